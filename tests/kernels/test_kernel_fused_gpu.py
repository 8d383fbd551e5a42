"""The fused elementwise kernels (rms_norm, silu_mul, RoPE + KV write) on the GPU (`-m gpu`) at
Llama-3.1-8B shapes, and each captured in a CUDA graph whose replays follow their inputs."""
from __future__ import annotations

import pytest
import torch

from specbatch.kernels.activation import silu_mul
from specbatch.kernels.norm import rms_norm
from specbatch.kernels.rope import rope_write_kv
from specbatch.models.llama import rope_inv_freq

from kernel_fused_helpers import (LLAMA31_8B, SENTINEL, _fused_qkv, _poisoned, assert_rounding_equal, ref_rms_norm,
                                  ref_rope_write, ref_silu_mul)


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
