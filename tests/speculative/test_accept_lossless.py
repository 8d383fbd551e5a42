"""Tree acceptance is statistically lossless: the emitted tokens follow the target distribution
exactly (temperature, top-k, top-p), at every node of a fixed tree, for rare and almost-sure drafts,
zero-probability drafts and candidates holding all the mass."""
from __future__ import annotations

import math

import pytest
import torch

from specbatch.sampling import SamplingParams, sample
from specbatch.speculative.accept import accept

from accept_helpers import (P, ROWS, TREE_DEPTH, TREE_PARENTS, TREE_TOKENS, _assert_distribution, _check_tree_law,
                            _reference_probs, _run_many, _sp, _t, _tree_run)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.5, top_k=6, top_p=0.9),
])
def test_tree_walk_is_lossless(kw):
    acc = _tree_run(tuple(sorted(kw.items())))
    probs = torch.stack([_reference_probs(P[i], kw.get("temperature", 1.0), kw.get("top_k", 0),
                                          kw.get("top_p", 1.0)) for i in range(P.shape[0])])
    _check_tree_law(acc, probs, TREE_TOKENS, TREE_PARENTS, str(kw))
    # the tree really was used: full depth reached for some rows
    assert int(acc.num.max()) == TREE_DEPTH + 1
    # the number of tokens emitted follows the tree's acceptance probabilities: P(num >= 2) =
    # mass of the root's candidates
    p2 = float(probs[0, 2] + probs[0, 5])
    got = float((acc.num >= 2).double().mean())
    assert abs(got - p2) < 4.5 * math.sqrt(p2 * (1 - p2) / ROWS), (got, p2)


def test_tree_walk_joint_of_first_two_tokens():
    # the joint law of the first two emitted tokens on the candidate branch 2: P(2, x) = p_root(2) p_n1(x)
    acc = _tree_run((("temperature", 1.0),))
    on2 = acc.tokens[:, 0] == 2
    pairs = acc.tokens[:, 1][on2]
    joint = torch.bincount(pairs, minlength=8).double() / ROWS
    exp = P[0, 2] * P[1]
    sd = (exp * (1 - exp) / ROWS).sqrt()
    assert ((joint - exp).abs() <= 4.5 * sd + 1e-12).all(), (joint, exp)


def test_tree_walk_different_start_positions_also_lossless():
    # the counter depends on start: a different position gives other draws, same law
    a = _tree_run((("temperature", 1.0),))
    b = _tree_run((("temperature", 1.0),), rows=10_000, start=4242)
    assert (a.tokens[:10_000, 0] != b.tokens[:, 0]).double().mean() > 0.5
    _check_tree_law(b, P, TREE_TOKENS, TREE_PARENTS, "start 4242")


def test_chain_draft_almost_sure_is_almost_always_accepted():
    V = 7
    p_root = torch.full((V,), 0.001 / (V - 1), dtype=torch.float64)
    p_root[3] = 0.999
    p_leaf = torch.tensor([0.2, 0.1, 0.1, 0.15, 0.15, 0.2, 0.1], dtype=torch.float64)
    logits = torch.stack([p_root, p_leaf]).log()
    acc = _run_many([0, 3], [-1, 0], logits, 1, ROWS, temperature=1.0)
    acc_rate = float((acc.num == 2).double().mean())
    assert abs(acc_rate - 0.999) < 4.5 * math.sqrt(0.999 * 0.001 / ROWS)
    # rejected rows never emit the rejected draft
    rej = acc.num == 1
    assert rej.any() and not (acc.tokens[rej, 0] == 3).any()
    _assert_distribution(acc.tokens[:, 0], p_root, "first token")
    # the residual (rejected rows) is p without the draft, renormalised: uniform on the others
    resid = p_root.clone()
    resid[3] = 0
    _assert_distribution(acc.tokens[rej, 0], resid / resid.sum(), "residual")
    _assert_distribution(acc.tokens[~rej, 1], p_leaf, "bonus")


@pytest.mark.parametrize("how", ["neg_inf_logit", "top_k"])
def test_chain_draft_with_zero_probability_is_never_accepted(how):
    V = 6
    p = torch.tensor([0.25, 0.05, 0.30, 0.10, 0.20, 0.10], dtype=torch.float64)
    draft = 1
    kw = dict(temperature=1.0)
    if how == "neg_inf_logit":
        p[draft] = 0
        p /= p.sum()
        logits_root = p.log()                        # -inf at the draft
        ref = p
    else:
        logits_root = p.log()
        kw["top_k"] = 4                              # 0.05 is the smallest: the draft is cut
        ref = _reference_probs(p, top_k=4)
        assert float(ref[draft]) == 0
    logits = torch.stack([logits_root, torch.zeros(V, dtype=torch.float64)])
    acc = _run_many([0, draft], [-1, 0], logits, 1, ROWS, **kw)
    assert (acc.num == 1).all()
    assert not (acc.tokens[:, 0] == draft).any()
    _assert_distribution(acc.tokens[:, 0], ref, how)


