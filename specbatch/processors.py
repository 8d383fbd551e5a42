"""Logits processors that act before temperature: min_tokens, logit_bias and the presence,
frequency and repetition penalties, in vLLM's order (min_tokens, logit_bias, repetition,
frequency, presence; then temperature, min-p, top-k, top-p in sampling.py).

Exact under speculation: the logits at tree node n of row b are processed with the state plain
decoding would have at that point, i.e. with the draft tokens on the path from the root to n
counted as generated: the generated length (for min_tokens) is the committed count plus n's
depth, and the token counts (for the penalties) are the slot's committed counts plus the tokens
of n's ancestors below the root and n itself. The acceptance walk, the seeded draws, greedy
argmaxes and logprobs then all see what vanilla decoding would see.

Per-slot device state (cycle.SlotState, allocated when the first request with a penalty
arrives): `counts` [slots+1, V] int32, how often each token was generated (the root included:
every emitted token), advanced at commit with the accepted tokens; `prompt_mask` [slots+1, V]
bool, the prompt's tokens (the repetition penalty covers the prompt too). Every function here
is fixed-shape tensor work with no host synchronisation (captured in the cycle's graphs).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import torch

from . import kernels
from .params import SamplingParams
from .sampling import FLOAT32_MAX

Row = tuple[SamplingParams, int]        # a request's params and its prompt length


def _bucket(n: int) -> int:
    """Fixed widths for captured graphs: 0, else a power of two >= 4."""
    return 0 if n <= 0 else max(4, 1 << (n - 1).bit_length())


def stop_set(p: SamplingParams, eos_ids: Iterable[int], vocab: int) -> list[int]:
    """The tokens min_tokens masks: stop_token_ids, and the EOS ids unless ignore_eos (vLLM's
    'all stop token ids'); ids outside the vocabulary can never be generated and are left out."""
    ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
    return sorted(t for t in ids if 0 <= t < vocab)


def processors_key(rows: Sequence[Row], eos_ids: Iterable[int], vocab: int) -> tuple[int, int, bool] | None:
    """The graph variant a batch needs: None when no row uses a processor, else (stop width,
    bias width, penalties) with widths bucketed."""
    used = [p for p, _ in rows if p.uses_processors]
    if not used:
        return None
    eos = tuple(eos_ids)
    ks = max((len(stop_set(p, eos, vocab)) for p in used if p.min_tokens > 0), default=0)
    kb = max((len(p.logit_bias) for p in used), default=0)
    return _bucket(ks), _bucket(kb), any(p.uses_penalties for p in used)


@dataclass
class Processors:
    """Per-row processor parameters of a batch, as tensors on the device. Id lists are sorted and
    padded by repeating their last id (0 when empty), so each is both valid gather indices and a
    table `searchsorted` finds an id's first (real) entry in."""
    stop_ids: torch.Tensor      # [R, KS] int64: tokens masked while fewer than min_tokens were generated
    stop_on: torch.Tensor       # [R, KS] bool: a real entry (padding: False)
    min_tokens: torch.Tensor    # [R] int64
    prompt_len: torch.Tensor    # [R] int64 (generated = committed length + 1 - prompt length)
    bias_ids: torch.Tensor      # [R, KB] int64
    bias_vals: torch.Tensor     # [R, KB] float32 (0 for padding)
    presence: torch.Tensor      # [R] float32
    frequency: torch.Tensor     # [R] float32
    repetition: torch.Tensor    # [R] float32
    penalties: bool             # some row uses a penalty: the count path runs

    @classmethod
    def build(cls, rows: Sequence[Row], eos_ids: Iterable[int], vocab: int, device: torch.device,
              key: tuple[int, int, bool] | None = None) -> "Processors":
        """`key`: fixed widths and the penalty flag (a captured graph's); None: what the rows need."""
        eos = tuple(eos_ids)
        stops = [stop_set(p, eos, vocab) if p.min_tokens > 0 else [] for p, _ in rows]
        biases = [_summed(p.logit_bias) if p.logit_bias else [] for p, _ in rows]
        if key is None:
            key = (max(map(len, stops), default=0), max(map(len, biases), default=0),
                   any(p.uses_penalties for p, _ in rows))
        ks, kb, penalties = key
        if any(len(s) > ks for s in stops) or any(len(b) > kb for b in biases):
            raise ValueError("processor widths too small for the batch")

        def pad(ids: list[int], width: int) -> list[int]:
            return ids + [ids[-1] if ids else 0] * (width - len(ids))

        f32 = dict(dtype=torch.float32)
        return cls(
            stop_ids=torch.tensor([pad(s, ks) for s in stops], dtype=torch.int64).view(len(rows), ks),
            stop_on=torch.tensor([[True] * len(s) + [False] * (ks - len(s)) for s in stops],
                                 dtype=torch.bool).view(len(rows), ks),
            min_tokens=torch.tensor([p.min_tokens for p, _ in rows], dtype=torch.int64),
            prompt_len=torch.tensor([n for _, n in rows], dtype=torch.int64),
            bias_ids=torch.tensor([pad([t for t, _ in b], kb) for b in biases], dtype=torch.int64).view(len(rows), kb),
            bias_vals=torch.tensor([[v for _, v in b] + [0.0] * (kb - len(b)) for b in biases], **f32).view(len(rows), kb),
            presence=torch.tensor([p.presence_penalty for p, _ in rows], **f32),
            frequency=torch.tensor([p.frequency_penalty for p, _ in rows], **f32),
            repetition=torch.tensor([p.repetition_penalty or 1.0 for p, _ in rows], **f32),
            penalties=penalties,
        ).to(device)

    def to(self, device: torch.device) -> "Processors":
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, v.to(device, non_blocking=True))      # queued: host.py
        return self

    def copy_(self, src: "Processors") -> None:
        """Refill static buffers (a captured graph's) in place."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v.copy_(getattr(src, f.name), non_blocking=True)      # stream-ordered (cycle._fill)

    def apply(self, logits: torch.Tensor, depths: torch.Tensor, generated: torch.Tensor,
              tokens: torch.Tensor, ancestors: torch.Tensor | None,
              state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """logits [B, N, V] at the nodes of a tree -> processed float32 logits [B, N, V] (a new tensor).

        depths [B, N] node depths; generated [B] tokens generated before the root's successor
        (the root included); tokens [B, N] node tokens (node 0 the root); ancestors [B, N, N]
        (node i sees j: j is i or an ancestor of i; None: a chain); state (needed when
        `penalties`): counts [S, V] int32, prompt_mask [S, V] bool and the batch's slots [B].

        Two passes. Every entry with what only its slot decides: the penalties with the committed
        counts (one kernel on GPU), else a float32 copy. Then the entries a row names, recomputed
        whole and written over: its stop ids, its biased ids and, under penalties, the ids of its
        nodes' tokens (counted again with each node's path). A few dozen entries a row, so no
        [B, N, V] mask, bias or count tensor is built."""
        B, N, V = logits.shape
        if self.penalties:
            counts, prompt_mask, slots = state
            out = dense_penalties(logits, counts, prompt_mask, slots, self.repetition, self.frequency, self.presence)
        else:
            out = logits.to(torch.float32, copy=True)
        named = [self.stop_ids, self.bias_ids] + ([tokens] if self.penalties and N > 1 else [])
        ids = torch.cat(named, dim=1)                                                  # [B, M]
        if ids.shape[1] == 0:
            return out
        at = ids[:, None, :].expand(B, N, ids.shape[1])
        x = logits.gather(2, at).float()                                               # [B, N, M]
        if self.bias_ids.shape[1]:
            x = x + _lookup(self.bias_ids, self.bias_vals, ids)[:, None, :]
        if self.penalties:
            x = self._penalise(x, ids, tokens, ancestors, counts, prompt_mask, slots)
        if self.stop_ids.shape[1]:
            stop = _lookup(self.stop_ids, self.stop_on, ids)                          # [B, M]
            active = (generated[:, None] + depths) < self.min_tokens[:, None]          # [B, N]
            x = x.masked_fill(active[:, :, None] & stop[:, None, :], float("-inf"))
        # Entries of one id hold the same value (the same computation), so repeated ids agree.
        return out.scatter_(2, at, x)

    def _penalise(self, x: torch.Tensor, ids: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor | None,
                  counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Repetition, frequency, presence at the named ids [B, M], with each node's path
        counted in: node n sees id q generated (committed count) + (times q is a token on n's
        path below the root) times."""
        B, N, M = x.shape
        r, f, p = (t[:, None, None] for t in (self.repetition, self.frequency, self.presence))
        committed = counts[slots[:, None], ids].float()                              # [B, M]
        seen = prompt_mask[slots[:, None], ids]
        cnt = committed[:, None, :].expand(B, N, M)
        if N > 1:
            if ancestors is None:
                ancestors = torch.ones(N, N, dtype=torch.bool, device=x.device).tril().expand(B, N, N)
            path = ancestors.clone()
            path[:, :, 0] = False                       # the root is in the committed counts
            same = (tokens[:, :, None] == ids[:, None, :]).float()                     # [B, N, M]
            cnt = cnt + torch.bmm(path.float(), same)
        return _penalty(x, cnt, seen[:, None, :] | (cnt > 0), r, f, p)


