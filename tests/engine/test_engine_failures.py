"""A failed prefill or cycle costs only the row that causes it: the rows in flight are rerun in
halves until the failing row runs alone, that row becomes its error record, and every other row
comes out as a run without the failure writes it. A fault that is not a row's (every row fails)
stops the job rather than writing error rows for all."""
from __future__ import annotations

import pytest
import torch

from specbatch.engine import Engine, EngineOptions
from specbatch.engine.failures import DeviceFailed, EngineFailed, out_of_memory, survivable
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

from failure_helpers import failure_rows as _rows

pytestmark = pytest.mark.usefixtures("one_thread")

POISON = 7


def _engine(model, **opts) -> Engine:
    return Engine(model, EngineOptions(device="cpu", dtype="float32", batch_size=8, max_model_len=64, **opts))


def _by_row(recs) -> dict[int, dict]:
    return {r["row"]: r for r in recs}


def _fail_prefill_of(eng: Engine, rows: set[int]) -> None:
    prefill = eng._prefill

    def failing(admitted):
        if any(req.row in rows for _, req in admitted):
            raise RuntimeError("shape mismatch in a planted bug")
        return prefill(admitted)
    eng._prefill = failing


def _fail_cycle_of(eng: Engine, row: int, after: int = 2) -> None:
    """Cycles fail once row `row` has `after` tokens (mid-generation, other rows in flight)."""
    launch = eng.cycle.launch

    def failing(active):
        if any(req.row == row and len(req.output_ids) >= after for _, req in active):
            raise ValueError("index out of range in a planted bug")
        return launch(active)
    eng.cycle.launch = failing


def _same_outputs(got: dict, want: dict, skip: set[int]) -> None:
    assert set(got) == set(want)
    for row in want:
        if row not in skip:
            assert got[row]["error"] is None, got[row]["error"]
            assert got[row]["output_token_ids"] == want[row]["output_token_ids"], row
            assert got[row]["choices"] == want[row]["choices"], row


@pytest.mark.parametrize("where", ["prefill", "cycle"])
def test_a_failing_row_becomes_its_error_record_and_the_rest_run(tiny_model, capsys, where):
    rows = _rows(30)
    want = _by_row(_engine(tiny_model).generate(rows, SamplingDefaults(ignore_eos=True)))
    eng = _engine(tiny_model)
    (_fail_prefill_of(eng, {POISON}) if where == "prefill" else _fail_cycle_of(eng, POISON))
    got = _by_row(eng.generate(rows, SamplingDefaults(ignore_eos=True)))
    _same_outputs(got, want, skip={POISON})
    bad = got[POISON]
    assert bad["error"].startswith("in.jsonl:8: the engine failed while generating this row, and again when it ran alone")
    assert ("RuntimeError: shape mismatch" if where == "prefill" else "ValueError: index out of range") in bad["error"]
    assert bad["id"] == "r7" and bad["completion_tokens"] == 0
    counts = eng.failure_counts
    assert counts.failed_alone == 1 and counts.failures == 1 and counts.rows_rerun > 1
    assert eng.pages.free_pages == eng.pages.usable                  # every page came back
    assert "warning: the engine failed with" in capsys.readouterr().err


def test_rows_of_n_seeded_choices_rerun_whole_and_the_same(tiny_model):
    """A row of n sampled choices is put aside whole (its finished choices dropped, its queued
    ones taken out of the queue) and reruns on the same seed streams."""
    rows = _rows(12, draw=3, n=3, temperature=0.9, seed=11)
    want = _by_row(_engine(tiny_model).generate(rows, SamplingDefaults(ignore_eos=True)))
    eng = _engine(tiny_model)
    _fail_cycle_of(eng, 5, after=1)
    got = _by_row(eng.generate(rows, SamplingDefaults(ignore_eos=True)))
    _same_outputs(got, want, skip={5})
    assert "ran alone" in got[5]["error"]


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_speculative_recipe_recovers_the_same_way(target_dir, eagle3_dir, shape):
    spec = SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)) if shape == "chain" else \
        SpecConfig("eagle3", 3, 3, 6, str(eagle3_dir))
    rows = _rows(20, draw=1)
    want = _by_row(_engine(target_dir, spec=spec).generate(rows, SamplingDefaults(ignore_eos=True)))
    eng = _engine(target_dir, spec=spec)
    _fail_cycle_of(eng, 11)
    got = _by_row(eng.generate(rows, SamplingDefaults(ignore_eos=True)))
    _same_outputs(got, want, skip={11})
    assert got[11]["error"] is not None


