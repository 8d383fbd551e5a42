"""Simulated acceptance, for `specbatch bench` only: step times of a draft at real shapes with
random weights (whose drafts the target never accepts) under a chosen acceptance profile.

The walk starts at the root and, at each node, considers ONE child: the one on the path to the
deepest node of the tree (the first such child in node order when several subtrees are equally
deep; for a chain, the next node; siblings holding that child's token: the first of them, as greedy
acceptance takes it). That child, the d-th draft of the walk, is accepted with
probability probs[d-1] given that the drafts before it were; the token after the last accepted
draft is the target's own token at that node (its argmax, or a sampled row's seeded draw). So for
a tree whose deepest node is at depth D the mean number of emitted tokens is exactly
1 + P1 + P1 P2 + ... + P1...PD: the chain formula truncated at D. Positions past D cannot be
accepted because the tree verified no draft there: an honest property of the proposal, not of
the profile. (Random-weight EAGLE3 heads draft near-uniform
distributions, so their top-N trees favour width: eagle3_tree (k 4, S 5, N 8) proposes 4 nodes at
depth 1 and 3 at depth 2, D = 2, and a profile's P3 never applies there.)

How: every node's verdict is drawn up front (the uniform of its depth against that depth's
probability) and becomes a planted target token, its deepest child's token when accepted and a
token no node holds when not; the real walk (`accept.walk`, one launch on GPU) then runs on the
planted tokens and the emitted correction is replaced by the target's token at the node where the
walk stopped (`accept.target_tokens`: greedy rows' argmax, sampled rows' seeded draw, as a real run
computes them). The cycle's acceptance thus costs what a real run's does, plus a
few whole-tensor ops (a walk of small torch ops per level cost ~0.2 ms a cycle on an H100).

Following the deepest path (not the first child) matters for trees whose deep branch is not the
first one: a first-child walk would stop short of the depth the tree holds.

The uniforms come from `generator` (or torch's default generator when None, which CUDA graphs
replay correctly and the bench seeds before every point), so a seeded run is reproducible.
Outputs are meaningless text; cycle costs (verify width, KV compaction, catch-up length) are
exactly those of a real run with these acceptance rates.
"""
from __future__ import annotations

import torch

from .accept import Acceptance, target_tokens, walk
from .drafter import Drafter, Proposal, takes_width
from .tree import ancestor_mask


