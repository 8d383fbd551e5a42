"""Logprobs: of the emitted tokens, in one of vLLM's four modes (`LOGPROBS_MODES`: the model's raw
distribution by default, as vLLM's `--logprobs-mode raw_logprobs`; or the processed distribution
each token was drawn from, after the bias, penalties, temperature and filters; or the logits
themselves), and of the prompt's tokens (always the model's raw distribution, as vLLM returns
prompt_logprobs: nothing was sampled there)."""
from __future__ import annotations

from typing import Callable

import torch

from ..request import Request
from ..sampling import BatchSampling

PROMPT_CHUNK = 1024       # prompt positions per log-softmax ([chunk, V] float32 at a time)

def emitted_logprobs(raw: torch.Tensor, processed: torch.Tensor, path: torch.Tensor, tokens: torch.Tensor,
                     sp: BatchSampling, k: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw and processed logits [B, N, V] at every node, the acceptance's path [B, W] (token d
    was drawn at node path[:, d]) and emitted tokens [B, W] -> ([B, W, 2 + k] the tokens' values,
    their ranks (1 = the likeliest, as vLLM's; float) then the top k values, [B, W, k] the top
    ids), in `mode` (LOGPROBS_MODES; processed greedy rows: no temperature, no filters)."""
    logits = raw if mode.startswith("raw") else processed
    B, N, V = logits.shape
    W = path.shape[1]
    at = logits.gather(1, path[:, :, None].expand(B, W, V)).float().reshape(B * W, V)
    if mode == "raw_logprobs":
        lp = at.log_softmax(dim=-1).view(B, W, V)
    elif mode == "raw_logits":
        lp = at.view(B, W, V)
    elif mode == "processed_logprobs":
        lp = sp.repeat_rows(W).target_logprobs(at).view(B, W, V)
    else:
        lp = sp.repeat_rows(W).target_logits(at).view(B, W, V)
    top, ids = lp.topk(k, dim=-1)
    own = lp.gather(2, tokens[:, :, None])
    rank = (lp > own).sum(dim=2, keepdim=True).to(lp.dtype) + 1
    values = torch.cat([own, rank, top], dim=2)
    if mode.startswith("processed"):
        ids = _filtered_lowest_first(lp, top, ids)
    return values, ids


def _filtered_lowest_first(lp: torch.Tensor, top: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Top ids [..., k] whose -inf entries (tokens the filters removed, when fewer than k remain)
    are the lowest removed ids, ascending: which of equal -inf values topk returns varies with the
    batch and the kernel. With fewer than k kept, the k lowest removed ids lie below 2k: only
    those columns are read."""
    k, V = top.shape[-1], lp.shape[-1]
    m = min(V, 2 * k)
    head = lp[..., :m]
    order = torch.arange(m, device=lp.device, dtype=lp.dtype).neg()            # -id: lower ids first
    low = torch.where(head == float("-inf"), order, float("-inf")).topk(k, dim=-1).indices   # [..., k]
    kept = (top > float("-inf")).sum(dim=-1, keepdim=True)
    at = (torch.arange(k, device=lp.device) - kept).clamp(min=0)
    return torch.where(top == float("-inf"), low.gather(-1, at), ids)


def add_logprobs(req: Request, lps: list[list[float]], ids: list[list[int]]) -> None:
    """Append the kept tokens' logprobs (host lists from emitted_logprobs) to the request:
    (logprob, rank, top k ids, top k values) a token."""
    k = req.params.logprobs or 0
    for lp, top in zip(lps, ids):
        req.logprobs.append((lp[0], int(lp[1]), top[:k], lp[2: 2 + k]))


def prompt_token_logprobs(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          ids: torch.Tensor, k: int) -> list[tuple[float, int, list[int], list[float]]]:
    """hidden [n, H] (final-normed, one prompt), ids [n] -> per prompt token after the first:
    (logprob, rank (1 = the likeliest), top k ids, top k logprobs) under the model's distribution
    at the position before it."""
    out = []
    n = ids.shape[0]
    for a in range(0, n - 1, PROMPT_CHUNK):
        b = min(n - 1, a + PROMPT_CHUNK)
        lp = torch.log_softmax(logits(hidden[a:b]).float(), dim=-1)                # [m, V]
        tok = lp.gather(1, ids[a + 1: b + 1, None])                               # [m, 1]
        rank = (lp > tok).sum(dim=1) + 1
        top, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], ids.new_zeros(b - a, 0))
        out += zip(tok[:, 0].tolist(), rank.tolist(), top_ids.tolist(), top.tolist())
    return out
