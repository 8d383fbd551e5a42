"""`--workers 2` with a row that brings its worker's device down (a planted CUDA error, through a
sitecustomize every process of the run loads): the rows that worker had in flight run alone on
one worker; the row that fails alone is written as its error; new workers replace the dead, and
every other row comes out as one clean process writes it."""
from __future__ import annotations

import pytest

from failure_helpers import POISON_ROW, completions, plant, run_cli, write_input

pytestmark = pytest.mark.slow


def test_a_worker_device_failure_isolates_the_row(tmp_path, tiny_model):
    inp = write_input(tmp_path)
    clean = tmp_path / "clean.jsonl"
    assert run_cli(inp, clean, tiny_model, "cpu").returncode == 0
    want = completions(clean)
    planted = plant(tmp_path, 'raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")')
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cpu", "--workers", "2", planted=planted)
    # the first death names its rows in flight, a new worker takes its place; the row that fails
    # alone takes one more worker, replaced too: one run finishes the job
    assert run.returncode == 0, run.stderr
    assert "rows in flight" in run.stderr and "restart 1 of 3" in run.stderr, run.stderr
    assert "alone, which is written as its error" in run.stderr, run.stderr
    got = completions(out)
    assert sorted(got) == sorted(want)
    bad = got[POISON_ROW]["error"]
    assert "the device failed while this row ran alone" in bad and "planted" in bad
    assert all(got[i]["completion"] == want[i]["completion"] and got[i]["error"] is None
               for i in got if i != POISON_ROW)
