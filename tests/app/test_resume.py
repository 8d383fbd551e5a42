"""A real `python -m specbatch run` killed mid-job (SIGKILL, and Ctrl-C), then rerun: it resumes from
the committed parts and ends with the same file an uninterrupted run of the same command writes."""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from specbatch.data.writer import OutputWriter

pytestmark = pytest.mark.slow

WORDS = ("def add(a, b): return a + b for i in range(10): print(i * i) class Point: import os "
         "The quick brown fox jumps over the lazy dog").split()
# OutputWriter commits a part every 256 rows (or 30 s) and the CLI has no flag for it. So that a
# part exists well before the end, the first SHORT rows finish within 1-3 tokens (row-level
# max_tokens) and the last LONG rows take the full --max-tokens 24: the job is stopped in that tail.
SHORT, LONG = 264, 60
N = SHORT + LONG


def _cmd(inp: Path, model: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specbatch", "run", str(inp), "--model", str(model), "--batch-size", "4",
            "--max-tokens", "24", "--device", "cpu", "-o", str(out), "-q", *extra]


def _env() -> dict:
    # one thread per process: several runs go side by side on few cores;
    # wide COLUMNS: rich's summary table on stderr does not wrap its cells
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "COLUMNS": "300"}


def _default_sigint() -> None:
    # a suite started in the background (`cmd &` in a script) ignores SIGINT, and children inherit
    # that: the run under test must see Ctrl-C as a terminal would deliver it
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)


def _finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        _, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, "", err)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    p = _finish(_start(cmd, cwd))
    assert p.returncode == 0, p.stderr
    return p


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _part_files(out: Path) -> list[Path]:
    d = Path(str(out) + ".parts")
    return sorted(d.glob("part-*.parquet")) if d.is_dir() else []


def _committed(out: Path) -> list[int]:
    return [r for p in _part_files(out) for r in pq.read_table(p, columns=["row"])["row"].to_pylist()]


@pytest.fixture(scope="module")
def job(tiny_model, tmp_path_factory):
    """Three runs of one command side by side, to three outputs: `ref` left alone, `out` SIGKILLed and
    `int` sent SIGINT as soon as their first part is committed; then `out` and `int` are rerun."""
    assert OutputWriter.__init__.__kwdefaults__["commit_rows"] <= SHORT - 8, "rebalance SHORT/LONG"
    d = tmp_path_factory.mktemp("resume")
    inp = d / "rows.jsonl"
    with open(inp, "w") as f:
        for i in range(N):
            row = {"id": f"q{i:03d}", "prompt": " ".join(WORDS[(i * 7) % len(WORDS):][: 3 + i % 6])}
            if i < SHORT:
                row["max_tokens"] = 1 + i % 3
            f.write(json.dumps(row) + "\n")
    outs = {name: d / f"{name}.parquet" for name in ("ref", "out", "int", "term")}
    cmds = {name: _cmd(inp, tiny_model, path) for name, path in outs.items()}
    procs = {name: _start(cmd, d) for name, cmd in cmds.items()}
    stops = {"out": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}
    first: dict[str, list[int]] = {}
    try:
        deadline = time.monotonic() + 150
        while len(first) < len(stops) and time.monotonic() < deadline:
            for name, sig in stops.items():
                if name in first:
                    continue
                if procs[name].poll() is not None:
                    first[name] = []          # ended on its own: the tests say so
                elif _part_files(outs[name]):
                    procs[name].send_signal(sig)
                    first[name] = _committed(outs[name])
            time.sleep(0.005)
        stopped = {name: _finish(procs[name]) for name in stops}
    finally:
        for p in procs.values():
            if p.poll() is None and p is not procs["ref"]:
                p.kill()
                p.wait()
    state = {name: {"rc": stopped[name].returncode, "stderr": stopped[name].stderr,
                    "final_exists": outs[name].exists(), "first": first.get(name, []),
                    "committed": _committed(outs[name]),
                    "tmp_left": [p.name for p in Path(str(outs[name]) + ".parts").glob("*.tmp")]
                    if Path(str(outs[name]) + ".parts").is_dir() else []}
             for name in stops}
    # not -q: the reruns say what they resumed
    reruns = {name: _start([a for a in cmds[name] if a != "-q"], d) for name in stops}
    resumed = {name: _finish(p) for name, p in reruns.items()}
    ref = _finish(procs["ref"])
    assert ref.returncode == 0, ref.stderr
    return {"dir": d, "inp": inp, "model": tiny_model, "outs": outs, "cmds": cmds, "stopped": state,
            "resumed": resumed}


