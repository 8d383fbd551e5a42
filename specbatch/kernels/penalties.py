"""Presence, frequency and repetition penalties over whole rows in one pass: processors.py's
`dense_penalties` (the torch reference) with the slots' committed counts.

    out[b, n, v] = pen(float(logits[b, n, v]), counts[slots[b], v], prompt_mask[slots[b], v])

The torch form builds a dozen [B, N, V] float32 temporaries (4.2 ms at 512 x 128,256 on an H100,
a quarter of a plain decoding step) after gathering the slots' [B, V] counts; here each program
reads its block of logits, counts and prompt mask once, by slot, and writes the float32 result.
Same floats as torch: IEEE division, no fused multiply-adds (enable_fp_fusion=False), the same
order of operations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT32_MAX = 3.4028234663852886e38      # sampling.FLOAT32_MAX (kernels import nothing above them)
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _penalties_kernel(x_ptr, stride_xb, stride_xn, out_ptr, counts_ptr, mask_ptr, stride_s, slots_ptr,
                      r_ptr, f_ptr, p_ptr, N, V, BLOCK: tl.constexpr, FMAX: tl.constexpr):
    row = tl.program_id(0)                      # b * N + n
    b = row // N
    n = row - b * N
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < V
    x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + n.to(tl.int64) * stride_xn + o, mask=m).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    c = tl.load(counts_ptr + slot * stride_s + o, mask=m, other=0)
    seen = tl.load(mask_ptr + slot * stride_s + o, mask=m, other=0) != 0
    r = tl.load(r_ptr + b)
    f = tl.load(f_ptr + b)
    p = tl.load(p_ptr + b)
    scaled = tl.where(x > 0, tl.math.div_rn(x, r), tl.where(x < 0, x * r, x))
    finite = (x == x) & (tl.abs(x) < float("inf"))
    scaled = tl.where(finite, tl.minimum(tl.maximum(scaled, -FMAX), FMAX), x)
    y = tl.where(seen | (c > 0), scaled, x)
    y = y - f * c.to(tl.float32)
    y = y - p * (c > 0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * V + o, y, mask=m)


def penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, slots: torch.Tensor,
              repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """logits [B, N, V] (any float dtype, last dim contiguous) -> float32 [B, N, V]; counts [S, V]
    int32 and prompt_mask [S, V] bool (rows contiguous, one stride), slots [B] int64; the three
    penalties [B] float32."""
    B, N, V = logits.shape
    assert logits.stride(2) == 1 and counts.stride(1) == 1 and counts.stride(0) == prompt_mask.stride(0)
    out = torch.empty(B, N, V, dtype=torch.float32, device=logits.device)
    if B * N == 0:
        return out
    _penalties_kernel[(B * N, triton.cdiv(V, BLOCK))](
        logits, logits.stride(0), logits.stride(1), out, counts, prompt_mask.view(torch.uint8),
        counts.stride(0), slots, repetition, frequency, presence, N, V,
        BLOCK=BLOCK, FMAX=FLOAT32_MAX, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
