"""Simulated acceptance (bench only): the acceptance profile it is given, on chains and trees."""
from __future__ import annotations

import contextlib

import pytest
import torch

from specbatch.speculative.drafter import Proposal
from specbatch.speculative.simulate import PlantedChain, simulate_acceptance
from specbatch.speculative.tree import ancestor_mask, chain


def _chain(B, N):
    parents, depths = chain(B, N, torch.device("cpu"))
    tokens = torch.arange(B * N).view(B, N) + 100
    return Proposal(tokens, parents, depths, None)


def test_always_and_never_accept():
    prop = _chain(4, 4)
    target = torch.full((4, 4), 7)
    acc = simulate_acceptance(prop, target, torch.ones(3), 3)
    assert acc.num.tolist() == [4] * 4
    assert acc.tokens[:, :3].tolist() == prop.tokens[:, 1:].tolist()
    assert acc.tokens[:, 3].tolist() == [7] * 4                      # bonus: the target's token
    assert acc.path.tolist() == [[0, 1, 2, 3]] * 4
    acc = simulate_acceptance(prop, target, torch.zeros(3), 3)
    assert acc.num.tolist() == [1] * 4 and acc.tokens[:, 0].tolist() == [7] * 4


def test_per_position_rates_are_conditional():
    torch.manual_seed(0)
    B = 20000
    prop = _chain(B, 4)
    acc = simulate_acceptance(prop, torch.zeros(B, 4, dtype=torch.int64), torch.tensor([0.8, 0.6, 0.45]), 3)
    n = acc.num.float()
    for d, want in enumerate([0.8, 0.8 * 0.6, 0.8 * 0.6 * 0.45], start=2):
        assert abs(float((n >= d).float().mean()) - want) < 0.015
    assert abs(float(n.mean()) - (1 + 0.8 + 0.48 + 0.216)) < 0.03


def test_tree_follows_first_children():
    # root -> nodes 1, 2; node 1 -> 3; node 3 -> 4
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    depths = torch.tensor([[0, 1, 1, 2, 3]])
    tokens = torch.tensor([[5, 11, 12, 13, 14]])
    prop = Proposal(tokens, parents, depths, ancestor_mask(parents, 3))
    acc = simulate_acceptance(prop, torch.full((1, 5), 9), torch.ones(3), 3)
    assert acc.num.tolist() == [4] and acc.path.tolist() == [[0, 1, 3, 4]]
    assert acc.tokens.tolist() == [[11, 13, 14, 9]]


# ---------------------------------------------------------------- the deepest path, statistically

P = (0.8, 0.6, 0.45)


def _tree(parents, depths, B):
    parents = torch.tensor([parents]).expand(B, -1)
    depths = torch.tensor([depths]).expand(B, -1)
    N = parents.shape[1]
    tokens = torch.arange(N).expand(B, N) + 100
    return Proposal(tokens, parents, depths, ancestor_mask(parents, int(depths.max())))


def _expected(probs, depth):
    """1 + P1 + P1P2 + ... up to `depth` terms, and the share of cycles accepting the d-th draft."""
    reach, run = [], 1.0
    for d in range(depth):
        run *= probs[d] if d < len(probs) else 0.0
        reach.append(run)
    return 1 + sum(reach), reach


def _check(prop, max_depth, tree_depth, B):
    g = torch.Generator().manual_seed(1234)
    acc = simulate_acceptance(prop, torch.zeros(B, prop.width, dtype=torch.int64),
                              torch.tensor(P[:max_depth] + (0.0,) * (max_depth - len(P))), max_depth,
                              generator=g)
    n = acc.num.double()
    mean_want, reach_want = _expected(P, tree_depth)
    se = float(n.std()) / B ** 0.5
    assert abs(float(n.mean()) - mean_want) < 4 * se, (float(n.mean()), mean_want, se)
    for d in range(1, max_depth + 1):                 # share of cycles whose d-th draft was accepted
        got = float((n >= d + 1).double().mean())
        want = reach_want[d - 1] if d <= tree_depth else 0.0
        se_d = max((want * (1 - want) / B) ** 0.5, 1e-9)
        assert abs(got - want) <= 4 * se_d, (d, got, want)
    return acc


