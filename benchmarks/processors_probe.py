"""Time of the logits processors (processors.py) at [rows, nodes, 128,256] on the GPU, against
the greedy pick they precede: min_tokens + logit_bias, the three penalties, and both, for plain
steps (nodes 1) and verify widths 2 and 4, under CUDA graphs.

    python benchmarks/processors_probe.py
    python benchmarks/processors_probe.py draws     # sample() at 512 rows by sampling kind
    KCAP=0 python benchmarks/processors_probe.py draws      # top-k by the radix descent alone
    DRAW_BLOCK=4096 DRAW_WARPS=16 python benchmarks/processors_probe.py draws   # the filtered draw's layout
"""
import torch

from specbatch.params import SamplingParams
from specbatch.processors import Processors
from specbatch.speculative.accept import greedy_targets

V = 128256
KINDS = {
    "bias+min_tokens": dict(logit_bias={13: 2.0, 1000: -3.0}, min_tokens=8, stop_token_ids=[2000]),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "all": dict(logit_bias={13: 2.0}, min_tokens=8, stop_token_ids=[2000], repetition_penalty=1.05),
}


def ms(f, reps=20):
    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print("| rows x nodes | processors | apply ms | + greedy pick ms | pick alone ms |")
    print("|---|---|---|---|---|")
    for B, N in ((512, 1), (256, 2), (128, 4), (64, 4)):
        logits = (torch.randn(B, N, V, device=dev, generator=gen) * 3).bfloat16()
        tokens = torch.randint(0, V, (B, N), device=dev, generator=gen)
        depths = torch.arange(N, device=dev).expand(B, N).contiguous()
        generated = torch.randint(0, 20, (B,), device=dev, generator=gen)
        counts = torch.randint(0, 2, (B, V), device=dev, generator=gen, dtype=torch.int32)
        prompt_mask = torch.rand(B, V, device=dev, generator=gen) < 0.002
        slots = torch.arange(B, device=dev)
        pick = ms(lambda: greedy_targets(logits))
        for name, kw in KINDS.items():
            rows = [(SamplingParams(**kw), 100)] * B
            proc = Processors.build(rows, [2], V, dev)

            def apply():
                return proc.apply(logits, depths, generated, tokens, None, (counts, prompt_mask, slots))

            both = ms(lambda: greedy_targets(apply()))
            print(f"| {B} x {N} | {name} | {ms(apply):.3f} | {both:.3f} | {pick:.3f} |", flush=True)




def draws() -> None:
    """`sampling.sample` at 512 rows by sampling kind: bf16 logits (a plain step), float32 (verify
    nodes after processors, width 2), and the chain race's draft row laid out by target id."""
    from specbatch.sampling import BatchSampling, draw_target, sample
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    kinds = {"T0.8 p0.95": dict(temperature=0.8, top_p=0.95), "T0.7 p0.8": dict(temperature=0.7, top_p=0.8),
             "T0.7 k20": dict(temperature=0.7, top_k=20), "T0.7 p0.8 k20": dict(temperature=0.7, top_p=0.8, top_k=20)}
    x16 = (torch.randn(512, V, device=dev, generator=gen) * 3).bfloat16()
    x32 = torch.randn(1024, V, device=dev, generator=gen) * 3
    xd = torch.randn(512, 32000, device=dev, generator=gen) * 3
    ids = torch.randperm(V, device=dev, generator=gen)[:32000].sort().values   # draft ids in target-id order
    pos = torch.arange(1024, device=dev)
    import os
    import specbatch.kernels.top_k_top_p as tkp
    if os.environ.get("KCAP"):                    # KCAP=0: every top-k by the radix descent (as before)
        tkp.KCAP = int(os.environ["KCAP"])
    import specbatch.kernels.filtered_draw as fd
    fd.BLOCK = int(os.environ.get("DRAW_BLOCK", fd.BLOCK))
    fd.NUM_WARPS = int(os.environ.get("DRAW_WARPS", fd.NUM_WARPS))
    print(f"filtered draw: BLOCK {fd.BLOCK}, {fd.NUM_WARPS} warps")
    KCAP = tkp.KCAP or 64
    print(f"torch.topk(x, {KCAP}) alone: 512 x bf16 {ms(lambda: torch.topk(x16, KCAP, dim=1)):.3f} ms, "
          f"1024 x f32 {ms(lambda: torch.topk(x32, KCAP, dim=1)):.3f} ms\n")
    print("| sampling | 512 x bf16 ms | 1024 x f32 ms | draft race 512 (32k -> 128k) ms | the race on 32k columns ms |")
    print("|---|---|---|---|---|")
    for name, kw in kinds.items():
        sp = BatchSampling.build([SamplingParams(seed=i, **kw) for i in range(512)], dev)
        sp2 = BatchSampling.build([SamplingParams(seed=i, **kw) for i in range(1024)], dev)

        def race():
            full = xd.new_full((512, V), float("-inf")).index_copy_(1, ids, xd)
            return sample(full, sp, pos[:512])

        compact = lambda: draw_target(xd, sp, pos[:512], ids=ids, vocab=V)    # noqa: E731 - the drafter's race
        print(f"| {name} | {ms(lambda: sample(x16, sp, pos[:512])):.3f} | {ms(lambda: sample(x32, sp2, pos)):.3f} | "
              f"{ms(race):.3f} | {ms(compact):.3f} |", flush=True)


if __name__ == "__main__":
    import sys
    draws() if sys.argv[1:] == ["draws"] else main()
