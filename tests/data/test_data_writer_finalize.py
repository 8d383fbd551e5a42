"""The output writer's finalize: the parts merged into one output sorted by row and deduplicated
(in chunks), kept columns unified across parts, token ids, errors and missing fields, an empty job,
the complete output recognised, pandas reading it back."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import OutputError, OutputWriter, output_schema
from specbatch.data import merge as merge_mod

from writer_helpers import FP, STANDARD, part_file, read_final, rec


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


def test_kept_columns_keep_the_inputs_types_in_every_part(tmp_path):
    """With the input's types (a Parquet input's schema), each part holds them: uint8 stays uint8,
    a decimal keeps its precision whatever a part's values are, a dictionary column stays one."""
    import decimal

    out = tmp_path / "out.parquet"
    types = {"u8": pa.uint8(), "dec": pa.decimal128(10, 2), "cat": pa.dictionary(pa.int32(), pa.string()),
             "mp": pa.map_(pa.string(), pa.int64())}
    w = OutputWriter(str(out), fingerprint=FP, keep_columns=list(types), commit_rows=1, keep_types=types)
    w.add(rec(0, u8=1, dec=decimal.Decimal("1.25"), cat="x", mp=[("k", 1)]))
    w.add(rec(1, u8=None, dec=decimal.Decimal("12345678.90"), cat="y", mp=[]))
    w.add(rec(2, u8=3, dec=None, cat=None, mp=None))
    assert pq.read_schema(part_file(out, 0)).field("dec").type == pa.decimal128(10, 2)
    w.finalize()
    t = pq.read_table(out)
    assert {c: t.schema.field(c).type for c in types} == types
    assert t.column("dec").to_pylist() == [decimal.Decimal("1.25"), decimal.Decimal("12345678.90"), None]
    assert t.column("mp").to_pylist() == [[("k", 1)], [], None] and t.column("cat").to_pylist() == ["x", "y", None]
    # a value the input's type cannot hold (not from that column): the part infers, as without types
    w = OutputWriter(str(tmp_path / "o2.parquet"), fingerprint=FP, keep_columns=["u8"], keep_types={"u8": pa.uint8()})
    w.add(rec(0, u8="not a number"))
    w.finalize()
    assert pq.read_table(tmp_path / "o2.parquet").column("u8").to_pylist() == ["not a number"]


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


def _rows(path):
    if str(path).endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_kept_columns_that_arrow_cannot_type_as_they_came_still_finish(tmp_path, fmt):
    """Each of these made every finalize fail, so the job could never finish: a kept column
    named twice, one holding only {} (Parquet has no empty struct), and integers past float64's
    exact range in one part beside floats in another (kept as JSON text: no value changes)."""
    out = tmp_path / f"out.{fmt}"
    big = 1152921504606846977
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=1, keep_columns=["v", "m", "v"])
    w.add(rec(0, v=big, m={}))
    w.add(rec(1, v=1.5, m={}))
    w.finalize()
    w.close()
    rows = _rows(out)
    assert [r["v"] for r in rows] == ([str(big), "1.5"] if fmt == "parquet" else [big, 1.5])
    assert [r["m"] for r in rows] == (["{}", "{}"] if fmt == "parquet" else [{}, {}])
    assert list(rows[0]).count("v") == 1
    if fmt == "parquet":
        assert pq.read_schema(out).names.count("v") == 1
    # small integers beside floats still unify as numbers
    out2 = tmp_path / f"small.{fmt}"
    w = OutputWriter(str(out2), fingerprint=FP, commit_rows=1, keep_columns=["v"])
    w.add(rec(0, v=3))
    w.add(rec(1, v=1.5))
    w.finalize()
    w.close()
    assert [r["v"] for r in _rows(out2)] == [3, 1.5]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_merge_reads_what_it_asks_of_each_part_from_its_metadata(tmp_path, fmt, monkeypatch):
    """Which on-request columns (logprobs, choices) and which output form (OpenAI lines) the final
    file takes are summarised in each part's metadata when it is committed: the merge reads no part
    whole for them (thousands of parts at a million rows). A part without it (an older writer's)
    is read as before, to the same output."""
    def run(out, strip):
        w = OutputWriter(str(out), fingerprint=FP, commit_rows=3)
        for r in range(9):
            extra = {"logprobs": [{"token_id": 1, "token": "a", "logprob": -0.5, "top_logprobs": []}]} if r == 7 else {}
            w.add(rec(r, batch_line=r > 1, endpoint="completion", **extra))
        w.commit()
        if strip:                                      # an older writer's parts: no summary
            for i in range(3):
                p = part_file(out, i)
                pq.write_table(pq.read_table(p).replace_schema_metadata(None), p)
        else:
            assert all(b"specbatch_part_summary" in pq.read_schema(part_file(out, i)).metadata for i in range(3))
            reads = []
            real = pq.read_table
            monkeypatch.setattr(pq, "read_table", lambda p, *a, **k: reads.append(k.get("columns")) or real(p, *a, **k))
        w.finalize()
        monkeypatch.undo()
        if not strip:                                  # the merge's own reads: rows and digests, errors, the rows
            assert not any(c and set(c) & {"logprobs", "prompt_logprobs", "choices", "batch_line"} for c in reads)
        w.close()
        return read_final(out)

    new, old = run(tmp_path / f"a.{fmt}", False), run(tmp_path / f"b.{fmt}", True)
    assert new.equals(old)
    assert "logprobs" in new.column_names and "choices" not in new.column_names


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_merge_opens_each_part_twice(tmp_path, fmt, monkeypatch):
    """A million-row output has thousands of parts: the merge opens each once for its footer and
    its row, digest and error columns, and once to read it whole (it read each about five times)."""
    out = tmp_path / f"o.{fmt}"
    w = OutputWriter(str(out), fingerprint=FP, commit_rows=3)
    for r in [5, 1, 0, 7, 2, 3, 8, 6, 4, 1]:
        w.add(rec(r))
    w.commit()
    opened = []
    for name in ("ParquetFile", "read_table", "read_schema", "read_metadata"):
        real = getattr(pq, name)
        monkeypatch.setattr(pq, name, lambda p, *a, _real=real, **k: opened.append(str(p)) or _real(p, *a, **k))
    assert w.finalize() == 9
    monkeypatch.undo()
    parts = [p for p in opened if ".parts" in p]
    assert len(set(parts)) == 4 and all(parts.count(p) == 2 for p in set(parts)), parts
    assert read_final(out).column("row").to_pylist() == list(range(9))
    w.close()
