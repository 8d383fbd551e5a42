"""Math the kernels share with torch's CUDA ops, rounding for rounding: with PRECISE (CUDA) the
libdevice functions torch calls (expf, logf, rsqrtf); otherwise (Triton's interpreter, which lacks
libdevice) tl's, which may be the hardware approximations (ex2.approx, lg2.approx) on a GPU."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        r = libdevice.exp(x)
    else:
        r = tl.exp(x)
    return r


@triton.jit
def log(x, PRECISE: tl.constexpr):
    if PRECISE:
        r = libdevice.log(x)
    else:
        r = tl.log(x)
    return r


@triton.jit
def rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        r = libdevice.rsqrt(x)
    else:
        r = tl.math.rsqrt(x)
    return r
