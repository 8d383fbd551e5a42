"""The output writer's commits and resume: parts every N rows or seconds, a different job's parts
refused (or removed with --overwrite), files specbatch did not write never replaced, leftover and
corrupt parts, a crash mid-job, a finished output reopened."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from specbatch.data import OutputError, OutputWriter
from specbatch.data import writer as writer_mod

from writer_helpers import FP, part_file, parts, read_final, rec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bad_path_and_keep_clash(tmp_path):
    with pytest.raises(ValueError, match=r"\.parquet or \.jsonl"):
        OutputWriter(str(tmp_path / "out.csv"), fingerprint=FP)
    with pytest.raises(ValueError, match="'id'"):
        OutputWriter(str(tmp_path / "out.jsonl"), fingerprint=FP, keep_columns=["id"])


def test_commit_every_n_rows_and_resume(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=3)
    assert w.done_rows == set() and not w.complete
    manifest = json.loads((tmp_path / "out.parquet.parts" / "manifest.json").read_text())
    assert manifest["fingerprint"] == FP
    for i in range(7):
        w.add(rec(i))
    assert parts(out) == ["part-000000.parquet", "part-000001.parquet"]
    assert pq.read_table(part_file(out, 0)).column("row").to_pylist() == [0, 1, 2]
    # row 6 is still buffered; a crash now loses it
    w.close()
    w2 = OutputWriter(str(out), fingerprint=dict(FP), commit_rows=3)
    assert w2.done_rows == {0, 1, 2, 3, 4, 5} and not w2.complete
    w2.add(rec(6))
    w2.commit()
    assert parts(out)[-1] == "part-000002.parquet"
    w2.close()
    w3 = OutputWriter(str(out), fingerprint=FP)
    assert w3.done_rows == set(range(7))


def test_commit_seconds(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: clock[0])
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=100, commit_seconds=5.0)
    w.add(rec(0))
    assert parts(out) == []
    clock[0] += 6
    w.add(rec(1))
    assert parts(out) == ["part-000000.parquet"]
    w.add(rec(2))
    assert parts(out) == ["part-000000.parquet"]


def test_commit_interval_batches_fast_rows_into_a_part_a_second(tmp_path, monkeypatch):
    """Rows finishing thousands a second: a part once commit_rows are buffered AND commit_interval
    passed (not one per 256 rows: a file and two fsyncs each, in the job's loop); commit_seconds
    still bounds what a crash can lose when rows come slowly."""
    clock = [1000.0]
    monkeypatch.setattr(writer_mod.time, "monotonic", lambda: clock[0])
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=2, commit_seconds=30.0, commit_interval=1.0)
    for r in range(10):                          # 10 rows in 0.5 s: no part yet
        clock[0] += 0.05
        w.add(rec(r))
    assert parts(out) == [] and w.buffered == 10
    clock[0] += 0.6
    w.add(rec(10))                               # a second since the last commit, past commit_rows
    assert parts(out) == ["part-000000.parquet"] and w.buffered == 0
    clock[0] += 5
    w.add(rec(11))                               # one row buffered, slow: waits for commit_rows or 30 s
    assert len(parts(out)) == 1
    clock[0] += 30
    w.add(rec(12))
    assert len(parts(out)) == 2


def test_empty_commit_writes_nothing(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP)
    w.commit()
    assert parts(out) == []


def test_different_fingerprint_refused(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=1)
    w.add(rec(0))
    w.close()
    with pytest.raises(OutputError) as ei:
        OutputWriter(str(out), fingerprint={**FP, "recipe": "eagle3_topk1", "sampling": {"temperature": 0.5}})
    msg = str(ei.value)
    assert msg == (
        f"{out}.parts was written by a different job (recipe: \"vanilla\" -> \"eagle3_topk1\"; "
        "sampling.temperature: 0.0 -> 0.5); rerun the same command to resume, or pass --overwrite"
    )
    with pytest.raises(OutputError, match=r"\(extra: <unset> -> 1\)"):
        OutputWriter(str(out), fingerprint={**FP, "extra": 1})
    with pytest.raises(OutputError, match="save_token_ids"):
        OutputWriter(str(out), fingerprint=FP, save_token_ids=True)
    with pytest.raises(OutputError, match="keep_columns"):
        OutputWriter(str(out), fingerprint=FP, keep_columns=["lang"])
    # the same setting spelled two ways: no run seed is seed 0
    seeded = tmp_path / "seeded.parquet"
    fp = lambda seed: {**FP, "sampling": {**FP["sampling"], "seed": seed}}      # noqa: E731
    w = OutputWriter(str(seeded), fingerprint=fp(None), commit_rows=1)
    w.add(rec(0))
    w.close()
    for seed in (0, None):
        OutputWriter(str(seeded), fingerprint=fp(seed)).close()
    with pytest.raises(OutputError, match=r"sampling.seed: null -> 1\)"):
        OutputWriter(str(seeded), fingerprint=fp(1))
    # parts survive the refusals
    assert parts(out) == ["part-000000.parquet"]


def test_a_refusal_names_a_differing_kept_column_list_once(tmp_path):
    """keep_columns sits in the job's settings and beside them in the manifest: one mention."""
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint={**FP, "keep_columns": ["a"]}, keep_columns=["a"], commit_rows=1)
    w.add(rec(0))
    w.close()
    with pytest.raises(OutputError) as ei:
        OutputWriter(str(out), fingerprint={**FP, "keep_columns": ["b"]}, keep_columns=["b"])
    assert str(ei.value).count("keep_columns") == 1, ei.value


