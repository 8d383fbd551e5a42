"""The graph path of the cycle on the CPU: a stand-in for GraphRunner that "replays" by calling the
stages on the same static batch (fixed size, pad rows on the dummy slot, buffers refilled by
`_fill` when the active set changes, kv_bound the whole cache) runs the code CUDA graphs capture.
With processors and logprobs in the batch it must give eager's tokens and logprobs, and batches
that use neither must keep today's variant."""
from __future__ import annotations

import pytest
import torch

from graph_emulation import EmulatedGraphs
from processors_helpers import ids, prompts, rows
from specbatch.engine import Engine, EngineOptions
from specbatch.engine.cycle import _GREEDY
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


MIXED = [{"frequency_penalty": 1.0, "presence_penalty": 0.5, "logprobs": 3},
         {},
         {"temperature": 0.9, "seed": 4, "min_p": 0.05, "logit_bias": {7: 2.0, 9: -3.0}, "logprobs": 0},
         {"min_tokens": 7, "logit_bias": {0: 8.0}},
         {"temperature": 1.1, "seed": 9, "top_k": 20, "repetition_penalty": 1.4},
         {"repetition_penalty": 0.6, "logprobs": 5, "stop_token_ids": [11, 12, 13, 14, 15], "min_tokens": 4}]


def _engine(model, spec, graphs: bool):
    eng = Engine(model, EngineOptions(batch_size=4, device="cpu", dtype="float32", spec=spec))
    if graphs:
        eng.cycle.graphs = EmulatedGraphs(eng.cycle, eng.fused)
    return eng


def _gen(eng, r):
    recs = sorted(eng.generate(r, SamplingDefaults(max_tokens=16)), key=lambda x: x["row"])
    assert all(x["error"] is None for x in recs)
    return recs


@pytest.mark.parametrize("spec", ["vanilla", "eagle3-tree", "naive_2token"])
def test_graph_variants_equal_eager(spec, target_dir, eagle3_dir):
    spec = {"vanilla": SpecConfig(), "eagle3-tree": SpecConfig("eagle3", 3, 3, 6, str(eagle3_dir)),
            "naive_2token": SpecConfig("naive_2token", 1, 1, 2, str(eagle3_dir), "eagle3")}[spec]
    r = rows(prompts(6), MIXED)
    eager = _gen(_engine(target_dir, spec, False), r)
    eng = _engine(target_dir, spec, True)
    graphs = _gen(eng, r)
    assert ids(graphs) == ids(eager)
    for a, b in zip(graphs, eager):
        if b["logprobs"] is None:
            assert a["logprobs"] is None
            continue
        assert [e["token_id"] for e in a["logprobs"]] == [e["token_id"] for e in b["logprobs"]]
        assert torch.allclose(torch.tensor([e["logprob"] for e in a["logprobs"]]),
                              torch.tensor([e["logprob"] for e in b["logprobs"]]), atol=1e-5)
        assert [len(e["top_logprobs"]) for e in a["logprobs"]] == [len(e["top_logprobs"]) for e in b["logprobs"]]
    variants = eng.cycle.graphs.variants
    # a penalties + logprobs variant
    assert any(v.processors is not None and v.processors[2] and v.logprobs == 20 for v in variants)
    # rows without any of these features run today's variants
    eng = _engine(target_dir, spec, True)
    _gen(eng, rows(prompts(6), [{}, {"temperature": 0.8, "seed": 1}, {"temperature": 0.7, "top_p": 0.9}] * 2))
    assert {(v.any_top_k, v.any_min_p, v.processors, v.logprobs) for v in eng.cycle.graphs.variants} == \
        {(False, False, None, None)}


def test_a_jobs_first_variant_is_captured_at_every_size_and_width(target_dir, eagle3_dir):
    """Each job's first cycle captures its variant whole (every width the policy may pick), as the
    all-greedy one is at start; a variant first met later in the job is captured as met."""
    eng = _engine(target_dir, SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)), True)
    g = eng.cycle.graphs
    widths = eng.cycle.policy.widths
    sampled = [{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "seed": i} for i in range(4)]
    _gen(eng, rows(prompts(4), sampled))
    first = {v for v, _ in g.captured_all}
    assert len(first) == 1 and [w for _, w in g.captured_all] == list(widths)
    (v,) = first
    assert not v.greedy and v.any_top_k and v.processors is not None
    assert all((size, (v, w)) in g._graphs for size in g.sizes for w in widths)
    # a second job: its first variant (greedy) whole; the bias variant its later cycles meet only as met
    g.captured_all.clear()
    _gen(eng, rows(prompts(6), [{}] * 4 + [{"logit_bias": {7: 2.0}}] * 2))
    assert {v.greedy for v, _ in g.captured_all} == {True}
    assert any(v.processors is not None for v in g.variants)


