"""`--workers 2` with a row that brings its worker's device down (a planted CUDA error, through a
sitecustomize every process of the run loads): the rows that worker had in flight run alone on
one worker; the row that fails alone is written as its error; new workers replace the dead, and
every other row comes out as one clean process writes it."""
from __future__ import annotations

import pytest

from failure_helpers import clean_run, only_the_poison_row_failed, plant, run_cli

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
