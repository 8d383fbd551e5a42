"""Experiment: can a Triton GEMM beat cuBLAS where the verify GEMMs sit (64-512 rows)? (GPU only)

    python benchmarks/gemm_triton.py [--rows 64,128,256,320,512] [--shapes gate_up,down]

At 256 rows cuBLAS runs Llama-3.1-8B's GEMMs at ~73% of max(weight bytes / bandwidth, FLOPs /
matmul rate) on the H100 (`gemm_rows.py`), where a batch-64 eagle3_topk1 verify (4 tokens a row)
needs ~10% more for the steady 1.9x. One cause is wave quantization: cuBLAS's 256 x 128 tile
gives 224 tiles of gate_up for 132 SMs (1.7 waves). Here the textbook Triton kernel (tiles
ordered in groups of GROUP_M row-tiles for L2 reuse, tl.dot on tensor cores, num_stages-deep
pipelining) over a small sweep of tile shapes, some of which divide N into ~whole waves; each
shape x config timed as 32 calls in a CUDA graph (4 weight sets rotated, so weights come from
HBM), median, against torch.mm in the same graph form. Prints the best config per shape and row
count and its ratio to cuBLAS.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from specbatch.bench.floor import copy_bandwidth
from specbatch.bench.job import matmul_rate
from specbatch.bench.timing import graph_us

from gemm_rows import LAYERS, SETS, SHAPES      # the same GEMMs and graph form as gemm_rows.py

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (64, 256, 64, 4, 8),
           (64, 128, 64, 5, 4), (64, 64, 128, 4, 4), (128, 64, 64, 5, 4), (256, 64, 64, 4, 8),
           (256, 128, 64, 3, 8)]


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's output tile (row tile, column tile): GROUP_M row tiles share each column
    tile's weight reads while they are in L2."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * n_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sbn, scm,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # c [M, N] = a [M, K] @ b [N, K]^T (b: nn.Linear's weight layout)
    pm, pn = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * sam + rk[None, :]
    b = b_ptr + rn[None, :] * sbn + rk[:, None]                     # [BLOCK_K, BLOCK_N] view of b^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(a, mask=rm[:, None] < M, other=0.0)
        w = tl.load(b, mask=rn[None, :] < N, other=0.0)
        acc = tl.dot(x, w, acc)
        a += BLOCK_K
        b += BLOCK_K
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def mm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, cfg: tuple[int, ...]) -> None:
    bm, bn, bk, stages, warps = cfg
    M, K = a.shape
    N = b.shape[0]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _mm_kernel[grid](a, b, c, M, N, K, a.stride(0), b.stride(0), c.stride(0),
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_stages=stages, num_warps=warps)


def cases(argv: list[str] | None = None):
    """Parses --rows / --shapes / --reps (from argv, default the command line), prints the machine
    line, then yields one case per row count and shape: (m, name, out features, weight sets, x, y,
    floor us, cuBLAS us, SMs, reps)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,256,320,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    dev, bf = torch.device("cuda"), torch.bfloat16
    bw, rate = copy_bandwidth(dev), matmul_rate(dev, bf)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {bw / 1e9:.0f} GB/s, matmul {rate / 1e12:.0f} TFLOP/s")
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    w = {k: [torch.randn(o, i, device=dev, dtype=bf) * 0.02 for _ in range(SETS)] for k, (o, i) in shapes.items()}
    for m in (int(v) for v in args.rows.split(",")):
        for name, (o, i) in shapes.items():
            ws = w[name]
            x = torch.randn(m, i, device=dev, dtype=bf)
            y = torch.empty(m, o, device=dev, dtype=bf)
            floor = max(o * i * 2 / bw, 2 * m * o * i / rate) * 1e6
            t_blas = graph_us([lambda j=j: torch.mm(x, ws[j % SETS].t(), out=y) for j in range(LAYERS)], args.reps)
            yield m, name, o, ws, x, y, floor, t_blas, sms, args.reps


def rank_configs(configs: list, make_calls, x: torch.Tensor, w0: torch.Tensor, y: torch.Tensor,
                 reps: int) -> list[tuple[float, tuple, str]]:
    """Each config timed in graph form (`make_calls(cfg)`: LAYERS calls writing y, the first with
    weight w0) and its result checked against fp32 and cuBLAS; (us, cfg, note), fastest first. A
    config that fails to build or run, or whose result is off by more than bf16 rounding, ranks
    last with us = inf."""
    torch.mm(x, w0.t(), out=y)
    blas = y.clone()
    ref = x.float() @ w0.float().t()
    results = []
    for cfg in configs:
        try:
            calls = make_calls(cfg)
            t = graph_us(calls, reps)
        except Exception as e:          # noqa: BLE001  (shared memory, registers, an unsupported form)
            results.append((float("inf"), cfg, type(e).__name__ + " " + str(e).replace("\n", " ")[:160]))
            continue
        y.zero_()
        calls[0]()
        err = (y.float() - ref).abs().max().item()
        diff = (y.float() - blas.float()).abs().max().item()
        if err > 0.1:                   # bf16 rounding of |c| < 16 is <= 0.0625: a wrong result, not a time
            results.append((float("inf"), cfg, f"WRONG (err {err:.2g}) in {t:.1f} us"))
            continue
        results.append((t, cfg, f"err {err:.2g} vs cuBLAS {diff:.2g}"))
    return sorted(results, key=lambda r: r[0])


def main() -> None:
    for m, name, o, ws, x, y, floor, t_blas, sms, reps in cases():
        results = rank_configs(CONFIGS, lambda cfg: [lambda j=j: mm(x, ws[j % SETS], y, cfg) for j in range(LAYERS)],
                               x, ws[0], y, reps)
        t, cfg, note = results[0]
        tiles = triton.cdiv(m, cfg[0]) * triton.cdiv(o, cfg[1])
        print(f"M {m:4d} {name:8s} floor {floor:7.1f} us  cuBLAS {t_blas:7.1f} ({floor / t_blas:4.0%})  "
              f"triton {t:7.1f} ({floor / t:4.0%}, {t_blas / t:4.2f}x) {cfg} {tiles} tiles ({tiles / sms:.2f} waves) "
              f"{note}; next: " + ", ".join(f"{r[1]} {r[0]:.1f}" for r in results[1:3]))


if __name__ == "__main__":
    main()