def test_chain_matches_the_formula():
    B = 100_000
    _check(_chain(B, 4), 3, 3, B)                     # 1 + 0.8 + 0.48 + 0.216 = 2.496


def test_chain_longer_than_the_profile_accepts_nothing_past_it():
    B = 50_000
    acc = _check(_chain(B, 6), 5, 5, B)               # P4 = P5 = 0
    assert int(acc.num.max()) == 4


def test_random_weight_eagle3_tree_shape_reaches_its_depth():
    # the shape random-weight eagle3_tree proposals have (k 4, S 5, N 8): 4 nodes at depth 1, the
    # 3 depth-2 nodes under the best depth-1 node; max depth 2, so only P1 and P2 can apply
    B = 100_000
    depths = [0, 1, 1, 1, 1, 2, 2, 2]
    _check(_tree([-1, 0, 0, 0, 0, 1, 1, 2], depths, B), 5, 2, B)            # 1 + 0.8 + 0.48
    # the depth-2 nodes under the THIRD depth-1 node: a first-child walk would stop at depth 1
    acc = _check(_tree([-1, 0, 0, 0, 0, 3, 3, 3], depths, B), 5, 2, B)
    assert set(acc.path[acc.num == 3, 1].tolist()) == {3}


def test_deep_branch_that_is_not_the_first_child():
    # root -> 1 (a leaf), 2; 2 -> 3 (a leaf), 4; 4 -> 5: the deepest path is 0, 2, 4, 5
    B = 100_000
    parents, depths = [-1, 0, 0, 2, 2, 4], [0, 1, 1, 2, 2, 3]
    _check(_tree(parents, depths, B), 5, 3, B)                              # 2.496, not 1.8
    prop = _tree(parents, depths, 1)
    acc = simulate_acceptance(prop, torch.full((1, 6), 9), torch.ones(5), 5)
    assert acc.num.tolist() == [4] and acc.path.tolist() == [[0, 2, 4, 5, 5, 5]]
    assert acc.tokens[0, :4].tolist() == [102, 104, 105, 9]


def test_equally_deep_branches_take_the_first():
    # 0 -> 1, 2; 1 -> 3; 2 -> 4: both depth 2, node 1's branch first in node order
    prop = _tree([-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], 1)
    acc = simulate_acceptance(prop, torch.full((1, 5), 9), torch.ones(2), 2)
    assert acc.num.tolist() == [3] and acc.path.tolist() == [[0, 1, 3]]


def test_uniforms_are_reproducible():
    prop = _tree([-1, 0, 0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 2, 2, 2], 512)
    target = torch.zeros(512, 8, dtype=torch.int64)
    probs = torch.tensor([0.8, 0.6, 0.45, 0.0, 0.0])
    a, b = (simulate_acceptance(prop, target, probs, 5, generator=torch.Generator().manual_seed(7))
            for _ in range(2))
    assert torch.equal(a.num, b.num) and torch.equal(a.path, b.path)
    torch.manual_seed(3)
    c = simulate_acceptance(prop, target, probs, 5)
    torch.manual_seed(3)
    d = simulate_acceptance(prop, target, probs, 5)
    assert torch.equal(c.num, d.num) and not torch.equal(a.num, c.num)


# ---------------------------------------------------------------- a planted chain (the bench's trees)

class _Shallow:
    """A drafter whose trees are wide and shallow, like random-weight eagle3_tree proposals."""
    num_draft_tokens, max_depth, capture_layers, reads_final_hidden, graphable, scratch_rows = 8, 5, (), False, True, 0

    def propose(self, slots, last_tokens, lens, kv_bound=None, width=None):
        return _tree([-1, 0, 0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 2, 2, 2], slots.shape[0])


