"""Acceptance: a pure tensor function from the verified tree and the target's logits to the
emitted tokens. Greedy and sampling share one walk.

At every node the target's token for the next position is drawn first: the argmax for greedy
rows, for sampled rows the seeded race of plain sampling (temperature, min-p, top-k, top-p;
`sampling.sample`) at position start + 1 + depth. Then from the root, level by level, the first
child (node order) holding the current node's drawn token is accepted; if none does, that token
is the emitted correction and the walk stops. Each emitted token is thus exactly the token plain
sampling draws at its position from the same prefix: its marginal is p for any deterministic
candidate set, a child is accepted with probability p(child) (min(1, p/q) for a draft's one-hot
choice q: the most any lossless rule accepts), a rejection's token follows the residual
norm(p with the children removed), and a seeded request emits the same tokens with or without a
draft. Siblings share a depth's uniforms, but a walk visits one node a depth.

On GPU the draws are one filtered-draw launch over every node (kernels/filtered_draw.py: no
filtered distribution is built) and the walk one more (kernels/accept.py).
"""
from __future__ import annotations

from dataclasses import dataclass
import torch

from .. import kernels
from ..sampling import BatchSampling, sample
from .topk import top1
from .tree import ancestor_mask


@dataclass
class Acceptance:
    tokens: torch.Tensor   # [B, D+1] emitted tokens; the first num[b] are valid
    num: torch.Tensor      # [B] tokens emitted: accepted drafts + 1
    path: torch.Tensor     # [B, D+1] tree node of each emitted row's input: path[:, 0] = 0 (root)


def accept(node_tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
           sp: BatchSampling, start: torch.Tensor, max_depth: int,
           depths: torch.Tensor | None = None) -> Acceptance:
    """node_tokens / parents [B, N] (node 0 the root), logits [B, N, V] from the target at every
    node (any float dtype; sampling works in float32), start [B] the committed length (node
    depth d decides position start+1+d); depths [B, N] the nodes' depths (None: from parents)."""
    if depths is None:
        depths = ancestor_mask(parents, max_depth).sum(dim=2) - 1      # ancestors, itself included
    return walk(node_tokens, parents, target_tokens(logits, sp, start, depths), max_depth)


def target_tokens(logits: torch.Tensor, sp: BatchSampling, start: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] -> [B, N] int64, the token the target emits after each node: greedy rows'
    argmax (the first of equal maxima), sampled rows' seeded draw for position start + 1 + depth."""
    if sp.all_greedy:
        return greedy_targets(logits)
    B, N, V = logits.shape
    pos = (start[:, None] + 1 + depths).reshape(B * N)
    return sample(logits.reshape(B * N, V), sp.repeat_rows(N) if N > 1 else sp, pos).view(B, N)


def greedy_targets(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] -> the target's argmax at every node [B, N] int64 (the first of equal
    maxima): the fused top-1 pass on GPU, a plain argmax elsewhere."""
    return top1(logits)[0] if kernels.active(logits) else logits.argmax(dim=-1)


def walk(node_tokens: torch.Tensor, parents: torch.Tensor, targets: torch.Tensor, max_depth: int) -> Acceptance:
    """The walk from the target's token after every node, targets [B, N] int64: at each level the
    first child (node order) holding the current node's target token is accepted, else that token
    is the emitted correction and the row stops. One launch on GPU (kernels/accept.py), torch ops
    elsewhere; the bench's simulated acceptance goes through it too."""
    if kernels.active(targets):
        from ..kernels.accept import walk_targets

        tokens, num, path = walk_targets(node_tokens, parents, targets, max_depth)
        return Acceptance(tokens=tokens, num=num, path=path)
    B, N = node_tokens.shape
    dev = node_tokens.device
    rows = torch.arange(B, device=dev)
    kids_of = parents[:, None, :] == torch.arange(N, device=dev)[None, :, None]     # [b, n, c]: c a child of n
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    num = torch.zeros(B, dtype=torch.int64, device=dev)
    tokens = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=dev)
    path = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=dev)
    for d in range(max_depth + 1):
        tok = targets[rows, cur]
        hit = kids_of[rows, cur] & (node_tokens == tok[:, None])
        tokens[:, d] = torch.where(alive, tok, 0)
        num += alive.to(torch.int64)
        alive &= hit.any(dim=1)
        cur = torch.where(alive, hit.to(torch.int8).argmax(dim=1), cur)      # the first matching child
        if d < max_depth:
            path[:, d + 1] = cur
    return Acceptance(tokens=tokens, num=num, path=path)
