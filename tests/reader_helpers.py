"""Shared by the input-reader tests (tests/data/test_data_reader_*.py): chat messages, JSONL and
Parquet inputs written from rows, parse_row at a fixed row and place, and the one-line error text a
bad row must give."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from specbatch.data import RowError, parse_row


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def parse(obj, as_given: bool = False, **kw):
    """`obj` parsed as row 3; an OpenAI batch line without an id gets custom_id "c" (its results need
    one: without, the line is an error) unless `as_given`."""
    if not as_given and isinstance(obj, dict) and obj.get("body") is not None and \
            obj.get("custom_id") is None and obj.get("id") is None:
        obj = {"custom_id": "c", **obj}
    opts = {"row": 3, "where": "f.jsonl:4", "prompt_column": "prompt", "id_column": None, "keep_columns": ()}
    opts.update(kw)
    return parse_row(obj, **opts)


def err(obj, **kw):
    out = parse(obj, **kw)
    assert isinstance(out, RowError), out
    assert "\n" not in out.error
    assert out.error.startswith("f.jsonl:4: "), out.error
    return out.error
