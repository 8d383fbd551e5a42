"""The sampling fields beyond temperature / top-p / top-k, per row (top level, or inside an OpenAI
body) and as recipe keys: their values, the logprobs spellings of chat and completions, n and
best_of, and every range check as a one-line error naming the field."""
from __future__ import annotations

import pytest

from bad_rows_helpers import MESSAGES, WHERE, err, parse
from recipe_helpers import _error, _parse
from specbatch.params import SamplingParams


def test_row_fields_become_overrides():
    r = parse({"prompt": "x", "min_tokens": 3, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": -2,
               "frequency_penalty": 2.0, "logit_bias": {"42": -100, "7": 3.5}, "logprobs": 5, "n": 3,
               "best_of": 3, "include_stop_str_in_output": True, "skip_special_tokens": False, "prompt_logprobs": 2})
    assert r.overrides == {"min_tokens": 3, "min_p": 0.1, "repetition_penalty": 1.1, "presence_penalty": -2.0,
                           "frequency_penalty": 2.0, "logit_bias": {42: -100.0, 7: 3.5}, "logprobs": 5, "n": 3,
                           "include_stop_str_in_output": True, "skip_special_tokens": False, "prompt_logprobs": 2}
    p = SamplingParams().for_row(r.overrides, 0)
    assert p.logit_bias == ((7, 3.5), (42, -100.0)) and p.uses_penalties and p.uses_processors
    assert p.prompt_logprobs == 2
    assert parse({"prompt": "x", "prompt_logprobs": None}).overrides == {}      # null asks for nothing
    # n: 1 and logprobs: false ask for nothing: the run's defaults apply to the row
    assert parse({"prompt": "x", "n": 1, "logprobs": False, "top_logprobs": 0, "logit_bias": {}}).overrides == {}


