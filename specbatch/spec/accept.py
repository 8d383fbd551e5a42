"""Acceptance: pure tensor functions from target logits and a proposal to emitted tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import BatchSampling, sample


@dataclass
class Acceptance:
    tokens: torch.Tensor   # [B, N] emitted tokens; the first num[b] are valid (accepted drafts, then the bonus)
    num: torch.Tensor      # [B] tokens emitted, >= 1


def target_tokens(logits: torch.Tensor, sp: BatchSampling, start: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] -> the target's own choice at every node [B, N].

    Node i predicts the token at sequence position start + 1 + i, which is its RNG counter.
    """
    B, N, V = logits.shape
    pos = start[:, None] + 1 + torch.arange(N, device=logits.device)
    return sample(logits.reshape(B * N, V), sp.repeat_rows(N), pos.reshape(-1)).view(B, N)


def greedy_chain(draft: torch.Tensor, target: torch.Tensor) -> Acceptance:
    """draft [B, N-1], target [B, N]: accept drafts while each equals the target's choice before it.

    The emitted tokens are the matched drafts followed by the target's token at the first
    mismatch (or after the last draft): exactly the target's own tokens target[:, :num].
    """
    match = (draft == target[:, :-1]).to(torch.int64)           # [B, N-1]
    accepted = match.cumprod(dim=1).sum(dim=1)                  # [B]
    return Acceptance(tokens=target, num=accepted + 1)
