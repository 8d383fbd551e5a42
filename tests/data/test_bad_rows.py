"""One bad row never stops a job, and nothing a row asks for is silently ignored: lone surrogates,
exceptions while building a request, numeric ranges, tiny temperatures, huge prompts,
unsupported sampling fields, inputs that are not JSONL, row digests, tokenizer safety, --device."""
from __future__ import annotations

import builtins
import gzip
import hashlib
import io
import json
import shutil
import sys
import time
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from specbatch.data import InputError, RowError, RowRequest, open_rows, parse_row
from specbatch.data import reader as reader_mod
from specbatch.engine import Engine, EngineOptions, resolve_device
from specbatch.recipe import SamplingDefaults

from errors import one_line_cli_error, one_line_model_error

MESSAGES = [{"role": "user", "content": "hi"}]
WHERE = "f.jsonl:4"


def parse(obj, **kw):
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


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, EngineOptions(batch_size=2, device="cpu", max_model_len=64))


# ---- 1. lone surrogates -------------------------------------------------------------------


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


def test_lone_surrogate_in_id_uses_the_row_number():
    e = err({"prompt": "x", "id": "hello\ud800"})
    assert e.id == 3 and "field 'id': invalid Unicode (lone surrogate at character 5)" in e.error
    e = err({"prompt": "x", "uid": "\ud800"}, id_column="uid")
    assert e.id == 3 and "field 'uid'" in e.error and "character 0" in e.error
    e = err({"prompt": "x", "custom_id": "ab\udc01"})
    assert e.id == 3 and "field 'custom_id'" in e.error


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
    assert out[2].id == 2 and "field 'id'" in out[2].error
    assert out[3].keep == {"k": None} and "field 'k[0]'" in out[3].error
    assert "field 'temperature'" in out[4].error
    for r in out[1:]:
        r.error.encode("utf-8")


# ---- 2. any exception building a request is the row's error ------------------------------


def test_tokenizer_exception_is_the_rows_error(engine):
    bad = RowRequest(row=0, id="a", prompt="ab\ud800c", where="in.jsonl:1")   # built without parse_row
    rec = engine.make_request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["id"] == "a"
    assert rec["error"].startswith("in.jsonl:1: cannot tokenize the prompt (TypeError: ")
    assert "\n" not in rec["error"]


def test_any_exception_while_encoding_is_the_rows_error(engine):
    bad = RowRequest(row=4, id=4, messages=[{"role": "user", "content": 5}])   # built without parse_row
    rec = engine.make_request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["error"].startswith("row 4: cannot tokenize the prompt (")
    assert "Error: " in rec["error"] and "\n" not in rec["error"]


def test_sampling_parameter_exception_is_the_rows_error(engine):
    bad = RowRequest(row=1, id="b", prompt="def add(a, b):", overrides={"top_k": "lots"})
    rec = engine.make_request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["error"].startswith("row 1: ") and "ValueError" in rec["error"]


def test_a_bad_row_does_not_stop_generate(engine):
    rows = [RowRequest(row=0, id=0, prompt="def add(a, b):"),
            RowRequest(row=1, id=1, prompt="x\udc00"),
            RowRequest(row=2, id=2, prompt="import os", overrides={"temperature": object()}),
            RowRequest(row=3, id=3, prompt="class Point:")]
    recs = sorted(engine.generate(rows, SamplingDefaults(max_tokens=3)), key=lambda r: r["row"])
    assert [r["row"] for r in recs] == [0, 1, 2, 3]
    assert [r["error"] is None for r in recs] == [True, False, False, True]


# ---- 3. numeric ranges ---------------------------------------------------------------------


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
    assert e.id == 3 and "field 'id'" in e.error
    assert parse({"prompt": "x", "id": 2**63 - 1}).id == 2**63 - 1


def test_huge_top_k_runs_in_the_engine(engine):
    """top_k beyond the vocabulary means no filter; the tensor build does not overflow."""
    rows = [RowRequest(row=0, id=0, prompt="def add(a, b):",
                       overrides={"top_k": 2**31 - 1, "temperature": 1.0, "seed": 1})]
    (rec,) = engine.generate(rows, SamplingDefaults(max_tokens=3, ignore_eos=True))
    assert rec["error"] is None and rec["completion_tokens"] == 3