def test_logprobs_spellings():
    chat = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": MESSAGES}}
    comp = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x"}}
    with_body = lambda base, **kw: {**base, "body": {**base["body"], **kw}}     # noqa: E731
    assert parse(with_body(chat, logprobs=True, top_logprobs=4)).overrides == {"logprobs": 4}
    assert parse(with_body(chat, logprobs=True)).overrides == {"logprobs": 0}
    assert parse(with_body(comp, logprobs=3)).overrides == {"logprobs": 3}
    assert parse(with_body(comp, logprobs=0)).overrides == {"logprobs": 0}
    assert "field 'body.logprobs': expected true or false (chat completions" in err(with_body(chat, logprobs=3)).error
    assert "field 'body.logprobs': expected an integer in [0, 20] (the completions API" in \
        err(with_body(comp, logprobs=True)).error
    assert err(with_body(chat, top_logprobs=2)).error.endswith("field 'body.top_logprobs': needs 'body.logprobs': true")
    assert "field 'body.top_logprobs': expected an integer in [0, 20]" in \
        err(with_body(chat, logprobs=True, top_logprobs=21)).error
    # plain rows take either spelling
    assert parse({"prompt": "x", "logprobs": 2}).overrides == {"logprobs": 2}
    assert parse({"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}).overrides == {"logprobs": 2}
    assert "goes with 'logprobs': true" in err({"prompt": "x", "logprobs": 2, "top_logprobs": 3}).error


@pytest.mark.parametrize("field,value,expected", [
    ("min_tokens", -1, "expected an integer in [0, 2147483647]"),
    ("min_tokens", 2.5, "expected an integer in [0, 2147483647]"),
    ("min_p", 1.5, "expected a number in [0, 1]"),
    ("min_p", -0.1, "expected a number in [0, 1]"),
    ("min_p", "0.1", "expected a number in [0, 1]"),
    ("repetition_penalty", 0, "expected a number > 0 (1 = off)"),
    ("repetition_penalty", -1.0, "expected a number > 0"),
    ("presence_penalty", 2.5, "expected a number in [-2, 2]"),
    ("frequency_penalty", -3, "expected a number in [-2, 2]"),
    ("frequency_penalty", True, "expected a number in [-2, 2]"),
    ("logit_bias", [1, 2], "expected an object mapping token ids to biases in [-100, 100]"),
    ("logit_bias", "x", "expected an object mapping token ids to biases"),
    ("logprobs", 21, "expected an integer in [0, 20]"),
    ("logprobs", -1, "expected an integer in [0, 20]"),
    ("prompt_logprobs", 21, "expected an integer in [0, 20]"),
    ("prompt_logprobs", True, "expected an integer in [0, 20]"),
    ("n", 0, "expected an integer in [1, 1024]"),
    ("n", 1025, "expected an integer in [1, 1024]"),
    ("n", "2", "expected an integer in [1, 1024]"),
    ("include_stop_str_in_output", 1, "expected true or false"),
    ("skip_special_tokens", "no", "expected true or false"),
])
def test_range_checks_name_the_field(field, value, expected):
    e = err({"prompt": "x", field: value}).error
    assert e.startswith(f"{WHERE}: field '{field}': {expected}"), e
    e = err({"custom_id": "c", "body": {"prompt": "x", field: value}}).error
    assert e.startswith(f"{WHERE}: field 'body.{field}': {expected}"), e


def test_logit_bias_entries():
    assert err({"prompt": "x", "logit_bias": {"42": 101}}).error == \
        f'{WHERE}: field \'logit_bias["42"]\': expected a bias in [-100, 100], got 101'
    assert err({"prompt": "x", "logit_bias": {"-3": 1}}).error == \
        f'{WHERE}: field \'logit_bias["-3"]\': expected a token id (an integer >= 0) as the key'
    assert err({"prompt": "x", "logit_bias": {"ab": 1}}).error.endswith("as the key")
    assert err({"prompt": "x", "logit_bias": {"7": 1, "007": 2}}).error.endswith(
        "field 'logit_bias': token id 7 given twice")
    assert "at most 1024 entries, got 1025" in err({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}).error
    # Parquet spellings: a struct (absent keys null) or a map ([key, value] pairs)
    assert parse({"prompt": "x", "logit_bias": {"5": 1.0, "6": None}}).overrides == {"logit_bias": {5: 1.0}}
    assert parse({"prompt": "x", "logit_bias": [[5, -1.0], [9, 2]]}).overrides == {"logit_bias": {5: -1.0, 9: 2.0}}


def test_n_best_of_and_min_tokens_rules():
    assert parse({"prompt": "x", "n": 4, "best_of": 4}).overrides == {"n": 4}
    assert err({"prompt": "x", "n": 2, "best_of": 3}).error == (
        f"{WHERE}: field 'best_of': best_of > n is not supported by specbatch (got 3 with n 2); "
        "remove it or set it to n")
    assert "field 'best_of': expected an integer >= n (3)" in err({"prompt": "x", "n": 3, "best_of": 2}).error
    assert err({"prompt": "x", "max_tokens": 4, "min_tokens": 5}).error == \
        f"{WHERE}: field 'min_tokens': 5 is more than max_tokens (4)"


def test_the_truly_unsupported_remain_errors():
    from specbatch.data.fields import UNSUPPORTED_FIELDS

    implemented = {"n", "best_of", "logprobs", "top_logprobs", "min_p", "min_tokens", "logit_bias",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "include_stop_str_in_output",
                   "skip_special_tokens", "prompt_logprobs"}
    assert not implemented & set(UNSUPPORTED_FIELDS)
    for name in ("tools", "use_beam_search", "response_format", "guided_json"):
        assert name in UNSUPPORTED_FIELDS


# ---------------------------------------------------------------- recipe keys


def test_recipe_sampling_keys():
    r = _parse(algorithm="vanilla", sampling={
        "min_tokens": 2, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "logit_bias": {42: -100, "7": 2}, "logprobs": 5, "n": 4, "include_stop_str_in_output": True,
        "skip_special_tokens": False, "temperature": None, "top_p": None, "top_k": None, "prompt_logprobs": 3})
    s = r.sampling
    assert (s.min_tokens, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (2, 0.05, 1.1, 0.5, -0.5)
    assert s.logit_bias == ((7, 2.0), (42, -100.0)) and s.logprobs == 5 and s.n == 4 and s.prompt_logprobs == 3
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    assert s.temperature is None and s.to_dict()["logit_bias"] == {7: 2.0, 42: -100.0}
    assert _parse(**r.to_dict()) == r
    # the --logit-bias flag's spelling
    assert _parse(algorithm="vanilla", sampling={"logit_bias": ["5=-1", " 9 = 2.5"]}).sampling.logit_bias == \
        ((5, -1.0), (9, 2.5))


@pytest.mark.parametrize("sampling,expected", [
    ({"min_p": 2}, "sampling.min_p: expected 0 <= min_p <= 1, got 2.0"),
    ({"min_tokens": -1}, "sampling.min_tokens: expected an integer >= 0, got -1"),
    ({"min_tokens": 300, "max_tokens": 256}, "sampling.min_tokens: expected at most max_tokens (256), got 300"),
    ({"repetition_penalty": 0}, "sampling.repetition_penalty: expected a number > 0 (1 = off), got 0.0"),
    ({"presence_penalty": 3}, "sampling.presence_penalty: expected a number in [-2, 2], got 3.0"),
    ({"frequency_penalty": "x"}, "sampling.frequency_penalty: expected a number, got str 'x'"),
    ({"logit_bias": {1: 200}}, "sampling.logit_bias: expected a bias in [-100, 100] for token id 1, got 200.0"),
    ({"logit_bias": ["1:2"]}, "sampling.logit_bias: expected ID=BIAS (a token id and a number), got str '1:2'"),
    ({"logit_bias": {-1: 2}}, "sampling.logit_bias: expected token ids as integers >= 0, got int -1"),
    ({"logit_bias": 3}, "sampling.logit_bias: expected a mapping of token ids to biases, got int 3"),
    ({"logprobs": 21}, "sampling.logprobs: expected an integer in [0, 20] or null, got 21"),
    ({"prompt_logprobs": -1}, "sampling.prompt_logprobs: expected an integer in [0, 20] or null, got -1"),
    ({"n": 0}, "sampling.n: expected an integer in [1, 1024], got 0"),
    ({"include_stop_str_in_output": "yes"}, "sampling.include_stop_str_in_output: expected true or false, got str 'yes'"),
    ({"skip_special_tokens": 1}, "sampling.skip_special_tokens: expected true or false, got int 1"),
])
def test_recipe_range_checks(sampling, expected):
    assert expected in _error({"algorithm": "vanilla", "sampling": sampling})


def test_choice_seeds_are_distinct_and_stable():
    p = SamplingParams(temperature=1.0, seed=7)
    seeds = [p.for_choice(i).seed for i in range(8)]
    assert seeds[0] == 7 and len(set(seeds)) == 8
    assert seeds == [p.for_choice(i).seed for i in range(8)]
    assert all(0 <= s < 2**64 for s in seeds)


def test_sampling_fields_a_row_sets_for_nothing_without_a_temperature():
    """top_p, top_k, min_p and n > 1 shape sampling; a plain row setting them with no temperature
    anywhere (row, run defaults, the model's generation config) runs greedy, where vLLM's
    SamplingParams (temperature 1.0) would sample: what the job names in its warning."""
    none = SamplingParams()
    assert none.unsampled({"top_p": 0.9, "n": 4}) == ["top_p", "n"]
    assert none.unsampled({"top_k": 20, "min_p": 0.1}) == ["top_k", "min_p"]
    assert none.unsampled({"top_p": 1.0, "top_k": -1, "n": 1, "max_tokens": 5}) == []     # off: asks nothing
    assert none.unsampled({"top_p": 0.9, "temperature": 0.0}) == []          # greedy asked for
    assert SamplingParams(temperature=0.7).unsampled({"top_p": 0.9}) == []   # --temperature or the recipe's
    assert none.unsampled({"top_p": 0.9}, {"temperature": 0.6}) == []        # the model's generation config
    assert SamplingParams(top_k=5).unsampled({}) == ["top_k"]                # the run's own (flags, recipe)
