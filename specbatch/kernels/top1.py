"""Fused exact top-1: argmax and its log-probability in one read of the logits, one launch.

Same result as `specbatch.speculative.topk.top1` (the torch reference): the lowest index among ties,
logp = max - logsumexp in float32, all -inf rows -> (0, LOG_ZERO), rows holding +inf -> the
+inf entries share the mass (logp = -log(count), index of the first +inf).
NaN: logp is LOG_ZERO as in the reference, but the index is that of the largest non-NaN entry
(the reference returns a NaN's index); an all-NaN row gives (0, LOG_ZERO) like the reference.

Layout: program (row, split) reads one contiguous chunk of the row, two blocks of BLOCK per
iteration, and keeps, per lane, an online (max, block of the first max, sum of exp(x - max)).
When there are several splits each program writes its partial, then bumps the row's counter;
the program that brings it to `splits` combines the partials and resets the counter to 0, so
CUDA-graph replays start clean.

One update covers every case without inf - inf: with e = exp(-|x - m|) (1 when x == m),
    x > m:  s = s * e + 1      (rescale the old sum to the new max)
    else:   s = s + e
so entries equal to the max (+inf included) add exactly 1 each, -inf below a finite max adds 0,
and once the max is +inf, s counts the +inf entries: logp = -log(s) is right in every case.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .counters import zeroed_counters

LOG_ZERO = -1e30          # same as specbatch.speculative.topk.LOG_ZERO (kernels import nothing above them)
MAX_SPLITS = 64           # partials per row the combine step reads (one constexpr: no recompiles)
PROGRAMS_PER_SM = 4       # target grid size: ~one full wave of resident programs
# lanes (accumulators); an iteration reads 2 * BLOCK elements. 1,024 beat 2,048 at every shape
# timed on an H100 (benchmarks/top1_kernel.py --sweep: 256 x 128,256 42 -> 31 us, 1,024 rows
# 125 -> 105, 64 rows 14 -> 12): twice the programs resident, the same bytes in flight.
BLOCK = 1024
NUM_WARPS = 8             # 4 lanes per thread: one 64-bit bf16 load per block


@triton.jit
def _fold(m, s, t_at, x, t):
    """Fold block number t (values x, one per lane) into the lanes' online state."""
    gt = x > m                                          # strict: a lane keeps its first max
    e = tl.where(x == m, 1.0, tl.exp(-tl.abs(x - m)))
    s = tl.where(gt, s * e + 1.0, s + e)
    return tl.where(gt, x, m), s, tl.where(gt, t, t_at)


@triton.jit
def _lane_reduce(m, s, t_at, lane, begin, BLOCK: tl.constexpr):
    """Per-lane (max, sum, block of first max) -> the chunk's (max, sum at that max, first index)."""
    pm = tl.max(m, axis=0)
    at_max = m == pm
    ps = tl.sum(s * tl.where(at_max, 1.0, tl.exp(-tl.abs(m - pm))), axis=0)
    pi = tl.min(tl.where(at_max, begin + t_at * BLOCK + lane, 2147483647), axis=0)
    return pm, ps, pi


@triton.jit
def _finish(row, m, s, i, idx_out, logp_out, LOG_ZERO_C: tl.constexpr):
    empty = m == float("-inf")                          # all -inf (or all NaN) row
    logp = -tl.log(s)
    logp = tl.where(empty | (logp != logp), LOG_ZERO_C, logp)
    tl.store(idx_out + row, tl.where(empty, 0, i).to(tl.int64))
    tl.store(logp_out + row, logp)