def _summed(pairs: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """(id, bias) pairs sorted by id, a repeated id's biases added up (as a scatter-add would)."""
    summed: dict[int, float] = {}
    for t, v in pairs:
        summed[t] = summed.get(t, 0.0) + v
    return sorted(summed.items())


def dense_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] -> float32 [B, N, V], every entry penalised with its slot's committed
    counts: kernels/penalties.py on GPU (one pass, by slot), torch ops elsewhere."""
    if kernels.active(logits) and logits.stride(2) == 1:
        from .kernels.penalties import penalties
        return penalties(logits, counts, prompt_mask, slots, repetition, frequency, presence)
    c = counts[slots]                                                                  # [B, V]
    r, f, p = (t[:, None, None] for t in (repetition, frequency, presence))
    return _penalty(logits.float(), c.float()[:, None, :], ((c > 0) | prompt_mask[slots])[:, None, :], r, f, p)


def _lookup(table: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [B, K] sorted ids (padding repeats the last), vals [B, K]: vals at each of ids [B, M]
    found in its row's table, else zero (False for a bool vals)."""
    at = torch.searchsorted(table, ids).clamp_(max=table.shape[1] - 1)
    hit = table.gather(1, at) == ids
    v = vals.gather(1, at)
    return hit & v if v.dtype == torch.bool else torch.where(hit, v, 0.0)


