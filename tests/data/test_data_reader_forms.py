"""Reading inputs: every row form from JSONL, Parquet and stdin, streaming, blank lines and the row
total, ids and kept columns."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import RowError, RowRequest, open_rows
from specbatch.data import reader as reader_mod

from reader_helpers import MESSAGES, err, parse, write_jsonl, write_parquet


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


def test_a_ray_data_llm_dataset_reads_as_there(tmp_path):
    """Rows prepared for Ray Data LLM carry `sampling_params` (a struct column in Parquet, null
    where a row set no such key) and may give `tokenized_prompt`: the fields apply as the row's
    own, never dropped as metadata; one set both ways, or a key no sampling field has, is the
    row's error naming it."""
    rows = [
        {"id": "a", "prompt": "p", "tokenized_prompt": None, "sampling_params": {"max_tokens": 7, "temperature": 0.5,
                                                                                "n": None}},
        {"id": "b", "prompt": None, "tokenized_prompt": [5, 6], "sampling_params": {"max_tokens": None,
                                                                                  "temperature": None, "n": 2}},
        {"id": "c", "prompt": "p", "tokenized_prompt": None, "sampling_params": None},
    ]
    out = list(open_rows(write_parquet(tmp_path / "r.parquet", rows)))
    assert [(r.id, r.prompt, r.prompt_token_ids, r.overrides) for r in out] == [
        ("a", "p", None, {"max_tokens": 7, "temperature": 0.5}), ("b", None, [5, 6], {"n": 2}), ("c", "p", None, {})]
    msgs = [{"role": "user", "content": "hi"}]
    chat = parse({"messages": msgs, "sampling_params": {"add_generation_prompt": False,
                                                        "continue_final_message": True}})
    assert chat.chat == {"add_generation_prompt": False, "continue_final_message": True}
    assert err({"prompt": "p", "temperature": 0.2, "sampling_params": {"temperature": 0.7}}).endswith(
        "field 'sampling_params.temperature': the row sets 'temperature' too; give one")
    assert err({"prompt": "p", "sampling_params": {"max_new_tokens": 5}}).endswith(
        "field 'sampling_params.max_new_tokens': not a sampling field specbatch knows (did you mean "
        "'sampling_params.max_tokens'?)")
    assert err({"prompt": "p", "sampling_params": [0.7]}).endswith(
        "field 'sampling_params': expected an object of sampling fields, got [0.7]")
    assert "field 'sampling_params.top_p'" in err({"prompt": "p", "sampling_params": {"top_p": 3}})
    # vLLM's fields a row has no field for: at their defaults (a SamplingParams dumped whole) nothing asked
    vllm_defaults = {"max_tokens": 3, "flat_logprobs": False, "output_kind": None, "skip_clone": False}
    assert parse({"prompt": "p", "sampling_params": vllm_defaults}).overrides == {"max_tokens": 3}
    assert err({"prompt": "p", "sampling_params": {"flat_logprobs": True}}).endswith(
        "field 'sampling_params.flat_logprobs': a vLLM sampling field specbatch does not support yet; remove it")
    assert "'tokenized_prompt': expected a non-empty list" in err({"tokenized_prompt": []})
    # Ray's tokenize stage adds tokenized_prompt beside the prompt it came from: the prompt reads
    both = parse({"prompt": "p", "tokenized_prompt": [1], "sampling_params": {"n": 2}})
    assert (both.prompt, both.prompt_token_ids, both.overrides, both.ray_fields) == ("p", None, {"n": 2}, True)
    assert parse({"messages": msgs, "tokenized_prompt": [1]}).messages == msgs
    assert err({"prompt": "p", "sampling_params": {"temperature": -1}}).endswith(
        "field 'sampling_params.temperature': expected a number >= 0, got -1")
    assert "'sampling_params.length_penalty': not supported" in err(      # keeping a column exempts the row's own
        {"prompt": "p", "sampling_params": {"length_penalty": 2}}, keep_columns=("length_penalty",))
    assert "field 'sampling_params': an OpenAI batch line's request fields go inside 'body'" in err(
        {"custom_id": "c", "body": {"prompt": "p"}, "sampling_params": {"temperature": 0.5}})


