"""Prefill: admitted prompts, packed into few target forwards with no padding at all.

Every prompt token is a sequence of one new token (T = 1) at its own position, whose prefix is
the prompt's earlier rows: within a layer every token's K/V are written before any token attends,
so one forward computes what one forward per prompt would, and its GEMMs see exactly the prompts'
tokens. For attention the tokens are grouped into query tiles (models.attention.QueryTiles): C
consecutive tokens of one prompt, C x G (query heads per KV head) one query tile of the kernel, so
K/V are read once per tile as on a whole prompt.

Tokens are packed in admission order up to `budget` a forward; a prompt that does not fit
continues in the next forward (chunked prefill: a long prompt never needs a forward of its
length). A prompt whose leading pages another prompt wrote (prefix caching, runtime/pages.py)
starts at the first token past them, as a continued prompt does. Prompts whose last token ran get
their first token sampled (processors, logprobs), their prompt logprobs, and the drafter's
catch-up (speculative.drafter.PromptRows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..host import to_device
from ..params import DEFAULT_LOGPROBS_MODE
from ..models.attention import AttnMetadata, QueryTiles
from ..processors import Processors, count_tokens, reset_slots
from ..request import Request, StopChecker
from ..sampling import BatchSampling, sample
from ..speculative.drafter import Drafter, PromptRows
from .cycle import SlotState, Slotted
from .graphs import GraphRunner
from .logprobs import add_logprobs, emitted_logprobs, prompt_token_logprobs

TILE_QUERIES = 128        # query rows of one attention tile (kernels.attention.MAX_QUERY_ROWS)
# Prefills of at most this many tokens (a few short prompts: a refill) replay a captured target
# forward: eager, its ~500 launches cost more host time than a short prompt's GPU time.
GRAPH_TOKENS = (32, 64, 128, 256, 512, 1024)
GRAPH_SPARE_TILES = 32    # a captured forward's tiles: tokens / C, plus one partial tile per prompt up to this


def chunk_tokens(num_heads: int, num_kv_heads: int) -> int:
    """C: prompt tokens a query tile (C x G query rows), at least 16."""
    return max(16, TILE_QUERIES // max(1, num_heads // num_kv_heads))


@dataclass
class _Static:
    """A captured prefill forward's buffers: tokens past the live ones are pad tokens (dummy
    slot, position 0, in no tile: their attention output is whatever the buffer held, so their
    hidden states and the K/V they write at the dummy slot's row 0 are garbage, which nothing
    reads: a cycle's pad rows write the dummy rows they read first), tiles past the live ones
    hold no tokens."""
    ids: torch.Tensor                # [size, 1]
    slots: torch.Tensor              # [size]
    positions: torch.Tensor          # [size, 1]
    tile_start: torch.Tensor         # [tiles]
    tile_count: torch.Tensor         # [tiles]
    hidden: torch.Tensor | None = None
    captured: list[torch.Tensor] | None = None


@dataclass
class Part:
    """Tokens [start, end) of one admitted prompt, in one forward."""
    slot: int
    req: Request
    start: int
    end: int
    last: bool                       # the prompt's last token is in this forward


def pack(admitted: Slotted, budget: int) -> list[list[Part]]:
    """Forwards of at most max(1, budget) tokens, prompts in order, split where a forward fills."""
    cap = max(1, budget)
    forwards: list[list[Part]] = []
    cur: list[Part] = []
    used = 0
    for slot, req in admitted:
        n = req.context_len                     # a resumed request: its output too
        j = req.cached_rows                     # tokens of a prefix already in the pool
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


def tiles_of(parts: list[Part], C: int) -> tuple[list[int], list[int]]:
    """(start, count) of each query tile: C consecutive tokens of one part, indices into the
    forward's tokens (the parts' tokens in order)."""
    start, count = [], []
    r = 0
    for p in parts:
        for a in range(p.start, p.end, C):
            start.append(r + a - p.start)
            count.append(min(C, p.end - a))
        r += p.end - p.start
    return start, count


class Prefiller:
    """Runs the prefill forwards of admitted requests: the target, the first token, the drafter."""

    def __init__(self, model, target: Callable, drafter: Drafter, state: SlotState, stops: StopChecker,
                 page_table: torch.Tensor | None, budget: int, *, max_len: int, graphs: bool,
                 logprobs_mode: str = DEFAULT_LOGPROBS_MODE):
        self.model, self.target, self.drafter, self.state, self.stops = model, target, drafter, state, stops
        self.logprobs_mode = logprobs_mode
        self.page_table, self.budget, self.max_len = page_table, budget, max_len
        cfg = model.cfg
        self.C = chunk_tokens(cfg.num_heads, cfg.num_kv_heads)
        if cfg.sliding_window is not None:       # a tile's tokens all sit inside one another's window
            self.C = max(1, min(self.C, cfg.sliding_window - 1))
        self.device = state.lens.device
        self.forwards = 0
        self.tokens_run = 0                  # prompt tokens the forwards computed
        self.tokens_emitted = 0
        self.graphs: GraphRunner | None = None
        if graphs and self.device.type == "cuda":
            self.graphs = GraphRunner(self._static, [[self._graph_forward]], list(GRAPH_TOKENS))
            with torch.inference_mode():
                self.graphs.capture_all(None)

    @property
    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs else 0.0

    def _tile_capacity(self, size: int) -> int:
        return size // self.C + GRAPH_SPARE_TILES

    def _static(self, size: int, variant) -> _Static:
        dev, tiles = self.device, self._tile_capacity(size)
        return _Static(ids=torch.zeros(size, 1, dtype=torch.int64, device=dev),
                       slots=torch.full((size,), self.state.dummy, dtype=torch.int64, device=dev),
                       positions=torch.zeros(size, 1, dtype=torch.int64, device=dev),
                       tile_start=torch.zeros(tiles, dtype=torch.int64, device=dev),
                       tile_count=torch.zeros(tiles, dtype=torch.int64, device=dev))

    def _graph_forward(self, b: _Static) -> None:
        # metadata made inside the capture: it caches tensors derived from the buffers (cache rows)
        meta = AttnMetadata(slots=b.slots, positions=b.positions, prefix_lens=b.positions[:, 0],
                            kv_len=self.max_len + 1, page_table=self.page_table,
                            tiles=QueryTiles(b.tile_start, b.tile_count, self.C))
        b.hidden, b.captured = self.target(b.ids, meta)

    def _graph_size(self, N: int, R: int) -> int | None:
        """The smallest captured forward holding N tokens and R tiles, else None (eager)."""
        if self.graphs is None:
            return None
        return next((s for s in GRAPH_TOKENS if s >= N and self._tile_capacity(s) >= R), None)

    def _run_target(self, ids: torch.Tensor, meta: AttnMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The target forward over N tokens: a captured one for a few tokens, else eager."""
        N, R = ids.shape[0], meta.tiles.start.shape[0]
        size = self._graph_size(N, R)
        if size is None:
            return self.target(ids, meta)
        cap = self.graphs.get(size, None)
        b: _Static = cap.batch
        pad, spare = b.ids.shape[0] - N, b.tile_start.shape[0] - R
        # whole buffers each time: pad tokens of an earlier, larger prefill go back to the dummy slot
        b.ids.copy_(torch.cat([ids, ids.new_zeros(pad, 1)]), non_blocking=True)
        b.slots.copy_(torch.cat([meta.slots, meta.slots.new_full((pad,), self.state.dummy)]), non_blocking=True)
        b.positions.copy_(torch.cat([meta.positions, meta.positions.new_zeros(pad, 1)]), non_blocking=True)
        b.tile_start.copy_(torch.cat([meta.tiles.start, meta.tiles.start.new_zeros(spare)]), non_blocking=True)
        b.tile_count.copy_(torch.cat([meta.tiles.count, meta.tiles.count.new_zeros(spare)]), non_blocking=True)
        for g in cap.graphs:
            g.replay()
        return b.hidden[:N], [c[:N] for c in b.captured]

    def __call__(self, admitted: Slotted) -> Slotted:
        """Prefill every admitted request; returns those finished by their first token. Every
        forward is launched before the first host copy, so the host builds the next forward
        while the GPU runs this one."""
        launched = [self._forward(parts) for parts in pack(admitted, self.budget)]
        finished: Slotted = []
        for done, first, lps in launched:
            finished += self._commit(done, first, lps)
        return finished

    def _rows(self, parts: list[Part]) -> tuple[torch.Tensor, PromptRows]:
        """Host-built [N, 1] ids (one sequence a prompt token) and their PromptRows, copied to the
        device."""
        N = sum(p.end - p.start for p in parts)
        self.tokens_run += N
        ids = torch.empty(N, dtype=torch.int64)
        nxt = torch.zeros(N, dtype=torch.int64)
        positions = torch.empty(N, dtype=torch.int64)
        slots = torch.empty(N, dtype=torch.int64)
        last, done = [], []
        r = 0
        contexts = {}
        for p in parts:
            prompt = contexts[p.slot] = p.req.context_ids
            L = len(prompt)
            a, b = p.start, p.end
            ids[r: r + b - a] = torch.tensor(prompt[a:b])
            nb = min(b + 1, L)
            nxt[r: r + nb - a - 1] = torch.tensor(prompt[a + 1: nb])
            positions[r: r + b - a] = torch.arange(a, b)
            slots[r: r + b - a] = p.slot
            r += b - a
            if p.last:
                last.append(r - 1)
                done.append(p)
        start, count = tiles_of(parts, self.C)
        dev = self.device
        pos = positions.to(dev, non_blocking=True)
        meta = AttnMetadata(slots=slots.to(dev, non_blocking=True), positions=pos[:, None], prefix_lens=pos,
                            kv_len=max(p.end for p in parts), page_table=self.page_table,
                            tiles=QueryTiles(to_device(start, torch.int64, dev), to_device(count, torch.int64, dev),
                                             self.C))
        rows = PromptRows(meta=meta, next_ids=nxt.view(N, 1).to(dev, non_blocking=True),
                          last=to_device(last, torch.int64, dev),
                          slots=to_device([p.slot for p in done], torch.int64, dev),
                          prompts=[contexts[p.slot] for p in done])
        return ids.view(N, 1).to(dev, non_blocking=True), rows

    def _forward(self, parts: list[Part]) -> tuple[list[Part], torch.Tensor | None, tuple | None]:
        """The device half of one forward: the target, the first tokens, the drafter, the slots'
        lengths and roots; returns (the finished prompts' parts, their first tokens, logprobs)."""
        ids, rows = self._rows(parts)
        hidden, captured = self._run_target(ids, rows.meta)                      # [N, 1, H]
        self.forwards += 1
        flat = hidden.view(-1, hidden.shape[-1])
        r = 0
        for p in parts:                       # prompt logprobs of the positions in this forward
            n = p.end - p.start
            # n choices share them; a resumed request has them
            if p.req.params.prompt_logprobs is not None and p.req.choice == 0 and not p.req.output_ids:
                L = len(p.req.prompt_ids)
                a, b = p.start, p.end
                got = prompt_token_logprobs(self.model.logits, flat[r: r + b - a],
                                            to_device(p.req.prompt_ids[a: min(b + 1, L)], torch.int64, self.device),
                                            p.req.params.prompt_logprobs)
                p.req.prompt_logprobs = (p.req.prompt_logprobs or []) + got
            r += n
        done = [p for p in parts if p.last]
        if not done:                          # a long prompt's first rows: only the drafter's K/V
            self.drafter.prefill(rows, captured, torch.zeros(0, dtype=torch.int64, device=self.device))
            return done, None, None
        lens = [p.req.context_len for p in done]
        lengths = to_device(lens, torch.int64, self.device)
        first, lps, sp = self._first_tokens(done, rows, hidden, lengths)
        self.drafter.sample_as(rows.slots, sp)
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
            self.state.seq_lens[p.slot] = req.context_len
            if not req.output_ids:
                req.histogram = [0] * (self.drafter.max_depth + 1)
            req.verify_steps += 1                # the prefill: a forward that verified no drafts
            kept = self.stops.append(req, [tok])
            self.tokens_emitted += kept
            if req.logprobs is not None:
                add_logprobs(req, lps[i][:kept], lp_ids[i][:kept])
            if req.finished:
                finished.append((p.slot, req))
        return finished

    def _first_tokens(self, done: list[Part], rows: PromptRows, hidden: torch.Tensor,
                      lengths: torch.Tensor) -> tuple:
        """The finished prompts' first tokens [B] (processed, sampled), when a row asked for them
        (their logprobs, top ids) on the device (else None), and the rows' sampling. lengths [B]:
        the rows each prefilled (prompt, and a resumed request's output), the position its token
        is drawn at."""
        B = len(done)
        dev = self.device
        slots = rows.slots
        params = [p.req.params for p in done]
        sp = BatchSampling.build(params, dev, self.logprobs_mode.startswith("processed"))
        logits = raw = self.model.logits(hidden.view(-1, hidden.shape[-1])[rows.last])   # [B, V]
        counts = None
        if any(q.uses_processors for q in params):
            # the next token after the prompt and what a resumed request generated (min_tokens);
            # penalties count the generated tokens, the prompt's present
            st = self.state
            vocab = self.model.cfg.vocab_size
            prompts = [p.req.prompt_ids for p in done]
            outputs = [p.req.output_ids for p in done]
            prompt_lens = [len(q) for q in prompts]
            generated = to_device([len(o) for o in outputs], torch.int64, dev)
            proc = Processors.build(list(zip(params, prompt_lens)), self.stops.eos_ids, vocab, dev)
            state = None
            if proc.penalties:
                counts, prompt_mask = st.penalty_state(vocab)
                reset_slots(counts, prompt_mask, slots, _padded(prompts, dev), to_device(prompt_lens, torch.int64, dev))
                if any(outputs):
                    count_tokens(counts, slots, _padded(outputs, dev), generated)
                state = counts, prompt_mask, slots
            zero = torch.zeros(B, 1, dtype=torch.int64, device=dev)
            logits = proc.apply(logits[:, None, :], zero, generated, zero, None, state)[:, 0]
        first = sample(logits, sp, lengths)
        if counts is not None:
            count_tokens(counts, slots, first[:, None], torch.ones_like(first))
        asked = [q.logprobs for q in params if q.logprobs is not None]
        if not asked:
            return first, None, sp
        zero = torch.zeros(B, 1, dtype=torch.int64, device=dev)
        return first, emitted_logprobs(raw[:, None, :], logits[:, None, :], zero, first[:, None], sp, max(asked),
                                       self.logprobs_mode), sp


def _padded(seqs: list[list[int]], device: torch.device) -> torch.Tensor:
    """Token lists as one right-padded [B, max(1, longest)] tensor on `device`."""
    out = torch.zeros(len(seqs), max(1, max(map(len, seqs))), dtype=torch.int64)
    for i, q in enumerate(seqs):
        out[i, : len(q)] = torch.tensor(q, dtype=torch.int64)
    return out.to(device, non_blocking=True)