def _penalty(x: torch.Tensor, count: torch.Tensor, present: torch.Tensor, r: torch.Tensor,
             f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """vLLM's formulas: repetition divides positive logits by r and multiplies the others, for
    tokens in the prompt or generated; then logit -= frequency * count + presence * (count > 0)."""
    # Kept finite: a tiny r (1e-45 is a float32 denormal) sends x / r to inf and an r past float32's
    # range makes 0 * r NaN; softmax of an inf is NaN, which samples token 0.
    scaled = torch.where(x > 0, x / r, torch.where(x < 0, x * r, x))
    scaled = torch.where(torch.isfinite(x), scaled.clamp(-FLOAT32_MAX, FLOAT32_MAX), x)   # masked: -inf stays
    x = torch.where(present, scaled, x)
    return x - f * count - p * (count > 0).float()


def reset_slots(counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor,
                prompts: torch.Tensor, lengths: torch.Tensor) -> None:
    """Fresh penalty state for prefilled slots: no generated tokens, the prompt's tokens present.
    prompts [B, T] right-padded with lengths [B]."""
    B, T = prompts.shape
    counts[slots] = 0
    real = (torch.arange(T, device=prompts.device)[None, :] < lengths[:, None]).float()
    mask = torch.zeros(B, counts.shape[1], device=prompts.device).scatter_add_(1, prompts, real) > 0
    prompt_mask[slots] = mask


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor) -> None:
    """counts[slot] += the first num[b] tokens of tokens[b] (the emitted ones)."""
    B, W = tokens.shape
    valid = torch.arange(W, device=tokens.device)[None, :] < num[:, None]
    flat = (slots[:, None] * counts.shape[1] + tokens).reshape(-1)
    counts.view(-1).scatter_add_(0, flat, valid.reshape(-1).to(counts.dtype))
