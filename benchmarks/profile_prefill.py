"""Where a prefill forward's time goes, per kernel, at Llama-3.1-8B shapes (random weights, GPU).

    python benchmarks/profile_prefill.py [--shapes 8x1024,32x256,64x128,5x1536]

For each shape B x T (B prompts of T random tokens, one token generated), runs the engine's job
loop a few times, prints the median wall time of the prefill against its compute floor (2 x
non-embedding parameters FLOPs per prompt token at the measured matmul rate) and, for the last
run, the CUDA kernels grouped by name.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specbatch.bench.configs import BUILTIN, random_target
from specbatch.bench.floor import weight_bytes
from specbatch.bench.job import matmul_rate
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults

from profile_step import NullTokenizer      # benchmarks/ is on the path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x1024,32x256,64x128,5x1536,1x64,1x256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernels", type=int, default=14)
    ap.add_argument("--host", action="store_true", help="also print where the host time of each shape goes (cProfile)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = random_target(BUILTIN["llama-3.1-8b"], torch.bfloat16, dev)
    rate = matmul_rate(dev, torch.bfloat16)
    params = weight_bytes(target) / 2
    # every rep prefills the same prompts: without prefix caching, or later reps would skip them
    eng = Engine(None, EngineOptions(batch_size=64, max_model_len=2048, profile=True, prefix_caching=False),
                 model=target, tokenizer=NullTokenizer())
    g = torch.Generator().manual_seed(0)
    sd = SamplingDefaults(max_tokens=1, ignore_eos=True, temperature=0.0)
    print(f"matmul {rate / 1e12:.0f} TFLOP/s; params {params / 1e9:.2f} G")
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        rows = [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(0, 128000, (T,), generator=g).tolist())
                for i in range(B)]
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            f0 = eng.prefill_forwards
            t0 = time.perf_counter()
            list(eng.generate(rows, sd))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        fw = eng.prefill_forwards - f0
        med = statistics.median(times)
        floor = 2 * params * B * T / rate
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with prof:
            list(eng.generate(rows, sd))
            torch.cuda.synchronize()
        by = defaultdict(lambda: [0.0, 0])
        gpu = 0.0
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", 0) or 0
            if t > 0:
                by[e.key][0] += t
                by[e.key][1] += e.count
                gpu += t
        print(f"\n{B} x {T} ({B * T} tokens, {fw} forwards): median {med * 1e3:.1f} ms, GPU {gpu / 1e3:.1f} ms, "
              f"floor {floor * 1e3:.1f} ms -> {floor / med:.0%} of floor (GPU busy {gpu / 1e3 / (med * 1e3):.0%})")
        for name, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:args.kernels]:
            print(f"  {t / 1e3:8.2f} ms {t / gpu:5.1%} {n:5d} calls  {name[:100]}")
        if args.host:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            list(eng.generate(rows, sd))
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)
            pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