def test_different_fingerprint_without_parts_is_adopted(tmp_path):
    out = tmp_path / "out.parquet"
    OutputWriter(str(out), fingerprint=FP).close()
    w = OutputWriter(str(out), fingerprint={**FP, "recipe": "x"}, commit_rows=1)
    w.add(rec(0))
    w.close()
    assert OutputWriter(str(out), fingerprint={**FP, "recipe": "x"}).done_rows == {0}


def test_overwrite_removes_parts_and_final(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=1)
    w.add(rec(0))
    w.close()
    w2 = OutputWriter(str(out), fingerprint={**FP, "recipe": "other"}, overwrite=True)
    assert w2.done_rows == set() and parts(out) == []
    w2.add(rec(5))
    assert w2.finalize() == 1
    w2.close()
    with pytest.raises(OutputError, match="different job"):
        OutputWriter(str(out), fingerprint=FP)            # finished by the "other" job
    w3 = OutputWriter(str(out), fingerprint={**FP, "recipe": "other"})
    assert w3.complete and w3.done_rows == {5}
    w3.close()
    w4 = OutputWriter(str(out), fingerprint=FP, overwrite=True)
    assert not w4.complete and w4.done_rows == set() and not out.exists()


def test_foreign_file_beside_our_parts_is_refused(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=1)
    w.add(rec(0))
    w.close()
    out.write_bytes(b"someone else's file")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="not written by specbatch"):
            OutputWriter(str(out), fingerprint=FP, overwrite=overwrite)
    assert out.read_bytes() == b"someone else's file" and parts(out) == ["part-000000.parquet"]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_files_specbatch_did_not_write_are_never_replaced(tmp_path, fmt):
    out = tmp_path / f"data.{fmt}"
    out.write_bytes(b"garbage")
    for overwrite in (False, True):
        with pytest.raises(OutputError) as ei:
            OutputWriter(str(out), fingerprint=FP, overwrite=overwrite)
        assert "not written by specbatch" in str(ei.value) and "\n" not in str(ei.value)
    assert out.read_bytes() == b"garbage"
    folder = tmp_path / f"dataset.{fmt}"
    folder.mkdir()
    (folder / "x").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(OutputError, match="is a directory"):
            OutputWriter(str(folder), fingerprint=FP, overwrite=overwrite)
    assert (folder / "x").read_text() == "keep me"
    stray = tmp_path / f"o.{fmt}"
    os.mkdir(str(stray) + ".parts")
    open(str(stray) + ".parts/notes.txt", "w").write("mine")
    with pytest.raises(OutputError):
        OutputWriter(str(stray), fingerprint=FP, overwrite=True)
    assert open(str(stray) + ".parts/notes.txt").read() == "mine"


def test_leftover_temp_files_and_corrupt_part(tmp_path, capsys):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=2)
    for i in range(4):
        w.add(rec(i))
    w.close()
    d = tmp_path / "out.parquet.parts"
    (d / "part-00000000-000002.parquet.tmp").write_bytes(b"half written")
    corrupt = part_file(out, 1)
    open(corrupt, "wb").write(b"corrupt")
    w2 = OutputWriter(str(out), fingerprint=FP, commit_rows=2)
    assert w2.done_rows == {0, 1}
    assert not (d / "part-00000000-000002.parquet.tmp").exists()
    assert not os.path.exists(corrupt)
    assert os.path.basename(corrupt) in capsys.readouterr().err
    w2.add(rec(2))
    w2.add(rec(3))
    assert w2.finalize() == 4
    assert pq.read_table(out).column("row").to_pylist() == [0, 1, 2, 3]


