"""Draft token selection: top-k with log-probabilities, and the exact top-1 fast path.

Top-1 (k = 1) never builds a [rows, vocab] probability tensor: the max, its index and the
log-sum-exp give the token and its exact probability exp(max - lse). A constant probability of
1.0 is what a public engine once shipped for this path and had to revert (an MTP deployment's
accuracy collapsed): whatever reads these probabilities gets the real ones. On GPU the same
function becomes one fused Triton pass.
"""
from __future__ import annotations

import torch

from .. import kernels

# Finite stand-in for log(0): keeps scores ordered and sums of them finite.
LOG_ZERO = -1e30


def top1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (argmax [...] (lowest index among ties), its log-probability [...]).

    Rows that are all -inf give token 0 with log-probability LOG_ZERO; rows holding +inf give
    the mass to the +inf entries.
    """
    if kernels.active(logits) and logits.shape[-1] > 0:
        from ..kernels.top1 import top1 as fused_top1

        idx, logp = fused_top1(logits.reshape(-1, logits.shape[-1]))
        return idx.view(logits.shape[:-1]), logp.view(logits.shape[:-1])
    x = logits.float()
    m, idx = x.max(dim=-1)
    # max - lse computed as -log(sum(exp(x - max))): exact even when |max| dwarfs log(V).
    logp = -(x - m[..., None]).logsumexp(dim=-1)
    # +inf entries share all the mass.
    logp = torch.where(torch.isposinf(m), -torch.log((x == m[..., None]).sum(dim=-1).float()), logp)
    return idx, logp.nan_to_num(nan=LOG_ZERO, neginf=LOG_ZERO)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (top-k indices [..., k], their log-probabilities [..., k]), best first."""
    if k == 1:
        idx, logp = top1(logits)
        return idx[..., None], logp[..., None]
    logp = torch.log_softmax(logits.float(), dim=-1).nan_to_num(nan=LOG_ZERO, neginf=LOG_ZERO)
    vals, idx = logp.topk(k, dim=-1)
    return idx, vals
