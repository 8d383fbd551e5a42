"""Prefill: admitted prompts, packed into few target forwards with no padding between prompts.

Each prompt is cut into rows of C tokens (the last row of a prompt padded), row j of a prompt
bringing positions [jC, jC + C) with prefix_lens = jC. Within a layer every row's K/V are
written before any row attends, so row j reads rows 0..j-1 of the same forward from the cache:
one forward computes what one row per prompt would, and the forward's token count is the
prompts' own (plus < C each), whatever their lengths. C x G (query heads per KV head) is one
query tile of the attention kernel, so the kernel does the same work as on a whole prompt.

Rows are packed in admission order up to `budget` tokens a forward; a prompt that does not fit
continues in the next forward (chunked prefill: a long prompt never needs a forward of its
length). A prompt whose leading pages another prompt wrote (prefix caching, runtime/pages.py)
starts at the first row past them, as a continued prompt does. Prompts whose last row ran get
their first token sampled (processors, logprobs), their prompt logprobs, and the drafter's
catch-up (speculative.drafter.PromptRows).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..host import to_device
from ..models.attention import AttnMetadata
from ..processors import Processors, count_tokens, reset_slots
from ..request import Request, StopChecker
from ..sampling import BatchSampling, sample
from ..speculative.drafter import Drafter, PromptRows
from .cycle import SlotState, Slotted
from .graphs import GraphRunner
from .logprobs import add_logprobs, emitted_logprobs, prompt_token_logprobs

TILE_QUERIES = 128        # query rows of one attention tile (kernels.attention.MAX_QUERY_ROWS)
# Prefills of at most this many rows (a few short prompts: a refill) replay a captured target
# forward: eager, its ~500 launches cost more host time than a short prompt's GPU time.
GRAPH_ROWS = (1, 2, 4, 8, 16, 32)


def chunk_tokens(num_heads: int, num_kv_heads: int) -> int:
    """C: prompt tokens a row (one query tile: C x G query rows), at least 16."""
    return max(16, TILE_QUERIES // max(1, num_heads // num_kv_heads))


@dataclass
class _Static:
    """A captured prefill forward's buffers: rows past the live ones are pad rows (dummy slot)."""
    ids: torch.Tensor                # [size, C]
    slots: torch.Tensor              # [size]
    positions: torch.Tensor          # [size, C]
    prefix_lens: torch.Tensor        # [size]
    hidden: torch.Tensor | None = None
    captured: list[torch.Tensor] | None = None


@dataclass
class Part:
    """Rows [start, end) (in chunks of C) of one admitted prompt, in one forward."""
    slot: int
    req: Request
    start: int
    end: int
    last: bool                       # the prompt's last row is in this forward


