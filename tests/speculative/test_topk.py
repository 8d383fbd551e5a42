"""Draft token selection: exact top-1 (token and real probability) and top-k log-probabilities."""
from __future__ import annotations

import math

import pytest
import torch

from specbatch.speculative.topk import LOG_ZERO, top1, topk_logprobs

LZ = float(torch.tensor(LOG_ZERO, dtype=torch.float32))   # LOG_ZERO as stored in float32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _random_logits(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _check_top1_against_reference(x: torch.Tensor):
    """top1(x) vs softmax of the same (up-cast) values: float32 reference as the brief asks, and a
    float64 one for the tight tolerance (the float32 softmax itself is off by ~1.5e-6 at V=32000)."""
    idx, logp = top1(x)
    assert idx.shape == x.shape[:-1] and logp.shape == x.shape[:-1]
    assert idx.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.isfinite(logp).all()
    ref32 = torch.softmax(x.float(), dim=-1).max(dim=-1)
    ref64 = torch.softmax(x.double(), dim=-1).max(dim=-1)
    assert torch.equal(idx, ref32.indices)
    assert torch.equal(idx, ref64.indices)
    p = logp.double().exp()
    torch.testing.assert_close(p, ref64.values, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.float(), ref32.values, rtol=5e-6, atol=0)
    # and log space against log_softmax
    torch.testing.assert_close(logp.double(), torch.log_softmax(x.double(), -1).max(-1).values,
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 1000), (2, 3, 32000)])
def test_top1_matches_softmax_reference(shape, dtype):
    x = _random_logits(shape, dtype, seed=len(shape) * 10 + DTYPES.index(dtype))
    _check_top1_against_reference(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top1_peaked_and_flat_rows(dtype):
    V = 1000
    x = torch.zeros(4, V)
    x[1, 17] = 5.0                 # one clear winner, prob ~ e^5 / (e^5 + 999)
    x[2, 999] = 20.0               # winner at the last index, prob very close to (but below) 1
    x[3, :] = torch.linspace(-4, 4, V)
    x = x.to(dtype)
    _check_top1_against_reference(x)
    idx, logp = top1(x)
    # a flat row: the first index, probability exactly-ish 1/V, not the constant 1.0
    assert int(idx[0]) == 0
    assert math.isclose(math.exp(float(logp[0])), 1.0 / V, rel_tol=1e-6)
    assert int(idx[1]) == 17 and int(idx[2]) == 999
    assert float(logp[1]) < -1e-3                       # real probability, not 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_top1_ties_take_lowest_index_and_shared_probability(dtype):
    V = 50
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, V, generator=g) - 5.0
    ties = [[3, 7], [0, 49], [10, 11, 12, 40], [48, 49], list(range(V))]
    for r, cols in enumerate(ties):
        x[r, cols] = 2.0
    x = x.to(dtype)
    idx, logp = top1(x)
    assert idx.tolist() == [c[0] for c in ties]
    _check_top1_against_reference(x)
    # every tied maximum shares the same probability: n_ties * p <= 1
    for r, cols in enumerate(ties):
        assert len(cols) * math.exp(float(logp[r])) <= 1.0 + 1e-6
    assert math.isclose(math.exp(float(logp[4])), 1.0 / V, rel_tol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top1_with_neg_inf_entries_and_all_neg_inf_row(dtype):
    inf = float("inf")
    x = torch.tensor([
        [-inf, 1.0, -inf, 0.0, -inf],      # a masked vocabulary
        [-inf, -inf, -inf, -inf, 3.0],     # one finite entry: probability 1
        [-inf, -inf, -inf, -inf, -inf],    # nothing allowed
        [2.0, -inf, 2.0, -inf, -inf],      # tie among the finite ones
    ]).to(dtype)
    idx, logp = top1(x)
    assert not torch.isnan(logp).any()
    assert idx.tolist() == [1, 4, 0, 0]
    assert float(logp[2]) == LZ
    assert float(logp[1]) == 0.0
    assert math.isclose(float(logp[0]), -math.log1p(math.exp(-1.0)), rel_tol=1e-6)
    assert math.isclose(float(logp[3]), -math.log(2.0), rel_tol=1e-6)
    _check_top1_against_reference(x[[0, 1, 3]])


def test_top1_all_neg_inf_in_a_batch_does_not_poison_other_rows():
    x = torch.randn(3, 2, 64)
    x[1, 0] = float("-inf")
    idx, logp = top1(x)
    assert int(idx[1, 0]) == 0 and float(logp[1, 0]) == LZ
    keep = torch.ones(3, 2, dtype=torch.bool)
    keep[1, 0] = False
    ref = torch.softmax(x.double(), -1).max(-1)
    torch.testing.assert_close(logp.double().exp()[keep], ref.values[keep], rtol=1e-6, atol=0)
    assert torch.equal(idx[keep], ref.indices[keep])


def test_top1_huge_magnitudes():
    x = torch.tensor([
        [1e30, 1e30, 0.0, -1e30],          # two huge equal maxima: exactly 0.5 (naive exp(max-lse) = 1)
        [1e30, 1e30, 1e30, 1e30],          # four: exactly 0.25
        [3e38, -3e38, 0.0, 1.0],           # max near float32's limit; x - max overflows to -inf
        [-1e30, -1e30, -1e30, -1e30],      # all hugely negative but finite: 0.25
        [1e30, 1e30 * (1 - 2**-20), 0.0, 0.0],   # separated by ~1e24: probability 1
        [3e38, 3e38, -3e38, -3e38],        # 0.5 at the very edge of the range
    ])
    idx, logp = top1(x)
    assert idx.tolist() == [0, 0, 0, 0, 0, 0]
    p = logp.exp().tolist()
    assert p[0] == 0.5 and p[1] == 0.25 and p[2] == 1.0 and p[3] == 0.25 and p[4] == 1.0
    assert p[5] == 0.5
    assert float(logp[0]) == pytest.approx(-math.log(2), rel=1e-7)
    assert torch.isfinite(logp).all()


def test_top1_huge_magnitudes_bf16():
    x = torch.tensor([[1e30, 1e30, 0.0], [3e38, 3e38, 3e38], [-3e38, -3e38, 1.0]]).to(torch.bfloat16)
    idx, logp = top1(x)
    assert idx.tolist() == [0, 0, 2]
    assert logp.exp().tolist() == pytest.approx([0.5, 1 / 3, 1.0], rel=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 5, 16])
