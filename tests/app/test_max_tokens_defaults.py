"""max_tokens for a row that sets none: the flags', else the recipe's (the builtin recipes leave it
unset), else the model's generation_config.json max_new_tokens, else what the row's form
defaults to: 256 for specbatch's own rows, as the API they imitate for OpenAI batch lines (up to
the context for /v1/chat/completions, as `vllm run-batch`; 16 for /v1/completions, as OpenAI and
vLLM's server)."""
from __future__ import annotations

import json

import pytest

from cli_runner import ok
from specbatch.data.rows import parse_row
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults, load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 6, 7, 8, 9]


def _chat(extra: dict | None = None) -> dict:
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "def f(x):"}], **(extra or {})}}


def _completion(extra: dict | None = None) -> dict:
    return {"custom_id": "p", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": PROMPT, **(extra or {})}}


def _plain(extra: dict | None = None) -> dict:
    return {"id": "n", "prompt_token_ids": PROMPT, **(extra or {})}


def _resolved(eng: Engine, obj: dict, defaults: SamplingDefaults):
    """The request the engine makes of one input row (or its error record)."""
    item = parse_row(obj, row=0, where="row 0")
    return eng.rows.request(item, defaults)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, EngineOptions(batch_size=2, device="cpu"))


@pytest.fixture(scope="module")
def max_new_model(tiny_model_factory):
    d = tiny_model_factory("llama3", tag="max-new-tokens")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "max_new_tokens": 7}))
    return d


@pytest.fixture(scope="module")
def engine_with_max_new(max_new_model):
    return Engine(max_new_model, EngineOptions(batch_size=2, device="cpu"))


def test_each_form_defaults_as_its_api(engine):
    unset = load_recipe("vanilla").sampling
    assert unset.max_tokens is None                                       # the builtin recipes leave it unset
    chat = _resolved(engine, _chat(), unset)
    assert chat.params.max_tokens == engine.max_len - len(chat.prompt_ids)   # up to the context
    assert chat.max_new == engine.max_len - len(chat.prompt_ids)
    assert _resolved(engine, _completion(), unset).params.max_tokens == 16
    assert _resolved(engine, _plain(), unset).params.max_tokens == 256
    assert _resolved(engine, {"id": "m", "messages": [{"role": "user", "content": "x"}]}, unset).params.max_tokens == 256


def test_the_row_then_the_flags_and_recipe_win(engine):
    unset, nine = SamplingDefaults(), SamplingDefaults(max_tokens=9)
    for make in (_chat, _completion, _plain):
        assert _resolved(engine, make(), nine).params.max_tokens == 9         # --max-tokens / the recipe's
        assert _resolved(engine, make({"max_tokens": 5}), nine).params.max_tokens == 5
        assert _resolved(engine, make({"max_tokens": 5}), unset).params.max_tokens == 5
    assert _resolved(engine, _chat({"max_completion_tokens": 4}), unset).params.max_tokens == 4


def test_the_models_max_new_tokens_before_the_forms_default(engine_with_max_new):
    unset = SamplingDefaults()
    assert _resolved(engine_with_max_new, _chat(), unset).params.max_tokens == 7
    assert _resolved(engine_with_max_new, _plain(), unset).params.max_tokens == 7
    # /v1/completions keeps OpenAI's 16 whatever the model says, as vLLM's server
    assert _resolved(engine_with_max_new, _completion(), unset).params.max_tokens == 16
    assert _resolved(engine_with_max_new, _plain(), SamplingDefaults(max_tokens=3)).params.max_tokens == 3


def test_min_tokens_past_the_default_names_where_it_came_from(engine):
    rec = _resolved(engine, _completion({"min_tokens": 20}), SamplingDefaults())
    assert rec["error"] == ("row 0: field 'body.min_tokens': 20 is more than max_tokens "
                            "(16: the /v1/completions default)")
    rec = _resolved(engine, _plain({"min_tokens": 300}), SamplingDefaults())
    assert rec["error"] == "row 0: field 'min_tokens': 300 is more than max_tokens (256: the default)"
    # a chat line's room is the context: a min_tokens under it runs
    assert _resolved(engine, _chat({"min_tokens": 20}), SamplingDefaults()).params.min_tokens == 20


def test_a_job_of_batch_lines_without_max_tokens(tiny_model, tmp_path):
    lines = [_chat({"ignore_eos": True}), _completion({"ignore_eos": True})]
    lines[1]["custom_id"] = "p"
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(o) + "\n" for o in lines))
    out = tmp_path / "out.jsonl"
    args = ["--model", tiny_model, "--batch-size", 2, "--device", "cpu", "-q", "--max-model-len", 48]
    ok("run", inp, "-o", out, *args)
    got = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, out.read_text().splitlines())}
    chat, completion = got["c"], got["p"]
    assert chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"] == 48     # to the context
    assert chat["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 16
    ok("run", inp, "-o", out, *args, "--max-tokens", 3, "--overwrite")
    got = [json.loads(s)["response"]["body"]["usage"]["completion_tokens"] for s in out.read_text().splitlines()]
    assert got == [3, 3]


def test_inspect_says_where_max_tokens_comes_from(tiny_model, max_new_model):
    # (a bad max_new_tokens is test_generation_defaults.py's test_bad_generation_config_value)
    def shown(model) -> str:
        return " ".join(ok("inspect", "--model", model).stdout.replace("│", " ").split())

    assert "max_tokens 256 (default; OpenAI batch lines: up to the context" in shown(tiny_model)
    assert "max_tokens 7 (generation_config.json max_new_tokens; OpenAI /v1/completions lines 16)" in shown(max_new_model)


def test_the_runs_min_tokens_past_a_rows_default_names_the_run_setting(engine):
    """--min-tokens 20 over a /v1/completions line that sets neither field: the error names the
    row's max_tokens (unset, so 16) and the run's setting, not a min_tokens the row does not have."""
    line = {"custom_id": "p", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5, 6, 7]}}
    rec = engine.rows.request(parse_row(line, row=0, where="row 0"), SamplingDefaults(min_tokens=20))
    assert rec["error"] == ("row 0: field 'body.max_tokens': unset, so 16 (the /v1/completions default), is less "
                            "than the run's min_tokens (20, --min-tokens or the recipe's sampling.min_tokens)")
    rec = engine.rows.request(parse_row({"prompt_token_ids": [5, 6]}, row=0, where="row 0"),
                              SamplingDefaults(min_tokens=300))
    assert rec["error"].startswith("row 0: field 'max_tokens': unset, so 256 (the default), is less")
