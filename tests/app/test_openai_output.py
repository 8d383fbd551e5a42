"""OpenAI Batch output: what `vllm run-batch` writes, read back by a consumer built from the
published format's field names (as an OpenAI client would parse them), not from our writer."""
from __future__ import annotations

import json
from typing import Any, Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict

from cli_runner import cli, ok
from errors import one_line_cli_error
from specbatch.cli import EXIT_USAGE

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the consumer: the OpenAI Batch output line, chat.completion and text_completion objects ----

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")       # clients ignore fields they do not know


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Message(_Open):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: list[Any]          # vLLM's ChatMessage always has the list (code reading msg["tool_calls"])


class ChatChoice(_Open):
    index: int
    message: Message
    finish_reason: Optional[Literal["stop", "length"]]
    logprobs: Optional[dict] = None


class TextChoice(_Open):
    index: int
    text: str
    finish_reason: Optional[Literal["stop", "length"]]
    logprobs: Optional[dict] = None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextCompletion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Response(_Open):
    status_code: int
    request_id: str
    body: dict


class Error(_Open):
    code: Optional[str]
    message: str


class BatchLine(_Open):
    id: str
    custom_id: str
    response: Optional[Response]
    error: Optional[Error]


def consume(path_or_text) -> list[BatchLine]:
    text = path_or_text.read_text() if hasattr(path_or_text, "read_text") else path_or_text
    return [BatchLine.model_validate_json(line) for line in text.splitlines() if line.strip()]


def body(line: BatchLine) -> ChatCompletion | TextCompletion:
    b = line.response.body
    return ChatCompletion.model_validate(b) if b["object"] == "chat.completion" else TextCompletion.model_validate(b)


# ---- the jobs ------------------------------------------------------------------------------------

def _batch(i: int, kind: str) -> dict:
    if kind == "chat":
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "my-model", "messages": [{"role": "user", "content": f"def f{i}(x):"}],
                         "max_tokens": 5}}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": f"import os{i}", "max_tokens": 4}}


@pytest.fixture
def batch_file(tmp_path):
    rows = [_batch(i, "chat" if i % 3 else "completion") for i in range(9)]
    rows[4] = {"custom_id": "req-4", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}}   # not supported
    p = tmp_path / "batch.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p, rows


def _args(model, *extra):
    return ["--model", model, "--batch-size", 3, "--device", "cpu", "-q", *extra]


def test_openai_batch_input_writes_openai_batch_output(tiny_model, batch_file, tmp_path):
    inp, rows = batch_file
    out = tmp_path / "results.jsonl"
    ok("run", inp, "-o", out, *_args(tiny_model))
    lines = consume(out)
    assert [ln.custom_id for ln in lines] == [r["custom_id"] for r in rows]          # input order
    assert len({ln.id for ln in lines}) == len(lines)
    native = tmp_path / "native.jsonl"
    ok("run", inp, "-o", native, *_args(tiny_model, "--output-format", "native"))
    want = [json.loads(x) for x in native.read_text().splitlines()]
    for ln, raw, w in zip(lines, rows, want):
        if raw["custom_id"] == "req-4":
            assert ln.response.status_code == 400 and "use_beam_search" in ln.error.message
            assert ln.response.body["error"]["message"] == ln.error.message
            continue
        assert ln.error is None and ln.response.status_code == 200 and ln.response.request_id
        b = body(ln)
        chat = raw["url"] == "/v1/chat/completions"
        assert isinstance(b, ChatCompletion if chat else TextCompletion)
        assert b.model == ("my-model" if chat else tiny_model.name)   # the request's model, else the model dir's
        choice = b.choices[0]
        assert (choice.message.content if chat else choice.text) == w["completion"]
        assert choice.finish_reason == w["finish_reason"]
        assert b.usage.completion_tokens == w["completion_tokens"] <= raw["body"]["max_tokens"]
        assert b.usage.total_tokens == b.usage.prompt_tokens + b.usage.completion_tokens
        # the speculation stats ride along in a clearly named extra field
        assert json.loads(ln.model_dump_json())["specbatch"]["spec"]["verify_steps"] >= 1
    assert json.loads(out.read_text().splitlines()[0])["specbatch"]["row"] == 0