def test_topk_logprobs_matches_log_softmax(dtype, k):
    x = _random_logits((2, 3, 32000), dtype, seed=k)
    idx, lp = topk_logprobs(x, k)
    assert idx.shape == (2, 3, k) and lp.shape == (2, 3, k)
    ref = torch.log_softmax(x.double(), dim=-1)
    ref_vals, ref_idx = ref.topk(k, dim=-1)
    # float32 log_softmax over 32000 entries: a few 1e-6 absolute
    torch.testing.assert_close(lp.double(), ref_vals, rtol=0, atol=5e-6)
    # indices: same set (random float logits: ties are possible after a bf16/f16 cast), and each
    # index's own log-probability is what is reported
    torch.testing.assert_close(ref.gather(-1, idx), lp.double(), rtol=0, atol=5e-6)
    assert (lp[..., :-1] >= lp[..., 1:]).all()                     # best first
    s = idx.sort(-1).values
    assert (s[..., 1:] > s[..., :-1]).all()                         # k distinct tokens
    # the probabilities agree with softmax, and k of them never sum above 1
    p = lp.double().exp()
    torch.testing.assert_close(p, torch.softmax(x.double(), -1).gather(-1, idx), rtol=5e-6, atol=0)
    assert (p.sum(-1) <= 1 + 1e-6).all()


def test_topk_logprobs_mass_sums_to_one_when_k_is_vocab():
    x = _random_logits((4, 37), torch.float32, seed=9)
    idx, lp = topk_logprobs(x, 37)
    torch.testing.assert_close(lp.double().exp().sum(-1), torch.ones(4, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    assert torch.equal(idx.sort(-1).values, torch.arange(37).expand(4, 37))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_k1_is_top1(dtype):
    x = _random_logits((3, 5, 2000), dtype, seed=4)
    x[0, 0, [5, 9]] = 100.0                              # a tie
    x[1, 1] = float("-inf")                              # an all -inf row
    idx, lp = topk_logprobs(x, 1)
    i1, l1 = top1(x)
    assert idx.shape == (3, 5, 1) and lp.shape == (3, 5, 1)
    assert torch.equal(idx[..., 0], i1) and torch.equal(lp[..., 0], l1)
    assert int(idx[0, 0, 0]) == 5 and float(lp[1, 1, 0]) == LZ


def test_topk_logprobs_neg_inf_rows():
    inf = float("inf")
    x = torch.tensor([[-inf, 0.0, -inf, 0.0, -inf, -inf], [-inf] * 6])
    idx, lp = topk_logprobs(x, 3)
    assert not torch.isnan(lp).any()
    assert sorted(idx[0, :2].tolist()) == [1, 3]
    assert lp[0, :2].tolist() == pytest.approx([-math.log(2)] * 2, rel=1e-6)
    assert float(lp[0, 2]) == LZ                    # masked entries: LOG_ZERO, not -inf
    assert (lp[1] == LZ).all()


def test_topk_logprobs_huge_magnitudes():
    x = torch.tensor([[1e30, 0.0, 1e30, -1e30], [3e38, -3e38, 0.0, 3e38]])
    idx, lp = topk_logprobs(x, 2)
    assert sorted(idx[0].tolist()) == [0, 2] and sorted(idx[1].tolist()) == [0, 3]
    assert lp.exp().tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_top1_positive_infinity_takes_the_mass():
    from specbatch.speculative.topk import top1

    idx, logp = top1(torch.tensor([[1.0, float("inf"), float("inf"), 0.0], [float("inf"), 0.0, 0.0, 0.0]]))
    assert idx.tolist() == [1, 0]
    torch.testing.assert_close(logp.exp(), torch.tensor([0.5, 1.0]))
