import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import InputError, RowError, RowRequest, open_rows, parse_row
from specbatch.data import reader as reader_mod

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, rows, schema=None):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


def parse(obj, **kw):
    opts = {"row": 3, "where": "f.jsonl:4", "prompt_column": "prompt", "id_column": None, "keep_columns": ()}
    opts.update(kw)
    return parse_row(obj, **opts)


def err(obj, **kw):
    out = parse(obj, **kw)
    assert isinstance(out, RowError), out
    assert "\n" not in out.error
    assert out.error.startswith("f.jsonl:4: "), out.error
    return out.error


# ---- row forms ----------------------------------------------------------


def test_jsonl_round_trip_every_form(tmp_path):
    rows = [
        {"prompt": "hello", "temperature": 0.5},
        {"messages": MESSAGES, "max_tokens": 8},
        {"prompt_token_ids": [1, 2, 3]},
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": MESSAGES, "max_completion_tokens": 16, "n": 1, "stream": False}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "complete me", "max_tokens": 4, "top_k": -1, "stop": "\n"}},
    ]
    src = open_rows(write_jsonl(tmp_path / "in.jsonl", rows))
    out = list(src)
    assert src.total == 5
    assert all(isinstance(r, RowRequest) for r in out), out
    assert [r.row for r in out] == [0, 1, 2, 3, 4]
    assert [r.id for r in out] == [0, 1, 2, "req-1", "req-2"]
    assert out[0].prompt == "hello" and out[0].messages is None and out[0].prompt_token_ids is None
    assert out[0].overrides == {"temperature": 0.5}
    assert out[1].messages == MESSAGES and out[1].prompt is None and out[1].overrides == {"max_tokens": 8}
    assert out[2].prompt_token_ids == [1, 2, 3] and out[2].prompt is None
    assert out[3].messages == MESSAGES and out[3].overrides == {"max_tokens": 16}
    assert out[4].prompt == "complete me"
    assert out[4].overrides == {"max_tokens": 4, "top_k": 0, "stop": ["\n"]}
    assert out[1].where.endswith("in.jsonl:2")
    # a file source can be iterated again
    assert [r.id for r in src] == [r.id for r in out]


def test_parquet_round_trip_every_form(tmp_path):
    rows = [
        {"prompt": "hello", "messages": None, "prompt_token_ids": None, "temperature": 0.5, "max_tokens": 16.0},
        {"prompt": None, "messages": MESSAGES, "prompt_token_ids": None, "temperature": None, "max_tokens": None},
        {"prompt": None, "messages": None, "prompt_token_ids": [5, 6], "temperature": 1.0, "max_tokens": 2.0},
    ]
    src = open_rows(write_parquet(tmp_path / "in.parquet", rows))
    assert src.total == 3
    out = list(src)
    assert all(isinstance(r, RowRequest) for r in out), out
    assert out[0].prompt == "hello" and out[0].overrides == {"temperature": 0.5, "max_tokens": 16}
    assert isinstance(out[0].overrides["max_tokens"], int)
    assert out[1].messages == MESSAGES and out[1].overrides == {}
    assert out[2].prompt_token_ids == [5, 6] and out[2].overrides == {"temperature": 1.0, "max_tokens": 2}
    assert out[2].where.endswith("in.parquet row 2")


def test_parquet_openai_body_struct(tmp_path):
    rows = [
        {"custom_id": "a", "url": "/v1/chat/completions",
         "body": {"messages": MESSAGES, "prompt": None, "max_completion_tokens": 7, "seed": 3}},
        {"custom_id": "b", "url": "/v1/completions",
         "body": {"messages": None, "prompt": "p", "max_completion_tokens": None, "seed": None}},
    ]
    out = list(open_rows(write_parquet(tmp_path / "b.parquet", rows)))
    assert [(r.id, r.messages, r.prompt, r.overrides) for r in out] == [
        ("a", MESSAGES, None, {"max_tokens": 7, "seed": 3}),
        ("b", None, "p", {}),
    ]


def test_parquet_streams_in_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "PARQUET_BATCH_ROWS", 7)
    rows = [{"prompt": f"p{i}"} for i in range(50)]
    path = tmp_path / "many.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=10)
    out = list(open_rows(str(path)))
    assert [r.prompt for r in out] == [f"p{i}" for i in range(50)]
    assert [r.row for r in out] == list(range(50))


def test_stdin(monkeypatch):
    data = b'{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{bad\n'

    class FakeStdin:
        buffer = io.BytesIO(data)

    monkeypatch.setattr("sys.stdin", FakeStdin())
    src = open_rows("-")
    assert src.total is None and src.path == "-"
    out = list(src)
    assert out[0].prompt == "a"
    assert out[1].messages == [{"role": "user", "content": "b"}]
    assert isinstance(out[2], RowError) and out[2].row == 2
    assert "<stdin>:4" in out[2].error


