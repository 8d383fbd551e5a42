"""Accepted-path KV compaction kernel against the torch reference
(specbatch.runtime.kv_cache.compact_path): random trees and accepted paths, several planes,
bf16 / fp32, slots in any order, pad rows on a shared dummy slot, and CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from specbatch.kernels.compact import compact_path
from specbatch.runtime.kv_cache import compact_path as ref_compact_path

CUDA = torch.device("cuda")


def _paths(B: int, N: int, W: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(path [B, W], num [B]) of root-to-node walks in random depth-ordered trees of N nodes:
    increasing, path[j] >= j, padded by repeating the last node."""
    path = torch.zeros(B, W, dtype=torch.int64)
    num = torch.ones(B, dtype=torch.int64)
    for b in range(B):
        parent, depth = [-1], [0]
        for i in range(1, N):
            # any earlier node shallow enough; depth order is kept by sorting below
            cands = [k for k in range(i) if depth[k] < W - 1]
            p = cands[int(torch.randint(len(cands), (1,), generator=g))]
            parent.append(p)
            depth.append(depth[p] + 1)
        # relabel nodes in depth order (stable), as choose_tree lays them out
        order = sorted(range(N), key=lambda k: depth[k])
        label = {k: r for r, k in enumerate(order)}
        node = int(torch.randint(N, (1,), generator=g))
        walk = []
        while node != -1:
            walk.append(label[node])
            node = parent[node]
        walk.reverse()
        path[b, :len(walk)] = torch.tensor(walk)
        path[b, len(walk):] = walk[-1]
        num[b] = len(walk)
    return path, num


def _case(P=4, slots=6, rows=40, H=2, D=16, B=5, N=10, W=5, pads=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(P, slots + 1, rows, H, D, generator=g).to(dtype)
    real = torch.randperm(slots, generator=g)[:B]                     # any order
    path, num = _paths(B, N, W, g)
    start = torch.randint(0, rows - N + 1, (B,), generator=g)
    dummy = torch.full((pads,), slots)                                # pad rows share the dummy slot
    return (kv, torch.cat([real, dummy]), torch.cat([start, torch.zeros(pads, dtype=torch.int64)]),
            torch.cat([path, torch.zeros(pads, W, dtype=torch.int64)]),
            torch.cat([num, torch.ones(pads, dtype=torch.int64)]))


def _check(kv, slots, start, path, num, device=torch.device("cpu")):
    want = kv.clone()
    ref_compact_path(want, slots, start, path, num)
    got = kv.to(device, copy=True)
    compact_path(got, *(t.to(device) for t in (slots, start, path, num)))
    assert torch.equal(got.cpu(), want)
    return want


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference(dtype, seed):
    kv, slots, start, path, num = _case(dtype=dtype, seed=seed)
    want = _check(kv, slots, start, path, num)
    assert not torch.equal(want, kv)                                 # something moved
    assert (num > 1).any() and (path != torch.arange(path.shape[1])).any()


@pytest.mark.interpreter
def test_chunked_rows_and_long_paths():
    # Hkv * D = 60 with a 32-element block: two chunks per row, one of them partial
    kv, slots, start, path, num = _case(P=2, H=3, D=20, B=3, N=12, W=8, pads=1, seed=5)
    want = kv.clone()
    ref_compact_path(want, slots, start, path, num)
    compact_path(kv, slots, start, path, num, block=32)
    assert torch.equal(kv, want)


@pytest.mark.interpreter
def test_overlapping_shift():
    # every destination is the previous copy's source: rows 2,3,4,5 -> 1,2,3,4 (and 7 -> 5)
    kv, slots, start, _, _ = _case(B=2, pads=0, W=6)
    path = torch.tensor([[0, 2, 3, 4, 5, 7], [0, 1, 3, 4, 4, 4]])
    num = torch.tensor([6, 4])
    want = kv.clone()
    ref_compact_path(want, slots, start, path, num)
    compact_path(kv, slots, start, path, num)
    assert torch.equal(kv, want)


@pytest.mark.interpreter
def test_nothing_to_move():
    kv, slots, start, _, _ = _case(B=3, pads=0)
    path = torch.arange(5).expand(3, 5).contiguous()                  # every node already in place
    num = torch.tensor([5, 2, 1])
    before = kv.clone()
    compact_path(kv, slots, start, path, num)
    assert torch.equal(kv, before)


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_real_sizes(dtype):
    # 4 layers (8 planes), 8 KV heads x 128, 64 sequences + 8 pad rows, trees of 64 nodes
    kv, slots, start, path, num = _case(P=8, slots=72, rows=72, H=8, D=128, B=64, N=64, W=9,
                                        pads=8, dtype=dtype, seed=7)
    _check(kv, slots, start, path, num, CUDA)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    kv, slots, start, path, num = _case(P=8, slots=16, rows=80, H=4, D=64, B=12, N=20, W=6, seed=3)
    dev = [t.to(CUDA) for t in (kv, slots, start, path, num)]
    compact_path(*dev)                                               # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compact_path(*dev)
    g = torch.Generator().manual_seed(11)
    for seed in range(3):
        kv2, _, _, _, _ = _case(P=8, slots=16, rows=80, H=4, D=64, B=12, N=20, W=6, seed=20 + seed)
        p, n = _paths(12, 20, 6, g)
        dev[0].copy_(kv2)
        dev[3][:12].copy_(p)
        dev[4][:12].copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = kv2.clone()
        ref_compact_path(want, slots, start, dev[3].cpu(), dev[4].cpu())
        assert torch.equal(dev[0].cpu(), want)


def _paged(kv: torch.Tensor, page: int, seed: int = 0):
    """[P, S, rows, H, D] -> a shuffled page pool [P, pages + 1, page, H, D] and its table."""
    planes, S, rows, H, D = kv.shape
    per = rows // page
    order = torch.randperm(S * per, generator=torch.Generator().manual_seed(seed)) + 1
    pool = torch.zeros(planes, S * per + 1, page, H, D, dtype=kv.dtype)
    pool[:, order] = kv.reshape(planes, S * per, page, H, D)
    return pool, order.view(S, per).to(torch.int32)


@pytest.mark.interpreter
@pytest.mark.parametrize("page", [4, 8])
def test_paged_pool_matches_the_static_cache(page):
    kv, slots, start, path, num = _case(seed=3)
    want = kv.clone()
    ref_compact_path(want, slots, start, path, num)
    for compact in (ref_compact_path, compact_path):              # torch path and kernel, both paged
        pool, table = _paged(kv, page)
        compact(pool, slots, start, path, num, page_table=table)
        back = pool[:, table.view(-1).long()].reshape(kv.shape)
        assert torch.equal(back, want)
