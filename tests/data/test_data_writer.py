import json
import os
import re
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import OutputError, OutputWriter, output_schema
from specbatch.data import merge as merge_mod
from specbatch.data import writer as writer_mod

FP = {"input": "in.jsonl", "recipe": "vanilla", "model": "m", "sampling": {"temperature": 0.0}}
STANDARD = ["row", "id", "completion", "prompt_tokens", "completion_tokens", "finish_reason", "error", "spec"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rec(row, **extra):
    r = {
        "row": row,
        "id": f"id{row}",
        "completion": f"text {row} ü",
        "prompt_tokens": 3,
        "completion_tokens": row + 1,
        "finish_reason": "stop" if row % 2 else "length",
        "error": None,
        "spec": {"verify_steps": 2, "draft_tokens": 6, "accepted_tokens": 4, "accept_length": 2.5,
                 "accept_histogram": [0, 1, 1]},
    }
    r.update(extra)
    return r


def parts(path):
    """Part names without their writer token, in commit order."""
    d = str(path) + ".parts"
    names = [re.sub(r"^part-[0-9a-f]{8}-", "part-", n) for n in os.listdir(d) if n.startswith("part-")]
    return sorted(names)


def part_file(path, index):
    d = str(path) + ".parts"
    return os.path.join(d, next(n for n in os.listdir(d) if n.endswith(f"-{index:06d}.parquet")))


def read_final(path):
    if str(path).endswith(".parquet"):
        return pq.read_table(path)
    return pa.Table.from_pylist([json.loads(line) for line in open(path, encoding="utf-8")])


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
    # parts survive the refusals
    assert parts(out) == ["part-000000.parquet"]


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


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_finalize_sorted_deduplicated(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=4)
    order = [9, 3, 7, 0, 5, 3, 1, 8, 2, 6, 4, 9]
    for i, r in enumerate(order):
        w.add(rec(r, completion=f"c{r}-{i}é"))
    assert w.finalize() == 10
    assert not os.path.exists(str(out) + ".parts")
    t = read_final(out)
    assert t.column_names == STANDARD
    assert t.column("row").to_pylist() == list(range(10))
    by_row = {r["row"]: r for r in t.to_pylist()}
    assert by_row[3]["completion"] == "c3-1é"  # first occurrence kept
    assert by_row[9]["completion"] == "c9-0é"
    assert by_row[4]["spec"] == rec(4)["spec"]
    assert by_row[4]["finish_reason"] == "length" and by_row[4]["id"] == "id4"
    if fmt == "parquet":
        assert t.schema.equals(output_schema())
    else:
        lines = out.read_text(encoding="utf-8").splitlines()
        assert list(json.loads(lines[0])) == STANDARD
        assert "é" in lines[0]  # ensure_ascii=False
    w.close()
    assert OutputWriter(str(out), fingerprint=FP).complete


@pytest.mark.parametrize("chunk_bytes", [1000, 6000])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_multi_chunk_merge(tmp_path, monkeypatch, fmt, chunk_bytes):
    monkeypatch.setattr(merge_mod, "MERGE_CHUNK_BYTES", chunk_bytes)
    out = tmp_path / f"out.{fmt}"
    w = OutputWriter(str(out), fingerprint=FP, keep_columns=["k"], commit_rows=7)
    rows = [(i * 37) % 101 for i in range(101)] + [50, 0, 100]
    for i, r in enumerate(rows):
        w.add(rec(r, completion=f"{r}:{i}", k=r))
    assert w.finalize() == 101
    t = read_final(out)
    assert t.column("row").to_pylist() == list(range(101))
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r, f"{r}:{i}")
    assert t.column("completion").to_pylist() == [first[r] for r in range(101)]
    assert t.column("k").to_pylist() == list(range(101))


