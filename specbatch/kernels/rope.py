"""Fused RoPE + KV-cache write: rotate q and k, write rotated k and plain v into the slot cache,
return rotated q. One launch replaces rope_cos_sin's per-layer use, ~16 elementwise ops and the
two index_puts of `attention.write_kv`.

Reference (specbatch.models.llama: rope_cos_sin, rotate_half, Attention.forward; write_kv),
rounding for rounding, dtype = q's:
    f   = positions.float() * inv_freq                 fp32
    cos = cos(f).to(dtype), sin = sin(f).to(dtype)     libdevice cosf / sinf, as torch on CUDA
    out[:D/2] = x1 * cos - x2 * sin                    each product and the sum rounded to dtype
    out[D/2:] = x2 * cos + x1 * sin                    (x1, x2 = the halves: rotate_half)
then k_cache[slots[b], rows[b, t]] = k_rot.to(cache dtype), same for v. Fused multiply-adds are
off, so float32 follows the same op sequence; on CUDA every op is the one torch runs, so results
should be bitwise equal (the interpreter's cos / sin are numpy's: last-bit differences there).

Layout: grid (B*T tokens, head groups): groups [0, NQG) rotate HB q heads each, the rest rotate
HB k heads and copy the same v heads. A program holds [HB, D/2] tiles of both halves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .norm import round_to

TILE = 512                  # elements of one half-tile per program: HB = TILE / next_pow2(D / 2)


@triton.jit
def _cos_sin(f, PRECISE: tl.constexpr):
    # PRECISE (CUDA): libdevice cosf / sinf (full range reduction), what torch calls.
    if PRECISE:
        c = libdevice.cos(f)
        s = libdevice.sin(f)
    else:
        c = tl.cos(f)
        s = tl.sin(f)
    return c, s


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr, PRECISE: tl.constexpr):
    """Halves (float32 holding DT values) -> rotated halves in DT. x * cos + rotate_half(x) * sin,
    with torch's rounding after every op; (-x2) * sin rounds to exactly -(x2 * sin)."""
    a1 = round_to(x1 * c, DT, PRECISE).to(tl.float32)
    b1 = round_to(x2 * s, DT, PRECISE).to(tl.float32)
    a2 = round_to(x2 * c, DT, PRECISE).to(tl.float32)
    b2 = round_to(x1 * s, DT, PRECISE).to(tl.float32)
    return round_to(a1 - b1, DT, PRECISE), round_to(a2 + b2, DT, PRECISE)


