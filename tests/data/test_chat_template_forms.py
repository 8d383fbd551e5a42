"""A chat row's messages reach the model's template as vLLM hands them (its "auto" content format
and developer role, vllm's chat_utils): a template that loops over a message's content gets every
content as a list of text parts, any other one string; a developer turn is a system turn for a
template that never names it; an assistant turn's reasoning and chat_template_kwargs' options
reach it; a role no template may know is said once. Compared with transformers' own rendering of
the messages vLLM would build."""
from __future__ import annotations

import pytest

from specbatch.chat_template import content_as_parts, template_messages
from specbatch.data import parse_row
from specbatch.prompts import load_tokenizer, render_chat
from specbatch.resolve import DEMO_DIR
from specbatch.row_notes import UnreadFields

# Gemma 3's shape: strings as they come, lists looped over (trimmed, as Gemma 3's template does)
PARTS = ("{{ bos_token }}{%- for message in messages -%}<turn {{ message['role'] }}>"
         "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
         "{%- else -%}{%- for item in message['content'] -%}{{ item['text'] | trim }}{%- endfor -%}{%- endif -%}"
         "</turn>{%- endfor -%}{%- if add_generation_prompt -%}<turn model>{%- endif -%}")
STRING = ("{%- for message in messages -%}<{{ message.role }}>{{ message.content }}"
          "{%- if message.reasoning_content %}[{{ message.reasoning_content }}]{% endif %}</{{ message.role }}>"
          "{%- endfor -%}{%- if add_generation_prompt -%}<assistant>{%- endif -%}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO_DIR / "target" if (DEMO_DIR / "target").is_dir() else DEMO_DIR)


def _render(tok, template, row):
    tok.chat_template = template
    row = parse_row(row, row=0, where="row 0")
    assert getattr(row, "error", None) is None, row
    return render_chat(tok, row)


@pytest.mark.parametrize("template, parts", [
    (PARTS, True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    # an alias of the messages, the content under a filter, an attribute access
    ("{% set turns = messages[1:] %}{% for m in turns %}{% for c in m.content | selectattr('type', 'equalto', "
     "'text') %}{{ c.text }}{% endfor %}{% endfor %}", True),
    # a macro looping over a variable named content (Qwen 3.5's)
    ("{% macro show(content) %}{% for item in content %}{{ item.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m.content) }}{% endfor %}", True),
    ("{% generation %}{% for m in messages %}{{ m.content }}{% endfor %}{% endgeneration %}", False),
    ("{% for m in messages %}{{ m.content }", False),              # jinja cannot parse it: strings
])
def test_which_templates_read_content_as_parts(template, parts):
    assert content_as_parts(template) is parts


def test_a_template_looping_over_content_gets_parts_as_transformers_renders_them(tok):
    """The parts stay parts (Gemma 3's trims each: " Hello ", "world " is "Helloworld"), a string
    content is one part; a template that does not loop gets the texts joined with newlines."""
    msgs = [{"role": "user", "content": [{"type": "text", "text": " Hello "}, {"type": "text", "text": "world "}]},
            {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "more"}]
    got = _render(tok, PARTS, {"messages": msgs})
    vllm = [{**m, "content": [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str)
             else m["content"]} for m in msgs]
    assert got == tok.apply_chat_template(vllm, tokenize=False, add_generation_prompt=True)
    assert "<turn user>Helloworld</turn>" in got
    assert "<user> Hello \nworld </user>" in _render(tok, STRING, {"messages": msgs})


def test_a_developer_turn_is_a_system_turn_for_a_template_that_never_names_it(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "developer", "content": "Answer in French."}]
    assert _render(tok, STRING, {"messages": msgs}) == \
        "<system>Be brief.\n\nAnswer in French.</system><user>hi</user><assistant>"
    naming = STRING + "{# 'developer' #}"
    assert "<developer>Answer in French.</developer>" in _render(tok, naming, {"messages": msgs})
    assert template_messages([{"role": "user", "content": "x"}], STRING) == [{"role": "user", "content": "x"}]


def test_reasoning_and_template_options_reach_the_template(tok):
    """An assistant turn's reasoning goes in as vLLM hands it (also as reasoning_content), and
    chat_template_kwargs' add_generation_prompt wins over the field, as vLLM's server merges them."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "think"},
            {"role": "user", "content": "q2"}]
    assert "<assistant>a[think]</assistant>" in _render(tok, STRING, {"messages": msgs})
    ended = {"messages": msgs[:2], "chat_template_kwargs": {"add_generation_prompt": False}}
    assert _render(tok, STRING, ended).endswith("</assistant>")
    bad = parse_row({"messages": msgs, "chat_template_kwargs": {"add_generation_prompt": "no"}}, row=0, where="row 0")
    assert "field 'chat_template_kwargs.add_generation_prompt': expected true or false" in bad.error
    bad = parse_row({"messages": msgs, "chat_template_kwargs": {"tokenize": True}}, row=0, where="row 0")
    assert "'tokenize' is not a template variable" in bad.error


def test_a_role_no_template_may_know_is_said_once(capsys):
    notes = UnreadFields()
    for i in range(3):
        notes.check(parse_row({"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"},
                                            {"role": "user", "content": "x"}]}, row=i, where=f"row {i}"))
    err = capsys.readouterr().err
    assert err.count("warning:") == 2 and "row 0: a message's role is 'human', not one of OpenAI's" in err
    assert "role is 'gpt'" in err and "'user'" not in err.split("not one of")[0]


def test_what_the_template_sees_besides_the_messages(tok):
    """chat_template_kwargs' variables reach the template, not the mapping itself; in one string,
    empty text parts are left out, as vLLM joins them."""
    probe = "{{ foo }}|{{ chat_template_kwargs is defined }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    row = {"messages": [{"role": "user", "content": ["a", "", {"type": "text", "text": ""}, "b"]}],
           "chat_template_kwargs": {"foo": 1}}
    assert _render(tok, probe, row) == "1|False|a\nb"