def test_resume_and_rerun_keep_the_openai_output_exactly_once(tiny_model, batch_file, tmp_path):
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    inp, rows = batch_file
    out = tmp_path / "r.jsonl"
    seen = []

    def stop(event, info):
        if event == "record":
            seen.append(1)
            if len(seen) == 4:
                raise KeyboardInterrupt

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        run_job(str(inp), recipe, JobOptions(output=str(out), device="cpu"), progress=stop)
    ok("run", inp, "-o", out, *_args(tiny_model))
    first = out.read_text()
    lines = consume(first)
    assert [ln.custom_id for ln in lines] == [r["custom_id"] for r in rows]
    # rows appended after the job finished are added; the ids of the others do not change
    with open(inp, "a") as f:
        f.write(json.dumps(_batch(9, "chat")) + "\n")
    ok("run", inp, "-o", out, *_args(tiny_model))
    again = consume(out)
    assert [ln.custom_id for ln in again] == [r["custom_id"] for r in rows] + ["req-9"]
    assert [ln.id for ln in again[:-1]] == [ln.id for ln in lines]
    # another output format is another job
    line = one_line_cli_error(cli("run", inp, "-o", out, *_args(tiny_model, "--output-format", "native")), EXIT_USAGE)
    assert "output_format" in line


def test_other_outputs_and_formats(tiny_model, batch_file, tmp_path):
    inp, rows = batch_file
    parquet = tmp_path / "p.parquet"
    ok("run", inp, "-o", parquet, *_args(tiny_model))                    # auto: Parquet stays native
    import pyarrow.parquet as pq

    assert pq.read_table(parquet).column_names[:3] == ["row", "id", "completion"]
    line = one_line_cli_error(cli("run", inp, "-o", tmp_path / "x.parquet",
                                  *_args(tiny_model, "--output-format", "openai")), EXIT_USAGE)
    assert "--output-format openai" in line and ".jsonl" in line
    r = ok("run", inp, "-o", "-", *_args(tiny_model))                     # stdout: OpenAI lines too
    assert [ln.custom_id for ln in consume(r.stdout)] == [r_["custom_id"] for r_ in rows]
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"id": "a", "prompt": "def add(a, b):"}\n{"prompt": "import os"}\n')
    out = tmp_path / "plain.out.jsonl"
    ok("run", plain, "-o", out, *_args(tiny_model, "--output-format", "openai", "--max-tokens", "3"))
    lines = consume(out)
    assert [ln.custom_id for ln in lines] == ["a", "1"]                  # custom_id: always a string
    assert all(isinstance(body(ln), TextCompletion) for ln in lines)


def test_stdout_and_a_file_write_the_same_lines(tiny_model, batch_file, tmp_path):
    """`-o -` and `-o file.jsonl` agree: a malformed first line does not make stdout native (the
    first row of known form decides "auto"), kept columns sit beside the OpenAI keys in both, and
    a bad --output-format is refused for both."""
    inp, rows = batch_file
    src = tmp_path / "bad_first.jsonl"
    src.write_text("not json\n" + "".join(json.dumps({**r, "tag": i}) + "\n" for i, r in enumerate(rows)))
    out = tmp_path / "f.jsonl"
    ok("run", src, "-o", out, *_args(tiny_model, "--keep-columns", "tag"))
    r = ok("run", src, "-o", "-", *_args(tiny_model, "--keep-columns", "tag"))
    file_lines = [json.loads(x) for x in out.read_text().splitlines()]
    std_lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(file_lines) == len(std_lines) == len(rows) + 1
    for a, b in zip(file_lines, std_lines):
        assert set(a) == set(b) and "custom_id" in a and a.get("tag") == b.get("tag")
    assert [x.get("tag") for x in file_lines] == [None, *range(len(rows))]
    # a finished OpenAI output reopened to add rows keeps its kept columns
    more = tmp_path / "more.jsonl"
    more.write_text(src.read_text() + json.dumps({**rows[0], "custom_id": "req-x", "tag": 99}) + "\n")
    ok("run", more, "-o", out, *_args(tiny_model, "--keep-columns", "tag"))
    assert [json.loads(x).get("tag") for x in out.read_text().splitlines()] == [None, *range(len(rows)), 99]
    for dest in ("-", tmp_path / "g.jsonl"):
        line = one_line_cli_error(cli("run", src, "-o", dest, *_args(tiny_model, "--output-format", "bogus")),
                                  EXIT_USAGE)
        assert "--output-format bogus" in line


