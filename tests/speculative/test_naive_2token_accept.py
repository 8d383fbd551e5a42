"""The accept step at N = 2 (one draft per slot): greedy rows, greedy and sampled rows in one
batch, and the law of a sampled draft (accepted with its probability, the residual after a
rejection, the bonus from the draft node's distribution)."""
from __future__ import annotations

import math

import pytest
import torch

from chi_square import assert_law
from specbatch.sampling import BatchSampling, SamplingParams
from specbatch.speculative.accept import accept
from specbatch.speculative.tree import chain

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


def _sp(params):
    return BatchSampling.build(params, CPU)


def _logits(argmaxes, V=12, seed=0):
    """[N, V] random logits whose argmax at node i is argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmaxes), V, generator=g)
    for i, t in enumerate(argmaxes):
        x[i, t] = x[i].max() + 1.0
    return x


def _t(rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_accept_n2_greedy():
    nodes = _t([[9, 4], [9, 4], [3, 3]])
    parents, depths = chain(3, 2, CPU)
    assert parents.tolist() == [[-1, 0]] * 3 and depths.tolist() == [[0, 1]] * 3
    logits = torch.stack([_logits([4, 6], seed=1),      # draft 4 right: [4, bonus 6]
                          _logits([2, 6], seed=2),      # wrong: the target's 2 alone
                          _logits([3, 0], seed=3)])     # draft equal to the root, right: [3, 0]
    acc = accept(nodes, parents, logits, _sp([SamplingParams()] * 3), _t([5, 0, 17]), max_depth=1)
    assert acc.tokens.shape == (3, 2) and acc.path.shape == (3, 2)
    assert acc.num.tolist() == [2, 1, 2]
    assert acc.tokens[0].tolist() == [4, 6] and acc.path[0].tolist() == [0, 1]
    assert acc.tokens[1, 0].item() == 2 and acc.path[1, 0].item() == 0
    assert acc.tokens[2].tolist() == [3, 0]


def test_accept_n2_greedy_and_sampled_rows_in_one_batch():
    V, B = 12, 6
    nodes = _t([[9, 4], [9, 4], [1, 7], [1, 7], [1, 7], [5, 2]])
    parents, _ = chain(B, 2, CPU)
    sure = torch.full((V,), -40.0)
    sure[7] = 5.0                                          # p(7) ~ 1: the draft 7 is accepted
    never = torch.randn(V, generator=torch.Generator().manual_seed(4))
    never[7] = float("-inf")                               # p(7) = 0: the draft 7 is rejected
    bonus = torch.randn(V, generator=torch.Generator().manual_seed(5))
    logits = torch.stack([
        _logits([4, 6], seed=1), _logits([2, 6], seed=2),  # greedy: accepted / rejected
        torch.stack([sure, bonus]), torch.stack([never, bonus]),
        torch.stack([sure, bonus]),                         # greedy row on a sampled row's logits
        _logits([2, 8], seed=6),                            # sampled, draft 2 is the argmax
    ])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.7, top_k=5, seed=4), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.9, seed=9)]
    start = _t([3, 8, 11, 2, 40, 6])
    acc = accept(nodes, parents, logits, _sp(params), start, 1)
    assert acc.num[:5].tolist() == [2, 1, 2, 1, 2]
    assert acc.tokens[0].tolist() == [4, 6] and acc.tokens[1, 0].item() == 2
    assert acc.tokens[2, 0].item() == 7 and acc.tokens[4].tolist() == [7, int(bonus.argmax())]
    assert acc.tokens[3, 0].item() != 7
    # each row alone gives the same: greedy rows are unchanged by the sampling code path
    for b in range(B):
        one = accept(nodes[b:b + 1], parents[b:b + 1], logits[b:b + 1], _sp([params[b]]), start[b:b + 1], 1)
        n = int(one.num[0])
        assert int(acc.num[b]) == n and torch.equal(acc.tokens[b, :n], one.tokens[0, :n]), b
    # the sampled bonus after an accepted draft is drawn from the draft node's distribution
    B2 = 4000
    lg = torch.stack([sure, bonus])[None].expand(B2, 2, V)
    many = accept(_t([[1, 7]]).expand(B2, 2), chain(B2, 2, CPU)[0], lg,
                  _sp([SamplingParams(temperature=1.0, seed=i) for i in range(B2)]), _t([11] * B2), 1)
    assert (many.num == 2).all() and (many.tokens[:, 0] == 7).all()
    assert_law(many.tokens[:, 1], bonus.double().softmax(-1), "bonus")


def test_accept_n2_sampled_draft_law():
    """One draft of probability 0.4: accepted 40 % of the time, the first token follows p, the
    rejected rows follow p without the draft, the bonus follows the draft node's p."""
    V, B, draft = 6, 20_000, 2
    p0 = torch.tensor([0.1, 0.2, 0.4, 0.05, 0.15, 0.1], dtype=torch.float64)
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.25, 0.05], dtype=torch.float64)
    lg = torch.stack([p0, p1]).log().float()[None].expand(B, 2, V)
    sp = _sp([SamplingParams(temperature=1.0, seed=i) for i in range(B)])
    acc = accept(_t([[0, draft]]).expand(B, 2), chain(B, 2, CPU)[0], lg, sp, _t([7] * B), 1)
    ok = acc.num == 2
    rate = float(ok.double().mean())
    assert abs(rate - 0.4) < 4.5 * math.sqrt(0.24 / B), rate
    assert (acc.tokens[ok, 0] == draft).all() and not (acc.tokens[~ok, 0] == draft).any()
    assert_law(acc.tokens[:, 0], p0, "first token")
    resid = p0.clone()
    resid[draft] = 0
    assert_law(acc.tokens[~ok, 0], resid / resid.sum(), "residual")
    assert_law(acc.tokens[ok, 1], p1, "bonus")
