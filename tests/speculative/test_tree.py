"""Draft trees: strictly decreasing child scores, ancestor masks, chains and the top-(N-1) choice."""
from __future__ import annotations

import pytest
import torch

from specbatch.speculative.topk import LOG_ZERO, topk_logprobs
from specbatch.speculative.tree import ancestor_mask, chain, child_scores, choose_tree

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- child_scores

def test_child_scores_is_the_sum_normally():
    parent = torch.tensor([0.0, -1.5, -3.25, -10.0])
    logp = torch.tensor([-0.5, -2.0, -0.25, -7.0])
    assert torch.equal(child_scores(parent, logp), parent + logp)


@pytest.mark.parametrize("parent", [0.0, -0.5, -1e4, -1e6, LOG_ZERO, -3e38])
@pytest.mark.parametrize("logp", [0.0, -0.0, -1e-12, -1e-30, -1e-3, -1.0, LOG_ZERO])
def test_child_scores_strictly_below_parent(parent, logp):
    p = torch.tensor([parent])
    s = child_scores(p, torch.tensor([logp]))
    assert float(s) < float(p), (parent, logp, float(s))
    assert torch.isfinite(s).all()
    # never further below than the exact sum (rounded), i.e. it is the sum or the next float down
    assert float(s) >= float(p + torch.tensor([logp])) or float(s) == float(
        torch.nextafter(p, torch.tensor([float("-inf")])))


def test_child_scores_grandchildren_keep_decreasing():
    # a path of probability-1 tokens (logp = 0) never produces a tie with its ancestors
    s = torch.tensor([-1e4])
    seen = [float(s)]
    for _ in range(10):
        s = child_scores(s, torch.zeros(1))
        seen.append(float(s))
    assert all(a > b for a, b in zip(seen, seen[1:]))


def test_child_scores_broadcasts_parent_over_children():
    parent = torch.tensor([[-1.0], [-2.0]])                      # [B, 1]
    logp = torch.tensor([[0.0, -0.5, -1e-12], [-1.0, 0.0, -2.0]])  # [B, k]
    s = child_scores(parent, logp)
    assert s.shape == (2, 3)
    assert (s < parent).all()
    assert float(s[0, 1]) == -1.5 and float(s[1, 2]) == -4.0


# --------------------------------------------------------------------------- ancestor_mask

def test_ancestor_mask_hand_built_trees():
    # Tree A (row 0):           Tree B (row 1): a chain with a side branch
    #         0                          0
    #       / | \                        |
    #      1  2  3                       1
    #     / \     \                     / \
    #    4   5     6                   2   3
    #    |                             |
    #    7                             4 - ... 5 is a child of 4, 6 of 5, 7 of 3
    parents = torch.tensor([
        [-1, 0, 0, 0, 1, 1, 3, 4],
        [-1, 0, 1, 1, 2, 4, 5, 3],
    ])
    # row i = node i; columns = nodes it sees (itself and its ancestors)
    A = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0, 0, 1],
    ]
    B = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 1, 1, 0],
        [1, 1, 0, 1, 0, 0, 0, 1],
    ]
    expected = torch.tensor([A, B], dtype=torch.bool)
    got = ancestor_mask(parents, max_depth=6)   # tree B is 6 deep
    assert got.dtype == torch.bool and got.shape == (2, 8, 8)
    assert torch.equal(got, expected)
    # a larger max_depth changes nothing; each row alone gives the same answer
    assert torch.equal(ancestor_mask(parents, max_depth=9), expected)
    assert torch.equal(ancestor_mask(parents[1:], max_depth=6), expected[1:])
    assert torch.equal(ancestor_mask(parents[:1], max_depth=3), expected[:1])


def test_ancestor_mask_needs_max_depth_iterations():
    # with too small a max_depth the deepest node misses its far ancestors: the parameter matters
    parents = torch.tensor([[-1, 0, 1, 2, 3]])
    full = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    assert torch.equal(ancestor_mask(parents, 4)[0], full)
    assert not torch.equal(ancestor_mask(parents, 2)[0], full)


def test_chain():
    parents, depths = chain(3, 5, CPU)
    assert parents.shape == (3, 5) and depths.shape == (3, 5)
    assert parents.tolist() == [[-1, 0, 1, 2, 3]] * 3
    assert depths.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert parents.dtype == torch.int64 and depths.dtype == torch.int64
    assert torch.equal(ancestor_mask(parents, 4), torch.tril(torch.ones(3, 5, 5, dtype=torch.bool)))
    p1, d1 = chain(1, 1, CPU)
    assert p1.tolist() == [[-1]] and d1.tolist() == [[0]]


# --------------------------------------------------------------------------- choose_tree

