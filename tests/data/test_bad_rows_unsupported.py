"""One bad row never stops a job, and nothing a row asks for is silently ignored: sampling fields
specbatch does not support are the row's error unless they hold their defaults."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specbatch.data import RowRequest, open_rows

from bad_rows_helpers import MESSAGES, WHERE, err, parse


NON_DEFAULT = {
    "length_penalty": 0.8, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object"}, "guided_regex": "[a-z]+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= x", "structured_outputs": {"json": {}}, "tools": [{"type": "function"}],
    "tool_choice": "required", "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "parallel_tool_calls": "yes", "use_beam_search": True, "bad_words": ["x"], "allowed_token_ids": [1, 2],
    "truncate_prompt_tokens": 10, "spaces_between_special_tokens": False, "echo": True, "suffix": "}", "stream": True,
    "stream_options": {"include_usage": True}, "prediction": {"type": "content", "content": "x"},
    "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "reasoning_effort": "high",
    "chat_template": "{{ messages }}", "documents": [{"text": "d"}], "mm_processor_kwargs": {"x": 1},
    "multi_modal_data": {"image": "x.png"},
    "return_tokens_as_token_ids": True, "detokenize": False, "structural_tag": {"type": "x"},
    "logits_processors": ["my.module:Proc"], "prompt_embeds": "AAAA",
    # vLLM's request extras that change the response or the generation (review: they were dropped silently)
    "return_token_ids": True, "repetition_detection": {"max_pattern_size": 4}, "vllm_xargs": {"k": 1},
}
DEFAULTS = {
    "n": 1, "best_of": None, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0,
    "frequency_penalty": 0, "repetition_penalty": 1.0, "length_penalty": 1, "min_p": 0.0, "min_tokens": 0,
    "logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
    "function_call": "none", "parallel_tool_calls": True, "use_beam_search": False, "bad_words": [],
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "echo": False, "suffix": "", "stream": False, "stream_options": None, "modalities": ["text"],
    "reasoning_effort": None, "prompt_logprobs": None, "return_tokens_as_token_ids": False, "detokenize": True,
    "return_token_ids": False, "repetition_detection": None, "vllm_xargs": {},
    "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {},
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
    e = err({"body": {"prompt": "x", "length_penalty": 0.5}})
    assert e.error == (f"{WHERE}: field 'body.length_penalty': not supported by specbatch yet (got 0.5); "
                       "remove it or set it to its default 1.0")


def test_defaults_are_accepted():
    r = parse({"custom_id": "c", "body": {"messages": MESSAGES, **DEFAULTS}})
    assert isinstance(r, RowRequest), r
    r = parse({"prompt": "x", **DEFAULTS})
    assert isinstance(r, RowRequest), r
    assert isinstance(parse({"body": {"prompt": "x", "logprobs": 0}}), RowRequest)   # completions API
    assert isinstance(parse({"body": {"prompt": "x", "logprobs": None, "n": 1.0}}), RowRequest)
    # a Parquet struct fills the keys a row lacks with null: still the default
    assert isinstance(parse({"body": {"prompt": "x", "response_format": {"type": "text", "json_schema": None}}}),
                      RowRequest)


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
        {"prompt": "a", "length_penalty": 1.0, "body": None},
        {"prompt": "b", "length_penalty": 5.0, "body": None},
    ]), path)
    out = list(open_rows(str(path)))
    assert isinstance(out[0], RowRequest)
    assert out[1].error == (f"{path} row 1: field 'length_penalty': not supported by specbatch yet (got 5.0); "
                            "remove it or set it to its default 1.0")
    path = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"custom_id": "x", "method": "POST", "body": {"prompt": "a", "logprobs": False}},
        {"custom_id": "y", "method": "PUT", "body": {"prompt": "a", "logprobs": False}},
        {"custom_id": "z", "method": "POST", "body": {"prompt": "a", "logprobs": True}},
    ]), path)
    out = list(open_rows(str(path)))
    assert isinstance(out[0], RowRequest)
    assert "field 'method'" in out[1].error and "field 'body.logprobs'" in out[2].error


def test_chat_template_options_reach_the_template_or_are_refused():
    """add_generation_prompt / continue_final_message / chat_template_kwargs change the prompt, so
    they are carried to the chat template (vLLM's chat extras), never dropped; a prompt row or a
    clash is the row's error, and add_special_tokens only at its endpoint's default."""
    r = parse({"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"enable_thinking": False}})
    assert r.chat == {"add_generation_prompt": False, "continue_final_message": True,
                      "chat_template_kwargs": {"enable_thinking": False}}
    assert parse({"body": {"messages": MESSAGES, "add_generation_prompt": True}}).chat == {}
    assert "true needs 'body.add_generation_prompt': false" in err(
        {"body": {"messages": MESSAGES, "continue_final_message": True}}).error
    assert "applies to 'messages' rows" in err({"prompt": "x", "add_generation_prompt": False}).error
    assert "'tokenize' is not a template variable" in err({"messages": MESSAGES,
                                                           "chat_template_kwargs": {"tokenize": True}}).error
    assert "expected an object of template variables" in err({"messages": MESSAGES, "chat_template_kwargs": [1]}).error
    assert "add_special_tokens" in err({"messages": MESSAGES, "add_special_tokens": True}).error
    assert "add_special_tokens" in err({"prompt": "x", "add_special_tokens": False}).error
    assert isinstance(parse({"prompt": "x", "add_special_tokens": True}), RowRequest)
    assert isinstance(parse({"messages": MESSAGES, "add_special_tokens": False}), RowRequest)
