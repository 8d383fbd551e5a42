"""Simulated acceptance, for `specbatch bench` only: step times of a draft at real shapes with
random weights (whose drafts the target never accepts) under a chosen acceptance profile.

The d-th draft along the first-child path of the tree is accepted with probability probs[d-1]
given that the drafts before it were; the token after the last accepted draft is the target's
greedy choice at that node. Outputs are meaningless text; cycle costs (verify width, KV
compaction, catch-up length) are exactly those of a real run with these acceptance rates.
"""
from __future__ import annotations

import torch

from .accept import Acceptance
from .drafter import Proposal


def simulate_acceptance(prop: Proposal, target_argmax: torch.Tensor, probs: torch.Tensor,
                        max_depth: int) -> Acceptance:
    """target_argmax [B, N], probs [max_depth] float32 (conditional per-position acceptance)."""
    B, N = prop.tokens.shape
    dev = prop.tokens.device
    rows = torch.arange(B, device=dev)
    kids_of = prop.parents[:, None, :] == torch.arange(N, device=dev)[None, :, None]   # [B, N, N]
    has_child = kids_of.any(dim=2)
    first_child = kids_of.to(torch.int8).argmax(dim=2)
    u = torch.rand(B, max_depth + 1, device=dev)
    accept_p = torch.cat([probs, probs.new_zeros(1)])                                   # no child past the deepest level
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    tokens = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=dev)
    path = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=dev)
    for d in range(max_depth + 1):
        child = first_child[rows, cur]
        ok = has_child[rows, cur] & (u[:, d] < accept_p[d])
        tok = torch.where(ok, prop.tokens[rows, child], target_argmax[rows, cur])
        tokens[:, d] = torch.where(alive, tok, tokens[:, d])
        num += alive.to(torch.int64)
        alive &= ok
        cur = torch.where(alive, child, cur)
        if d < max_depth:
            path[:, d + 1] = cur
    return Acceptance(tokens=tokens, num=num, path=path)