def test_choose_tree_hand_built():
    # k = 2, S = 3. Candidates (index: token, score, parent candidate):
    #   depth 1:  c0 (t=11, -0.1, root)   c1 (t=12, -1.0, root)
    #   depth 2:  c2 (t=21, -0.3, c0)     c3 (t=22, -2.0, c0)     c4 (t=23, -1.2, c1)  c5 (t=24, -3.0, c1)
    #   depth 3:  c6 (t=31, -0.5, c2)     c7 (t=32, -2.5, c2)     c8 (t=33, -1.5, c4)  c9 (t=34, -4.0, c4)
    # Row 0, N = 6: the 5 best are c0 -0.1, c2 -0.3, c6 -0.5, c1 -1.0, c4 -1.2 ->
    #       root(7)
    #       /     \
    #   n1 c0(11)  n2 c1(12)
    #     |          |
    #   n3 c2(21)  n4 c4(23)
    #     |
    #   n5 c6(31)
    # Row 1 (same layout, other scores): depth 2 is c2 -5.0, c3 -1.1 (children of c0), c4 -0.9,
    # c5 -0.6 (children of c1); the beam keeps c5 and c4, so depth 3 is c6 -3.0, c7 -3.5 (children
    # of c4) and c8 -1.0, c9 -2.0 (children of c5). N = 6: c1 -0.2, c0 -0.4, c5 -0.6, c4 -0.9,
    # c8 -1.0 (c3 -1.1 just misses) ->
    #       root(8)
    #       /     \
    #   n1 c0(11)  n2 c1(12)
    #              /    \
    #         n3 c4(23)  n4 c5(24)
    #                      |
    #                  n5 c8(33)
    tokens = torch.tensor([[11, 12, 21, 22, 23, 24, 31, 32, 33, 34]] * 2)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4],
                            [-1, -1, 0, 0, 1, 1, 4, 4, 5, 5]])
    scores = torch.tensor([
        [-0.1, -1.0, -0.3, -2.0, -1.2, -3.0, -0.5, -2.5, -1.5, -4.0],
        [-0.4, -0.2, -5.0, -1.1, -0.9, -0.6, -3.0, -3.5, -1.0, -2.0],
    ])
    depths = torch.tensor([1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    root = torch.tensor([7, 8])
    nt, npar, nd, mask = choose_tree(tokens, scores, parents, depths, root, num_nodes=6, max_depth=3)
    assert nt.tolist() == [[7, 11, 12, 21, 23, 31], [8, 11, 12, 23, 24, 33]]
    assert npar.tolist() == [[-1, 0, 0, 1, 2, 3], [-1, 0, 0, 2, 2, 4]]
    assert nd.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 1, 2, 2, 3]]
    m0 = [[1, 0, 0, 0, 0, 0],
          [1, 1, 0, 0, 0, 0],
          [1, 0, 1, 0, 0, 0],
          [1, 1, 0, 1, 0, 0],
          [1, 0, 1, 0, 1, 0],
          [1, 1, 0, 1, 0, 1]]
    m1 = [[1, 0, 0, 0, 0, 0],
          [1, 1, 0, 0, 0, 0],
          [1, 0, 1, 0, 0, 0],
          [1, 0, 1, 1, 0, 0],
          [1, 0, 1, 0, 1, 0],
          [1, 0, 1, 0, 1, 1]]
    assert torch.equal(mask, torch.tensor([m0, m1], dtype=torch.bool))
    # each row is chosen independently of the other
    one = choose_tree(tokens[1:], scores[1:], parents[1:], depths, root[1:], 6, 3)
    assert one[0].tolist() == nt[1:].tolist() and one[1].tolist() == npar[1:].tolist()


def test_choose_tree_chain_when_n_is_2():
    tokens = torch.tensor([[5, 6, 9, 9]])
    scores = torch.tensor([[-2.0, -0.5, -2.1, -0.7]])
    parents = torch.tensor([[-1, -1, 0, 1]])
    depths = torch.tensor([1, 1, 2, 2])
    nt, npar, nd, mask = choose_tree(tokens, scores, parents, depths, torch.tensor([3]), 2, 2)
    assert nt.tolist() == [[3, 6]] and npar.tolist() == [[-1, 0]] and nd.tolist() == [[0, 1]]
    assert torch.equal(mask[0], torch.tensor([[True, False], [True, True]]))


def _beam_candidates(B: int, V: int, k: int, S: int, seed: int, peaked: float):
    """Candidates as a beam search builds them: depth 1 = the root's top-k; every further depth
    expands the k best of the previous depth into their top-k. Some logits rows are one-hot-ish
    (logp = 0 for the top token, LOG_ZERO for the rest) to make ties and zero log-probs."""
    g = torch.Generator().manual_seed(seed)

    def logits(n):
        x = torch.randn(B, n, V, generator=g) * 2
        sharp = torch.rand(B, n, generator=g) < peaked
        onehot = torch.full((B, n, V), float("-inf"))
        onehot[..., 0] = 0.0
        return torch.where(sharp[..., None], onehot, x)

    toks, scores, pars = [], [], []
    idx, lp = topk_logprobs(logits(1), k)                          # [B, 1, k]
    toks.append(idx[:, 0])
    scores.append(child_scores(torch.zeros(B, 1), lp[:, 0]))
    pars.append(torch.full((B, k), -1))
    offset = 0
    for _ in range(1, S):
        prev = scores[-1]                                          # [B, n_prev]
        beam = prev.topk(k, dim=1).indices                         # [B, k] within the previous depth
        idx, lp = topk_logprobs(logits(k), k)                      # [B, k, k]
        ps = prev.gather(1, beam)                                  # [B, k]
        s = child_scores(ps[..., None], lp)                        # [B, k, k]
        toks.append(idx.reshape(B, k * k))
        scores.append(s.reshape(B, k * k))
        pars.append((offset + beam)[..., None].expand(B, k, k).reshape(B, k * k))
        offset += prev.shape[1]
    depths = torch.cat([torch.full((t.shape[1],), d + 1) for d, t in enumerate(toks)])
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(pars, 1), depths