def test_a_parquet_column_like_a_request_field_is_noted_outside_the_digest(tmp_path):
    """Parquet rows are read from the columns specbatch uses; a column that looks like a request
    field (`max_new_tokens`) is read too, so the job can say the rows run without it, but it
    changes nothing about the row, so a resume's digests stay those of the row without it."""
    plain = [{"prompt": "p", "label": "x"}, {"prompt": "q", "label": "y"}]
    noted = [{**r, "max_new_tokens": 8} for r in plain]
    a = list(open_rows(write_parquet(tmp_path / "a.parquet", plain)))
    b = list(open_rows(write_parquet(tmp_path / "b.parquet", noted)))
    assert [r.unread for r in b] == [(("max_new_tokens", "max_tokens"),)] * 2 and [r.unread for r in a] == [(), ()]
    assert [r.digest for r in a] == [r.digest for r in b] and all(r.overrides == {} for r in b)


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
        cut = rng.randrange(0, len(data) + 1)        # a head already read, cut anywhere (inside a line too)
        assert reader_mod.count_nonblank_lines(io.BytesIO(data[cut:]), data[:cut]) == expected, (data, cut)


def test_bom_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')
    (r,) = list(open_rows(str(path)))
    assert r.prompt == "a"
    only = tmp_path / "bom_line.jsonl"                 # a first line holding only the BOM is blank
    only.write_bytes(b'\xef\xbb\xbf\n{"prompt": "a"}\n')
    src = open_rows(str(only))
    rows = list(src)
    assert [type(x).__name__ for x in rows] == ["RowRequest"] and rows[0].row == 0 and src.total == 1


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
    # an OpenAI batch line is keyed by custom_id, which its response echoes, whatever else it carries
    line = {"id": "meta-1", "custom_id": "req-7", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    assert parse(line).id == "req-7"
    assert parse({**line, "custom_id": None}).id == "meta-1"
    # one without any: an error row with no id (its result's custom_id would be made up, maybe another's)
    bare = {k: v for k, v in line.items() if k not in ("id", "custom_id")}
    for missing in (bare, {**bare, "id": None, "custom_id": None}):
        e = parse(missing, as_given=True)
        assert isinstance(e, RowError) and e.id is None and e.batch_line
        assert e.error == ("f.jsonl:4: field 'custom_id': required on an OpenAI batch line (its result line echoes it, "
                           "and results are matched to requests by it), got none")
    assert parse({k: v for k, v in line.items() if k != "custom_id"}, id_column="id", as_given=True).id == "meta-1"
    # a batch line's fields at the top level, without its body, would run as a plain row's defaults
    flat = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "messages": MESSAGES, "max_tokens": 5}
    assert err(flat) == ("f.jsonl:4: field 'body': an OpenAI batch line (url '/v1/chat/completions') holds its "
                         "request in 'body', got none")
    assert parse({"prompt": "x", "url": "https://example.com/page"}).prompt == "x"      # a dataset's own url column
    # pandas stores an integer column with nulls as float: whole values are the integer ids
    assert parse({"prompt": "x", "id": 12.0}).id == 12 and "'id'" in err({"prompt": "x", "id": 1.5})


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


