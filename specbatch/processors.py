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
    """Per-row processor parameters of a batch, as tensors on the device."""
    stop_ids: torch.Tensor      # [R, KS] int64: tokens masked while fewer than min_tokens were generated
    stop_on: torch.Tensor       # [R, KS] float32: 1 for a real entry, 0 for padding
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
        biases = [list(p.logit_bias) for p, _ in rows]
        if key is None:
            key = (max(map(len, stops), default=0), max(map(len, biases), default=0),
                   any(p.uses_penalties for p, _ in rows))
        ks, kb, penalties = key
        if any(len(s) > ks for s in stops) or any(len(b) > kb for b in biases):
            raise ValueError("processor widths too small for the batch")

        def pad(ids: list[int], width: int) -> list[int]:
            return ids + [ids[0] if ids else 0] * (width - len(ids))   # duplicates of a real id: harmless

        f32 = dict(dtype=torch.float32)
        return cls(
            stop_ids=torch.tensor([pad(s, ks) for s in stops], dtype=torch.int64).view(len(rows), ks),
            stop_on=torch.tensor([[1.0] * len(s) + [0.0] * (ks - len(s)) for s in stops], **f32).view(len(rows), ks),
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
              tokens: torch.Tensor, ancestors: torch.Tensor | None, counts: torch.Tensor | None,
              prompt_mask: torch.Tensor | None) -> torch.Tensor:
        """logits [B, N, V] at the nodes of a tree -> processed float32 logits [B, N, V].

        depths [B, N] node depths; generated [B] tokens generated before the root's successor
        (the root included); tokens [B, N] node tokens (node 0 the root); ancestors [B, N, N]
        (node i sees j: j is i or an ancestor of i; None: a chain); counts [B, V] int32 and
        prompt_mask [B, V] bool: the slots' penalty state (needed when `penalties`)."""
        B, N, V = logits.shape
        dev = logits.device
        x = logits.float()
        if self.stop_ids.shape[1]:
            stop = torch.zeros(B, V, device=dev).scatter_add_(1, self.stop_ids, self.stop_on) > 0
            active = (generated[:, None] + depths) < self.min_tokens[:, None]                  # [B, N]
            x = x.masked_fill(active[:, :, None] & stop[:, None, :], float("-inf"))
        if self.bias_ids.shape[1]:
            bias = torch.zeros(B, V, device=dev).scatter_add_(1, self.bias_ids, self.bias_vals)
            x = x + bias[:, None, :]
        if self.penalties:
            x = self._penalise(x, tokens, ancestors, counts, prompt_mask)
        return x

    def _penalise(self, x: torch.Tensor, tokens: torch.Tensor, ancestors: torch.Tensor | None,
                  counts: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Repetition, frequency, presence. Every vocabulary entry first with the slot's committed
        counts; then the entries of the path tokens (at most N per node) again with the path
        counted in, so no [B, N, V] count tensor is built."""
        B, N, V = x.shape
        r, f, p = (t[:, None, None] for t in (self.repetition, self.frequency, self.presence))
        base = counts.float()                                                          # [B, V]
        out = _penalty(x, base[:, None, :], (counts > 0)[:, None, :] | prompt_mask[:, None, :], r, f, p)
        if N == 1:
            return out                                  # the root alone: already counted
        if ancestors is None:
            ancestors = torch.ones(N, N, dtype=torch.bool, device=x.device).tril().expand(B, N, N)
        path = ancestors.clone()
        path[:, :, 0] = False                           # the root is in the committed counts
        same = (tokens[:, :, None] == tokens[:, None, :]).float()                      # [B, N, N]
        # count of node j's token as node n sees it: committed + its occurrences on n's path
        cnt = base.gather(1, tokens)[:, None, :] + torch.bmm(path.float(), same)        # [B, n, j]
        idx = tokens[:, None, :].expand(B, N, N)
        present = prompt_mask.gather(1, tokens)[:, None, :] | (cnt > 0)
        val = _penalty(x.gather(2, idx), cnt, present, r, f, p)
        # Entries of one token id all hold the same value, so duplicate indices agree.
        return out.scatter(2, idx, val)


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
