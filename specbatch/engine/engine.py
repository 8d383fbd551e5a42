"""The engine: owns the target, the paged KV pool and the drafter; turns rows into requests,
admits them in waves, prefills them, runs the cycle (cycle.py) and turns requests into records.

    rows -> requests -> admission (slots and pages) -> prefill -> cycle* -> records
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from .cycle import Launched, SlotState, Slotted, SpecCycle, exact_acceptance
from .failures import (IDLE, DeviceFailed, FailedAlone, FailureCounts, failed_alone, survivable, touched, vouched,
                       warn_failure)
from .rows import RowConverter
from .pool import module_bytes, plan_pool
from .prefill import Prefiller
from .profile import CycleTime
from ..data import RowError, RowRequest
from ..models.attention import AttnMetadata
from ..models.config import ModelError, generation_sampling_defaults, model_eos_ids
from ..models.eagle3 import Eagle3Head
from ..models.llama import CausalLM, fuse_projections
from ..models.loader import load_target
from ..models.mtp import MTPLayer
from ..prompts import exception_line, load_tokenizer
from ..records import OUTPUT_FAILED, error_record
from ..request import Request, StopChecker
from ..runtime.kv_cache import PagedKVCache
from ..runtime.pages import Grant, PageAllocator
from ..params import DEFAULT_LOGPROBS_MODE, SamplingParams, check_logprobs_mode
from ..scheduler import SlotScheduler
from ..speculative.drafter import Drafter
from ..speculative.factory import SpecConfig, load_draft_module, make_drafter

# A source may yield WAIT: "no row ready now, more may come" (a worker fed over a queue); the
# engine decodes what it has and asks again. None still means the input ended.
WAIT = object()
Inputs = dict[int, tuple[RowRequest, list[Request]]]     # row -> its input and its requests, while they run


@dataclass
class EngineOptions:
    batch_size: int | None = None        # slots: sequences in flight (None: from memory)
    max_model_len: int | None = None     # context per request (None: the model's, capped by the pool)
    gpu_memory_utilization: float | None = None   # share of the GPU's whole memory (None: 90% of the free)
    dtype: str = "auto"
    device: str | None = None            # None: cuda when available, else cpu
    bucket_window: int = 0               # > 0: admit similar prompt lengths together
    longest_first: bool = True           # admit the largest max_tokens of the lookahead first (a short tail)
    prefill_tokens: int = 8192           # prompt tokens per prefill forward (prefill.py: packed, no padding)
    wave: float = 0.125                  # admit when this share of the slots is free (or nothing runs)
    page_size: int | None = None         # KV rows per page (None: 64 on GPU, 16 on CPU)
    kv_rows: int | None = None           # KV pool capacity in rows (None: what memory allows)
    spec: SpecConfig = SpecConfig()      # the drafter (vanilla: none)
    graphs: bool = True                  # CUDA graphs for the cycle and small prefills on CUDA (False: --eager)
    time_graph_sizes: bool = True        # a batch replays the fastest captured size that holds it (graphs.py)
    fused: bool | None = None            # the cycle as ONE graph (None: the recipe's choice, naive_2token)
    profile: bool = False                # record per-cycle stage timings and prefill time
    adaptive: bool | None = None         # cycles verify the proposal prefix that pays best
                                         # (adaptive.py; None: on CUDA; off: every cycle verifies it all)
    simulate_acceptance: tuple[float, ...] | None = None   # bench only: per-position acceptance
    overlap: bool = True                 # launch cycle k + 1 before the host commits cycle k
    prefix_caching: bool = True          # share the K/V pages of prompts that begin alike
    reserve_max_tokens: bool = False     # admission reserves prompt + max_tokens up front, never preempts
                                         # (default: pages as rows write, the request admitted last
                                         # preempted when the pool runs short: runtime/pages.py)
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE   # what logprobs hold (engine/logprobs.py; vLLM's modes)


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import re

    shown = name if name.isprintable() and name.strip() == name and name else repr(name)
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", name):
        raise ValueError(f"--device {shown}: expected cpu, cuda or cuda:N")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {shown}: no CUDA device is available (use --device cpu)")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {shown}: this machine has {count} CUDA device"
                             f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return dev


class Engine:
    def __init__(self, model_dir: str | Path | None, opts: EngineOptions | None = None,
                 drafter: Drafter | None = None, *, model: CausalLM | None = None,
                 tokenizer: Any = None, draft_head: Eagle3Head | MTPLayer | None = None):
        """`drafter` replaces the one `opts.spec` describes (tests plug in their own); `model`
        and `tokenizer` replace loading from `model_dir` (bench: random weights), `draft_head`
        replaces loading `opts.spec.draft`."""
        self.opts = opts = opts or EngineOptions()
        if model is None:
            self.device = resolve_device(opts.device)
            self._on_device()
            self.model, _ = load_target(model_dir, opts.dtype, self.device)
            self.tokenizer = load_tokenizer(model_dir)
            eos = model_eos_ids(model_dir, self.model.cfg)
            # sampling values the model's generation_config.json sets: for rows, flags and recipes that set none
            self.model_defaults = generation_sampling_defaults(model_dir)
        else:
            self.model, self.device, self.tokenizer = model, model.lm_head.weight.device, tokenizer
            eos = model.cfg.eos_token_ids
            self.model_defaults = {}
        self._on_device()
        fuse_projections(self.model)
        self.cfg = self.model.cfg
        self.dtype = self.model.lm_head.weight.dtype
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_ids = set(eos)

        # Rows a request writes past its committed length: verify's N - 1 and the draft's scratch,
        # plus depth - 1 for the cycle after its last: it finished on device with up to D drafts
        # past max_tokens committed, and rides in the next launched cycle once more (cycle.py).
        width = drafter.num_draft_tokens if drafter else opts.spec.width
        steps = drafter.max_depth if drafter else (opts.spec.num_steps or width - 1)
        depth = min(steps, width - 1)
        self.headroom = max(width, drafter.scratch_rows if drafter else opts.spec.scratch_rows) + max(0, depth - 1)
        window = self.cfg.sliding_window
        if window is not None and window <= self.headroom:
            # (the cycle's new rows must all sit inside the window: models/attention.py)
            raise ModelError(f"{model_dir or 'the model'}: sliding_window {window} is not wider than the "
                             f"{self.headroom} rows a cycle writes per sequence (the verify width and the draft's "
                             "rows); use a recipe that drafts fewer tokens (vanilla) or a model with a wider window")
        # rows a running request may write past its host-known length before the next growth: the
        # cycle in flight (width) and the next (headroom)
        self.ahead = width + self.headroom
        if drafter is None and draft_head is None:
            # the draft module's weights first, so that the pool leaves them room
            draft_head = load_draft_module(opts.spec, self.model, model_dir)
        held = 0            # what gpu_memory_utilization's share holds already: the weights
        if opts.gpu_memory_utilization is not None and self.device.type != "cuda":
            print(f"warning: gpu_memory_utilization {opts.gpu_memory_utilization} is a GPU's share; on the "
                  f"{self.device.type} the KV pool takes a quarter of the available memory (at most 8 GiB)",
                  file=sys.stderr, flush=True)
        elif opts.gpu_memory_utilization is not None:
            # counted by the tensors, not by the device's free memory, which other processes on the
            # same GPU (Ray actors sharing it, workers) move while this one loads
            held = module_bytes(self.model, draft_head, getattr(drafter, "head", None))
        plan = plan_pool(self.cfg, self.dtype, self.device, headroom=self.headroom,
                         drafting=drafter is not None or opts.spec.module is not None,
                         batch_size=opts.batch_size, max_model_len=opts.max_model_len, page_size=opts.page_size,
                         kv_rows=opts.kv_rows, prefill_tokens=opts.prefill_tokens, verify_nodes=width,
                         utilization=opts.gpu_memory_utilization, held=held)
        self.num_slots, self.max_len, self.page_size, self.num_pages = (
            plan.num_slots, plan.max_len, plan.page_size, plan.num_pages)
        # table columns for the longest request and its verify / draft headroom
        self.pages = PageAllocator(self.num_pages, self.page_size, self.num_slots,
                                   math.ceil((self.max_len + self.headroom) / self.page_size),
                                   self.device, dummy_rows=self.headroom)
        self.cache = PagedKVCache(self.cfg, self.pages.layout, self.dtype, self.device)
        self.drafter = drafter or make_drafter(opts.spec, self.model, self.num_slots, self.max_len,
                                               head=draft_head, target_dir=model_dir, layout=self.pages.layout)
        if opts.simulate_acceptance is not None:
            from ..speculative.simulate import PlantedChain

            self.drafter = PlantedChain(self.drafter)       # bench: trees reach the full draft depth
        self.stops = StopChecker(self.tokenizer, self.eos_ids, getattr(self.tokenizer, "eos_token_id", None))
        self.state = SlotState(self.num_slots, self.device)
        acceptor = exact_acceptance
        if opts.simulate_acceptance is not None:
            from ..speculative.simulate import simulated_acceptor

            acceptor = simulated_acceptor(opts.simulate_acceptance, self.drafter.max_depth, self.device)
        self.fused = opts.spec.fused if opts.fused is None else opts.fused
        self.cycle = SpecCycle(self.model, self.cache, self.drafter, self.state, self.stops, self._target,
                               acceptor=acceptor, max_len=self.max_len, graphs=opts.graphs,
                               fused=self.fused, profile=opts.profile, time_sizes=opts.time_graph_sizes,
                               adaptive=self.device.type == "cuda" if opts.adaptive is None else opts.adaptive,
                               logprobs_mode=check_logprobs_mode(opts.logprobs_mode))
        self.rows = RowConverter(self.tokenizer, self.cfg, self.max_len, self.stops, self.model_defaults)
        self.prefiller = Prefiller(self.model, self._target, self.drafter, self.state, self.stops,
                                   self.pages.layout.page_table, opts.prefill_tokens, max_len=self.max_len,
                                   graphs=opts.graphs, logprobs_mode=opts.logprobs_mode)
        self._prefill_clock: list = []       # (start, end) per prefill call when profiling: CUDA events / host clock
        self.prefill_calls = 0
        self.occupancy: list[int] = []       # active slots per cycle when profiling
        self.waited = 0                      # requests that waited for pages (at the head of the queue)
        self.preempted = 0                   # requests preempted at least once (resumed by recompute)
        self.preemptions = 0                 # ... and how many times
        self.recomputed_tokens = 0           # tokens prefilled again for resumed requests
        self._admissions = 0
        self._pressure = False               # a preemption since a request last finished: admit none
        self._grow_at = [math.inf] * self.num_slots   # per slot: the committed length that needs more pages
        # prefix caching: requests start from the pages of earlier prompts that began alike, when
        # the drafter's prompt state lives in those pages too; a continued prompt starts on a page
        self.prefix_caching = opts.prefix_caching and self.drafter.shares_prompt_pages
        self.pages.index.set_lookahead(self.drafter.prompt_page_lookahead)  # what a page's key holds past it
        self.pages.copies = self.drafter.copies_prompt_pages
        self.prompt_tokens = 0               # prompt tokens admitted
        self.cached_tokens = 0               # ... of them found in the pool (prefill skipped them)
        self.failure_counts = FailureCounts()  # failed steps survived (failures.py)
        self.live: tuple[SlotScheduler, Inputs] | None = None   # the running job's scheduler and rows

    @property
    def capture_seconds(self) -> float:
        return self.cycle.capture_seconds + self.prefiller.capture_seconds

    @property
    def graphs(self):
        return self.cycle.graphs

    @property
    def cycle_times(self) -> list[CycleTime]:
        return self.cycle.times

    @property
    def tokens_emitted(self) -> int:
        return self.cycle.tokens_emitted + self.prefiller.tokens_emitted

    def pool_facts(self) -> dict[str, int]:
        """The KV pool as planned: slots, pages, rows a page, and the rows requests may reserve;
        the prompt tokens admitted, and how many of them prefix caching found in the pool; the
        requests preempted when the pool ran short, the times, and the tokens prefilled again."""
        return {"slots": self.num_slots, "kv_pages": self.num_pages, "kv_page_rows": self.page_size,
                "kv_rows": self.pages.usable * self.page_size,
                "prompt_tokens_admitted": self.prompt_tokens, "prompt_tokens_cached": self.cached_tokens,
                "preempted": self.preempted, "preemptions": self.preemptions,
                "recomputed_tokens": self.recomputed_tokens}

    @property
    def prefill_forwards(self) -> int:
        return self.prefiller.forwards

    @property
    def target_forwards(self) -> int:
        """Batched target forward calls (prefills and cycles)."""
        return self.cycle.forwards + self.prefill_forwards

    @property
    def lens(self) -> torch.Tensor:
        return self.state.lens

    def _on_device(self) -> None:
        """Make this engine's GPU the current one: capture streams, Triton launches and the memory
        planner use the current device (per thread; another engine of the process may have moved it)."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _rows_needed(self, req: Request) -> int:
        """Every cache row the request can write: its prompt, max_tokens and the headroom."""
        return len(req.prompt_ids) + req.max_new + self.headroom

    def _rows_soon(self, req: Request, written: int) -> int:
        """Rows a request holds pages for when `written` rows are committed: the next cycles' and
        a page more (all of them with reserve_max_tokens)."""
        full = self._rows_needed(req)
        return full if self.opts.reserve_max_tokens else min(full, written + self.ahead + self.page_size)

    # ---- the job loop -----------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, items: Iterable[RowRequest | RowError], defaults: SamplingParams = SamplingParams(),
                 alone: Sequence[RowRequest | RowError] = (), vouch: bool = True) -> Iterator[Any]:
        """Yield one record per input row, in completion order, streaming the input.

        Admission comes in waves: once a share of the slots is free (or nothing runs, or the
        queue is that short), every queued request whose pages fit is admitted and prefilled in
        a few large forwards, rather than a forward for each slot that frees up. A failure in a
        prefill or a cycle costs only the row that causes it (failures.py). A caller that stops
        reading early leaves the engine as it found it, ready for the next call. `alone`: rows
        run one at a time (each a job of its own) before `items`, under the same record filter.
        `vouch=False`: a row that failed alone comes as its FailedAlone, and IDLE when a live feed
        idles, for a caller that holds them itself (the worker pool: failures.Vouching)."""
        runs = (self._run(part, defaults) for part in ([[r] for r in alone] + [items]))
        records = itertools.chain.from_iterable(runs)
        yield from (vouched(records) if vouch else records)

    def _run(self, items: Iterable[RowRequest | RowError], defaults: SamplingParams,
             recover: bool = True) -> Iterator[dict[str, Any] | FailedAlone]:
        sched: SlotScheduler[Request] = SlotScheduler(
            self.num_slots, bucket_window=self.opts.bucket_window,
            priority=(lambda r: r.max_new) if self.opts.longest_first else None)
        failed = False
        try:
            yield from self._job(sched, items, defaults, recover)
        except Exception:
            failed = True                        # a failed admission's grants: never assigned, indexed unwritten
            raise
        finally:
            if failed or sched.active():         # stopped midway: its requests' pages, some never written
                self.pages.reset()

    def rows_in_flight(self) -> list[int]:
        """The running job's rows with a request in a slot (or taken from the queue by the step
        running): what a step that never returns holds. Another thread may ask (a worker's beat):
        a best effort that may raise while the job changes them."""
        live = self.live
        return [] if live is None else touched(*live)

    def _job(self, sched: SlotScheduler, items: Iterable[RowRequest | RowError], defaults: SamplingParams,
             recover: bool) -> Iterator[dict[str, Any] | FailedAlone]:
        """The job loop of `generate`: read rows, then a step of the engine, then the records of
        what finished. `recover`: a failed step puts its rows aside and reruns them (_isolate)."""
        source = iter(items)
        self.cycle.new_job()
        lookahead = max(2 * self.num_slots, self.opts.bucket_window)
        exhausted = False
        pending = None                           # the cycle in flight (launched, not finished)
        inputs: Inputs = {}
        self.live = (sched, inputs)
        while True:
            self._on_device()
            while not exhausted and sched.queued() < lookahead:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                if item is WAIT:                 # a live feed with nothing ready yet (workers.py)
                    if not sched.active() and not sched.queued():
                        if pending is None:
                            yield IDLE           # generate writes the rows it holds
                        time.sleep(0.002)        # idle: nothing to decode until rows arrive
                    break
                req = self.rows.request(item, defaults)
                if isinstance(req, dict):
                    yield req
                else:
                    reqs = self.rows.choices(req)
                    inputs[item.row] = (item, reqs)
                    for r in reqs:
                        sched.add(r)
            done: list[Request] = []             # finished requests, their slots and pages freed
            try:
                pending = self._step(sched, pending, done)
            except Exception as e:
                if not survivable(e, self.device):
                    if isinstance(e, DeviceFailed):
                        raise
                    raise DeviceFailed([inputs[row][0] for row in touched(sched, inputs)], e,
                                       self.device) from e
                if not recover:
                    raise
                pending = None
                yield from self._records(done, inputs)      # what finished before the failure stands
                yield from self._isolate(self._put_aside(sched, inputs, e), defaults)
                continue
            yield from self._records(done, inputs)
            if pending is None and not sched.active() and exhausted and not sched.queued():
                return

    def _step(self, sched: SlotScheduler, pending: Launched | None, done: list[Request]) -> Launched | None:
        """Admit and prefill a wave when one is due, launch a cycle over the active slots and
        finish the one launched before (cycle k + 1 goes to the GPU before the host commits
        cycle k); adds the requests that finished to `done` (their slots and pages freed) and
        returns the cycle now in flight."""
        active = sched.active()
        wave = max(1, math.ceil(self.opts.wave * self.num_slots))
        if sched.queued() and (not active or (not self._pressure and
                                              self.num_slots - len(active) >= min(wave, sched.queued()))):
            admitted = self._admit(sched)
            if admitted:
                done += self._free(sched, self._prefill(admitted))
        pending = self._grow(sched, pending, done)
        active = sched.active()
        if not active:
            if pending is not None:              # only rows that had finished rode in it
                done += self._free(sched, self.cycle.finish(pending))
            return None
        if self.opts.profile:
            self.occupancy.append(len(active))
        launched = self.cycle.launch(active)
        if pending is not None:
            done += self._free(sched, self.cycle.finish(pending))
        if not self.opts.overlap:
            done += self._free(sched, self.cycle.finish(launched))
            launched = None
        return launched

    def _grow(self, sched: SlotScheduler, pending: Launched | None, done: list[Request]) -> Launched | None:
        """Pages for the next cycles of every running request. When the pool runs short, the cycle
        in flight is finished first (exact lengths; its finished requests' pages back), then the
        requests admitted last are preempted until the earlier ones fit; returns the cycle still
        in flight."""
        if self.opts.reserve_max_tokens:
            return pending
        lens, at = self.state.seq_lens, self._grow_at
        short = [(s, r) for s, r in sched.active() if lens[s] >= at[s]]
        if all(self._grown(s, r, self._rows_soon(r, lens[s])) for s, r in sorted(short, key=_admission)):
            self.pages.write_grown()
            return pending
        if pending is not None:
            done += self._free(sched, self.cycle.finish(pending))
        order = sorted(sched.active(), key=_admission)
        i = 0
        while i < len(order):
            slot, req = order[i]
            while not self._grown(slot, req, min(self._rows_needed(req), lens[slot] + self.ahead)):
                victim_slot, victim = order.pop()          # the request admitted last
                self._preempt(sched, victim_slot, victim)
                if victim is req:
                    break
            else:
                i += 1
        self.pages.write_grown()
        return None

    def _grown(self, slot: int, req: Request, rows: int) -> bool:
        """Grow the slot's pages to `rows` (False: not free); then note the length at which it
        needs more (never, once it holds every row it can write)."""
        if not self.pages.grow(slot, rows):
            return False
        held = self.pages.rows_held(slot)
        self._grow_at[slot] = math.inf if held >= self._rows_needed(req) else held - self.ahead + 1
        return True

    def _preempt(self, sched: SlotScheduler, slot: int, req: Request) -> None:
        """Take a running request's slot and pages back; it waits at the front of the queue and
        resumes by recompute (a prefill of its prompt and the tokens it generated)."""
        sched.release(slot)
        self.pages.release(slot)
        self.preempted += not req.preempted
        req.preempted += 1
        self.preemptions += 1
        self._pressure = True
        sched.requeue(req)

    def _put_aside(self, sched: SlotScheduler, inputs: Inputs, e: Exception) -> list[RowRequest]:
        """After a failed step: the inputs of the rows it touched (in flight, or taken from the
        queue when it failed), every slot and page freed; a row's choices still queued leave the
        queue with it, rows wholly queued stay."""
        rows = touched(sched, inputs)
        sched.clear_active()
        gone = set(rows)
        sched.drop(lambda r: r.row in gone)
        self.pages.reset()
        if not self._isolating:                  # once per failure, not once per half rerun
            warn_failure(e, len(rows))
            self.failure_counts.failures += 1
            self.failure_counts.rows_rerun += len(rows)
        return [inputs.pop(row)[0] for row in rows]

    def _isolate(self, items: list[RowRequest], defaults: SamplingParams) -> Iterator[dict[str, Any] | FailedAlone]:
        """Rows that were in flight when a step failed, rerun: a group in halves, each half a job
        of its own (which puts aside and halves again when it fails), a row alone for good."""
        self._isolating += 1
        try:
            if len(items) > 1:
                half = (len(items) + 1) // 2
                for part in (items[:half], items[half:]):
                    yield from self._run(part, defaults)
                return
            try:
                yield from self._run(items, defaults, recover=False)
            except DeviceFailed:
                raise
            except Exception as e:               # _job found it survivable (else: DeviceFailed)
                self.failure_counts.failed_alone += 1
                yield failed_alone(items[0], e)
        finally:
            self._isolating -= 1

    _isolating = 0                               # _isolate calls under way

    def _admit(self, sched: SlotScheduler) -> Slotted:
        """Queued requests into free slots, in order, while their pages fit (granted here, in
        the order prefill packs them: a page a request finds indexed is written by then, by an
        earlier forward or earlier rows of the same one)."""
        grants: dict[int, Grant] = {}
        self.pages.new_wave()
        # Pages the running requests may still take (every row they can write), and how many may grow
        owed = [self.pages.pages_for(self._rows_needed(r)) - self.pages.rows_held(s) // self.page_size
                for s, r in sched.active()]
        debt, growing = [sum(owed)], [sum(1 for n in owed if n > 0)]

        def fits(req: Request) -> bool:
            context = req.context_ids
            prompt = context if self.prefix_caching else None
            # prompt logprobs need every prompt position's logits (one choice computes them; a
            # resumed request has them)
            reuse = req.params.prompt_logprobs is None or req.choice > 0 or bool(req.output_ids)
            rows = self._rows_soon(req, len(context))
            owes = self.pages.pages_for(self._rows_needed(req)) - self.pages.pages_for(rows)
            # Where the pool cannot hold every row all of them may write, a page stays free for each
            # request that may grow (its next growth): fewer preemptions
            certain = self.pages.free_pages >= self.pages.pages_for(rows) + debt[0] + owes
            spare = 0 if certain else growing[0] + (owes > 0)
            g = self.pages.grant(rows, prompt, reuse=reuse, spare=spare)
            if g is None:
                if not req.waited_for_pages:     # count rows, not the admission attempts they sat through
                    req.waited_for_pages = True
                    self.waited += 1
                return False
            if g.copy is not None:          # now, in grant order: a later grant may take its source
                self.cache.copy_page(*g.copy)
                self.drafter.copy_page(*g.copy)
            grants[id(req)] = g
            debt[0] += owes
            growing[0] += owes > 0
            return True

        admitted = sched.admit(fits=fits)
        self.pages.assign([(slot, grants[id(req)]) for slot, req in admitted])
        for slot, req in admitted:
            self._grown(slot, req, 0)
            req.cached_rows = grants[id(req)].cached_rows
            self._admissions += 1
            req.admitted_at = self._admissions
            if req.output_ids:                   # resumed: its prompt and output computed again
                self.recomputed_tokens += req.context_len - req.cached_rows
            else:
                self.prompt_tokens += len(req.prompt_ids)
                self.cached_tokens += req.cached_rows
        return admitted

    def _free(self, sched: SlotScheduler, finished: Slotted) -> list[Request]:
        if finished:
            self._pressure = False               # pages came back: admission may go on
        for slot, _ in finished:
            sched.release(slot)
            self.pages.release(slot)
        return [req for _, req in finished]

    def _records(self, done: list[Request], inputs: Inputs) -> Iterator[dict[str, Any]]:
        """A record per finished row (a row of n choices when its last one finishes); a row put
        aside after a failure reruns whole, its finished choices dropped."""
        for req in done:
            if req.row not in inputs:
                continue
            group = req.group
            if group is not None:
                group.done += 1
                if group.done < len(group.reqs):
                    continue
            item = inputs.pop(req.row)[0]
            try:
                rec = self.rows.record(req) if group is None else self.rows.group_record(group)
            except Exception as e:  # noqa: BLE001 - building one row's output fails that row alone
                rec = error_record(item.row, item.id, f"{item.place}: {OUTPUT_FAILED} ({exception_line(e)})",
                                   item.keep, prompt_tokens=len(req.prompt_ids), batch_line=item.batch_line)
            yield rec

    # ---- prefill ------------------------------------------------------------------------------

    def _prefill(self, admitted: Slotted) -> Slotted:
        """Packed prefill forwards (prefill.py), timed when profiling (GPU time: no host wait)."""
        self.prefill_calls += 1
        if not self.opts.profile:
            return self.prefiller(admitted)
        start = self.cycle.now()
        finished = self.prefiller(admitted)
        self._prefill_clock.append((start, self.cycle.now()))
        return finished

    @property
    def prefill_call_s(self) -> list[float]:
        """Seconds each prefill call's forwards took (profiling): GPU time on CUDA."""
        return [self.cycle.elapsed(pair) for pair in self._prefill_clock]

    @property
    def prefill_s(self) -> float:
        return sum(self.prefill_call_s)

    def reset_profile(self) -> None:
        self._prefill_clock.clear()
        self.cycle_times.clear()
        self.occupancy.clear()
        self.waited = self.prefill_calls = self.prompt_tokens = self.cached_tokens = 0
        self.preempted = self.preemptions = self.recomputed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every prompt page no request holds (a benchmark's next run starts cold)."""
        self.pages.drop_idle()

    def _target(self, ids: torch.Tensor, meta: AttnMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target forward: (final-normed hidden, the states the drafter reads)."""
        hidden, captured = self.model(ids, meta, self.cache.layers, self.drafter.capture_layers)
        return hidden, [hidden] if self.drafter.reads_final_hidden else captured


def _admission(pair: tuple[int, Request]) -> int:
    return pair[1].admitted_at