def deepest_child(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents / depths [B, N] -> (child [B, N], has_child [B, N]): for every node, its child whose
    subtree reaches deepest (ties: the first in node order). Pure tensor work (graph-safe)."""
    B, N = parents.shape
    dev = parents.device
    # height[n]: the greatest depth in n's subtree, pushed up one level per pass
    height = depths.clone()
    up = parents.clamp(min=0)                           # the root (-1) folds into itself: harmless
    for _ in range(max_depth):
        height = height.scatter_reduce(1, up, height, reduce="amax", include_self=True)
    kids_of = parents[:, None, :] == torch.arange(N, device=dev)[None, :, None]        # [B, n, c]
    score = height[:, None, :].expand(B, N, N).masked_fill(~kids_of, -1)
    return score.argmax(dim=2), kids_of.any(dim=2)     # argmax: the first of equal maxima


def simulate_acceptance(prop: Proposal, targets: torch.Tensor, probs: torch.Tensor,
                        max_depth: int, generator: torch.Generator | None = None) -> Acceptance:
    """targets [B, N] (the target's token after each node), probs [<= max_depth] float32
    (conditional per-position acceptance; positions past the list: 0); `generator`: where the
    acceptance uniforms come from (None: torch's default generator)."""
    B, N = prop.tokens.shape
    dev = prop.tokens.device
    if prop.tree_mask is None:                          # a chain: node n's child is n + 1
        nodes = torch.arange(N, device=dev).expand(B, N)
        child_of, has_child = (nodes + 1).clamp(max=N - 1), nodes < N - 1
    else:
        child_of, has_child = deepest_child(prop.parents, prop.depths, max_depth)
    u = torch.rand(B, max_depth + 1, device=dev, generator=generator)
    p = probs.to(device=dev, dtype=torch.float32)[:max_depth]
    accept_p = torch.cat([p, p.new_zeros(max_depth + 1 - p.numel())])     # none past the list / deepest level
    # a node at depth d is the walk's d-th level: its verdict is u[:, d] < P(d + 1)
    depth = prop.depths.clamp(max=max_depth)
    ok = has_child & (u.gather(1, depth) < accept_p[depth])
    planted = torch.where(ok, prop.tokens.gather(1, child_of), -1)       # -1: no node's token
    acc = walk(prop.tokens, prop.parents, planted, max_depth)
    # the last emitted token is always a correction (nothing is accepted at depth max_depth)
    last = (acc.num - 1)[:, None]
    acc.tokens.scatter_(1, last, targets.gather(1, acc.path.gather(1, last)))
    return acc


def simulated_acceptor(probs: tuple[float, ...], max_depth: int, device: torch.device):
    """An acceptor for the cycle (cycle.Acceptor) drawing acceptance from `probs` instead of the
    target's distribution: the bench's stand-in for trained drafts at random weights."""
    p = list(probs)[:max_depth]
    p += [0.0] * (max_depth - len(p))
    table = torch.tensor(p, dtype=torch.float32, device=device)

    def acceptor(prop: Proposal, logits: torch.Tensor, sp, lens: torch.Tensor, depth: int) -> Acceptance:
        # the target's own tokens (greedy: one fused top-1 pass on GPU; sampled: the filtered draws),
        # so the verify costs what a real run's does
        return simulate_acceptance(prop, target_tokens(logits, sp, lens, prop.depths), table, depth)

    return acceptor


class PlantedChain(Drafter):
    """A drafter whose trees always hold a chain of the full draft depth S (bench only).

    Random-weight drafts are near-uniform, so the beam's top-N trees come out wide and shallow
    (eagle3_tree at random weights never reaches depth 3) and a profile's later positions would
    never apply. This wrapper keeps the drafter's N tokens (verify, compaction and catch-up cost
    what they cost) but lays them out as a chain of min(S, N - 1) nodes from the root, the other
    nodes hanging off the root: the simulated walk then reaches depth S, so the accept length is
    1 + P1 + P1 P2 + ... as for a chain. Chains (topk 1) are left alone."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        for name in ("num_draft_tokens", "max_depth", "capture_layers", "reads_final_hidden", "graphable",
                     "scratch_rows", "shares_prompt_pages", "prompt_page_lookahead", "copies_prompt_pages"):
            setattr(self, name, getattr(inner, name, getattr(Drafter, name)))   # the base class: its default
        self._shape: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        self._inner_width = takes_width(inner.propose)          # once, not per cycle

    def __getattr__(self, name: str):
        return getattr(self.inner, name)            # the draft module (head), its caches, ...

    def copy_page(self, src: int, dst: int) -> None:
        self.inner.copy_page(src, dst)

    def prefill(self, *args, **kw):
        return self.inner.prefill(*args, **kw)

    def sample_as(self, *args, **kw):
        return self.inner.sample_as(*args, **kw)

    def extend(self, *args, **kw):
        return self.inner.extend(*args, **kw)

    def propose(self, slots, last_tokens, lens, kv_bound=None, width=None) -> Proposal:
        if self._inner_width:
            prop = self.inner.propose(slots, last_tokens, lens, kv_bound, width=width)
        else:
            prop = self.inner.propose(slots, last_tokens, lens, kv_bound)
        if prop.tree_mask is None:
            return prop
        B, N = prop.tokens.shape
        key = (N, prop.tokens.device)
        if key not in self._shape:
            depth = min(self.max_depth, N - 1)
            parents = [-1] + list(range(depth)) + [0] * (N - 1 - depth)
            depths = list(range(depth + 1)) + [1] * (N - 1 - depth)
            par = torch.tensor([parents], device=prop.tokens.device)
            self._shape[key] = (par, torch.tensor([depths], device=prop.tokens.device),
                                ancestor_mask(par, depth))
        par, dep, mask = self._shape[key]
        return Proposal(tokens=prop.tokens, parents=par.expand(B, N), depths=dep.expand(B, N),
                        tree_mask=mask.expand(B, N, N))
