"""`--workers 2` with a row that brings its worker's device down (a planted CUDA error, through a
sitecustomize every process of the run loads): the rows that worker had in flight run alone on
one worker; the row that fails alone is written as its error, and the job ends or goes on with
every other row as one clean process writes it (the rerun finishes what a job left)."""
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
    runs = []
    for _ in range(3):                    # each run gets past what the last one found
        runs.append(run_cli(inp, out, tiny_model, "cpu", "--workers", "2", planted=planted))
        if runs[-1].returncode == 0:
            break
    assert runs[-1].returncode == 0, [r.stderr for r in runs]
    assert "rows in flight" in runs[0].stderr and len(runs) > 1, runs[0].stderr
    got = completions(out)
    assert sorted(got) == sorted(want)
    bad = got[POISON_ROW]["error"]
    assert "the device failed while this row ran alone" in bad and "planted" in bad
    assert all(got[i]["completion"] == want[i]["completion"] and got[i]["error"] is None
               for i in got if i != POISON_ROW)
