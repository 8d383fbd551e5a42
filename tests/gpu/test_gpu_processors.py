"""min_tokens, logit_bias, penalties and logprobs in CUDA graphs over Triton kernels equal the eager
torch reference (run on a GPU machine: `pytest -m gpu`): the processors' graph variants, the
penalty state advanced inside the replay, all-greedy batches through the Triton greedy walk on
processed logits, and batches without these fields keeping the plain variants."""
from __future__ import annotations

import pytest
import torch

import specbatch.kernels as kernels
from processors_helpers import prompts, rows
from specbatch.engine import Engine, EngineOptions
from specbatch.params import LOGPROBS_MODES
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.gpu

MIXED = [{"frequency_penalty": 1.0, "presence_penalty": 0.5, "logprobs": 3},
         {},
         {"temperature": 0.9, "seed": 4, "min_p": 0.05, "logit_bias": {7: 2.0, 9: -3.0}, "logprobs": 0},
         {"min_tokens": 7, "logit_bias": {0: 8.0}},
         {"temperature": 1.1, "seed": 9, "top_k": 20, "repetition_penalty": 1.4},
         {"repetition_penalty": 0.6, "logprobs": 5, "stop_token_ids": [11, 12, 13, 14, 15], "min_tokens": 4}]
GREEDY = [{"frequency_penalty": 1.2, "repetition_penalty": 1.3}, {"logit_bias": {5: 3.0}}, {},
          {"min_tokens": 6, "logit_bias": {0: 8.0}, "logprobs": 2}]


def _run(model, spec, graphs, per_row, bs=4, logprobs_mode="raw_logprobs"):
    eng = Engine(model, EngineOptions(batch_size=bs, device="cuda", dtype="float32", spec=spec, graphs=graphs,
                                      logprobs_mode=logprobs_mode))
    recs = sorted(eng.generate(rows(prompts(len(per_row)), per_row), SamplingDefaults(max_tokens=16)),
                  key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs, eng


def _specs(eagle3_dir):
    return {"vanilla": SpecConfig(), "eagle3_tree": SpecConfig("eagle3", 5, 4, 8, str(eagle3_dir)),
            "eagle3_topk1": SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)),
            "naive_2token": SpecConfig("naive_2token", 1, 1, 2, str(eagle3_dir), "eagle3")}


@pytest.mark.parametrize("name", ["vanilla", "eagle3_topk1", "eagle3_tree", "naive_2token"])
@pytest.mark.parametrize("per_row", [MIXED, GREEDY], ids=["mixed", "greedy"])
def test_processor_graphs_equal_eager(name, per_row, target_dir, eagle3_dir):
    spec = _specs(eagle3_dir)[name]
    with kernels.torch_only():
        ref, _ = _run(target_dir, spec, False, per_row)
    got, eng = _run(target_dir, spec, True, per_row)
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in ref]
    for a, b in zip(got, ref):
        if b["logprobs"] is not None:
            assert torch.allclose(torch.tensor([e["logprob"] for e in a["logprobs"]]),
                                  torch.tensor([e["logprob"] for e in b["logprobs"]]), atol=1e-4)
    variants = {v for _, (v, _width) in eng.graphs._graphs}
    assert any(v.processors is not None for v in variants)


@pytest.mark.parametrize("name", ["eagle3_topk1", "naive_2token"])
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_modes_in_graphs_equal_eager(name, mode, target_dir, eagle3_dir):
    spec = _specs(eagle3_dir)[name]
    with kernels.torch_only():
        ref, _ = _run(target_dir, spec, False, MIXED, logprobs_mode=mode)
    got, _ = _run(target_dir, spec, True, MIXED, logprobs_mode=mode)
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in ref]
    ranks = []
    for a, b in zip(got, ref):
        if b["logprobs"] is not None:
            flat = lambda r: [v for e in r["logprobs"] for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]]  # noqa: E731
            assert torch.allclose(torch.tensor(flat(a)), torch.tensor(flat(b)), atol=1e-4)
            ranks += [(x["rank"], y["rank"]) for x, y in zip(a["logprobs"], b["logprobs"])]
    # each token's rank (vLLM's): the same but where a near tie rounds the other way
    assert ranks and all(x >= 1 for x, _ in ranks)
    assert sum(x != y for x, y in ranks) <= len(ranks) // 20 and all(abs(x - y) <= 2 for x, y in ranks)


def test_plain_batches_keep_the_plain_variants(target_dir, eagle3_dir):
    _, eng = _run(target_dir, _specs(eagle3_dir)["eagle3_tree"], True, [{}, {"temperature": 0.8, "seed": 1}] * 2)
    variants = {v for _, (v, _width) in eng.graphs._graphs}
    assert {(v.any_min_p, v.processors, v.logprobs) for v in variants} == {(False, None, None)}