def pack(admitted: Slotted, budget: int, C: int) -> list[list[Part]]:
    """Forwards of at most max(1, budget // C) rows, prompts in order, split where a forward fills."""
    cap = max(1, budget // C)
    forwards: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for slot, req in admitted:
        n = math.ceil(len(req.prompt_ids) / C)
        j = req.cached_rows // C                # rows of a prefix already in the pool (a whole number)
        while j < n:
            take = min(n - j, cap - used)
            cur.append(Part(slot, req, j, j + take, j + take == n))
            used, j = used + take, j + take
            if used == cap:
                forwards.append(cur)
                cur, used = [], 0
    if cur:
        forwards.append(cur)
    return forwards


class Prefiller:
    """Runs the prefill forwards of admitted requests: the target, the first token, the drafter."""

    def __init__(self, model, target: Callable, drafter: Drafter, state: SlotState, stops: StopChecker,
                 page_table: torch.Tensor | None, budget: int, *, max_len: int, graphs: bool):
        self.model, self.target, self.drafter, self.state, self.stops = model, target, drafter, state, stops
        self.page_table, self.budget, self.max_len = page_table, budget, max_len
        cfg = model.cfg
        self.C = chunk_tokens(cfg.num_heads, cfg.num_kv_heads)
        self.device = state.lens.device
        self.forwards = 0
        self.rows_run = 0                    # prompt rows of C tokens the forwards computed
        self.tokens_emitted = 0
        self.graphs: GraphRunner | None = None
        if graphs and self.device.type == "cuda":
            self.graphs = GraphRunner(self._static, [[self._graph_forward]], list(GRAPH_ROWS))
            with torch.inference_mode():
                self.graphs.capture_all(None)

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs else 0.0

    def _static(self, size: int, variant) -> _Static:
        C, dev = self.C, self.device
        return _Static(ids=torch.zeros(size, C, dtype=torch.int64, device=dev),
                       slots=torch.full((size,), self.state.dummy, dtype=torch.int64, device=dev),
                       positions=torch.arange(C, device=dev).repeat(size, 1),
                       prefix_lens=torch.zeros(size, dtype=torch.int64, device=dev))

    def _graph_forward(self, b: _Static) -> None:
        # metadata made inside the capture: it caches tensors derived from the buffers (cache rows)
        meta = AttnMetadata(slots=b.slots, positions=b.positions, prefix_lens=b.prefix_lens,
                            kv_len=self.max_len + self.C, page_table=self.page_table)
        b.hidden, b.captured = self.target(b.ids, meta)

    def _run_target(self, ids: torch.Tensor, meta: AttnMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target forward over R rows: a captured one for a few rows, else eager."""
        R = ids.shape[0]
        if self.graphs is None or R > GRAPH_ROWS[-1]:
            return self.target(ids, meta)
        cap = self.graphs.get(R, None)
        b: _Static = cap.batch
        size, C = b.ids.shape
        pad = size - R
        # whole buffers each time: pad rows of an earlier, larger prefill go back to the dummy slot
        b.ids.copy_(torch.cat([ids, ids.new_zeros(pad, C)]), non_blocking=True)
        b.slots.copy_(torch.cat([meta.slots, meta.slots.new_full((pad,), self.state.dummy)]), non_blocking=True)
        b.prefix_lens.copy_(torch.cat([meta.prefix_lens, meta.prefix_lens.new_zeros(pad)]), non_blocking=True)
        b.positions.copy_(torch.cat([meta.positions, b.positions[R:].new_zeros(pad, 1) +
                                     torch.arange(C, device=self.device)]), non_blocking=True)
        for g in cap.graphs:
            g.replay()
        return b.hidden[:R], [c[:R] for c in b.captured]

    def __call__(self, admitted: Slotted) -> Slotted:
        """Prefill every admitted request; returns those finished by their first token. Every
        forward is launched before the first host copy, so the host builds the next forward
        while the GPU runs this one."""
        launched = [self._forward(parts) for parts in pack(admitted, self.budget, self.C)]
        finished: Slotted = []
        for done, first, lps in launched:
            finished += self._commit(done, first, lps)
        return finished

    def _rows(self, parts: list[Part]) -> tuple[torch.Tensor, PromptRows]:
        """Host-built [R, C] ids and their PromptRows, copied to the device."""
        C = self.C
        R = sum(p.end - p.start for p in parts)
        self.rows_run += R
        ids = torch.zeros(R * C, dtype=torch.int64)
        nxt = torch.zeros(R * C, dtype=torch.int64)
        slots, prefix, out_cols = [], [], []
        last_rows, last_cols, done = [], [], []
        r = 0
        for p in parts:
            prompt, L = p.req.prompt_ids, len(p.req.prompt_ids)
            a, b = p.start * C, min(p.end * C, L)
            ids[r * C: r * C + b - a] = torch.tensor(prompt[a:b])
            nb = min(b + 1, L)
            nxt[r * C: r * C + nb - a - 1] = torch.tensor(prompt[a + 1: nb])
            n = p.end - p.start
            slots += [p.slot] * n
            prefix += [j * C for j in range(p.start, p.end)]
            out_cols += [C - 1] * n
            if p.last:
                last_rows.append(r + n - 1)
                last_cols.append((L - 1) % C)
                out_cols[-1] = last_cols[-1]
                done.append(p)
            r += n
        dev = self.device
        prefix_t = torch.tensor(prefix, dtype=torch.int64)
        positions = (prefix_t[:, None] + torch.arange(C)).to(dev, non_blocking=True)
        meta = AttnMetadata(slots=to_device(slots, torch.int64, dev), positions=positions,
                            prefix_lens=prefix_t.to(dev, non_blocking=True),
                            kv_len=max(prefix) + C, page_table=self.page_table)
        rows = PromptRows(meta=meta, next_ids=nxt.view(R, C).to(dev, non_blocking=True),
                          last_rows=to_device(last_rows, torch.int64, dev), last_cols=to_device(last_cols, torch.int64, dev),
                          slots=to_device([p.slot for p in done], torch.int64, dev), prompts=[p.req.prompt_ids for p in done],
                          out_cols=to_device(out_cols, torch.int64, dev))
        return ids.view(R, C).to(dev, non_blocking=True), rows

    def _forward(self, parts: list[Part]) -> tuple[list[Part], torch.Tensor | None, tuple | None]:
        """The device half of one forward: the target, the first tokens, the drafter, the slots'
        lengths and roots; returns (the finished prompts' parts, their first tokens, logprobs)."""
        ids, rows = self._rows(parts)
        hidden, captured = self._run_target(ids, rows.meta)                      # [R, C, H]
        self.forwards += 1
        C, H = self.C, hidden.shape[-1]
        flat = hidden.view(-1, H)
        r = 0
        for p in parts:                       # prompt logprobs of the positions in this forward
            n = p.end - p.start
            if p.req.params.prompt_logprobs is not None and p.req.choice == 0:   # n choices share them
                L = len(p.req.prompt_ids)
                a, b = p.start * C, min(p.end * C, L)
                got = prompt_token_logprobs(self.model.logits, flat[r * C: r * C + b - a],
                                            to_device(p.req.prompt_ids[a: min(b + 1, L)], torch.int64, self.device),
                                            p.req.params.prompt_logprobs)
                p.req.prompt_logprobs = (p.req.prompt_logprobs or []) + got
            r += n
        done = [p for p in parts if p.last]
        if not done:                          # a long prompt's first rows: only the drafter's K/V
            self.drafter.prefill(rows, captured, torch.zeros(0, dtype=torch.int64, device=self.device))
            return done, None, None
        lens = [len(p.req.prompt_ids) for p in done]
        lengths = to_device(lens, torch.int64, self.device)
        first, lps = self._first_tokens(done, rows, hidden, lens, lengths)
        self.drafter.prefill(rows, captured, first)
        st = self.state
        st.lens[rows.slots], st.last[rows.slots] = lengths, first
        return done, first, lps

    def _commit(self, done: list[Part], first: torch.Tensor | None, lps) -> Slotted:
        """The host half: first tokens appended (stops), logprobs, stats."""
        if not done:
            return []
        lps, lp_ids = (None, None) if lps is None else (lps[0].tolist(), lps[1].tolist())
        finished: Slotted = []
        for i, (p, tok) in enumerate(zip(done, first.tolist())):
            req = p.req
            self.state.seq_lens[p.slot] = len(req.prompt_ids)
            req.histogram = [0] * (self.drafter.max_depth + 1)
            req.verify_steps = 1                 # the prefill: a forward that verified no drafts
            kept = self.stops.append(req, [tok])
            self.tokens_emitted += kept
            if req.logprobs is not None:
                add_logprobs(req, lps[i][:kept], lp_ids[i][:kept])
            if req.finished:
                finished.append((p.slot, req))
        return finished

    def _first_tokens(self, done: list[Part], rows: PromptRows, hidden: torch.Tensor, lens: list[int],
                      lengths: torch.Tensor) -> tuple:
        """The finished prompts' first tokens [B] (processed, sampled), and when a row asked for
        them, (their logprobs, top ids) on the device (else None). lens: their prompt lengths,
        on the host and as `lengths` on the device."""
        B = len(done)
        dev = self.device
        slots = rows.slots
        params = [p.req.params for p in done]
        sp = BatchSampling.build(params, dev)
        logits = self.model.logits(hidden[rows.last_rows, rows.last_cols])        # [B, V]
        counts = None
        if any(q.uses_processors for q in params):
            # the first token: nothing generated yet (min_tokens), counts zero, the prompt present
            st = self.state
            vocab = self.model.cfg.vocab_size
            proc = Processors.build(list(zip(params, lens)),
                                    self.stops.eos_ids, vocab, dev)
            pm = None
            if proc.penalties:
                counts, prompt_mask = st.penalty_state(vocab)
                T = max(len(q) for q in rows.prompts)
                padded = torch.zeros(B, T, dtype=torch.int64)
                for i, q in enumerate(rows.prompts):
                    padded[i, : len(q)] = torch.tensor(q)
                reset_slots(counts, prompt_mask, slots, padded.to(dev, non_blocking=True), lengths)
                pm = prompt_mask[slots]
            zero = torch.zeros(B, 1, dtype=torch.int64, device=dev)
            logits = proc.apply(logits[:, None, :], zero, zero[:, 0], zero, None,
                                None if counts is None else counts[slots], pm)[:, 0]
        first = sample(logits, sp, lengths)
        if counts is not None:
            count_tokens(counts, slots, first[:, None], torch.ones_like(first))
        asked = [q.logprobs for q in params if q.logprobs is not None]
        if not asked:
            return first, None
        zero = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        return first, emitted_logprobs(logits[:, None, :], zero, first[:, None], sp, max(asked))