@pytest.mark.parametrize("last", [b'{"prompt": "done"}', b'{"prompt": "half', b'{"prompt": "\xff', b"[" * 100000, b""])
def test_a_resumes_digest_pass_numbers_and_digests_rows_as_reading_them_does(tmp_path, last):
    """A resume checks the committed rows by their digests: for JSONL it hashes the lines without
    parsing them (~20x faster), and must give every row the number and digest the full read gives,
    whatever the lines hold: a BOM, blank and CRLF lines, invalid UTF-8, nesting too deep for the
    parser, and a last line with no newline (valid JSON: a row; cut JSON: not one, the file still
    being written; invalid UTF-8: an error row)."""
    body = (b'\xef\xbb\xbf{"prompt": "a"}\n\n  \n{"prompt": "b"}\r\n\xff\xfe\n' + b"[" * 100000 + b"\n"
            b'{"id": 7, "messages": [{"role": "user", "content": "c"}]}\n' + last)
    path = tmp_path / "in.jsonl"
    path.write_bytes(body)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.jsonl").write_bytes(body)
    (tmp_path / "ds" / "b.jsonl").write_bytes(b'{"prompt": "z"}\n' + last)
    for p in (path, tmp_path / "ds"):
        full = [(r.row, r.digest) for r in open_rows(str(p))]
        light = [(d.row, d.digest) for d in open_rows(str(p)).digested()]
        assert light == full and len(full) >= 5


def _skipping_matches_the_full_read(path, done, **opts):
    from specbatch.data.digests import RowSet
    from specbatch.data.reader import Skipped

    full = list(open_rows(str(path), **opts))
    light = list(open_rows(str(path), **opts).skipping(RowSet(done)))
    assert [r.row for r in light] == [r.row for r in full] and len(full) >= 4
    for a, b in zip(light, full):            # (a line that is not JSON is its error row either way)
        assert a == (Skipped(b.row, b.id) if b.row in done and isinstance(a, Skipped) else b), (a, b)
        assert isinstance(a, Skipped) or b.row not in done or "JSON" in b.error or "UTF-8" in b.error
    assert {type(r) for r in light} >= {Skipped}


