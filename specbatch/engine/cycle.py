"""The speculative cycle, top to bottom: propose -> verify -> accept -> commit -> extend.

    cycle(active):
        propose   the drafter builds a tree of N nodes per slot, the root the last emitted token
        verify    one target forward over every node (tree mask, positions = length + depth)
        accept    walk the tree with the target's distribution -> emitted tokens, accepted path
        commit    device: the path's K/V made contiguous, lengths and roots advanced;
                  host: tokens appended token by token (stops), per-request stats
        extend    the drafter catches up on the accepted tokens with the target's states

The device half is three stages (propose; verify + accept + device commit; extend), run eagerly
or replayed as CUDA graphs; the one host synchronisation is the copy of the emitted tokens and
their counts. Rows become requests and requests become records elsewhere (engine.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.attention import AttnMetadata
from ..request import Request, StopChecker
from .graphs import GraphRunner, capture_sizes
from .profile import CycleTime, StageTimer
from ..runtime.kv_cache import compact_path
from ..sampling import BatchSampling, SamplingParams
from ..speculative.accept import Acceptance, accept
from ..speculative.drafter import Drafter, Proposal

Slotted = list[tuple[int, Request]]
# (tokens [B, N], parents [B, N], logits [B, N, V], sampling, lengths [B], max depth) -> Acceptance
Acceptor = Callable[[Proposal, torch.Tensor, BatchSampling, torch.Tensor, int], Acceptance]
_GREEDY = (True, False)       # graph variant: (all rows greedy, some row filters top-k / top-p)


def exact_acceptance(prop: Proposal, logits: torch.Tensor, sp: BatchSampling, lens: torch.Tensor,
                     max_depth: int) -> Acceptance:
    """The lossless acceptance walk (spec/accept.py): what every run uses."""
    return accept(prop.tokens, prop.parents, logits, sp, lens, max_depth)


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


class SlotState:
    """Per slot (the last one is the dummy slot of pad rows): committed cache rows and the last
    emitted token (not yet in the cache), on the device; the host mirrors the lengths."""

    def __init__(self, num_slots: int, device: torch.device):
        self.lens = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.last = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self.seq_lens = [0] * (num_slots + 1)
        self.dummy = num_slots


class SpecCycle:
    """The cycle over a target, its KV cache and a drafter. `target(ids, meta)` is the target
    forward -> (final-normed hidden, states the drafter reads); `acceptor` decides acceptance
    (the exact walk; bench passes its simulator)."""

    def __init__(self, model, cache, drafter: Drafter, state: SlotState, stops: StopChecker,
                 target: Callable, *, acceptor: Acceptor = exact_acceptance, max_len: int,
                 graphs: bool, fused: bool, profile: bool):
        self.model, self.cache, self.drafter, self.state, self.stops = model, cache, drafter, state, stops
        self.target, self.acceptor = target, acceptor
        self.device = state.lens.device
        self.max_len = max_len
        self.page_table = getattr(cache, "page_table", None)
        self.timer = StageTimer(profile, self.device)
        self.tokens_emitted = 0
        self.forwards = 0
        self.graphs: GraphRunner | None = None
        if graphs and self.device.type == "cuda" and drafter.graphable:
            # Fused: propose, verify + accept + commit and the draft extend in one replay (no
            # host work separates them); otherwise one graph each, so profiles split the cycle.
            stages = [self._propose, self._verify, self._extend]
            groups = [stages] if fused else [[s] for s in stages]
            self.graphs = GraphRunner(self._static_batch, groups, capture_sizes(len(state.seq_lens) - 1))
            with torch.inference_mode():
                self.graphs.capture_all(_GREEDY)

    @property
    def times(self) -> list[CycleTime]:
        return self.timer.times

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs else 0.0

    def __call__(self, active: Slotted) -> Slotted:
        """One cycle over the active slots; returns those whose request finished."""
        t0 = time.perf_counter()
        b, stages = self._stages(active)
        marks = []
        for stage in stages:                  # propose; verify + accept + device commit; extend
            marks.append(self.timer.mark())
            stage()
        marks.append(self.timer.mark())
        out = b.out[: len(active)].tolist()   # the host copy of the results

        # commit on the host: stop checks, stats (device lengths and KV were committed in _verify)
        finished: Slotted = []
        emitted = 0
        N = b.prop.width
        for (slot, req), row in zip(active, out):
            n = row[-1]
            self.state.seq_lens[slot] += n
            emitted += self.stops.append(req, row[:n])
            req.verify_steps += 1
            req.draft_tokens += N - 1
            req.accepted_tokens += n - 1
            req.histogram[n - 1] += 1
            if req.finished:
                finished.append((slot, req))
        self.tokens_emitted += emitted
        self.forwards += 1
        self.timer.record(len(active), marks, t0, emitted)
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
        b = Batch(slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
                  sp=BatchSampling.build(params, self.device),
                  kv_bound=max(self.state.seq_lens[s] for s in slots))
        return b, [lambda: self._propose(b), lambda: self._verify(b), lambda: self._extend(b)]

    # Device stages: tensor work only, no host synchronisation (they are captured in graphs).

    def _propose(self, b: Batch) -> None:
        """A tree of N nodes per slot, the root being the last emitted token."""
        b.lens = self.state.lens[b.slots]
        b.prop = self.drafter.propose(b.slots, self.state.last[b.slots], b.lens, b.kv_bound)

    def _verify(self, b: Batch) -> None:
        """One target forward over every node, the acceptance walk, and the device half of
        commit: the accepted path's K/V made contiguous (trees), lengths advanced, the last
        emitted token kept as the next root."""
        prop, lens, st = b.prop, b.lens, self.state
        meta = AttnMetadata(slots=b.slots, positions=lens[:, None] + prop.depths, prefix_lens=lens,
                            kv_len=b.kv_bound + prop.width, tree_mask=prop.tree_mask, page_table=self.page_table)
        hidden, b.captured = self.target(prop.tokens, meta)
        logits = self.model.lm_head(hidden)                                      # [B, N, V]
        acc = self.acceptor(prop, logits, b.sp, lens, self.drafter.max_depth)
        if prop.tree_mask is not None:
            compact_path(self.cache.data, b.slots, lens, acc.path, acc.num, page_table=self.page_table)
        st.lens[b.slots] = lens + acc.num
        st.last[b.slots] = acc.tokens.gather(1, (acc.num - 1)[:, None])[:, 0]
        st.lens[st.dummy:].zero_()              # pad rows all advanced the dummy slot
        b.acc = acc
        b.out = torch.cat([acc.tokens, acc.num[:, None]], dim=1)

    def _extend(self, b: Batch) -> None:
        """The drafter catches up on the accepted tokens with the target's states."""
        self.drafter.extend(b.slots, b.lens, b.acc, b.captured, b.kv_bound)

    # ---- graph buffers and timing ---------------------------------------------------------------

    def _static_batch(self, size: int, variant: tuple[bool, bool]) -> Batch:
        greedy, any_filter = variant
        pad = [SamplingParams()] * size
        b = Batch(slots=torch.full((size,), self.state.dummy, dtype=torch.int64, device=self.device),
                  sp=BatchSampling.build(pad, self.device), kv_bound=self.max_len)
        b.sp.all_greedy, b.sp.any_filter = greedy, any_filter
        return b

    def _fill(self, b: Batch, slots: list[int], params: list[SamplingParams]) -> None:
        """Lay the active rows out in a captured batch's buffers; the rest become pad rows."""
        pad = b.slots.shape[0] - len(slots)
        src = BatchSampling.build(params + [SamplingParams()] * pad, torch.device("cpu"))
        b.slots.copy_(torch.tensor(slots + [self.state.dummy] * pad))
        for name in ("temperature", "top_k", "top_p", "seed_lo", "seed_hi"):
            getattr(b.sp, name).copy_(getattr(src, name))