# ---- 4. tiny temperatures are greedy ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 9e-6])
def test_tiny_temperature_is_greedy(engine, temperature):
    prompts = ["def add(a, b):", "import os\n", "for i in range(10):"]

    def run(overrides, **defaults):
        rows = [RowRequest(row=i, id=i, prompt=p, overrides=dict(overrides)) for i, p in enumerate(prompts)]
        d = SamplingDefaults(**{"max_tokens": 8, "ignore_eos": True, "seed": 5, **defaults})
        return [r["output_token_ids"] for r in sorted(engine.generate(rows, d), key=lambda r: r["row"])]

    greedy = run({"temperature": 0.0})
    assert run({"temperature": temperature}) == greedy                  # a row override
    assert run({}, temperature=temperature) == greedy                   # the recipe / CLI default
    assert run({"temperature": 1.0}) != greedy                          # sampling still samples


# ---- 5. huge prompts are bounded by the context ------------------------------------------------


def test_huge_prompt_is_rejected_without_tokenizing(engine):
    text = "def add(a, b):\n    return a + b\n" * 100_000                # 3.2 MB
    t0 = time.perf_counter()
    rec = engine.make_request(RowRequest(row=0, id=0, prompt=text, where="in.jsonl:1"), SamplingDefaults())
    took = time.perf_counter() - t0
    assert rec["error"].startswith(f"in.jsonl:1: prompt has {len(text)} bytes, more than the context of "
                                   f"{engine.max_len} tokens")
    assert took < 0.3, took
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    t0 = time.perf_counter()
    rec = engine.make_request(RowRequest(row=1, id=1, messages=msgs), SamplingDefaults())
    assert f"prompt has {len(text) + 8} bytes" in rec["error"] and time.perf_counter() - t0 < 0.3


def test_long_prompt_is_tokenized_by_a_prefix_first(engine, monkeypatch):
    from specbatch import prompts

    monkeypatch.setitem(prompts._BYTES_PER_TOKEN, engine.tokenizer, 10**9)   # skip the byte bound
    text = "for i in range(10):\n    print(i * i)\n" * 100_000          # 3.7 MB
    calls = []
    real = type(engine.tokenizer).__call__

    def spy(self, t, *a, **kw):
        calls.append(len(t))
        return real(self, t, *a, **kw)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", spy)
    t0 = time.perf_counter()
    rec = engine.make_request(RowRequest(row=0, id=0, prompt=text, where="in.jsonl:1"), SamplingDefaults())
    assert time.perf_counter() - t0 < 0.5
    assert rec["error"] == (f"in.jsonl:1: prompt has more than {engine.max_len} tokens but the context is "
                            f"{engine.max_len} tokens (the model's limit, --max-model-len, or what the KV pool holds)")
    assert calls == [engine.max_len * 8]


def test_prompts_near_the_context_keep_the_usual_messages(engine):
    from specbatch.prompts import max_bytes_per_token

    assert max_bytes_per_token(engine.tokenizer) >= 16
    text = "def add(a, b):\n    return a + b\n" * 6                            # > 64 tokens, < 64 * 8 bytes
    rec = engine.make_request(RowRequest(row=0, id=0, prompt=text, where="w"), SamplingDefaults())
    assert rec["error"].startswith("w: prompt has ") and "tokens but the context is 64 tokens" in rec["error"]
    assert rec["prompt_tokens"] > 64
    req = engine.make_request(RowRequest(row=0, id=0, prompt="def add(a, b):"), SamplingDefaults())
    assert not isinstance(req, dict)


# ---- 6. unsupported sampling fields ------------------------------------------------------------


