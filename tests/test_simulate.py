"""Simulated acceptance (bench only): the acceptance profile it is given, on chains and trees."""
from __future__ import annotations

import torch

from specbatch.spec.drafter import Proposal
from specbatch.spec.simulate import simulate_acceptance
from specbatch.spec.tree import ancestor_mask, chain


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
