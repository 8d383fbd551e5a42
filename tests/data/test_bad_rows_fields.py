"""One bad row never stops a job, and nothing a row asks for is silently ignored: the fields of a
row (lone surrogates, numeric ranges, a prompt given as null, ids that keep their type)."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import RowError, RowRequest, open_rows

from bad_rows_helpers import WHERE, err, parse, write_lines


# ---- lone surrogates -------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj,field",
    [
        ({"prompt": "hello\ud800"}, "prompt"),
        ({"text": "hello\udfff x"}, "text"),
        ({"messages": [{"role": "user", "content": "hello\ud800"}]}, "messages[0].content"),
        ({"messages": [{"role": "hello\ud800", "content": "x"}]}, "messages[0].role"),
        ({"prompt": "x", "stop": "hello\ud800"}, "stop"),
        ({"prompt": "x", "stop": ["ok", "hello\ud800"]}, "stop[1]"),
        ({"body": {"prompt": "hello\ud800"}}, "body.prompt"),
        ({"body": {"prompt": ["hello\ud800"]}}, "body.prompt"),
        ({"body": {"messages": [{"role": "user", "content": "hello\ud800"}]}}, "body.messages[0].content"),
        ({"body": {"prompt": "x", "stop": ["hello\udc00"]}}, "body.stop[0]"),
    ],
)
def test_lone_surrogate_is_the_rows_error(obj, field):
    prompt_column = "text" if "text" in obj else "prompt"
    e = err(obj, prompt_column=prompt_column)
    assert e.error == f"{WHERE}: field '{field}': invalid Unicode (lone surrogate at character 5)"


def test_lone_surrogate_in_id_leaves_the_row_without_one():
    # no id made up: the row number may be another row's id (a result joined back by it would land there)
    e = err({"prompt": "x", "id": "hello\ud800"})
    assert e.id is None and "field 'id': invalid Unicode (lone surrogate at character 5)" in e.error
    e = err({"prompt": "x", "uid": "\ud800"}, id_column="uid")
    assert e.id is None and "field 'uid'" in e.error and "character 0" in e.error
    e = err({"prompt": "x", "custom_id": "ab\udc01"})
    assert e.id is None and "field 'custom_id'" in e.error


def test_lone_surrogate_in_keep_column_nulls_that_column():
    obj = {"prompt": "x", "id": "a", "meta": {"tags": ["ok", "bad\ud800"]}, "lang": "en"}
    e = err(obj, keep_columns=["meta", "lang"])
    assert e.id == "a"
    assert e.keep == {"meta": None, "lang": "en"}
    assert "field 'meta.tags[1]': invalid Unicode (lone surrogate at character 3)" in e.error
    e = err({"prompt": "x", "meta": {"\ud800k": 1}}, keep_columns=["meta"])
    assert e.keep == {"meta": None} and "field 'meta'" in e.error and "key" in e.error
    e = err({"prompt": "x", "note": "\udc80"}, keep_columns=["note"])
    assert e.keep == {"note": None} and "field 'note'" in e.error
    # valid pairs decode to one character: fine
    ok = parse(json.loads('{"prompt": "smile \\ud83d\\ude00", "meta": ["\\ud83d\\ude00"]}'), keep_columns=["meta"])
    assert isinstance(ok, RowRequest) and ok.prompt == "smile \U0001F600" and ok.keep == {"meta": ["\U0001F600"]}


def test_lone_surrogates_in_a_jsonl_file(tmp_path):
    path = write_lines(tmp_path / "s.jsonl", [
        '{"prompt": "fine"}',
        '{"prompt": "caf\\ud800"}',
        '{"id": "\\udc00", "prompt": "x"}',
        '{"prompt": "x", "k": ["\\ud800"]}',
        '{"prompt": "x", "temperature": "\\ud800"}',
    ])
    out = list(open_rows(path, keep_columns=["k"]))
    assert isinstance(out[0], RowRequest)
    assert out[1].error == f"{path}:2: field 'prompt': invalid Unicode (lone surrogate at character 3)"
    assert out[2].id is None and "field 'id'" in out[2].error
    assert out[3].keep == {"k": None} and "field 'k[0]'" in out[3].error
    assert "field 'temperature'" in out[4].error
    for r in out[1:]:
        r.error.encode("utf-8")


# ---- numeric ranges ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("top_k", 1e30, "expected an integer in [1, 2147483647] (0 or -1 to disable), got 1e+30"),
        ("top_k", 2**31, "expected an integer in [1, 2147483647]"),
        ("max_tokens", 2**31, "expected an integer in [1, 2147483647], got 2147483648"),
        ("max_completion_tokens", 1e20, "expected an integer in [1, 2147483647]"),
        ("stop_token_ids", [1, 2**63], "expected an integer in [0, 9223372036854775807]"),
        ("temperature", 10**400, "expected a number >= 0"),
        ("top_p", 10**400, "expected a number in (0, 1]"),
    ],
)
def test_out_of_range_numbers(field, value, expected):
    e = err({"prompt": "x", field: value})
    assert f"field '{field}" in e.error and expected in e.error, e.error


def test_in_range_numbers():
    r = parse({"prompt": "x", "top_k": 2**31 - 1, "max_tokens": 2**31 - 1, "stop_token_ids": [2**63 - 1],
               "seed": 2**100, "temperature": 1e300})
    assert r.overrides == {"top_k": 2**31 - 1, "max_tokens": 2**31 - 1, "stop_token_ids": [2**63 - 1],
                           "seed": 2**100, "temperature": 1e300}
    assert parse({"prompt": "x", "seed": -(2**80)}).overrides == {"seed": -(2**80)}


def test_non_finite_numbers_from_json(tmp_path):
    path = write_lines(tmp_path / "nf.jsonl", [
        '{"prompt": "x", "temperature": Infinity}',
        '{"prompt": "x", "temperature": NaN}',
        '{"prompt": "x", "top_k": 1e400}',
    ])
    out = list(open_rows(path))
    assert all(isinstance(r, RowError) for r in out), out
    assert "field 'temperature'" in out[0].error and "field 'top_k'" in out[2].error


def test_ids_outside_int64_are_row_errors():
    e = err({"prompt": "x", "id": 2**64})
    assert e.id is None and "field 'id'" in e.error
    assert parse({"prompt": "x", "id": 2**63 - 1}).id == 2**63 - 1


# ---- a prompt given as null -------------------------------------------------------------------


def test_null_prompt_is_named():
    assert err({"prompt": None}).error == f"{WHERE}: field 'prompt': expected a non-empty string, got null"
    assert "field 'text': expected a non-empty string, got null" in err({"text": None}, prompt_column="text").error
    assert "field 'messages': expected a non-empty list" in err({"messages": None}).error
    assert "field 'body.prompt': expected a non-empty string, got null" in err({"body": {"prompt": None}}).error
    assert "no 'prompt' or 'messages' field" in err({"other": 1}).error


# ---- ids keep their type ---------------------------------------------------------------------


def test_ids_keep_their_type(tmp_path):
    path = write_lines(tmp_path / "ids.jsonl", [
        '{"prompt": "a", "id": 7}', '{"prompt": "a", "id": "7"}', '{"prompt": "a"}',
        '{"prompt": "a", "custom_id": 12}', '{"prompt": "a", "id": [1]}', '{"prompt": "", "id": 9}', "[]",
    ])
    out = list(open_rows(path))
    assert [r.id for r in out] == [7, "7", 2, 12, None, 9, None]      # an id that cannot be read: none
    assert [type(r.id) for r in out] == [int, str, int, int, type(None), int, type(None)]
    ppath = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "uid": 5}, {"prompt": "b", "uid": None}]), ppath)
    out = list(open_rows(str(ppath), id_column="uid"))
    assert out[0].id == 5 and isinstance(out[0].id, int) and out[1].id is None and isinstance(out[1], RowError)


# ---- OpenAI content parts ---------------------------------------------------------------------


def test_text_content_parts_are_read_as_vllm_reads_them_and_other_parts_named():
    """OpenAI's content may be a list of parts: their texts are kept (chat_template.py joins them
    or hands them on as the template needs); text, input_text, output_text, refusal and thinking
    parts and bare strings are text, a null text is skipped, as vLLM reads them; a media part (an
    image) is a row error naming its type."""
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "    return"}]
    row = parse({"messages": [{"role": "user", "content": parts}]})
    assert isinstance(row, RowRequest)
    assert row.messages == [{"role": "user", "content": ["def add(a, b):", "    return"]}]
    batch = parse({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"messages": [{"role": "user", "content": parts[:1]}]}})
    assert batch.messages == [{"role": "user", "content": ["def add(a, b):"]}]
    kinds = [{"type": "input_text", "text": "a"}, "b", {"type": "output_text", "text": "c"},
             {"type": "refusal", "refusal": "d"}, {"type": "thinking", "thinking": "e"}, {"type": "text", "text": None}]
    assert parse({"messages": [{"role": "user", "content": kinds}]}).messages[0]["content"] == list("abcde")
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    assert "field 'messages[0].content[0].type': expected a text part, 'text' (specbatch runs text-only models), " \
           "got \"image_url\"" in err({"messages": [{"role": "user", "content": image}]}).error
    assert "field 'messages[0].content[0].text': expected a string" in \
        err({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}).error
    assert "field 'messages[0].content': expected a string or a list of text parts" in \
        err({"messages": [{"role": "user", "content": 5}]}).error


def test_tool_turns_and_names_reach_the_template():
    """name, tool_calls and tool_call_id go to the chat template as vLLM hands them; an assistant
    turn that only calls tools may have no content."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    row = parse({"messages": [{"role": "user", "content": "hi", "name": "ann"},
                              {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "content": "2", "tool_call_id": "c1"}]})
    assert row.messages == [{"role": "user", "name": "ann", "content": "hi"},
                            {"role": "assistant", "content": [],       # arguments parsed, as vLLM's
                             "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert "field 'messages[0].name': expected a string" in \
        err({"messages": [{"role": "user", "content": "x", "name": 3}]}).error
    assert "field 'messages[0].tool_calls': expected a list of objects" in \
        err({"messages": [{"role": "assistant", "content": None, "tool_calls": "add"}]}).error


def test_null_or_absent_content_is_empty_as_vllm_reads_it():
    """vLLM reads a turn's null (or absent, or empty-list) content as no parts: an empty text,
    whatever the role (an assistant turn that only calls tools, a system turn left blank)."""
    row = parse({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"},
                              {"role": "assistant"}, {"role": "user", "content": []}]})
    assert [m["content"] for m in row.messages] == [[], "hi", [], []]
