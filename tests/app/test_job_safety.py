"""Whole jobs through the CLI (in process) that must never lose or mix a user's data, and never
silently do other than asked: changed inputs under a resume, the output lock, the input as the
output, stdout output, quiet and logged progress, exit codes."""
from __future__ import annotations

import json
import os
import re

import pyarrow.parquet as pq
import pytest

from specbatch.cli import EXIT_FAILED, EXIT_USAGE
from specbatch.data import OutputWriter

from cli_runner import cli, ok
from errors import one_line_cli_error

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox",
           "while True:", "print(i * i)", "Hello world!"]


pytestmark = pytest.mark.usefixtures("one_thread")


def lines(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def write(path, rows):
    path.write_text(lines(rows))
    return path


def read(path):
    if str(path).endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    return [json.loads(x) for x in open(path)]


@pytest.fixture
def base(tiny_model):
    return ["--model", tiny_model, "--max-tokens", 4, "--batch-size", 2, "--device", "cpu", "-q"]


ROWS = [{"id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)]} for i in range(12)]


def _interrupted(inp, out, base, after):
    """A run stopped (Ctrl-C) after `after` finished rows: its parts stay for a resume."""
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    seen = []

    def stop(event, info):
        if event == "record":
            seen.append(info["record"]["row"])
            if len(seen) == after:
                raise KeyboardInterrupt

    model = base[base.index("--model") + 1]
    recipe = load_recipe("vanilla").with_overrides(model=str(model), max_tokens=4, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        run_job(str(inp), recipe, JobOptions(output=str(out), device="cpu"), progress=stop)
    assert os.path.isdir(str(out) + ".parts")


# ---------------------------------------------------------------- the input under a resume

def test_an_edited_row_is_refused_naming_it(tmp_path, base):
    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet"
    _interrupted(inp, out, base, after=6)
    committed = sorted(r for p in (tmp_path / "o.parquet.parts").glob("part-*") for r in pq.read_table(p)["row"].to_pylist())
    edited = [dict(r) for r in ROWS]
    edited[committed[1]]["prompt"] = "something else"
    write(inp, edited)
    line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_USAGE)
    assert f"row {committed[1]} differs" in line and "--overwrite" in line
    # --overwrite starts over on the new input
    ok("run", inp, "-o", out, *base, "--overwrite")
    assert [r["id"] for r in read(out)] == [r["id"] for r in edited]


def test_a_deleted_first_line_is_refused(tmp_path, base):
    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.jsonl"
    _interrupted(inp, out, base, after=6)
    write(inp, ROWS[1:])
    line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_USAGE)
    assert re.search(r"row \d+ differs", line)
    assert os.path.isdir(str(out) + ".parts") and not out.exists()


def test_another_stdin_is_refused(tmp_path, base):
    out = tmp_path / "s.parquet"
    a = lines(ROWS[:5])
    ok("run", "-", "-o", out, *base, input=a)
    b = lines([{"id": "x", "prompt": "different"}] + ROWS[1:5])
    line = one_line_cli_error(cli("run", "-", "-o", out, *base, input=b), EXIT_USAGE)
    assert "<stdin>" in line and "rows 0-" in line and "differ" in line
    # the same stdin again: complete, nothing changes
    before = out.read_bytes()
    ok("run", "-", "-o", out, *base, input=a)
    assert out.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".stdin-" in n]


def test_rows_appended_after_a_finished_job_are_generated(tmp_path, base):
    inp, out = write(tmp_path / "in.jsonl", ROWS[:6]), tmp_path / "o.parquet"
    ok("run", inp, "-o", out, *base)
    first = read(out)
    write(inp, ROWS)
    stats = tmp_path / "s.json"
    ok("run", inp, "-o", out, *base, "--stats-json", stats)
    s = json.loads(stats.read_text())
    assert s["resumed"] == 6 and s["requests"] == 6
    rows = read(out)
    assert [r["id"] for r in rows] == [r["id"] for r in ROWS] and rows[:6] == first


# ---------------------------------------------------------------- the output

def test_a_second_run_on_the_same_output_is_refused(tmp_path, base):
    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "c.parquet"
    with OutputWriter(str(out), fingerprint={"held": True}):
        line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_USAGE)
    assert "in use by another specbatch run" in line and f"pid {os.getpid()}" in line
    ok("run", inp, "-o", out, *base)
    assert len(read(out)) == len(ROWS)