def test_part_numbering_continues_after_gap(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=1)
    for i in range(3):
        w.add(rec(i))
    os.remove(part_file(out, 1))
    w.close()
    w2 = OutputWriter(str(out), fingerprint=FP, commit_rows=1)
    assert w2.done_rows == {0, 2}
    w2.add(rec(1))
    assert parts(out) == ["part-000000.parquet", "part-000002.parquet", "part-000003.parquet"]


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from specbatch.data import OutputWriter
    out, n = sys.argv[1], int(sys.argv[2])
    w = OutputWriter(out, fingerprint={"job": 1}, keep_columns=["k"], commit_rows=5)
    for i in range(n):
        w.add({"row": 100 - i, "id": str(i), "completion": "x" * i, "k": i})
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_crash_and_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(out), "13"], env=env, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    w = OutputWriter(str(out), fingerprint={"job": 1}, keep_columns=["k"], commit_rows=5)
    committed = {100 - i for i in range(10)}  # two parts of 5; the 3 buffered rows are lost
    assert w.done_rows == committed
    for i in range(30):
        if 100 - i not in w.done_rows:
            w.add({"row": 100 - i, "id": str(i), "completion": "x" * i, "k": i})
    assert w.finalize() == 30
    t = read_final(out)
    assert t.column("row").to_pylist() == list(range(71, 101))
    assert t.column("id").to_pylist() == [str(100 - r) for r in range(71, 101)]
    assert t.column("k").to_pylist() == [100 - r for r in range(71, 101)]


def test_reopen_turns_a_finished_output_back_into_parts(tmp_path):
    for ext in ("parquet", "jsonl"):
        out = str(tmp_path / f"re.{ext}")
        w = OutputWriter(out, fingerprint={"job": 1}, keep_columns=("k",))
        for i in range(3):
            w.add({**rec(i), "k": f"v{i}"})
        assert w.finalize() == 3
        w.close()
        w = OutputWriter(out, fingerprint={"job": 1}, keep_columns=("k",))
        assert w.complete and w.done_rows == {0, 1, 2}
        w.reopen({0: b"a", 1: b"b", 2: b"c"})
        assert not w.complete and os.path.isdir(out + ".parts")
        # the finished rows' part carries the merge's summary as every part does (the merge reads none whole)
        (first,) = [n for n in os.listdir(out + ".parts") if n.startswith("part-")]
        assert json.loads(pq.read_schema(os.path.join(out + ".parts", first)).metadata[b"specbatch_part_summary"]) \
            == {"set": [], "first_form": None}
        for i in (3, 4):
            w.add({**rec(i), "k": f"v{i}"})
        assert w.finalize() == 5
        w.close()
        rows = read_final(out).to_pylist()
        assert [r["row"] for r in rows] == [0, 1, 2, 3, 4] and [r["k"] for r in rows] == [f"v{i}" for i in range(5)]


def test_finished_parquet_remembers_its_job(tmp_path):
    out = str(tmp_path / "job.parquet")
    w = OutputWriter(out, fingerprint={"recipe": "vanilla"})
    w.add(rec(0))
    w.finalize()
    w.close()
    with pytest.raises(OutputError, match=r'different job \(recipe: "vanilla" -> "eagle3_topk1"\)'):
        OutputWriter(out, fingerprint={"recipe": "eagle3_topk1"})
    assert OutputWriter(out, fingerprint={"recipe": "vanilla"}).complete


