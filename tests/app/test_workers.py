"""Several engine processes fed from one reader (`--workers 2` on the CPU: the machinery `--gpus`
runs per GPU): outputs identical, row by row, to one process; a worker SIGKILLed mid-job loses
nothing (its rows are redone); the parent SIGKILLed takes its workers with it and the rerun
resumes to the same output."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORDS = "def add(a, b): return a + b for i in range(10): print(i * i) class Point: import os".split()


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
            "COLUMNS": "300"}


def _cmd(inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specbatch", "run", str(inp), "-o", str(out), "--device", "cpu",
            "--max-tokens", "24", "--batch-size", "8", *extra]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _children(pid: int) -> list[int]:
    """Worker processes of `pid` (spawned interpreters; the resource tracker is not one)."""
    kids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "spawn_main" in cmd:
            kids.append(int(d.name))
    return kids


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("workers")
    inp = d / "in.jsonl"
    with open(inp, "w") as f:
        for i in range(300):
            row = {"id": f"q{i}", "prompt": " ".join(WORDS[i % len(WORDS):][: 3 + i % 5])}
            if i == 7:
                row = {"id": "bad", "prompt": ""}
            f.write(json.dumps(row) + "\n")
    ref = d / "ref.jsonl"
    p = subprocess.run(_cmd(inp, ref, "-q"), env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return {"dir": d, "inp": inp, "ref": _rows(ref)}


def _same(rows: list[dict], ref: list[dict]) -> None:
    assert [r["row"] for r in rows] == list(range(len(ref)))
    for r, w in zip(rows, ref):
        for key in ("id", "completion", "completion_tokens", "finish_reason", "error"):
            assert r[key] == w[key], (r["row"], key)


class Proc:
    """A dead worker process's stand-in for WorkerPool._bury: its exit code, a join that returns."""

    def __init__(self, code: int = 1):
        self.exitcode = code
        self.terminated = False

    def terminate(self):
        self.terminated = True

    def join(self, timeout=None):
        pass


class Inbox:
    def cancel_join_thread(self):
        pass