@pytest.mark.parametrize("id_column", [None, "uid"])
def test_a_resumes_pass_reads_committed_rows_ids_only(tmp_path, monkeypatch, id_column):
    """A resume's pass over the input skips its committed rows reading no more of them than their
    ids (the repeated-ids count needs every row's), each the id the full read gives: bad ids and
    rows that are not objects have none; the other rows are read in full, JSONL and
    Parquet (a batch of committed rows alone, and a batch holding both), in a directory too."""
    monkeypatch.setattr(reader_mod, "PARQUET_BATCH_ROWS", 2)
    lines = [b'{"id": "a", "uid": 1, "prompt": "x"}', b'{"id": 3.0, "uid": "u", "prompt": 5}', b"",
             b'{"id": true, "uid": [1], "prompt": "x"}', b'{"id": {"k": 1}, "prompt": "x"}',
             b'{"custom_id": "c", "id": "i", "body": {"prompt": "p"}}', b'{"custom_id": "c2", "id": "i2"}',
             b'{"id": "\\ud800", "uid": "\\udc00", "prompt": "x"}', b"[1, 2]", b"not json", b'{"id": "\xff"}',
             b'{"id": 99999999999999999999, "prompt": "x"}', b'{"uid": null, "prompt": "y"}', b'{"prompt": "half']
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines))
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.jsonl").write_bytes(b"\n".join(lines[:-1]) + b"\n")
    (tmp_path / "ds" / "b.jsonl").write_bytes(b"\n".join(lines))
    opts = {"id_column": id_column}
    for done in ({0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {1, 4, 7}, set(range(30))):
        _skipping_matches_the_full_read(path, done, **opts)
        _skipping_matches_the_full_read(tmp_path / "ds", done, **opts)
    rows = [{"id": "a", "custom_id": None, "uid": 1, "prompt": "x", "body": None},
            {"id": None, "custom_id": "c", "uid": None, "prompt": None, "body": {"prompt": "p"}},
            {"id": "i", "custom_id": "c2", "uid": 7, "prompt": None, "body": {"prompt": None}},
            {"id": None, "custom_id": None, "uid": 2, "prompt": "y", "body": None},
            {"id": "e", "custom_id": None, "uid": 1.5, "prompt": "z", "body": None}]
    pq.write_table(pa.Table.from_pylist(rows * 2), tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ds" / "c.parquet")
    (tmp_path / "ds" / "a.jsonl").unlink()
    (tmp_path / "ds" / "b.jsonl").unlink()
    pq.write_table(pa.Table.from_pylist(rows[:3]), tmp_path / "ds" / "b.parquet")
    for done in ({0, 1, 2, 3, 5, 7, 8, 9}, {2, 3}, set(range(10))):
        _skipping_matches_the_full_read(tmp_path / "in.parquet", done, **opts)
        _skipping_matches_the_full_read(tmp_path / "ds", done, **opts)


def test_a_resumes_digest_pass_over_parquet_gives_the_full_reads_digests(tmp_path, monkeypatch):
    """Parquet rows are digested without validating them (a resume's check): every row, good or
    bad, in every form, with the columns left out of the digest (noted fields, Ray Data LLM's
    nulls and a tokenized_prompt beside a prompt) and across batches and a directory's files."""
    monkeypatch.setattr(reader_mod, "PARQUET_BATCH_ROWS", 2)
    rows = [
        {"id": "a", "prompt": "p", "tokenized_prompt": None, "sampling_params": {"max_tokens": 7, "n": None}},
        {"id": "b", "prompt": None, "tokenized_prompt": [5, 6], "sampling_params": None},
        {"id": "c", "prompt": "p", "tokenized_prompt": [1], "sampling_params": None},
        {"id": None, "prompt": None, "tokenized_prompt": None, "sampling_params": None},
        {"id": "e", "prompt": "q", "tokenized_prompt": None, "sampling_params": {"max_tokens": -1, "n": 2}},
    ]
    extra = [{"messages": MESSAGES, "max_new_tokens": 3, "temperature": 9.0, "k": b"\x00"},
             {"messages": None, "max_new_tokens": None, "temperature": 0.5, "k": None},
             {"messages": [{"role": "", "content": "x"}], "max_new_tokens": 1, "temperature": None, "k": b"x"}]
    bodies = [{"custom_id": "x", "body": {"prompt": "p", "seed": 1}}, {"custom_id": None, "body": None},
              {"custom_id": "z", "body": {"prompt": None, "seed": None}}]
    (tmp_path / "ds").mkdir()
    paths = [write_parquet(tmp_path / "r.parquet", rows), write_parquet(tmp_path / "ds" / "a.parquet", rows),
             write_parquet(tmp_path / "x.parquet", extra), write_parquet(tmp_path / "ds" / "b.parquet", rows[:3]),
             write_parquet(tmp_path / "b.parquet", bodies)]
    for p, opts in [*((p, {}) for p in paths), (paths[2], {"keep_columns": ["k"]}), (str(tmp_path / "ds"), {})]:
        full = [(r.row, r.digest) for r in open_rows(p, **opts)]
        light = [(d.row, d.digest) for d in open_rows(p, **opts).digested()]
        assert light == full and len(full) >= 3


def test_a_prompt_column_of_conversations_reads_as_chat(tmp_path):
    """TRL's conversational datasets hold each prompt as a list of messages under `prompt`; such a
    column (or the one --prompt-column names) reads as a chat, its errors named under it."""
    conv = [{"role": "system", "content": "brief"}, {"role": "user", "content": "hi"}]
    (chat,) = open_rows(write_parquet(tmp_path / "trl.parquet", [{"prompt": conv}]))
    assert (chat.messages, chat.endpoint, chat.prompt) == (conv, "chat", None)
    _, plain = open_rows(write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": conv}, {"prompt": "plain"}]))
    assert (plain.prompt, plain.messages, plain.endpoint) == ("plain", None, "completion")
    named = list(open_rows(write_jsonl(tmp_path / "c.jsonl", [{"conversation": conv, "add_generation_prompt": False}]),
                           prompt_column="conversation"))[0]
    assert named.messages == conv and named.chat == {"add_generation_prompt": False}
    assert "field 'prompt[1].content': expected a string or a list of text parts, got 5" in \
        err({"prompt": [conv[0], {"role": "user", "content": 5}]})
