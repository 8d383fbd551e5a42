"""Reading inputs: bad rows are their own one-line errors (naming the line or Parquet row), and
inputs that cannot be read at all are a fatal InputError."""
from __future__ import annotations

import pytest

from specbatch.data import InputError, RowError, RowRequest, open_rows

from reader_helpers import MESSAGES, err, write_parquet


# ---- bad rows -------------------------------------------------------------


@pytest.mark.parametrize(
    "obj,needles",
    [
        ({"temperature": 1}, ["no 'prompt' or 'messages'"]),
        ({"prompt": None}, ["field 'prompt': expected a non-empty string, got null"]),
        ({"prompt": ""}, ["field 'prompt'", "non-empty string"]),
        ({"prompt": "  \n\t"}, ["field 'prompt'", "non-empty string"]),
        ({"prompt": 5}, ["field 'prompt'", "got 5"]),
        ({"messages": []}, ["field 'messages'", "non-empty list"]),
        ({"messages": "hi"}, ["field 'messages'"]),
        ({"messages": ["hi"]}, ["field 'messages[0]'"]),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, ["field 'messages[0].content'", "a string"]),
        ({"messages": [{"content": "x"}]}, ["field 'messages[0].role'"]),
        ({"messages": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]}, ["field 'messages[1].role'"]),
        ({"messages": [{"role": "user", "content": [5]}]}, ["field 'messages[0].content[0]'", "a content part"]),
        ({"prompt_token_ids": []}, ["field 'prompt_token_ids'", "non-empty list"]),
        ({"prompt_token_ids": [1, -2]}, ["field 'prompt_token_ids[1]'"]),
        ({"prompt_token_ids": [1, 2.5]}, ["field 'prompt_token_ids[1]'"]),
        ({"prompt": "a", "messages": MESSAGES}, ["row has both 'prompt' and 'messages'; give one"]),
        ({"prompt": "a", "prompt_token_ids": [1]}, ["row has both 'prompt' and 'prompt_token_ids'"]),
        ({"messages": MESSAGES, "prompt_token_ids": [1]}, ["row has both 'messages' and 'prompt_token_ids'"]),
        ({"body": {"messages": MESSAGES, "use_beam_search": True}},
         ["field 'body.use_beam_search': not supported by specbatch yet (got true)"]),
        ({"body": {"messages": MESSAGES, "n": 0}}, ["field 'body.n'"]),
        ({"body": "x"}, ["field 'body'", "an object"]),
        ({"body": {"model": "m"}}, ["field 'body'", "'messages' or 'prompt'"]),
        ({"body": {"prompt": "a", "messages": MESSAGES}}, ["body has both 'prompt' and 'messages'"]),
        ({"body": {"prompt": ""}}, ["field 'body.prompt'"]),
        ({"body": {"messages": [{"role": "user", "content": 7}]}}, ["field 'body.messages[0].content'"]),
        ({"url": "/v1/embeddings", "body": {"prompt": "a"}}, ["field 'url'", "/v1/embeddings"]),
    ],
)
def test_bad_rows(obj, needles):
    e = err(obj)
    for n in needles:
        assert n in e, e


def test_non_object_rows():
    assert "expected a JSON object, got an array" in err([1, 2])
    assert "expected a JSON object, got 5" in err(5)
    assert "expected a JSON object" in err("s")


def test_bad_lines_in_jsonl_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [
        b'{"prompt": "ok0"}',
        b'{"prompt": "trunc',
        b"[1, 2]",
        b'{"prompt": "caf\xe9"}',
        b'{"temperature": 1}',
        b'{"prompt": "x", "temperature": "hot"}',
        b"",
        b'{"prompt": "ok6"}',
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    src = open_rows(str(path))
    out = list(src)
    assert src.total == 7 and len(out) == 7
    assert [r.row for r in out] == list(range(7))
    assert isinstance(out[0], RowRequest) and out[0].prompt == "ok0"
    assert isinstance(out[6], RowRequest) and out[6].prompt == "ok6" and out[6].where == f"{path}:8"
    errors = out[1:6]
    assert all(isinstance(e, RowError) for e in errors)
    # a line whose id cannot be read has none (the row number may be another row's id); one that parses, its own
    assert [e.id for e in errors] == [None, None, None, 4, 5]
    assert errors[0].error.startswith(f"{path}:2: malformed JSON")
    assert errors[1].error.startswith(f"{path}:3: expected a JSON object")
    assert errors[2].error.startswith(f"{path}:4: invalid UTF-8")
    assert errors[3].error.startswith(f"{path}:5: no 'prompt'")
    assert errors[4].error == f'{path}:6: field \'temperature\': expected a number >= 0, got "hot"'


def test_bad_rows_in_parquet_name_row(tmp_path):
    rows = [{"prompt": "a", "top_p": 0.5}, {"prompt": "  ", "top_p": None}, {"prompt": "c", "top_p": 2.0}]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    out = list(open_rows(path))
    assert isinstance(out[0], RowRequest)
    assert out[1].error.startswith(f"{path} row 1: field 'prompt'")
    assert out[2].error.startswith(f"{path} row 2: field 'top_p'")


# ---- fatal input errors ---------------------------------------------------


@pytest.mark.parametrize("name", ["in.json", "in.csv", "in.txt", "data"])
def test_unknown_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text("{}")
    with pytest.raises(InputError) as ei:
        open_rows(str(path))
    msg = str(ei.value)
    assert str(path) in msg and ".jsonl" in msg and ".parquet" in msg and "\n" not in msg


@pytest.mark.parametrize("name", ["nope.jsonl", "nope.parquet"])
def test_missing_file(tmp_path, name):
    path = tmp_path / name
    with pytest.raises(InputError) as ei:
        open_rows(str(path))
    assert str(ei.value).startswith(f"{path}: cannot read") and "no such file" in str(ei.value)


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_bytes(b"this is not parquet at all\n" * 10)
    with pytest.raises(InputError) as ei:
        open_rows(str(path))
    msg = str(ei.value)
    assert msg.startswith(f"{path}: cannot read Parquet: ") and "\n" not in msg


def test_keep_column_absent_from_parquet(tmp_path):
    path = write_parquet(tmp_path / "k.parquet", [{"prompt": "a", "topic": "t"}])
    with pytest.raises(InputError) as ei:
        open_rows(path, keep_columns=["topic", "lang"])
    assert str(path) in str(ei.value) and "'lang'" in str(ei.value)


def test_parquet_schema_problems_are_fatal(tmp_path):
    path = write_parquet(tmp_path / "s.parquet", [{"text": "a"}])
    with pytest.raises(InputError, match="no 'prompt', 'messages'"):
        open_rows(path)
    with pytest.raises(InputError, match="id column 'uid'"):
        open_rows(path, prompt_column="text", id_column="uid")