def test_a_batch_whose_every_request_is_rejected_still_gets_openai_lines(tiny_model, tmp_path):
    """A batch line with a bad field is still a batch line: "auto" answers it with a 400 line
    (what a vLLM run-batch consumer parses), also when no request of the job could run."""
    from specbatch.cli import EXIT_FAILED

    rows = [{**_batch(i, "chat"), "body": {**_batch(i, "chat")["body"], "response_format": {"type": "json_object"}}}
            for i in range(2)]
    inp, out = tmp_path / "rejected.jsonl", tmp_path / "rejected.out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one_line_cli_error(cli("run", inp, "-o", out, *_args(tiny_model)), EXIT_FAILED)
    r = cli("run", inp, "-o", "-", *_args(tiny_model))
    for lines in (consume(out), consume(r.stdout)):
        assert [ln.custom_id for ln in lines] == ["req-0", "req-1"]
        assert all(ln.response.status_code == 400 and "response_format" in ln.error.message for ln in lines)


def test_auto_follows_the_first_row_of_known_form_in_a_file_as_on_stdout(tiny_model, tmp_path):
    """Review repro: a plain row first, then an OpenAI batch line. `-o -` wrote native rows (the
    first row of known form decides "auto") while the file wrote OpenAI lines (any batch line
    decided it): the same command gave two formats."""
    inp = tmp_path / "mixed.jsonl"
    inp.write_text(json.dumps({"id": "p", "prompt": "def f(x):", "max_tokens": 2}) + "\n"
                   + json.dumps(_batch(1, "completion")) + "\n")
    out = tmp_path / "mixed.out.jsonl"
    ok("run", inp, "-o", out, *_args(tiny_model))
    r = ok("run", inp, "-o", "-", *_args(tiny_model))
    for text in (out.read_text(), r.stdout):
        lines = [json.loads(x) for x in text.splitlines()]
        assert [ln.get("row") for ln in lines] == [0, 1] and all("custom_id" not in ln for ln in lines)


@pytest.mark.parametrize("dest", ["-", "file"])
def test_two_batches_reusing_custom_ids_get_different_ids(tiny_model, tmp_path, dest):
    """Review repro: ids were a hash of (row, custom_id) alone, so two batches numbering their
    requests alike ("request-1", ...) got the same line id, request_id and completion id for
    different requests (results keyed by id overwrote each other); a rerun still writes the same."""
    ids = []
    for name, prompt in (("a", "def f(x):"), ("b", "import os"), ("a", "def f(x):")):
        inp = tmp_path / f"{name}.jsonl"
        inp.write_text(json.dumps({**_batch(1, "completion"), "body": {"prompt": prompt, "max_tokens": 2}}) + "\n")
        out = tmp_path / f"{name}-{len(ids)}.out.jsonl"
        r = ok("run", inp, "-o", "-" if dest == "-" else out, *_args(tiny_model))
        (line,) = consume(r.stdout if dest == "-" else out)
        ids.append((line.id, line.response.request_id, line.response.body["id"]))
    assert ids[0] == ids[2]
    assert all(x != y for x, y in zip(ids[0], ids[1]))


def test_a_batch_line_asking_past_the_context_is_its_error_a_plain_row_ends_there(tmp_path, tiny_model):
    """As vLLM's server (so `vllm run-batch`) and OpenAI answer a request whose max_tokens does not
    fit the context after its prompt; a plain row keeps running to the context (finish_reason length)."""
    import pyarrow.parquet as pq

    big = 100000
    rows = [{"custom_id": "far", "body": {"prompt": "def f():", "max_tokens": big}},
            {"custom_id": "chat", "body": {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": big}},
            {"custom_id": "near", "body": {"prompt": "def f():", "max_tokens": 3}},
            {"id": "plain", "prompt": "def f():", "max_tokens": big}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.parquet"
    ok("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q", "--max-model-len", 64)
    got = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    for rid in ("far", "chat"):
        e = got[rid]["error"]
        assert "field 'body.max_tokens' (or max_completion_tokens): 100000 tokens after a prompt of " in e, e
        assert "pass this engine's context of 64 tokens (--max-model-len, else" in e and "ask for at most " in e
    assert got["near"]["error"] is None and got["near"]["completion_tokens"] <= 3
    assert got["plain"]["error"] is None and got["plain"]["prompt_tokens"] + got["plain"]["completion_tokens"] <= 64
