"""Fused SwiGLU: silu(gate) * up from the fused gate/up GEMM output [..., gate | up], one launch.

Reference: `nn.functional.silu(x[..., :I]) * x[..., I:]`, rounding for rounding:
    a   = g / (1 + exp(-g))     fp32 math (libdevice expf, IEEE division), rounded to the dtype
    out = a * u                 fp32 math, rounded to the dtype
which is torch's CUDA silu (x / (1 + exp(-x)) in opmath) and multiply op for op: bitwise equal
on CUDA up to libdevice's flush-to-zero setting, which only touches subnormal intermediates.

Layout: grid (rows, cdiv(I, BLOCK)); each program reads BLOCK gates and the BLOCK ups I later.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from . import libm
from .norm import round_to

BLOCK = 1024
NUM_WARPS = 4               # 8 elements a thread: one 128-bit load of bf16


@triton.jit
def _silu_mul_kernel(x_ptr, sx, y_ptr, sy, I: tl.constexpr, BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < I
    g = tl.load(x_ptr + row * sx + o, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sx + I + o, mask=m, other=0.0).to(tl.float32)
    a = round_to(tl.math.div_rn(g, 1.0 + libm.exp(-g, PRECISE)), y_ptr.dtype.element_ty, PRECISE)
    y = round_to(a.to(tl.float32) * u, y_ptr.dtype.element_ty, PRECISE)
    tl.store(y_ptr + row * sy + o, y, mask=m)


def silu_mul(x: torch.Tensor, out: torch.Tensor | None = None, *, block: int = BLOCK,
             num_warps: int = NUM_WARPS) -> torch.Tensor:
    """x [..., 2I] (gate | up) -> silu(gate) * up [..., I], same dtype as x.

    x rows may be strided (last dim unit stride); out: optional [..., I] of x's dtype whose rows
    view as [R, I]. Graph-capturable; one compile per (I, dtype), none per row count.
    """
    I2 = x.shape[-1]
    if I2 % 2:
        raise ValueError(f"silu_mul: last dim {I2} is not even (gate | up)")
    I = I2 // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        x2 = x.view(-1, I2)
    except RuntimeError:
        x2 = x.contiguous().view(-1, I2)
    shape = (*x.shape[:-1], I)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.shape != shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"silu_mul: out must be {x.dtype} {shape} with a unit last stride")
    y2 = out.view(-1, I)
    R = x2.shape[0]
    if R > 0 and I > 0:
        block = min(block, triton.next_power_of_2(I))
        _silu_mul_kernel[(R, triton.cdiv(I, block))](
            x2, x2.stride(0), y2, y2.stride(0), I=I, BLOCK=block, PRECISE=x.is_cuda,
            num_warps=num_warps, enable_fp_fusion=False)
    return out