def test_candidates_holding_all_the_mass():
    # p is zero outside the root's candidates {1, 4, 6}: the emitted token is always a candidate
    V = 8
    p = torch.zeros(V, dtype=torch.float64)
    p[[1, 4, 6]] = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    leaf = torch.full((V,), 1.0 / V, dtype=torch.float64)
    logits = torch.stack([p.log(), leaf.log(), leaf.log(), leaf.log()])
    acc = _run_many([0, 1, 4, 6], [-1, 0, 0, 0], logits, 1, ROWS, temperature=1.0)
    assert (acc.num == 2).all()
    assert torch.isin(acc.tokens[:, 0], _t([1, 4, 6])).all()
    _assert_distribution(acc.tokens[:, 0], p, "candidates")
    # the path points at the node of the emitted token
    node_of = {1: 1, 4: 2, 6: 3}
    assert all(node_of[t] == n for t, n in zip(acc.tokens[:, 0].tolist(), acc.path[:, 1].tolist()))
    # and the same when truncation (top-p) leaves only candidates: n1's 1 and 7 under top_p = 0.8
    acc = _tree_run((("temperature", 1.0), ("top_p", 0.8)))
    at_n1 = (acc.num > 1) & (acc.path[:, 1] == 1)
    assert at_n1.sum() > 1000
    assert (acc.num[at_n1] >= 3).all() and torch.isin(acc.tokens[at_n1, 1], _t([1, 7])).all()


def test_candidates_holding_all_the_mass_of_an_unnormalised_row():
    # The candidates hold all the mass of logits whose exp sums to 0.6, not 1 (the draw normalises):
    # the emitted token is always a candidate, in proportion to its mass.
    B, V = ROWS, 5
    p = torch.zeros(V, dtype=torch.float64)
    p[2], p[4] = 0.35, 0.25
    logits = torch.stack([p.log(), torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64),
                          torch.zeros(V, dtype=torch.float64)])
    acc = _run_many([0, 2, 4, 3], [-1, 0, 0, 0], logits, 1, B, temperature=1.0)
    assert (acc.num == 2).all()
    assert torch.isin(acc.path[:, 1], _t([1, 2])).all()               # never node 3 (no mass) or the root
    _assert_distribution(acc.tokens[:, 0], p / p.sum(), "candidates")


def test_acceptance_uses_the_depth_position_counter():
    # Depth d of a walk at committed length `start` draws for position start + 1 + d with the same
    # race as plain sampling there: accepted or not, the token emitted at depth 0 is vanilla's.
    V, B = 8, 2000
    logits = P[0].log().float()
    sp = _sp([SamplingParams(temperature=1.0, seed=i) for i in range(B)])
    lg = logits[None, None].expand(B, 2, V).contiguous()
    lg[:, 1] = P[2].log().float()
    # chain root -> draft 2: the token at position start + 1 is vanilla's there, the draft
    # accepted exactly when vanilla drew 2, and then the bonus is vanilla's at start + 2
    acc = accept(_t([[0, 2]]).expand(B, -1), _t([[-1, 0]]).expand(B, -1), lg, sp,
                 torch.full((B,), 50, dtype=torch.int64), 1)
    van = sample(lg[:, 0], sp, torch.full((B,), 51, dtype=torch.int64))
    nxt = sample(lg[:, 1], sp, torch.full((B,), 52, dtype=torch.int64))
    assert torch.equal(acc.tokens[:, 0], van)
    assert torch.equal(acc.num == 2, van == 2) and 100 < int((van == 2).sum()) < B - 100
    assert torch.equal(acc.tokens[van == 2, 1], nxt[van == 2])


def test_tree_walk_emits_what_vanilla_sampling_would():
    # A seeded row emits, position by position, plain sampling's token from the same prefix,
    # whatever the tree: here the fixed tree of accept_helpers, its node logits standing in for the
    # target's conditionals along each path (vanilla at depth d reads the node the walk reached).
    B, N, V = 3000, len(TREE_TOKENS), P.shape[1]
    kw = dict(temperature=0.9, top_p=0.9, top_k=6)
    sp = _sp([SamplingParams(seed=i, **kw) for i in range(B)])
    logits = P.log().float()[None].expand(B, N, V).contiguous()
    start = torch.randint(0, 1000, (B,))
    acc = accept(_t([TREE_TOKENS]).expand(B, -1), _t([TREE_PARENTS]).expand(B, -1), logits, sp, start, TREE_DEPTH)
    for d in range(TREE_DEPTH + 1):
        on = acc.num > d
        node = acc.path[:, d]
        want = sample(logits[torch.arange(B), node], sp, start + 1 + d)
        assert torch.equal(acc.tokens[on, d], want[on]), d
    assert int(acc.num.max()) == TREE_DEPTH + 1