@pytest.mark.parametrize("how", ["same", "relative", "link"])
def test_the_input_is_never_the_output(tmp_path, base, how, monkeypatch):
    inp = write(tmp_path / "same.jsonl", ROWS)
    before = inp.read_bytes()
    out = inp
    if how == "relative":
        monkeypatch.chdir(tmp_path)
        out = "./sub/../same.jsonl"
        os.mkdir(tmp_path / "sub")
    elif how == "link":
        out = tmp_path / "alias.jsonl"
        os.symlink(inp, out)
    for extra in ((), ("--overwrite",)):
        line = one_line_cli_error(cli("run", inp, "-o", out, *base, *extra), EXIT_USAGE)
        assert "is the input file" in line
    assert inp.read_bytes() == before


@pytest.mark.parametrize("where", ["input", "output"])
@pytest.mark.parametrize("url", ["https://example.com/batch.jsonl", "s3://bucket/batch.jsonl"])
def test_a_url_is_refused_before_anything_runs(tmp_path, base, monkeypatch, where, url):
    """vllm run-batch reads and writes http(s) URLs; pyarrow would take s3:// for its own filesystems
    and the job would fail only at assembly, after every row ran, and again on every rerun."""
    monkeypatch.chdir(tmp_path)
    inp = write(tmp_path / "in.jsonl", ROWS)
    args = ("run", url, "-o", tmp_path / "o.jsonl") if where == "input" else ("run", inp, "-o", url)
    line = one_line_cli_error(cli(*args, *base), EXIT_USAGE)
    assert url in line and "a URL" in line and ("download it first" if where == "input" else "local path") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]       # no parts under ./https:/...


def test_output_on_stdout_in_input_order(tmp_path, base):
    inp = write(tmp_path / "in.jsonl", ROWS)
    r = ok("run", inp, "-o", "-", *base)
    got = [json.loads(x) for x in r.stdout.splitlines()]
    assert [g["row"] for g in got] == list(range(len(ROWS))) and [g["id"] for g in got] == [x["id"] for x in ROWS]
    ref = tmp_path / "ref.jsonl"
    ok("run", inp, "-o", ref, *base)
    assert [g["completion"] for g in got] == [x["completion"] for x in read(ref)]


@pytest.mark.parametrize("stop, code, said", [(KeyboardInterrupt, 130, "interrupted"),
                                              ("Terminated", 143, "terminated (SIGTERM)")])
def test_a_stopped_stdout_run_says_what_it_wrote_and_that_a_rerun_starts_over(tmp_path, base, monkeypatch,
                                                                             stop, code, said):
    """-o - keeps no parts: the stop's line counts the lines on stdout (rows finished behind an
    unfinished one are not among them) and does not promise a resume."""
    from specbatch import cli as cli_mod
    from specbatch.progress import ProgressView

    stop = getattr(cli_mod, stop) if isinstance(stop, str) else stop
    real, seen = ProgressView.update, []

    def update(self, event, info):
        real(self, event, info)
        if event == "record":
            seen.append(info["record"]["row"])
            if sorted(seen) != list(range(len(seen))) or len(seen) == 7:     # at the first gap
                raise stop()

    monkeypatch.setattr(ProgressView, "update", update)
    inp = write(tmp_path / "in.jsonl", [dict(r, max_tokens=1 + 5 * (i % 3 == 0)) for i, r in enumerate(ROWS)])
    i = base.index("--max-tokens")
    r = cli("run", inp, "-o", "-", *base[:i], *base[i + 2:])          # the rows' own max_tokens: out of order
    line = one_line_cli_error(r, code)
    written = next(n for n in range(8) if n not in seen)          # rows go out in order: up to the first gap
    assert 0 < written < len(seen), seen                           # the rows' lengths finish them out of order
    assert [json.loads(x)["row"] for x in r.stdout.splitlines()] == list(range(written))
    assert line.startswith(f"error: {said}; {written} rows were written to stdout") and "starts over" in line
    assert f"({len(seen) - written} finished rows waited behind unfinished ones and were not)" in line
    assert "committed" not in line and "rerun the same command" not in line


