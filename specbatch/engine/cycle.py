"""The speculative cycle, top to bottom: propose -> verify -> accept -> commit -> extend.

    launch(active), later finish(launched):
        propose   the drafter builds a tree of N nodes per slot, the root the last emitted token
        verify    one target forward over every node (tree mask, positions = length + depth)
        accept    walk the tree with the target's distribution -> emitted tokens, accepted path
        commit    device: the path's K/V made contiguous, lengths and roots advanced;
                  host: tokens appended token by token (stops), per-request stats
        extend    the drafter catches up on the accepted tokens with the target's states

The device half is three stages (propose; verify + accept + device commit; extend), run eagerly
or replayed as CUDA graphs; the one host synchronisation is the copy of the emitted tokens and
their counts (and, when a row asked for them, their logprobs), waited for in `finish` while the
next cycle runs (host commit in the next launched cycle's shadow). Rows become requests and requests
become records elsewhere (engine.py).

Logits processors (min_tokens, logit_bias, penalties: processors.py) act in verify on every tree
node with the state that node's path implies, before the acceptance walk; batches that use them
(or logprobs) run their own graph variants, so batches that do not keep today's graphs.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..models.attention import AttnMetadata
from ..host import to_device
from ..params import DEFAULT_LOGPROBS_MODE, LOGPROBS_MAX
from ..prompts import exception_line
from ..processors import Processors, count_tokens, processors_key
from ..request import Request, StopChecker
from .adaptive import WidthPolicy
from .failures import out_of_memory
from .logprobs import add_logprobs, emitted_logprobs
from .graphs import GraphRunner, capture_sizes, padded_size
from .profile import CycleTime, StageTimer
from ..runtime.kv_cache import compact_path
from ..sampling import BatchSampling, SamplingParams, host_flags
from ..speculative.accept import Acceptance, accept
from ..speculative.drafter import Drafter, Proposal, takes_width

Slotted = list[tuple[int, Request]]
# (tokens [B, N], parents [B, N], logits [B, N, V], sampling, lengths [B], max depth) -> Acceptance
Acceptor = Callable[[Proposal, torch.Tensor, BatchSampling, torch.Tensor, int], Acceptance]


class Variant(NamedTuple):
    """What a batch's rows ask of the device stages (a graph variant: each captures its own); the
    first four are sampling.host_flags."""
    greedy: bool                             # all rows greedy
    any_filter: bool                         # some row filters (min-p / top-k / top-p)
    any_top_k: bool                          # some row uses top-k
    any_min_p: bool                          # some row uses min-p
    processors: tuple[int, int, bool] | None   # processors.processors_key (None: no row uses them)
    logprobs: int | None                     # logprobs width (None: none asked)


_GREEDY = Variant(True, False, False, False, None, None)


def exact_acceptance(prop: Proposal, logits: torch.Tensor, sp: BatchSampling, lens: torch.Tensor,
                     max_depth: int) -> Acceptance:
    """The lossless acceptance walk (spec/accept.py): what every run uses."""
    return accept(prop.tokens, prop.parents, logits, sp, lens, max_depth, prop.depths)


@dataclass
class Batch:
    """One cycle's inputs and the tensors its stages hand on to each other. Eager: built per
    cycle with the active rows. Graphs: static buffers of a captured size, pad rows on the dummy
    slot, and every attribute below is the same memory at each replay."""
    slots: torch.Tensor                      # [B]
    sp: BatchSampling
    kv_bound: int                            # >= every committed length (cache rows attention may read)
    width: int = 0                           # nodes verified: a prefix of the proposal (adaptive.py)
    lens: torch.Tensor | None = None         # [B] committed lengths at the start of the cycle
    prop: Proposal | None = None
    acc: Acceptance | None = None
    captured: list[torch.Tensor] | None = None   # target states the drafter reads
    out: torch.Tensor | None = None          # [B, D + 2]: emitted tokens, then their count
    proc: Processors | None = None           # logits processors (None: no row uses one)
    lp_k: int | None = None                  # logprobs: alternatives per token (None: no row asked)
    lp_out: torch.Tensor | None = None       # [B, D + 1, 2 + lp_k]: each emitted token's logprob and rank, the top ones'
    lp_ids: torch.Tensor | None = None       # [B, D + 1, lp_k]: the top alternatives' ids


@dataclass
class Launched:
    """A cycle enqueued on the device (SpecCycle.launch), its results on their way to the host."""
    active: Slotted
    width: int
    bucket: int
    host: list[torch.Tensor]                 # emitted tokens + counts [B, D + 2] (+ logprobs, top ids)
    ready: object                            # CUDA event after the host copies (None on CPU)
    marks: list                              # stage timer marks (profiling)
    clock: list                              # the policy's clock around the device stages
    t0: float                                # host clock at launch
    context: int                             # committed rows of the active rows at launch (profiling)


class SlotState:
    """Per slot (the last one is the dummy slot of pad rows): committed cache rows and the last
    emitted token (not yet in the cache), on the device; the host mirrors the lengths."""

    def __init__(self, num_slots: int, device: torch.device):
        self.lens = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.last = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.seq_lens = [0] * (num_slots + 1)
        self.dummy = num_slots
        # Penalty state (processors.py), allocated when the first request with a penalty comes:
        # 4 + 1 bytes per vocabulary entry per slot.
        self.counts: torch.Tensor | None = None         # [slots + 1, V] int32: generated token counts
        self.prompt_mask: torch.Tensor | None = None    # [slots + 1, V] bool: the prompt's tokens

    def penalty_state(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.counts is None:
            n = self.lens.shape[0]
            self.counts = torch.zeros(n, vocab, dtype=torch.int32, device=self.lens.device)
            self.prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=self.lens.device)
        return self.counts, self.prompt_mask


class SpecCycle:
    """The cycle over a target, its KV cache and a drafter. `target(ids, meta)` is the target
    forward -> (final-normed hidden, states the drafter reads); `acceptor` decides acceptance
    (the exact walk; bench passes its simulator)."""

    def __init__(self, model, cache, drafter: Drafter, state: SlotState, stops: StopChecker,
                 target: Callable, *, acceptor: Acceptor = exact_acceptance, max_len: int,
                 graphs: bool, fused: bool, profile: bool, adaptive: bool = True,
                 time_sizes: bool = True, logprobs_mode: str = DEFAULT_LOGPROBS_MODE):
        self.model, self.cache, self.drafter, self.state, self.stops = model, cache, drafter, state, stops
        self.target, self.acceptor = target, acceptor
        self.device = state.lens.device
        self.vocab = model.cfg.vocab_size
        self.max_len = max_len
        self.logprobs_mode = logprobs_mode
        self._processed_logprobs = logprobs_mode.startswith("processed")
        self.page_table = getattr(cache, "page_table", None)
        self.timer = StageTimer(profile, self.device)
        self.tokens_emitted = 0
        self.forwards = 0
        self.policy = WidthPolicy(drafter.num_draft_tokens, enabled=adaptive)
        self._propose_width = takes_width(drafter.propose)
        self.sizes = capture_sizes(len(state.seq_lens) - 1)
        self.graphs: GraphRunner | None = None
        self._time_sizes = time_sizes
        self.eager_variants: set[Variant] = set()    # variants whose capture ran out of memory: eager cycles
        if graphs and self.device.type == "cuda" and drafter.graphable:
            # Fused: propose, verify + accept + commit and the draft extend in one replay (no
            # host work separates them); otherwise one graph each, so profiles split the cycle.
            stages = [self._propose, self._verify, self._extend]
            groups = [stages] if fused else [[s] for s in stages]
            self.graphs = GraphRunner(self._static_batch, groups, self.sizes)
            with torch.inference_mode():
                for width in self.policy.widths:
                    # each width's sizes timed: a batch replays the fastest size that holds it
                    self.graphs.capture_all((_GREEDY, width), time_sizes=time_sizes)

    def new_job(self) -> None:
        """A job starts: the graph variant its first cycle needs is captured at every size and
        width at once, and its sizes timed, as the all-greedy variant is at start (a job whose
        rows all sample, as a model's generation config makes them, would otherwise capture
        size by size as its occupancy meets them, ~5 s into a 1,024-row job at 512 slots,
        Llama-3.1-8B shapes, and replay untimed sizes)."""
        self._job_first = True

    _job_first = False

    @property
    def times(self) -> list[CycleTime]:
        return self.timer.times

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs else 0.0

    def launch(self, active: Slotted) -> "Launched":
        """Enqueue one cycle over the active slots (device stages and the copy of their results
        to the host) without waiting for it. The engine launches cycle k + 1 before finishing
        cycle k, so the host's commit of k runs while the GPU runs k + 1; a request that
        finished in cycle k then rides in k + 1 once more, its results dropped (its pages hold
        the rows it writes: Engine._grow keeps them ahead of the cycle in flight and the next)."""
        t0 = time.perf_counter()
        context = sum(self.state.seq_lens[s] for s, _ in active) if self.timer.enabled else 0
        # the policy's key for this many rows (the graph replayed may be a larger, faster size)
        bucket = padded_size(self.sizes, len(active))
        b, stages = self._stages(active, bucket)
        clock = [self.now()]                 # after any graph capture: the policy times the cycle itself
        marks = []
        for stage in stages:                  # propose; verify + accept + device commit; extend
            marks.append(self.timer.mark())
            stage()
        marks.append(self.timer.mark())
        clock.append(self.now())
        n = len(active)
        host = [b.out[:n]] + ([b.lp_out[:n], b.lp_ids[:n]] if b.lp_k is not None else [])
        if self.device.type == "cuda":        # pinned copies, read once `ready` has passed
            host = [t.to("cpu", non_blocking=True) for t in host]
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = [t.clone() for t in host], None
        return Launched(active, b.width, bucket, host, ready, marks, clock, t0, context)

    def finish(self, c: "Launched") -> Slotted:
        """Wait for a launched cycle's results and commit them on the host: stop checks, stats
        (device lengths and KV were committed in _verify); returns the requests that finished."""
        if c.ready is not None:
            c.ready.synchronize()
        out = c.host[0].tolist()
        lps = lp_ids = None
        if len(c.host) > 1:
            lps, lp_ids = c.host[1].tolist(), c.host[2].tolist()
        finished: Slotted = []
        emitted = 0
        N = c.width
        for i, ((slot, req), row) in enumerate(zip(c.active, out)):
            if req.finished:                  # finished in the cycle before: this one's tokens are not its
                continue
            n = row[-1]
            self.state.seq_lens[slot] += n
            kept = self.stops.append(req, row[:n])
            emitted += kept
            if req.logprobs is not None:
                add_logprobs(req, lps[i][:kept], lp_ids[i][:kept])
            req.verify_steps += 1
            req.draft_tokens += N - 1
            req.accepted_tokens += n - 1
            req.histogram[n - 1] += 1
            if req.finished:
                finished.append((slot, req))
        self.tokens_emitted += emitted
        self.forwards += 1
        now = time.perf_counter()
        # the cycle's share of the wall clock: since its launch or the previous cycle's finish
        self.timer.record(len(c.active), c.marks, max(c.t0, self._finished_at), emitted, c.context, N)
        self._finished_at = now
        self.policy.record(c.bucket, N, [row[-1] for row in out], self.elapsed(c.clock))
        return finished

    _finished_at = 0.0

    def now(self) -> object:
        """A point on the cycle's clock: a CUDA event (GPU time: the host runs ahead), else the host's."""
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, clock) -> float:
        """Seconds between two points of now() (CUDA: waits for the second)."""
        a, b = clock
        return a.elapsed_time(b) / 1e3 if self.device.type == "cuda" else b - a

    def _stages(self, active: Slotted, bucket: int) -> tuple[Batch, list]:
        """The batch of this cycle and its stages as callables: graph replays, or eager calls."""
        if self.graphs is not None:
            first = False
            if not _same_layout(self._variant_of, active):      # the variant changes with the active set only
                self._variant_of, self._variant = list(active), self._graph_variant(active)
                first, self._job_first = self._job_first, False
            if self._variant not in self.eager_variants:
                failed = None
                try:
                    return self._replays(active, bucket, first)
                except Exception as e:  # noqa: BLE001 - an allocation that failed; anything else goes on up
                    if not out_of_memory(e):
                        raise
                    failed = exception_line(e)
                # past the handler: the failed capture's tensors, held by the traceback, are free
                self._no_graphs(self._variant, failed)
        slots = [s for s, _ in active]
        params = [r.params for _, r in active]
        rows = [(r.params, len(r.prompt_ids)) for _, r in active]
        pkey = processors_key(rows, self.stops.eos_ids, self.vocab)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        b = Batch(slots=to_device(slots, torch.int64, self.device),
                  sp=BatchSampling.build(params, self.device, self._processed_logprobs),
                  # host lengths may lag the device by the cycle in flight (launch / finish)
                  kv_bound=min(self.max_len, max(self.state.seq_lens[s] for s in slots) + self.drafter.num_draft_tokens),
                  width=self.policy.choose(bucket),
                  proc=None if pkey is None else Processors.build(rows, self.stops.eos_ids, self.vocab, self.device),
                  lp_k=max(asked) if asked else None)
        return b, [lambda: self._propose(b), lambda: self._verify(b), lambda: self._extend(b)]

    def _replays(self, active: Slotted, bucket: int, first: bool) -> tuple[Batch, list]:
        """The graphs of this cycle's size, variant and width (captured now if new), buffers filled."""
        if first:
            for w in self.policy.widths:
                # timing replays each size on what its buffers hold: a variant met mid-job in an earlier
                # job (captured as met, never timed) holds that job's rows, whose slots this job's rows
                # now hold: its batches go back to pad rows first
                for cap in self.graphs.captured((self._variant, w)):
                    if cap.layout is not None:
                        self._fill(cap.batch, [])
                        cap.layout = None
                self.graphs.capture_all((self._variant, w), time_sizes=self._time_sizes)
        width = self.policy.choose(bucket)
        if self.policy.adaptive:
            # a variant captured on first use (sampled, processors, logprobs) gets every width of this size
            # at once: later widths would otherwise be captured mid-job, one stall at a time
            for w in self.policy.widths:
                self.graphs.get(len(active), (self._variant, w))
        cap = self.graphs.get(len(active), (self._variant, width))
        if not _same_layout(cap.layout, active):
            self._fill(cap.batch, active)
            cap.layout = list(active)     # the requests themselves: a new one never passes for an old one
        return cap.batch, [g.replay for g in cap.graphs]

    def _no_graphs(self, variant: Variant, why: str) -> None:
        """Capturing `variant`'s graphs ran out of memory (graph pools hold what the KV pool's
        reserve left): its cycles run eagerly from now on, the graphs it has are dropped (their
        blocks go back to the shared pool), and the job goes on."""
        self.eager_variants.add(variant)
        self.graphs.drop(lambda v: v[0] == variant)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"warning: CUDA out of memory capturing the graphs of a batch's sampling variant ({why}); "
              "its cycles run without CUDA graphs", file=sys.stderr, flush=True)

    _variant_of: Slotted | None = None
    _variant: Variant = _GREEDY

    def _graph_variant(self, active: Slotted) -> Variant:
        params = [r.params for _, r in active]
        pkey = processors_key([(r.params, len(r.prompt_ids)) for _, r in active], self.stops.eos_ids, self.vocab)
        asked = any(p.logprobs is not None for p in params)
        return Variant(*host_flags(params), pkey, LOGPROBS_MAX if asked else None)

    # Device stages: tensor work only, no host synchronisation (they are captured in graphs).

    def _propose(self, b: Batch) -> None:
        """A tree of N nodes per slot, the root being the last emitted token."""
        b.lens = self.state.lens[b.slots]
        width = {"width": b.width} if self._propose_width else {}      # drafters may omit it
        b.prop = self.drafter.propose(b.slots, self.state.last[b.slots], b.lens, b.kv_bound, **width)

    def _verify(self, b: Batch) -> None:
        """One target forward over every node, the acceptance walk, and the device half of
        commit: the accepted path's K/V made contiguous (trees), lengths advanced, the last
        emitted token kept as the next root."""
        lens, st = b.lens, self.state
        prop = b.prop = b.prop.prefix(b.width)
        meta = AttnMetadata(slots=b.slots, positions=lens[:, None] + prop.depths, prefix_lens=lens,
                            kv_len=b.kv_bound + prop.width, tree_mask=prop.tree_mask, page_table=self.page_table)
        hidden, b.captured = self.target(prop.tokens, meta)
        logits = raw = self.model.head_logits(hidden)                            # [B, N, V]
        proc = b.proc
        if proc is not None:
            # every node with its own path's state: generated = committed + 1 (the root) - prompt, + depth
            logits = proc.apply(logits, prop.depths, lens + 1 - proc.prompt_len, prop.tokens, prop.tree_mask,
                                (st.counts, st.prompt_mask, b.slots) if proc.penalties else None)
        acc = self.acceptor(prop, logits, b.sp, lens, self.drafter.max_depth)
        if prop.tree_mask is not None:
            compact_path(self.cache.data, b.slots, lens, acc.path, acc.num, page_table=self.page_table)
        st.lens[b.slots] = lens + acc.num
        st.last[b.slots] = acc.tokens.gather(1, (acc.num - 1)[:, None])[:, 0]
        st.lens[st.dummy:].zero_()              # pad rows all advanced the dummy slot
        if proc is not None and proc.penalties:
            count_tokens(st.counts, b.slots, acc.tokens, acc.num)
            st.counts[st.dummy:].zero_()
        if b.lp_k is not None:
            b.lp_out, b.lp_ids = emitted_logprobs(raw, logits, acc.path, acc.tokens, b.sp, b.lp_k, self.logprobs_mode)
        b.acc = acc
        b.out = torch.cat([acc.tokens, acc.num[:, None]], dim=1)

    def _extend(self, b: Batch) -> None:
        """The drafter catches up on the accepted tokens with the target's states."""
        self.drafter.extend(b.slots, b.lens, b.acc, b.captured, b.kv_bound)

    # ---- graph buffers and timing ---------------------------------------------------------------

    def _static_batch(self, size: int, key: tuple) -> Batch:
        (greedy, any_filter, any_top_k, any_min_p, pkey, lp_k), width = key
        pad = [SamplingParams()] * size
        b = Batch(slots=torch.full((size,), self.state.dummy, dtype=torch.int64, device=self.device),
                  sp=BatchSampling.build(pad, self.device), kv_bound=self.max_len, width=width, lp_k=lp_k)
        b.sp.all_greedy, b.sp.any_filter, b.sp.any_top_k = greedy, any_filter, any_top_k
        if lp_k is not None and self._processed_logprobs:
            b.sp.built = torch.zeros(size, dtype=torch.bool, device=self.device)
        if any_min_p:
            b.sp.min_p = torch.zeros(size, dtype=torch.float32, device=self.device)
        if pkey is not None:
            b.proc = Processors.build([(p, 0) for p in pad], (), self.vocab, self.device, key=pkey)
            if pkey[2]:
                self.state.penalty_state(self.vocab)
        return b

    def _fill(self, b: Batch, active: Slotted) -> None:
        """Lay the active rows out in a captured batch's buffers; the rest become pad rows. The
        copies are stream-ordered and do not wait: the cycle in flight may read these buffers,
        and it runs before them (a pageable source is staged before the call returns)."""
        pad = b.slots.shape[0] - len(active)
        params = [r.params for _, r in active] + [SamplingParams()] * pad
        src = BatchSampling.build(params, torch.device("cpu"), self._processed_logprobs)
        b.slots.copy_(torch.tensor([s for s, _ in active] + [self.state.dummy] * pad), non_blocking=True)
        for name in BatchSampling.ROWS:
            getattr(b.sp, name).copy_(getattr(src, name), non_blocking=True)
        if b.sp.built is not None:
            b.sp.built.copy_(src.built if src.built is not None else torch.zeros(len(params), dtype=torch.bool),
                             non_blocking=True)
        if b.sp.min_p is not None:
            b.sp.min_p.copy_(src.min_p if src.min_p is not None else torch.zeros(len(params)), non_blocking=True)
        if b.proc is not None:
            rows = [(r.params, len(r.prompt_ids)) for _, r in active] + [(SamplingParams(), 0)] * pad
            key = (b.proc.stop_ids.shape[1], b.proc.bias_ids.shape[1], b.proc.penalties)
            b.proc.copy_(Processors.build(rows, self.stops.eos_ids, self.vocab, torch.device("cpu"), key=key))


def _same_layout(old: Slotted | None, active: Slotted) -> bool:
    """Whether `old` holds exactly these requests in these slots (by identity)."""
    return old is not None and len(old) == len(active) and all(
        r is q and s == t for (t, q), (s, r) in zip(old, active))