NON_DEFAULT = {
    "n": 2, "best_of": 3, "logprobs": True, "top_logprobs": 5, "prompt_logprobs": 1,
    "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "length_penalty": 0.8,
    "min_p": 0.05, "min_tokens": 30, "logit_bias": {"42": 5}, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= x", "structured_outputs": {"json": {}}, "tools": [{"type": "function"}],
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "parallel_tool_calls": "yes", "use_beam_search": True, "bad_words": ["x"], "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 10, "include_stop_str_in_output": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "echo": True, "suffix": "}", "stream": True,
    "stream_options": {"include_usage": True}, "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "reasoning_effort": "high",
}
DEFAULTS = {
    "n": 1, "best_of": None, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0,
    "frequency_penalty": 0, "repetition_penalty": 1.0, "length_penalty": 1, "min_p": 0.0, "min_tokens": 0,
    "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
    "function_call": "none", "parallel_tool_calls": True, "use_beam_search": False, "bad_words": [],
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "echo": False, "suffix": "", "stream": False, "stream_options": None, "modalities": ["text"],
    "reasoning_effort": None, "prompt_logprobs": None,
}


def test_the_table_covers_every_field():
    from specbatch.data.fields import UNSUPPORTED_FIELDS

    assert set(NON_DEFAULT) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_unsupported_field_with_a_value_is_a_row_error(name):
    e = err({"custom_id": "c", "method": "POST", "body": {"messages": MESSAGES, name: NON_DEFAULT[name]}})
    assert e.id == "c"
    assert f"field 'body.{name}': not supported by specbatch yet (got " in e.error
    assert "; remove it or set it to its default " in e.error
    e = err({"prompt": "x", name: NON_DEFAULT[name]})
    assert f"field '{name}': not supported by specbatch yet" in e.error


def test_unsupported_message():
    e = err({"body": {"prompt": "x", "min_tokens": 30}})
    assert e.error == (f"{WHERE}: field 'body.min_tokens': not supported by specbatch yet (got 30); "
                       "remove it or set it to its default 0")


def test_defaults_are_accepted():
    r = parse({"custom_id": "c", "body": {"messages": MESSAGES, **DEFAULTS}})
    assert isinstance(r, RowRequest), r
    r = parse({"prompt": "x", **DEFAULTS})
    assert isinstance(r, RowRequest), r
    assert isinstance(parse({"body": {"prompt": "x", "logprobs": 0}}), RowRequest)   # completions API
    assert isinstance(parse({"body": {"prompt": "x", "logprobs": None, "n": 1.0}}), RowRequest)


def test_metadata_and_named_columns_stay_allowed():
    r = parse({"prompt": "x", "category": "math", "source": {"n": 5}, "model": "m"})
    assert isinstance(r, RowRequest)
    # a column the user names (id or keep) is their data, not a sampling field
    r = parse({"prompt": "x", "n": 7, "echo": "yes"}, id_column="n", keep_columns=["echo"])
    assert isinstance(r, RowRequest) and r.id == 7 and r.keep == {"echo": "yes"}
    # top-level fields of an OpenAI batch line are not its sampling fields
    assert isinstance(parse({"custom_id": "c", "n": 3, "body": {"prompt": "x"}}), RowRequest)


def test_method_must_be_post():
    e = err({"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}})
    assert e.error == f"{WHERE}: field 'method': expected 'POST', got \"GET\""
    assert isinstance(parse({"custom_id": "c", "body": {"prompt": "x"}}), RowRequest)
    assert isinstance(parse({"prompt": "x", "method": "GET"}), RowRequest)       # plain rows: metadata


def test_unsupported_fields_in_parquet(tmp_path):
    path = tmp_path / "u.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "a", "min_tokens": 0, "body": None},
        {"prompt": "b", "min_tokens": 5, "body": None},
    ]), path)
    out = list(open_rows(str(path)))
    assert isinstance(out[0], RowRequest)
    assert out[1].error == (f"{path} row 1: field 'min_tokens': not supported by specbatch yet (got 5); "
                            "remove it or set it to its default 0")
    path = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"custom_id": "x", "method": "POST", "body": {"prompt": "a", "logprobs": False}},
        {"custom_id": "y", "method": "PUT", "body": {"prompt": "a", "logprobs": False}},
        {"custom_id": "z", "method": "POST", "body": {"prompt": "a", "logprobs": True}},
    ]), path)
    out = list(open_rows(str(path)))
    assert isinstance(out[0], RowRequest)
    assert "field 'method'" in out[1].error and "field 'body.logprobs'" in out[2].error


