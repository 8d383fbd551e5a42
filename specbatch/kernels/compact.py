"""Accepted-path KV compaction in place: every layer's K and V in one launch.

Same result as `specbatch.runtime.kv_cache.compact_path`: for j < num[b], cache row
start[b] + path[b, j] of slot slots[b] is copied to row start[b] + j in every plane; rows at
j >= num stay untouched.

Hazard: a tree's accepted path is increasing with path[j] >= j, and the move is in place. Copy
j writes row j, which may be the source path[j'] = j of another copy j' < j still to be read,
so every source must be read before its row is overwritten. One program per (plane, sequence,
chunk of the Hkv * D row) reads all its sources into registers, waits at a CTA barrier, then
writes all destinations: one memory round trip, safe whatever the overlap. Programs running the
copies of one sequence in parallel over j would race (there is no barrier between programs),
which is why j is never split across programs. (Walking j in increasing order, copy by copy,
is also safe, since copy j' > j reads path[j'] >= j' > j, never a row already written, but costs
W dependent round trips.) Programs for different (plane, sequence, chunk) touch disjoint memory,
provided real sequences have distinct slots; pad rows may all share the dummy slot since they
move nothing (num = 1, path[:, 0] = 0). Rows already in place (path[j] == j) are masked out.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096          # elements a program holds: (rows of the path) x (chunk of one Hkv * D row)


@triton.jit(do_not_specialize=["W", "s_pt"])
def _compact_kernel(kv_ptr, s_plane, s_slot, s_row, slots_ptr, start_ptr, path_ptr, s_path,
                    num_ptr, W, E, pt_ptr, s_pt, WB: tl.constexpr, BLOCK: tl.constexpr,
                    PAGED: tl.constexpr, PAGE: tl.constexpr):
    b = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)             # [BLOCK] within the row
    j = tl.arange(0, WB)                                              # [WB] path positions
    slot = tl.load(slots_ptr + b)
    start = tl.load(start_ptr + b)
    n = tl.load(num_ptr + b)
    src = tl.load(path_ptr + b * s_path + j, mask=j < W, other=0)
    move = (j < W) & (j < n) & (src != j)                             # rows past num stay put
    mask = move[:, None] & (offs < E)[None, :]                        # [WB, BLOCK]
    base = kv_ptr + plane * s_plane
    src_row = start + src
    dst_row = start + j
    if PAGED:                                      # slot rows -> (page, row in page)
        src_at = tl.load(pt_ptr + slot * s_pt + src_row // PAGE, mask=j < W, other=0).to(tl.int64) * s_slot \
            + (src_row % PAGE) * s_row
        dst_at = tl.load(pt_ptr + slot * s_pt + dst_row // PAGE, mask=j < W, other=0).to(tl.int64) * s_slot \
            + (dst_row % PAGE) * s_row
    else:
        src_at = slot * s_slot + src_row * s_row
        dst_at = slot * s_slot + dst_row * s_row
    rows = tl.load(base + src_at[:, None] + offs[None, :], mask=mask)
    tl.debug_barrier()                                                # every source read first
    tl.store(base + dst_at[:, None] + offs[None, :], rows, mask=mask)


def compact_path(kv: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, path: torch.Tensor,
                 num: torch.Tensor, *, block: int | None = None, page_table: torch.Tensor | None = None) -> None:
    """kv [P, S, rows, Hkv, D] (KVCache.data), slots / start / num [B] int64, path [B, W] int64.
    With `page_table` [S, pages per slot], kv is paged: [P, pages, page rows, Hkv, D].

    In place; graph-capturable. kv's last two dims must be contiguous. block: elements of a
    Hkv * D row per program (default: TILE / path rows; a tuning knob).
    """
    P, _, _, H, D = kv.shape
    B, W = path.shape
    if kv.stride(-1) != 1 or kv.stride(-2) != D:
        raise ValueError("compact_path wants kv rows [Hkv, D] contiguous")
    if path.stride(1) != 1 or not all(t.shape == (B,) and t.is_contiguous() for t in (slots, start, num)):
        raise ValueError("compact_path wants slots / start / num [B] contiguous and path rows contiguous")
    if B == 0 or W <= 1:
        return
    E = H * D
    WB = triton.next_power_of_2(W)
    block = min(block or max(32, TILE // WB), triton.next_power_of_2(E))
    grid = (B, P, triton.cdiv(E, block))
    paged = page_table is not None
    _compact_kernel[grid](kv, kv.stride(0), kv.stride(1), kv.stride(2), slots, start, path,
                          path.stride(0), num, W, E, page_table if paged else slots,
                          page_table.stride(0) if paged else 0, WB=WB, BLOCK=block,
                          PAGED=paged, PAGE=kv.shape[2] if paged else 1, num_warps=4)
