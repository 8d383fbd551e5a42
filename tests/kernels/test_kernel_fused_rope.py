"""Fused RoPE + KV write (kernels/rope.py) against the model's own path (rope_cos_sin, rotate_half,
write_kv), rounding for rounding, on the CPU through the Triton interpreter: rows and slots in any
order, caches that are planes of one tensor, a paged pool, empty inputs and errors."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specbatch.kernels.rope import rope_write_kv
from specbatch.models.attention import AttnMetadata, write_kv
from specbatch.models.config import DecoderConfig
from specbatch.models.llama import rope_cos_sin, rope_inv_freq, rotate_half

from kernel_fused_helpers import (DTYPES, LLAMA31_8B, SENTINEL, _fused_qkv, _poisoned, assert_rounding_equal,
                                  ref_rope_write)


# ----------------------------------------------------------------------------- CPU: rope + KV write

def _small_cfg(D: int) -> DecoderConfig:
    return dataclasses.replace(LLAMA31_8B, hidden_size=4 * D, num_heads=4, num_kv_heads=2, head_dim=D)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [24, 16])
def test_rope_write_kv_matches_model_path(dtype, D):
    """Against the model's own path: rope_cos_sin + rotate_half + write_kv(AttnMetadata)."""
    g = torch.Generator().manual_seed(D)
    B, T, Hq, Hkv, S, L = 3, 4, 4, 2, 5, 16
    q, k, v = _fused_qkv(B, T, Hq, Hkv, D, dtype, "cpu", g)
    inv_freq = rope_inv_freq(_small_cfg(D))
    meta = AttnMetadata(slots=torch.tensor([3, 0, 2]), positions=torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3],
                                                                               [99990, 99991, 99992, 99993]]),
                        prefix_lens=torch.tensor([5, 0, 9]), kv_len=16, write_offset=1)
    k_cache = torch.full((S, L, Hkv, D), SENTINEL, dtype=dtype)
    v_cache = torch.full((S, L, Hkv, D), SENTINEL, dtype=dtype)
    kr_cache, vr_cache = k_cache.clone(), v_cache.clone()

    q_out = rope_write_kv(q, k, v, meta.positions, inv_freq, k_cache, v_cache, meta.slots, meta.cache_rows())
    cos, sin = rope_cos_sin(inv_freq, meta.positions, dtype)
    q_ref = q * cos + rotate_half(q) * sin
    write_kv(kr_cache, vr_cache, k * cos + rotate_half(k) * sin, v, meta)

    assert q_out.is_contiguous() and q_out.shape == q.shape
    assert_rounding_equal(q_out, q_ref, 0.99)
    assert_rounding_equal(k_cache, kr_cache, 0.99)  # includes every untouched sentinel row
    assert torch.equal(v_cache, vr_cache)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_any_rows_slots_and_out(dtype):
    """Rows and slots in any order (tree nodes: rows apart from positions), q_out given, caches
    that are planes of one bigger tensor, untouched rows keep their sentinel."""
    g = torch.Generator().manual_seed(5)
    B, T, Hq, Hkv, D, S, L = 3, 3, 6, 2, 24, 4, 12
    q, k, v = _fused_qkv(B, T, Hq, Hkv, D, dtype, "cpu", g, scale=2.0)
    inv_freq = rope_inv_freq(_small_cfg(D))
    positions = torch.randint(0, 100000, (B, T), generator=g)
    slots = torch.tensor([2, 0, 3])
    rows = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)])
    kv = torch.full((4, S, L, Hkv, D), SENTINEL, dtype=dtype)          # like runtime.kv_cache
    k_cache, v_cache = kv[2], kv[3]
    ref_kv = kv.clone()
    q_out = _poisoned((B, T, Hq, D), dtype, "cpu")

    got = rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slots, rows, q_out=q_out)
    q_ref = ref_rope_write(q, k, v, positions, inv_freq, ref_kv[2], ref_kv[3], slots, rows)

    assert got.data_ptr() == q_out.data_ptr()
    assert_rounding_equal(q_out, q_ref, 0.99)
    assert_rounding_equal(kv, ref_kv, 0.99)
    assert (kv[[0, 1]] == SENTINEL).all()
    written = torch.zeros(S, L, dtype=torch.bool)
    written[slots[:, None].expand_as(rows), rows] = True
    assert (kv[2:][:, ~written] == SENTINEL).all()
    assert (kv[2:][:, written] != SENTINEL).any()


@pytest.mark.interpreter
def test_rope_write_kv_into_pages():
    """A paged pool: row r of slot s lands at row r % P of page table[s, r // P], the same values
    the static cache gets, and the torch path's write_kv agrees."""
    g = torch.Generator().manual_seed(7)
    B, T, Hq, Hkv, D, S, L, P = 3, 3, 4, 2, 16, 4, 12, 4
    q, k, v = _fused_qkv(B, T, Hq, Hkv, D, torch.float32, "cpu", g)
    inv_freq = rope_inv_freq(_small_cfg(D))
    positions = torch.randint(0, 1000, (B, T), generator=g)
    slots = torch.tensor([2, 0, 3])
    rows = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)])
    k_cache = torch.full((S, L, Hkv, D), SENTINEL)
    v_cache = torch.full((S, L, Hkv, D), SENTINEL)
    rope_write_kv(q, k, v, positions, inv_freq, k_cache, v_cache, slots, rows)
    table = (torch.randperm(S * L // P, generator=g) + 1).view(S, L // P).to(torch.int32)
    k_pool = torch.full((S * L // P + 1, P, Hkv, D), SENTINEL)
    v_pool = k_pool.clone()
    rope_write_kv(q, k, v, positions, inv_freq, k_pool, v_pool, slots, rows, page_table=table)
    assert torch.equal(k_pool[table.view(-1).long()].view(S, L, Hkv, D), k_cache)
    assert torch.equal(v_pool[table.view(-1).long()].view(S, L, Hkv, D), v_cache)
    meta = AttnMetadata(slots=slots, positions=positions, prefix_lens=torch.zeros(B, dtype=torch.int64),
                        kv_len=L, page_table=table)
    meta.__dict__["_cache_rows"] = rows
    k2, v2 = torch.full_like(k_pool, SENTINEL), torch.full_like(v_pool, SENTINEL)
    write_kv(k2, v2, k.contiguous(), v.contiguous(), meta)
    assert torch.equal(v2, v_pool)


def test_rope_write_kv_empty_and_errors():
    D = 16
    q, k, v = _fused_qkv(2, 1, 4, 2, D, torch.float32, "cpu", torch.Generator().manual_seed(0))
    inv = rope_inv_freq(_small_cfg(D))
    kc = torch.zeros(3, 4, 2, D)
    pos = torch.zeros(2, 1, dtype=torch.int64)
    out = rope_write_kv(q[:0], k[:0], v[:0], pos[:0], inv, kc, kc.clone(), pos[:0, 0], pos[:0])
    assert out.shape == (0, 1, 4, D)
    with pytest.raises(ValueError):
        rope_write_kv(q, k, v, pos, inv[:4], kc, kc.clone(), pos[:, 0], pos)      # inv_freq size
    with pytest.raises(ValueError):
        rope_write_kv(q, k, v, pos, inv, kc[..., :8], kc.clone(), pos[:, 0], pos)  # cache shape
    with pytest.raises(ValueError):
        rope_write_kv(q, k.bfloat16(), v, pos, inv, kc, kc.clone(), pos[:, 0], pos)
