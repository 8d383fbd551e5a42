"""A job whose engine fails on one row: that row is written as its error, every other row as
usual, and the summary counts the failure; an engine that fails on every row stops the job
with one line, finished rows committed, and the rerun completes it."""
from __future__ import annotations

import json

import pytest

from specbatch.cli import EXIT_USAGE

from cli_runner import cli, ok
from failure_helpers import job_flags, job_input, plant_in_process

pytestmark = pytest.mark.usefixtures("one_thread")

_input, _base, _plant = job_input, job_flags, plant_in_process


def test_one_failing_row_is_its_error_and_the_summary_counts_it(tmp_path, tiny_model, monkeypatch):
    inp, out = _input(tmp_path), tmp_path / "o.jsonl"
    ok("run", inp, "-o", out, *_base(tiny_model), "-q", "--overwrite")
    want = {r["row"]: r["completion"] for r in map(json.loads, open(out))}
    _plant(monkeypatch, lambda row: row == 6)
    stats = tmp_path / "stats.json"
    r = ok("run", inp, "-o", out, *_base(tiny_model), "--overwrite", "--stats-json", stats)
    got = {r["row"]: r for r in map(json.loads, open(out))}
    assert sorted(got) == list(range(10))
    assert "in.jsonl:7: the engine failed while generating this row" in got[6]["error"]
    assert all(got[i]["completion"] == want[i] and got[i]["error"] is None for i in got if i != 6)
    summary = json.loads(stats.read_text())
    assert summary["errors"] == 1 and summary["engine_failures"] >= 1 and summary["rows_failed_alone"] == 1
    assert "engine failures" in r.output and "failed alone" in r.output


def test_an_engine_failing_on_every_row_stops_and_the_rerun_completes(tmp_path, tiny_model, monkeypatch):
    inp, out = _input(tmp_path), tmp_path / "o.jsonl"
    _plant(monkeypatch, lambda row: row >= 4)
    r = cli("run", inp, "-o", out, *_base(tiny_model), "-q")
    assert r.exit_code == EXIT_USAGE
    warning, line = r.stderr.strip().splitlines()       # one warning for the first failure, one error
    assert warning.startswith("warning: the engine failed with 4 rows in flight (RuntimeError: planted)")
    assert line.startswith("error: ") and "failed on 3 rows one after another" in line and "rerun the same command to resume" in line
    monkeypatch.undo()
    ok("run", inp, "-o", out, *_base(tiny_model), "-q")
    got = [json.loads(x) for x in open(out)]
    assert sorted(r["row"] for r in got) == list(range(10)) and all(r["error"] is None for r in got)


def test_a_row_that_brings_the_device_down_costs_reruns_not_the_job(tmp_path, tiny_model, monkeypatch):
    """A CUDA error ends the process: the rows in flight are remembered beside the parts; the
    rerun runs them one at a time first, so the row that fails alone is written as its error
    and the next rerun goes past it. Every other row is as a clean run writes it."""
    inp, out = _input(tmp_path), tmp_path / "o.jsonl"
    ok("run", inp, "-o", out, *_base(tiny_model), "-q")
    want = {r["row"]: r["completion"] for r in map(json.loads, open(out))}
    _plant(monkeypatch, lambda row: row == 6, "CUDA error: an illegal memory access was encountered")
    run = ["run", inp, "-o", out, *_base(tiny_model), "-q", "--overwrite"]
    r = cli(*run)
    assert r.exit_code == EXIT_USAGE and "rows in flight (RuntimeError: CUDA error: an illegal memory" in r.stderr
    assert "run one at a time first" in r.stderr
    suspects = json.loads((tmp_path / "o.jsonl.parts" / "suspects.json").read_text())["rows"]
    assert "6" in suspects and len(suspects) > 1
    r = cli(*run[:-1])                                   # the rerun: row 6 alone brings it down
    assert r.exit_code == EXIT_USAGE and "in.jsonl:7 ran alone (RuntimeError: CUDA error" in r.stderr
    r = cli(*run[:-1])                                   # and the next goes past it
    assert r.exit_code == 0, r.output
    got = {r["row"]: r for r in map(json.loads, open(out))}
    assert sorted(got) == list(range(10)) and "ran alone" in got[6]["error"]
    assert all(got[i]["completion"] == want[i] and got[i]["error"] is None for i in got if i != 6)
    assert not (tmp_path / "o.jsonl.parts").exists()


def test_an_openai_line_the_engine_failed_on_is_a_server_error_not_a_bad_request(tmp_path, tiny_model, monkeypatch):
    """Review repro: a batch line the engine failed on was written as a 400 invalid_request_error,
    the answer to a request that is wrong, which a client does not retry; the engine's failure is
    a 500 server_error (as OpenAI reports one), and a bad field stays a 400."""
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"row {i}", "max_tokens": 3}} for i in range(4)]
    lines[3]["body"]["use_beam_search"] = True
    inp, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    _plant(monkeypatch, lambda row: row == 1)
    ok("run", inp, "-o", out, "--model", tiny_model, "--batch-size", 4, "--device", "cpu", "-q")
    got = {x["custom_id"]: x for x in map(json.loads, open(out))}
    assert got["c0"]["response"]["status_code"] == got["c2"]["response"]["status_code"] == 200
    failed, bad = got["c1"], got["c3"]
    assert failed["response"]["status_code"] == 500 and failed["error"]["code"] == "server_error"
    assert failed["response"]["body"]["error"]["type"] == "server_error"
    assert "the engine failed while generating this row" in failed["error"]["message"]
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["type"] == "invalid_request_error"