def _check_resumed(job, name: str) -> None:
    committed = job["stopped"][name]["committed"]
    p = job["resumed"][name]
    assert p.returncode == 0, p.stderr
    assert f"resuming: {len(committed)} rows already committed" in p.stderr
    m = re.search(r"requests\W+(\d+) \((\d+) resumed", p.stderr)
    assert m and (int(m.group(1)), int(m.group(2))) == (N - len(committed), len(committed)), p.stderr

    out = job["outs"][name]
    rows, ref = _rows(out), _rows(job["outs"]["ref"])
    assert not Path(str(out) + ".parts").exists()
    assert [r["row"] for r in rows] == list(range(N))
    ids = [r["id"] for r in rows]
    assert ids == [f"q{i:03d}" for i in range(N)] and len(set(ids)) == N
    assert all(r["error"] is None for r in rows)
    assert [r["row"] for r in ref] == list(range(N))
    for r, want in zip(rows, ref):
        for key in ("id", "completion", "completion_tokens", "finish_reason", "prompt_tokens"):
            assert r[key] == want[key], (r["row"], key)
    # the rerun did real work too: long rows that were not committed before the stop
    assert any(r["completion_tokens"] > 3 for r in rows if r["row"] not in set(committed))


def test_sigkilled_run_resumes_to_the_same_output(job):
    s = job["stopped"]["out"]
    assert s["rc"] == -signal.SIGKILL, "the job ended before it was killed; grow LONG"
    assert not s["final_exists"]
    assert s["first"] and set(s["first"]) <= set(s["committed"])
    assert 0 < len(s["committed"]) < N and len(set(s["committed"])) == len(s["committed"])
    _check_resumed(job, "out")


def test_ctrl_c_commits_what_finished_then_resumes(job):
    s = job["stopped"]["int"]
    assert s["rc"] == 130, s["stderr"]
    lines = [line for line in s["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: interrupted") and "rerun" in lines[0], s["stderr"]
    assert not s["final_exists"]
    assert not s["tmp_left"]
    assert s["first"] and set(s["first"]) <= set(s["committed"])
    assert 0 < len(s["committed"]) < N and len(set(s["committed"])) == len(s["committed"])
    _check_resumed(job, "int")


def test_sigterm_commits_what_finished_then_resumes(job):
    """What schedulers send: like Ctrl-C, the finished rows are committed and the exit is non-zero."""
    s = job["stopped"]["term"]
    assert s["rc"] == 143, s["stderr"]
    lines = [line for line in s["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and "terminated (SIGTERM)" in lines[0] and "rerun" in lines[0], s["stderr"]
    assert not s["final_exists"] and not s["tmp_left"]
    assert s["first"] and set(s["first"]) <= set(s["committed"])
    _check_resumed(job, "term")


def test_rerun_of_a_complete_output_changes_nothing(job):
    out = job["outs"]["out"]
    before = _digest(out)
    p = _run([a for a in job["cmds"]["out"] if a != "-q"], job["dir"])
    assert "already complete" in p.stderr and "--overwrite" in p.stderr
    assert _digest(out) == before
    assert not Path(str(out) + ".parts").exists()


def test_overwrite_redoes_a_complete_output(job):
    out = job["outs"]["int"]
    stats = job["dir"] / "overwrite.stats.json"
    # --limit keeps it quick; without --overwrite this would be "already complete" and keep all N rows
    p = _run([a for a in job["cmds"]["int"] if a != "-q"] + ["--overwrite", "--limit", "40", "--stats-json", str(stats)],
             job["dir"])
    assert "already complete" not in p.stderr
    s = json.loads(stats.read_text())
    assert s["requests"] == 40 and s["resumed"] == 0 and s["rows_in_output"] == 40
    rows, ref = _rows(out), _rows(job["outs"]["ref"])[:40]
    assert [r["row"] for r in rows] == list(range(40))
    assert [r["completion"] for r in rows] == [r["completion"] for r in ref]
