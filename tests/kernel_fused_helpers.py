"""Shared by the fused elementwise kernel tests (tests/kernels/test_kernel_fused_*.py): the dtypes,
a sentinel for cache rows a kernel must not touch, Llama-3.1-8B's config, the rounding-for-rounding
check (bf16 / fp16 within 1 ulp and mostly bitwise equal, fp32 within ~1 ulp), NaN-poisoned outputs,
and the torch references from specbatch.models.llama."""
from __future__ import annotations

import torch
from torch import nn

from specbatch import kernels
from specbatch.bench.configs import BUILTIN
from specbatch.models.config import DecoderConfig
from specbatch.models.llama import RMSNorm, rope_cos_sin, rotate_half


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SENTINEL = 7.0                      # cache rows a kernel must not touch

LLAMA31_8B = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])      # the bench's 8B shapes


# ---------------------------------------------------------------------------------------- checks

def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits -> integers in the floats' order (adjacent floats differ by 1, -0 == +0)."""
    if t.dtype == torch.float32:
        bits = t.contiguous().view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    else:
        bits = t.contiguous().view(torch.int16).to(torch.int64)
        mag = bits & 0x7FFF
    return torch.where(bits < 0, -mag, mag)


def assert_rounding_equal(out: torch.Tensor, ref: torch.Tensor, min_equal: float) -> None:
    """bf16 / fp16: at least `min_equal` of the elements bitwise equal, all within 1 ulp.
    fp32: within rtol 1e-6 (different summation order / libm on CPU)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "kernel left NaNs (unwritten output?)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return
    dist = (_ordered(out) - _ordered(ref)).abs()
    assert int(dist.max()) <= 1, f"max ulp distance {int(dist.max())}"
    equal = float((dist == 0).float().mean())
    assert equal >= min_equal, f"only {equal:.5f} of elements bitwise equal"


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ----------------------------------------------------------------------------- references

def ref_rms_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device)
    norm.weight = nn.Parameter(weight.clone(), requires_grad=False)
    with kernels.torch_only():                      # RMSNorm dispatches to the kernel on CUDA
        if residual is None:
            return norm(x)
        s = x + residual
        return norm(s), s


def ref_silu_mul(x):
    i = x.shape[-1] // 2
    return nn.functional.silu(x[..., :i]) * x[..., i:]


def ref_rope_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots, rows):
    cos, sin = rope_cos_sin(inv_freq, positions, q.dtype)
    qr = q * cos + rotate_half(q) * sin
    kr = k * cos + rotate_half(k) * sin
    s = slots[:, None].expand_as(rows)
    k_cache[s, rows] = kr.to(k_cache.dtype)
    v_cache[s, rows] = v.to(v_cache.dtype)
    return qr


def _fused_qkv(B, T, Hq, Hkv, D, dtype, device, gen, scale=1.0):
    """q, k, v as strided views of one [B, T, (Hq + 2 Hkv) * D] GEMM output, like the model."""
    qkv = (torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen) * scale).to(device=device, dtype=dtype)
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, T, Hkv, D)
    v = qkv[..., (Hq + Hkv) * D:].view(B, T, Hkv, D)
    return q, k, v
