"""Logits processors (min_tokens, logit_bias, penalties) at every node of a tree, against a plain
float64 reference that rebuilds each node's history (committed tokens + the path) from scratch;
min-p with temperature and top-k / top-p; the logprobs of the sampled distribution."""
from __future__ import annotations


import pytest
import torch

from specbatch.params import SamplingParams
from specbatch.processors import Processors, count_tokens, processors_key, reset_slots
from specbatch.sampling import BatchSampling
from specbatch.speculative.tree import ancestor_mask

from processors_helpers import law, processed

V = 12
EOS = (0,)


PARAMS = [
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, repetition_penalty=1.6),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(min_tokens=5, stop_token_ids=(3, 40)),            # 40: outside the vocabulary
    SamplingParams(logit_bias=((2, 3.5), (7, -100.0), (9, 0.25))),
    SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=(5,), logit_bias=((5, 2.0),),
                   frequency_penalty=1.5),
    SamplingParams(),                                                 # nothing: logits unchanged
    # stop, biased (an id twice: the biases add) and path ids all the same few: every entry recomputed once
    SamplingParams(min_tokens=6, stop_token_ids=(1, 2), logit_bias=((1, 5.0), (2, -1.5), (4, 2.0), (4, 1.0)),
                   repetition_penalty=1.3, presence_penalty=0.2),
]


def _tree(B: int, N: int, g: torch.Generator):
    """Random trees (parents before children) with repeated tokens."""
    parents = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        for i in range(1, N):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=g))
    depths = torch.zeros(B, N, dtype=torch.int64)
    for i in range(1, N):
        depths[:, i] = depths.gather(1, parents[:, i: i + 1])[:, 0] + 1
    tokens = torch.randint(0, 6, (B, N), generator=g)                  # few ids: many repeats
    return parents, depths, tokens


def _case(shape: str, dtype=torch.float32):
    """PARAMS' rows at N = 7 nodes (a chain or random trees), each with a prompt and a generated
    history: (proc, apply's arguments, prompts, histories, parents)."""
    g = torch.Generator().manual_seed(0)
    B, N = len(PARAMS), 7
    if shape == "tree":
        parents, depths, tokens = _tree(B, N, g)
        mask = ancestor_mask(parents, N)
    else:
        parents = (torch.arange(N) - 1).expand(B, N)
        depths = torch.arange(N).expand(B, N)
        tokens = torch.randint(0, 6, (B, N), generator=g)
        mask = None
    prompts = [torch.randint(0, V, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(B)]
    history = [torch.randint(0, 6, (k,), generator=g).tolist() + [int(tokens[b, 0])]      # ends with the root
               for b, k in enumerate([0, 3, 1, 2, 2, 4, 3])]
    rows = [(p, len(pr)) for p, pr in zip(PARAMS, prompts)]
    proc = Processors.build(rows, EOS, V, torch.device("cpu"))
    counts = torch.zeros(B + 2, V, dtype=torch.int32)
    prompt_mask = torch.zeros(B + 2, V, dtype=torch.bool)
    slots = torch.randperm(B + 2, generator=g)[:B]          # the batch's rows sit in other slots
    T = max(map(len, prompts))
    ids = torch.tensor([pr + [0] * (T - len(pr)) for pr in prompts])
    reset_slots(counts, prompt_mask, slots, ids, torch.tensor([len(pr) for pr in prompts]))
    for b, h in enumerate(history):
        count_tokens(counts, slots[b: b + 1], torch.tensor([h]), torch.tensor([len(h)]))
    raw = (torch.randn(B, N, V, generator=g) * 3).to(dtype)
    raw[0, 1, 5] = float("-inf")                              # a masked entry stays masked
    generated = torch.tensor([len(h) for h in history])
    args = (raw, depths, generated, tokens, mask, (counts, prompt_mask, slots))
    return proc, args, prompts, history, parents


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_every_node_sees_its_own_path(shape):
    proc, args, prompts, history, parents = _case(shape)
    raw, tokens = args[0], args[3]
    B, N, _ = raw.shape
    out = proc.apply(*args)
    for b in range(B):
        for n in range(N):
            path, i = [], n
            while i > 0:                       # the node and its ancestors below the root
                path.append(int(tokens[b, i]))
                i = int(parents[b, i])
            want = processed(raw[b, n], PARAMS[b], history[b] + path[::-1], prompts[b], eos_ids=EOS)
            got = out[b, n].double()
            assert torch.equal(torch.isinf(got), torch.isinf(want)), (b, n)
            fin = ~torch.isinf(want)
            assert torch.allclose(got[fin], want[fin], atol=1e-5), (b, n, got, want)
    plain = PARAMS.index(SamplingParams())
    assert torch.equal(out[plain], raw[plain])                # a row with no processor is left exactly as it was
    assert out.data_ptr() != raw.data_ptr()                   # a new tensor: raw logits stay for logprobs


@pytest.mark.interpreter
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalty_kernel_path_gives_the_same_floats(shape, dtype, monkeypatch):
    """The GPU path (kernels/penalties.py, interpreted here) writes exactly the torch path's floats."""
    from specbatch import kernels

    proc, args, *_ = _case(shape, dtype)
    want = proc.apply(*args)
    monkeypatch.setattr(kernels, "active", lambda t: True)
    got = proc.apply(*args)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_min_tokens_boundary_and_the_key():
    p = SamplingParams(min_tokens=3)
    proc = Processors.build([(p, 4)], EOS, V, torch.device("cpu"))
    raw = torch.zeros(1, 4, V)
    out = proc.apply(raw, torch.arange(4)[None], torch.tensor([1]), torch.zeros(1, 4, dtype=torch.int64), None, None)
    # generated before each node: 1, 2, 3, 4: EOS masked while < 3
    assert torch.isinf(out[0, :, 0]).tolist() == [True, True, False, False]
    assert processors_key([(SamplingParams(), 3)], EOS, V) is None
    assert processors_key([(p, 3), (SamplingParams(logit_bias={1: 1.0}), 2)], EOS, V) == (4, 4, False)
    assert processors_key([(SamplingParams(repetition_penalty=1.1), 3)], EOS, V) == (0, 0, True)


@pytest.mark.parametrize("t,min_p,top_k,top_p", [(1.0, 0.1, 0, 1.0), (0.7, 0.3, 0, 1.0), (1.3, 0.05, 3, 1.0),
                                                 (1.0, 0.2, 0, 0.6), (0.8, 0.0, 4, 0.9)])
def test_min_p_follows_temperature_before_top_k_top_p(t, min_p, top_k, top_p):
    logits = torch.tensor([[2.0, 1.6, 1.1, 0.4, 0.0, -0.7, -1.5, -3.0]])
    p = SamplingParams(temperature=t, min_p=min_p, top_k=top_k, top_p=top_p)
    sp = BatchSampling.build([p], torch.device("cpu"))
    got = sp.target_probs(logits)[0].double()
    want = law(logits[0], p, [], [])          # the float64 reference: temperature, min-p, top-k, top-p
    assert torch.allclose(got, want, atol=1e-6), (got, want)
    lp = sp.target_logprobs(logits)[0]
    assert torch.equal(torch.isinf(lp), want == 0)
    assert torch.allclose(lp[want > 0].double(), want[want > 0].log(), atol=1e-5)


def test_greedy_logprobs_are_the_plain_log_softmax():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    sp = BatchSampling.build([SamplingParams(temperature=0.0, top_k=1, min_p=0.5)], torch.device("cpu"))
    assert torch.allclose(sp.target_logprobs(logits), logits.log_softmax(-1))
