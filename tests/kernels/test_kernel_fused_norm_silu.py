"""Fused rms_norm (kernels/norm.py, with the residual add) and silu_mul (kernels/activation.py) against
the torch reference in specbatch.models.llama, rounding for rounding, on the CPU through the Triton
interpreter at small, awkward sizes: strided rows, given outputs, several blocks a row, errors."""
from __future__ import annotations

import pytest
import torch

from specbatch.kernels.activation import silu_mul
from specbatch.kernels.norm import rms_norm

from kernel_fused_helpers import DTYPES, _poisoned, assert_rounding_equal, ref_rms_norm, ref_silu_mul


# ----------------------------------------------------------------------------- CPU: rms_norm

@pytest.mark.interpreter
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


@pytest.mark.interpreter
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


@pytest.mark.interpreter
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

@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 96), (5, 80)])
def test_silu_mul_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    assert_rounding_equal(silu_mul(x), ref_silu_mul(x), 0.99)


@pytest.mark.interpreter
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
