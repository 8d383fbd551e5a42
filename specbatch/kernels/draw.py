"""Fused seeded draw: the exponential race of `specbatch.sampling.draw` in one read of the probs.

Reference (torch): u = uniforms(keys, V) (a 32-bit hash of (row key, vocabulary index), 23 bits
into (0, 1)), token = argmax(p / -log(u)), the lowest index among ties. The torch form builds the
[R, V] hashes in int64 with a dozen elementwise passes (8.5 ms at 512 x 128,256 on an H100, as
long as the whole top-p sort); here each program hashes its indices in registers and keeps a
running (max, first index) per lane: the same integers, the same float32 u, libdevice logf and
IEEE division as torch's CUDA ops, so the same token.

Layout: program (row, split) walks a contiguous chunk of the row; with several splits each writes
its chunk's (max, first index) and the caller takes the first split holding the row's max.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import INTERPRET, libm
from .top1 import plan

BLOCK = 1024
NUM_WARPS = 8


@triton.jit
def _mul(x, c: tl.constexpr):
    # x * c mod 2**32 (c may not fit int32: a uint32 constant, not a promoted int64)
    return x * tl.full([1], c, tl.int64).to(tl.uint32)


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (sampling.mix32)."""
    x = x ^ (x >> 16)
    x = _mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def race_weight(p, rkey, o, PRECISE: tl.constexpr):
    """p / E for vocabulary indices o of the row with key rkey: E = -log(u), u the row's seeded
    uniform for o (sampling.uniforms: a 32-bit hash, 23 bits into (0, 1))."""
    golden = tl.full([1], 0x9E3779B9, tl.int64).to(tl.uint32)
    x = _mix32(rkey ^ _mix32(o.to(tl.uint32) ^ golden))
    u = ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)      # exact: 23 bits + 1/2, times 2**-23
    return tl.math.div_rn(p, -libm.log(u, PRECISE))


@triton.jit
def keep_first_max(best, at, w, o):
    """A lane's running (max weight, its first index) with block values w at indices o."""
    gt = w > best                                                # strict: a lane keeps its first max
    return tl.where(gt, w, best), tl.where(gt, o, at)


@triton.jit
def first_max(best, at):
    """The lanes' (max, lowest index holding it)."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, at, 2147483647), axis=0)


@triton.jit(do_not_specialize=["tiles"])
def _draw_kernel(p_ptr, stride_r, keys_ptr, V, tiles, val_ptr, idx_ptr,
                 BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    lane = tl.arange(0, BLOCK)
    begin = split * tiles * BLOCK
    end = tl.minimum(begin + tiles * BLOCK, V)
    base = p_ptr + row.to(tl.int64) * stride_r
    key = tl.load(keys_ptr + row).to(tl.uint32)          # the row key's low 32 bits (all it holds)
    best = tl.full([BLOCK], -1.0, tl.float32)
    at = tl.zeros([BLOCK], tl.int32)
    for t in range(tiles):
        o = begin + t * BLOCK + lane
        m = o < end
        p = tl.load(base + o, mask=m, other=0.0).to(tl.float32)
        best, at = keep_first_max(best, at, tl.where(m, race_weight(p, key, o, PRECISE), -1.0), o)
    top, first = first_max(best, at)
    k = row * splits + split
    tl.store(val_ptr + k, top)
    tl.store(idx_ptr + k, first.to(tl.int64))


def draw_race(probs: torch.Tensor, keys: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """probs [R, V] (float32/bf16, last dim contiguous; need not sum to 1), keys [R] int64 row keys
    (sampling.row_keys) -> tokens [R] int64, equal to the torch race. Graph-capturable."""
    if probs.dim() != 2 or probs.stride(1) != 1:
        probs = probs.reshape(probs.shape[0], -1).contiguous()
    R, V = probs.shape
    if R == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    block, splits, tiles = plan(R, V, probs.device, num_splits, BLOCK)
    tiles *= 2                                  # plan counts iterations of 2 x block; this kernel reads one
    val = torch.empty(R, splits, dtype=torch.float32, device=probs.device)
    idx = torch.empty(R, splits, dtype=torch.int64, device=probs.device)
    _draw_kernel[(R, splits)](probs, probs.stride(0), keys.contiguous(), V, tiles, val, idx,
                              BLOCK=block, PRECISE=not INTERPRET, num_warps=NUM_WARPS)
    if splits == 1:
        return idx[:, 0]
    return idx.gather(1, val.argmax(dim=1, keepdim=True))[:, 0]