def test_a_failure_while_granting_pages_loses_nothing(tiny_model):
    """Requests taken from the queue by a failed admission are rerun, and pages granted but not
    yet assigned to a slot come back."""
    rows = _rows(24, draw=2)
    want = _by_row(_engine(tiny_model).generate(rows, SamplingDefaults(ignore_eos=True)))
    eng = _engine(tiny_model)
    grant = eng.pages.grant
    poison = rows[9].prompt_token_ids

    def failing(n, prompt=None, **kw):
        if prompt == poison:
            raise MemoryError("planted")
        return grant(n, prompt, **kw)
    eng.pages.grant = failing
    got = _by_row(eng.generate(rows, SamplingDefaults(ignore_eos=True)))
    _same_outputs(got, want, skip={9})
    assert "MemoryError: planted" in got[9]["error"]
    assert eng.pages.free_pages == eng.pages.usable


def test_a_fault_every_row_meets_stops_the_job_without_error_rows(tiny_model):
    """When rows keep failing alone with none finishing between them, the engine is at fault:
    generate raises and writes none of those rows, so a rerun retries them."""
    eng = _engine(tiny_model)
    launch = eng.cycle.launch
    calls = {"n": 0}

    def broken_after_a_while(active):
        calls["n"] += 1
        if calls["n"] > 6:
            raise RuntimeError("broken for good")
        return launch(active)
    eng.cycle.launch = broken_after_a_while
    seen = []
    with pytest.raises(EngineFailed, match="failed on 3 rows one after another.*RuntimeError: broken for good"):
        for rec in eng.generate(_rows(30), SamplingDefaults(ignore_eos=True)):
            seen.append(rec)
    assert all(r["error"] is None for r in seen)


def test_without_a_row_finishing_after_it_a_failed_row_is_still_written(tiny_model):
    """The last row of a job fails alone: fewer strikes than a broken engine, so it is written."""
    rows = _rows(6)
    eng = _engine(tiny_model)
    _fail_prefill_of(eng, {5})
    got = _by_row(eng.generate(rows, SamplingDefaults(ignore_eos=True, max_tokens=40)))
    assert set(got) == set(range(6)) and "ran alone" in got[5]["error"]


def test_device_errors_are_not_survived():
    cpu = torch.device("cpu")
    assert survivable(RuntimeError("shape mismatch"), cpu) and survivable(torch.OutOfMemoryError("oom"), cpu)
    assert not survivable(RuntimeError("CUDA error: an illegal memory access was encountered"), cpu)
    # a failed allocation outside torch's allocator leaves the device usable
    assert survivable(RuntimeError("CUDA error: out of memory"), cpu)
    assert survivable(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), cpu)
    assert not survivable(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED"), cpu)
    # the capture an allocation invalidated fails again as it ends, raised while the first propagates
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as e:
        assert out_of_memory(e) and survivable(e, cpu)
    assert not out_of_memory(RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    assert not survivable(KeyboardInterrupt(), cpu) and not survivable(EngineFailed("x"), cpu)
    assert not survivable(DeviceFailed([], RuntimeError("x"), cpu), cpu)
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None:
        assert not survivable(accel.__new__(accel), cpu)


def test_a_device_error_ends_the_job(tiny_model):
    eng = _engine(tiny_model)
    _fail_prefill_of(eng, {3})
    prefill = eng._prefill

    def cuda_failure(admitted):
        try:
            return prefill(admitted)
        except RuntimeError:
            raise RuntimeError("CUDA error: device-side assert triggered") from None
    eng._prefill = cuda_failure
    with pytest.raises(DeviceFailed, match="device-side assert triggered.*with 8 rows in flight") as failed:
        list(eng.generate(_rows(10), SamplingDefaults(ignore_eos=True)))
    assert eng.failure_counts.failures == 0
    rows = [item.row for item in failed.value.items]                # the first wave, row 3 among them
    assert len(rows) == 8 and 3 in rows and failed.value.items[0].id == f"r{rows[0]}"


def test_a_device_error_during_a_rerun_apart_names_the_rows_then_in_flight(tiny_model):
    """A survivable failure first, then a device error while its rows rerun in halves: the rows
    named are those of the half in flight."""
    eng = _engine(tiny_model)
    prefill = eng._prefill
    calls = {"n": 0}

    def failing(admitted):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("survivable")
        if any(req.row == 2 for _, req in admitted):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return prefill(admitted)
    eng._prefill = failing
    with pytest.raises(DeviceFailed) as failed:
        list(eng.generate(_rows(8), SamplingDefaults(ignore_eos=True)))
    assert sorted(item.row for item in failed.value.items) == [0, 1, 2, 3]
