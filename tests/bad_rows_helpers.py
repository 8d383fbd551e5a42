"""Shared by the bad-row tests (tests/data/test_bad_rows_*.py): parse_row at a fixed row and place,
the one-line error a row must give, and JSONL lines written as given (bytes or text)."""
from __future__ import annotations

from specbatch.data import RowError, parse_row


MESSAGES = [{"role": "user", "content": "hi"}]
WHERE = "f.jsonl:4"


def parse(obj, as_given: bool = False, **kw):
    """`obj` parsed as row 3; an OpenAI batch line without an id gets custom_id "c" (its results need
    one: without, the line is an error) unless `as_given`."""
    if not as_given and isinstance(obj, dict) and obj.get("body") is not None and \
            obj.get("custom_id") is None and obj.get("id") is None:
        obj = {"custom_id": "c", **obj}
    opts = {"row": 3, "where": WHERE, "prompt_column": "prompt", "id_column": None, "keep_columns": ()}
    opts.update(kw)
    return parse_row(obj, **opts)


def err(obj, **kw) -> RowError:
    out = parse(obj, **kw)
    assert isinstance(out, RowError), out
    assert "\n" not in out.error and out.error.startswith(WHERE + ": "), out.error
    out.error.encode("utf-8")  # the output can always hold the message
    return out


def write_lines(path, lines: list[str | bytes]) -> str:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return str(path)
