"""Tree acceptance, exact results: greedy walks follow the target's argmax down the matching branch,
plain sampling is reproduced without drafts, and every row of a batch gets what it gets alone."""
from __future__ import annotations

import pytest
import torch

from specbatch.sampling import SamplingParams, sample
from specbatch.speculative.accept import accept
from specbatch.speculative.tree import chain

from accept_helpers import CPU, _sp, _t


def _greedy_logits(argmax_per_node: list[int], V: int = 10, seed: int = 0) -> torch.Tensor:
    """[N, V] random logits whose argmax at node i is argmax_per_node[i]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(argmax_per_node), V, generator=g)
    for i, t in enumerate(argmax_per_node):
        x[i, t] = x[i].max() + 1.0 + float(torch.rand(1, generator=g))
    return x


# ------------------------------------------------------------------------------------ greedy

def test_greedy_chain_all_some_none_accepted():
    # chain: root(9) -> 4 -> 7 -> 1 ; target argmax per node decides how far it goes
    node_tokens = _t([[9, 4, 7, 1]] * 3)
    parents, _ = chain(3, 4, CPU)
    logits = torch.stack([
        _greedy_logits([4, 7, 1, 6], seed=1),   # all three accepted, bonus 6 from the last node
        _greedy_logits([4, 7, 3, 6], seed=2),   # 4, 7 accepted, the target says 3 instead of 1
        _greedy_logits([2, 7, 1, 6], seed=3),   # nothing accepted: the target's own 2
    ])
    sp = _sp([SamplingParams()] * 3)
    acc = accept(node_tokens, parents, logits, sp, _t([5, 11, 0]), max_depth=3)
    assert acc.num.tolist() == [4, 3, 1]
    assert acc.tokens.shape == (3, 4) and acc.path.shape == (3, 4)
    assert acc.tokens[0].tolist() == [4, 7, 1, 6]
    assert acc.tokens[1, :3].tolist() == [4, 7, 3]
    assert acc.tokens[2, :1].tolist() == [2]
    assert acc.path[0].tolist() == [0, 1, 2, 3]
    assert acc.path[1, :3].tolist() == [0, 1, 2]
    assert acc.path[2, :1].tolist() == [0]


def _branchy():
    #            root(9)
    #           /       \
    #       n1 (3)     n2 (5)
    #       /    \         \
    #   n3 (7)  n4 (2)    n5 (8)
    node_tokens = [9, 3, 5, 7, 2, 8]
    parents = [-1, 0, 0, 1, 1, 2]
    return node_tokens, parents


@pytest.mark.parametrize("argmaxes,tokens,path", [
    ([5, 0, 8, 0, 0, 4], [5, 8, 4], [0, 2, 5]),     # second branch, to its leaf, bonus 4
    ([3, 2, 0, 0, 9, 0], [3, 2, 9], [0, 1, 4]),     # first branch, second child, bonus 9
    ([3, 7, 0, 1, 0, 0], [3, 7, 1], [0, 1, 3]),     # first branch, first child
    ([3, 6, 0, 0, 0, 0], [3, 6], [0, 1]),           # first branch, then a miss
    ([5, 2, 1, 0, 0, 0], [5, 1], [0, 2]),           # n2's target is 1 (2 is n4's token, not n2's child)
    ([7, 0, 0, 0, 0, 0], [7], [0]),                 # 7 is a grandchild's token, not a root child
])
def test_greedy_tree_follows_the_matching_branch(argmaxes, tokens, path):
    nt, par = _branchy()
    logits = _greedy_logits(argmaxes, seed=len(tokens))[None]
    acc = accept(_t([nt]), _t([par]), logits, _sp([SamplingParams()]), _t([3]), max_depth=2)
    n = len(tokens)
    assert int(acc.num[0]) == n
    assert acc.tokens[0, :n].tolist() == tokens
    assert acc.path[0, :n].tolist() == path
    # emitted tokens are the target argmax at the node each one was predicted from
    assert acc.tokens[0, :n].tolist() == [argmaxes[p] for p in path]


def test_greedy_rows_same_through_the_sampling_code_path():
    # a sampling row in the batch makes accept build probabilities; greedy rows must not change
    nt, par = _branchy()
    cases = [[5, 0, 8, 0, 0, 4], [3, 2, 0, 0, 9, 0], [3, 6, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0]]
    logits = torch.stack([_greedy_logits(a, seed=i) for i, a in enumerate(cases)])
    B = len(cases)
    greedy = accept(_t([nt] * B), _t([par] * B), logits, _sp([SamplingParams()] * B), _t([3] * B), 2)
    mixed_logits = torch.cat([logits, torch.randn(1, 6, 10)])
    mixed = accept(_t([nt] * (B + 1)), _t([par] * (B + 1)), mixed_logits,
                   _sp([SamplingParams()] * B + [SamplingParams(temperature=1.0, seed=1)]),
                   _t([3] * (B + 1)), 2)
    assert torch.equal(mixed.num[:B], greedy.num)
    for b in range(B):
        n = int(greedy.num[b])
        assert torch.equal(mixed.tokens[b, :n], greedy.tokens[b, :n])
        assert torch.equal(mixed.path[b, :n], greedy.path[b, :n])


# ------------------------------------------------------------------------------------ vanilla

def test_vanilla_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1, 50, generator=g)
    acc = accept(_t([[1]] * 16), _t([[-1]] * 16), logits, _sp([SamplingParams()] * 16),
                 torch.arange(16), max_depth=0)
    assert acc.num.tolist() == [1] * 16
    assert acc.tokens.shape == (16, 1)
    assert torch.equal(acc.tokens[:, 0], logits[:, 0].argmax(-1))
    assert acc.path.tolist() == [[0]] * 16


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                dict(temperature=1.3, top_p=0.6), dict(temperature=0.0)])
def test_vanilla_sampling_reproduces_plain_sampling(kw):
    B, V = 256, 50
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, 1, V, generator=g) * 2
    start = torch.randint(0, 10_000, (B,), generator=g)
    params = [SamplingParams(seed=1000 + i, **kw) for i in range(B)]
    if kw.get("temperature", 0) == 0:
        params[0] = SamplingParams(temperature=1.0, seed=5)        # keep the sampling code path
    sp = _sp(params)
    acc = accept(torch.zeros(B, 1, dtype=torch.int64), _t([[-1]] * B), logits, sp, start, 0)
    ref = sample(logits[:, 0], sp, start + 1)
    assert acc.num.tolist() == [1] * B
    assert torch.equal(acc.tokens[:, 0], ref)
    if kw.get("temperature", 0) > 0:
        assert ref.unique().numel() > 5                             # really sampled, not argmax


# ------------------------------------------------------------------------------------ batch invariance

def test_batch_rows_equal_each_row_alone():
    V, N = 10, 6
    g = torch.Generator().manual_seed(7)
    trees = [
        ([9, 3, 5, 7, 2, 8], [-1, 0, 0, 1, 1, 2]),     # branchy, depth 2
        ([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4]),     # chain, depth 5
        ([0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 0, 0]),     # a star, depth 1
        ([4, 4, 1, 0, 9, 2], [-1, 0, 1, 1, 3, 0]),     # mixed, depth 3
    ]
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.6, top_k=3, seed=4), SamplingParams(temperature=1.0, top_p=0.7, seed=5),
              SamplingParams(), SamplingParams(temperature=2.0, seed=6), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.9, top_k=4, top_p=0.9, seed=2**40 + 7)]
    B = len(params)
    rows_t, rows_p = zip(*[trees[i % len(trees)] for i in range(B)])
    node_tokens, parents = _t(list(rows_t)), _t(list(rows_p))
    # logits that make drafts plausible: boost each node's children's tokens a bit
    logits = torch.randn(B, N, V, generator=g)
    for b in range(B):
        for c in range(1, N):
            logits[b, int(parents[b, c]), int(node_tokens[b, c])] += 1.5
    start = torch.randint(0, 500, (B,), generator=g)
    D = 5
    full = accept(node_tokens, parents, logits, _sp(params), start, D)
    for b in range(B):
        one = accept(node_tokens[b:b + 1], parents[b:b + 1], logits[b:b + 1], _sp([params[b]]), start[b:b + 1], D)
        n = int(one.num[0])
        assert int(full.num[b]) == n, b
        assert torch.equal(full.tokens[b, :n], one.tokens[0, :n]), b
        assert torch.equal(full.path[b, :n], one.path[0, :n]), b
    # the batch is not degenerate: something was accepted and something rejected
    assert int(full.num.max()) > 1 and int(full.num.min()) < D + 1
    # a shuffled batch gives every row the same result
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    shuf = accept(node_tokens[perm], parents[perm], logits[perm], _sp([params[i] for i in perm]), start[perm], D)
    assert torch.equal(shuf.num, full.num[perm])
