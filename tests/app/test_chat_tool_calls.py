"""Messages' tool_calls reach the chat template as vLLM's text-only chat parsing hands them
(vllm/entrypoints/chat_utils.py): an empty tool_calls list is dropped, each call's JSON `arguments`
string is parsed into an object. Templates (Llama 3.1's below) render `arguments | tojson`."""
import json

from specbatch.data import parse_row
from specbatch.prompts import encode_row, load_tokenizer
from specbatch.resolve import DEMO_DIR

# the tool-call branch of Llama-3.1-8B-Instruct's template, verbatim in substance
TEMPLATE = ("{%- for message in messages %}{%- if 'tool_calls' in message %}"
            "{%- if not message.tool_calls|length == 1 %}{{ raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}"
            "{%- set tool_call = message.tool_calls[0].function %}"
            "{{- '{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}{{- tool_call.arguments | tojson }}{{- '}' }}"
            "{%- else %}{{ message.role + ': ' + message.content + '\n' }}{%- endif %}{%- endfor %}")


def _text(messages):
    tok = load_tokenizer(DEMO_DIR / "target" if (DEMO_DIR / "target").is_dir() else DEMO_DIR)
    tok.chat_template = TEMPLATE
    row = parse_row({"messages": messages}, row=0, where="row 0")
    assert getattr(row, "error", None) is None, row
    return tok.decode(encode_row(tok, row, 10**6), skip_special_tokens=True)


def test_empty_tool_calls_stay_on_the_normal_path():
    # a Parquet list<struct<role, content, tool_calls>> gives [] (or null) to turns without calls
    assert "user: Hi" in _text([{"role": "user", "content": "Hi", "tool_calls": []}])


def test_tool_call_arguments_reach_the_template_as_an_object():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2})}}
    text = _text([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '"parameters": {"a": 2}' in text, text
