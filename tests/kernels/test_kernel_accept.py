"""The tree acceptance kernel against specbatch.speculative.accept.accept (all-greedy sampling),
element for element: random depth-ordered trees and chains, targets that stop the walk at every
depth, duplicate tokens among siblings, `out=` and CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from specbatch.kernels.accept import walk_targets
from specbatch.sampling import BatchSampling, SamplingParams
from specbatch.speculative.accept import accept

CUDA = torch.device("cuda")


def _random_trees(B: int, N: int, max_depth: int, V: int, g: torch.Generator):
    """Depth-ordered trees like choose_tree makes (parents[i] < i, nodes sorted by depth, depth
    <= max_depth, every level used); tokens from a small vocabulary, so siblings share tokens."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        levels = int(torch.randint(1, min(max_depth, N - 1) + 1, (1,), generator=g)) if N > 1 else 0
        extra = torch.randint(1, levels + 1, (N - 1 - levels,), generator=g).tolist() if levels else []
        members: dict[int, list[int]] = {0: [0]}
        for i, level in enumerate(sorted(list(range(1, levels + 1)) + extra), start=1):
            prev = members[level - 1]
            parents[b, i] = prev[int(torch.randint(len(prev), (1,), generator=g))]
            members.setdefault(level, []).append(i)
    return torch.randint(V, (B, N), generator=g), parents


def _chains(B: int, N: int, V: int, g: torch.Generator):
    parents = (torch.arange(N) - 1).expand(B, N).clone()
    return torch.randint(V, (B, N), generator=g), parents


def _targets_stopping_everywhere(tokens, parents, g, V):
    """Target argmaxes: sequence b follows a random branch for b levels, then misses (token V,
    which no node holds) unless it reached a leaf first; elsewhere random."""
    B, N = tokens.shape
    am = torch.randint(V + 1, (B, N), generator=g)
    for b in range(B):
        cur = 0
        for _ in range(b):
            kids = (parents[b] == cur).nonzero().flatten()
            if len(kids) == 0:
                break
            nxt = int(kids[torch.randint(len(kids), (1,), generator=g)])
            am[b, cur] = tokens[b, nxt]
            cur = nxt
        am[b, cur] = V
    return am


def _reference(tokens, parents, am, max_depth, V):
    B, N = tokens.shape
    logits = torch.zeros(B, N, V + 1)
    logits.scatter_(2, am[..., None], 1.0)                 # argmax = am
    sp = BatchSampling.build([SamplingParams()] * B, tokens.device)
    acc = accept(tokens, parents, logits, sp, torch.zeros(B, dtype=torch.int64), max_depth)
    return acc.tokens, acc.num, acc.path


def _depth(parents: torch.Tensor) -> int:
    d = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        d[:, i] = d.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    return int(d.max())


def _check(tokens, parents, am, max_depth, V, device=torch.device("cpu")):
    ref = _reference(tokens, parents, am, max_depth, V)
    got = walk_targets(tokens.to(device), parents.to(device), am.to(device), max_depth)
    for r, x in zip(ref, got):
        assert torch.equal(x.cpu(), r)
    return ref


@pytest.mark.interpreter
@pytest.mark.parametrize("B,N,max_depth,V", [(16, 8, 3, 3), (12, 16, 5, 4), (6, 5, 4, 2)])
def test_random_trees(B, N, max_depth, V):
    g = torch.Generator().manual_seed(B * N)
    tokens, parents = _random_trees(B, N, max_depth, V, g)
    am = _targets_stopping_everywhere(tokens, parents, g, V)
    ref = _check(tokens, parents, am, max_depth, V)
    assert ref[1].min() == 1 and ref[1].max() > 2            # stops early and goes deep


@pytest.mark.interpreter
@pytest.mark.parametrize("N", [1, 2, 7])
def test_chains_stop_at_every_depth(N):
    B, V = N + 1, 50
    g = torch.Generator().manual_seed(N)
    tokens, parents = _chains(B, N, V, g)
    am = torch.randint(V, (B, N), generator=g)
    am[:, :N - 1] = tokens[:, 1:]                            # the target agrees everywhere ...
    for b in range(B):
        if b < N - 1:
            am[b, b] = (tokens[b, b + 1] + 1) % V             # ... except at depth b
    tokens_r, num, _ = _check(tokens, parents, am, N - 1, V)
    assert num.tolist() == [min(b, N - 1) + 1 for b in range(B)]
    _check(tokens, parents, am, N + 2, V)                      # a deeper bound than the tree


@pytest.mark.interpreter
def test_duplicate_sibling_tokens_take_the_first():
    #        root
    #   n1(4) n2(4) n3(4)      n2 has a child n4(6), n1 has none: the first child wins (n1)
    tokens = torch.tensor([[9, 4, 4, 4, 6]])
    parents = torch.tensor([[-1, 0, 0, 0, 2]])
    am = torch.tensor([[4, 8, 6, 1, 2]])
    tok, num, path = _check(tokens, parents, am, 2, 10)
    assert tok.tolist() == [[4, 8, 0]] and num.tolist() == [2] and path.tolist() == [[0, 1, 1]]


@pytest.mark.interpreter
def test_out_is_fully_written_and_strided_inputs():
    g = torch.Generator().manual_seed(3)
    tokens, parents = _random_trees(5, 9, 4, 3, g)
    am = _targets_stopping_everywhere(tokens, parents, g, 3)
    D = _depth(parents)
    out = (torch.full((5, D + 1), -99, dtype=torch.int64), torch.full((5,), -99, dtype=torch.int64),
           torch.full((5, D + 1), -99, dtype=torch.int64))
    wide = torch.zeros(5, 20, dtype=torch.int64)
    wide[:, :9] = am
    res = walk_targets(tokens, parents, wide[:, :9], D, out=out)
    assert all(r is o for r, o in zip(res, out))
    for r, x in zip(_reference(tokens, parents, am, D, 3), out):
        assert torch.equal(x, r)


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("B,N,max_depth,V", [(64, 64, 8, 3), (256, 32, 6, 2), (33, 64, 63, 2)])
def test_gpu_random_trees(B, N, max_depth, V):
    g = torch.Generator().manual_seed(N + B)
    if max_depth == N - 1:
        tokens, parents = _chains(B, N, V, g)
    else:
        tokens, parents = _random_trees(B, N, max_depth, V, g)
    am = _targets_stopping_everywhere(tokens, parents, g, V)
    _check(tokens, parents, am, max_depth, V, CUDA)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    B, N, V = 32, 16, 3
    g = torch.Generator().manual_seed(0)
    tokens, parents = _random_trees(B, N, 5, V, g)
    D = _depth(parents)
    args = [t.to(CUDA) for t in (tokens, parents, _targets_stopping_everywhere(tokens, parents, g, V))]
    out = (torch.empty(B, D + 1, dtype=torch.int64, device=CUDA), torch.empty(B, dtype=torch.int64, device=CUDA),
           torch.empty(B, D + 1, dtype=torch.int64, device=CUDA))
    walk_targets(*args, D, out=out)                       # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        walk_targets(*args, D, out=out)
    for _ in range(3):
        am = _targets_stopping_everywhere(tokens, parents, g, V)
        args[2].copy_(am)
        for o in out:
            o.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        for r, x in zip(_reference(tokens, parents, am, D, V), out):
            assert torch.equal(x.cpu(), r)
