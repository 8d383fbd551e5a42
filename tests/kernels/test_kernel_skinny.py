"""kernels/skinny.py: few-row linear layers (decode / verify at small batches) against torch,
on the CPU through the Triton interpreter at awkward sizes, and on the GPU at Llama shapes: the
same values as cuBLAS within bf16 rounding, each row independent of the others (a verify's rows
equal plain steps' rows), graph-capturable, and the model takes it only where it serves."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specbatch import kernels
from specbatch.kernels import skinny
from specbatch.kernels.skinny import MAX_ROWS, NARROW, WIDE, serves, skinny_linear, tile
from specbatch.models.llama import linear

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _case(M: int, N: int, K: int, dtype: torch.dtype, device="cpu", lead=()):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(*lead, M, K, generator=g).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(device)
    return x, w


@pytest.mark.interpreter
@pytest.mark.parametrize("M,N,K", [(1, 48, 600), (3, 40, 1100), (16, 96, 512), (5, 33, 70)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_interpreter(M, N, K, dtype):
    x, w = _case(M, N, K, dtype)
    got = skinny_linear(x, w)
    want = (x.float() @ w.float().t()).to(dtype)
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.interpreter
def test_leading_dims_strided_rows_and_row_independence_interpreter():
    x, w = _case(6, 40, 300, torch.float16, lead=(2,))             # [2, 6, 300]: 12 rows
    wide = torch.zeros(2, 6, 400, dtype=torch.float16)
    wide[..., :300] = x
    got = skinny_linear(wide[..., :300], w)                        # rows strided by 400
    assert got.shape == (2, 6, 40)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()), atol=2e-2, rtol=2e-2)
    # a row's result does not depend on the rows beside it
    assert torch.equal(skinny_linear(x[1, 2:3], w)[0], got[1, 2])


@pytest.mark.interpreter
def test_tile_follows_the_output_width_and_the_wide_tile_interpreter(monkeypatch):
    """Past one wave of narrow programs the wide tile: chosen by N and the GPU, never by M, and
    the same values and row independence as the narrow one."""
    monkeypatch.setattr(skinny, "_sm_count", lambda device: 3)     # a 3-SM GPU: 3 narrow programs a wave
    dev = torch.device("cpu")
    assert tile(3 * NARROW[0], dev) == NARROW and tile(3 * NARROW[0] + 1, dev) == WIDE
    x, w = _case(5, 3 * NARROW[0] + 40, 2 * WIDE[1] + 70, torch.bfloat16)    # ragged N and K tails
    got = skinny_linear(x, w)
    torch.testing.assert_close(got.float(), (x.float() @ w.float().t()), atol=2e-2, rtol=2e-2)
    for i in range(5):
        assert torch.equal(skinny_linear(x[i: i + 1], w)[0], got[i])


def test_refuses_what_it_does_not_serve():
    x, w = _case(MAX_ROWS + 1, 8, 32, torch.float16)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(x, w)
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear(x[:2], w[:, :16])
    assert serves(x[:MAX_ROWS], w, None)
    assert not serves(x, w, None)                                   # too many rows
    assert not serves(x[:2], w, torch.zeros(8, dtype=torch.float16))  # a bias
    assert not serves(x[:2].float(), w.float(), None)                # fp32: torch's own path
    assert not serves(x[:2], w[:, :16], None)                       # shapes that do not match


def test_linear_stays_on_torch_off_the_gpu():
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), nn.functional.linear(x, w))    # CPU: torch itself


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("N,K", [(4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096), (128256, 4096)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gpu_matches_cublas_and_rows_are_independent(M, N, K):
    x, w = _case(M, N, K, torch.bfloat16, "cuda")
    got = skinny_linear(x, w)
    ref = x.float() @ w.float().t()
    blas = nn.functional.linear(x, w)
    # both round an fp32 sum to bf16: within a unit or two of the last place of each other
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=1.6e-2)
    assert (got.float() - blas.float()).abs().max() <= (blas.float() - ref).abs().max() * 2 + 1e-2
    for i in range(M):
        assert torch.equal(skinny_linear(x[i: i + 1], w)[0], got[i])


@pytest.mark.gpu
@CUDA
def test_gpu_graph_replay_follows_inputs_and_model_dispatch():
    x, w = _case(4, 4096, 4096, torch.bfloat16, "cuda")
    out = skinny_linear(x, w)                                       # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny_linear(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), atol=3e-2, rtol=1.6e-2)
    F = nn.functional
    assert torch.equal(linear(x, w), skinny_linear(x, w))            # a few rows: the kernel
    with kernels.torch_only():
        assert torch.equal(linear(x, w), F.linear(x, w))             # switched off: torch
    big = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(big, w), F.linear(big, w))             # many rows: cuBLAS
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, bias), F.linear(x, w, bias))     # a bias: cuBLAS
