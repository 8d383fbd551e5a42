"""Where a graphed cycle's time goes, per kernel, at Llama-3.1-8B shapes (random weights, GPU).

    python benchmarks/profile_step.py [--recipe vanilla] [--batch 1] [--ctx 1024] [--top 25] [--trace t.json]

Builds the engine on random weights, prefills `batch` prompts of `ctx` tokens, runs a few
cycles to warm up, then profiles cycles with torch.profiler and prints the CUDA kernels grouped
by name (total and per-cycle microseconds), and the cycle time against the weight+KV floor.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from specbatch.bench.configs import BUILTIN, BUILTIN_HEADS, random_eagle3, random_target
from specbatch.bench.floor import copy_bandwidth, kv_bytes, weight_bytes
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults, load_recipe
from specbatch.speculative.factory import SpecConfig


class NullTokenizer:
    """Random token ids need no text: a tokenizer that decodes to nothing (also profile_prefill.py)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="vanilla")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--simulate", default="0.8,0.6,0.45")
    ap.add_argument("--top", type=int, default=25, help="kernel names listed")
    ap.add_argument("--trace", default=None, help="also write the profiler's Chrome trace (JSON) here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = random_target(BUILTIN["llama-3.1-8b"], torch.bfloat16, dev)
    rec = load_recipe(args.recipe)
    head = None
    spec = SpecConfig()
    if rec.algorithm != "vanilla":
        head = random_eagle3(BUILTIN[BUILTIN_HEADS["llama-3.1-8b"]], target, torch.bfloat16, dev)
        spec = SpecConfig(rec.algorithm, rec.num_steps, rec.topk, rec.num_draft_tokens, "random")
    sim = tuple(float(x) for x in args.simulate.split(",")) if rec.algorithm != "vanilla" else None
    total = args.cycles * 2 + 16
    eng = Engine(None, EngineOptions(batch_size=args.batch, max_model_len=args.ctx + 4 * total + 64,
                                     spec=spec, profile=True, simulate_acceptance=sim),
                 model=target, tokenizer=NullTokenizer(), draft_head=head)
    print(f"capture {eng.capture_seconds:.2f} s")
    g = torch.Generator().manual_seed(0)
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(0, 128000, (args.ctx,), generator=g).tolist())
            for i in range(args.batch)]
    for _ in eng.generate(rows, SamplingDefaults(max_tokens=total, ignore_eos=True)):
        pass                                         # warm-up run (first prefill, lazy state)
    eng.cycle_times.clear()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    launch = eng.cycle.launch

    def launch_profiled(*a, **kw):               # the profile starts at the first cycle: no prefill in it
        if not started:
            torch.cuda.synchronize()
            prof.start()
            started.append(True)
        return launch(*a, **kw)

    started: list[bool] = []
    eng.cycle.launch = launch_profiled
    for _ in eng.generate(rows, SamplingDefaults(max_tokens=total, ignore_eos=True)):
        pass
    torch.cuda.synchronize()
    prof.stop()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    cycles = [c for c in eng.cycle_times if c.batch == args.batch]
    n0 = len(cycles)
    wall = statistics.median(c.wall_ms for c in cycles)
    gpu = statistics.median(c.draft_ms + c.verify_ms + c.extend_ms for c in cycles)
    print(f"{n0} cycles: median wall {wall:.3f} ms, GPU {gpu:.3f} ms "
          f"(draft {statistics.median(c.draft_ms for c in cycles):.3f} verify "
          f"{statistics.median(c.verify_ms for c in cycles):.3f} extend {statistics.median(c.extend_ms for c in cycles):.3f})")
    bw = copy_bandwidth(dev)
    floor = (weight_bytes(target) + kv_bytes(target.cfg, torch.bfloat16, args.batch * (args.ctx + total))) / bw * 1e3
    print(f"target forward floor {floor:.3f} ms (copy bandwidth {bw / 1e9:.0f} GB/s): "
          f"vanilla step at floor/measured = {floor / gpu:.1%}")
    by = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            by[e.key][0] += t
            by[e.key][1] += e.count
    steps = max(len(eng.cycle_times), 1)
    print(f"kernels (per cycle, over {steps} cycles):")
    for name, (t, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {t / steps:9.1f} us  {n / steps:7.1f} calls  {name[:90]}")


if __name__ == "__main__":
    main()
