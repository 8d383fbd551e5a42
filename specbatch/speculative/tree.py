"""Draft trees: candidate scores in log space, the global top-(N-1) choice, masks and positions.

A tree of N nodes per sequence: node 0 is the root (the last emitted token), nodes 1..N-1 are
draft candidates ordered by depth. `parents[b, i]` is the parent node (-1 for the root),
`depths[b, i]` the distance from the root (RoPE position = committed length + depth), and
`mask[b, i, j]` says node i sees node j (its ancestors and itself).
"""
from __future__ import annotations

import torch


def child_scores(parent: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """score(child) = score(parent) + log p(child), strictly below the parent's score.

    Summing log-probabilities (not multiplying probabilities) keeps deep trees from
    underflowing. Strictness (nextafter when log p rounds to 0) makes every top-n set of
    candidates ancestor-closed: a chosen child always has its parent chosen.
    """
    s = parent + logp
    return torch.minimum(s, torch.nextafter(parent, torch.full_like(parent, float("-inf"))))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents [B, N] -> [B, N, N] bool: node i sees node j iff j is i or an ancestor of i."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    up = parents.clamp(min=0)[:, :, None].expand(B, N, N)
    mask = eye
    for _ in range(max_depth):
        mask = eye | torch.gather(mask, 1, up)
    return mask


def chain(batch: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depths) [B, n] of a chain: node i's parent is i - 1."""
    i = torch.arange(n, device=device)
    return (i - 1).expand(batch, n), i.expand(batch, n)


def choose_tree(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, root: torch.Tensor, num_nodes: int, max_depth: int):
    """Pick the best num_nodes-1 candidates of every sequence and lay them out as a tree.

    tokens / scores / parents [B, C]: candidates in depth order, parents as candidate indices
    (-1 = child of the root); depths [C]; root [B] the root token.
    Returns (node tokens [B, N] root first, parents [B, N], depths [B, N], mask [B, N, N]).
    """
    B, C = scores.shape
    dev = scores.device
    chosen = scores.topk(num_nodes - 1, dim=1).indices.sort(dim=1).values          # [B, N-1]
    node_of = torch.full((B, C), -1, dtype=torch.int64, device=dev)
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes, device=dev).expand(B, -1))
    pc = parents.gather(1, chosen)
    pnode = torch.where(pc < 0, 0, node_of.gather(1, pc.clamp(min=0)))
    node_parents = torch.cat([torch.full((B, 1), -1, dtype=torch.int64, device=dev), pnode], dim=1)
    node_depths = torch.cat([torch.zeros(B, 1, dtype=torch.int64, device=dev), depths[chosen]], dim=1)
    node_tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], dim=1)
    return node_tokens, node_parents, node_depths, ancestor_mask(node_parents, max_depth)
