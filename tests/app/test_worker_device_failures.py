"""`--workers 2` with a planted failure (through a sitecustomize every process of the run loads).
A row that brings its worker's device down (a CUDA error): the rows that worker had in flight run
alone on one worker; the row that fails alone is written as its error; new workers replace the
dead, and every other row comes out as one clean process writes it. A row whose prefill raises
(the worker goes on) is its error once its worker finished another row. An engine that fails on
every row writes no row as an error: each worker ends on its third, the job with the last."""
from __future__ import annotations

import pytest

from failure_helpers import clean_run, completions, only_the_poison_row_failed, plant, run_cli, write_input

pytestmark = pytest.mark.slow


def test_a_worker_device_failure_isolates_the_row(tmp_path, tiny_model):
    inp, want = clean_run(tmp_path, tiny_model, "cpu")
    planted = plant(tmp_path, 'raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")')
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cpu", "--workers", "2", planted=planted)
    # the first death names its rows in flight, a new worker takes its place; the row that fails
    # alone takes one more worker, replaced too: one run finishes the job
    assert run.returncode == 0, run.stderr
    assert "rows in flight" in run.stderr and "restart 1 of 3" in run.stderr, run.stderr
    assert "alone, which is written as its error" in run.stderr, run.stderr
    bad = only_the_poison_row_failed(out, want)
    assert "the device failed while this row ran alone" in bad and "planted" in bad


def test_a_failing_row_in_a_worker_is_its_error(tmp_path, tiny_model):
    inp, want = clean_run(tmp_path, tiny_model, "cpu")
    planted = plant(tmp_path, 'raise RuntimeError("planted")')
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cpu", "--workers", "2", planted=planted)
    assert run.returncode == 0, run.stderr
    assert "died" not in run.stderr, run.stderr
    bad = only_the_poison_row_failed(out, want)
    assert "and again when it ran alone (RuntimeError: planted)" in bad


def test_workers_failing_on_every_row_write_no_row_as_its_error(tmp_path, tiny_model):
    inp = write_input(tmp_path)
    planted = plant(tmp_path, 'raise RuntimeError("planted")', when="True")
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cpu", "--workers", "2", planted=planted)
    assert run.returncode == 2, run.stderr
    assert "EngineFailed: the engine failed on 3 rows one after another" in run.stderr, run.stderr
    assert "restart 3 of 3" in run.stderr and "Traceback" not in run.stderr, run.stderr
    # (Python's resource tracker may warn after it, at the interpreter's exit)
    assert any(line.startswith("error: every worker died") for line in run.stderr.splitlines()), run.stderr
    assert not out.exists() or all(r["error"] is None for r in completions(out).values())
    rerun = run_cli(inp, out, tiny_model, "cpu", "--workers", "2")
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(completions(out)) == list(range(16))
    assert all(r["error"] is None for r in completions(out).values())
