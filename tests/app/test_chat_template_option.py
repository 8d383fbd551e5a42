"""A chat template other than the model's, as vLLM takes one: `specbatch run --chat-template`
(vllm run-batch's flag: a file or the template's text), `LLM(chat_template=...)`, `LLM.chat(...,
chat_template=...)` for one call, Ray's engine_kwargs. Prompts are rendered by it exactly as by
the model's own template holding the same text; a resume keeps the template it began with."""
from __future__ import annotations

import json

import pytest

from cli_runner import cli, ok
from errors import one_line_cli_error

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
CHATS = [[{"role": "user", "content": "def add(a, b):"}], [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "import os"}]]


def _rendered(chat: list[dict]) -> str:
    return "".join(f"<<{m['role']}>> {m['content']}\n" for m in chat) + "<<assistant>>"


def test_the_library_renders_with_the_template_given(tiny_model, tmp_path):
    from specbatch.llm import LLM

    params = {"max_tokens": 4, "temperature": 0}
    llm = LLM(tiny_model, device="cpu")
    own = llm.engine.tokenizer.chat_template
    once = llm.chat(CHATS, params, use_tqdm=False, chat_template=TEMPLATE)
    assert [c.prompt for c in once] == [_rendered(c) for c in CHATS]          # made within the call
    assert llm.engine.tokenizer.chat_template == own                        # the model's again after it
    assert llm.chat(CHATS[:1], params, use_tqdm=False)[0].prompt != once[0].prompt
    plain = llm.generate([_rendered(c) for c in CHATS], params, use_tqdm=False)
    assert [c.token_ids for c in once] == [c.token_ids for c in plain]      # the same prompt, the same tokens
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    kept = LLM(tiny_model, device="cpu", chat_template=str(tmp_path / "t.jinja"))       # a file, for every call
    assert [c.prompt for c in kept.chat(CHATS, params, use_tqdm=False)] == [_rendered(c) for c in CHATS]
    with pytest.raises(ValueError, match=r"^chat\(chat_template=\.\.\.\) nope\.jinja: no such file"):
        llm.chat(CHATS, params, chat_template="nope.jinja")
    with pytest.raises(ValueError, match=r"^LLM\(chat_template=\.\.\.\) nope\.jinja: no such file"):
        LLM(tiny_model, device="cpu", chat_template="nope.jinja")          # before the model loads
    from specbatch.ray import ProcessorConfig, _check_engine_kwargs

    with pytest.raises(ValueError, match=r"^engine_kwargs\['chat_template'\] nope\.jinja: no such file"):
        _check_engine_kwargs(ProcessorConfig(engine_kwargs={"device": "cpu", "chat_template": "nope.jinja"}))


def test_run_takes_vllms_chat_template_flag_and_a_resume_keeps_it(tiny_model, tmp_path):
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": i, "messages": c, "max_tokens": 3, "temperature": 0}) + "\n"
                           for i, c in enumerate(CHATS)))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    base = ("--model", tiny_model, "--device", "cpu", "-q")
    out = tmp_path / "o.jsonl"
    ok("run", src, "-o", out, "--chat-template", tmp_path / "t.jinja", "--limit", 1, *base)
    ok("run", src, "-o", out, "--chat-template", TEMPLATE, *base)           # the same text: resumes
    got = [json.loads(x) for x in out.read_text().splitlines()]
    plain = tmp_path / "plain.jsonl"
    plain_src = tmp_path / "plain_src.jsonl"
    plain_src.write_text("".join(json.dumps({"id": i, "prompt": _rendered(c), "max_tokens": 3, "temperature": 0})
                                 + "\n" for i, c in enumerate(CHATS)))
    ok("run", plain_src, "-o", plain, *base)
    assert [g["completion"] for g in got] == [json.loads(x)["completion"] for x in plain.read_text().splitlines()]
    assert [g["prompt_tokens"] for g in got] == [json.loads(x)["prompt_tokens"] for x in plain.read_text().splitlines()]
    other = tmp_path / "o2.jsonl"
    ok("run", src, "-o", other, "--chat-template", TEMPLATE, "--limit", 1, *base)
    for flags in ((), ("--chat-template", TEMPLATE.replace("<<", "[["))):      # without it, or another: refused
        line = one_line_cli_error(cli("run", src, "-o", other, *flags, *base), 2)
        assert "chat_template" in line, line
    # a file is read as given, once: an empty one is named as such (it was read again as a path); a
    # template's text beginning with ~ is text (expanding it as a home directory raised)
    (tmp_path / "empty.jinja").write_text(" ")
    line = one_line_cli_error(cli("run", src, "-o", tmp_path / "e.jsonl", "--chat-template", tmp_path / "empty.jinja",
                                  *base), 2)
    assert line == f"error: --chat-template {tmp_path / 'empty.jinja'}: the file is empty (expected a chat template)"
    ok("run", src, "-o", tmp_path / "tilde.jsonl", "--chat-template", "~" + TEMPLATE, *base)
    line = one_line_cli_error(cli("run", src, "-o", tmp_path / "x.jsonl", "--chat-template", "t.jinja", *base), 2)
    assert line == ("error: --chat-template t.jinja: no such file (a chat template is a file's path or the "
                    "template's own text)")
