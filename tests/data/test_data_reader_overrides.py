"""Reading inputs: a row's sampling overrides, top-level or in an OpenAI batch body, and the
one-line error naming the field of each bad value."""
from __future__ import annotations

import pytest

from reader_helpers import MESSAGES, err, parse


# ---- overrides ----------------------------------------------------------


def test_overrides_all_valid():
    r = parse({
        "prompt": "x", "max_tokens": 5, "temperature": 0, "top_p": 1, "top_k": 40, "seed": -3,
        "stop": ["a", "bc"], "stop_token_ids": [0, 2], "ignore_eos": True,
    })
    assert r.overrides == {
        "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": 40, "seed": -3,
        "stop": ["a", "bc"], "stop_token_ids": [0, 2], "ignore_eos": True,
    }
    assert parse({"prompt": "x", "top_k": 0}).overrides == {"top_k": 0}
    assert parse({"prompt": "x", "top_k": -1}).overrides == {"top_k": 0}
    assert parse({"prompt": "x", "stop": "END"}).overrides == {"stop": ["END"]}
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")}
    assert parse({"prompt": "x", **nulls}).overrides == {}


def test_openai_body_overrides():
    r = parse({"custom_id": "c", "body": {"prompt": "x", "max_completion_tokens": 9, "temperature": 0.2,
                                          "top_p": 0.9, "logprobs": False, "model": "m"}})
    assert r.overrides == {"max_tokens": 9, "temperature": 0.2, "top_p": 0.9}
    assert parse({"body": {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9}}).overrides == {"max_tokens": 9}
    # both: the chat API's newer name wins, as vLLM's server (and SGLang's) read them; /v1/completions
    # has max_tokens only; each is still checked
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 3}
    assert parse({"body": chat}).overrides == {"max_tokens": 3}
    assert parse({"messages": chat["messages"], "max_tokens": 9, "max_completion_tokens": 3}).overrides == \
        {"max_tokens": 3}
    assert parse({"body": {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 3}}).overrides == {"max_tokens": 9}
    assert "field 'body.max_tokens'" in err({"body": {"prompt": "x", "max_tokens": 0, "max_completion_tokens": 3}})
    # a sampling field beside the body (not in it) is the row's error, not silently ignored
    assert "go inside 'body' (as 'body.temperature')" in err({"temperature": "hot", "body": {"prompt": "x"}})
    assert parse({"body": {"prompt": [1, 2]}}).prompt_token_ids == [1, 2]
    assert parse({"body": {"prompt": ["only"]}}).prompt == "only"
    # OpenAI's batch of prompts in one request (its choices answer them all): one line a prompt here
    for batch in (["a", "b"], [[1, 2], [3]]):
        assert "field 'body.prompt': a list of 2 prompts in one request is not supported; give each prompt its " \
               "own line" in err({"body": {"prompt": batch}})


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("max_tokens", 0, "expected an integer in [1, 2147483647]"),
        ("max_tokens", True, "expected an integer in [1, 2147483647]"),
        ("max_tokens", 16.5, "expected an integer in [1, 2147483647]"),
        ("max_tokens", "16", "expected an integer in [1, 2147483647]"),
        ("temperature", "hot", 'expected a number >= 0, got "hot"'),
        ("temperature", -0.1, "expected a number >= 0"),
        ("temperature", True, "expected a number >= 0"),
        ("top_p", 0, "expected a number in (0, 1]"),
        ("top_p", 1.5, "expected a number in (0, 1]"),
        ("top_p", [0.5], "expected a number in (0, 1]"),
        ("top_k", -2, "expected an integer in [1, 2147483647] (0 or -1 to disable)"),
        ("top_k", 2.5, "expected an integer in [1, 2147483647]"),
        ("seed", "1", "expected an integer"),
        ("seed", False, "expected an integer"),
        ("stop", 3, "expected a non-empty string or a list of non-empty strings"),
        ("stop", "", "expected a non-empty string or a list"),
        ("stop", ["a", ""], "expected a non-empty string"),
        ("stop", ["a", 1], "expected a non-empty string"),
        ("stop_token_ids", 3, "of integers >= 0"),
        ("stop_token_ids", [1, -1], "expected an integer in [0, 9223372036854775807]"),
        ("stop_token_ids", [1, "2"], "expected an integer in [0, 9223372036854775807]"),
        ("ignore_eos", 1, "expected true or false"),
        ("ignore_eos", "yes", "expected true or false"),
    ],
)
def test_bad_override(field, value, expected):
    e = err({"prompt": "x", field: value})
    assert f"field '{field}" in e
    assert expected in e
    assert parse({"prompt": "x", field: value}).id == 3


def test_bad_override_in_body_names_body_field():
    e = err({"custom_id": "c", "body": {"messages": MESSAGES, "temperature": "hot"}})
    assert "field 'body.temperature'" in e and '"hot"' in e
    assert parse({"custom_id": "c", "body": {"messages": MESSAGES, "temperature": "hot"}}).id == "c"


def test_a_kept_column_still_sets_its_sampling_field():
    """--keep-columns copies columns to the output; it does not change how a row is read: a kept
    `temperature` (or `max_tokens`, `stop`, a chat option) still applies to its row."""
    row = {"messages": MESSAGES, "temperature": 0.7, "max_tokens": 9, "stop": "END", "add_generation_prompt": False}
    r = parse(row, keep_columns=["temperature", "max_tokens", "stop", "add_generation_prompt"])
    assert r.overrides == parse(row).overrides == {"temperature": 0.7, "max_tokens": 9, "stop": ["END"]}
    assert r.chat == {"add_generation_prompt": False}
    assert r.keep == {"temperature": 0.7, "max_tokens": 9, "stop": "END", "add_generation_prompt": False}
    assert "'temperature'" in err({**row, "temperature": -1}, keep_columns=["temperature"])
