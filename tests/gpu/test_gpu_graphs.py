"""CUDA-graph replay equals the eager reference (run on a GPU machine: `pytest -m gpu`).

Eager here means no graphs and the torch reference ops everywhere (`kernels.torch_only`);
the fast path is graphs over Triton kernels. Float32, so greedy tokens must match exactly.
"""
from __future__ import annotations

import pytest
import torch

import specbatch.kernels as kernels
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.engine.cycle import Variant
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.gpu

LENS = (5, 31, 12, 64, 3, 20, 47, 9, 15, 2, 38)
SPECS = {
    "vanilla": SpecConfig(),
    "eagle3_topk1": (3, 1, 4),
    "eagle3_deep": (6, 1, 7),
    "eagle3_tree": (5, 4, 8),
    "eagle3_small_tree": (2, 3, 7),
    "nextn_mtp": (3, 1, 4),               # the MTP layer inside the target checkpoint
    "nextn_mtp_tree": (3, 2, 5),
}


def _spec(name, eagle3_dir):
    s = SPECS[name]
    if isinstance(s, SpecConfig):
        return s
    return SpecConfig("nextn_mtp", *s) if name.startswith("nextn") else SpecConfig("eagle3", *s, str(eagle3_dir))


def _model(name, target_dir, mtp_target_dir):
    return mtp_target_dir if name.startswith("nextn") else target_dir


def _rows(n=len(LENS), **overrides):
    g = torch.Generator().manual_seed(7)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 320, (LENS[i],), generator=g).tolist(),
                       overrides={"max_tokens": 12 + 5 * (i % 4), **overrides}) for i in range(n)]


