"""OpenAI Batch output checked with the official `openai` SDK's own pydantic types (the ones its
clients parse responses into), strict: every line of a job that asks for each feature OpenAI and
vLLM describe (chat and completions, n > 1, logprobs / top_logprobs, prompt_logprobs, stop strings
and stop token ids, max_completion_tokens, seeds, a bad row). test_openai_output.py checks the
values against the native output; this module checks the shapes against the SDK."""
from __future__ import annotations

import json

import pytest

from cli_runner import cli, ok
from errors import one_line_cli_error
from specbatch.cli import EXIT_USAGE

openai_types = pytest.importorskip("openai.types")           # the test extra installs it
from openai.types import BatchError, Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LINE_KEYS = {"id", "custom_id", "response", "error"}


def _line(custom_id: str, url: str, **body) -> dict:
    if url == CHAT:
        body = {"model": "my-model", "messages": [{"role": "user", "content": f"say {custom_id}"}], **body}
    else:
        body = {"prompt": f"def {custom_id.replace('-', '_')}(x):", **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


ROWS = [
    _line("chat", CHAT, max_tokens=5),
    _line("chat-n3", CHAT, max_tokens=4, n=3, temperature=0.9, seed=1),
    _line("chat-lp", CHAT, max_tokens=4, logprobs=True, top_logprobs=3),
    _line("chat-lp0", CHAT, max_tokens=3, logprobs=True),
    _line("chat-lp-n2", CHAT, max_tokens=3, logprobs=True, top_logprobs=2, n=2, temperature=1.0, seed=7),
    _line("chat-plp", CHAT, max_tokens=3, prompt_logprobs=2),
    _line("chat-mct", CHAT, max_completion_tokens=2, stop=["e", " "]),
    _line("chat-eos", CHAT, max_tokens=6, logit_bias={"0": 100}, logprobs=True, top_logprobs=1),   # EOS is id 0
    _line("chat-stop-id", CHAT, max_tokens=6, logit_bias={"5": 100}, stop_token_ids=[5]),
    _line("cmpl", COMPLETIONS, max_tokens=5),
    _line("cmpl-n2", COMPLETIONS, max_tokens=4, n=2, temperature=0.7, seed=3),
    _line("cmpl-lp", COMPLETIONS, max_tokens=4, logprobs=3),
    _line("cmpl-lp0", COMPLETIONS, max_tokens=3, logprobs=0),
    _line("cmpl-lp-n2", COMPLETIONS, max_tokens=3, logprobs=2, n=2, temperature=1.0, seed=5),
    _line("cmpl-plp", COMPLETIONS, max_tokens=3, prompt_logprobs=1, n=2),
    _line("cmpl-stop", COMPLETIONS, max_tokens=8, stop="\n"),
    _line("cmpl-eos", COMPLETIONS, max_tokens=6, logit_bias={"0": 100}, logprobs=1),
    _line("cmpl-stop-id", COMPLETIONS, max_tokens=6, logit_bias={"5": 100}, stop_token_ids=[5]),
    _line("bad", COMPLETIONS, max_tokens=-1),
]


def _validate(line: dict, request: dict) -> None:
    assert LINE_KEYS <= set(line) and isinstance(line["id"], str) and isinstance(line["custom_id"], str)
    if line["error"] is not None:
        BatchError.model_validate(line["error"], strict=True)
        assert isinstance(line["error"]["code"], str) and isinstance(line["error"]["message"], str)
        # a rejected request's HTTP 400, as vLLM's run-batch and OpenAI write it
        assert line["response"]["status_code"] == 400 and isinstance(line["response"]["request_id"], str)
        assert line["response"]["body"]["error"]["message"] == line["error"]["message"]
        return
    response = line["response"]
    assert type(response["status_code"]) is int and isinstance(response["request_id"], str)
    body = response["body"]
    chat = request["url"] == CHAT
    parsed = (ChatCompletion if chat else Completion).model_validate(body, strict=True)
    want = request["body"]
    assert len(parsed.choices) == want.get("n", 1)
    assert [c.index for c in parsed.choices] == list(range(len(parsed.choices)))
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    asked = want.get("logprobs") is not None and want["logprobs"] is not False     # completions' 0 asks
    for c in parsed.choices:
        assert c.finish_reason in ("stop", "length")
        if not asked:
            assert c.logprobs is None
        elif chat:
            assert c.logprobs is not None and c.logprobs.content        # ChoiceLogprobs of ChatCompletionTokenLogprob
            assert all(len(t.top_logprobs) == want.get("top_logprobs", 0) for t in c.logprobs.content)
            assert all(t.bytes == list(t.token.encode("utf-8", "replace")) for t in c.logprobs.content)
        else:
            lp = c.logprobs                                             # completion_choice.Logprobs
            assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
                == len(lp.text_offset)
            # the top `logprobs` and the sampled token (OpenAI's legacy API: up to logprobs + 1 keys)
            assert all(t in top and len(top) <= want["logprobs"] + 1 for t, top in zip(lp.tokens, lp.top_logprobs))
    if "stop_token_ids" in want:
        assert [c.finish_reason for c in parsed.choices] == ["stop"] * len(parsed.choices)
        assert [c.model_extra["stop_reason"] for c in parsed.choices] == want["stop_token_ids"][:1] * len(parsed.choices)
    if "prompt_logprobs" in want:                                       # vLLM's extension: body (chat) or choice
        holders = [body] if chat else body["choices"]
        for h in holders:
            first, *rest = h["prompt_logprobs"]
            assert first is None and rest and all(isinstance(e, dict) for e in rest)


def test_every_line_validates_with_the_openai_sdk_types(tiny_model, tmp_path):
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "results.jsonl"
    ok("run", inp, "-o", out, "--model", tiny_model, "--batch-size", 4, "--device", "cpu", "-q")
    text = out.read_text()
    lines = [json.loads(x, parse_constant=lambda c: pytest.fail(f"non-JSON number {c}")) for x in text.splitlines()]
    assert [ln["custom_id"] for ln in lines] == [r["custom_id"] for r in ROWS]
    for line, request in zip(lines, ROWS):
        _validate(line, request)
    assert [ln["custom_id"] for ln in lines if ln["error"]] == ["bad"]


@pytest.mark.parametrize("dest", ["-", "file"])
def test_a_kept_column_never_replaces_a_key_of_the_line(tiny_model, tmp_path, dest):
    inp = tmp_path / "batch.jsonl"
    inp.write_text(json.dumps({**_line("a", COMPLETIONS, max_tokens=2), "response": "my note"}) + "\n")
    out = "-" if dest == "-" else tmp_path / "o.jsonl"
    args = ["--model", tiny_model, "--device", "cpu", "-q", "--keep-columns", "response"]
    line = one_line_cli_error(cli("run", inp, "-o", out, *args), EXIT_USAGE)
    assert "keep column 'response'" in line and "--output-format native" in line
    r = ok("run", inp, "-o", "-", *args, "--output-format", "native")        # native rows keep it
    assert json.loads(r.stdout)["response"] == "my note"


@pytest.mark.parametrize("dest", ["-", "file"])
def test_auto_native_rows_keep_a_column_named_like_a_line_key(tiny_model, tmp_path, dest):
    """Review repro: a prompt/response dataset written to .jsonl (auto -> native rows) kept its
    `response` column before 7f4735; auto must refuse it only when the lines are OpenAI lines."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "def f(x):", "response": "my note", "max_tokens": 2}) + "\n")
    out = "-" if dest == "-" else tmp_path / "o.jsonl"
    r = ok("run", inp, "-o", out, "--model", tiny_model, "--device", "cpu", "-q", "--keep-columns", "response")
    text = r.stdout if dest == "-" else (tmp_path / "o.jsonl").read_text()
    assert json.loads(text)["response"] == "my note"