@triton.jit(do_not_specialize=["tiles", "splits"])
def _top1_kernel(x_ptr, stride_r, V, tiles, splits, part_ptr, counters, idx_out, logp_out,
                 BLOCK: tl.constexpr, MAX_SPLITS: tl.constexpr, ONE_SPLIT: tl.constexpr,
                 LOG_ZERO_C: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    lane = tl.arange(0, BLOCK)
    # chunk = tiles * 2 * BLOCK: a multiple of BLOCK the compiler can see (aligned vector loads).
    begin = split * tiles * (2 * BLOCK)
    end = tl.minimum(begin + tiles * (2 * BLOCK), V)
    base = x_ptr + row.to(tl.int64) * stride_r
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t_at = tl.zeros([BLOCK], tl.int32)
    for t in range(tiles):
        # Both blocks' loads go out before either is folded in: twice the bytes in flight for
        # the same accumulator registers. Block 2t holds the lower indices, so it folds first.
        o0 = begin + t * (2 * BLOCK) + lane
        o1 = o0 + BLOCK
        x0 = tl.load(base + o0, mask=o0 < end, other=float("-inf")).to(tl.float32)
        x1 = tl.load(base + o1, mask=o1 < end, other=float("-inf")).to(tl.float32)
        m, s, t_at = _fold(m, s, t_at, x0, 2 * t)
        m, s, t_at = _fold(m, s, t_at, x1, 2 * t + 1)
    pm, ps, pi = _lane_reduce(m, s, t_at, lane, begin, BLOCK)

    if ONE_SPLIT:
        _finish(row, pm, ps, pi, idx_out, logp_out, LOG_ZERO_C)
    else:
        # part_ptr: float32 [3, R, splits] = (max, sum, first index as int32 bits)
        n_part = tl.num_programs(0) * splits
        k = row * splits + split
        tl.store(part_ptr + k, pm)
        tl.store(part_ptr + n_part + k, ps)
        tl.store(part_ptr + 2 * n_part + k, pi.to(tl.float32, bitcast=True))
        # Every thread's partial store is ordered before the counter bump (release); the
        # program that sees splits - 1 acquires them all.
        tl.debug_barrier()
        done = tl.atomic_add(counters + row, 1, sem="acq_rel")
        if done == splits - 1:
            j = tl.arange(0, MAX_SPLITS)
            ok = j < splits
            kk = row * splits + j
            # .cg: read from L2, where the other programs' stores landed.
            m_all = tl.load(part_ptr + kk, mask=ok, other=float("-inf"), cache_modifier=".cg")
            s_all = tl.load(part_ptr + n_part + kk, mask=ok, other=0.0, cache_modifier=".cg")
            i_all = tl.load(part_ptr + 2 * n_part + kk, mask=ok, other=0.0,
                            cache_modifier=".cg").to(tl.int32, bitcast=True)
            M = tl.max(m_all, axis=0)
            at_max = m_all == M
            S = tl.sum(s_all * tl.where(at_max, 1.0, tl.exp(-tl.abs(m_all - M))), axis=0)
            I = tl.min(tl.where(at_max & ok, i_all, 2147483647), axis=0)
            _finish(row, M, S, I, idx_out, logp_out, LOG_ZERO_C)
            tl.store(counters + row, 0)                 # ready for the next launch / replay


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4                                            # interpreter: small grids still split


def plan(rows: int, vocab: int, device: torch.device, num_splits: int | None = None,
         block: int = BLOCK) -> tuple[int, int, int]:
    """-> (block, splits, iterations per split of 2 * block elements): splits fill the GPU
    when rows are few."""
    block = min(block, max(16, triton.next_power_of_2(vocab) // 2))
    step = 2 * block
    most = min(MAX_SPLITS, triton.cdiv(vocab, step))
    if num_splits is None:
        num_splits = triton.cdiv(_sm_count(device) * PROGRAMS_PER_SM, max(rows, 1))
    splits = max(1, min(num_splits, most))
    tiles = triton.cdiv(triton.cdiv(vocab, splits), step)
    return block, triton.cdiv(vocab, tiles * step), tiles


def top1(logits: torch.Tensor, num_splits: int | None = None,
         out: tuple[torch.Tensor, torch.Tensor] | None = None,
         *, block: int = BLOCK, num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (bf16/fp16/fp32, last dim contiguous) -> (idx int64 [R], logp float32 [R]).

    num_splits: programs per row (default: enough to fill the GPU; clipped to [1, 64] and to
    what V allows). out: optional (idx, logp) to write into. block / num_warps: tuning knobs.
    Graph-capturable: no host sync, allocations depend on shapes only; call it once before
    capturing (compiles, allocates the per-device row counters). Launches must not overlap on
    two streams (they share those counters).
    """
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
        raise ValueError(f"top1 wants [R, V] with a contiguous last dim, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    R, V = logits.shape
    dev = logits.device
    if out is None:
        out = (torch.empty(R, dtype=torch.int64, device=dev), torch.empty(R, dtype=torch.float32, device=dev))
    idx, logp = out
    if idx.shape != (R,) or idx.dtype != torch.int64 or logp.shape != (R,) or logp.dtype != torch.float32 \
            or not (idx.is_contiguous() and logp.is_contiguous()):
        raise ValueError("top1 out= wants (int64 [R], float32 [R]) contiguous")
    if R == 0:
        return idx, logp
    block, splits, tiles = plan(R, V, dev, num_splits, block)
    if splits == 1:
        part, counters = logp, logp                     # unused (ONE_SPLIT)
    else:
        part = torch.empty(3 * R * splits, dtype=torch.float32, device=dev)
        counters = zeroed_counters("top1", dev, R)      # the kernel leaves them zero
    _top1_kernel[(R, splits)](logits, logits.stride(0), V, tiles, splits, part, counters, idx, logp,
                              BLOCK=block, MAX_SPLITS=MAX_SPLITS, ONE_SPLIT=splits == 1,
                              LOG_ZERO_C=LOG_ZERO, num_warps=num_warps)
    return idx, logp