def test_an_output_finished_with_no_rows_takes_the_rows_a_rerun_adds(tiny_model, tmp_path):
    """--limit 0 (or --fail-fast on a first bad row, or an empty input) finishes an output with no
    rows; a rerun adds the rest as it does for any smaller --limit."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(3)))
    _job(tiny_model, inp, out, limit=0)
    assert out.read_text() == ""
    _job(tiny_model, inp, out)
    assert [json.loads(x)["row"] for x in out.read_text().splitlines()] == [0, 1, 2]


def test_a_finished_output_with_a_gap_below_its_last_row_is_filled(tiny_model, tmp_path):
    """--fail-fast with rows finishing out of order (workers) finishes an output with gaps; a rerun
    generates the missing rows instead of calling the output complete."""
    from specbatch.data import open_rows
    from specbatch.job import fingerprint
    from specbatch.resolve import resolve_model

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(4)))
    recipe, opts, _ = _job(tiny_model, inp, tmp_path / "ref.jsonl")
    digests = {r.row: r.digest for r in open_rows(str(inp))}
    w = OutputWriter(str(out), fingerprint=fingerprint(recipe, resolve_model(recipe.model), None, opts))
    for r in (0, 1, 3):
        w.add(rec(r), digests[r])
    w.finalize()
    w.close()
    summary = _job(tiny_model, inp, out)[2]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == [0, 1, 2, 3] and not summary.get("complete_before")
    assert rows[2]["completion"] != rec(2)["completion"] and rows[3]["completion"] == rec(3)["completion"]  # the gap ran


def test_a_bad_output_path_fails_before_the_input_is_read(tiny_model, tmp_path):
    """The output's ending is checked first: a huge input is not counted line by line (nor a
    missing one reported) only to fail on '-o x.csv' afterwards."""
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model))
    with pytest.raises(ValueError, match=r"x\.csv: unsupported output"):
        run_job(str(tmp_path / "missing.jsonl"), recipe, JobOptions(output=str(tmp_path / "x.csv"), device="cpu"))


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_a_reopen_cut_short_keeps_the_finished_rows(tmp_path, monkeypatch, ext):
    """A rerun that adds rows to a finished output turns it back into a part; stopped while that
    part is written (Ctrl-C, SIGKILL), the next rerun still counts the finished rows as done
    instead of generating the whole job again."""
    out = str(tmp_path / f"re.{ext}")
    w = OutputWriter(out, fingerprint=FP)
    for i in range(3):
        w.add(rec(i))
    w.finalize()
    w.close()
    w = OutputWriter(out, fingerprint=FP)

    def stopped(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_mod.pq, "write_table", stopped)
    with pytest.raises(KeyboardInterrupt):
        w.reopen({0: b"a", 1: b"b", 2: b"c"})
    w.close()
    monkeypatch.undo()
    w = OutputWriter(out, fingerprint=FP)
    assert w.done_rows == {0, 1, 2}
    w.close()


def test_an_edited_jsonl_output_is_named_as_edited(tmp_path):
    """A finished JSONL output changed afterwards is not taken for finished (nor replaced), and
    the refusal says why: its manifest is there, the file differs from it."""
    out = str(tmp_path / "ed.jsonl")
    w = OutputWriter(out, fingerprint=FP)
    w.add(rec(0))
    w.finalize()
    w.close()
    with open(out, "a") as f:
        f.write("\n")
    for overwrite in (False, True):
        with pytest.raises(OutputError) as e:
            OutputWriter(out, fingerprint=FP, overwrite=overwrite)
        assert "edited since" in str(e.value) and "ed.jsonl.manifest.json" in str(e.value)
        assert "no manifest" not in str(e.value)


def test_the_engines_context_is_recorded_and_a_resume_with_another_is_named(tmp_path):
    """Unset, --max-model-len follows the model and the memory the KV pool gets: a resume on another
    GPU may run with another context. The manifest names the contexts of the engines whose rows
    were committed; another one is a one-line warning (rows reaching past the smaller end
    differently), the same one none."""
    def stored(out):
        return json.loads((tmp_path / (os.path.basename(out) + ".parts") / "manifest.json").read_text()).get("contexts")

    for ext in ("parquet", "jsonl"):
        out = str(tmp_path / f"ctx.{ext}")
        w = OutputWriter(out, fingerprint=FP)
        assert w.set_context(4096) is None                      # nothing written before
        assert stored(out) is None                             # named with its first rows
        w.add(rec(0))
        w.commit()
        assert stored(out) == [4096]
        w.close()
        w = OutputWriter(out, fingerprint=FP)                  # resumed from the parts
        assert w.set_context(4096) is None
        w.close()
        w = OutputWriter(out, fingerprint=FP)
        warning = w.set_context(1500)
        assert warning == (f"warning: {out}: its rows so far were written with a context of 4096 tokens and this "
                           "engine's is 1500 (--max-model-len unset: the model's limit or what the KV pool holds); "
                           "rows reaching past 1500 tokens end differently: resume on a GPU that holds the earlier "
                           "context, or pass --overwrite to redo every row")
        w.close()                                              # stopped on the warning: no row at 1500
        assert stored(out) == [4096]
        w = OutputWriter(out, fingerprint=FP)
        assert w.set_context(4096) is None                     # so back at 4096 nothing is mixed
        w.close()
        w = OutputWriter(out, fingerprint=FP)
        assert w.set_context(1500) is not None
        w.add(rec(1))
        assert w.finalize() == 2
        w.close()
        w = OutputWriter(out, fingerprint=FP)                  # the finished output names both
        assert w.complete
        assert "a context of 1500 and 4096 tokens and this engine's is 2000" in w.set_context(2000)
        assert w.set_context(1500) is None
        w.reopen({0: b"", 1: b""})                             # back into parts, before any engine: kept
        w.close()
        assert stored(out) == [1500, 4096]
    # a manifest from before contexts were recorded: nothing to compare
    out = str(tmp_path / "old.parquet")
    w = OutputWriter(out, fingerprint=FP)
    w.add(rec(0))
    w.commit()
    w.close()
    assert stored(out) is None
    assert OutputWriter(out, fingerprint=FP).set_context(64) is None


def test_a_job_resumed_with_another_context_says_so(tiny_model, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(3)))
    summary = _job(tiny_model, inp, out, limit=2)[2]
    sidecar = tmp_path / "out.jsonl.manifest.json"
    stored = json.loads(sidecar.read_text())
    assert stored["contexts"] == [summary["max_model_len"]]
    capsys.readouterr()
    _job(tiny_model, inp, out, limit=2)                                 # complete: no engine, no word
    assert "context" not in capsys.readouterr().err
    stored["contexts"] = [summary["max_model_len"] + 100]               # as if begun on a larger GPU
    sidecar.write_text(json.dumps(stored))
    _job(tiny_model, inp, out)
    err = capsys.readouterr().err
    assert f"written with a context of {summary['max_model_len'] + 100} tokens and this engine's is " \
           f"{summary['max_model_len']}" in err, err
    assert [json.loads(x)["row"] for x in out.read_text().splitlines()] == [0, 1, 2]
    assert json.loads(sidecar.read_text())["contexts"] == [summary["max_model_len"], summary["max_model_len"] + 100]



def test_the_dtype_a_resume_compares_is_the_one_the_run_computes_in(tiny_model, tmp_path):
    """`--dtype auto` is recorded as what it resolved to: a CPU run's float32 resumes under an
    explicit `--dtype float32`, parts computed in bfloat16 (auto on a GPU) refuse a CPU rerun in
    float32 naming both, and an older manifest's literal `auto` still resumes."""
    from specbatch.data import open_rows
    from specbatch.job import fingerprint
    from specbatch.resolve import resolve_model

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(3)))
    recipe, opts, _ = _job(tiny_model, inp, tmp_path / "a.jsonl", limit=2)        # auto on the CPU
    fp = fingerprint(recipe, resolve_model(recipe.model), None, opts, "cpu")
    assert fp["dtype"] == "float32"
    summary = _job(tiny_model, inp, tmp_path / "a.jsonl", dtype="float32")[2]
    assert summary["resumed"] == 2 and len((tmp_path / "a.jsonl").read_text().splitlines()) == 3

    digests = {r.row: r.digest for r in open_rows(str(inp))}
    for stored in ("bfloat16", "auto"):
        out = tmp_path / f"{stored}.jsonl"
        old = {k: v for k, v in fp.items() if k != "dtype_requested"}          # as an older manifest holds it
        w = OutputWriter(str(out), fingerprint={**old, "dtype": stored})
        w.add(rec(0), digests[0])
        w.commit()
        w.close()                                               # parts, as a stopped run leaves them
        if stored == "bfloat16":
            with pytest.raises(OutputError, match=r'dtype: "bfloat16" -> "float32"'):
                _job(tiny_model, inp, out)
        else:
            with pytest.raises(OutputError, match=r'dtype: "auto" -> "float32"'):     # auto matches auto only
                _job(tiny_model, inp, out, dtype="float32")
            assert _job(tiny_model, inp, out)[2]["resumed"] == 1