def test_a_second_ctrl_c_does_not_cut_the_commit_and_the_count_has_earlier_runs_rows(tmp_path, base, monkeypatch):
    """Ctrl-C pressed twice: the second lands while the finished rows are committed, which it must
    not cut (they were lost while the message said they were kept); the stop's count is what a
    rerun resumes from, earlier runs' rows included, and equals what the parts hold."""
    import signal

    from specbatch.data.writer import OutputWriter
    from specbatch.progress import ProgressView

    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet"
    _interrupted(inp, out, base, after=3)                   # an earlier run committed 3 rows
    real_update, real_commit, seen = ProgressView.update, OutputWriter.commit, []

    def update(self, event, info):
        real_update(self, event, info)
        if event == "record":
            seen.append(info["record"]["row"])
            if len(seen) == 2:
                raise KeyboardInterrupt

    def commit(self, *a, **kw):
        if seen:                                           # the stop's commit: a second Ctrl-C arrives
            os.kill(os.getpid(), signal.SIGINT)
        return real_commit(self, *a, **kw)

    monkeypatch.setattr(ProgressView, "update", update)
    monkeypatch.setattr(OutputWriter, "commit", commit)
    # Ctrl-C as a terminal delivers it (a shell's background job, CI's, starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        line = one_line_cli_error(cli("run", inp, "-o", out, *base), 130)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler      # (held for the commit only)
    finally:
        signal.signal(signal.SIGINT, previous)
    held = sorted(r for p in (tmp_path / "o.parquet.parts").glob("part-*") for r in pq.read_table(p)["row"].to_pylist())
    assert len(held) == 5
    assert line == "error: interrupted; 5 finished rows are committed, rerun the same command to resume"
    monkeypatch.undo()
    ok("run", inp, "-o", out, *base)
    assert len(read(out)) == len(ROWS)


# ---------------------------------------------------------------- what the user sees

def test_quiet_prints_nothing_and_logs_get_progress_lines(tmp_path, base):
    inp = write(tmp_path / "in.jsonl", ROWS)
    r = ok("run", inp, "-o", tmp_path / "q.parquet", *base)
    assert r.stderr == ""
    loud = [a for a in base if a != "-q"]
    r = ok("run", inp, "-o", tmp_path / "l.parquet", *loud, "--progress-every", "0.1")
    assert "started: 12 rows on cpu" in r.stderr
    assert "output tokens/s" in r.stderr and "model load" in r.stderr
    progress = [x for x in r.stderr.splitlines() if x.startswith("progress:")]
    for p in progress:
        assert re.match(r"progress: \d+/12 rows \(\d+\.\d%\), \d+ tok/s, 0 errors, accept \d\.\d\d, "
                        r"elapsed \dm\d\ds, ETA (\dm\d\ds|\?)$", p), p
    # the steps that read every committed row are said (a million rows take minutes to check or merge),
    # and no progress line follows the last row's
    lines = r.stderr.splitlines()
    assembling = lines.index(f"assembling 12 rows into {tmp_path / 'l.parquet'}")
    assert not [x for x in lines[assembling:] if x.startswith("progress:")]
    write(inp, ROWS + ROWS[:2])
    r = ok("run", inp, "-o", tmp_path / "l.parquet", *loud)
    assert r.stderr.startswith(f"checking the input against the 12 rows committed in {tmp_path / 'l.parquet'}\n"
                               "resuming: 12 rows already committed\n"), r.stderr
    assert f"assembling 14 rows into {tmp_path / 'l.parquet'}" in r.stderr


def test_progress_lines_keep_coming_while_no_row_finishes(tmp_path, base):
    """In a log, long rows on a full batch finish minutes apart: a line every --progress-every
    seconds still comes, its tok/s counting tokens as they are generated."""
    inp = write(tmp_path / "in.jsonl", [{"prompt": "def f():", "max_tokens": 400, "ignore_eos": True}] * 2)
    loud = [a for a in base if a != "-q"]
    r = ok("run", inp, "-o", tmp_path / "p.jsonl", *loud, "--progress-every", "0.1")
    waiting = [x for x in r.stderr.splitlines() if x.startswith("progress: 0/2 rows")]
    assert waiting, r.stderr
    assert any(int(re.search(r"(\d+) tok/s", x).group(1)) > 0 for x in waiting), waiting


def test_a_line_still_being_written_is_added_once_complete(tmp_path, base):
    """Run over a JSONL file whose producer is still writing its last line: the partial line is
    not run (nor committed as an error row); once complete, a rerun adds it to the finished output."""
    inp = tmp_path / "grow.jsonl"
    lines = [json.dumps(r) + "\n" for r in ROWS[:4]]
    inp.write_text("".join(lines[:3]) + lines[3][:-9])
    out = tmp_path / "grow.out.jsonl"
    r = ok("run", inp, "-o", out, *base)
    assert f"warning: {inp}:4: the last line has no newline" in r.stderr and len(read(out)) == 3
    inp.write_text("".join(lines))
    ok("run", inp, "-o", out, *base)
    assert [x["id"] for x in read(out)] == [x["id"] for x in ROWS[:4]] and not any(x["error"] for x in read(out))


