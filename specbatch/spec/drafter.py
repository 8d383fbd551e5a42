"""Drafters propose tokens for the target to verify. Vanilla decoding is the drafter that proposes none."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor             # [B, N-1] draft token ids (target vocabulary)
    depths: torch.Tensor             # [N] depth of each verified node, root (the last token) = 0
    tree_mask: torch.Tensor | None   # [B, N, N] bool, None = a chain (causal)

    @property
    def width(self) -> int:
        """N: tokens verified per sequence, the root included."""
        return self.depths.shape[0]


class Drafter:
    """The interface every drafter implements; this base proposes nothing (N = 1)."""

    num_draft_tokens: int = 1                 # N
    capture_layers: tuple[int, ...] = ()      # target layers whose outputs the drafter reads

    def prefill(self, slots: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                captured: list[torch.Tensor]) -> None:
        """Catch up on prompts the target just prefilled."""

    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor) -> Proposal:
        B = slots.shape[0]
        dev = slots.device
        return Proposal(tokens=torch.empty(B, 0, dtype=torch.int64, device=dev),
                        depths=torch.zeros(1, dtype=torch.int64, device=dev), tree_mask=None)

    def extend(self, slots: torch.Tensor, proposal: Proposal, accepted: torch.Tensor,
               captured: list[torch.Tensor]) -> None:
        """Catch up on the tokens the target accepted this cycle."""


class NoDrafter(Drafter):
    """Vanilla decoding: one target forward per emitted token."""