@pytest.mark.parametrize("seed,B,k,S,N,peaked", [
    (0, 1, 2, 3, 6, 0.0), (1, 4, 2, 3, 8, 0.3), (2, 8, 3, 4, 12, 0.5), (3, 16, 4, 5, 30, 0.3),
    (4, 5, 2, 6, 11, 0.9), (5, 32, 3, 3, 16, 0.2), (6, 7, 4, 4, 50, 1.0), (7, 3, 5, 2, 4, 0.0),
])
def test_choose_tree_properties_on_beam_candidates(seed, B, k, S, N, peaked):
    V = 20
    tokens, scores, cparents, depths = _beam_candidates(B, V, k, S, seed, peaked)
    C = scores.shape[1]
    assert N - 1 <= C
    root = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(seed))
    nt, npar, nd, mask = choose_tree(tokens, scores, cparents, depths, root, N, S)
    assert nt.shape == (B, N) and npar.shape == (B, N) and nd.shape == (B, N) and mask.shape == (B, N, N)
    # the best candidate positions: recover which candidate each node is (by score and token)
    for b in range(B):
        assert int(npar[b, 0]) == -1 and int(nd[b, 0]) == 0 and int(nt[b, 0]) == int(root[b])
        best = scores[b].topk(N - 1).values.sort().values
        # reconstruct chosen candidates: the tree is ancestor-closed and depth-sorted
        # map node -> candidate by replaying choose_tree's contract independently
        chosen = _match_nodes(tokens[b], scores[b], cparents[b], nt[b], npar[b])
        chosen_scores = scores[b, chosen].sort().values
        assert torch.equal(chosen_scores, best), "not the N-1 best scores"
        for i in range(1, N):
            p = int(npar[b, i])
            assert 0 <= p < i                                       # parents come first
            assert int(nd[b, i]) == int(nd[b, p]) + 1               # depth = parent depth + 1
            assert int(nd[b, i]) == int(depths[chosen[i - 1]])
            cp = int(cparents[b, chosen[i - 1]])                    # the candidate's true parent
            if cp < 0:
                assert p == 0
            else:
                assert p >= 1 and chosen[p - 1] == cp
        assert (nd[b, 1:] >= nd[b, :-1]).all()                      # sorted by depth
        assert torch.equal(mask[b].sum(1), nd[b] + 1)               # itself + depth ancestors
        assert mask[b].diagonal().all() and mask[b, :, 0].all()
        # mask row i = i plus its parent's row
        for i in range(1, N):
            row = mask[b, int(npar[b, i])].clone()
            row[i] = True
            assert torch.equal(mask[b, i], row)


def _match_nodes(ctok, cscore, cpar, nt, npar):
    """The candidate index of every non-root node: candidates are laid out in increasing index
    order (choose_tree sorts), so walk the nodes and match token + parent node uniquely."""
    N = nt.shape[0]
    node_to_cand = []
    for i in range(1, N):
        p = int(npar[i])
        want_cp = -1 if p == 0 else node_to_cand[p - 1]
        lo = node_to_cand[-1] + 1 if node_to_cand else 0           # strictly increasing indices
        options = [c for c in range(lo, ctok.shape[0])
                   if int(ctok[c]) == int(nt[i]) and int(cpar[c]) == want_cp]
        assert options, f"node {i} matches no candidate"
        node_to_cand.append(options[0])
    return node_to_cand


def test_choose_tree_ties_of_zero_logprob_keep_tree_closed():
    # Every logits row one-hot: each parent has one child of logp 0 (score = nextafter(parent))
    # and k-1 children at about LOG_ZERO. The chosen tree must be the chain of logp-0 children
    # and then LOG_ZERO siblings whose parents are chosen too.
    B, V, k, S, N = 3, 10, 2, 4, 7
    tokens, scores, cparents, depths = _beam_candidates(B, V, k, S, seed=11, peaked=1.0)
    nt, npar, nd, mask = choose_tree(tokens, scores, cparents, depths, torch.zeros(B, dtype=torch.int64), N, S)
    for b in range(B):
        for i in range(1, N):
            assert 0 <= int(npar[b, i]) < i
            assert int(nd[b, i]) == int(nd[b, int(npar[b, i])]) + 1
        # the probability-1 chain is always inside: token 0 at depths 1..S
        chain_nodes = [i for i in range(1, N) if int(nt[b, i]) == 0]
        assert sorted(int(nd[b, i]) for i in chain_nodes)[:S] == list(range(1, S + 1))
