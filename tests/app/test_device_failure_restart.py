"""A CUDA error ends the process, not the job: `specbatch run` starts the same command again in
a fresh process (exec), which resumes: the rows in flight run alone first, the one that brings
the device down alone is written as its error, and the next start finishes the job, in one
invocation. Restarts are bounded. On the CPU the failure is planted (a sitecustomize every
process of the run loads) together with what CUDA implies: the process cannot go on."""
from __future__ import annotations

import json

import pytest

from failure_helpers import clean_run, only_the_poison_row_failed, plant, run_cli

pytestmark = pytest.mark.slow

CUDA_ERROR = 'raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")'

# as on a CUDA device: the process cannot go on after the failure (DeviceFailed.hard_exit)
HARD = '''
from specbatch.engine import failures as _failures

_device_failed = _failures.DeviceFailed.__init__


def _hard(self, *args, **kwargs):
    _device_failed(self, *args, **kwargs)
    self.hard_exit = True


_failures.DeviceFailed.__init__ = _hard
'''


def _plant_hard(tmp_path, when=None):
    planted = plant(tmp_path, CUDA_ERROR) if when is None else plant(tmp_path, CUDA_ERROR, when=when)
    site = planted / "sitecustomize.py"
    site.write_text(site.read_text() + HARD)
    return planted


def test_one_command_gets_past_a_row_that_brings_the_device_down(tmp_path, tiny_model):
    inp, want = clean_run(tmp_path, tiny_model, "cpu")
    out = tmp_path / "clean.jsonl"           # --overwrite: the first start discards it, a restart resumes
    stats = tmp_path / "stats.json"
    run = run_cli(inp, out, tiny_model, "cpu", "--overwrite", "--stats-json", str(stats), planted=_plant_hard(tmp_path))
    assert run.returncode == 0, run.stderr
    summary = json.loads(stats.read_text())     # the last start's, which resumed: the error row is counted
    assert summary["resumed"] > 0 and summary["errors"] == 0 and summary["errors_in_output"] == 1
    assert "rows in flight" in run.stderr and "restart 1 of 3" in run.stderr, run.stderr
    assert "ran alone" in run.stderr and "restart 2 of 3" in run.stderr and "restart 3" not in run.stderr, run.stderr
    assert "the device failed while this row ran alone" in only_the_poison_row_failed(out, want)
    assert not (tmp_path / "clean.jsonl.parts").exists()


def test_restarts_are_bounded(tmp_path, tiny_model):
    inp, _ = clean_run(tmp_path, tiny_model, "cpu")
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cpu", planted=_plant_hard(tmp_path, when="True"))
    assert run.returncode == 2, run.stderr
    assert "restart 3 of 3" in run.stderr and "restart 4" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the device failed") and "rerun the same command to resume" in last, last
    assert (tmp_path / "o.jsonl.parts").exists()


def test_no_restart_where_a_rerun_cannot_resume(tmp_path, tiny_model):
    """-o - has nothing to resume from, --fail-fast stops at the failing row: one start each."""
    inp, _ = clean_run(tmp_path, tiny_model, "cpu")
    planted = _plant_hard(tmp_path)
    for extra in (["-o", "-"], ["--fail-fast"]):
        run = run_cli(inp, tmp_path / "o.jsonl", tiny_model, "cpu", *extra, planted=planted)
        assert run.returncode == 2 and "restart" not in run.stderr, run.stderr


def test_the_summary_names_the_outputs_errors_after_a_resume():
    from specbatch.progress import _errors

    assert _errors({"errors": 0, "resumed": 10, "errors_in_output": 1}) == "0 (1 in the output, resumed rows included)"
    assert _errors({"errors": 1, "resumed": 0, "errors_in_output": 1}) == "1"
    assert _errors({"errors": 2, "resumed": 3}) == "2"             # -o -: no output to count
