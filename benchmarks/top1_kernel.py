"""Fused Triton top-1 vs the torch paths, timed inside CUDA graphs (GPU only).

    python benchmarks/top1_kernel.py [--sweep]

For each shape: the kernel (default split plan), the torch reference `spec.topk.top1` and
`softmax(-1).max(-1)`; microseconds per call (median over replays, CUDA events) and the fraction
of copy bandwidth a single read of the logits reaches. Inputs rotate over enough copies to
overflow L2, so every call reads from HBM. --sweep also times splits x block x warps on
every shape, to tune the defaults in kernels/top1.py.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

from specbatch.bench.timing import graph_us as _graph_us
from specbatch.bench.floor import copy_bandwidth
from specbatch.kernels.top1 import plan, top1
from specbatch import kernels
from specbatch.speculative.topk import top1 as _dispatch_top1


def torch_top1(x):
    """The torch reference path (spec.topk.top1 would dispatch to the kernel on CUDA)."""
    with kernels.torch_only():
        return _dispatch_top1(x)

SHAPES = [(64, 128256), (1, 128256), (256, 32000), (64, 32000), (16, 128256), (256, 128256), (1024, 128256)]
DTYPE = torch.bfloat16


def inputs(R: int, V: int, dev: torch.device) -> list[torch.Tensor]:
    """Enough distinct [R, V] inputs that a round over them does not fit in L2."""
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    nbytes = R * V * torch.empty((), dtype=DTYPE).element_size()
    n = min(max(2, -(-3 * l2 // nbytes)), 512)
    return [torch.randn(R, V, device=dev).mul_(3).to(DTYPE) for _ in range(n)]


def graph_us(fn, xs: list[torch.Tensor], replays: int = 100) -> float:
    """Median microseconds per fn(x) call, one graph holding one call per input."""
    return _graph_us([functools.partial(fn, x) for x in xs], replays)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time splits x block x warps on every shape")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)}; copy bandwidth {bw / 1e9:.0f} GB/s; dtype {DTYPE}")
    for R, V in SHAPES:
        xs = inputs(R, V, dev)
        i, lp = top1(xs[0])
        ri, rl = torch_top1(xs[0].cpu())                     # CPU reference: lowest index on ties
        assert torch.equal(i.cpu(), ri) and (lp.cpu() - rl).abs().max().item() < 1e-5, "kernel disagrees"
        read_us = xs[0].nbytes / bw * 1e6
        block, splits, tiles = plan(R, V, dev)
        print(f"\n[{R}, {V}]  one read at copy bandwidth: {read_us:.2f} us   "
              f"(plan: block {block}, {splits} splits x {tiles} tiles, {R * splits} programs)")
        for name, fn in (("triton top1", top1), ("torch spec.topk.top1", torch_top1),
                         ("softmax(-1).max(-1)", lambda x: x.softmax(-1).max(-1))):
            us = graph_us(fn, xs)
            print(f"  {name:22s} {us:8.2f} us   {read_us / us:6.1%} of copy bandwidth")
        if args.sweep:
            print("  sweep (splits asked -> used, block, warps): us, fraction")
            rows = []
            for splits, block, warps in itertools.product((1, 2, 3, 4, 8, 16, 32), (1024, 2048, 4096), (4, 8)):
                us = graph_us(lambda x: top1(x, splits, block=block, num_warps=warps), xs, replays=30)
                rows.append((us, splits, block, warps))
            for us, splits, block, warps in sorted(rows)[:6]:
                used = plan(R, V, dev, splits, block)[1]
                print(f"    {splits:3d} -> {used:3d} {block:5d} {warps}: {us:7.2f} us  {read_us / us:6.1%}")


if __name__ == "__main__":
    main()