def test_stdout_closed_by_its_reader_stops_quietly(tmp_path, tiny_model):
    """`specbatch run ... -o - | head -1`: once the reader closes the pipe, the run stops as a
    piped tool does (exit 141, one plain line, no error and no traceback). With `2>&1 | head`,
    stderr goes too: a progress line must neither end the job nor (as rich's console does on a
    broken pipe) point stdout at /dev/null and generate every row into nothing."""
    import subprocess
    import sys

    long = write(tmp_path / "long.jsonl", [{"id": i, "prompt": "def f():"} for i in range(2000)])  # (never done first)
    short = write(tmp_path / "short.jsonl", [{"id": i, "prompt": "def f():"} for i in range(32)])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "o.jsonl"
    base = [sys.executable, "-m", "specbatch", "run", "--model", str(tiny_model), "--device", "cpu",
            "--max-tokens", "12", "--ignore-eos", "--batch-size", "2"]
    runs = [(subprocess.Popen([*base, long, "-o", "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env), 141)]
    runs += [(subprocess.Popen([*base, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env), code)
             for args, code in (([long, "-o", "-", "--progress-every", "0.1"], 141),
                                ([short, "-o", str(out), "--progress-every", "1000"], 0))]  # (three at once: start-up)
    first = runs[0][0]
    assert json.loads(first.stdout.readline())["row"] == 0
    for p, _ in runs:
        p.stdout.readline()
        p.stdout.close()                                      # the reader has what it wanted
    err = first.stderr.read().decode()
    assert [p.wait(timeout=120) for p, _ in runs] == [code for _, code in runs], err
    assert "error" not in err and "Traceback" not in err and "stdout was closed by its reader after" in err
    assert len(read(out)) == 32


def test_version():
    from specbatch import __version__

    r = ok("--version")
    assert r.stdout.strip() == f"specbatch {__version__}"


def test_a_job_where_every_row_failed_exits_non_zero(tmp_path, base):
    inp = write(tmp_path / "bad.jsonl", [{"prompt": ""}, {"prompt": 5}])
    out = tmp_path / "bad.parquet"
    line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_FAILED)
    assert "every row failed (2 rows)" in line and f"{out} holds each one's error" in line
    line = one_line_cli_error(cli("run", inp, "-o", "-", *base), EXIT_FAILED)
    assert "every row failed (2 rows); the lines on stdout hold each one's error" in line
    assert [r["error"] is not None for r in read(out)] == [True, True]
    # a rerun whose new rows all fail, over an output of good rows: not every row failed
    good = tmp_path / "good.jsonl"
    write(good, [{"prompt": "def f():"}])
    out = tmp_path / "good.parquet"
    ok("run", good, "-o", out, *base)
    write(good, [{"prompt": "def f():"}, {"prompt": ""}])
    ok("run", good, "-o", out, *base)
    assert [r["error"] is not None for r in read(out)] == [False, True]


def test_fail_fast_exits_1_for_a_bad_row_only(tmp_path, base):
    """Exit 1 under --fail-fast is the rows' doing; a problem with the job itself stays exit 2."""
    inp = write(tmp_path / "in.jsonl", ROWS[:2])
    one_line_cli_error(cli("run", inp, "-o", inp, *base, "--fail-fast"), EXIT_USAGE)
    out = tmp_path / "o.parquet"
    ok("run", inp, "-o", out, *base, "--fail-fast")
    write(inp, [ROWS[1], ROWS[0]])                       # the input the output was made from, edited
    line = one_line_cli_error(cli("run", inp, "-o", out, *base, "--fail-fast"), EXIT_USAGE)
    assert "differ from the rows" in line
    bad = write(tmp_path / "bad.jsonl", [{"prompt": 5}])
    one_line_cli_error(cli("run", bad, "-o", tmp_path / "b.parquet", *base, "--fail-fast"), EXIT_FAILED)


def test_stats_json_that_cannot_be_written_fails_before_the_job(tmp_path, base):
    inp = write(tmp_path / "in.jsonl", ROWS)
    blocker = tmp_path / "f"
    blocker.write_text("")
    line = one_line_cli_error(cli("run", inp, "-o", tmp_path / "o.parquet", *base, "--stats-json", blocker / "s.json"),
                              EXIT_USAGE)
    assert "--stats-json" in line and str(blocker) in line
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("target", ["input", "output", "sidecar"])
def test_stats_json_is_never_the_input_or_the_output(tmp_path, base, target):
    """--stats-json is written after the job: naming the input (or the output, or its manifest)
    there would replace the user's data with the summary."""
    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.jsonl"
    before = inp.read_bytes()
    path = {"input": inp, "output": out, "sidecar": tmp_path / "o.jsonl.manifest.json"}[target]
    line = one_line_cli_error(cli("run", inp, "-o", out, *base, "--stats-json", path), EXIT_USAGE)
    assert "--stats-json" in line and str(path) in line
    assert inp.read_bytes() == before and not out.exists()


@pytest.mark.parametrize("flag,value,expect", [("--top-p", "2", "--top-p: expected 0 < top_p <= 1"),
                                                ("--temperature", "-1", "--temperature: expected a number >= 0"),
                                                ("--batch-size", "0", "--batch-size: expected an integer >= 1"),
                                                ("--gpu-memory-utilization", "1.5",
                                                 "--gpu-memory-utilization: expected a number in (0, 1]")])
def test_bad_flags_are_named_as_flags(tmp_path, base, flag, value, expect):
    inp = write(tmp_path / "in.jsonl", ROWS)
    line = one_line_cli_error(cli("run", inp, *base, flag, value), EXIT_USAGE)
    assert expect in line and "sampling." not in line.split(":")[0]
    assert "or null" not in line                          # the recipe key's null is no value for a flag


def test_gpu_memory_utilization_reaches_the_engine(tmp_path, base):
    """The flag travels with the recipe to the engine, which on a CPU says it does not apply."""
    inp, out = write(tmp_path / "in.jsonl", ROWS[:2]), tmp_path / "o.jsonl"
    r = cli("run", inp, "-o", out, *base, "--gpu-memory-utilization", "0.5")
    assert r.exit_code == 0 and "warning: gpu_memory_utilization 0.5 is a GPU's share" in r.stderr


def test_disk_full_is_one_line_and_keeps_the_committed_rows(tmp_path, base, monkeypatch):
    import errno

    from specbatch.data import writer as writer_mod

    inp, out = write(tmp_path / "in.jsonl", ROWS * 30), tmp_path / "full.parquet"
    real, calls = writer_mod.pq.write_table, []

    def full_after_one(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(writer_mod.pq, "write_table", full_after_one)
    line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_USAGE)
    assert "ENOSPC" in line and ".parts" in line
    monkeypatch.setattr(writer_mod.pq, "write_table", real)
    stats = tmp_path / "s.json"
    ok("run", inp, "-o", out, *base, "--stats-json", stats)        # after freeing space: resumes
    assert json.loads(stats.read_text())["resumed"] == 256 and len(read(out)) == 360


def test_bodies_naming_another_model_are_said_once_per_name(tmp_path, base):
    """The response echoes body.model (as a served alias); a file prepared for another model is
    named once per model name, the running model's own name (or org/name of it) is not."""
    model = base[base.index("--model") + 1]
    own = os.path.basename(os.path.normpath(str(model)))
    names = ["gpt-4o-mini", own, f"org/{own}", "gpt-4o-mini", "a", "b", "c", "d"]
    inp = write(tmp_path / "b.jsonl", [{"custom_id": f"c{i}", "body": {"model": m, "prompt": "def f():"}}
                                      for i, m in enumerate(names)])
    out = tmp_path / "b.out.jsonl"
    r = ok("run", inp, "-o", out, *base)
    warned = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert warned == [
        f"warning: {inp}:1: body.model is 'gpt-4o-mini', but the rows run on '{own}'; their responses echo the "
        "request's name",
        f"warning: {inp}:5: body.model is 'a', but the rows run on '{own}'; their responses echo the request's name",
        f"warning: {inp}:6: body.model is 'b', but the rows run on '{own}'; their responses echo the request's name",
        "warning: more rows name other models in body.model; not said again"]
    assert [json.loads(x)["response"]["body"]["model"] for x in open(out)] == names


def test_a_sigterm_after_the_output_is_complete_does_not_fail_the_job(tmp_path, base):
    """A scheduler's SIGTERM landing as the job ends (the output complete, the summary being
    printed): the summary and --stats-json are still written and the exit is 0, not a silent 143."""
    import signal
    import subprocess
    import sys

    inp, out, stats = write(tmp_path / "in.jsonl", ROWS[:3]), tmp_path / "o.jsonl", tmp_path / "s.json"
    loud = [str(a) for a in base if a != "-q"]
    code = ("import os, signal, sys\n"
            "import specbatch.cli as c\n"
            "real = c.print_summary\n"
            "def late(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return real(*a, **k)\n"
            "c.print_summary = late\n"
            "sys.argv = ['specbatch'] + sys.argv[1:]\n"
            "c.app()\n")
    r = subprocess.run([sys.executable, "-c", code, "run", str(inp), "-o", str(out), "--stats-json", str(stats), *loud],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.returncode != -signal.SIGTERM, r.stderr
    assert "error:" not in r.stderr and json.loads(stats.read_text())["requests"] == 3 and len(read(out)) == 3


@pytest.mark.parametrize("args, expect", [
    (["run", "IN", "--max-tokens", "abc"], "error: Invalid value for '--max-tokens': "),
    (["run", "IN", "--workers", "0"], "error: Invalid value for '--workers': "),
    (["run", "IN", "--no-such-flag"], "error: No such option: --no-such-flag"),
    (["run"], "error: missing the input: INPUT (or -i/--input-file), a .jsonl or .parquet file"),
    (["run", "IN", "-i", "IN"], "error: give the input once: as INPUT or as -i/--input-file"),
    (["no-such-command"], "error: No such command 'no-such-command'."),
    (["run", "IN", "IN"], "error: Got unexpected extra argument")])
def test_a_malformed_flag_is_one_line_from_the_console_script(tmp_path, monkeypatch, capsys, args, expect):
    """The CLI framework's own form for a flag it cannot parse is a usage block and a box; the
    console script answers one line naming the flag, as every other error, with exit 2."""
    import sys

    from specbatch.cli import main

    inp = write(tmp_path / "in.jsonl", ROWS[:1])
    monkeypatch.setattr(sys, "argv", ["specbatch", *[str(inp) if a == "IN" else a for a in args]])
    with pytest.raises(SystemExit) as ex:
        main()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert ex.value.code == EXIT_USAGE and len(lines) == 1 and lines[0].startswith(expect), lines
    if args.count("IN") > 1 and "-i" not in args:     # a shell glob's files: the input form that takes them
        assert lines[0].endswith("pass their directory, whose .jsonl or .parquet files are read in path order")
    elif "the input" not in lines[0]:           # (ours, not the framework's)
        assert lines[0].endswith("--help')")


def test_keys_that_look_like_request_fields_are_said_once_each(tmp_path, base):
    """A plain row's `max_new_tokens` (transformers' name) or `temprature` is the row's data and
    the row runs without it: said once per key with the field it likely meant; --keep-columns
    marks it as data and keeps it quiet."""
    rows = [{"id": f"r{i}", "prompt": "def f():", "max_new_tokens": 2, "temprature": 0.7, "label": "x"}
            for i in range(3)]
    inp, out = write(tmp_path / "u.jsonl", rows), tmp_path / "u.out.jsonl"
    r = ok("run", inp, "-o", out, *base)
    assert [x for x in r.stderr.splitlines() if x.startswith("warning:")] == [
        f"warning: {inp}:1: 'max_new_tokens' is not a request field, so the row runs without it; did you mean "
        "'max_tokens'? (rename the column, or name it in --keep-columns, to keep this quiet)",
        f"warning: {inp}:1: 'temprature' is not a request field, so the row runs without it; did you mean "
        "'temperature'? (rename the column, or name it in --keep-columns, to keep this quiet)"]
    assert {x["completion_tokens"] for x in read(out)} == {4}            # --max-tokens 4, not 2
    r = ok("run", inp, "-o", tmp_path / "k.jsonl", *base, "--keep-columns", "max_new_tokens,temprature")
    assert "warning" not in r.stderr


def test_sampling_fields_without_a_temperature_are_said_once(tmp_path, base):
    """vLLM's SamplingParams default to temperature 1.0; a row setting top_p and n with nothing
    setting a temperature runs greedy here (n copies of one completion): said once, naming them.
    A temperature from the flags, or an OpenAI line (1.0 when unset), says nothing."""
    rows = [{"prompt": "def f():", "top_p": 0.9, "n": 2}, {"prompt": "def g():", "top_k": 5}]
    inp = write(tmp_path / "g.jsonl", rows)
    r = ok("run", inp, "-o", tmp_path / "g.out.jsonl", *base)
    assert [x for x in r.stderr.splitlines() if x.startswith("warning:")] == [
        f"warning: {inp}:1: top_p and n > 1 are set but no temperature is (row, flags, recipe or the model's "
        "generation_config.json), so the row runs greedy and its n completions are one, repeated; vLLM's "
        "SamplingParams would sample at temperature 1.0: set temperature to sample (said once)"]
    assert "warning" not in ok("run", inp, "-o", tmp_path / "t.jsonl", *base, "--temperature", "0.7").stderr
    line = write(tmp_path / "b.jsonl", [{"custom_id": "c", "body": {"prompt": "def f():", "top_p": 0.9}}])
    assert "warning" not in ok("run", line, "-o", tmp_path / "b.out.jsonl", *base).stderr


def test_repeated_ids_are_counted_and_the_first_named(tmp_path, base):
    """Ids are what users join results back by: rows repeating an earlier row's id (a row without
    one takes its row number, which can meet a given id) are said once, counted in the summary."""
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"},
            {"prompt": "no id: row 3"}, {"id": 3, "prompt": "w"}, {"id": "c", "prompt": "v"}]
    inp, stats = write(tmp_path / "ids.jsonl", rows), tmp_path / "s.json"
    r = ok("run", inp, "-o", tmp_path / "o.jsonl", *base, "--stats-json", stats)
    assert [x for x in r.stderr.splitlines() if x.startswith("warning:")] == [
        "warning: 2 rows have the id of an earlier row (the first: row 2, the id of row 0); results joined back by "
        "id would reach the wrong rows: the output's row column tells them apart"]
    s = json.loads(stats.read_text())
    assert s["repeated_ids"] == 2 and sum(s["finish_reasons"].values()) == 6
    r = ok("run", write(tmp_path / "fine.jsonl", rows[:2]), "-o", tmp_path / "f.jsonl", *base)
    assert "warning" not in r.stderr


def test_repeated_ids_counting():
    from types import SimpleNamespace

    from specbatch.row_notes import RepeatedIds

    def count(ids):
        r = RepeatedIds()
        for row, i in enumerate(ids):
            r.add(SimpleNamespace(id=i, row=row))
        return r.count()

    assert count([]) == (0, None) and count(["a"]) == (0, None) and count(["a", "b", 1]) == (0, None)
    assert count(["x", "a", "b", "a", "a", "b"]) == (3, (3, 1))
    assert count([7, "q", "7"]) == (1, (2, 0))                  # 7 and "7": one id in a Parquet column
    # a line whose id could not be read (None) meets no other and leaves the others' row numbers right
    assert count([None, "x", None, "a", "x", None]) == (1, (4, 1)) and count([None, None]) == (0, None)


@pytest.mark.parametrize("finished", [True, False])
def test_a_shortened_input_is_named_as_such(tmp_path, base, finished):
    """Rows cut off the end of the input: the refusal says where the input ends and what the output
    holds past it, not that a block of rows differs."""
    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet"
    if finished:
        ok("run", inp, "-o", out, *base)
    else:
        _interrupted(inp, out, base, after=6)
    committed = len(read(out)) if finished else None
    write(inp, ROWS[:3])
    line = one_line_cli_error(cli("run", inp, "-o", out, *base), EXIT_USAGE)
    assert f"{inp}: the input ends after 3 rows, but {out}" in line and "(rows deleted?)" in line, line
    if finished:
        assert committed == len(ROWS) and "holds row 3 " in line


def test_a_parquet_input_s_kept_columns_keep_their_types(tmp_path, base):
    import datetime
    import decimal

    import pyarrow as pa

    t = pa.table({
        "prompt": ["a", "b", "c"],
        "u8": pa.array([1, 2, 3], pa.uint8()),
        "f32": pa.array([1.5, None, 2.25], pa.float32()),
        "dec": pa.array([decimal.Decimal("1.25"), decimal.Decimal("12345678.90"), None], pa.decimal128(10, 2)),
        "cat": pa.array(["x", "y", "x"]).dictionary_encode(),
        "ts": pa.array([datetime.datetime(2026, 1, 1, 12), None, datetime.datetime(2026, 2, 1)], pa.timestamp("us")),
        "blob": pa.array([b"\x00\xff", None, b""], pa.binary()),
    })
    inp, out = tmp_path / "in.parquet", tmp_path / "o.parquet"
    pq.write_table(t, inp)
    kept = [c for c in t.column_names if c != "prompt"]
    ok("run", inp, "-o", out, *base, "--keep-columns", ",".join(kept))
    got = pq.read_table(out)
    assert {c: got.schema.field(c).type for c in kept} == {c: t.schema.field(c).type for c in kept}
    assert got.select(kept).to_pylist() == t.select(kept).to_pylist()


@pytest.mark.parametrize("stop, how", [(KeyboardInterrupt, "interrupted"), ("Terminated", "terminated")])
def test_a_stopped_run_still_writes_its_stats_json(tmp_path, base, monkeypatch, stop, how):
    """A scheduler reads --stats-json after the job: a stop leaves what the run did, marked as stopped."""
    from specbatch import cli as cli_mod
    from specbatch.progress import ProgressView

    stop = getattr(cli_mod, stop) if isinstance(stop, str) else stop
    real, seen = ProgressView.update, []

    def update(self, event, info):
        real(self, event, info)
        if event == "record":
            seen.append(1)
            if len(seen) == 3:
                raise stop()

    monkeypatch.setattr(ProgressView, "update", update)
    inp, out, stats = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet", tmp_path / "s.json"
    r = cli("run", inp, "-o", out, *base, "--stats-json", stats)
    assert r.exit_code in (130, 143)
    s = json.loads(stats.read_text())
    assert s["stopped"] == how and s["requests"] == 3 and s["output"] == str(out) and s["resumed"] == 0


def test_nothing_left_below_the_limit_assembles_the_committed_rows_without_the_model(tmp_path, base, monkeypatch):
    """Parts already holding every row below --limit (or every row): the rerun assembles the output
    from them and says so; it loads no model to run no row."""
    from specbatch import job as job_mod

    inp, out = write(tmp_path / "in.jsonl", ROWS), tmp_path / "o.parquet"
    _interrupted(inp, out, base, after=6)
    committed = sorted(r for p in (tmp_path / "o.parquet.parts").glob("part-*") for r in pq.read_table(p)["row"].to_pylist())
    below = min(r for r in range(len(ROWS)) if r not in committed)       # the first row not committed

    def no_model(*a, **kw):
        raise AssertionError("a model was loaded to run no row")

    monkeypatch.setattr(job_mod, "_Runner", no_model)
    loud = [a for a in base if a != "-q"]
    r = ok("run", inp, "-o", out, *loud, "--limit", below)
    said = " ".join(r.stderr.replace("│", " ").split())                  # the summary table's cells, unwrapped
    assert f"no row left to run below --limit {below}; assembled from its {len(committed)} committed rows" in said
    assert sorted(x["row"] for x in read(out)) == committed


@pytest.mark.parametrize("output", ["o.jsonl", "-"])
def test_kept_dates_and_bytes_read_back_from_jsonl(tmp_path, base, output):
    """What JSON cannot hold, from a Parquet input's kept columns: ISO 8601 times and base64 bytes,
    as JSON readers take them (not Python's repr of bytes, nor str() of a datetime)."""
    import base64
    import datetime

    import pyarrow as pa

    t = pa.table({"prompt": ["a", "b"],
                  "ts": pa.array([datetime.datetime(2026, 1, 2, 3, 4, 5), None], pa.timestamp("us")),
                  "day": pa.array([datetime.date(2026, 1, 2), None], pa.date32()),
                  "blob": pa.array([b"\x00\xff", b""], pa.binary())})
    inp = tmp_path / "in.parquet"
    pq.write_table(t, inp)
    out = output if output == "-" else tmp_path / output
    r = ok("run", inp, "-o", out, *base, "--keep-columns", "ts,day,blob")
    got = [json.loads(x) for x in (r.stdout.splitlines() if output == "-" else open(out))]
    assert [(g["ts"], g["day"]) for g in got] == [("2026-01-02T03:04:05", "2026-01-02"), (None, None)]
    assert [base64.b64decode(g["blob"]) for g in got] == [b"\x00\xff", b""]


def test_the_eta_is_paced_from_the_first_finished_row(monkeypatch):
    """The first rows finish only after the batch's whole first generation: an ETA from the start
    would be far too long. It waits for a few rows and times their pace from the first."""
    from rich.console import Console

    from specbatch import progress

    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    view = progress.ProgressView(Console(stderr=True), quiet=True, every=1.0)
    view.update("start", {"total": 100, "resumed": 0, "device": "cpu", "load_s": 0.0})
    rec = {"record": {"row": 0, "spec": None}, "tokens": 0}
    clock[0] = 60.0                                      # the first row, a minute in
    view.update("record", rec)
    assert view.line(61.0, 0.0, "1.00").endswith("ETA ?")
    # no finished row has reported cycles yet (an error row, or vanilla's first): no accept length to show
    assert ", accept -, " in view.line(61.0, *view._rates(61.0))
    for i in range(8):                                   # then one a second
        clock[0] = 61.0 + i
        view.update("record", rec)
    assert view.line(clock[0], 0.0, "1.00").endswith(f"ETA {progress.hms(91)}")        # 91 rows left at 1 s
    view.update("record", {"record": {"row": 9, "spec": {"verify_steps": 4, "accept_length": 2.25}}, "tokens": 9})
    assert ", accept 2.25, " in view.line(clock[0], *view._rates(clock[0]))
