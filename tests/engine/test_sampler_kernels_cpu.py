"""The sampling kernels' path through the engine, on the CPU: the fused draw for plain sampling
(vanilla decode, a prefill's first token) and the radix filter for acceptance and logprobs,
switched on for CPU tensors (Triton's interpreter runs them) in sampling.py and accept.py alone,
under the CPU stand-in for CUDA graphs. Tokens and logprobs must be the torch path's, and rows
that report processed logprobs must draw from the distribution they report."""
from __future__ import annotations

import types

import pytest
import torch

import specbatch.kernels as kernels
import specbatch.kernels.filtered_draw as filtered_draw
import specbatch.kernels.top_k_top_p as top_k_top_p
import specbatch.sampling as sampling
import specbatch.speculative.accept as accept_module
from graph_emulation import EmulatedGraphs
from processors_helpers import ids, prompts, rows
from specbatch.engine import Engine, EngineOptions
from specbatch.params import SamplingParams
from specbatch.recipe import SamplingDefaults
from specbatch.sampling import BatchSampling, draw, draw_target

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [{"temperature": 0.9, "seed": 3, "top_p": 0.8, "logprobs": 2},
        {"temperature": 1.2, "seed": 5, "top_k": 5},
        {"logprobs": 1},
        {"temperature": 0.7, "seed": 8, "min_p": 0.05, "top_p": 0.6, "top_k": 40},
        {"temperature": 1.0, "seed": 2, "logprobs": 0}]


def _sampler_kernels_on(monkeypatch) -> None:
    on = types.SimpleNamespace(**{n: getattr(kernels, n) for n in dir(kernels) if not n.startswith("__")})
    on.active = lambda t: True
    monkeypatch.setattr(sampling, "kernels", on)
    monkeypatch.setattr(accept_module, "kernels", on)


def _gen(model, graphs: bool, mode: str) -> list[dict]:
    eng = Engine(model, EngineOptions(batch_size=4, device="cpu", dtype="float32", logprobs_mode=mode))
    if graphs:
        eng.cycle.graphs = EmulatedGraphs(eng.cycle, eng.fused)
    recs = sorted(eng.generate(rows(prompts(5), ROWS), SamplingDefaults(max_tokens=6)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs), [r["error"] for r in recs]
    return recs


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_the_kernel_sampler_in_the_engine_equals_the_torch_path(mode, target_dir, monkeypatch):
    want = _gen(target_dir, graphs=False, mode=mode)
    _sampler_kernels_on(monkeypatch)
    calls = {"fused": 0, "filter": 0, "built": 0}

    def counted(name, f, built=False):
        def g(*a, **kw):
            calls[name] += 1 if not built else a[1].built is not None
            return f(*a, **kw)
        return g
    monkeypatch.setattr(filtered_draw, "draw_filtered", counted("fused", filtered_draw.draw_filtered))
    monkeypatch.setattr(top_k_top_p, "top_k_top_p", counted("filter", top_k_top_p.top_k_top_p))
    monkeypatch.setattr(sampling, "draw_target", counted("built", sampling.draw_target, built=True))
    got = _gen(target_dir, graphs=True, mode=mode)
    processed = mode.startswith("processed")
    assert calls["fused"] > 0 and (calls["filter"] > 0) == processed and (calls["built"] > 0) == processed
    assert ids(got) == ids(want)
    for a, b in zip(got, want):
        if b["logprobs"] is None:
            assert a["logprobs"] is None
            continue
        assert torch.allclose(torch.tensor([e["logprob"] for e in a["logprobs"]]),
                              torch.tensor([e["logprob"] for e in b["logprobs"]]), atol=1e-5)


@pytest.mark.interpreter
def test_rows_reporting_processed_logprobs_draw_from_the_distribution_they_report(monkeypatch):
    params = [SamplingParams(temperature=0.8, top_p=0.7, seed=i, logprobs=(1 if i % 2 else None)) for i in range(4)]
    g = torch.Generator().manual_seed(0)
    logits, pos = torch.randn(4, 50, generator=g) * 2, torch.arange(4) + 9
    reference = draw(BatchSampling.build(params, torch.device("cpu")).target_probs(logits),
                     BatchSampling.build(params, torch.device("cpu")), pos)
    assert BatchSampling.build(params, torch.device("cpu")).built is None          # raw modes: no such row
    sp = BatchSampling.build(params, torch.device("cpu"), processed_logprobs=True)
    assert sp.built.tolist() == [False, True, False, True]
    _sampler_kernels_on(monkeypatch)
    monkeypatch.setattr(filtered_draw, "draw_filtered",
                        lambda x, k, p, keys, t=None, find_kth=True, ids=None: torch.full_like(keys, 49))
    got = draw_target(logits, sp, pos)
    assert got.tolist() == [49, int(reference[1]), 49, int(reference[3])]


@pytest.mark.interpreter
def test_graph_rows_reporting_processed_logprobs_never_take_the_fused_draw(target_dir, monkeypatch):
    """The fused draw shifted by one token: sampled rows that report processed logprobs must still
    draw the torch path's tokens (eager prefill, then the graph variant's `built` buffer, laid out
    by _static_batch and refilled by _fill as the active set changes); the other sampled rows move."""
    want = _gen(target_dir, graphs=False, mode="processed_logprobs")
    _sampler_kernels_on(monkeypatch)
    fused = filtered_draw.draw_filtered
    monkeypatch.setattr(filtered_draw, "draw_filtered",
                        lambda x, k, p, keys, t=None, find_kth=True, ids=None: (fused(x, k, p, keys, t, find_kth, ids) + 1)
                        % x.shape[-1])
    got = _gen(target_dir, graphs=True, mode="processed_logprobs")
    sampled = [i for i, r in enumerate(ROWS) if r.get("temperature", 0) > 0]
    reporting = [i for i in sampled if "logprobs" in ROWS[i]]
    assert reporting and [ids(got)[i] for i in reporting] == [ids(want)[i] for i in reporting]
    assert all(ids(got)[i] != ids(want)[i] for i in sampled if i not in reporting)      # the shift is live
