"""Recipe validation, one line naming the source: unknown keys (with a suggestion), wrong types,
ranges, and each algorithm's parameters (chains, trees, naive_2token's fixed values)."""
from __future__ import annotations

import pytest

from specbatch.recipe import ALGORITHMS, SamplingDefaults

from recipe_helpers import _error, _parse


# ---------------------------------------------------------------- keys and types


def test_unknown_top_level_key_with_suggestion():
    msg = _error({"algorithm": "vanilla", "topK": 2})
    assert "unknown key 'topK'" in msg
    assert "(known: name, description, algorithm, num_steps, topk, num_draft_tokens, model, drafter, draft, dtype, batch_size, max_model_len, gpu_memory_utilization, sampling)" in msg
    assert "did you mean 'topk'?" in msg


def test_unknown_key_without_close_match():
    msg = _error({"algorithm": "vanilla", "zzzzzz": 1})
    assert "unknown key 'zzzzzz'" in msg and "did you mean" not in msg


def test_unknown_sampling_key_with_suggestion():
    msg = _error({"algorithm": "vanilla", "sampling": {"temprature": 0.5}})
    assert "unknown key 'sampling.temprature'" in msg
    assert "known: max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos" in msg
    assert "did you mean 'sampling.temperature'?" in msg


def test_missing_algorithm():
    assert "algorithm: missing" in _error({"batch_size": 4})


def test_unknown_algorithm_and_dtype():
    msg = _error({"algorithm": "medusa"})
    assert "algorithm: expected one of vanilla, eagle3, nextn_mtp, naive_2token, got str 'medusa'" in msg
    msg = _error({"algorithm": "vanilla", "dtype": "fp8"})
    assert "dtype: expected one of auto, float32, bfloat16, float16" in msg
    msg = _error({"algorithm": "vanilla", "dtype": ["half"]})
    assert "dtype: expected one of auto, float32, bfloat16, float16" in msg


def test_vllms_dtype_spellings_are_their_dtypes():
    from specbatch.recipe import load_recipe

    assert load_recipe("vanilla").with_overrides(dtype="half").dtype == "float16"
    assert load_recipe("vanilla").with_overrides(dtype="float").dtype == "float32"


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"batch_size": "64"}, "batch_size: expected an integer or null, got str '64'"),
        ({"batch_size": 64.0}, "batch_size: expected an integer or null, got float 64.0"),
        ({"batch_size": True}, "batch_size: expected an integer or null, got bool True"),
        ({"max_model_len": "4k"}, "max_model_len: expected an integer or null, got str '4k'"),
        ({"model": 3}, "model: expected a string, got int 3"),
        ({"draft": ["a"]}, "draft: expected a string or null, got list ['a']"),
        ({"name": 5}, "name: expected a string, got int 5"),
        ({"sampling": [1]}, "sampling: expected a mapping, got list [1]"),
        ({"sampling": {"max_tokens": False}}, "sampling.max_tokens: expected an integer or null, got bool False"),
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature: expected a number, got str 'hot'"),
        ({"sampling": {"top_p": True}}, "sampling.top_p: expected a number, got bool True"),
        ({"sampling": {"top_k": 1.5}}, "sampling.top_k: expected an integer, got float 1.5"),
        ({"sampling": {"seed": "x"}}, "sampling.seed: expected an integer or null, got str 'x'"),
        ({"sampling": {"ignore_eos": "yes"}}, "sampling.ignore_eos: expected true or false, got str 'yes'"),
        ({"sampling": {"stop": 5}}, "sampling.stop: expected a string or a list of strings, got int 5"),
        ({"sampling": {"stop": ["a", 1]}}, "sampling.stop[1]: expected a non-empty string, got int 1"),
        ({"sampling": {"stop_token_ids": [1, True]}}, "sampling.stop_token_ids[1]: expected an integer, got bool True"),
        ({"sampling": {"stop_token_ids": 3}}, "sampling.stop_token_ids: expected a list of integers, got int 3"),
    ],
)
def test_wrong_types(data, expected):
    assert expected in _error({"algorithm": "vanilla", **data})


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"batch_size": 0}, "batch_size: expected an integer >= 1 or null, got 0"),
        ({"max_model_len": 0}, "max_model_len: expected an integer >= 1 or null, got 0"),
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens: expected an integer >= 1 or null, got 0"),
        ({"sampling": {"temperature": -0.1}}, "sampling.temperature: expected a number >= 0"),
        ({"sampling": {"top_p": 0}}, "sampling.top_p: expected 0 < top_p <= 1, got 0.0"),
        ({"sampling": {"top_p": 1.01}}, "sampling.top_p: expected 0 < top_p <= 1, got 1.01"),
        ({"sampling": {"top_k": -2}}, "sampling.top_k: expected an integer >= -1, got -2"),
        ({"sampling": {"stop_token_ids": [-1]}}, "sampling.stop_token_ids[0]: expected an integer >= 0, got -1"),
    ],
)
def test_ranges(data, expected):
    assert expected in _error({"algorithm": "vanilla", **data})


