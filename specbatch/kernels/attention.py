"""Triton attention over the slot KV cache (static or paged): prefill, decode, chain / tree verify
and draft steps.

The same operation as `specbatch.models.attention.attend` (kept import-free of it: kernels stay a
leaf). Sequence b brings T new tokens; token t reads rows l < prefix_b + M of cache slot slots[b]:
every committed row l < prefix_b (within a sliding window when given), and region row
m = l - prefix_b when tree_mask[b, t, m] (tree) or m <= write_offset + t (causal).

One program per (sequence, kv head, query tile, split) takes up to BLOCK_M of the T*G query rows
of its kv head as one tile, so K/V are read once per kv head and tile (GQA). Few new tokens
(decode, verify, draft steps) fit one tile; a prompt's T tokens span T*G / BLOCK_M tiles, each
reading only the rows its causal mask reaches (flash attention: no mask is materialised). The
engine's packed prefill brings one token a sequence instead, and groups runs of one prompt's
tokens into query tiles (tile_start / tile_count): one program per (tile, kv head) then takes the
tile's tokens as one causal sequence, each token's q and output at its own sequence. A
split walks its contiguous chunk of BLOCK_N-row blocks, computed in the kernel from the slot's
own row count: short sequences never loop over the host bound. Blocks wholly before the prefix
(committed rows every query row sees, no window) run without masks; only the region's blocks
build one. With several splits, partial
(acc, max, sum) go to fp32 scratch and the split that finishes last merges them (log-sum-exp):
each split counts itself in on a per-(sequence, kv head) counter (a buffer the kernel leaves
zero), and the one that brings it to the number of splits with rows resets it, so there is no
second kernel to launch. No host sync and no device-dependent allocation: capturable in a CUDA
graph.

Paged caches: k_cache / v_cache are [pages, P, Hkv, D] and cache row l of slot s lives at row
l % P of page page_table[s, l // P]; without a page table they are [slots, L, Hkv, D].
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import INTERPRET
from .counters import zeroed_counters

MAX_QUERY_ROWS = 128    # T * G rows per query tile
MAX_HEAD_DIM = 256
_WAVES = 2              # aim for >= this many programs per SM before splitting stops
_MIN_BLOCKS_PER_SPLIT = 2
_MAX_SPLITS = 64
_TILE_BYTES = 16384     # one K (or V) tile per pipeline stage
_NUM_STAGES = 3         # K/V tiles in flight: 2 prefetched (~70 KB shared at bf16 D 128)


@triton.jit(do_not_specialize=["T", "n_splits", "region", "write_offset", "smb", "smt", "smm", "s_pt"])
def _slot_attn_kernel(
    q_ptr, k_ptr, v_ptr, slots_ptr, prefix_ptr, mask_ptr, pos_ptr, out_ptr, pacc_ptr, pm_ptr, pl_ptr, cnt_ptr,
    pt_ptr, tstart_ptr, tcount_ptr, order_ptr, T, n_splits, region, write_offset, window, qk_scale,
    s_slot, s_pre, s_pt,
    sqb, sqt, sqh, sqd,
    sks, skl, skh, skd,
    svs, svl, svh, svd,
    smb, smt, smm,
    spb, spt,
    sob, sot, soh, sod,
    G: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TREE: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, TILED: tl.constexpr,
    ORDERED: tl.constexpr,
):
    n_heads = tl.num_programs(1)
    if ORDERED:
        # Blocks start in launch order (axis 0 fastest): the r-th started (sequence, kv head)
        # pair belongs to the r // n_heads-th program of order_ptr, so the longest start first.
        started = tl.program_id(0) + tl.num_programs(0) * tl.program_id(1)
        b = tl.load(order_ptr + started // n_heads).to(tl.int32)
        h = started % n_heads
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
    tile = tl.program_id(2) // n_splits
    s = tl.program_id(2) % n_splits

    # Query row r = t * G + g: new token t, query head h * G + g (the GQA group of kv head h).
    # TILED: program b is query tile b, sequences [start, start + count) of one token each
    # (consecutive positions of one slot, causal among themselves): token t is sequence start + t.
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // G
    if TILED:
        seq = tl.load(tstart_ptr + b).to(tl.int32)
        n_new = tl.load(tcount_ptr + b).to(tl.int32)
        reg = n_new
        q_seq = seq + t
        q_col = t * 0
    else:
        seq = b
        n_new = T
        reg = region
        q_seq = seq + t * 0
        q_col = t
    row_ok = rows < n_new * G
    qh = h * G + rows % G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(q_ptr + q_seq[:, None] * sqb + q_col[:, None] * sqt + qh[:, None] * sqh + dd[None, :] * sqd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)                  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    slot = tl.load(slots_ptr + seq * s_slot).to(tl.int64)    # int64: slot * stride can pass 2**31 elements
    prefix = tl.load(prefix_ptr + seq * s_pre).to(tl.int32)
    n_rows = prefix + reg                            # rows this slot reads (device value)
    if not TREE:
        # causal: the tile's last token reads up to its own row
        t_last = (tl.minimum(tile * BLOCK_M + BLOCK_M, n_new * G) - 1) // G
        n_rows = tl.minimum(n_rows, prefix + write_offset + t_last + 1)
    n_rows = tl.where(tile * BLOCK_M < n_new * G, n_rows, 0)     # an empty tile reads nothing

    lo = prefix * 0
    pos = t * 0
    if WINDOW:
        pos = tl.load(pos_ptr + q_seq * spb + q_col * spt, mask=row_ok, other=0).to(tl.int32)   # [BLOCK_M]
        # Committed rows before every token's window are skipped; region rows are always inside.
        first = tl.min(tl.where(row_ok, pos, 2147483647), 0) - window + 1
        lo = tl.minimum(tl.maximum(first, 0), prefix)

    # This split's contiguous chunk of blocks among those the slot actually reads.
    blk_lo = lo // BLOCK_N
    n_blk = tl.cdiv(n_rows, BLOCK_N) - blk_lo
    per_split = tl.cdiv(n_blk, n_splits)
    start = blk_lo + s * per_split
    end = tl.minimum(start + per_split, blk_lo + n_blk)

    k_base = k_ptr + h * skh
    v_base = v_ptr + h * svh
    if not PAGED:
        k_base += slot * sks
        v_base += slot * svs
    # Finite start: a row that has seen nothing keeps alpha = 1 and p = 0 (no inf - inf).
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)    # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Blocks wholly before the prefix are visible to every query row (committed rows, no window):
    # no mask there; the region's blocks (causal or tree) and windowed runs take the masked loop.
    if WINDOW:
        mid = start
    else:
        mid = tl.maximum(tl.minimum(end, prefix // BLOCK_N), start)
    for blk in range(start, mid):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, pt_ptr, mask_ptr, blk, slot, s_pt, prefix, n_rows,
                                      write_offset, window, qk_scale, b, t, row_ok, pos, dd, d_ok,
                                      skl, skd, sks, svl, svd, svs, smb, smt, smm, m_i, l_i, acc,
                                      D, BLOCK_N, BLOCK_D, TREE, WINDOW, DOT_PREC, UPCAST, PAGED, PAGE, False)
    for blk in range(mid, end):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, pt_ptr, mask_ptr, blk, slot, s_pt, prefix, n_rows,
                                      write_offset, window, qk_scale, b, t, row_ok, pos, dd, d_ok,
                                      skl, skd, sks, svl, svd, svs, smb, smt, smm, m_i, l_i, acc,
                                      D, BLOCK_N, BLOCK_D, TREE, WINDOW, DOT_PREC, UPCAST, PAGED, PAGE, True)

    if SPLIT:
        # Partials [B, Hkv, S, T*G(, D)] of the splits that read rows: the first `used` (splits are
        # contiguous chunks). A host bound far above the rows read (a graph captured for max_len)
        # leaves most splits empty: they store nothing and do not count in.
        used = tl.maximum(tl.cdiv(n_blk, tl.maximum(per_split, 1)), 1)
        if s < used:
            base = (b * n_heads + h) * n_splits
            part = base + s
            tl.store(pm_ptr + part * (T * G) + rows, m_i, mask=row_ok)
            tl.store(pl_ptr + part * (T * G) + rows, l_i, mask=row_ok)
            tl.store(pacc_ptr + part * (T * G * D) + rows[:, None] * D + dd[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.debug_barrier()                # every thread's partial before the release below
            arrived = tl.atomic_add(cnt_ptr + b * n_heads + h, 1, sem="acq_rel")
            if arrived == used - 1:           # the last split in merges, then resets the counter
                tl.debug_barrier()
                _merge_splits(pacc_ptr, pm_ptr, pl_ptr, base, used, out_ptr, q_seq, q_col, qh, rows, row_ok,
                              dd, d_ok, T, sob, sot, soh, sod, G, D, BLOCK_M, BLOCK_D)
                tl.store(cnt_ptr + b * n_heads + h, 0)
    else:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]           # pad rows: no 0 / 0
        tl.store(out_ptr + q_seq[:, None] * sob + q_col[:, None] * sot + qh[:, None] * soh + dd[None, :] * sod,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attend_block(q, k_base, v_base, pt_ptr, mask_ptr, blk, slot, s_pt, prefix, n_rows, write_offset, window,
                  qk_scale, b, t, row_ok, pos, dd, d_ok, skl, skd, sks, svl, svd, svs, smb, smt, smm,
                  m_i, l_i, acc, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  TREE: tl.constexpr, WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
                  UPCAST: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_N-row block of K/V into the running (max, sum, acc). MASKED = False: every row of
    the block is a committed row every query row sees (before the prefix, no window)."""
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)                                 # cache rows
    col_ok = cols < n_rows
    if PAGED:
        if PAGE % BLOCK_N == 0:         # the block lies within one page: one lookup
            page = tl.load(pt_ptr + slot * s_pt + (blk * BLOCK_N) // PAGE).to(tl.int64)
        else:
            page = tl.load(pt_ptr + slot * s_pt + cols // PAGE, mask=col_ok, other=0).to(tl.int64)
        k_rows = page * sks + (cols % PAGE) * skl
        v_rows = page * svs + (cols % PAGE) * svl
    else:
        k_rows = cols * skl
        v_rows = cols * svl
    k_at = k_base + k_rows[:, None] + dd[None, :] * skd
    v_at = v_base + v_rows[:, None] + dd[None, :] * svd
    if MASKED:
        # Unread rows may hold anything (NaN): masked loads give 0 there.
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(k_at, mask=kv_ok, other=0.0)
        v = tl.load(v_at, mask=kv_ok, other=0.0)
    elif BLOCK_D == D:
        k = tl.load(k_at)
        v = tl.load(v_at)
    else:
        k = tl.load(k_at, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_at, mask=d_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale              # [BLOCK_M, BLOCK_N]
    if MASKED:
        rel = cols - prefix                                                       # region index
        in_prefix = rel < 0
        if TREE:
            in_region = (rel >= 0) & col_ok
            allowed = tl.load(mask_ptr + b * smb + t[:, None] * smt + rel[None, :] * smm,
                              mask=row_ok[:, None] & in_region[None, :], other=0) != 0
        else:
            allowed = (rel[None, :] <= write_offset + t[:, None]) & col_ok[None, :]
        vis = in_prefix[None, :] | allowed
        if WINDOW:
            vis = vis & ((rel >= 0)[None, :] | ((pos[:, None] - cols[None, :]) < window))
        qk = tl.where(vis, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])                                              # 0 where hidden
    l_i = l_i * alpha + tl.sum(p, 1)
    p_dtype = v_base.dtype.element_ty               # p meets V rounded to the cache dtype
    acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(pacc_ptr, pm_ptr, pl_ptr, base, used, out_ptr, q_seq, q_col, qh, rows, row_ok, dd, d_ok, T,
                  sob, sot, soh, sod,
                  G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = the log-sum-exp merge of partials base .. base + used - 1. Loads go to L2 (.cg):
    other programs wrote them during this kernel."""
    ok = row_ok[:, None] & d_ok[None, :]
    m_max = tl.full([BLOCK_M], -1.0e30, tl.float32)
    for j in range(used):
        m_j = tl.load(pm_ptr + (base + j) * (T * G) + rows, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        m_max = tl.maximum(m_max, m_j)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(used):
        m_j = tl.load(pm_ptr + (base + j) * (T * G) + rows, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        l_j = tl.load(pl_ptr + (base + j) * (T * G) + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_j = tl.load(pacc_ptr + (base + j) * (T * G * D) + rows[:, None] * D + dd[None, :], mask=ok, other=0.0,
                      cache_modifier=".cg")
        w = tl.exp2(m_j - m_max)
        l_sum += w * l_j
        acc += w[:, None] * a_j
    o = acc / tl.where(row_ok, l_sum, 1.0)[:, None]
    tl.store(out_ptr + q_seq[:, None] * sob + q_col[:, None] * sot + qh[:, None] * soh + dd[None, :] * sod,
             o.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _longest_first_kernel(len_ptr, order_ptr, n, BI: tl.constexpr, BJ: tl.constexpr):
    """order[rank[i]] = i, rank[i] = #{j: len[j] > len[i], or len[j] == len[i] and j < i}."""
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    li = tl.load(len_ptr + i, mask=i < n, other=0)
    rank = tl.zeros([BI], tl.int32)
    for j0 in range(0, n, BJ):
        j = j0 + tl.arange(0, BJ)
        lj = tl.load(len_ptr + j, mask=j < n, other=0)
        ahead = (lj[None, :] > li[:, None]) | ((lj[None, :] == li[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((ahead & (j < n)[None, :]).to(tl.int32), 1)
    tl.store(order_ptr + rank, i, mask=i < n)


def longest_first(lengths: torch.Tensor, heads: int) -> torch.Tensor | None:
    """lengths [P] (the rows each of the kernel's P programs reads) -> [P] int32 program indices,
    longest first (ties in index order), for `slot_attention(order=)`; None when the P x heads
    programs all fit in one wave, where the order cannot matter. One launch: computed once a
    forward, every layer uses it."""
    P = lengths.shape[0]
    if P * heads <= _sm_count(lengths.device):
        return None
    order = torch.empty(P, dtype=torch.int32, device=lengths.device)
    _longest_first_kernel[(triton.cdiv(P, 128),)](lengths.contiguous(), order, P, BI=128, BJ=32, num_warps=4)
    return order


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132      # interpreter: an H100's count, so CPU runs choose like the GPU would
    return torch.cuda.get_device_properties(device).multi_processor_count


def _config(block_m: int, block_d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): a K tile of <= 16 KB (64 rows at bf16 D 128) and a score
    tile of <= 64 x 64; 8 warps for fp32 (its dots run on FMA units, operands in registers) and
    for wide tiles of D > 128; 2 stages for wide tiles (shared memory). A prefill tile of 128
    query rows at bf16 D 128 runs 25-33% faster on 4 warps than on 8 (H100, 32 x 256 to 5 x 1,536
    token prefills: `benchmarks/attention_kernel.py --prefill --sweep`)."""
    block_n = max(16, min(64, _TILE_BYTES // (block_d * elem_bytes), 4096 // block_m))
    wide = block_m * block_d > 64 * 128
    warps = 8 if elem_bytes == 4 or (wide and block_d > 128) else 4
    return block_n, warps, 2 if wide else _NUM_STAGES


def choose_splits(programs: int, max_rows: int, block_n: int, device: torch.device) -> int:
    """Splits of the KV rows: enough programs for ~_WAVES waves, each split >= 2 blocks of rows."""
    want = triton.cdiv(_WAVES * _sm_count(device), programs)
    most = triton.cdiv(max_rows, block_n) // _MIN_BLOCKS_PER_SPLIT
    return max(1, min(want, most, _MAX_SPLITS))


def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   prefix_lens: torch.Tensor, scale: float, *, tree_mask: torch.Tensor | None = None,
                   write_offset: int = 0, positions: torch.Tensor | None = None,
                   sliding_window: int | None = None, max_rows: int | None = None,
                   num_splits: int | None = None, out: torch.Tensor | None = None,
                   page_table: torch.Tensor | None = None, tile_start: torch.Tensor | None = None,
                   tile_count: torch.Tensor | None = None, tile_size: int = 0,
                   order: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, Hq, D] over caches [S, L, Hkv, D] -> out [B, T, Hq, D] (q's dtype).

    slots, prefix_lens [B] int64; tree_mask [B, T, M] bool (None = causal over write_offset + T
    region rows); positions [B, T] (only read with sliding_window); max_rows: host bound on
    prefix_b + M, for the split choice only (default: the cache length). page_table [S, pages
    per slot] (int): the caches are paged, [pages, P, Hkv, D].

    tile_start, tile_count [R] (int), tile_size: one new token a sequence (T = 1, causal), the
    sequences grouped into query tiles: tile r is sequences [start, start + count), count <=
    tile_size, consecutive positions of one slot (prefix_lens rising by one), so they share
    their K/V reads. Sequences in no tile are not computed (their output is left as it was).

    order [programs] (int, a permutation of the sequences, or of the tiles when tiled): the
    order in which their programs start (`longest_first`), so the longest do not run alone at the
    end; the result does not depend on it.

    counters (int32, >= B * Hkv zeros; left zero): the splits' arrival counters; None: the
    device's shared buffer (`counters.zeroed_counters`).
    """
    B, T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if k_cache.shape[3] != D or v_cache.shape != k_cache.shape or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype:
        raise ValueError(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}: need one of bf16/fp16/fp32")
    G = Hq // Hkv
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} > {MAX_HEAD_DIM}")
    tree = tree_mask is not None
    region = tree_mask.shape[2] if tree else write_offset + T
    if tree and tuple(tree_mask.shape[:2]) != (B, T):
        raise ValueError(f"tree_mask {tuple(tree_mask.shape)} does not match q {tuple(q.shape)}")
    if tree and T * G > MAX_QUERY_ROWS:
        raise ValueError(f"tree verify with T * G = {T * G} query rows > {MAX_QUERY_ROWS}")
    if sliding_window is not None:
        if positions is None:
            raise ValueError("sliding_window needs positions")
        widest = tile_size if tile_start is not None else region     # rows a tile treats as in-window
        if sliding_window <= widest:
            raise ValueError(f"sliding window {sliding_window} not wider than the region ({widest} rows)")
    tiled = tile_start is not None
    if tiled and (T != 1 or tree or write_offset or tile_count is None or tile_size < 1
                  or tile_count.shape != tile_start.shape):
        raise ValueError("query tiles group one-token causal sequences: need T = 1, no tree, no write "
                         "offset, tile_count shaped like tile_start and tile_size >= 1")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0 or T == 0 or (tiled and tile_start.numel() == 0):
        return out

    rows_q = tile_size * G if tiled else T * G           # query rows of one program's sequence(s)
    BLOCK_M = min(MAX_QUERY_ROWS, max(16, triton.next_power_of_2(rows_q)))
    n_tiles = triton.cdiv(rows_q, BLOCK_M)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N, warps, stages = _config(BLOCK_M, BLOCK_D, q.element_size())
    if num_splits is None:
        rows_bound = max_rows if max_rows is not None else (
            page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1])
        num_splits = 1 if n_tiles > 1 or tiled else choose_splits(B * Hkv, rows_bound, BLOCK_N, q.device)
    if (n_tiles > 1 or tiled) and num_splits > 1:
        raise ValueError("splits are for one query tile (decode / verify), not prefills")
    split = num_splits > 1
    if split:
        pacc = torch.empty(B, Hkv, num_splits, T * G, D, dtype=torch.float32, device=q.device)
        pm = torch.empty(B, Hkv, num_splits, T * G, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        if counters is None:
            counters = zeroed_counters("attention", q.device, B * Hkv, least=4096)
        elif counters.dtype != torch.int32 or counters.numel() < B * Hkv or counters.device != q.device:
            raise ValueError(f"counters {counters.dtype} [{counters.numel()}] on {counters.device}: need int32 "
                             f">= {B * Hkv} zeros on {q.device}")
    else:
        pacc = pm = pl = counters = out    # unused: the kernel writes out directly
    # bool -> uint8 is a view (same bytes); unused pointers get any tensor.
    mask = tree_mask.view(torch.uint8) if tree else slots
    smask = tree_mask.stride() if tree else (0, 0, 0)
    pos = positions if positions is not None else slots
    spos = positions.stride() if positions is not None else (0, 0)
    window = sliding_window if sliding_window is not None else 0
    paged = page_table is not None
    pt = page_table if paged else slots
    programs = tile_start.shape[0] if tiled else B
    if order is not None and tuple(order.shape) != (programs,):
        per = "tile" if tiled else "sequence"
        raise ValueError(f"order {tuple(order.shape)}: need one entry per {per} ({programs})")

    _slot_attn_kernel[(programs, Hkv, n_tiles * num_splits)](
        q, k_cache, v_cache, slots, prefix_lens, mask, pos, out, pacc, pm, pl, counters,
        pt, tile_start if tiled else slots, tile_count if tiled else slots,
        order if order is not None else slots, T, num_splits,
        region, write_offset, window, scale * 1.4426950408889634,      # log2(e): exp2 domain
        slots.stride(0), prefix_lens.stride(0), pt.stride(0) if paged else 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *smask, *spos, *out.stride(),
        G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        TREE=tree, WINDOW=sliding_window is not None, SPLIT=split,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",      # fp32: exact, like the torch path
        UPCAST=INTERPRET and q.dtype == torch.bfloat16, PAGED=paged,     # UPCAST: p rounded to bf16 first, as on GPU
        PAGE=k_cache.shape[1] if paged else 1, TILED=tiled, ORDERED=order is not None,
        num_warps=warps, num_stages=stages,
    )
    return out
