"""Fused Triton top-1 against the torch reference (specbatch.speculative.topk.top1): exact indices,
float32 log-probabilities, ties, -inf / +inf / NaN rows, split layouts, `out=` and CUDA graphs.
CPU runs go through the Triton interpreter at small sizes; `-m gpu` runs real vocabularies."""
from __future__ import annotations

import pytest
import torch

from specbatch.kernels.counters import _buffers
from specbatch.kernels.top1 import plan, top1
from specbatch.speculative.topk import LOG_ZERO
from specbatch.speculative.topk import top1 as ref_top1

# The interpreter evaluates both sides of tl.where: inf - inf there is expected and discarded.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")

CUDA = torch.device("cuda")
LZ = float(torch.tensor(LOG_ZERO, dtype=torch.float32))
# logp tolerance: float32 arithmetic whatever the input dtype; on GPU exp / log are the hardware
# approximations (ex2.approx, lg2.approx), ~2 ulp each, over sums of ~1e5 terms.
ATOL = {"cpu": 1e-6, "cuda": 2e-6}


def _planted(R: int, V: int, dtype: torch.dtype, seed: int, block: int) -> torch.Tensor:
    """Random rows plus the hard cases: ties across lanes / tiles / splits, -inf rows, +inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3
    big = 40.0
    at = lambda *i: torch.tensor([k % V for k in i])
    specials = [
        lambda r: r.index_fill_(0, at(V - 1, 3, block + 3, V // 2), big),   # ties: first is 3
        lambda r: r.fill_(float("-inf")),                                             # all -inf
        lambda r: r.index_fill_(0, at(V - 2, block + 1), float("inf")),   # two +inf
        lambda r: r.fill_(float("-inf")).index_fill_(0, at(V - 1), -5.0),  # one finite
        lambda r: r.fill_(1.5),                                                       # flat: all tie
        lambda r: r.masked_fill_(torch.rand(V, generator=g) < 0.5, float("-inf")),     # half -inf
        lambda r: r.index_fill_(0, at(block - 1, block), big),            # tie at a tile edge
    ]
    for i, f in enumerate(specials[: R - 1]):
        f(x[i + 1])
    return x.to(dtype)


def _check(x: torch.Tensor, idx: torch.Tensor, logp: torch.Tensor) -> None:
    ri, rl = ref_top1(x.cpu())
    assert idx.dtype == torch.int64 and logp.dtype == torch.float32
    assert torch.equal(idx.cpu(), ri)
    torch.testing.assert_close(logp.cpu(), rl, rtol=0, atol=ATOL[idx.device.type])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,V,block,splits", [
    (8, 1000, 128, None),     # default split plan: several splits of several tiles
    (8, 777, 128, 3),         # V not a multiple of 16 or of the block
    (3, 1000, 128, 1),        # one program per row, no partials
    (8, 300, 4096, None),     # block clipped to the vocabulary
])
@pytest.mark.interpreter
def test_top1_matches_reference(dtype, R, V, block, splits):
    x = _planted(R, V, dtype, seed=R + V, block=block)
    _check(x, *top1(x, splits, block=block))


@pytest.mark.interpreter
@pytest.mark.parametrize("splits", [1, 3, 1000])
def test_top1_any_split_count(splits):
    x = _planted(8, 1000, torch.float32, seed=splits, block=128)
    _check(x, *top1(x, splits, block=128))
    assert int(_buffers[("top1", x.device)][-1].abs().sum()) == 0    # reset for the next launch


def test_split_plan_fills_and_clips():
    cpu = torch.device("cpu")
    assert plan(1, 128256, cpu, block=4096) == (4096, 16, 1)          # 4 "SMs" x 4 programs
    assert plan(64, 1000, cpu, num_splits=1000, block=128)[1] == 4     # at most one per 2 blocks
    assert plan(1, 10**7, cpu, num_splits=1000, block=128)[1] == 64    # MAX_SPLITS
    assert plan(64, 100, cpu, block=4096) == (64, 1, 1)               # block clipped to V / 2


@pytest.mark.interpreter
def test_strided_rows_out_and_empty():
    big = torch.randn(4, 600) * 2
    x = big[:, :500]                                        # row stride 600
    idx = torch.full((4,), -7, dtype=torch.int64)
    logp = torch.full((4,), float("nan"))
    res = top1(x, 3, out=(idx, logp), block=64)
    assert res[0] is idx and res[1] is logp
    _check(x, idx, logp)
    i0, l0 = top1(torch.empty(0, 50))
    assert i0.shape == (0,) and l0.shape == (0,)
    with pytest.raises(ValueError):
        top1(big.t())


@pytest.mark.interpreter
def test_nan_documented_behaviour():
    x = torch.randn(3, 400)
    x[0, 10] = float("nan")
    x[0, 20] = 50.0
    x[1] = float("nan")
    x[2, 5] = float("nan")
    x[2, 6] = float("inf")
    idx, logp = top1(x, 2, block=64)
    assert idx.tolist() == [20, 0, 6]                       # largest non-NaN; all-NaN -> 0
    assert logp.tolist() == [LZ, LZ, LZ]                    # as the reference


# ---------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,V", [(64, 128256), (7, 32000), (1, 128256), (300, 32000), (256, 128256)])
def test_top1_gpu_real_sizes(dtype, R, V):
    x = _planted(R, V, dtype, seed=R, block=4096).to(CUDA)
    idx = torch.full((R,), -12345, dtype=torch.int64, device=CUDA)
    logp = torch.full((R,), float("nan"), device=CUDA)
    for _ in range(2):                                      # second run: counters were reset
        idx.fill_(-12345)
        logp.fill_(float("nan"))
        top1(x, out=(idx, logp))
        torch.cuda.synchronize()
        _check(x, idx, logp)
    for splits in (1, 3, 64):
        _check(x, *top1(x, splits))


@pytest.mark.gpu
def test_top1_gpu_cuda_graph_replay():
    R, V = 64, 128256
    x = _planted(R, V, torch.bfloat16, seed=1, block=4096).to(CUDA)
    idx = torch.empty(R, dtype=torch.int64, device=CUDA)
    logp = torch.empty(R, device=CUDA)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        top1(x, out=(idx, logp))                             # compile and allocate outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        top1(x, out=(idx, logp))
    for seed in range(2, 6):
        x.copy_(_planted(R, V, torch.bfloat16, seed=seed, block=4096).to(CUDA))
        idx.fill_(-1)
        logp.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(x, idx, logp)
