"""records.py declares every standard output column once: adding a column is one line there, and
the engine, the Parquet / JSONL writers, `-o -` and specbatch.LLM all carry it."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch import records
from specbatch.data import OutputWriter, output_schema


@pytest.fixture
def extra_column(monkeypatch):
    """The one line a new column takes (here from a test): name, type, value, doc."""
    col = records.Column("output_chars", pa.int64(), lambda f: len(f.text), "characters of the completion")
    monkeypatch.setattr(records, "COLUMNS", [*records.COLUMNS, col])
    monkeypatch.setattr(records, "NAMES", (*records.NAMES, col.name))
    return col


def test_the_schema_is_the_column_list():
    assert output_schema().names == [c.name for c in records.COLUMNS if c.option is None]
    assert output_schema(save_token_ids=True).names == [c.name for c in records.COLUMNS
                                                        if c.option in (None, "save_token_ids")]
    assert output_schema().field("spec").type == records.SPEC_TYPE


def test_an_error_record_fills_every_column():
    rec = records.error_record(3, "x", "bad", {"k": 1}, prompt_tokens=5)
    assert set(records.NAMES) <= set(rec) and rec["k"] == 1
    assert (rec["row"], rec["error"], rec["prompt_tokens"], rec["completion_tokens"], rec["completion"]) == \
        (3, "bad", 5, 0, None)


def test_a_new_column_reaches_every_output(extra_column, tiny_model, tmp_path):
    from specbatch.job import JobOptions, run_job
    from specbatch.llm import LLM
    from specbatch.recipe import load_recipe

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "import os", "")))
    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), max_tokens=6, batch_size=2)
    for out in (tmp_path / "o.parquet", tmp_path / "o.jsonl"):
        run_job(str(inp), recipe, JobOptions(output=str(out), device="cpu"))
        rows = pq.read_table(out).to_pylist() if out.suffix == ".parquet" else \
            [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["output_chars"] for r in rows[:2]] == [len(r["completion"]) for r in rows[:2]]
        assert rows[2]["error"] is not None and rows[2]["output_chars"] is None
    llm = LLM(model=tiny_model, device="cpu", batch_size=2)
    (c,) = llm.generate(["def add(a, b):"], {"max_tokens": 6})
    assert c.record["output_chars"] == len(c.text)


def test_a_writer_keeps_a_new_column(extra_column, tmp_path):
    out = str(tmp_path / "w.parquet")
    with OutputWriter(out, fingerprint={}) as w:
        w.add({"row": 0, "id": "a", "completion": "xy", "output_chars": 2})
        w.finalize()
    assert pq.read_table(out).column("output_chars").to_pylist() == [2]