def test_blank_lines_rows_and_total(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b'\n{"prompt": "a"}\n   \n\t\r\n{"prompt": "b"}\n\n{"prompt": "c"}')
    src = open_rows(str(path))
    out = list(src)
    assert src.total == 3
    assert [(r.row, r.prompt) for r in out] == [(0, "a"), (1, "b"), (2, "c")]
    assert [r.where for r in out] == [f"{path}:2", f"{path}:5", f"{path}:7"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8, 1 << 20])
def test_total_scan_across_chunk_boundaries(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(reader_mod, "SCAN_CHUNK_BYTES", chunk)
    data = b'{"a":1}\n \n\n  {"b": 2}  \n\t\n{}\n{"long": "' + b"x" * 40 + b'"}\n   x'
    expected = sum(1 for line in data.split(b"\n") if line.strip())
    assert expected == 5
    with io.BytesIO(data) as f:
        assert reader_mod.count_nonblank_lines(f) == expected


def test_total_scan_fuzz(monkeypatch):
    import random

    rng = random.Random(0)
    alphabet = [b"\n", b"\n", b" ", b"\t", b"\r", b"x", b"{", b"\x0c"]
    for _ in range(300):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        monkeypatch.setattr(reader_mod, "SCAN_CHUNK_BYTES", rng.randrange(1, 12))
        expected = sum(1 for line in io.BytesIO(data) if line.strip())
        assert reader_mod.count_nonblank_lines(io.BytesIO(data)) == expected, data


def test_bom_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')
    (r,) = list(open_rows(str(path)))
    assert r.prompt == "a"


# ---- ids and keep columns -----------------------------------------------


def test_id_precedence():
    assert parse({"prompt": "x", "id": 7, "custom_id": "c"}).id == 7
    assert parse({"prompt": "x", "id": "7", "custom_id": "c"}).id == "7"
    assert parse({"prompt": "x", "id": None, "custom_id": "c"}).id == "c"
    assert parse({"prompt": "x"}).id == 3
    assert parse({"prompt": "x", "id": "a", "key": 12}, id_column="key").id == 12
    e = err({"prompt": "x", "id": "a"}, id_column="key")
    assert "'key'" in e and "null" in e
    assert "'id'" in err({"prompt": "x", "id": [1]})
    assert "'key'" in err({"prompt": "x", "key": True}, id_column="key")


def test_id_column_and_keep_columns_jsonl(tmp_path):
    rows = [
        {"prompt": "a", "uid": "u1", "meta": {"x": 1}, "lang": "en"},
        {"prompt": "b", "uid": 5, "lang": "fr"},
        {"prompt": "", "uid": "u3", "meta": 2},
    ]
    out = list(open_rows(write_jsonl(tmp_path / "k.jsonl", rows), id_column="uid", keep_columns=["meta", "lang"]))
    assert [r.id for r in out] == ["u1", 5, "u3"]
    assert out[0].keep == {"meta": {"x": 1}, "lang": "en"}
    assert out[1].keep == {"meta": None, "lang": "fr"}
    assert isinstance(out[2], RowError) and out[2].keep == {"meta": 2, "lang": None} and out[2].id == "u3"


def test_keep_columns_parquet_and_prompt_column(tmp_path):
    rows = [{"text": "a", "topic": "t1", "n": 1}, {"text": "b", "topic": None, "n": 2}]
    path = write_parquet(tmp_path / "k.parquet", rows)
    out = list(open_rows(path, prompt_column="text", id_column="n", keep_columns=["topic"]))
    assert [(r.id, r.prompt, r.keep) for r in out] == [(1, "a", {"topic": "t1"}), (2, "b", {"topic": None})]


def test_malformed_line_keeps_keep_columns_shape(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"prompt": "a", "k": 1}\nnot json\n', encoding="utf-8")
    out = list(open_rows(str(path), keep_columns=["k"]))
    assert out[1].keep == {"k": None}


# ---- overrides ----------------------------------------------------------


def test_overrides_all_valid():
    r = parse({
        "prompt": "x", "max_tokens": 5, "temperature": 0, "top_p": 1, "top_k": 40, "seed": -3,
        "stop": ["a", "bc"], "stop_token_ids": [0, 2], "ignore_eos": True,
    })
    assert r.overrides == {
        "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "seed": -3,
        "stop": ["a", "bc"], "stop_token_ids": [0, 2], "ignore_eos": True,
    }
    assert parse({"prompt": "x", "top_k": 0}).overrides == {"top_k": 0}
    assert parse({"prompt": "x", "top_k": -1}).overrides == {"top_k": 0}
    assert parse({"prompt": "x", "stop": "END"}).overrides == {"stop": ["END"]}
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")}
    assert parse({"prompt": "x", **nulls}).overrides == {}


def test_openai_body_overrides():
    r = parse({"custom_id": "c", "body": {"prompt": "x", "max_completion_tokens": 9, "temperature": 0.2,
                                          "top_p": 0.9, "logprobs": False, "model": "m"}})
    assert r.overrides == {"max_tokens": 9, "temperature": 0.2, "top_p": 0.9}
    assert parse({"body": {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9}}).overrides == {"max_tokens": 9}
    e = err({"body": {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 10}})
    assert "max_tokens" in e and "max_completion_tokens" in e
    # top-level sampling fields are ignored when body is given
    assert parse({"temperature": "hot", "body": {"prompt": "x"}}).overrides == {}
    assert parse({"body": {"prompt": [1, 2]}}).prompt_token_ids == [1, 2]
    assert parse({"body": {"prompt": ["only"]}}).prompt == "only"


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("max_tokens", 0, "expected an integer in [1, 2147483647]"),
        ("max_tokens", True, "expected an integer in [1, 2147483647]"),
        ("max_tokens", 16.5, "expected an integer in [1, 2147483647]"),
        ("max_tokens", "16", "expected an integer in [1, 2147483647]"),
        ("temperature", "hot", 'expected a number >= 0, got "hot"'),
        ("temperature", -0.1, "expected a number >= 0"),
        ("temperature", True, "expected a number >= 0"),
        ("top_p", 0, "expected a number in (0, 1]"),
        ("top_p", 1.5, "expected a number in (0, 1]"),
        ("top_p", [0.5], "expected a number in (0, 1]"),
        ("top_k", -2, "expected an integer in [1, 2147483647] (0 or -1 to disable)"),
        ("top_k", 2.5, "expected an integer in [1, 2147483647]"),
        ("seed", "1", "expected an integer"),
        ("seed", False, "expected an integer"),
        ("stop", 3, "expected a non-empty string or a list of non-empty strings"),
        ("stop", "", "expected a non-empty string or a list"),
        ("stop", ["a", ""], "expected a non-empty string"),
        ("stop", ["a", 1], "expected a non-empty string"),
        ("stop_token_ids", 3, "of integers >= 0"),
        ("stop_token_ids", [1, -1], "expected an integer in [0, 9223372036854775807]"),
        ("stop_token_ids", [1, "2"], "expected an integer in [0, 9223372036854775807]"),
        ("ignore_eos", 1, "expected true or false"),
        ("ignore_eos", "yes", "expected true or false"),
    ],
)
def test_bad_override(field, value, expected):
    e = err({"prompt": "x", field: value})
    assert f"field '{field}" in e
    assert expected in e
    assert parse({"prompt": "x", field: value}).id == 3


