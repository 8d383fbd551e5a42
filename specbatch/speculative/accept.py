"""Acceptance: a pure tensor function from the verified tree and the target's logits to the
emitted tokens. Greedy and sampling share one walk.

From the root, level by level: the target distribution p at the current node (temperature,
top-k, top-p applied; one-hot at the argmax for greedy rows) is sampled by inverse CDF with the
current node's children placed first, in node order: one uniform u accepts the first child whose
running probability sum exceeds u. If none does, the token is drawn from p with the rejected
children removed (the residual) and the walk stops. The emitted token's marginal is exactly p
for any deterministic candidate set: drafts change how many tokens a step emits, never which
distribution they come from. For a chain of greedy drafts this is the classic min(1, p/q) test
with the correction drawn from norm(max(p - q, 0)), q being the draft's one-hot choice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import kernels
from ..sampling import BatchSampling, draw, row_keys, sample, uniforms
from .topk import top1

_ACCEPT_SALT = 1      # the acceptance uniform; salt 0 is the per-vocabulary race of `draw`


@dataclass
class Acceptance:
    tokens: torch.Tensor   # [B, D+1] emitted tokens; the first num[b] are valid
    num: torch.Tensor      # [B] tokens emitted: accepted drafts + 1
    path: torch.Tensor     # [B, D+1] tree node of each emitted row's input: path[:, 0] = 0 (root)


def accept(node_tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor,
           sp: BatchSampling, start: torch.Tensor, max_depth: int) -> Acceptance:
    """node_tokens / parents [B, N] (node 0 the root), logits [B, N, V] from the target at every
    node (any float dtype; sampling works in float32), start [B] the committed length (node
    depth d decides position start+1+d)."""
    B, N, V = logits.shape
    dev = logits.device
    if sp.all_greedy:
        return greedy_walk(node_tokens, parents, greedy_targets(logits), max_depth)
    if N == 1 and kernels.active(logits):
        # nothing to accept (plain sampling): the token alone, without the filtered distribution
        tokens = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=dev)
        tokens[:, 0] = sample(logits[:, 0].float(), sp, start + 1)
        return Acceptance(tokens=tokens, num=torch.ones(B, dtype=torch.int64, device=dev), path=torch.zeros_like(tokens))
    rows = torch.arange(B, device=dev)
    kids_of = _kids_of(parents)
    argmax = logits.argmax(dim=-1)                                           # [B, N]
    probs = sp.repeat_rows(N).target_probs(logits.float().reshape(B * N, V)).view(B, N, V)
    onehot = torch.nn.functional.one_hot(argmax, V).to(probs.dtype)
    probs = torch.where((sp.temperature == 0)[:, None, None], onehot, probs)

    def level(d: int, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tok, hit = _sample_level(probs[rows, cur], node_tokens, kids_of[rows, cur], sp, start + 1 + d)
        return _first_hit(node_tokens, rows, tok, hit)

    return walk(B, max_depth, dev, level)


def greedy_targets(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] -> the target's argmax at every node [B, N] int64 (the first of equal
    maxima): the fused top-1 pass on GPU, a plain argmax elsewhere."""
    return top1(logits)[0] if kernels.active(logits) else logits.argmax(dim=-1)


def greedy_walk(node_tokens: torch.Tensor, parents: torch.Tensor, target_argmax: torch.Tensor,
                max_depth: int) -> Acceptance:
    """Greedy acceptance from the target's argmax at every node, target_argmax [B, N] int64: at
    each level the first child (node order) holding the current node's argmax is accepted, else
    that argmax is the emitted correction. One launch on GPU (kernels/accept.py), the walk here
    elsewhere; the bench's simulated acceptance goes through it too."""
    if kernels.active(target_argmax):
        from ..kernels.accept import greedy_accept

        tokens, num, path = greedy_accept(node_tokens, parents, target_argmax, max_depth)
        return Acceptance(tokens=tokens, num=num, path=path)
    B = node_tokens.shape[0]
    rows = torch.arange(B, device=node_tokens.device)
    kids_of = _kids_of(parents)

    def level(d: int, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tok = target_argmax[rows, cur]
        return _first_hit(node_tokens, rows, tok, kids_of[rows, cur] & (node_tokens == tok[:, None]))

    return walk(B, max_depth, node_tokens.device, level)


def _kids_of(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] -> [B, N, N] bool: [b, n, c] node c is a child of node n."""
    N = parents.shape[1]
    return parents[:, None, :] == torch.arange(N, device=parents.device)[None, :, None]


def _first_hit(node_tokens: torch.Tensor, rows: torch.Tensor, tok: torch.Tensor,
               hit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A level's verdict from its accepted-children mask hit [B, N]: (emitted token, accepted,
    the first accepted child)."""
    accepted = hit.any(dim=1)
    nxt = hit.to(torch.int8).argmax(dim=1)
    return torch.where(accepted, node_tokens[rows, nxt], tok), accepted, nxt


Level = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def walk(B: int, max_depth: int, device: torch.device, level: Level) -> Acceptance:
    """The root-to-leaf walk every acceptance shares: at depth d, `level(d, cur)` gives for the
    current node cur [B] the emitted token [B], whether a child was accepted [B] and that child
    [B]; a row stops at its first rejection (its token then is the correction)."""
    cur = torch.zeros(B, dtype=torch.int64, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    num = torch.zeros(B, dtype=torch.int64, device=device)
    tokens = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=device)
    path = torch.zeros(B, max_depth + 1, dtype=torch.int64, device=device)
    for d in range(max_depth + 1):
        tok, accepted, nxt = level(d, cur)
        tokens[:, d] = torch.where(alive, tok, tokens[:, d])
        num += alive.to(torch.int64)
        alive &= accepted
        cur = torch.where(alive, nxt, cur)
        if d < max_depth:
            path[:, d + 1] = cur
    return Acceptance(tokens=tokens, num=num, path=path)


def _sample_level(p: torch.Tensor, node_tokens: torch.Tensor, kids: torch.Tensor,
                  sp: BatchSampling, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, V] at the current node -> (residual token [B], accepted-child mask [B, N])."""
    kid_p = p.gather(1, node_tokens) * kids                                 # [B, N], node order
    cum = kid_p.cumsum(dim=1)
    u = uniforms(row_keys(sp.seed_lo, sp.seed_hi, pos, _ACCEPT_SALT), 1)[:, 0]
    hit = kids & (kid_p > 0) & (u[:, None] < cum)
    rejected = torch.zeros_like(p).scatter_add_(1, node_tokens, kids.to(p.dtype)) > 0
    residual = p.masked_fill(rejected, 0.0)
    # Rounding can leave u above the candidates' total when they hold all the mass: take the
    # last candidate then, since the residual is empty.
    empty = ~hit.any(dim=1) & (residual.sum(dim=1) <= 0) & (kid_p > 0).any(dim=1)
    last = torch.where(kid_p > 0, torch.arange(kids.shape[1], device=p.device), -1).argmax(dim=1)
    hit = hit | (empty[:, None] & (torch.arange(kids.shape[1], device=p.device)[None, :] == last[:, None]))
    return draw(residual, sp, pos), hit
