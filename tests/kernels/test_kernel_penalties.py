"""The penalties kernel (kernels/penalties.py) against processors.dense_penalties' torch form:
the same float32 values bit for bit, rows read by slot, several blocks a row, extreme penalties,
-inf and huge logits. CPU runs go through the Triton interpreter; `-m gpu` runs 128,256 entries
and the whole processors pass under a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from specbatch import kernels
from specbatch.kernels.penalties import BLOCK, penalties
from specbatch.params import SamplingParams
from specbatch.processors import Processors, dense_penalties

# The interpreter evaluates both sides of tl.where: x / r overflowing where it is discarded is expected.
pytestmark = pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")


def _inputs(B: int, N: int, V: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, V, generator=g) * 4
    x[0, 0, :7] = torch.tensor([float("-inf"), 3e38, -3e38, 0.0, -0.0, 1e-30, float("inf")])
    S = B + 3
    counts = torch.randint(0, 3, (S, V), generator=g, dtype=torch.int32) * (torch.rand(S, V, generator=g) < 0.3)
    prompt_mask = torch.rand(S, V, generator=g) < 0.2
    slots = torch.randperm(S, generator=g)[:B]
    # repetition: plain, below 1, 1 (off), a denormal and huge (x / r and x * r leave float32's range)
    rep = torch.tensor([1.3, 0.6, 1.0, 1e-45, 1e30, 2.0])[torch.arange(B) % 6]
    freq = torch.randn(B, generator=g)
    pres = torch.randn(B, generator=g)
    t = lambda v: v.to(device)
    return t(x.to(dtype)), t(counts.to(torch.int32)), t(prompt_mask), t(slots), t(rep), t(freq), t(pres)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,N,V", [(6, 1, 300), (3, 4, 2 * BLOCK + 5)])
def test_penalties_kernel_equals_torch(dtype, B, N, V):
    args = _inputs(B, N, V, dtype, "cpu")
    want = dense_penalties(*args)                 # CPU tensors: the torch form
    got = penalties(*args)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.isneginf(got[0, 0, 0]) and torch.isfinite(got[0, 0, 1:6]).all()


@pytest.mark.interpreter
def test_penalties_kernel_strided_logits():
    x, *rest = _inputs(4, 2, 700, torch.bfloat16, "cpu")
    wide = torch.zeros(4, 3, 700, dtype=torch.bfloat16)
    wide[:, ::2] = x                                        # node stride 2 rows of V
    view = wide[:, ::2]
    assert torch.equal(penalties(view, *rest), dense_penalties(x, *rest))


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(512, 1), (64, 4), (3, 2)])
def test_penalties_kernel_gpu(B, N):
    args = _inputs(B, N, 128256, torch.bfloat16, "cuda", seed=B)
    with kernels.torch_only():
        want = dense_penalties(*args)
    assert torch.equal(penalties(*args), want)


@pytest.mark.gpu
def test_processors_pass_gpu_graph_equals_torch():
    """min_tokens, logit_bias and penalties over a 4-node chain at 128,256 entries: the kernel path
    replayed from a CUDA graph equals the torch path."""
    dev = torch.device("cuda")
    B, N, V = 32, 4, 128256
    x, counts, prompt_mask, slots, *_ = _inputs(B, N, V, torch.bfloat16, "cuda", seed=3)
    params = [SamplingParams(min_tokens=9, stop_token_ids=(7, 11), logit_bias={11: 4.0, 200: -2.0},
                             repetition_penalty=1.2, frequency_penalty=0.3),
              SamplingParams(presence_penalty=0.5, logit_bias={5: 1.0}), SamplingParams()]
    proc = Processors.build([(params[b % 3], 10) for b in range(B)], [2], V, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    tokens = torch.randint(0, 300, (B, N), device=dev, generator=g)
    depths = torch.arange(N, device=dev).expand(B, N)
    generated = torch.randint(0, 12, (B,), device=dev, generator=g)
    args = (x, depths, generated, tokens, None, (counts, prompt_mask, slots))
    with kernels.torch_only():
        want = proc.apply(*args)
    out = proc.apply(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = proc.apply(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
