"""The engine: owns the target, the KV cache and the drafter, and runs the speculative cycle.

    rows -> requests -> scheduler slots -> prefill -> cycle* -> records
    cycle: propose -> verify -> accept -> commit -> extend
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .data import RowError, RowRequest
from .models.attention import AttnMetadata
from .models.config import generation_eos_ids
from .models.eagle3 import Eagle3Head
from .models.llama import CausalLM, fuse_projections
from .models.loader import load_target
from .models.mtp import MTPLayer
from .prompts import PromptError, encode_row, load_tokenizer
from .recipe import SamplingDefaults
from .request import Request, StopChecker
from .runtime.graphs import GraphRunner, capture_sizes
from .runtime.kv_cache import KVCache, compact_path, plan_max_len
from .sampling import BatchSampling, SamplingParams, sample
from .scheduler import SlotScheduler
from .spec.accept import Acceptance, accept
from .spec.drafter import Drafter, Proposal
from .spec.factory import SpecConfig, make_drafter
from .spec.simulate import simulate_acceptance
from .stats import error_record, spec_stats

Slotted = list[tuple[int, Request]]
_GREEDY = (True, False)       # graph variant: (all rows greedy, some row filters top-k / top-p)


@dataclass
class EngineOptions:
    batch_size: int = 64
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str | None = None            # None: cuda when available, else cpu
    bucket_window: int = 0               # > 0: admit similar prompt lengths together
    prefill_tokens: int = 8192           # padded tokens per prefill forward
    spec: SpecConfig = SpecConfig()      # the drafter (vanilla: none)
    graphs: bool = True                  # CUDA graphs for the cycle on CUDA (False: --eager)
    fused: bool | None = None            # the cycle as ONE graph (None: the recipe's choice, naive_2token)
    profile: bool = False                # record per-cycle stage timings (cycle_times)
    simulate_acceptance: tuple[float, ...] | None = None   # bench only: per-position acceptance


@dataclass
class CycleTime:
    batch: int                 # active rows
    draft_ms: float
    verify_ms: float           # verify + accept + commit (the whole cycle when fused in one graph)
    extend_ms: float
    wall_ms: float             # the whole cycle on the host clock, host bookkeeping included
    tokens: int                # tokens emitted


@dataclass
class Batch:
    """One cycle's inputs and the tensors its stages hand on to each other. Eager: built per
    cycle with the active rows. Graphs: static buffers of a captured size, pad rows on the dummy
    slot, and every attribute below is the same memory at each replay."""
    slots: torch.Tensor                      # [B]
    sp: BatchSampling
    kv_bound: int                            # >= every committed length (cache rows attention may read)
    lens: torch.Tensor | None = None         # [B] committed lengths at the start of the cycle
    prop: Proposal | None = None
    acc: Acceptance | None = None
    captured: list[torch.Tensor] | None = None   # target states the drafter reads
    out: torch.Tensor | None = None          # [B, D + 2]: emitted tokens, then their count


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
            self.model, _ = load_target(model_dir, opts.dtype, self.device)
            self.tokenizer = load_tokenizer(model_dir)
            eos = generation_eos_ids(model_dir) or self.model.cfg.eos_token_ids
        else:
            self.model, self.device, self.tokenizer = model, model.lm_head.weight.device, tokenizer
            eos = model.cfg.eos_token_ids
        fuse_projections(self.model)
        self.cfg = self.model.cfg
        self.dtype = self.model.lm_head.weight.dtype
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_ids = set(eos)
        self.num_slots = opts.batch_size
        width = drafter.num_draft_tokens if drafter else opts.spec.width
        self.max_len = plan_max_len(self.cfg, self.num_slots, self.dtype, self.device,
                                    opts.max_model_len, headroom=width)
        # Verify writes up to N-1 rows past the committed length: that headroom is allocated too.
        self.cache = KVCache(self.cfg, self.num_slots, self.max_len + width, self.dtype, self.device)
        self.drafter = drafter or make_drafter(opts.spec, self.model, self.num_slots, self.max_len,
                                               head=draft_head, target_dir=model_dir)
        self.stops = StopChecker(self.tokenizer, self.eos_ids)
        # Per slot (the last one is the dummy slot of pad rows): committed cache rows, and the
        # last emitted token (not yet in the cache), on the device; the host mirrors the lengths.
        self.lens = torch.zeros(self.num_slots + 1, dtype=torch.int64, device=self.device)
        self.last = torch.zeros(self.num_slots + 1, dtype=torch.int64, device=self.device)
        self.seq_lens = [0] * (self.num_slots + 1)
        self.simulate = None
        if opts.simulate_acceptance is not None:
            p = list(opts.simulate_acceptance)[: self.drafter.max_depth]
            p += [0.0] * (self.drafter.max_depth - len(p))
            self.simulate = torch.tensor(p, dtype=torch.float32, device=self.device)
        self.tokens_emitted = 0
        self.target_forwards = 0                        # batched target forward calls
        self.cycle_times: list[CycleTime] = []
        self.graphs: GraphRunner | None = None
        self.fused = opts.spec.fused if opts.fused is None else opts.fused
        if opts.graphs and self.device.type == "cuda" and self.drafter.graphable:
            # Fused: propose, verify + accept + commit and the draft extend in one replay (no
            # host work separates them); otherwise one graph each, so profiles split the cycle.
            stages = [self._propose, self._verify, self._extend]
            groups = [stages] if self.fused else [[s] for s in stages]
            self.graphs = GraphRunner(self._static_batch, groups, capture_sizes(self.num_slots))
            with torch.inference_mode():
                self.graphs.capture_all(_GREEDY)

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs else 0.0

    # ---- rows -> requests -------------------------------------------------------------------

    def make_request(self, item: RowRequest | RowError, defaults: SamplingDefaults) -> Request | dict:
        """A Request ready to schedule, or an error record for a row that cannot run."""
        if isinstance(item, RowError):
            return error_record(item.row, item.id, item.error, item.keep)
        # Whatever goes wrong with one row is that row's error record, never the job's end.
        where = item.where or f"row {item.row}"
        try:
            ids = encode_row(self.tokenizer, item, self.cfg.vocab_size, max_tokens_allowed=self.max_len)
        except PromptError as e:
            return error_record(item.row, item.id, str(e), item.keep)
        except Exception as e:
            from .prompts import exception_line

            return error_record(item.row, item.id, f"{where}: cannot tokenize the prompt ({exception_line(e)})",
                                item.keep)
        if len(ids) >= self.max_len:
            return error_record(item.row, item.id,
                                f"{where}: prompt has {len(ids)} tokens but the context per slot is "
                                f"{self.max_len} (set --max-model-len or lower --batch-size)",
                                item.keep, prompt_tokens=len(ids))
        try:
            params = _params(defaults, item.overrides, item.row)
        except Exception as e:
            from .prompts import exception_line

            return error_record(item.row, item.id, f"{where}: invalid sampling parameters ({exception_line(e)})",
                                item.keep, prompt_tokens=len(ids))
        return Request(row=item.row, id=item.id, prompt_ids=ids, params=params,
                       max_new=min(params.max_tokens, self.max_len - len(ids)), keep=item.keep)

    def record(self, req: Request) -> dict[str, Any]:
        return {
            "row": req.row, "id": req.id, "completion": self.stops.completion_text(req),
            "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
            "finish_reason": req.finish_reason, "error": None, "spec": spec_stats(req),
            "output_token_ids": list(req.output_ids), **req.keep,
        }

    # ---- the job loop -----------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, items: Iterable[RowRequest | RowError],
                 defaults: SamplingDefaults = SamplingDefaults()) -> Iterator[dict[str, Any]]:
        """Yield one record per input row, in completion order, streaming the input."""
        sched: SlotScheduler[Request] = SlotScheduler(self.num_slots, bucket_window=self.opts.bucket_window)
        source = iter(items)
        lookahead = max(2 * self.num_slots, self.opts.bucket_window)
        exhausted = False
        while True:
            while not exhausted and sched.queued() < lookahead:
                item = next(source, None)
                if item is None:
                    exhausted = True
                    break
                req = self.make_request(item, defaults)
                if isinstance(req, dict):
                    yield req
                else:
                    sched.add(req)
            admitted = sched.admit()
            if admitted:
                yield from self._release(sched, self._prefill(admitted))
            active = sched.active()
            if not active:
                if exhausted and sched.queued() == 0:
                    return
                continue
            yield from self._release(sched, self.cycle(active))

    def _release(self, sched: SlotScheduler, finished: Slotted) -> Iterator[dict[str, Any]]:
        for slot, req in finished:
            sched.release(slot)
            yield self.record(req)

    # ---- prefill ------------------------------------------------------------------------------

    def _prefill(self, admitted: Slotted) -> Slotted:
        finished: Slotted = []
        for group in _prefill_groups(admitted, self.opts.prefill_tokens):
            lens = [len(r.prompt_ids) for _, r in group]
            B, T = len(group), max(lens)
            ids = torch.zeros(B, T, dtype=torch.int64)
            for i, (_, r) in enumerate(group):
                ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
            ids = ids.to(self.device)
            slots = self._tensor([s for s, _ in group])
            lengths = self._tensor(lens)
            meta = AttnMetadata(slots=slots, positions=torch.arange(T, device=self.device).expand(B, T),
                                prefix_lens=torch.zeros_like(slots), kv_len=T)
            hidden, captured = self._target(ids, meta)
            self.target_forwards += 1
            last = hidden[torch.arange(B, device=self.device), lengths - 1]          # [B, H]
            sp = BatchSampling.build([r.params for _, r in group], self.device)
            first = sample(self.model.logits(last), sp, lengths)
            self.drafter.prefill(slots, ids, lengths, captured, first)
            self.lens[slots], self.last[slots] = lengths, first
            for (slot, req), tok, n in zip(group, first.tolist(), lens):
                self.seq_lens[slot] = n
                req.histogram = [0] * (self.drafter.max_depth + 1)
                req.verify_steps = 1                 # the prefill: a forward that verified no drafts
                self.tokens_emitted += self.stops.append(req, [tok])
                if req.finished:
                    finished.append((slot, req))
        return finished

    # ---- the speculative cycle ----------------------------------------------------------------

    def cycle(self, active: Slotted) -> Slotted:
        """One propose -> verify -> accept -> commit -> extend step over the active slots.

        The device half is three stages (below), run eagerly or replayed as CUDA graphs; the
        one host synchronisation is the copy of the emitted tokens and their counts.
        """
        t0 = time.perf_counter()
        b, stages = self._stages(active)
        marks = []
        for stage in stages:
            marks.append(self._mark())
            stage()
        marks.append(self._mark())
        out = b.out[: len(active)].tolist()                          # the host copy of the results

        # commit on the host: stop checks, stats; device lengths and KV were committed in _verify
        finished: Slotted = []
        emitted = 0
        N = b.prop.width
        for (slot, req), row in zip(active, out):
            n = row[-1]
            self.seq_lens[slot] += n
            emitted += self.stops.append(req, row[:n])
            req.verify_steps += 1
            req.draft_tokens += N - 1
            req.accepted_tokens += n - 1
            req.histogram[n - 1] += 1
            if req.finished:
                finished.append((slot, req))
        self.tokens_emitted += emitted
        self.target_forwards += 1
        if self.opts.profile:
            self._record_time(len(active), marks, t0, emitted)
        return finished

    def _stages(self, active: Slotted) -> tuple[Batch, list]:
        """The batch of this cycle and its stages as callables: graph replays, or eager calls."""
        slots = [s for s, _ in active]
        params = [r.params for _, r in active]
        greedy = all(p.greedy for p in params)
        if self.graphs is not None:
            variant = _GREEDY if greedy else (False, any(p.top_k > 0 or p.top_p < 1.0 for p in params))
            cap = self.graphs.get(len(active), variant)
            layout = tuple((s, id(r)) for s, r in active)
            if cap.layout != layout:
                self._fill(cap.batch, slots, params)
                cap.layout = layout
            return cap.batch, [g.replay for g in cap.graphs]
        b = Batch(slots=self._tensor(slots), sp=BatchSampling.build(params, self.device),
                  kv_bound=max(self.seq_lens[s] for s in slots))
        return b, [lambda: self._propose(b), lambda: self._verify(b), lambda: self._extend(b)]

    # Device stages: tensor work only, no host synchronisation (they are captured in graphs).

    def _propose(self, b: Batch) -> None:
        """A tree of N nodes per slot, the root being the last emitted token."""
        b.lens = self.lens[b.slots]
        b.prop = self.drafter.propose(b.slots, self.last[b.slots], b.lens, b.kv_bound)

    def _verify(self, b: Batch) -> None:
        """One target forward over every node (tree mask, positions = length + depth), the
        acceptance walk, and the device half of commit: the accepted path's K/V made contiguous
        (trees), lengths advanced, the last emitted token kept as the next root."""
        prop, lens = b.prop, b.lens
        meta = AttnMetadata(slots=b.slots, positions=lens[:, None] + prop.depths, prefix_lens=lens,
                            kv_len=b.kv_bound + prop.width, tree_mask=prop.tree_mask)
        hidden, b.captured = self._target(prop.tokens, meta)
        logits = self.model.lm_head(hidden)                                      # [B, N, V]
        if self.simulate is None:
            acc = accept(prop.tokens, prop.parents, logits, b.sp, lens, self.drafter.max_depth)
        else:
            acc = simulate_acceptance(prop, logits.argmax(dim=-1), self.simulate, self.drafter.max_depth)
        if prop.tree_mask is not None:
            compact_path(self.cache.data, b.slots, lens, acc.path, acc.num)
        self.lens[b.slots] = lens + acc.num
        self.last[b.slots] = acc.tokens.gather(1, (acc.num - 1)[:, None])[:, 0]
        self.lens[self.cache.dummy_slot:].zero_()       # pad rows all advanced the dummy slot
        b.acc = acc
        b.out = torch.cat([acc.tokens, acc.num[:, None]], dim=1)

    def _target(self, ids: torch.Tensor, meta: AttnMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target forward: (final-normed hidden, the states the drafter reads)."""
        hidden, captured = self.model(ids, meta, self.cache.layers, self.drafter.capture_layers)
        return hidden, [hidden] if self.drafter.reads_final_hidden else captured

    def _extend(self, b: Batch) -> None:
        """The drafter catches up on the accepted tokens with the target's states."""
        self.drafter.extend(b.slots, b.lens, b.acc, b.captured, b.kv_bound)

    # ---- graph buffers and timing ---------------------------------------------------------------

    def _static_batch(self, size: int, variant: tuple[bool, bool]) -> Batch:
        greedy, any_filter = variant
        pad = [SamplingParams()] * size
        b = Batch(slots=torch.full((size,), self.cache.dummy_slot, dtype=torch.int64, device=self.device),
                  sp=BatchSampling.build(pad, self.device), kv_bound=self.max_len)
        b.sp.all_greedy, b.sp.any_filter = greedy, any_filter
        return b

    def _fill(self, b: Batch, slots: list[int], params: list[SamplingParams]) -> None:
        """Lay the active rows out in a captured batch's buffers; the rest become pad rows."""
        pad = b.slots.shape[0] - len(slots)
        src = BatchSampling.build(params + [SamplingParams()] * pad, torch.device("cpu"))
        b.slots.copy_(torch.tensor(slots + [self.cache.dummy_slot] * pad))
        for name in ("temperature", "top_k", "top_p", "seed_lo", "seed_hi"):
            getattr(b.sp, name).copy_(getattr(src, name))

    def _mark(self):
        if not self.opts.profile:
            return None
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _record_time(self, rows: int, marks: list, t0: float, tokens: int) -> None:
        if self.device.type == "cuda":
            marks[-1].synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        if len(ms) == 1:                     # one fused graph: all of it counts as verify
            ms = [0.0, ms[0], 0.0]
        self.cycle_times.append(CycleTime(batch=rows, draft_ms=ms[0], verify_ms=ms[1], extend_ms=ms[2],
                                          wall_ms=(time.perf_counter() - t0) * 1e3, tokens=tokens))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _params(d: SamplingDefaults, o: dict[str, Any], row: int) -> SamplingParams:
    seed = o.get("seed")
    if seed is None:
        # From the run seed (--seed, default 0) and the row: reruns and resumes draw the same tokens.
        run_seed = d.seed or 0
        seed = ((run_seed * 0x9E3779B97F4A7C15) ^ (row * 0xBF58476D1CE4E5B9)) % (1 << 64)
    temperature = float(o.get("temperature", d.temperature))
    if temperature < 1e-5:
        # Greedy, as vLLM does below its _SAMPLING_EPS: dividing logits by a tiny temperature
        # overflows (1e-40 emitted only EOS) or acts greedy anyway. Every temperature (row
        # overrides, recipe, CLI) passes here.
        temperature = 0.0
    return SamplingParams(
        max_tokens=o.get("max_tokens", d.max_tokens),
        temperature=temperature,
        top_p=float(o.get("top_p", d.top_p)),
        top_k=min(int(o.get("top_k", d.top_k)), 2**31 - 1),   # >= the vocabulary: no filter either way
        seed=int(seed),
        stop=tuple(o.get("stop", d.stop)),
        stop_token_ids=tuple(o.get("stop_token_ids", d.stop_token_ids)),
        ignore_eos=bool(o.get("ignore_eos", d.ignore_eos)),
    )


def _prefill_groups(admitted: Slotted, budget: int) -> list[Slotted]:
    """Split by prompt length so each padded prefill forward stays within `budget` tokens."""
    groups: list[Slotted] = []
    for item in sorted(admitted, key=lambda sr: len(sr[1].prompt_ids)):
        if groups and len(item[1].prompt_ids) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups
