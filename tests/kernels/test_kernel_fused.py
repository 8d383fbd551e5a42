"""Fused elementwise kernels (kernels/norm.py, activation.py, rope.py) against the torch reference
in specbatch.models.llama, rounding for rounding: bf16 / fp16 bitwise equal in (almost) every
element and never more than 1 ulp off, fp32 within ~1 ulp. CPU runs go through the Triton
interpreter at small, awkward sizes; `-m gpu` runs Llama-3.1-8B shapes and CUDA graphs."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from specbatch import kernels
from specbatch.kernels.activation import silu_mul
from specbatch.kernels.norm import rms_norm
from specbatch.kernels.rope import rope_write_kv
from specbatch.models.attention import AttnMetadata, write_kv
from specbatch.models.config import DecoderConfig
from specbatch.models.llama import RMSNorm, rope_cos_sin, rope_inv_freq, rotate_half

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SENTINEL = 7.0                      # cache rows a kernel must not touch

LLAMA31_8B = DecoderConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
    mlp_bias=False, qk_norm=False, sliding_window=None, torch_dtype="bfloat16")


# ---------------------------------------------------------------------------------------- checks

def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Float bits -> integers in the floats' order (adjacent floats differ by 1, -0 == +0)."""
    if t.dtype == torch.float32:
        bits = t.contiguous().view(torch.int32).to(torch.int64)
        mag = bits & 0x7FFFFFFF
    else:
        bits = t.contiguous().view(torch.int16).to(torch.int64)
        mag = bits & 0x7FFF
    return torch.where(bits < 0, -mag, mag)


def assert_rounding_equal(out: torch.Tensor, ref: torch.Tensor, min_equal: float) -> None:
    """bf16 / fp16: at least `min_equal` of the elements bitwise equal, all within 1 ulp.
    fp32: within rtol 1e-6 (different summation order / libm on CPU)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "kernel left NaNs (unwritten output?)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return
    dist = (_ordered(out) - _ordered(ref)).abs()
    assert int(dist.max()) <= 1, f"max ulp distance {int(dist.max())}"
    equal = float((dist == 0).float().mean())
    assert equal >= min_equal, f"only {equal:.5f} of elements bitwise equal"


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ----------------------------------------------------------------------------- references

def ref_rms_norm(x, weight, eps, residual=None):
    norm = RMSNorm(x.shape[-1], eps).to(device=x.device)
    norm.weight = nn.Parameter(weight.clone(), requires_grad=False)
    with kernels.torch_only():                      # RMSNorm dispatches to the kernel on CUDA
        if residual is None:
            return norm(x)
        s = x + residual
        return norm(s), s


def ref_silu_mul(x):
    i = x.shape[-1] // 2
    return nn.functional.silu(x[..., :i]) * x[..., i:]


def ref_rope_write(q, k, v, positions, inv_freq, k_cache, v_cache, slots, rows):
    cos, sin = rope_cos_sin(inv_freq, positions, q.dtype)
    qr = q * cos + rotate_half(q) * sin
    kr = k * cos + rotate_half(k) * sin
    s = slots[:, None].expand_as(rows)
    k_cache[s, rows] = kr.to(k_cache.dtype)
    v_cache[s, rows] = v.to(v_cache.dtype)
    return qr


def _fused_qkv(B, T, Hq, Hkv, D, dtype, device, gen, scale=1.0):
    """q, k, v as strided views of one [B, T, (Hq + 2 Hkv) * D] GEMM output, like the model."""
    qkv = (torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen) * scale).to(device=device, dtype=dtype)
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, T, Hkv, D)
    v = qkv[..., (Hq + Hkv) * D:].view(B, T, Hkv, D)
    return q, k, v


# ----------------------------------------------------------------------------- CPU: rms_norm

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 48), (5, 48), (3, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(sum(shape))
    H = shape[-1]
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(dtype)
    if not with_residual:
        assert_rounding_equal(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), 0.99)
        return
    r = torch.randn(shape, generator=g).to(dtype)
    y, s = rms_norm(x, w, 1e-5, residual=r)
    ry, rs = ref_rms_norm(x, w, 1e-5, r)
    assert torch.equal(s, rs)                        # the sum is one rounded add: always exact
    assert_rounding_equal(y, ry, 0.99)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided_rows_and_out(dtype):
    g = torch.Generator().manual_seed(1)
    big = (torch.randn(6, 80, generator=g) * 2).to(dtype)
    x = big[:, 8:56]                                # row stride 80, H 48
    r = torch.randn(6, 64, generator=g).to(dtype)[:, :48]
    w = torch.randn(48, generator=g).to(dtype)
    out = _poisoned((6, 64), dtype, "cpu")[:, :48]
    res_out = _poisoned((6, 50), dtype, "cpu")[:, 2:]
    y, s = rms_norm(x, w, 1e-6, residual=r, out=out, residual_out=res_out)
    assert y.data_ptr() == out.data_ptr() and s.data_ptr() == res_out.data_ptr()
    ry, rs = ref_rms_norm(x, w, 1e-6, r)
    assert torch.equal(s, rs)
    assert_rounding_equal(y, ry, 0.99)


def test_rms_norm_weight_promotes_and_errors():
    x = torch.randn(4, 48).to(torch.bfloat16)
    w = torch.randn(48)                             # float32 weight: the reference gives float32
    assert_rounding_equal(rms_norm(x, w, 1e-5), ref_rms_norm(x, w, 1e-5), 1.0)
    assert rms_norm(x[:0], w.bfloat16(), 1e-5).shape == (0, 48)
    with pytest.raises(ValueError):
        rms_norm(x, w[:40], 1e-5)
    with pytest.raises(ValueError):
        rms_norm(x, w.bfloat16(), 1e-5, out=torch.empty(4, 48))       # wrong dtype
    with pytest.raises(ValueError):
        rms_norm(x, w.bfloat16(), 1e-5, residual=torch.randn(4, 48))  # residual dtype


# ----------------------------------------------------------------------------- CPU: silu_mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 96), (5, 80)])
def test_silu_mul_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    assert_rounding_equal(silu_mul(x), ref_silu_mul(x), 0.99)


def test_silu_mul_strided_out_and_blocks():
    g = torch.Generator().manual_seed(2)
    big = (torch.randn(3, 4, 130, generator=g) * 6).to(torch.bfloat16)
    x = big[..., 1:97]                              # strided rows, I = 48
    out = _poisoned((3, 4, 48), torch.bfloat16, "cpu")
    assert silu_mul(x, out=out, block=16).data_ptr() == out.data_ptr()    # 3 blocks per row
    assert_rounding_equal(out, ref_silu_mul(x), 0.99)
    assert silu_mul(x[:0]).shape == (0, 4, 48)
    with pytest.raises(ValueError):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError):
        silu_mul(x, out=torch.empty(3, 4, 48))


# ----------------------------------------------------------------------------- CPU: rope + KV write

def _small_cfg(D: int) -> DecoderConfig:
    return dataclasses.replace(LLAMA31_8B, hidden_size=4 * D, num_heads=4, num_kv_heads=2, head_dim=D)


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


# ----------------------------------------------------------------------------- GPU: real sizes

CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 512])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm(dtype, rows, with_residual):
    g = torch.Generator().manual_seed(rows)
    H = LLAMA31_8B.hidden_size
    x = (torch.randn(rows, H, generator=g) * 2).to(CUDA, dtype)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(CUDA, dtype)
    out = _poisoned((rows, H), dtype, CUDA)
    if not with_residual:
        rms_norm(x, w, 1e-5, out=out)
        assert_rounding_equal(out, ref_rms_norm(x, w, 1e-5), 0.999)
        return
    r = torch.randn(rows, H, generator=g).to(CUDA, dtype)
    s = _poisoned((rows, H), dtype, CUDA)
    rms_norm(x, w, 1e-5, residual=r, out=out, residual_out=s)
    ry, rs = ref_rms_norm(x, w, 1e-5, r)
    assert torch.equal(s, rs)
    assert_rounding_equal(out, ry, 0.999)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 512])
def test_gpu_silu_mul(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    I = LLAMA31_8B.intermediate_size
    x = (torch.randn(rows, 2 * I, generator=g) * 3).to(CUDA, dtype)
    out = _poisoned((rows, I), dtype, CUDA)
    silu_mul(x, out=out)
    assert_rounding_equal(out, ref_silu_mul(x), 0.999)


def _gpu_rope_case(B, T, dtype, seed):
    cfg = LLAMA31_8B
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D, L = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 64
    q, k, v = _fused_qkv(B, T, Hq, Hkv, D, dtype, CUDA, g, scale=2.0)
    positions = torch.randint(0, 100000, (B, T), generator=g).to(CUDA)
    slots = torch.randperm(B + 1, generator=g)[:B].to(CUDA)
    rows = torch.stack([torch.randperm(L, generator=g)[:T] for _ in range(B)]).to(CUDA)
    caches = [torch.full((B + 1, L, Hkv, D), SENTINEL, dtype=dtype, device=CUDA) for _ in range(2)]
    return q, k, v, positions, rope_inv_freq(cfg).to(CUDA), caches, slots, rows


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (64, 8), (3, 8)])
def test_gpu_rope_write_kv(dtype, B, T):
    q, k, v, pos, inv, (kc, vc), slots, rows = _gpu_rope_case(B, T, dtype, seed=B * 10 + T)
    rkc, rvc = kc.clone(), vc.clone()
    q_out = _poisoned(q.shape, dtype, CUDA)
    rope_write_kv(q, k, v, pos, inv, kc, vc, slots, rows, q_out=q_out)
    q_ref = ref_rope_write(q, k, v, pos, inv, rkc, rvc, slots, rows)
    assert_rounding_equal(q_out, q_ref, 0.999)
    assert_rounding_equal(kc, rkc, 0.999)
    assert torch.equal(vc, rvc)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_inputs():
    """Each wrapper captured once, inputs changed in place, replayed: outputs follow the inputs."""
    dtype, H, I, eps = torch.bfloat16, LLAMA31_8B.hidden_size, LLAMA31_8B.intermediate_size, 1e-5
    g = torch.Generator().manual_seed(0)
    R = 16
    x = torch.randn(R, H, generator=g).to(CUDA, dtype)
    res = torch.randn(R, H, generator=g).to(CUDA, dtype)
    w = (1 + 0.2 * torch.randn(H, generator=g)).to(CUDA, dtype)
    gu = torch.randn(R, 2 * I, generator=g).to(CUDA, dtype)
    q, k, v, pos, inv, (kc, vc), slots, rows = _gpu_rope_case(4, 2, dtype, seed=1)
    y, s, a, qo = (torch.empty(R, H, dtype=dtype, device=CUDA), torch.empty(R, H, dtype=dtype, device=CUDA),
                   torch.empty(R, I, dtype=dtype, device=CUDA), torch.empty(q.shape, dtype=dtype, device=CUDA))
    y0 = torch.empty_like(y)

    def step():
        rms_norm(x, w, eps, out=y0)
        rms_norm(x, w, eps, residual=res, out=y, residual_out=s)
        silu_mul(gu, out=a)
        rope_write_kv(q, k, v, pos, inv, kc, vc, slots, rows, q_out=qo)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                      # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for t in (x, res, gu, q, k, v):                 # q, k, v: views of one buffer, written in place
        t.copy_(torch.randn(t.shape, generator=g).to(CUDA, dtype))
    pos.copy_(torch.randint(0, 100000, pos.shape, generator=g))
    slots.copy_(slots.flip(0))
    rows.copy_(rows.flip(1))
    for t in (y0, y, s, a, qo):
        t.fill_(float("nan"))
    rkc, rvc = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()

    assert_rounding_equal(y0, ref_rms_norm(x, w, eps), 0.999)
    ry, rs = ref_rms_norm(x, w, eps, res)
    assert torch.equal(s, rs)
    assert_rounding_equal(y, ry, 0.999)
    assert_rounding_equal(a, ref_silu_mul(gu), 0.999)
    q_ref = ref_rope_write(q, k, v, pos, inv, rkc, rvc, slots, rows)
    assert_rounding_equal(qo, q_ref, 0.999)
    assert_rounding_equal(kc, rkc, 0.999)
    assert torch.equal(vc, rvc)
