"""The few-row linear kernel (`kernels/skinny.py`, decode at batch 1-16) against cuBLAS (GPU only).

    python benchmarks/skinny_gemm.py [--rows 1,4,8,16]

Llama-3.1-8B's per-layer GEMMs and its lm_head at M rows, each captured as a CUDA graph of 32
calls (4 weight sets rotated, so weights come from HBM as in a forward), median of replays: torch
(cuBLAS) against one Triton program per BLOCK_N output columns streaming its weight rows, no
split-K (so no reduce kernel). Prints us a call and the share of the copy bandwidth reached, and
whether each row's result is the same whatever M is (a verify of 4 tokens against a plain step);
beside the best tile of the sweep, the tile the engine runs at that width (`skinny.tile`).
"""
from __future__ import annotations

import argparse

import torch
import triton

from specbatch.bench.floor import copy_bandwidth
from specbatch.bench.timing import graph_us
from specbatch.kernels.skinny import NUM_STAGES, NUM_WARPS, _skinny_kernel, tile

from gemm_rows import LAYERS, SETS, SHAPES as LAYER_SHAPES      # the layer GEMMs of gemm_rows.py

SHAPES = {**LAYER_SHAPES, "lm_head": (128256, 4096)}


def skinny(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bn: int, bk: int, stages: int, warps: int) -> None:
    """kernels/skinny.py's kernel at another tile config."""
    m, k = x.shape
    n = w.shape[0]
    _skinny_kernel[(triton.cdiv(n, bn),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                          BM=16, BN=bn, BK=bk, UPCAST=False, num_stages=stages, num_warps=warps)


CONFIGS = [(bn, bk, st, wp) for bn in (16, 32, 64) for bk in (128, 256, 512) for st in (3, 4, 6) for wp in (4,)
           if (bn + 16) * bk * st * 2 <= 200 * 1024]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; copy {bw / 1e9:.0f} GB/s")
    w = {k: [torch.randn(o, i, device=dev, dtype=bf) * 0.02 for _ in range(SETS if o < 100000 else 2)]
         for k, (o, i) in SHAPES.items()}
    for m in (int(v) for v in args.rows.split(",")):
        total_t = total_s = total_floor = 0.0
        for name, (o, i) in SHAPES.items():
            ws = w[name]
            x = torch.randn(m, i, device=dev, dtype=bf)
            y = torch.empty(m, o, device=dev, dtype=bf)
            floor = o * i * 2 / bw * 1e6

            t_torch = graph_us([lambda j=j: torch.mm(x, ws[j % len(ws)].t(), out=y) for j in range(LAYERS)],
                               args.reps)

            def tri_calls(cfg):
                return [lambda j=j: skinny(x, ws[j % len(ws)], y, *cfg) for j in range(LAYERS)]
            best = None
            for cfg in CONFIGS:
                try:
                    t = graph_us(tri_calls(cfg), 5)
                except Exception as e:          # noqa: BLE001  (a config that does not compile or fit)
                    print(f"  {name} {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            cfg = best[1]
            t_tri = graph_us(tri_calls(cfg), args.reps)
            landed = (*tile(o, dev), NUM_STAGES, NUM_WARPS)          # what the engine runs at this width
            t_landed = graph_us(tri_calls(landed), args.reps)
            ref = x.float() @ ws[0].float().t()
            skinny(x, ws[0], y, *cfg)
            err = (y.float() - ref).abs().max().item()
            one = torch.empty(1, o, device=dev, dtype=bf)
            skinny(x[:1], ws[0], one, *cfg)
            same = torch.equal(one[0], y[0])
            print(f"M {m:3d} {name:8s} floor {floor:7.1f} us  torch {t_torch:7.1f} ({floor / t_torch:4.0%})  "
                  f"triton {t_tri:7.1f} ({floor / t_tri:4.0%}) {cfg}  engine's tile {t_landed:7.1f} {landed}  "
                  f"max err {err:.3g}  row 0 same at M=1: {same}")
            mult = 1 if name == "lm_head" else LAYERS
            total_t += t_torch * mult
            total_s += t_tri * mult
            total_floor += floor * mult
        print(f"M {m:3d} a forward's GEMMs: torch {total_t / 1e3:.3f} ms ({total_floor / total_t:.0%}), "
              f"triton {total_s / 1e3:.3f} ms ({total_floor / total_s:.0%}), floor {total_floor / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
