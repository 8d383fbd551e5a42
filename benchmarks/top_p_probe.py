"""Time of the sampling filters at [rows, 128,256] on the GPU: the sort-based top-k/top-p against a
bisection on the probabilities' float bits (no sort), and the draw's other parts.

    python benchmarks/top_p_probe.py
"""
import torch
from specbatch.sampling import BatchSampling, apply_top_k_top_p, draw, uniforms, row_keys
from specbatch.params import SamplingParams
import specbatch.kernels as kernels


def top_p_bisect(logits, top_p):
    probs = logits.softmax(dim=-1)
    bits = probs.view(torch.int32)
    lo = torch.zeros(probs.shape[0], dtype=torch.int32, device=probs.device)
    hi = bits.max(dim=-1).values
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        mass = torch.where(bits > mid[:, None], probs, 0.0).sum(dim=-1)
        ok = mass < top_p
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid + 1)
    return logits.masked_fill(bits < hi[:, None], float("-inf"))


def torch_draw(probs, sp, pos):
    with kernels.torch_only():
        return draw(probs, sp, pos)


def ms(f, reps=20):
    f(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / reps


for R in (64, 256, 512):
    x = torch.randn(R, 128256, device="cuda") * 3
    p = torch.full((R,), 0.95, device="cuda")
    k = torch.zeros(R, dtype=torch.int64, device="cuda")
    sp = BatchSampling.build([SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(R)], torch.device("cuda"))
    pos = torch.arange(R, device="cuda")
    a, b = apply_top_k_top_p(x, k, p), top_p_bisect(x, p)
    same = ((a == float("-inf")) == (b == float("-inf"))).float().mean().item()
    print(f"R={R}: sort top-k/top-p {ms(lambda: apply_top_k_top_p(x, k, p)):.2f} ms, bisect top-p {ms(lambda: top_p_bisect(x, p)):.2f} ms, "
          f"softmax {ms(lambda: x.softmax(-1)):.2f}, uniforms {ms(lambda: uniforms(row_keys(sp.seed_lo, sp.seed_hi, pos), 128256)):.2f}, "
          f"target_probs {ms(lambda: sp.target_probs(x)):.2f}, draw (kernel) {ms(lambda: draw(x.softmax(-1), sp, pos)):.2f}, "
          f"draw (torch) {ms(lambda: torch_draw(x.softmax(-1), sp, pos)):.2f}, "
          f"kept-set agreement {same:.6f}, kept {(b > float('-inf')).sum(-1).float().mean().item():.0f}", flush=True)