def test_bad_override_in_body_names_body_field():
    e = err({"custom_id": "c", "body": {"messages": MESSAGES, "temperature": "hot"}})
    assert "field 'body.temperature'" in e and '"hot"' in e
    assert parse({"custom_id": "c", "body": {"messages": MESSAGES, "temperature": "hot"}}).id == "c"


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
        ({"messages": [{"role": "user"}]}, ["field 'messages[0].content'", "a string"]),
        ({"messages": [{"content": "x"}]}, ["field 'messages[0].role'"]),
        ({"messages": [{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]}, ["field 'messages[1].role'"]),
        ({"messages": [{"role": "user", "content": ["a"]}]}, ["field 'messages[0].content'"]),
        ({"prompt_token_ids": []}, ["field 'prompt_token_ids'", "non-empty list"]),
        ({"prompt_token_ids": [1, -2]}, ["field 'prompt_token_ids[1]'"]),
        ({"prompt_token_ids": [1, 2.5]}, ["field 'prompt_token_ids[1]'"]),
        ({"prompt": "a", "messages": MESSAGES}, ["row has both 'prompt' and 'messages'; give one"]),
        ({"prompt": "a", "prompt_token_ids": [1]}, ["row has both 'prompt' and 'prompt_token_ids'"]),
        ({"messages": MESSAGES, "prompt_token_ids": [1]}, ["row has both 'messages' and 'prompt_token_ids'"]),
        ({"body": {"messages": MESSAGES, "n": 2}}, ["field 'body.n': not supported by specbatch yet (got 2)"]),
        ({"body": {"messages": MESSAGES, "n": 0}}, ["field 'body.n'"]),
        ({"body": "x"}, ["field 'body'", "an object"]),
        ({"body": {"model": "m"}}, ["field 'body'", "'messages' or 'prompt'"]),
        ({"body": {"prompt": "a", "messages": MESSAGES}}, ["body has both 'prompt' and 'messages'"]),
        ({"body": {"prompt": ""}}, ["field 'body.prompt'"]),
        ({"body": {"messages": [{"role": "user", "content": None}]}}, ["field 'body.messages[0].content'"]),
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
    assert [e.id for e in errors] == [1, 2, 3, 4, 5]
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
