"""Device failures over reruns in one process: suspects run alone still count strikes (a broken
engine writes none of them as errors), --fail-fast never writes the failing row, and -o - (which
cannot resume) says so."""
from __future__ import annotations

import json

import pytest

from specbatch.cli import EXIT_USAGE

from cli_runner import cli, ok
from failure_helpers import job_flags, job_input, plant_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

_input, _base, _plant = job_input, job_flags, plant_in_process


def test_suspects_run_alone_still_count_strikes(tmp_path, tiny_model, monkeypatch):
    """A rerun whose engine fails on every row (its fault, not the rows'): the suspects it runs
    alone first must not be written as their errors one by one; STRIKES stops the job with them
    unwritten, as it does for any other rows, so a rerun on a working engine completes them."""
    inp, out = _input(tmp_path), tmp_path / "o.jsonl"
    run = ["run", inp, "-o", out, *_base(tiny_model), "-q"]
    _plant(monkeypatch, lambda row: True, "CUDA error: an illegal memory access was encountered")
    r = cli(*run)
    assert r.exit_code == EXIT_USAGE and "rows in flight" in r.stderr
    suspects = json.loads((tmp_path / "o.jsonl.parts" / "suspects.json").read_text())["rows"]
    assert len(suspects) >= 3
    monkeypatch.undo()
    _plant(monkeypatch, lambda row: True)          # the engine is broken (survivably): every prefill raises
    r = cli(*run)
    assert r.exit_code == EXIT_USAGE and "failed on 3 rows one after another" in r.stderr, r.output
    monkeypatch.undo()
    ok(*run)                                       # a working engine: every row as it should be
    got = {r["row"]: r for r in map(json.loads, open(out))}
    assert sorted(got) == list(range(10))
    assert [i for i in got if got[i]["error"]] == []


def test_fail_fast_never_completes_an_output_with_the_row_that_brought_the_device_down(tmp_path, tiny_model,
                                                                                      monkeypatch):
    """--fail-fast stops at a row that fails instead of writing it as an error row (as the worker
    pool does for a row that brings its device down alone): no rerun of the same command may
    finish the output with that row as an error row."""
    inp, out = _input(tmp_path), tmp_path / "o.jsonl"
    run = ["run", inp, "-o", out, *_base(tiny_model), "-q", "--fail-fast"]
    _plant(monkeypatch, lambda row: row == 6, "CUDA error: an illegal memory access was encountered")
    codes = [cli(*run).exit_code for _ in range(3)]
    assert codes[0] != 0 and codes[1] != 0
    if out.exists():
        got = {r["row"]: r for r in map(json.loads, open(out))}
        assert all(r["error"] is None for r in got.values()), (codes, got[6]["error"])
    assert codes[2] != 0, codes


def test_stdout_device_failure_does_not_promise_a_resume(tmp_path, tiny_model, monkeypatch):
    """`-o -` keeps no parts and no suspects.json: the line must not tell the user that a rerun
    resumes and runs the rows in flight one at a time first (every rerun fails the same way)."""
    inp = _input(tmp_path)
    _plant(monkeypatch, lambda row: row == 6, "CUDA error: an illegal memory access was encountered")
    r = cli("run", inp, "-o", "-", *_base(tiny_model), "-q")
    assert r.exit_code == EXIT_USAGE and "rows in flight" in r.stderr
    assert "one at a time first" not in r.stderr, r.stderr
