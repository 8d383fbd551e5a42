"""naive_2token on CUDA: the whole cycle captured as ONE graph per (size, variant), equal to the
eager torch reference and to the split three-graph cycle, greedy and sampled, with both drafters
(run on a GPU machine: `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from naive_2token_helpers import VOCAB, n2_spec, output_ids
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpu_rows(n=11, **overrides):
    lens = (5, 31, 12, 64, 3, 20, 47, 9, 15, 2, 38)
    g = torch.Generator().manual_seed(7)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, VOCAB, (lens[i],), generator=g).tolist(),
                       overrides={"max_tokens": 12 + 5 * (i % 4), **overrides}) for i in range(n)]


def _gpu_run(model, spec, bs, graphs=True, rows=None, fused=None, profile=False, **defaults):
    eng = Engine(model, EngineOptions(batch_size=bs, device="cuda", dtype="float32", spec=spec,
                                      graphs=graphs, fused=fused, profile=profile, adaptive=False))
    recs = sorted(eng.generate(rows or _gpu_rows(), SamplingDefaults(**defaults)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return output_ids(recs), [r["spec"] for r in recs], eng


def _graph_counts(eng):
    return {key: len(cap.graphs) for key, cap in eng.graphs._graphs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
@pytest.mark.parametrize("bs", [3, 10])
def test_gpu_fused_graph_equals_eager_greedy(drafter, bs, target_dir, mtp_target_dir, eagle3_dir):
    import specbatch.kernels as kernels

    model, spec = (target_dir if drafter == "eagle3" else mtp_target_dir), n2_spec(drafter, eagle3_dir)
    with kernels.torch_only():
        ref, ref_stats, eager = _gpu_run(model, spec, bs, graphs=False)
    assert eager.graphs is None
    got, stats, eng = _gpu_run(model, spec, bs)
    assert eng.fused and eng.graphs is not None and eng.capture_seconds > 0
    assert got == ref and stats == ref_stats
    counts = _graph_counts(eng)
    assert counts and set(counts.values()) == {1}, counts                 # ONE graph per (size, variant)
    assert {size for size, _ in counts} == set(eng.graphs.sizes)
    split, split_stats, eng3 = _gpu_run(model, spec, bs, fused=False)
    assert not eng3.fused and set(_graph_counts(eng3).values()) == {3}
    assert split == ref and split_stats == ref_stats


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_gpu_fused_graph_equals_eager_sampling(drafter, target_dir, mtp_target_dir, eagle3_dir):
    import specbatch.kernels as kernels

    model, spec = (target_dir if drafter == "eagle3" else mtp_target_dir), n2_spec(drafter, eagle3_dir)
    rows = _gpu_rows()
    rows[2].overrides["temperature"] = 0.0                               # a greedy row among sampled ones
    defaults = {"temperature": 0.8, "top_p": 0.9, "seed": 11}
    with kernels.torch_only():
        ref, _, _ = _gpu_run(model, spec, 4, graphs=False, rows=rows, **defaults)
    got, _, eng = _gpu_run(model, spec, 4, rows=rows, **defaults)
    assert got == ref
    counts = _graph_counts(eng)
    assert {v[:2] for _, (v, _width) in counts} == {(True, False), (False, True)}    # (all greedy, any filter)
    assert set(counts.values()) == {1}, counts
    split, _, eng3 = _gpu_run(model, spec, 4, rows=rows, fused=False, **defaults)
    assert split == ref and set(_graph_counts(eng3).values()) == {3}


@pytest.mark.gpu
def test_gpu_exact_mtp_fused_graph_accepts_every_draft(bigram):
    ref, _, _ = _gpu_run(bigram, SpecConfig(), 4)
    got, stats, eng = _gpu_run(bigram, n2_spec("nextn_mtp"), 4)
    assert got == ref
    cycles = sum(s["verify_steps"] - 1 for s in stats)
    rejected = sum(s["accept_histogram"][0] for s in stats)
    assert cycles > 40 and rejected <= cycles // 20, (rejected, cycles)
    assert eng.fused and set(_graph_counts(eng).values()) == {1}


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_gpu_profile_of_the_fused_cycle(drafter, target_dir, mtp_target_dir, eagle3_dir):
    model, spec = (target_dir if drafter == "eagle3" else mtp_target_dir), n2_spec(drafter, eagle3_dir)
    _, _, eng = _gpu_run(model, spec, 4, rows=_gpu_rows(6), profile=True)
    assert eng.cycle_times
    for t in eng.cycle_times:
        assert t.draft_ms == 0.0 and t.extend_ms == 0.0                  # the whole cycle is one graph
        assert t.verify_ms > 0 and t.wall_ms > 0      # wall: its share (cycles overlap the host)
    assert sum(c.tokens for c in eng.cycle_times) > 0
    _, _, eng3 = _gpu_run(model, spec, 4, rows=_gpu_rows(6), profile=True, fused=False)
    t = eng3.cycle_times[0]
    assert t.draft_ms > 0 and t.verify_ms > 0 and t.extend_ms > 0
