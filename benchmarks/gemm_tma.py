"""Experiment: a Hopper GEMM with TMA loads and split-K against cuBLAS at 64-512 rows (GPU only).

    python benchmarks/gemm_tma.py [--rows 64,128,256,320,512] [--shapes gate_up,down]

`gemm_triton.py` found a textbook Triton GEMM (pointer loads) at 0.68-0.77x of cuBLAS where a
batch-64 eagle3_topk1 verify runs (256 rows), and cuBLAS itself at 58-75% of the floor there: o
and down (N = 4,096) give cuBLAS's 128 x 128 tiles 64 programs for 132 SMs. This kernel loads both
operands through TMA descriptors (wgmma operands straight from shared memory, no address
arithmetic in registers) and can split K: SPLIT programs per output tile write fp32 partials,
and the last to arrive (an arrival counter per tile, left at zero) sums them in split order, so
results do not depend on arrival order. Sweeps tile shapes x splits in the graph form of
`gemm_rows.py` (32 calls, 4 weight sets rotated) and prints the best per shape and row count
against cuBLAS and the floor max(weight bytes / bandwidth, FLOPs / matmul rate).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemm_rows import LAYERS, SETS
from gemm_triton import cases, grouped_tile, rank_configs   # arguments, weights, cuBLAS, floor; tile order; the sweep

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, SPLIT)
CONFIGS = [(128, 128, 64, 4, 8, 1), (128, 128, 64, 4, 8, 2), (128, 128, 64, 4, 4, 2), (128, 128, 64, 4, 8, 3),
           (128, 128, 64, 4, 8, 4), (128, 256, 64, 3, 8, 1), (128, 256, 64, 3, 8, 2), (64, 128, 64, 4, 4, 1),
           (64, 128, 64, 4, 4, 2), (64, 256, 64, 4, 8, 1), (128, 64, 64, 4, 4, 1), (128, 64, 64, 4, 4, 2),
           (128, 128, 128, 3, 8, 1), (128, 128, 128, 3, 8, 2), (256, 128, 64, 3, 8, 1), (64, 64, 128, 4, 4, 1),
           (64, 64, 128, 4, 4, 2)]


@triton.jit
def _mm_tma_kernel(a_desc, b_desc, c_ptr, part_ptr, cnt_ptr, M, N, K, scm,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                   SPLIT: tl.constexpr):
    # c [M, N] = a [M, K] @ b [N, K]^T; program (tile, s) sums K tiles [s * per, (s + 1) * per)
    s = tl.program_id(1)
    pm, pn = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    k_tiles = tl.cdiv(K, BK)
    per = tl.cdiv(k_tiles, SPLIT)
    k_lo = s * per
    k_hi = tl.minimum(k_lo + per, k_tiles)
    acc = tl.zeros((BM, BN), tl.float32)
    for kt in range(k_lo, k_hi):
        a = a_desc.load([pm * BM, kt * BK])
        b = b_desc.load([pn * BN, kt * BK])
        acc = tl.dot(a, b.T, acc)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        off = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + s * M * N + off, acc, mask=mask)
        tl.debug_barrier()                       # every thread's partial before the release below
        tile = pm * tl.cdiv(N, BN) + pn
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            tl.debug_barrier()
            tot = tl.zeros((BM, BN), tl.float32)
            for j in tl.static_range(SPLIT):     # split order, whoever arrived last
                tot += tl.load(part_ptr + j * M * N + off, mask=mask, other=0.0)
            tl.store(c_ptr + rm[:, None] * scm + rn[None, :], tot.to(c_ptr.dtype.element_ty), mask=mask)
            tl.store(cnt_ptr + tile, 0)


class TmaMM:
    """c = a @ b^T for fixed tensors and config (descriptors built once, as a captured graph keeps them)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: tuple[int, ...],
                 part: torch.Tensor, cnt: torch.Tensor) -> None:
        bm, bn, bk, self.stages, self.warps, self.split = cfg
        self.a, self.b, self.c, self.part, self.cnt = a, b, c, part, cnt
        self.bm, self.bn, self.bk = bm, bn, bk
        self.a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        self.b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
        M, K = a.shape
        N = b.shape[0]
        self.grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), self.split)
        self.MNK = (M, N, K)

    def __call__(self) -> None:
        M, N, K = self.MNK
        _mm_tma_kernel[self.grid](self.a_desc, self.b_desc, self.c, self.part, self.cnt, M, N, K, self.c.stride(0),
                                  BM=self.bm, BN=self.bn, BK=self.bk, GROUP_M=8, SPLIT=self.split,
                                  num_stages=self.stages, num_warps=self.warps)


def main() -> None:
    cnt = None
    for m, name, o, ws, x, y, floor, t_blas, sms, reps in cases():
        if cnt is None:
            cnt = torch.zeros(65536, device=x.device, dtype=torch.int32)
        part = torch.empty(max(c[5] for c in CONFIGS) * m * o, device=x.device, dtype=torch.float32)
        results = rank_configs(CONFIGS, lambda cfg: [TmaMM(x, ws[j % SETS], y, cfg, part, cnt) for j in range(LAYERS)],
                               x, ws[0], y, reps)
        t, cfg, note = results[0]
        tiles = triton.cdiv(m, cfg[0]) * triton.cdiv(o, cfg[1]) * cfg[5]
        print(f"M {m:4d} {name:8s} floor {floor:7.1f} us  cuBLAS {t_blas:7.1f} ({floor / t_blas:4.0%})  "
              f"tma {t:7.1f} ({floor / t:4.0%}, {t_blas / t:4.2f}x) {cfg} {tiles} programs "
              f"({tiles / sms:.2f} waves) {note}; next: " + ", ".join(f"{r[1]} {r[0]:.1f}" for r in results[1:4]),
              flush=True)
        bad = [r for r in results if r[0] == float("inf")]
        if bad:
            print("   failed:", "; ".join(f"{r[1]} {r[2][:100]}" for r in bad[:3]))


if __name__ == "__main__":
    main()
