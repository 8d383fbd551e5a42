"""Linear layers of a few rows (decode and verify at small batches): y [M, N] = x [M, K] @ w [N, K]^T
for M <= MAX_ROWS.

cuBLAS runs these as GEMVs at 70-97% of the weight bytes on an H100, o_proj and down_proj (an
output narrower than the input) as a split-K GEMV plus a second reduce kernel
(`benchmarks/skinny_gemm.py`: o_proj 70%, down_proj 89%, lm_head 94%). Here one program owns
BLOCK_N output columns for all M rows and streams its weight rows through K (BLOCK_N = 32: 128
programs for N = 4,096, about a wave of an H100), accumulating in fp32 with tensor-core dots over
a 16-row tile (rows past M masked): 80%, 95% and ~100% there, a forward's GEMMs 5.57 -> 5.28 ms at
one row. No split-K, so no second kernel, and a row's result does not depend on the other rows
or on M: a verify of 4 tokens computes each token exactly as a plain step would.

The tile follows the output width, never M: when BLOCK_N = 32 would need more than one wave of
programs (qkv, gate_up, lm_head at 8B shapes), BLOCK_N = 64 over BLOCK_K = 256 (half the programs,
the same bytes in flight each) saves the second wave's tail: on an H200 at one row qkv 17.6 ->
14.9 us, gate_up 60.3 -> 58.5 (benchmarks/results/h200-2026-11-28e.md; `benchmarks/skinny_gemm.py`
times the engine's tile beside the sweep's best).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from . import INTERPRET

MAX_ROWS = 16           # one dot tile of rows
NARROW = (32, 512)      # (BLOCK_N, BLOCK_K) while N / 32 programs fit in one wave
WIDE = (64, 256)        # past one wave
NUM_STAGES = 4
NUM_WARPS = 4


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
    # x [M, K], w [N, K] (nn.Linear's layout), y [M, N]; program p: columns [p * BN, (p + 1) * BN)
    rm = tl.arange(0, BM)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * swn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:          # the interpreter (kernels.INTERPRET): fp32 dots
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `skinny_linear` takes this product: 1 to MAX_ROWS rows, no bias, 16-bit floats,
    weight rows contiguous."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (bias is None and 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and weight.stride(1) == 1)


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30          # the interpreter: one tile for every width
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile(n: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an output of n columns: a function of n and the GPU only, so a row's
    result does not depend on how many rows share the call."""
    return NARROW if triton.cdiv(n, NARROW[0]) <= _sm_count(device) else WIDE


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K]^T -> [..., N] in x's dtype."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x [..., {K}] does not match weight {tuple(weight.shape)}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows > {MAX_ROWS}: use nn.functional.linear")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        bn, bk = tile(N, x.device)
        _skinny_kernel[(triton.cdiv(N, bn),)](
            x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0),
            BM=MAX_ROWS, BN=bn, BK=bk, UPCAST=INTERPRET and x.dtype == torch.bfloat16,
            num_stages=NUM_STAGES, num_warps=NUM_WARPS)
    return y.view(*x.shape[:-1], N)
