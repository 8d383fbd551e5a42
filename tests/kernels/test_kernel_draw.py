"""Fused seeded draw (kernels/draw.py) against the torch race of `specbatch.sampling.draw`: the
same token for every row, split layout, tie and zero-mass case. CPU runs go through the Triton
interpreter at small sizes; `-m gpu` runs real vocabularies, bit for bit, and inside a CUDA graph."""
from __future__ import annotations

import pytest
import torch

import specbatch.kernels as kernels
from specbatch.kernels.draw import draw_race
from specbatch.params import SamplingParams
from specbatch.sampling import BatchSampling, draw, row_keys, uniforms


def _reference(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    u = uniforms(keys, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(dim=-1)


def _probs(R: int, V: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(R, V, generator=g) * 2).softmax(dim=-1)
    p[0, : V // 2] = 0.0                                      # half the vocabulary filtered out
    if R > 1:
        p[1] = 0.0                                            # no mass at all: index 0, as argmax
    if R > 2:
        p[2] = 1.0 / V                                        # flat: the hash alone decides
    if R > 3:
        p[3] = 0.0
        p[3, V - 1] = 1.0                                     # one token: it, at the last index
    return p.to(device)


def _keys(R: int, seed: int, device) -> torch.Tensor:
    sp = BatchSampling.build([SamplingParams(temperature=1.0, seed=seed * 1000 + i) for i in range(R)], device)
    return row_keys(sp.seed_lo, sp.seed_hi, torch.arange(R, device=device) + 17)


@pytest.mark.interpreter
@pytest.mark.parametrize("R, V, splits", [(5, 3000, None), (6, 4099, 1), (4, 5000, 3), (1, 257, None)])
def test_interpreted_draw_equals_the_torch_race(R, V, splits):
    probs, keys = _probs(R, V, seed=R + V, device="cpu"), _keys(R, 3, "cpu")
    assert draw_race(probs, keys, num_splits=splits).tolist() == _reference(probs, keys).tolist()


def test_draw_uses_the_kernel_only_on_cuda():
    probs, keys = _probs(3, 300, 1, "cpu"), _keys(3, 1, "cpu")
    sp = BatchSampling.build([SamplingParams(temperature=1.0, seed=1000 + i) for i in range(3)], torch.device("cpu"))
    assert not kernels.active(probs)
    assert draw(probs, sp, torch.arange(3) + 17).tolist() == _reference(probs, keys).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("R, V", [(1, 128256), (64, 128256), (512, 128256), (7, 32000), (300, 151936)])
def test_cuda_draw_equals_the_torch_race_bit_for_bit(R, V):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for seed in range(3):
        probs, keys = _probs(R, V, seed, "cuda"), _keys(R, seed, "cuda")
        assert torch.equal(draw_race(probs, keys), _reference(probs, keys)), (R, V, seed)
        bf = probs.to(torch.bfloat16)
        assert torch.equal(draw_race(bf, keys), _reference(bf.float(), keys)), (R, V, seed, "bf16")


@pytest.mark.gpu
def test_cuda_draw_in_a_graph_replays_new_inputs():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    probs, keys = _probs(64, 128256, 0, "cuda"), _keys(64, 0, "cuda")
    out = draw_race(probs, keys)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = draw_race(probs, keys)
    for seed in (1, 2):
        probs.copy_(_probs(64, 128256, seed, "cuda"))
        keys.copy_(_keys(64, seed, "cuda"))
        g.replay()
        assert torch.equal(out, _reference(probs, keys))
