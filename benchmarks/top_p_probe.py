"""Time of the sampling filters at [rows, 128,256] on the GPU: the sort-based top-k/top-p against a
bisection on the probabilities' float bits in torch and the radix kernel (kernels/top_k_top_p.py, at
a few block shapes), the draw's other parts, and the whole draw from logits: filter + softmax + race
against the fused kernel (kernels/filtered_draw.py) at top-p 0.95, 0.5 and 0.1, and with top-k 50.

    python benchmarks/top_p_probe.py
"""
import torch
from specbatch.sampling import BatchSampling, apply_top_k_top_p, draw, uniforms, row_keys
from specbatch.params import SamplingParams
import specbatch.kernels as kernels
import specbatch.kernels.top_k_top_p as tkp
from specbatch.kernels.filtered_draw import draw_filtered
from specbatch.kernels.draw import draw_race


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


def sort_filter(x, k, p):
    with kernels.torch_only():
        return apply_top_k_top_p(x, k, p)


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
    a, b = sort_filter(x, k, p), top_p_bisect(x, p)
    kk = torch.where(torch.arange(R, device="cuda") % 2 == 0, 50, 0)
    shapes, default = [], (tkp.BLOCK, tkp.NUM_WARPS)
    for block, warps in ((128, 4), (256, 4), (512, 4), (512, 8), (1024, 8)):
        tkp.BLOCK, tkp.NUM_WARPS = block, warps
        shapes.append(f"{block}/{warps}w {ms(lambda: tkp.top_k_top_p(x, k, p)):.3f}")
    tkp.BLOCK, tkp.NUM_WARPS = default
    c = tkp.top_k_top_p(x, kk, p)
    print(f"R={R}: kernel top-p ms by block/warps: {', '.join(shapes)}; with top-k 50 on half the rows: kernel "
          f"{ms(lambda: tkp.top_k_top_p(x, kk, p)):.3f} ms, sort {ms(lambda: sort_filter(x, kk, p)):.3f} ms; "
          f"kernel vs sort kept-set mismatches: top-p {int(((tkp.top_k_top_p(x, k, p) > float('-inf')) != (a > float('-inf'))).sum())}, "
          f"top-k + top-p {int(((c > float('-inf')) != (sort_filter(x, kk, p) > float('-inf'))).sum())}", flush=True)
    keys = row_keys(sp.seed_lo, sp.seed_hi, pos)
    parts = []
    for name, kk_, pp in (("p0.95", k, p), ("p0.5", k, p * 0 + 0.5), ("p0.1", k, p * 0 + 0.1), ("k50+p0.95", kk, p)):
        sep = lambda: draw_race(apply_top_k_top_p(x, kk_, pp).softmax(-1), keys)
        parts.append(f"{name}: separate {ms(sep):.3f} fused {ms(lambda: draw_filtered(x, kk_, pp, keys)):.3f} "
                     f"same {int((sep() == draw_filtered(x, kk_, pp, keys)).sum())}/{R}")
    print(f"R={R}: draw from logits (radix filter + softmax + race vs fused), ms: " + "; ".join(parts), flush=True)
    same = ((a == float("-inf")) == (b == float("-inf"))).float().mean().item()
    print(f"R={R}: sort top-k/top-p {ms(lambda: sort_filter(x, k, p)):.2f} ms, bisect top-p {ms(lambda: top_p_bisect(x, p)):.2f} ms, "
          f"softmax {ms(lambda: x.softmax(-1)):.2f}, uniforms {ms(lambda: uniforms(row_keys(sp.seed_lo, sp.seed_hi, pos), 128256)):.2f}, "
          f"target_probs {ms(lambda: sp.target_probs(x)):.2f}, draw (kernel) {ms(lambda: draw(x.softmax(-1), sp, pos)):.2f}, "
          f"draw (torch) {ms(lambda: torch_draw(x.softmax(-1), sp, pos)):.2f}, "
          f"kept-set agreement {same:.6f}, kept {(b > float('-inf')).sum(-1).float().mean().item():.0f}", flush=True)