def test_keep_columns_unify_across_parts(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, keep_columns=["lang", "score", "mixed"], commit_rows=2)
    w.add(rec(0, lang=None, score=1, mixed=1))
    w.add(rec(1, lang=None, score=2, mixed=2))
    w.add(rec(2, lang="en", score=0.5, mixed="two"))
    w.add(rec(3, lang=None, score=None, mixed=None))
    w.add(rec(4, score=3))  # lang / mixed missing -> null
    assert pq.read_schema(part_file(out, 0)).field("lang").type == pa.null()
    w.finalize()
    t = pq.read_table(out)
    assert t.column_names == STANDARD + ["lang", "score", "mixed"]
    assert t.schema.field("lang").type == pa.string()
    assert t.schema.field("score").type == pa.float64()
    assert t.column("lang").to_pylist() == [None, None, "en", None, None]
    assert t.column("score").to_pylist() == [1.0, 2.0, 0.5, None, 3.0]
    # int64 and string parts cannot unify: stored as JSON text rather than failing
    assert t.schema.field("mixed").type == pa.string()
    assert t.column("mixed").to_pylist() == ["1", "2", "two", None, None]


def test_mixed_types_within_one_part(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(str(out), fingerprint=FP, keep_columns=["meta"])
    w.add(rec(0, meta={"a": 1}))
    w.add(rec(1, meta="plain"))
    w.add(rec(2, meta={"b": [1, {"c": None}]}))
    w.finalize()
    # JSONL keeps every value exactly: no JSON text, no null keys added to nested objects
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [x["meta"] for x in lines] == [{"a": 1}, "plain", {"b": [1, {"c": None}]}]


@pytest.mark.parametrize("save", [False, True])
def test_save_token_ids(tmp_path, save):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP, save_token_ids=save)
    w.add(rec(1, output_token_ids=[4, 5, 6]))
    w.add(rec(0, output_token_ids=None))
    w.finalize()
    t = pq.read_table(out)
    if save:
        assert t.column_names == STANDARD + ["output_token_ids"]
        assert t.schema.field("output_token_ids").type == pa.list_(pa.int64())
        assert t.column("output_token_ids").to_pylist() == [None, [4, 5, 6]]
    else:
        assert "output_token_ids" not in t.column_names


def test_errors_and_missing_fields(tmp_path):
    out = tmp_path / "out.parquet"
    w = OutputWriter(str(out), fingerprint=FP)
    w.add({"row": 0, "id": "a", "completion": None, "prompt_tokens": 0, "completion_tokens": 0,
           "finish_reason": None, "error": "in.jsonl:1: bad", "spec": None})
    w.add({"row": 1})
    with pytest.raises(ValueError):
        w.add({"row": "2"})
    w.finalize()
    rows = pq.read_table(out).to_pylist()
    assert rows[0]["error"] == "in.jsonl:1: bad" and rows[0]["spec"] is None
    assert rows[1]["id"] is None and rows[1]["completion"] is None


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_complete_detection(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    w = OutputWriter(str(out), fingerprint=FP)
    for r in (2, 0, 1):
        w.add(rec(r))
    assert w.finalize() == 3
    assert w.finalize() == 3  # idempotent
    w.close()
    w2 = OutputWriter(str(out), fingerprint=FP)
    assert w2.complete and w2.done_rows == {0, 1, 2}
    assert w2.finalize() == 3
    with pytest.raises(OutputError, match="already complete"):
        w2.add(rec(3))
    assert not os.path.exists(str(out) + ".parts")


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


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_empty_finalize(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    w = OutputWriter(str(out), fingerprint=FP, keep_columns=["k"], save_token_ids=True)
    assert w.finalize() == 0
    assert out.exists() and not os.path.exists(str(out) + ".parts")
    if fmt == "parquet":
        t = pq.read_table(out)
        assert t.num_rows == 0 and t.column_names == STANDARD + ["output_token_ids", "k"]
    else:
        assert out.read_bytes() == b""
    w.close()
    w2 = OutputWriter(str(out), fingerprint=FP, keep_columns=["k"], save_token_ids=True)
    assert w2.complete and w2.done_rows == set()


def test_pandas_reads_final(tmp_path):
    pd = pytest.importorskip("pandas")
    for fmt in ("parquet", "jsonl"):
        out = tmp_path / f"out.{fmt}"
        w = OutputWriter(str(out), fingerprint=FP, keep_columns=["lang"])
        w.add(rec(1, lang="en"))
        w.add(rec(0, lang=None))
        w.finalize()
        df = pd.read_parquet(out) if fmt == "parquet" else pd.read_json(out, lines=True)
        assert list(df["row"]) == [0, 1]
        assert pd.isna(df["lang"][0]) and df["lang"][1] == "en"


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
