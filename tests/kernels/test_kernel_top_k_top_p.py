"""Top-k / top-p without a sort (kernels/top_k_top_p.py) against the stable-sort reference of
`specbatch.sampling.apply_top_k_top_p`: the same kept set for every row, ties at either threshold
kept in index order, -inf and -0.0 entries, rows with neither filter. Masses are summed in another
order than the reference's cumsum, so an entry whose exclusive mass is within rounding of top_p may
go either way: `_same_kept_set` allows that and nothing else. CPU runs go through the Triton
interpreter at small sizes; `-m gpu` runs real vocabularies and a CUDA graph."""
from __future__ import annotations

import pytest
import torch

import specbatch.kernels as kernels
import specbatch.kernels.top_k_top_p as tkp
from specbatch.kernels.top_k_top_p import top_k_top_p
from specbatch.params import SamplingParams
from specbatch.sampling import BatchSampling, apply_top_k_top_p

NEG = float("-inf")


def _reference(x, k, p):
    with kernels.torch_only():
        return apply_top_k_top_p(x, k, p)


def _same_kept_set(got: torch.Tensor, x: torch.Tensor, k: torch.Tensor, p: torch.Tensor, tol: float = 1e-5):
    """Kept entries keep their logits, dropped ones are -inf, and the kept set is the reference's
    except for entries whose exclusive mass (float64, stable order) is within `tol` of top_p."""
    ref = _reference(x, k, p)
    assert torch.equal(torch.where(got > NEG, got, 0.0), torch.where(got > NEG, x, 0.0))
    differ = (got > NEG) != (ref > NEG)
    for r in differ.any(dim=1).nonzero()[:, 0].tolist():
        xs, order = x[r].double().sort(descending=True, stable=True)
        if 0 < int(k[r]) < xs.numel():
            xs[int(k[r]):] = NEG
        probs = xs.softmax(dim=0)
        excl = probs.cumsum(0) - probs
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        for i in differ[r].nonzero()[:, 0].tolist():
            assert abs(float(excl[rank[i]]) - float(p[r])) < tol, (r, i, float(excl[rank[i]]), float(p[r]))
    return int(differ.sum())


def _logits(R: int, V: int, seed: int, device, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, V, generator=g) * scale).to(torch.bfloat16).float()     # bf16 values: many ties
    if R > 2:
        x[2, : V // 3] = NEG                                                   # min-p masked entries
    if R > 3:
        x[3] = 0.0
        x[3, ::2] = -0.0                                                      # one value, both zeros
    return x.to(device)


def _params(R: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    ks = [0, 1, 5, 40, 0, 0, 3, 100000][: R] + torch.randint(0, 90, (max(0, R - 8),), generator=g).tolist()
    ps = [0.9, 1.0, 0.5, 0.3, 1.0, 0.999, 0.05, 0.95][: R] + torch.rand(max(0, R - 8), generator=g).tolist()
    return (torch.tensor(ks, dtype=torch.int64, device=device),
            torch.tensor(ps, dtype=torch.float32, device=device))


@pytest.mark.interpreter
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])          # 0: every top-k by the radix descent
@pytest.mark.parametrize("R, V, seed", [(8, 1000, 0), (8, 257, 1), (3, 40, 2), (1, 5, 3), (12, 300, 4)])
def test_interpreted_filter_keeps_the_reference_set(R, V, seed, kcap, monkeypatch):
    monkeypatch.setattr(tkp, "KCAP", kcap)
    x = _logits(R, V, seed, "cpu")
    k, p = _params(R, seed, "cpu")
    assert _same_kept_set(top_k_top_p(x, k, p), x, k, p) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])
def test_ties_at_either_threshold_are_kept_in_index_order(kcap, monkeypatch):
    monkeypatch.setattr(tkp, "KCAP", kcap)
    # top-k 2 over [1, 2, 2, 2, 0]: the first two 2s; top-p 0.3 over 8 equal logits (mass j/8
    # exact): the first three; top-k 4 then top-p 0.5 over 8 equal: 4 kept, mass j/4 -> two
    x = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, NEG, NEG, NEG]] + [[0.5] * 8] * 2)
    k = torch.tensor([2, 0, 4])
    p = torch.tensor([1.0, 0.3, 0.5])
    got = top_k_top_p(x, k, p)
    assert (got > NEG).tolist() == [[False, True, True, False, False, False, False, False],
                                    [True, True, True, False, False, False, False, False],
                                    [True, True, False, False, False, False, False, False]]
    assert torch.equal(got, _reference(x, k, p))


@pytest.mark.interpreter
def test_rows_without_a_filter_are_copied_and_the_top_entry_always_stays():
    x = torch.tensor([[3.0, -0.0, 7.5, NEG, 7.5], [0.0, 9.0, 1.0, 2.0, 3.0]])
    got = top_k_top_p(x, torch.tensor([0, 0]), torch.tensor([1.0, 1e-6]))
    assert torch.equal(got[0], x[0])
    assert (got[1] > NEG).tolist() == [False, True, False, False, False]


@pytest.mark.interpreter
def test_top_p_zero_keeps_the_first_top_entry_alone():
    # a top_p below float32's least denormal (1e-46 passes `0 < top_p`) is 0 on the device: the
    # reference keeps rank 0 alone (exclusive mass 0 >= 0 drops the rest); the descent's limit is 0
    x = torch.tensor([[0.0, 9.0, 1.0, 2.0, 9.0], [0.5] * 5, [NEG, 1.0, 3.0, NEG, 2.0]])
    k = torch.tensor([0, 0, 2])
    p = torch.tensor([1e-46, 0.0, 0.0], dtype=torch.float32)
    got = top_k_top_p(x, k, p)
    assert (got > NEG).tolist() == [[False, True, False, False, False], [True, False, False, False, False],
                                    [False, False, True, False, False]]
    assert torch.equal(got, _reference(x, k, p))


def test_the_batch_sampling_filter_uses_the_kernel_only_on_cuda():
    x = _logits(4, 300, 5, "cpu")
    sp = BatchSampling.build([SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=i) for i in range(4)],
                             torch.device("cpu"))
    assert not kernels.active(x)
    assert torch.equal(sp.target_logits(x), torch.where(sp.temperature[:, None] > 0, _reference(
        x / sp.temperature[:, None], sp.top_k, sp.top_p), x))


@pytest.mark.gpu
@pytest.mark.parametrize("kcap", [0, tkp.KCAP])
@pytest.mark.parametrize("R, V", [(1, 128256), (64, 128256), (512, 128256), (9, 32000), (300, 151936)])
def test_cuda_filter_keeps_the_reference_set(R, V, kcap, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setattr(tkp, "KCAP", kcap)
    for seed in range(3):
        for scale in (0.5, 3.0, 12.0):             # 0.5: near-uniform rows, ~1 entry within 1e-5 of top_p
            x = _logits(R, V, seed, "cuda", scale)
            k, p = _params(R, seed, "cuda")
            _same_kept_set(top_k_top_p(x, k, p), x, k, p)


@pytest.mark.gpu
def test_cuda_filter_replays_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    x = _logits(64, 128256, 7, "cuda")
    k, p = _params(64, 7, "cuda")
    out = top_k_top_p(x, k, p)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = top_k_top_p(x, k, p)
    x.copy_(_logits(64, 128256, 8, "cuda"))
    g.replay()
    assert torch.equal(got, top_k_top_p(x, k, p))
    assert not torch.equal(got, out)