def test_a_planted_chain_reaches_the_full_depth():
    """eagle3_tree's random-weight trees stop at depth 2 (P3 never applied: 2.28, not 2.50); the
    bench's PlantedChain keeps the N tokens but lays them out with a chain of depth S."""
    B = 100_000
    shallow = _Shallow().propose(torch.zeros(B, dtype=torch.int64), None, None)
    _check(shallow, 5, 2, B)                                       # 1 + 0.8 + 0.48 = 2.28
    planted = PlantedChain(_Shallow())
    prop = planted.propose(torch.zeros(B, dtype=torch.int64), None, None)
    assert prop.width == 8 and torch.equal(prop.tokens, shallow.tokens)
    assert prop.depths[0].tolist() == [0, 1, 2, 3, 4, 5, 1, 1]
    acc = _check(prop, 5, 5, B)                                    # 2.496: P1..P3 apply, P4 = P5 = 0
    assert abs(float(acc.num.double().mean()) - 2.496) < 0.01
    assert planted.max_depth == 5 and planted.num_draft_tokens == 8


# ---------------------------------------------------------------- GPU: the kernel walk equals the torch walk

@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["chain", "wide", "deep_second", "planted", "duplicates"])
def test_gpu_walk_equals_the_torch_walk(shape):
    """On CUDA the simulated acceptance runs the greedy-accept kernel on planted argmaxes; the
    same draws through the torch walk (kernels.torch_only) give the same tokens, counts and paths."""
    from specbatch import kernels

    B, dev = 4096, torch.device("cuda")
    if shape == "chain":
        prop, D = _chain(B, 4), 3
    elif shape == "wide":
        prop, D = _tree([-1, 0, 0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 2, 2, 2], B), 5
    elif shape == "deep_second":
        prop, D = _tree([-1, 0, 0, 2, 2, 4], [0, 1, 1, 2, 2, 3], B), 5
    elif shape == "planted":
        prop, D = PlantedChain(_Shallow()).propose(torch.zeros(B, dtype=torch.int64), None, None), 5
    else:                       # the deep child's sibling before it holds its token: greedy takes that one
        prop = _tree([-1, 0, 0, 2, 2, 3], [0, 1, 1, 2, 2, 3], B)
        prop = Proposal(torch.tensor([[5, 7, 7, 8, 9, 4]]).expand(B, -1), prop.parents, prop.depths, prop.tree_mask)
        D = 3
    prop = Proposal(*(t.to(dev) if t is not None else None
                      for t in (prop.tokens, prop.parents, prop.depths, prop.tree_mask)))
    target = torch.randint(0, 50, (B, prop.width), device=dev)
    probs = torch.tensor([0.8, 0.6, 0.45], device=dev)
    runs = []
    for reference in (False, True):
        g = torch.Generator(device=dev).manual_seed(11)
        with kernels.torch_only() if reference else contextlib.nullcontext():
            runs.append(simulate_acceptance(prop, target, probs, D, generator=g))
    fast, ref = runs
    assert torch.equal(fast.num, ref.num) and torch.equal(fast.path, ref.path)
    assert torch.equal(fast.tokens, ref.tokens)
    assert float(ref.num.double().mean()) > 1.5                       # the walk did go deep


def test_siblings_sharing_the_deep_childs_token_take_the_first():
    # root -> 1 (a leaf, token 7), 2 (token 7) -> 3 -> 5: greedy acceptance of the planted 7 takes
    # node 1, the first child holding it, and the walk ends there with the target's token
    prop = _tree([-1, 0, 0, 2, 2, 3], [0, 1, 1, 2, 2, 3], 1)
    prop = Proposal(torch.tensor([[5, 7, 7, 8, 9, 4]]), prop.parents, prop.depths, prop.tree_mask)
    acc = simulate_acceptance(prop, torch.full((1, 6), 3), torch.ones(3), 3)
    assert acc.num.tolist() == [2] and acc.path.tolist() == [[0, 1, 1, 1]]
    assert acc.tokens[0, :2].tolist() == [7, 3]
