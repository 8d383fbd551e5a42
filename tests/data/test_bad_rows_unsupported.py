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
    "return_tokens_as_token_ids": True, "detokenize": "no", "structural_tag": {"type": "x"},
    "logits_processors": ["my.module:Proc"], "prompt_embeds": "AAAA",
    # vLLM's request extras that change the response or the generation (review: they were dropped silently)
    "return_token_ids": True, "repetition_detection": {"max_pattern_size": 4}, "vllm_xargs": {"k": 1},
    "verbosity": "low", "web_search_options": {"search_context_size": "low"},
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


def test_echo_names_what_gives_the_prompts_logprobs():
    """lm-eval's completions scoring sends echo with logprobs: prompt_logprobs gives what it reads."""
    e = err({"body": {"prompt": "x", "echo": True, "logprobs": 1}})
    assert e.error.endswith("set it to its default false; for the prompt's logprobs (echo with logprobs), set "
                            "prompt_logprobs, vLLM's field, and max_tokens 1")


def test_unsupported_message():
    e = err({"body": {"prompt": "x", "length_penalty": 0.5}})
    assert e.error == (f"{WHERE}: field 'body.length_penalty': not supported by specbatch yet (got 0.5); "
                       "remove it or set it to its default 1.0")


def test_defaults_are_accepted():
    r = parse({"custom_id": "c", "body": {"messages": MESSAGES, **DEFAULTS}})
    assert isinstance(r, RowRequest), r
    assert isinstance(parse({"prompt": "x", "detokenize": False}), RowRequest)    # the text is made anyway
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
    # beside an OpenAI line's body a request field would be ignored: an error, unless the user keeps it
    e = err({"custom_id": "c", "n": 3, "body": {"prompt": "x"}})
    assert e.error == (f"{WHERE}: field 'n': an OpenAI batch line's request fields go inside 'body' (as 'body.n'); "
                       "a column of your own by that name: name it in --keep-columns")
    r = parse({"custom_id": "c", "n": 3, "body": {"prompt": "x"}}, keep_columns=["n"])
    assert isinstance(r, RowRequest) and r.keep == {"n": 3} and "n" not in r.overrides
    r = parse({"seed": "job-1", "body": {"prompt": "x"}}, id_column="seed")      # the named id column: data
    assert isinstance(r, RowRequest) and r.id == "job-1" and "seed" not in r.overrides
    assert isinstance(parse({"custom_id": "c", "n": None, "category": "x", "body": {"prompt": "x"}}), RowRequest)


def test_keys_that_look_like_request_fields_are_named_with_the_field_they_meant():
    """A plain row's other keys are the user's data, so a misspelled field or another API's name
    for one (`max_new_tokens`, transformers') would run the row without it: the row notes each
    such key with the field it likely meant, for the job to say once. Data columns, ours included
    (a rerun over an output), are not noted."""
    from specbatch.data.fields import near_field

    meant = {"max_new_tokens": "max_tokens", "maxTokens": "max_tokens", "max-tokens": "max_tokens",
             "Temperature": "temperature", "temprature": "temperature", "topP": "top_p", "seeds": "seed",
             "stops": "stop", "stop_sequences": "stop", "num_return_sequences": "n", "logprob": "logprobs",
             "topk": "top_k",
             "repetition_penality": "repetition_penalty", "stop_token_id": "stop_token_ids"}
    assert {k: near_field(k) for k in meant} == meant
    data = ["label", "answer", "category", "source", "text", "gold", "score", "n_tokens", "prompt_tokens",
            "completion_tokens", "finish_reason", "stop_reason", "choices", "row", "N", "temp", "model", "step",
            "top", "speed", "seen", "need", "top_n"]
    assert [k for k in data if near_field(k) is not None] == []

    row = parse({"prompt": "x", "max_new_tokens": 8, "temprature": 0.7, "label": "a", "seeds": None,
                 "Temperature": 0.2})
    assert isinstance(row, RowRequest) and row.overrides == {}
    assert row.unread == (("max_new_tokens", "max_tokens"), ("temprature", "temperature"),
                          ("Temperature", "temperature"))           # a null asks for nothing
    assert parse({"prompt": "x", "temprature": 0.7}, keep_columns=("temprature",)).unread == ()
    assert parse({"txt": "x", "temprature": 0.7}, prompt_column="txt").unread == (("temprature", "temperature"),)
    assert parse({"prompt": "x", "max_tokens": 3}).unread == ()
    # in an OpenAI body every key is the request's: another API's name is the row's error, naming the field
    assert "did you mean 'body.max_tokens'?" in err({"body": {"prompt": "x", "max_new_tokens": 8}}).error


def test_an_unknown_body_key_is_an_error_naming_the_closest_field():
    """Every key of an OpenAI body is part of the request (OpenAI refuses an unknown one): a typo
    must not run the row without what it meant."""
    e = err({"custom_id": "c", "body": {"prompt": "x", "temprature": 0.7}})
    assert e.id == "c" and e.batch_line
    assert e.error == (f"{WHERE}: field 'body.temprature': not a request field specbatch knows "
                       "(did you mean 'body.temperature'?); remove it")
    assert "did you mean 'body.top_p'?" in err({"body": {"messages": MESSAGES, "topp": 0.5}}).error
    assert "did you mean 'body.response_format'?" in err({"body": {"prompt": "x",
                                                                  "response_fromat": {"type": "json_object"}}}).error
    # empty asks for nothing, as null does
    assert isinstance(parse({"body": {"prompt": "x", "response_fromat": {}, "extra_list": [], "note": ""}}), RowRequest)
    assert err({"body": {"prompt": "x", "xyzzy": 1}}).error.endswith("field 'body.xyzzy': not a request field "
                                                                    "specbatch knows; remove it")
    # keys that change nothing here: who asked, storage hints, the echoed model, vLLM's scheduling extras
    inert = {"model": "m", "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
             "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h", "request_id": "r",
             "priority": 0, "cache_salt": "x", "include_reasoning": True, "media_io_kwargs": {"image": {}}}
    assert isinstance(parse({"custom_id": "c", "body": {"prompt": "x", **inert}}), RowRequest)
    assert isinstance(parse({"prompt": "x", "temprature": 0.7}), RowRequest)       # plain rows: metadata
    # null asks for nothing (a Parquet body struct gives every row the keys of any row)
    assert isinstance(parse({"custom_id": "c", "body": {"prompt": "x", "temprature": None}}), RowRequest)


def test_request_fields_are_the_keys_the_parsers_read():
    """REQUEST_FIELDS (what an OpenAI body may hold besides the refused and the inert keys) is the
    set of keys parse_overrides and parse_chat_options read: a field added to them is added there."""
    from specbatch.data.fields import REQUEST_FIELDS, UNSUPPORTED_FIELDS, parse_chat_options, parse_overrides

    class Reads(dict):
        seen: set = set()

        def get(self, key, default=None):
            Reads.seen.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            Reads.seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            Reads.seen.add(key)
            return super().__contains__(key)

    for endpoint, chat in (("chat", True), ("completion", False), (None, True)):
        body = Reads(messages=MESSAGES) if chat else Reads(prompt="x")
        parse_overrides(body, "body.", endpoint=endpoint)
        parse_chat_options(body, "body.", chat)
    assert Reads.seen - {"messages", "prompt"} - set(UNSUPPORTED_FIELDS) == REQUEST_FIELDS


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