# ---- 7. a prompt given as null -------------------------------------------------------------------


def test_null_prompt_is_named():
    assert err({"prompt": None}).error == f"{WHERE}: field 'prompt': expected a non-empty string, got null"
    assert "field 'text': expected a non-empty string, got null" in err({"text": None}, prompt_column="text").error
    assert "field 'messages': expected a non-empty list" in err({"messages": None}).error
    assert "field 'body.prompt': expected a non-empty string, got null" in err({"body": {"prompt": None}}).error
    assert "no 'prompt' or 'messages' field" in err({"other": 1}).error


# ---- 8. JSON errors --------------------------------------------------------------------------


def test_malformed_json_message(tmp_path):
    path = write_lines(tmp_path / "j.jsonl", ['{"prompt": "ok"}', '{"prompt": "abc', '{"prompt": 1,}',
                                              '{"prompt": "a\tb"}', '{"prompt": "ok"} x'])
    out = list(open_rows(path))
    assert out[1].error == f"{path}:2: malformed JSON at column 12: Unterminated string"
    assert out[2].error.startswith(f"{path}:3: malformed JSON at column 14: ")
    assert out[3].error == f"{path}:4: malformed JSON at column 14: Invalid control character"
    assert out[4].error == f"{path}:5: malformed JSON at column 18: Extra data"
    assert all(" at" not in r.error.split("malformed JSON at column")[1] for r in out[1:])


# ---- 9. JSONL checks at open ---------------------------------------------------------------------


def test_jsonl_columns_are_checked_at_open(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", ['{"text": "a", "uid": 1}', '{"text": "b", "meta": 2}'])
    with pytest.raises(InputError) as ei:
        open_rows(path)
    assert str(ei.value) == (f"{path}: no 'prompt', 'messages', 'prompt_token_ids' or 'body' field in the "
                             "first 2 rows (fields: text, uid, meta)")
    with pytest.raises(InputError, match=r"id column 'id' is not in the first 2 rows \(fields: text, uid, meta\)"):
        open_rows(path, prompt_column="text", id_column="id")
    with pytest.raises(InputError, match="keep column 'lang' is not in the first 2 rows"):
        open_rows(path, prompt_column="text", keep_columns=["meta", "lang"])
    # present in some row of the block: fine (rows without it get null / their own errors)
    src = open_rows(path, prompt_column="text", id_column="uid", keep_columns=["meta"])
    out = list(src)
    assert out[0].id == 1 and out[0].keep == {"meta": None} and isinstance(out[1], RowError)


def test_column_check_reads_only_the_first_block(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 3)
    path = write_lines(tmp_path / "late.jsonl", ['{"prompt": "a"}'] * 3 + ['{"prompt": "b", "late": 1}'])
    with pytest.raises(InputError, match="keep column 'late' is not in the first 3 rows"):
        open_rows(path, keep_columns=["late"])
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 4)
    assert [r.keep for r in open_rows(path, keep_columns=["late"])][-1] == {"late": 1}


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("rows.jsonl", '{"prompt": "a"}\n')
    return buf.getvalue()


def _parquet_bytes(tmp_path) -> bytes:
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}]), tmp_path / "p.parquet")
    return (tmp_path / "p.parquet").read_bytes()


@pytest.mark.parametrize("kind,what", [("png", "a PNG image"), ("gzip", "gzip-compressed data"),
                                       ("zip", "a zip archive"), ("parquet", "a Parquet file")])
def test_not_jsonl_at_all(tmp_path, kind, what):
    data = {
        "png": lambda: b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40,
        "gzip": lambda: gzip.compress(b'{"prompt": "a"}\n' * 100),
        "zip": _zip_bytes,
        "parquet": lambda: _parquet_bytes(tmp_path),
    }[kind]()
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    with pytest.raises(InputError) as ei:
        open_rows(str(path))
    assert str(ei.value) == f"{path}: looks like {what}, not JSONL"