def test_two_workers_write_what_one_process_writes(job):
    out = job["dir"] / "two.jsonl"
    stats = job["dir"] / "two.stats.json"
    p = subprocess.run(_cmd(job["inp"], out, "--workers", "2", "-q", "--stats-json", str(stats)),
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    _same(_rows(out), job["ref"])
    s = json.loads(stats.read_text())
    assert s["device"] == "cpu,cpu" and len(s["workers"]) == 2
    assert all(w["records"] > 0 for w in s["workers"]) and sum(w["records"] for w in s["workers"]) == 300


def _start_and_wait(cmd: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:               # "started:" comes once every worker is loaded
        line = p.stderr.readline()
        if not line or line.startswith("started:"):
            break
    return p


def test_a_worker_killed_mid_job_loses_nothing(job):
    out = job["dir"] / "kill1.jsonl"
    p = _start_and_wait(_cmd(job["inp"], out, "--workers", "2", "--progress-every", "1000"))
    kids = _children(p.pid)
    assert len(kids) == 2, kids
    time.sleep(0.1)
    os.kill(kids[0], signal.SIGKILL)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "died" in err and "go to the other workers (a new worker starts on cpu: restart 1 of 3)" in err
    _same(_rows(out), job["ref"])


def test_a_hung_worker_is_killed_and_its_rows_run_elsewhere(job):
    """A worker whose engine stops moving (a wedged device call; here a stopped process) while it
    holds rows is killed once it has said nothing for the hung limit, and its rows run on the others
    and on its replacement: the job ends with the uninterrupted run's rows (it stalled forever)."""
    out = job["dir"] / "hung.jsonl"
    cmd = _cmd(job["inp"], out, "--workers", "2", "--progress-every", "1000")
    p = subprocess.Popen(cmd, env={**_env(), "SPECBATCH_WORKER_HUNG_S": "4"}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not p.stderr.readline().startswith("started:"):
        pass
    kids = _children(p.pid)
    assert len(kids) == 2, kids
    os.kill(kids[0], signal.SIGSTOP)
    try:
        _, err = p.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(kids[0], signal.SIGKILL)
    assert p.returncode == 0, err
    assert "its engine made no progress in 4 s (hung: killed)" in err and "a new worker starts on cpu" in err
    assert "1 died or hung (their unfinished rows ran on the others" in err and "KV pool" in err    # the summary
    _same(_rows(out), job["ref"])


class Alive(Proc):
    """A live worker process's stand-in: alive until killed."""

    def __init__(self):
        super().__init__(-9)
        self.killed = False

    def is_alive(self):
        return not self.killed

    def kill(self):
        self.killed = True


def test_a_hung_workers_rows_run_alone_and_one_hanging_alone_is_its_error(capsys):
    """The watch kills a worker silent past the limit while holding rows; its rows become suspects
    (each runs alone, as a failed device's in flight), and one that hangs running alone is written as
    its error, not redone: a row that wedges every engine does not take the job down."""
    import multiprocessing as mp

    from specbatch.data import RowRequest
    from specbatch.workers import WorkerPool, _Worker

    ends = []                                    # the workers' ends of their pipes, kept open (silent, alive)

    def pipe():
        reader, writer = mp.Pipe(False)
        ends.append(writer)
        return reader

    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.unstarted, pool.hung_s = "", set(), set(), [], 5.0
    pool._spawn = lambda wid, restarts=0: _Worker(proc=Alive(), inbox=Inbox(), reader=pipe(), device="cpu",
                                                  wid=wid, restarts=restarts)
    rows = {i: RowRequest(row=i, id=f"q{i}", prompt="x", where=f"in.jsonl:{i + 1}") for i in (3, 7)}
    long_ago = time.monotonic() - 10
    quiet = _Worker(proc=Alive(), inbox=Inbox(), reader=pipe(), device="cpu", ready=True,
                    held={3: rows[3]}, heard_at=time.monotonic())         # silent, but not for long: left alone
    hung = _Worker(proc=Alive(), inbox=Inbox(), reader=pipe(), device="cpu", wid=1, ready=True,
                   held=dict(rows), heard_at=long_ago)
    pool.workers = [quiet, hung]
    redo = pool._drain([])
    assert not quiet.dead and hung.dead and hung.proc.killed
    assert pool.suspects == {3, 7} and sorted(r.row for r in redo) == [3, 7]
    assert "its engine made no progress in 5 s (hung: killed)" in capsys.readouterr().err
    # of the rows it holds, those its engine held at its last beat: the others had not started
    pool.suspects = set()
    partly = _Worker(proc=Alive(), inbox=Inbox(), reader=pipe(), device="cpu", wid=3, ready=True,
                     held=dict(rows), heard_at=long_ago, engine_rows=[7, 99])
    pool.workers = [partly]
    assert sorted(r.row for r in pool._drain([])) == [3, 7] and pool.suspects == {7}
    alone = _Worker(proc=Alive(), inbox=Inbox(), reader=pipe(), device="cpu", wid=2, ready=True,
                    held={7: rows[7]}, alone=7, heard_at=long_ago, engine_rows=[])
    pool.workers, out = [alone], []
    assert pool._drain(out) == [] and [r["row"] for r in out] == [7]
    assert "in.jsonl:8: " in out[0]["error"] and "no progress in 5 s" in out[0]["error"] and 7 not in pool.suspects


@pytest.mark.parametrize("value, ok", [(None, 600.0), ("4", 4.0), ("10m", None), ("0", None), ("-3", None),
                                       ("nan", None)])
def test_the_hung_limit_is_seconds_of_at_least_one(monkeypatch, value, ok):
    from specbatch.workers import HUNG_ENV, hung_limit

    if value is None:
        monkeypatch.delenv(HUNG_ENV, raising=False)
    else:
        monkeypatch.setenv(HUNG_ENV, value)
    if ok is not None:
        assert hung_limit() == ok
    else:
        with pytest.raises(ValueError, match=rf"^{HUNG_ENV}={value}: expected the seconds a worker may make no "):
            hung_limit()


def test_workers_lost_are_those_that_died_once_started():
    from specbatch.workers import WorkerPool, _Worker

    pool = WorkerPool.__new__(WorkerPool)
    pool.workers = [_Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", dead=True),        # at start
                    _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", dead=True, ready=True),
                    _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", dead=True, restarts=1),
                    _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", ready=True)]
    assert [w["lost"] for w in pool.per_worker()] == [False, True, True, False]


def test_a_replaced_worker_takes_rows_and_restarts_are_bounded(capsys):
    """A worker that dies mid-job is replaced on its device (its replacement counted), up to
    MAX_RESTARTS, and so is a replacement that dies while loading; one that dies at the job's start
    is not (wait_ready says it, once)."""
    from specbatch.workers import MAX_RESTARTS, WorkerPool, _Worker


    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.unstarted = "", set(), set(), []
    spawned = []

    def spawn(wid, restarts=0):
        spawned.append((wid, restarts))
        return _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", wid=wid, restarts=restarts,
                       ready=True)
    pool._spawn = spawn
    pool.workers = [_Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", wid=1, ready=True)]
    for _ in range(MAX_RESTARTS + 1):
        pool._bury(pool.workers[-1], [], [])
    assert spawned == [(1, n) for n in range(1, MAX_RESTARTS + 1)] and all(w.dead for w in pool.workers)
    err = capsys.readouterr().err.splitlines()
    assert "restart 1 of 3" in err[0] and "restart 3 of 3" in err[2] and "rerun to resume" in err[3]
    assert "(no new worker on cuda:1: its 3 restarts are spent)" in err[3]
    starting = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", wid=0, error="x")   # never ready
    pool.workers.append(starting)
    pool._bury(starting, [], [])
    assert len(spawned) == MAX_RESTARTS
    assert capsys.readouterr().err == "" and pool.unstarted == ["worker on cuda:0 failed to start (x)"]
    # a replacement that dies while loading (the dead one's memory not yet freed) is replaced in turn
    loading = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:2", wid=2, restarts=1, error="x")
    pool.workers.append(loading)
    pool._bury(loading, [], [])
    assert spawned[-1] == (2, 2)
    assert "worker on cuda:2 died while loading its engine (x); its 0 unfinished rows go to the other workers (a " \
           "new worker starts on cuda:2: restart 2 of 3)" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["stop", "let go", "end"])
def test_a_stop_passing_through_the_pool_does_not_wait_for_the_workers(how):
    """Ctrl-C or SIGTERM passing through stream() tells the workers to end but does not wait for
    them (a hung one held the commit of the finished rows up to 15 s, past a scheduler's grace
    period): the job commits, then close()s. A consumer letting go, or the rows' end, closes."""
    from specbatch.workers import WorkerPool, _Worker

    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.unstarted = "", set(), set(), []
    calls = []
    pool.stop, pool.close = (lambda: calls.append("stop")), (lambda: calls.append("close"))
    pool._drain = lambda out: []
    worker = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cpu", ready=True)
    worker.inbox.put = lambda items: None
    pool.workers = [worker]

    def rows():
        if how == "stop":
            raise KeyboardInterrupt
        yield from ()

    stream = pool.stream(rows())
    if how == "stop":
        with pytest.raises(KeyboardInterrupt):
            next(stream)
    elif how == "end":
        worker.done = True
        assert list(stream) == []
    else:
        worker.held[0] = object()                # rows in hand: the stream goes on until closed
        pool._drain = lambda out: out.append({"row": 0}) or []
        next(stream)
        stream.close()
    assert calls == ["stop" if how == "stop" else "close"]


def test_the_parent_killed_takes_its_workers_and_the_rerun_resumes(job):
    out = job["dir"] / "killp.jsonl"
    cmd = _cmd(job["inp"], out, "--workers", "2", "--progress-every", "1000")
    p = _start_and_wait(cmd)
    kids = _children(p.pid)
    assert len(kids) == 2
    time.sleep(0.5)
    p.kill()
    p.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{k}").exists() and
                                              "spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="ignore")
                                              for k in kids):
        time.sleep(0.1)
    assert not any(Path(f"/proc/{k}").exists() for k in kids if
                   "spawn_main" in (Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="ignore")
                                    if Path(f"/proc/{k}").exists() else "")), "orphan workers"
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    _same(_rows(out), job["ref"])


def test_workers_that_cannot_start_are_a_one_line_error(tmp_path):
    """Every worker refusing the settings is what one process says: one line, exit 2 (it was an
    uncaught WorkerError, a traceback and exit 1)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    p = subprocess.run([sys.executable, "-m", "specbatch", "run", str(inp), "-o", str(tmp_path / "o.jsonl"),
                        "--device", "cpu", "--max-model-len", "99999", "--workers", "2", "-q"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "max_position_embeddings" in last


def test_each_dead_worker_is_named_by_its_own_end(capsys):
    """Two workers killed: each warning says how that one ended (the second repeated the first's),
    and the last one's rows wait for a rerun (there are no other workers to take them)."""
    from specbatch.workers import WorkerPool, _Worker


    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.unstarted = "", []
    spent = {"ready": True, "restarts": 3}          # mid-job, no restart left (none spawned here)
    pool.workers = [_Worker(proc=Proc(-9), inbox=Inbox(), reader=None, device="cuda:0", held={1: "r"}, **spent),
                    _Worker(proc=Proc(3), inbox=Inbox(), reader=None, device="cuda:1", held={2: "r"}, **spent)]
    redo: list = []
    pool._bury(pool.workers[0], redo, [])
    pool._bury(pool.workers[1], redo, [])
    err = capsys.readouterr().err.splitlines()
    assert "cuda:0: worker killed by signal 9" in err[0] and "go to the other workers" in err[0]
    assert "cuda:1: worker exited with code 3" in err[1] and "rerun to resume" in err[1]
    assert redo == ["r", "r"] and pool.last_error == "cuda:1: worker exited with code 3"


def test_a_device_failure_makes_suspects_and_one_alone_is_the_error(capsys):
    """A worker whose device failed with rows in flight makes them suspects (each to run alone);
    one that failed running a suspect alone writes that row as its error, not redone."""
    from specbatch.data import RowRequest
    from specbatch.workers import WorkerPool, _Worker


    rows = {i: RowRequest(row=i, id=f"q{i}", prompt="x", where=f"in.jsonl:{i + 1}") for i in range(6)}
    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.unstarted = "", set(), set(), []
    spent = {"ready": True, "restarts": 3}          # mid-job, no restart left (none spawned here)
    many = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", held={i: rows[i] for i in (0, 1, 2)},
                   error="cuda:0: DeviceFailed: boom", in_flight=[1, 2], **spent)
    alone = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", held={4: rows[4]},
                    error="cuda:1: DeviceFailed: boom", in_flight=[4], alone=4, **spent)
    pool.workers = [many, alone, _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:2")]
    redo, out = [], []
    pool._bury(many, redo, out)
    assert pool.suspects == {1, 2} and [r.row for r in redo] == [0, 1, 2] and out == []
    redo.clear()
    pool._bury(alone, redo, out)
    assert redo == [] and [r["row"] for r in out] == [4] and 4 in pool.delivered
    assert out[0]["error"].startswith("in.jsonl:5: the device failed while this row ran alone (cuda:1: DeviceFailed")
    assert "it ran row 4 alone, which is written as its error" in capsys.readouterr().err


def test_rows_that_failed_alone_wait_for_their_worker_to_finish_a_row(capsys):
    """A row that failed alone in a worker is written once that worker's engine finishes a row
    after it, or when the job ends; its hands are free meanwhile (a draining worker takes the next
    suspect). A worker that ends (its engine failed on a third in a row: EngineFailed) hands the
    rows it held that way to the others, with the rest it held, instead of their being written as
    errors."""
    from specbatch.data import RowRequest
    from specbatch.records import error_record
    from specbatch.workers import WorkerPool, _Worker

    rows = {i: RowRequest(row=i, id=f"q{i}", prompt="x", where=f"in.jsonl:{i + 1}") for i in range(8)}

    def failed(i):
        return ("failed_alone", error_record(i, f"q{i}", f"in.jsonl:{i + 1}: failed alone", {}))

    def ok(i):
        return ("rec", {**error_record(i, f"q{i}", "", {}), "error": None, "completion": "fine"})

    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.errors = "", set(), set(), []
    spawned = []
    pool._spawn = lambda wid, restarts=0: spawned.append(wid) or _Worker(
        proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", wid=wid, restarts=restarts)
    w = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", held=dict(rows), ready=True)
    pool.workers = [w, _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:1", ready=True)]
    out = []
    for kind, payload in (failed(0), failed(1)):
        pool._heard(w, kind, payload, out)
    assert out == [] and 0 not in w.held and 1 not in w.held and not pool.delivered
    pool._heard(w, *ok(2), out)
    assert [(r["row"], r["error"] is None) for r in out] == [(0, False), (1, False), (2, True)]
    out.clear()
    pool._heard(w, *failed(3), out)
    pool._heard(w, "done", {}, out)                     # the job ended: what it held is written
    assert [r["row"] for r in out] == [3] and pool.delivered == {0, 1, 2, 3}

    w = _Worker(proc=Proc(), inbox=Inbox(), reader=None, device="cuda:0", held=dict(rows), ready=True)
    pool.workers[0], out, redo = w, [], []
    for i in (4, 5):
        pool._heard(w, *failed(i), out)
    pool._heard(w, "error", "cuda:0: EngineFailed: the engine failed on 3 rows one after another", out)
    pool._bury(w, redo, out)                            # it ended itself on the third (row 6)
    assert out == [] and w.dead and spawned == [0] and not w.unvouched
    assert sorted(r.row for r in redo) == list(range(8)) and not pool.delivered & {4, 5, 6}
    assert "its 8 unfinished rows go to the other workers" in capsys.readouterr().err


def test_a_worker_that_ends_after_done_is_not_buried(capsys):
    """A worker closes its pipe as it exits, right after "done": the parent may read both in one
    drain. The end of a finished worker is not a death (no warning, no replacement started)."""
    import multiprocessing as mp

    from specbatch.workers import WorkerPool, _Worker

    pool = WorkerPool.__new__(WorkerPool)
    pool.last_error, pool.suspects, pool.delivered, pool.errors = "", set(), set(), []
    spawned = []
    pool._spawn = lambda wid, restarts=0: spawned.append(wid)
    reader, writer = mp.Pipe(duplex=False)
    w = _Worker(proc=Proc(0), inbox=Inbox(), reader=reader, device="cpu", ready=True, ended=True)
    pool.workers = [w]
    writer.send(("done", 0, {"tokens_emitted": 5}))
    writer.close()                                    # it exited: EOF follows "done" in the pipe
    assert pool._drain([]) == []
    assert w.done and not w.dead and spawned == [] and w.stats["tokens_emitted"] == 5
    assert "died" not in capsys.readouterr().err


def test_workers_holding_different_contexts_are_named_and_the_smallest_recorded(monkeypatch, capsys):
    """GPUs of different memory with --max-model-len unset: each engine's pool sets its own context;
    the job says so in one line and records the smallest (the output's manifest compares it)."""
    from specbatch import workers
    from specbatch.job import JobOptions, _Runner
    from specbatch.recipe import load_recipe

    class Pool:
        def __init__(self, *a, **kw):
            pass

        def wait_ready(self):
            pass

        def per_worker(self):
            return [{"device": "cuda:0", "max_model_len": 131072, "capture_s": 1.0, "died": False},
                    {"device": "cuda:1", "max_model_len": 60000, "capture_s": 2.0, "died": False},
                    {"device": "cuda:2", "max_model_len": 9000, "died": True}]      # died after its start: not counted

    monkeypatch.setattr(workers, "WorkerPool", Pool)
    runner = _Runner(load_recipe("vanilla"), JobOptions(gpus="0,1"), ["cuda:0", "cuda:1"])
    assert runner.max_len == 60000 and runner.capture_s == 2.0
    assert capsys.readouterr().err == (
        "warning: the workers' engines hold different contexts (cuda:0: 131072, cuda:1: 60000 tokens): rows "
        "reaching past 60000 tokens end differently by worker; a new output started with --max-model-len 60000 "
        "has one\n")
    cpu = [{"device": "cpu", "max_model_len": 512, "died": False}, {"device": "cpu", "max_model_len": 500, "died": False}]
    monkeypatch.setattr(Pool, "per_worker", lambda self: cpu)
    assert _Runner(load_recipe("vanilla"), JobOptions(gpus="0,1"), ["cpu", "cpu"]).max_len == 500
    assert "(cpu #0: 512, cpu #1: 500 tokens)" in capsys.readouterr().err      # the same name: told apart
    cpu[1]["max_model_len"] = 512
    assert _Runner(load_recipe("vanilla"), JobOptions(gpus="0,1"), ["cpu", "cpu"]).max_len == 512
    assert capsys.readouterr().err == ""


class _StubPool:
    """A WorkerPool of two CPU workers that are always ready; tests give it a stream."""
    eager = False

    def __init__(self, *a, **kw):
        self.suspects: set = set()

    def wait_ready(self):
        pass

    def per_worker(self):
        return [{"device": "cpu", "max_model_len": 512, "died": False}] * 2

    def close(self):
        pass


def _record(r) -> dict:
    """A finished row's record as a worker sends it."""
    return {"row": r.row, "id": r.id, "text": "x", "completion": "x", "error": None, "finish_reason": "length",
            "prompt_tokens": 1, "completion_tokens": 1, "output_token_ids": [1],
            "spec": {"verify_steps": 1, "draft_tokens": 0, "accepted_tokens": 0, "accept_length": 1.0,
                     "accept_histogram": [1]}}


def test_a_failing_output_stops_the_workers_before_the_error_leaves_the_job(tmp_path, monkeypatch):
    """Disk full under --gpus: the workers stop before the OutputError reaches the caller, not when
    the pool's stream is collected (a library caller may hold the traceback for a long time)."""
    from specbatch import workers
    from specbatch.data import OutputError, writer as writer_mod
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    events = []

    class Pool(_StubPool):
        def stream(self, rows):
            for r in rows:
                yield _record(r)
            events.append("stream ended")

        def close(self):
            events.append("closed")

    def full(*a, **kw):
        raise OutputError("o.jsonl: [Errno 28] No space left on device")

    monkeypatch.setattr(workers, "WorkerPool", Pool)
    monkeypatch.setattr(writer_mod.OutputWriter, "add", full)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    with pytest.raises(OutputError) as caught:
        run_job(str(inp), load_recipe("vanilla"), JobOptions(workers=2, output=str(tmp_path / "o.jsonl")))
    assert events == ["closed"] and caught.value is not None     # closed while the traceback is still held


def test_a_restarted_worker_holding_another_context_is_named(capsys):
    """A worker restarted mid-job builds its engine again; with --max-model-len unset its context
    follows the memory free then. One that differs from the job's is said, a first start is not
    (the job compares those together)."""
    from specbatch.workers import WorkerPool, _Worker

    pool = WorkerPool.__new__(WorkerPool)
    pool.context = 60000
    first = _Worker(proc=Proc(0), inbox=Inbox(), reader=None, device="cuda:1")
    pool._heard(first, "ready", {"max_model_len": 50000, "slots": 8}, [])
    assert first.ready and capsys.readouterr().err == ""
    again = _Worker(proc=Proc(0), inbox=Inbox(), reader=None, device="cuda:1", restarts=1)
    pool._heard(again, "ready", {"max_model_len": 60000, "slots": 8}, [])
    assert capsys.readouterr().err == ""
    shrunk = _Worker(proc=Proc(0), inbox=Inbox(), reader=None, device="cuda:1", restarts=2)
    pool._heard(shrunk, "ready", {"max_model_len": 50000, "slots": 8}, [])
    assert capsys.readouterr().err == (
        "warning: the new worker on cuda:1 holds a context of 50000 tokens where the job's is 60000: rows reaching "
        "past 50000 tokens end differently on it; a new output started with --max-model-len 50000 has one\n")


@pytest.mark.parametrize("output", ["o.jsonl", "-"])
def test_the_workers_failing_says_what_a_rerun_finds(tmp_path, monkeypatch, capsys, output):
    """Every worker died: committed parts for a rerun to resume from, or (-o -) nothing: the job's
    line says which, never promising a resume that stdout cannot give."""
    from specbatch import workers
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe
    from specbatch.resolve import JobError

    class Pool(_StubPool):
        def stream(self, rows):
            yield _record(next(iter(rows)))
            raise workers.WorkerError("every worker died; the last said: boom")

    monkeypatch.setattr(workers, "WorkerPool", Pool)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    out = output if output == "-" else str(tmp_path / output)
    with pytest.raises(JobError) as caught:
        run_job(str(inp), load_recipe("vanilla"), JobOptions(workers=2, output=out))
    if output == "-":
        assert str(caught.value).endswith("boom; finished rows went to stdout; -o - keeps nothing to resume from, so "
                                          "a rerun starts over")
    else:
        assert str(caught.value).endswith("boom; finished rows are committed, rerun the same command to resume")
