"""Fused RMSNorm (optionally with the residual add before it): one launch, one read of each row.

Reference: `specbatch.models.llama.RMSNorm.forward`, rounding for rounding:
    s   = x + residual                       (torch `h + attn`: fp32 math, rounded to x.dtype)
    x32 = s.float()
    y   = (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)
    out = weight * y                         (fp32 math, rounded to promote(weight, x) dtype)
Everything but the sum of squares is the same op sequence as torch, with the same CUDA math
(libdevice rsqrtf, no fused multiply-adds); torch's CUDA mean is sum * fl(1/H), so that is used
here too. Only the summation order differs: bf16/fp16 outputs are bitwise equal except where a
last-bit difference in the fp32 scale moves a value across a rounding boundary (rare; then 1 ulp).
Fused multiply-adds are off (enable_fp_fusion=False) so fp32 follows torch's separate ops.

Layout: one program per row, the whole row in one block of next_pow2(H) (H <= 32768).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import libm

MAX_H = 32768               # one block per row: beyond this the row no longer fits in registers


@triton.jit
def round_to(x, DT: tl.constexpr, PRECISE: tl.constexpr):
    """float32 x -> dtype DT, round to nearest even: what torch does after each elementwise op.

    Shared by the fused elementwise kernels (norm, activation, rope). On CUDA (PRECISE) a plain
    cast (cvt.rn). The interpreter's float32 -> bfloat16 cast truncates, so there the rounding is
    done on the bits: add half an ulp (less one when the kept last bit is even) and cut.
    """
    if PRECISE or DT != tl.bfloat16:
        r = x.to(DT)
    else:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        r = b.to(tl.float32, bitcast=True).to(DT)
    return r


@triton.jit
def _rms_norm_kernel(x_ptr, sx, r_ptr, sr, w_ptr, y_ptr, sy, s_ptr, ss, eps, inv_h,
                     H: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                     PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < H
    x = tl.load(x_ptr + row * sx + o, mask=m, other=0.0)
    if HAS_RES:
        res = tl.load(r_ptr + row * sr + o, mask=m, other=0.0)
        x = round_to(x.to(tl.float32) + res.to(tl.float32), x_ptr.dtype.element_ty, PRECISE)
        tl.store(s_ptr + row * ss + o, x, mask=m)
    x32 = x.to(tl.float32)
    ms = tl.sum(x32 * x32, axis=0) * inv_h                  # masked lanes hold 0
    y = round_to(x32 * libm.rsqrt(ms + eps, PRECISE), x_ptr.dtype.element_ty, PRECISE)
    w = tl.load(w_ptr + o, mask=m, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(y_ptr + row * sy + o, round_to(out, y_ptr.dtype.element_ty, PRECISE), mask=m)


@functools.lru_cache(maxsize=None)
def _inv(h: int) -> float:
    """fl32(1 / h), the factor torch's CUDA mean multiplies by (exactly representable as a double)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / h)


def _as_rows(t: torch.Tensor, H: int, name: str, writable: bool = False) -> torch.Tensor:
    """[..., H] -> [R, H] view with a unit last stride; inputs that cannot be viewed so are copied
    (a shape-only allocation: still graph-capturable), outputs must view."""
    if t.shape[-1] != H:
        raise ValueError(f"rms_norm: {name} has last dim {t.shape[-1]}, want {H}")
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        try:
            return t.view(-1, H)
        except RuntimeError:
            pass
    if writable:
        raise ValueError(f"rms_norm: {name} must be viewable as [rows, {H}] with a unit last stride")
    return t.contiguous().view(-1, H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> weight * norm(x) [..., H]; with `residual` (same shape and dtype as x):
    s = x + residual, -> (weight * norm(s), s).

    out / residual_out: optional outputs (shape of x; rows may be strided, last dim unit stride).
    The output dtype is promote(weight, x) like the reference. Graph-capturable; one compile per
    (H, dtypes), none per row count.
    """
    H = x.shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)}, want ({H},)")
    if H > MAX_H:
        raise ValueError(f"rms_norm: H = {H} > {MAX_H} is not supported")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"rms_norm: out must be {out_dtype} {tuple(x.shape)}")
    x2, y2 = _as_rows(x, H, "x"), _as_rows(out, H, "out", writable=True)
    has_res = residual is not None
    if has_res:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("rms_norm: residual must match x in shape and dtype")
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if residual_out.shape != x.shape or residual_out.dtype != x.dtype:
            raise ValueError("rms_norm: residual_out must match x in shape and dtype")
        r2, s2 = _as_rows(residual, H, "residual"), _as_rows(residual_out, H, "residual_out", True)
    else:
        r2 = s2 = x2                                        # unused (HAS_RES False)
    R = x2.shape[0]
    if R > 0:
        block = triton.next_power_of_2(H)
        _rms_norm_kernel[(R,)](
            x2, x2.stride(0), r2, r2.stride(0), weight.contiguous(), y2, y2.stride(0), s2, s2.stride(0),
            float(eps), _inv(H), H=H, BLOCK=block, HAS_RES=has_res, PRECISE=x.is_cuda,
            num_warps=min(max(block // 512, 1), 16), enable_fp_fusion=False)
    return (out, residual_out) if has_res else out
