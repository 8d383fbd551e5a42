"""Shared by the tree-acceptance tests (tests/speculative/test_accept_*.py): batch sampling on the
CPU, int64 tensors, and the statistics of the lossless tests: a chi-square check against a target
law computed independently in float64, the fixed tree with its per-node laws, many-seed runs (the
tree's cached: several tests read the same run), and the walk's consistency checks."""
from __future__ import annotations

import functools

import torch

from specbatch.sampling import BatchSampling, SamplingParams
from specbatch.speculative.accept import accept

CPU = torch.device("cpu")


def _sp(params: list[SamplingParams]) -> BatchSampling:
    return BatchSampling.build(params, CPU)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# ------------------------------------------------------------------------------------ statistics


def _chi2_sf(stat: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _assert_distribution(samples: torch.Tensor, p: torch.Tensor, what: str, alpha: float = 1e-3):
    """Check samples [n] ~ p [V] (float64): zero-probability tokens must never appear, then a
    chi-square over the rest with bins of expected count < 5 merged."""
    V = p.shape[0]
    n = samples.numel()
    assert n > 0, what
    counts = torch.bincount(samples, minlength=V).double()
    zero = p <= 0
    assert counts[zero].sum() == 0, f"{what}: zero-probability tokens emitted {counts[zero].tolist()}"
    exp = n * p
    big = (exp >= 5) & ~zero
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    small = ~big & ~zero
    if small.any():
        obs_b.append(float(counts[small].sum()))
        exp_b.append(float(exp[small].sum()))
    if len(exp_b) <= 1:
        return
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    pv = _chi2_sf(stat, len(exp_b) - 1)
    assert pv > alpha, f"{what}: chi2={stat:.1f} dof={len(exp_b) - 1} p={pv:.2e} n={n}\n" \
                       f"obs={counts.tolist()}\nexp={exp.tolist()}"


def _reference_probs(p: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """The distribution sampling must follow, computed independently in float64 from p [V]
    (temperature, then top-k, then the smallest prefix of the renormalised top-k reaching top_p,
    as Hugging Face's warpers chain). p must have no ties."""
    q = p.double() ** (1.0 / temperature)
    order = q.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]                        # top-p then acts on the renormalised top-k
    q = q / q[order].sum()
    keep = torch.zeros_like(q, dtype=torch.bool)
    mass = 0.0
    for rank, v in enumerate(order):
        if rank > 0 and mass >= top_p:
            break
        keep[v] = True
        mass += float(q[v])
    q = torch.where(keep, q, torch.zeros_like(q))
    return q / q.sum()


# The fixed tree (V = 8):          root(6)
#                                 /       \
#                          n1 (2)          n2 (5)   <- p_root(5) = 0.02: a rare candidate
#                          /    \              \
#                    n3 (1)    n4 (7)          n5 (0)
#                      |       ^ n1's candidates 1 and 7 hold 90 % of p_n1
#                    n6 (3)
TREE_TOKENS = [6, 2, 5, 1, 7, 0, 3]
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TREE_DEPTH = 3
P = torch.tensor([
    [0.11, 0.05, 0.40, 0.08, 0.12, 0.02, 0.13, 0.09],     # root
    [0.010, 0.550, 0.020, 0.030, 0.015, 0.025, 0.005, 0.345],  # n1
    [0.30, 0.04, 0.06, 0.08, 0.10, 0.12, 0.14, 0.16],     # n2
    [0.05, 0.06, 0.11, 0.45, 0.09, 0.12, 0.04, 0.08],     # n3
    [0.13, 0.12, 0.14, 0.11, 0.15, 0.10, 0.16, 0.09],     # n4
    [0.21, 0.19, 0.08, 0.12, 0.07, 0.11, 0.13, 0.09],     # n5
    [0.28, 0.05, 0.06, 0.11, 0.19, 0.10, 0.12, 0.09],     # n6
], dtype=torch.float64)


def _run_many(node_tokens, parents, logits, max_depth, n_rows, start=17, **kw):
    sp = _sp([SamplingParams(seed=i, **kw) for i in range(n_rows)])
    nt = _t([node_tokens]).expand(n_rows, -1)
    par = _t([parents]).expand(n_rows, -1)
    lg = logits.float()[None].expand(n_rows, -1, -1)
    acc = accept(nt, par, lg, sp, torch.full((n_rows,), start, dtype=torch.int64), max_depth)
    _check_walk_consistent(acc, node_tokens, parents, max_depth)
    return acc


def _check_walk_consistent(acc, node_tokens, parents, max_depth):
    """Every emitted token but the last is the token of the next node on the path, that node is a
    child of the previous one, and the last token is never a child of the last node (a child's
    token is accepted at its node, and removed from the residual)."""
    nt, par = _t(node_tokens), _t(parents)
    B = acc.num.shape[0]
    assert ((acc.num >= 1) & (acc.num <= max_depth + 1)).all()
    assert (acc.path[:, 0] == 0).all()
    for d in range(max_depth):
        live = acc.num > d + 1                     # token d was an accepted draft
        nxt = acc.path[:, d + 1]
        assert (nt[nxt][live] == acc.tokens[live, d]).all()
        assert (par[nxt][live] == acc.path[live, d]).all()
    last = acc.num - 1
    rows = torch.arange(B)
    last_node = acc.path[rows, last]
    last_tok = acc.tokens[rows, last]
    child_of = (par[None, :] == last_node[:, None]) & (nt[None, :] == last_tok[:, None])   # [B, N]
    assert not child_of.any(), "the walk stopped on a token that is a child of the current node"


def _check_tree_law(acc, probs, node_tokens, parents, tag):
    """(a) first token ~ p_root; (b) for every node, given the walk reached it, the next token ~ its
    p; (c) a first token that is no candidate ends the walk."""
    nt, par = _t(node_tokens), _t(parents)
    N = nt.shape[0]
    # rows whose walk reached node i (at its depth) and emitted a token from it
    for i in range(N):
        depth = 0
        j = i
        while par[j] >= 0:
            j = int(par[j])
            depth += 1
        sel = (acc.num > depth) & (acc.path[:, depth] == i)
        if i == 0:
            assert sel.all()
        if sel.sum() < 30:
            continue
        _assert_distribution(acc.tokens[sel, depth], probs[i], f"{tag}: token after node {i}")
    root_kids = nt[par == 0]
    not_cand = ~torch.isin(acc.tokens[:, 0], root_kids)
    assert (acc.num[not_cand] == 1).all()
    assert (acc.num[~not_cand] >= 2).all()


ROWS = 30_000


@functools.lru_cache(maxsize=None)
def _tree_run(kw_items: tuple, rows: int = ROWS, start: int = 17):
    """The fixed tree over `rows` seeds (0..rows-1), cached: several tests read the same run."""
    return _run_many(TREE_TOKENS, TREE_PARENTS, P.log(), TREE_DEPTH, rows, start=start, **dict(kw_items))