@triton.jit(do_not_specialize=["T", "spb", "spt", "ssb", "srb", "srt", "s_pt"])
def _rope_kv_kernel(q_ptr, sqb, sqt, sqh, k_ptr, skb, skt, skh, v_ptr, svb, svt, svh,
                    pos_ptr, spb, spt, inv_ptr, slot_ptr, ssb, row_ptr, srb, srt,
                    kc_ptr, skc0, skc1, skc2, vc_ptr, svc0, svc1, svc2,
                    qo_ptr, sob, sot, soh, T, pt_ptr, s_pt,
                    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                    HALF_BLOCK: tl.constexpr, HB: tl.constexpr, NQG: tl.constexpr,
                    PRECISE: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    tok = tl.program_id(0)
    grp = tl.program_id(1)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    DT = q_ptr.dtype.element_ty

    d = tl.arange(0, HALF_BLOCK)
    dm = d < HALF
    pos = tl.load(pos_ptr + b * spb + t * spt)
    inv = tl.load(inv_ptr + d, mask=dm, other=0.0)
    c, s = _cos_sin(pos.to(tl.float32) * inv, PRECISE)                 # [HALF_BLOCK] fp32
    # cat(freqs, freqs): both halves use the same cos / sin, rounded to dtype like rope_cos_sin.
    c = round_to(c, DT, PRECISE).to(tl.float32)[None, :]
    s = round_to(s, DT, PRECISE).to(tl.float32)[None, :]

    hh = tl.arange(0, HB)
    dd = d[None, :]
    if grp < NQG:
        h = grp * HB + hh
        m = (h < HQ)[:, None] & dm[None, :]
        src = q_ptr + b * sqb + t * sqt + h[:, None] * sqh + dd
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c, s, DT, PRECISE)
        dst = qo_ptr + b * sob + t * sot + h[:, None] * soh + dd
        tl.store(dst, o1, mask=m)
        tl.store(dst + HALF, o2, mask=m)
    else:
        h = (grp - NQG) * HB + hh
        m = (h < HKV)[:, None] & dm[None, :]
        slot = tl.load(slot_ptr + b * ssb)                               # int64
        row = tl.load(row_ptr + b * srb + t * srt)
        if PAGED:                                # (page, row in page) instead of (slot, row)
            slot = tl.load(pt_ptr + slot * s_pt + row // PAGE).to(tl.int64)
            row = row % PAGE
        src = k_ptr + b * skb + t * skt + h[:, None] * skh + dd
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        o1, o2 = _rotate(x1, x2, c, s, DT, PRECISE)
        KT = kc_ptr.dtype.element_ty                                     # k.to(k_cache.dtype)
        dst = kc_ptr + slot * skc0 + row * skc1 + h[:, None] * skc2 + dd
        tl.store(dst, round_to(o1.to(tl.float32), KT, PRECISE), mask=m)
        tl.store(dst + HALF, round_to(o2.to(tl.float32), KT, PRECISE), mask=m)
        VT = vc_ptr.dtype.element_ty
        src = v_ptr + b * svb + t * svt + h[:, None] * svh + dd
        v1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        v2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        dst = vc_ptr + slot * svc0 + row * svc1 + h[:, None] * svc2 + dd
        tl.store(dst, round_to(v1, VT, PRECISE), mask=m)
        tl.store(dst + HALF, round_to(v2, VT, PRECISE), mask=m)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, rows: torch.Tensor, q_out: torch.Tensor | None = None,
                  *, heads_per_program: int | None = None, num_warps: int | None = None,
                  page_table: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate q [B, T, Hq, D] and k [B, T, Hkv, D] at `positions` [B, T] (int) with `inv_freq`
    [D/2] float32; write rotated k and v [B, T, Hkv, D] to k_cache / v_cache [S, L, Hkv, D] at
    (slots[b], rows[b, t]); -> rotated q (q_out, or a new contiguous [B, T, Hq, D]).

    q, k, v may be strided views (e.g. slices of one fused qkv GEMM output); every last dim must
    have unit stride (inputs are copied otherwise). q, k, v share one dtype, which cos / sin are
    rounded to (the model dtype, as in rope_cos_sin). Graph-capturable; one compile per head
    shape and dtypes, none per B or T. With `page_table` [S, pages per slot] the caches are
    pages [pages, P, Hkv, D] and row r of slot s is row r % P of page page_table[s, r // P].
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("rope_write_kv: q, k, v must be [B, T, heads, D]")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, D) or v.shape != k.shape:
        raise ValueError(f"rope_write_kv: k, v must be [{B}, {T}, Hkv, {D}], got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if D % 2:
        raise ValueError(f"rope_write_kv: head dim {D} is odd")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("rope_write_kv: q, k, v must share one dtype")
    if positions.shape != (B, T) or rows.shape != (B, T) or slots.shape != (B,):
        raise ValueError("rope_write_kv: positions and rows must be [B, T], slots [B]")
    if inv_freq.shape != (D // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"rope_write_kv: inv_freq must be float32 [{D // 2}]")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2:] != (Hkv, D) or c.stride(-1) != 1:
            raise ValueError(f"rope_write_kv: {name} must be [S, L, {Hkv}, {D}] with a unit last stride")
    if q_out is None:
        q_out = torch.empty((B, T, Hq, D), dtype=q.dtype, device=q.device)
    if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"rope_write_kv: q_out must be {q.dtype} {tuple(q.shape)} with a unit last stride")
    if B * T == 0:
        return q_out
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    half_block = triton.next_power_of_2(D // 2)
    hb = heads_per_program or max(1, TILE // half_block)
    hb = triton.next_power_of_2(min(hb, max(Hq, Hkv)))
    nqg, nkg = triton.cdiv(Hq, hb), triton.cdiv(Hkv, hb)
    if num_warps is None:
        num_warps = min(max(hb * half_block // 256, 1), 8)     # 8 bf16 per thread and half
    _rope_kv_kernel[(B * T, nqg + nkg)](
        q, q.stride(0), q.stride(1), q.stride(2), k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        positions, positions.stride(0), positions.stride(1), inv_freq.contiguous(),
        slots, slots.stride(0), rows, rows.stride(0), rows.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_out, q_out.stride(0), q_out.stride(1), q_out.stride(2), T,
        page_table if page_table is not None else slots, page_table.stride(0) if page_table is not None else 0,
        HQ=Hq, HKV=Hkv, HALF=D // 2, HALF_BLOCK=half_block, HB=hb, NQG=nqg, PRECISE=q.is_cuda,
        PAGED=page_table is not None, PAGE=k_cache.shape[1] if page_table is not None else 1,
        num_warps=num_warps, enable_fp_fusion=False)
    return q_out