def _job(tiny_model, inp, out, dtype="auto", **kw):
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), max_tokens=3, batch_size=2, dtype=dtype)
    opts = JobOptions(output=str(out), device="cpu", **kw)
    return recipe, opts, run_job(str(inp), recipe, opts)


def test_an_output_begun_when_ray_fields_were_data_resumes_unless_a_committed_row_has_them(tiny_model, tmp_path):
    """A row's sampling_params and tokenized_prompt were its data before specbatch read them as
    Ray Data LLM does: parts begun then resume when no committed row has them (and record the new
    reading, so rows committed later are not held against it); a committed row with them is refused
    naming it, rather than mixing rows read both ways."""
    from specbatch.data import open_rows
    from specbatch.job import RAY_FIELDS, JobError, fingerprint
    from specbatch.resolve import resolve_model

    def legacy_parts(inp, out):
        recipe, opts, _ = _job(tiny_model, inp, tmp_path / "ref.jsonl", overwrite=True)
        fp = fingerprint(recipe, resolve_model(recipe.model), None, opts, "cpu")
        del fp["ray_fields"]
        w = OutputWriter(str(out), fingerprint=fp)
        w.add(rec(0), next(iter(open_rows(str(inp)))).digest)
        w.commit()
        w.close()
        return fp

    plain, ray = tmp_path / "plain.jsonl", tmp_path / "ray.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"def f{i}():"}) + "\n" for i in range(3)))
    ray.write_text("".join(json.dumps({"prompt": f"def f{i}():", "sampling_params": {"max_tokens": 2}}) + "\n"
                           for i in range(3)))
    out = tmp_path / "plain.out.jsonl"
    fp = legacy_parts(plain, out)
    w = OutputWriter(str(out), fingerprint={**fp, "ray_fields": RAY_FIELDS})
    assert w.deferred == {"ray_fields"}
    w.settle_deferred()
    w.close()
    assert json.loads((tmp_path / "plain.out.jsonl.parts" / "manifest.json").read_text())["fingerprint"][
        "ray_fields"] == RAY_FIELDS
    assert _job(tiny_model, plain, out)[2]["resumed"] == 1
    legacy_parts(plain, tmp_path / "p2.out.jsonl")                       # the job settles it itself
    assert _job(tiny_model, plain, tmp_path / "p2.out.jsonl")[2]["resumed"] == 1

    out = tmp_path / "ray.out.jsonl"
    legacy_parts(ray, out)
    with pytest.raises(JobError, match=r"ray\.jsonl:1: has sampling_params or tokenized_prompt, which the specbatch "
                                       r"that began .* took as the row's data"):
        _job(tiny_model, ray, out)
    # a row the new reading refuses (its error row would sit beside the old run's success) is refused too
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "def f():", "sampling_params": {"temperature": "hot"}}) + "\n")
    legacy_parts(bad, tmp_path / "bad.out.jsonl")
    with pytest.raises(JobError, match=r"row 0: has sampling_params or tokenized_prompt"):
        _job(tiny_model, bad, tmp_path / "bad.out.jsonl")

    # Parquet: a row's null in these columns stays out of its digest, so the old run's digest holds
    import pyarrow as pa
    import pyarrow.parquet as pq

    from specbatch.data.reader import _parquet_digest

    pqin = tmp_path / "ray.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "def f():", "sampling_params": None},
                                         {"prompt": "def g():", "sampling_params": {"max_tokens": 2}}]), pqin)
    old_digest = _parquet_digest({"prompt": "def f():"})              # what the older reader hashed
    assert next(iter(open_rows(str(pqin)))).digest == old_digest
    both = tmp_path / "both.parquet"                                  # Ray's tokenize stage beside the prompt
    pq.write_table(pa.Table.from_pylist([{"prompt": "def f():", "tokenized_prompt": [5, 6]}]), both)
    assert next(iter(open_rows(str(both)))).digest == old_digest
    out = tmp_path / "pq.out.jsonl"
    recipe, opts, _ = _job(tiny_model, plain, tmp_path / "ref2.jsonl", overwrite=True)
    fp = fingerprint(recipe, resolve_model(recipe.model), None, opts, "cpu")
    del fp["ray_fields"]
    w = OutputWriter(str(out), fingerprint=fp)
    w.add(rec(0), old_digest)
    w.commit()
    w.close()
    done = _job(tiny_model, pqin, out)[2]
    assert done["resumed"] == 1 and [json.loads(x)["completion_tokens"] for x in out.read_text().splitlines()][1] <= 2
