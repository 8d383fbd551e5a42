"""Experiment: a warp-specialised Hopper GEMM (Triton) against cuBLAS at 64-512 rows (GPU only).

    python benchmarks/gemm_ws.py [--rows 256,128,512,64] [--shapes gate_up,down]

`gemm_tma.py` found TMA loads alone at 0.80-0.95x of cuBLAS where a batch-64 eagle3_topk1 verify
runs (256 rows), and named warp specialisation (a producer warp issuing TMA loads into a ring of
shared-memory stages while the consumer warps run wgmma) as what is missing. Triton 3.5+ gives
it on Hopper through `tl.range(..., warp_specialize=True)` over device-side tensor descriptors.
Two forms, each with and without warp specialisation:
  P  persistent: min(tiles, SMs) programs walk the output tiles (grouped for L2 reuse);
  T  one program per output tile.
Same graph form as `gemm_rows.py` (32 calls, 4 weight sets rotated); prints the best config per
shape and row count against cuBLAS and the floor max(weight bytes / bandwidth, FLOPs / rate),
with the max |difference| from torch.mm's result (0 = bit-identical). A config whose result is
off by more than bf16 rounding is listed as failed, not timed. (A split-K form, run once at
561800c, summed wrongly on the H100 though right under the interpreter; dropped, not debugged:
gemm_tma.py's split-K had already lost to cuBLAS.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemm_rows import LAYERS, SETS
from gemm_triton import cases, grouped_tile, rank_configs   # arguments, weights, cuBLAS, floor; tile order; the sweep

# (form, BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, warp_specialize)
CONFIGS = [("P", 128, 128, 64, 4, 4, True), ("P", 128, 128, 64, 4, 8, True), ("P", 128, 256, 64, 3, 8, True),
           ("P", 64, 128, 64, 4, 4, True), ("P", 128, 64, 64, 4, 4, True), ("P", 128, 128, 128, 3, 8, True),
           ("P", 256, 128, 64, 3, 8, True), ("P", 64, 64, 128, 4, 4, True), ("P", 128, 128, 64, 4, 8, False),
           ("P", 128, 256, 64, 3, 8, False), ("P", 64, 128, 64, 4, 4, False), ("T", 128, 128, 64, 4, 4, True),
           ("T", 128, 256, 64, 3, 8, True), ("T", 64, 128, 64, 4, 4, True), ("T", 128, 128, 64, 4, 4, False)]


@triton.jit
def _mm_persistent(a_ptr, b_ptr, c_ptr, M, N, K, NUM_PROGS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    # c [M, N] = a [M, K] @ b [N, K]^T, all row-major contiguous
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=False, warp_specialize=WS):
        pm, pn = grouped_tile(tile, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([pm * BM, kt * BK])
            b = b_desc.load([pn * BN, kt * BK])
            acc = tl.dot(a, b.T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(c_ptr.dtype.element_ty))


@triton.jit
def _mm_tile(a_ptr, b_ptr, c_ptr, M, N, K,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, WS: tl.constexpr):
    # one program per output tile
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pm, pn = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), tl.float32)
    for kt in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        a = a_desc.load([pm * BM, kt * BK])
        b = b_desc.load([pn * BN, kt * BK])
        acc = tl.dot(a, b.T, acc)
    c_desc.store([pm * BM, pn * BN], acc.to(c_ptr.dtype.element_ty))


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # global memory for device-side tensor descriptors
    return torch.empty(size, device="cuda", dtype=torch.int8)


def mm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: tuple, sms: int) -> None:
    form, bm, bn, bk, stages, warps, ws = cfg
    M, K = a.shape
    N = b.shape[0]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if form == "P":
        progs = min(tiles, sms)
        _mm_persistent[(progs,)](a, b, c, M, N, K, NUM_PROGS=progs, BM=bm, BN=bn, BK=bk, GROUP_M=8, WS=ws,
                                 num_stages=stages, num_warps=warps)
    else:
        _mm_tile[(tiles,)](a, b, c, M, N, K, BM=bm, BN=bn, BK=bk, GROUP_M=8, WS=ws,
                           num_stages=stages, num_warps=warps)


def main() -> None:
    triton.set_allocator(_scratch)
    for m, name, o, ws, x, y, floor, t_blas, sms, reps in cases():
        results = rank_configs(CONFIGS, lambda cfg: [lambda j=j: mm(x, ws[j % SETS], y, cfg, sms)
                                                     for j in range(LAYERS)], x, ws[0], y, reps)
        t, cfg, note = results[0]
        tiles = triton.cdiv(m, cfg[1]) * triton.cdiv(o, cfg[2])
        print(f"M {m:4d} {name:8s} floor {floor:7.1f} us  cuBLAS {t_blas:7.1f} ({floor / t_blas:4.0%})  "
              f"best {t:7.1f} ({floor / t:4.0%}, {t_blas / t:4.2f}x) {cfg} {tiles} units "
              f"({tiles / sms:.2f} waves) {note}", flush=True)
        print("   next: " + ", ".join(f"{r[1]} {r[0]:.1f}" for r in results[1:6]), flush=True)
        for form, w in (("P", True), ("P", False), ("T", True), ("T", False)):
            best = [r for r in results if r[1][0] == form and r[1][6] == w and r[0] < float("inf")]
            if best:
                print(f"   best {form} ws={int(w)}: {best[0][0]:.1f} us {best[0][1]} {best[0][2]}")
        bad = [r for r in results if r[0] == float("inf")]
        if bad:
            print("   failed:", "; ".join(f"{r[1]} {r[2][:100]}" for r in bad), flush=True)


if __name__ == "__main__":
    main()
