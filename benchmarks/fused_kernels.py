"""Fused elementwise kernels vs the torch reference sequences, timed inside CUDA graphs (GPU only).

    python benchmarks/fused_kernels.py [--calls 20] [--replays 200]

Llama-3.1-8B shapes (H 4096, I 14336, Hq 32, Hkv 8, D 128), bf16, T = 1, batch 1 and 64. Each
line: microseconds per call (median over graph replays of `--calls` back-to-back calls, CUDA
events) for the Triton kernel and for the torch ops it replaces in the decoder layer, plus the
fraction of outputs bitwise equal to torch. The torch RoPE line starts from cos / sin, which the
model computes once per forward (not per layer), and includes write_kv's index arithmetic.
"""
from __future__ import annotations

import argparse

import torch

from specbatch.bench.timing import graph_us as _graph_us
from specbatch import kernels
from specbatch.kernels.activation import silu_mul
from specbatch.kernels.norm import rms_norm
from specbatch.kernels.rope import rope_write_kv
from specbatch.models.attention import AttnMetadata, write_kv
from specbatch.bench.configs import BUILTIN
from specbatch.models.config import DecoderConfig
from specbatch.models.llama import RMSNorm, rope_cos_sin, rope_inv_freq, rotate_half

DTYPE = torch.bfloat16
CACHE_ROWS = 2048
CFG = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])


def graph_us(fn, calls: int, replays: int) -> float:
    """Median microseconds per fn() call, `calls` of them in one graph."""
    return _graph_us([fn] * calls, replays)


def same(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).float().mean())


def cases(B: int, dev: torch.device):
    """-> [(name, fused fn, torch fn, check)] for batch B, T = 1; check() runs both eagerly and
    gives the fraction of outputs bitwise equal."""
    H, I = CFG.hidden_size, CFG.intermediate_size
    Hq, Hkv, D = CFG.num_heads, CFG.num_kv_heads, CFG.head_dim
    g = torch.Generator(device=dev).manual_seed(B)
    rnd = lambda *s: torch.randn(*s, generator=g, device=dev).to(DTYPE)   # noqa: E731
    x, res = rnd(B, 1, H), rnd(B, 1, H)
    norm = RMSNorm(H, CFG.rms_norm_eps).to(dev, DTYPE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * rnd(H))
    w, eps = norm.weight.detach(), CFG.rms_norm_eps
    y_f, s_f = torch.empty_like(x), torch.empty_like(x)
    gu = rnd(B, 1, 2 * I)
    a_f = torch.empty(B, 1, I, dtype=DTYPE, device=dev)
    silu_t = lambda: torch.nn.functional.silu(gu[..., :I]) * gu[..., I:]        # noqa: E731

    qkv = rnd(B, 1, (Hq + 2 * Hkv) * D)
    q = qkv[..., : Hq * D].view(B, 1, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, 1, Hkv, D)
    v = qkv[..., (Hq + Hkv) * D:].view(B, 1, Hkv, D)
    meta = AttnMetadata(slots=torch.randperm(B + 1, device=dev)[:B],
                        positions=torch.randint(0, 100000, (B, 1), device=dev),
                        prefix_lens=torch.randint(0, CACHE_ROWS - 1, (B,), device=dev), kv_len=CACHE_ROWS)
    rows = meta.cache_rows()
    inv = rope_inv_freq(CFG).to(dev)
    cos, sin = rope_cos_sin(inv, meta.positions, DTYPE)
    kc_f, vc_f, kc_t, vc_t = (torch.zeros(B + 1, CACHE_ROWS, Hkv, D, dtype=DTYPE, device=dev) for _ in range(4))
    qo_f = torch.empty(B, 1, Hq, D, dtype=DTYPE, device=dev)

    def rope_t():
        write_kv(kc_t, vc_t, k * cos + rotate_half(k) * sin, v, meta)
        return q * cos + rotate_half(q) * sin

    def rope_f():
        return rope_write_kv(q, k, v, meta.positions, inv, kc_f, vc_f, meta.slots, rows, q_out=qo_f)

    def rope_check() -> float:
        s = meta.slots[:, None]
        return min(same(rope_f(), rope_t()), same(kc_f[s, rows], kc_t[s, rows]), same(vc_f, vc_t))

    def norm_t():
        with kernels.torch_only():                  # RMSNorm dispatches to the kernel on CUDA
            return norm(x)

    def add_norm_t():
        with kernels.torch_only():
            return norm(x + res)

    return [
        ("rms_norm", lambda: rms_norm(x, w, eps, out=y_f), norm_t,
         lambda: same(rms_norm(x, w, eps, out=y_f), norm_t())),
        ("add + rms_norm", lambda: rms_norm(x, w, eps, residual=res, out=y_f, residual_out=s_f),
         add_norm_t, lambda: same(rms_norm(x, w, eps, residual=res, out=y_f, residual_out=s_f)[0], add_norm_t())),
        ("silu_mul", lambda: silu_mul(gu, out=a_f), silu_t, lambda: same(silu_mul(gu, out=a_f), silu_t())),
        ("rope + kv write", rope_f, rope_t, rope_check),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; {DTYPE}; T = 1; microseconds per call in a CUDA graph")
    print(f"{'B':>3}  {'kernel':16s} {'triton':>8s} {'torch':>8s} {'speedup':>8s}  bitwise equal")
    with torch.no_grad():
        for B in (1, 64):
            for name, fused, ref, check in cases(B, dev):
                eq = check()
                tf = graph_us(fused, args.calls, args.replays)
                tt = graph_us(ref, args.calls, args.replays)
                print(f"{B:>3}  {name:16s} {tf:8.2f} {tt:8.2f} {tt / tf:7.1f}x  {eq:.5f}")


if __name__ == "__main__":
    main()
