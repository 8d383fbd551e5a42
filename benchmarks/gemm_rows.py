"""How the decode and verify GEMMs' efficiency varies with their row count M (GPU only).

    python benchmarks/gemm_rows.py [--rows 64,128,...] [--blas cublaslt] [--layout kn] [--tunable]

Llama-3.1-8B's four per-layer GEMMs (qkv, o, gate_up, down) at M rows, each captured as a CUDA
graph of 32 layers (4 weight sets rotated, so weights come from HBM as in a forward), medians of
replays. Per M: ms for the 32 layers, TFLOP/s, and the time against the floor
max(weight bytes / copy bandwidth, FLOPs / matmul rate). `--layout kn` stores each weight
transposed ([in, out] contiguous, so cuBLAS sees an NN product and may pick other kernels);
`--tunable` lets torch's TunableOp time the library's candidate algorithms for each shape before
capture and prints what it chose.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from specbatch.bench.floor import copy_bandwidth
from specbatch.bench.job import matmul_rate

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS, SETS = 32, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,128,192,256,288,300,316,320,352,384,448,512,632,640,768,1024,1264,1280")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--blas", default="default", help="torch.backends.cuda.preferred_blas_library: default | cublas | cublaslt")
    ap.add_argument("--layout", default="nk", choices=("nk", "kn"), help="weights [out, in] (as nn.Linear) or [in, out]")
    ap.add_argument("--tunable", action="store_true", help="torch.cuda.tunable: time candidate algorithms per shape")
    args = ap.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    if args.tunable:
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
        torch.cuda.tunable.set_filename("/tmp/specbatch_gemm_rows_tunableop.csv")
    dev, bf = torch.device("cuda"), torch.bfloat16
    bw, rate = copy_bandwidth(dev), matmul_rate(dev, bf)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; copy {bw / 1e9:.0f} GB/s, "
          f"matmul {rate / 1e12:.0f} TFLOP/s; blas {args.blas}")
    w = {k: [torch.randn(o, i, device=dev, dtype=bf) * 0.02 for _ in range(SETS)] for k, (o, i) in SHAPES.items()}
    if args.layout == "kn":                      # w[k][j].t() is then a contiguous [in, out] tensor
        w = {k: [t.t().contiguous().t() for t in ts] for k, ts in w.items()}
    print(f"{'M':>5s} " + " ".join(f"{k + ' ms':>10s} {'%':>4s}" for k in SHAPES) + f" {'all ms':>8s} {'floor':>6s} {'%':>4s}")
    for m in (int(v) for v in args.rows.split(",")):
        row, total, floor_all = [], 0.0, 0.0
        for k, (o, i) in SHAPES.items():
            x = torch.randn(m, i, device=dev, dtype=bf)
            y = torch.empty(m, o, device=dev, dtype=bf)

            def run() -> None:
                for layer in range(LAYERS):
                    torch.mm(x, w[k][layer % SETS].t(), out=y)
            run()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run()
            ts = []
            for _ in range(args.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            t = statistics.median(ts)
            floor = LAYERS * max(o * i * 2 / bw, 2 * m * o * i / rate) * 1e3
            row.append(f"{t:10.3f} {floor / t:4.0%}")
            total += t
            floor_all += floor
        print(f"{m:5d} " + " ".join(row) + f" {total:8.3f} {floor_all:6.2f} {floor_all / total:4.0%}")
    if args.tunable:
        for r in torch.cuda.tunable.get_results():
            print("  tuned:", *r)


if __name__ == "__main__":
    main()