def test_text_that_is_not_jsonl(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", ["id,prompt", "1,hello", "2,world"])
    with pytest.raises(InputError) as ei:
        open_rows(path)
    assert str(ei.value) == f"{path}: does not look like JSONL: not one of its first 3 non-blank lines is a JSON object"
    path = write_lines(tmp_path / "one.jsonl", ["[1, 2]"])
    with pytest.raises(InputError, match="not one of its first line is a JSON object"):
        open_rows(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n")
    assert list(open_rows(str(empty))) == []


def test_cli_exit_2_for_a_file_that_is_not_jsonl(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from specbatch.cli import EXIT_USAGE, app

    path = tmp_path / "in.jsonl"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n'))
    result = CliRunner().invoke(app, ["run", str(path), "--model", str(tiny_model), "--device", "cpu",
                                      "-o", str(tmp_path / "o.parquet")])
    line = one_line_cli_error(result, EXIT_USAGE)
    assert "looks like gzip-compressed data, not JSONL" in line


def _fake_stdin(monkeypatch, data: bytes) -> io.BytesIO:
    stream = io.BytesIO(data)

    class FakeStdin:
        buffer = stream

    monkeypatch.setattr("sys.stdin", FakeStdin())
    return stream


def test_stdin_is_checked_then_read_once(monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_LINES", 2)
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 1 << 20)
    lines = [json.dumps({"prompt": f"p{i}", "k": i}) for i in range(6)]
    _fake_stdin(monkeypatch, ("\n".join(lines) + "\n").encode())
    out = list(open_rows("-", keep_columns=["k"]))
    assert [r.prompt for r in out] == [f"p{i}" for i in range(6)]
    assert [r.where for r in out] == [f"<stdin>:{i + 1}" for i in range(6)]
    _fake_stdin(monkeypatch, gzip.compress(b'{"prompt": "a"}\n'))
    with pytest.raises(InputError, match=r"^<stdin>: looks like gzip-compressed data, not JSONL$"):
        list(open_rows("-"))
    _fake_stdin(monkeypatch, b'{"prompt": "a"}\n')
    with pytest.raises(InputError, match="^<stdin>: keep column 'x' is not in the first 1 row "):
        list(open_rows("-", keep_columns=["x"]))


def test_stdin_line_cut_by_the_block_budget(monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 40)
    big = json.dumps({"prompt": "x" * 200, "k": 1})
    data = f'{{"prompt": "a"}}\n{big}\n{{"prompt": "c"}}\n'.encode()
    _fake_stdin(monkeypatch, data)
    out = list(open_rows("-", keep_columns=["k"]))
    assert [r.prompt for r in out] == ["a", "x" * 200, "c"] and out[1].keep == {"k": 1}
    # a first line longer than the block is not judged by its cut prefix
    _fake_stdin(monkeypatch, (big + "\n").encode())
    (r,) = list(open_rows("-"))
    assert r.prompt == "x" * 200


def test_long_first_line_in_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_mod, "BLOCK_BYTES", 64)
    path = write_lines(tmp_path / "long.jsonl", [json.dumps({"prompt": "y" * 500}), '{"prompt": "z"}'])
    assert [r.prompt for r in open_rows(path)] == ["y" * 500, "z"]


# ---- 10. row digests -----------------------------------------------------------------------------


def test_jsonl_digests(tmp_path):
    lines = [b'{"prompt": "a"}', b'{"prompt": "b"}', b'{"prompt": "a"}', b'  {"prompt": "a"}\t',
             b'{"prompt": "caf\xe9"}', b'{"prompt": "x', b"[1]", b'{"prompt": ""}', b'{"prompt": "a", "id": 1}']
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    out = list(open_rows(str(path)))
    assert len(out) == len(lines)
    assert all(isinstance(r.digest, bytes) and len(r.digest) == 16 for r in out)
    assert out[0].digest == out[2].digest == out[3].digest == hashlib.blake2b(lines[0], digest_size=16).digest()
    assert len({r.digest for r in out}) == len(lines) - 2
    assert isinstance(out[4], RowError) and isinstance(out[5], RowError) and isinstance(out[6], RowError)


def test_parquet_digests(tmp_path):
    rows = [{"prompt": "a", "t": 1.0}, {"prompt": "b", "t": 1.0}, {"prompt": "a", "t": 1.0},
            {"prompt": "a", "t": 0.5}, {"prompt": "", "t": None}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows).rename_columns(["prompt", "temperature"]), path)
    out = list(open_rows(str(path)))
    assert all(len(r.digest) == 16 for r in out) and isinstance(out[4], RowError)
    assert out[0].digest == out[2].digest
    assert len({r.digest for r in out}) == 4
    expected = json.dumps({"prompt": "a", "temperature": 1.0}, sort_keys=True, ensure_ascii=False)
    assert out[0].digest == hashlib.blake2b(expected.encode(), digest_size=16).digest()


def test_stdin_digests(monkeypatch):
    _fake_stdin(monkeypatch, b'{"prompt": "a"}\n{bad\n{"prompt": "a"}\n')
    out = list(open_rows("-"))
    assert out[0].digest == out[2].digest != out[1].digest and len(out[1].digest) == 16


# ---- 11. tokenizer safety ------------------------------------------------------------------------


@pytest.fixture
def no_stdin(monkeypatch):
    read = []

    class Stdin:
        def __getattr__(self, name):
            read.append(name)
            raise AssertionError(f"stdin.{name} used")

    def no_input(*a, **kw):
        read.append("input")
        raise AssertionError("input() called")

    monkeypatch.setattr(sys, "stdin", Stdin())
    monkeypatch.setattr(builtins, "input", no_input)
    return read


def test_tokenizer_with_remote_code_is_refused(tiny_model, tmp_path, no_stdin):
    from specbatch.prompts import load_tokenizer

    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    marker = tmp_path / "MARKER"
    (d / "evil_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    msg = one_line_model_error(lambda: load_tokenizer(d))
    assert msg == (f"{d}: the tokenizer needs Python code from the model directory (auto_map in "
                   "tokenizer_config.json); specbatch never runs model-directory code")
    assert not marker.exists()
    assert no_stdin == []


def test_model_dir_without_tokenizer(tiny_model, tmp_path, no_stdin):
    from specbatch.prompts import load_tokenizer

    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    for f in d.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            f.unlink()
    msg = one_line_model_error(lambda: load_tokenizer(d))
    assert msg == f"{d}: no tokenizer (expected tokenizer.json, tokenizer.model or tokenizer_config.json)"


# ---- 12. --device ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tpu", "mps", "xpu", "cuda:x", "cuda:-1", "cpu "])
def test_unknown_device(name):
    with pytest.raises(ValueError) as ei:
        resolve_device(name)
    shown = name if name.strip() == name else repr(name)
    assert str(ei.value) == f"--device {shown}: expected cpu, cuda or cuda:N"


def test_known_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^--device cuda:1: no CUDA device is available"):
            resolve_device("cuda:1")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"^--device cuda:{n}: this machine has {n} CUDA device"):
            resolve_device(f"cuda:{n}")


# ---- 13. ids keep their type ---------------------------------------------------------------------


def test_ids_keep_their_type(tmp_path):
    path = write_lines(tmp_path / "ids.jsonl", [
        '{"prompt": "a", "id": 7}', '{"prompt": "a", "id": "7"}', '{"prompt": "a"}',
        '{"prompt": "a", "custom_id": 12}', '{"prompt": "a", "id": [1]}', '{"prompt": "", "id": 9}', "[]",
    ])
    out = list(open_rows(path))
    assert [r.id for r in out] == [7, "7", 2, 12, 4, 9, 6]
    assert [type(r.id) for r in out] == [int, str, int, int, int, int, int]
    ppath = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "uid": 5}, {"prompt": "b", "uid": None}]), ppath)
    out = list(open_rows(str(ppath), id_column="uid"))
    assert out[0].id == 5 and isinstance(out[0].id, int) and out[1].id == 1 and isinstance(out[1], RowError)


def test_records_carry_the_id_type(engine):
    rows = [RowRequest(row=0, id=41, prompt="def add(a, b):"), RowRequest(row=1, id="41", prompt="import os"),
            RowError(row=2, id=2, error="w: bad")]
    recs = {r["row"]: r for r in engine.generate(rows, SamplingDefaults(max_tokens=2))}
    assert recs[0]["id"] == 41 and recs[1]["id"] == "41" and recs[2]["id"] == 2