class _OutOfMemoryFor(EmulatedGraphs):
    """Capturing a variant that `fails` picks raises `error()` (CUDA's out-of-memory error)."""

    def __init__(self, cycle, fused, fails, error=None):
        super().__init__(cycle, fused)
        self.fails = fails
        self.error = error or (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))

    def _check(self, variant):
        if self.fails(variant[0]):
            raise self.error()                # a new one each time: no traceback carried over

    def capture_all(self, variant, time_sizes=False):
        self._check(variant)
        super().capture_all(variant, time_sizes)

    def get(self, n, variant):
        if (next(s for s in self.sizes if s >= n), variant) not in self._graphs:
            self._check(variant)
        return super().get(n, variant)


# allocations that fail inside torch's allocator and outside it (a graph's instantiation, cuBLAS's
# workspace, a Triton launch); a new one a raise, so no traceback carries frames from one into the next
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", RuntimeError)      # torch >= 2.8


def _capture_invalidated() -> RuntimeError:
    # the capture an allocation invalidated fails again as it ends, raised while the first propagates
    e = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    e.__context__ = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return e

_ALLOCATION_ERRORS = {
    "torch-allocator": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cuda-malloc": lambda: _ACCELERATOR_ERROR("CUDA error: out of memory"),
    "cublas": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "triton": lambda: RuntimeError("Triton Error [CUDA]: out of memory"),
    "capture-invalidated": _capture_invalidated}


@pytest.mark.parametrize("error", list(_ALLOCATION_ERRORS))
@pytest.mark.parametrize("first", [True, False], ids=["job-first", "mid-job"])
def test_a_variant_that_cannot_be_captured_runs_eagerly(first, error, target_dir, eagle3_dir, capsys):
    """Out of memory capturing a variant's graphs (at a job's start or first met mid-job) does not
    fail its rows: that variant's cycles run eagerly, with eager's tokens, and the job goes on."""
    spec = SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir))
    per_row = MIXED if first else [{}] * 4 + MIXED[:2]
    r = rows(prompts(6), per_row)
    eager = _gen(_engine(target_dir, spec, False), r)
    eng = _engine(target_dir, spec, False)
    eng.cycle.graphs = g = _OutOfMemoryFor(eng.cycle, eng.fused, lambda v: v.processors is not None,
                                           _ALLOCATION_ERRORS[error])
    got = _gen(eng, r)
    assert ids(got) == ids(eager)
    bad = eng.cycle.eager_variants
    assert bad and all(v.processors is not None for v in bad)
    assert not any(v in bad for _, (v, _w) in g._graphs)
    if not first:
        assert any(v.greedy for v in g.variants)            # the greedy cycles before it replayed graphs
    assert "out of memory capturing the graphs" in capsys.readouterr().err


def test_a_capture_that_fails_otherwise_is_not_taken_for_out_of_memory(target_dir, eagle3_dir, capsys):
    """Only a failed allocation sends a variant to eager cycles: any other error capturing its
    graphs goes to the engine's failure handling (its rows rerun apart, then error records)."""
    spec = SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir))
    eng = _engine(target_dir, spec, False)
    eng.cycle.graphs = _OutOfMemoryFor(eng.cycle, eng.fused, lambda v: v.processors is not None,
                                       lambda: RuntimeError("shape mismatch (planted)"))  # both rows: processors
    got = {x["row"]: x["error"] for x in eng.generate(rows(prompts(6), [{}] * 4 + MIXED[2:4]),
                                                       SamplingDefaults(max_tokens=16))}
    assert not eng.cycle.eager_variants
    assert "out of memory capturing the graphs" not in capsys.readouterr().err
    assert [row for row, error in sorted(got.items()) if error] == [4, 5]      # the rows with processors
    assert all("shape mismatch (planted)" in got[row] for row in (4, 5))


def test_timing_a_jobs_first_variant_replays_no_rows_of_an_earlier_job(target_dir, eagle3_dir):
    """A variant first met mid-job (captured as met, its buffers then filled with that job's rows,
    never timed) that is a later job's first is timed then: the timing replays must run pad rows
    only, not the earlier job's rows, whose slots the new job's rows now hold."""
    spec = SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir))
    bias = {"temperature": 0.8, "logit_bias": {7: 2.0}}
    first = rows(prompts(6), [{}] * 4 + [{**bias, "seed": i} for i in range(2)])
    second = rows(prompts(4, seed=1), [{**bias, "seed": 10 + i} for i in range(4)])
    eager = _engine(target_dir, spec, False)
    want = [_gen(eager, first), _gen(eager, second)]
    eng = _engine(target_dir, spec, True)
    g = eng.cycle.graphs
    got = [_gen(eng, first)]
    (v,) = {v for v in g.variants if v.processors is not None}
    assert v not in {u for u, _ in g.captured_all}           # met mid-job: captured as met, not timed
    assert any(cap.layout for w in eng.cycle.policy.widths for cap in g.captured((v, w)))   # holds job 1's rows
    got.append(_gen(eng, second))
    assert {u for u, _ in g.captured_all} == {_GREEDY, v} and all((v, w) in g.timed for w in eng.cycle.policy.widths)
    assert [ids(recs) for recs in got] == [ids(recs) for recs in want]