def test_valid_edges():
    r = _parse(algorithm="vanilla", batch_size=1, max_model_len=1, sampling={"top_p": 1, "temperature": 0, "top_k": 0, "max_tokens": 1, "seed": 0})
    assert r.sampling.top_p == 1.0 and isinstance(r.sampling.top_p, float)
    assert r.sampling.temperature == 0.0 and r.sampling.seed == 0
    assert _parse(algorithm="vanilla", sampling=None).sampling == SamplingDefaults()
    # as rows take them: top_k -1 is vLLM's "off", and any integer seed
    r = _parse(algorithm="vanilla", sampling={"top_k": -1, "seed": -5})
    assert r.sampling.top_k == 0 and r.sampling.seed == -5


# ---------------------------------------------------------------- algorithm parameters


@pytest.mark.parametrize("key", ["num_steps", "topk", "num_draft_tokens"])
def test_vanilla_takes_no_params(key):
    msg = _error({"algorithm": "vanilla", key: 2})
    assert f"{key}: algorithm vanilla takes none of num_steps, topk, num_draft_tokens" in msg


def test_vanilla_null_params_ok():
    r = _parse(algorithm="vanilla", num_steps=None, topk=None, num_draft_tokens=None)
    assert (r.num_steps, r.topk, r.num_draft_tokens) == (None, None, None)


@pytest.mark.parametrize("algorithm", ["eagle3", "nextn_mtp"])
def test_chain_rule(algorithm):
    r = _parse(algorithm=algorithm, num_steps=3, topk=1, num_draft_tokens=4)
    assert (r.num_steps, r.topk, r.num_draft_tokens) == (3, 1, 4)
    msg = _error({"algorithm": algorithm, "num_steps": 3, "topk": 1, "num_draft_tokens": 5})
    assert "num_draft_tokens: topk 1 (a chain) needs num_draft_tokens = num_steps + 1 = 4, got 5" in msg


@pytest.mark.parametrize("algorithm", ["eagle3", "nextn_mtp"])
def test_tree_rule(algorithm):
    # S=3, k=4: at most 4 + 2*16 = 36 draft tokens, so N <= 37
    assert _parse(algorithm=algorithm, num_steps=3, topk=4, num_draft_tokens=37).num_draft_tokens == 37
    assert _parse(algorithm=algorithm, num_steps=1, topk=8, num_draft_tokens=9).num_draft_tokens == 9
    msg = _error({"algorithm": algorithm, "num_steps": 3, "topk": 4, "num_draft_tokens": 38})
    assert "num_draft_tokens:" in msg and "must be <= 37, got 38" in msg
    assert "must be <= 9, got 10" in _error({"algorithm": algorithm, "num_steps": 1, "topk": 8, "num_draft_tokens": 10})


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"topk": 1, "num_draft_tokens": 4}, "num_steps: algorithm eagle3 needs num_steps, topk and num_draft_tokens; num_steps is missing"),
        ({"num_steps": 3, "num_draft_tokens": 4}, "topk is missing"),
        ({"num_steps": 3, "topk": 1}, "num_draft_tokens is missing"),
        ({"num_steps": 0, "topk": 1, "num_draft_tokens": 1}, "num_steps: expected an integer >= 1, got 0"),
        ({"num_steps": 2, "topk": 0, "num_draft_tokens": 3}, "topk: expected an integer >= 1, got 0"),
        ({"num_steps": 2, "topk": 2, "num_draft_tokens": 1}, "num_draft_tokens: expected an integer >= 2, got 1"),
        ({"num_steps": "3", "topk": 1, "num_draft_tokens": 4}, "num_steps: expected an integer, got str '3'"),
        ({"num_steps": 3, "topk": True, "num_draft_tokens": 4}, "topk: expected an integer, got bool True"),
    ],
)
def test_spec_params_required_and_ranged(params, expected):
    assert expected in _error({"algorithm": "eagle3", **params})


def test_naive_2token_defaults_and_fixed_values():
    r = _parse(algorithm="naive_2token")
    assert (r.num_steps, r.topk, r.num_draft_tokens) == (1, 1, 2)
    assert _parse(algorithm="naive_2token", num_steps=1, topk=1, num_draft_tokens=2).num_draft_tokens == 2
    for key, bad in [("num_steps", 2), ("topk", 2), ("num_draft_tokens", 3), ("topk", True)]:
        msg = _error({"algorithm": "naive_2token", key: bad})
        assert f"{key}: naive_2token is fixed at num_steps 1, topk 1, num_draft_tokens 2" in msg


def test_every_algorithm_accepted():
    params = {"vanilla": {}, "naive_2token": {}, "eagle3": {"num_steps": 2, "topk": 1, "num_draft_tokens": 3}}
    params["nextn_mtp"] = params["eagle3"]
    for algorithm in ALGORITHMS:
        assert _parse(algorithm=algorithm, **params[algorithm]).algorithm == algorithm


@pytest.mark.parametrize("value", [0, 1.5, -0.2, "0.9", True])
def test_gpu_memory_utilization_is_a_share(value):
    msg = _error({"algorithm": "vanilla", "gpu_memory_utilization": value})
    assert "gpu_memory_utilization: expected" in msg


def test_gpu_memory_utilization_takes_a_share_or_null():
    assert _parse(algorithm="vanilla", gpu_memory_utilization=0.85).gpu_memory_utilization == 0.85
    assert _parse(algorithm="vanilla", gpu_memory_utilization=1).gpu_memory_utilization == 1.0
    assert _parse(algorithm="vanilla").gpu_memory_utilization is None