def _run(model, spec, bs, graphs, rows=None, adaptive=False, time_sizes=True, **defaults):
    # adaptive off unless asked: spec stats are compared below, every cycle at full width
    eng = Engine(model, EngineOptions(batch_size=bs, device="cuda", dtype="float32", spec=spec, graphs=graphs,
                                      adaptive=adaptive, time_graph_sizes=time_sizes))
    recs = sorted(eng.generate(rows or _rows(), SamplingDefaults(**defaults)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return [r["output_token_ids"] for r in recs], [r["spec"] for r in recs], eng


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("bs", [3, 10])
def test_graph_replay_equals_eager_greedy(name, bs, target_dir, mtp_target_dir, eagle3_dir):
    spec, model = _spec(name, eagle3_dir), _model(name, target_dir, mtp_target_dir)
    with kernels.torch_only():
        ref, ref_stats, eager = _run(model, spec, bs, graphs=False)
    assert eager.graphs is None
    got, stats, eng = _run(model, spec, bs, graphs=True)
    assert eng.graphs is not None and eng.capture_seconds > 0
    assert got == ref
    assert stats == ref_stats


@pytest.mark.parametrize("name", ["eagle3_topk1", "eagle3_tree", "nextn_mtp_tree"])
def test_adaptive_width_graphs_equal_eager_greedy(name, target_dir, mtp_target_dir, eagle3_dir):
    """Graphs captured per verify width (engine/adaptive.py): whichever prefix each cycle verified,
    the tokens are the eager reference's, and every candidate width ran."""
    spec, model = _spec(name, eagle3_dir), _model(name, target_dir, mtp_target_dir)
    with kernels.torch_only():
        ref, _, _ = _run(model, spec, 4, graphs=False)
    got, stats, eng = _run(model, spec, 4, graphs=True, adaptive=True)
    assert got == ref
    assert set(eng.cycle.policy.used) == set(eng.cycle.policy.widths) == {1, 2, spec.num_draft_tokens}
    assert {w for _, (_, w) in eng.graphs._graphs} == {1, 2, spec.num_draft_tokens}
    assert all(s["accepted_tokens"] <= s["draft_tokens"] for s in stats)


@pytest.mark.parametrize("name", ["vanilla", "eagle3_topk1", "eagle3_tree", "nextn_mtp"])
def test_graph_replay_equals_eager_sampling(name, target_dir, mtp_target_dir, eagle3_dir):
    spec, model = _spec(name, eagle3_dir), _model(name, target_dir, mtp_target_dir)
    defaults = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    with kernels.torch_only():
        ref, _, _ = _run(model, spec, 4, graphs=False, **defaults)
    got, _, eng = _run(model, spec, 4, graphs=True, **defaults)
    assert got == ref
    # the sampling variant (the job's first) is captured whole and its sizes timed, next to the greedy one
    sampled = Variant(False, True, False, False, None, None)
    assert {v for _, (v, _width) in eng.graphs._graphs} == {Variant(True, False, False, False, None, None), sampled}
    assert all(eng.graphs.complete((sampled, w)) and (sampled, w) in eng.graphs.replay_ms
               for w in eng.cycle.policy.widths)


def test_graph_sizes_pad_to_the_next_capture(target_dir, eagle3_dir):
    eng = Engine(target_dir, EngineOptions(batch_size=20, device="cuda", dtype="float32",
                                           spec=_spec("eagle3_topk1", eagle3_dir)))
    assert eng.graphs.sizes == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20]
    assert eng.graphs.padded(9) == 12 and eng.graphs.padded(20) == 20
    with torch.inference_mode():
        recs = list(eng.generate(_rows(), SamplingDefaults()))
    assert len(recs) == len(LENS)
    assert int(eng.lens[eng.state.dummy]) == 0


def test_a_variant_first_met_mid_job_captures_its_largest_size_first(target_dir, eagle3_dir):
    """Rows with a logit bias, two at a time on 20 slots, their variant met after a job's first
    cycle (which captures its variant whole): the size-20 graph is captured before the size-2 one
    (smaller sizes then take their temporaries from its blocks in the shared pool, rather than
    each growing it), and the tokens equal eager's."""
    rows = _rows(4, logit_bias={"7": 3.0})
    want, _, _ = _run(target_dir, _spec("eagle3_topk1", eagle3_dir), 2, graphs=False, rows=rows)
    eng = Engine(target_dir, EngineOptions(batch_size=20, device="cuda", dtype="float32", wave=0.0,
                                           spec=_spec("eagle3_topk1", eagle3_dir), adaptive=False))
    eng.cycle.new_job = lambda: None                 # as if met after the job's first cycle
    base = set(eng.graphs._graphs)
    recs = sorted(eng.generate(rows[:2], SamplingDefaults()), key=lambda r: r["row"])
    new = [k for k in eng.graphs._graphs if k not in base]
    assert new and new[0][0] == 20 and {k[0] for k in new} == {20, 2, 1}     # 1: the longer row alone at the end
    assert [r["output_token_ids"] for r in recs] == want[:2]


def test_every_width_times_its_sizes_and_keeps_the_largest(target_dir, eagle3_dir):
    eng = Engine(target_dir, EngineOptions(batch_size=20, device="cuda", dtype="float32",
                                           spec=_spec("eagle3_topk1", eagle3_dir), adaptive=True))
    widths = eng.cycle.policy.widths
    assert sorted(v[1] for v in eng.graphs.replay_ms) == widths
    for variant, ms in eng.graphs.replay_ms.items():
        assert sorted(ms) == eng.graphs.sizes and all(t > 0 for t in ms.values())
        route = eng.graphs._route[variant]
        assert route[20] == 20 and all(r >= s and r in ms for s, r in route.items())
        assert set(eng.graphs.skipped(variant)) <= set(eng.graphs.sizes[:-1])


@pytest.mark.parametrize("name", ["vanilla", "eagle3_topk1", "eagle3_tree"])
def test_batches_routed_to_a_larger_size_give_the_same_tokens(name, target_dir, eagle3_dir):
    """A size skipped for a faster larger one: its batches replay the larger graph with more pad
    rows; forced here (only the largest size kept) against the smallest size that fits."""
    spec = _spec(name, eagle3_dir)
    ref, ref_spec, _ = _run(target_dir, spec, 10, graphs=True, time_sizes=False)
    eng = Engine(target_dir, EngineOptions(batch_size=10, device="cuda", dtype="float32", spec=spec,
                                           adaptive=False))
    for variant in eng.graphs.replay_ms:
        eng.graphs._route[variant] = {size: 10 for size in eng.graphs.sizes}
    replayed, padded = [], eng.graphs.padded
    eng.graphs.padded = lambda rows, variant=None: replayed.append(padded(rows, variant)) or replayed[-1]
    recs = sorted(eng.generate(_rows(), SamplingDefaults()), key=lambda r: r["row"])
    assert [r["output_token_ids"] for r in recs] == ref
    assert [r["spec"] for r in recs] == ref_spec
    assert replayed and set(replayed) == {10}            # the batches of 1 to 9 rows too (the drain)


def test_profile_records_stage_times(target_dir, eagle3_dir):
    eng = Engine(target_dir, EngineOptions(batch_size=4, device="cuda", dtype="float32",
                                           spec=_spec("eagle3_topk1", eagle3_dir), profile=True))
    list(eng.generate(_rows(6), SamplingDefaults()))
    assert eng.cycle_times
    t = eng.cycle_times[0]
    assert t.draft_ms > 0 and t.verify_ms > 0 and t.extend_ms > 0 and t.wall_ms > 0
    assert sum(c.tokens for c in eng.cycle_times) > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_engine_on_a_second_gpu_equals_the_first(target_dir, eagle3_dir):
    """An engine on cuda:N (what `--gpus` workers use) captures and replays on its own device."""
    spec = _spec("eagle3_topk1", eagle3_dir)
    last = f"cuda:{torch.cuda.device_count() - 1}"
    ref, _, _ = _run(target_dir, spec, 4, graphs=True)
    try:
        eng = Engine(target_dir, EngineOptions(batch_size=4, device=last, dtype="float32", spec=spec, graphs=True,
                                               adaptive=False))
        assert torch.cuda.current_device() == torch.cuda.device_count() - 1
        recs = sorted(eng.generate(_rows(), SamplingDefaults()), key=lambda r: r["row"])
    finally:
        torch.cuda.set_device(0)
    assert eng.cache.layers[0][0].device == torch.device(last) and eng.graphs is not None
    assert [r["output_token_ids"] for r in recs] == ref


def test_a_capture_failing_at_instantiation_gives_the_callers_stream_back(monkeypatch):
    """torch.cuda.graph's exit instantiates the graph before it restores the stream: an allocation
    failing there (a CUDA error: out of memory, which the cycle survives by running that variant
    eagerly) must not leave the process on the runner's capture stream."""
    from specbatch.engine.graphs import GraphRunner

    real_end = torch.cuda.CUDAGraph.capture_end

    def failing_end(self):
        real_end(self)
        raise getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: out of memory")

    runner = GraphRunner(make_batch=lambda size, variant: torch.zeros(size, device="cuda"),
                         groups=[[lambda b: b.add_(1)]], sizes=[1, 2])
    before = torch.cuda.current_stream()
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", failing_end)
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.get(1, "v")
    assert torch.cuda.current_stream() == before
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", real_end)
    cap = runner.get(1, "w")                                   # the runner still captures
    cap.graphs[0].replay()
    torch.cuda.synchronize()
    assert cap.batch.tolist() == [2.0]                         # warm-up once, replay once
