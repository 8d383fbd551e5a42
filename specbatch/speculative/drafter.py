"""Drafters propose tokens for the target to verify. Vanilla decoding is the drafter that proposes none."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .accept import Acceptance
from .tree import chain


@dataclass
class Proposal:
    """The tree the target verifies this cycle, N nodes per sequence, node 0 the root."""
    tokens: torch.Tensor             # [B, N] node tokens: the last emitted token, then drafts
    parents: torch.Tensor            # [B, N] parent node, -1 for the root
    depths: torch.Tensor             # [B, N] distance from the root (RoPE position offset)
    tree_mask: torch.Tensor | None   # [B, N, N] ancestor mask, None for a chain (causal)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, w: int) -> "Proposal":
        """The first w nodes (parents precede children, so a tree; two nodes are a chain)."""
        if w >= self.width:
            return self
        mask = None if self.tree_mask is None or w <= 2 else self.tree_mask[:, :w, :w].contiguous()
        return Proposal(tokens=self.tokens[:, :w].contiguous(), parents=self.parents[:, :w].contiguous(),
                        depths=self.depths[:, :w].contiguous(), tree_mask=mask)


class Drafter:
    """The interface every drafter implements; this base proposes nothing (N = 1)."""

    num_draft_tokens: int = 1                 # N, the root included
    max_depth: int = 0                        # longest root-to-leaf path (drafts a cycle can accept)
    capture_layers: tuple[int, ...] = ()      # target layers whose outputs the drafter reads
    reads_final_hidden: bool = False          # ... or the target's final-normed hidden state (MTP)
    graphable: bool = True                    # propose/extend are pure tensor work (CUDA graphs)
    scratch_rows: int = 0                     # cache rows past a slot's committed length it writes

    def prefill(self, slots: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
                captured: list[torch.Tensor], first_tokens: torch.Tensor) -> None:
        """Catch up on prompts the target just prefilled ([B, T] right-padded) and their first tokens."""

    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor, lens: torch.Tensor,
                kv_bound: int | None = None) -> Proposal:
        """Draft from each slot's state; lens [B] are committed lengths (the root sits at lens);
        kv_bound >= max(lens), a host int (None: read from lens, a host sync)."""
        parents, depths = chain(last_tokens.shape[0], 1, last_tokens.device)
        return Proposal(tokens=last_tokens[:, None], parents=parents, depths=depths, tree_mask=None)

    def extend(self, slots: torch.Tensor, lens: torch.Tensor, acc: Acceptance,
               captured: list[torch.Tensor], kv_bound: int | None = None) -> None:
        """Catch up on the tokens accepted this cycle (captured: target states at every node)."""


class NoDrafter(Drafter):
    """Vanilla decoding: one target forward per emitted token."""
