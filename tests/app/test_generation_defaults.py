"""generation_config.json's sampling values (temperature, top_p, top_k, repetition_penalty) apply
to rows when neither the row, the flags nor the recipe set them, as vLLM applies them; shown by
`specbatch inspect`; a value out of range is a one-line error naming the file and key. Also the
run flags of the other sampling fields, and their one-line errors."""
from __future__ import annotations

import json
import re

import pytest

from cli_runner import cli, ok
from errors import one_line_cli_error
from processors_helpers import ids, prompts, rows, run
from specbatch.cli import EXIT_USAGE
from specbatch.engine import Engine, EngineOptions
from specbatch.models.config import ModelError
from specbatch.recipe import SamplingDefaults

pytestmark = pytest.mark.usefixtures("one_thread")

GEN = {"eos_token_id": 0, "do_sample": False, "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def gen_model(tiny_model_factory):
    d = tiny_model_factory("llama3", tag="gen-defaults")          # the tiny model's weights, its own copy
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return d


def test_model_defaults_fill_what_nobody_set(gen_model, tiny_model):
    r = rows(prompts(4), [{"seed": i} for i in range(4)])
    model = ids(run(gen_model, r, 2))
    explicit = ids(run(tiny_model, r, 2, temperature=0.7, top_k=5, repetition_penalty=1.3))
    assert model == explicit
    assert model != ids(run(tiny_model, r, 2))                                    # not greedy
    # a row's own value wins, then the flags' / recipe's
    greedy_rows = rows(prompts(4), {"temperature": 0})
    assert ids(run(gen_model, greedy_rows, 2)) == ids(run(tiny_model, greedy_rows, 2, repetition_penalty=1.3))
    assert ids(run(gen_model, r, 2, temperature=0.0, repetition_penalty=1.0)) == ids(run(tiny_model, r, 2))
    assert ids(run(gen_model, rows(prompts(4), {"top_k": 0, "seed": 1}), 2)) == \
        ids(run(tiny_model, rows(prompts(4), {"seed": 1}), 2, temperature=0.7, repetition_penalty=1.3))


def _table_text(stdout: str) -> str:
    """The inspect table's cells as one line (wrapped cells joined)."""
    return " ".join(stdout.replace("│", " ").split())


def test_inspect_shows_the_defaults(gen_model, tiny_model):
    out = _table_text(ok("inspect", "--model", gen_model).stdout)
    assert "temperature 0.7 (generation_config.json)" in out and "top_p 1.0 (default)" in out
    assert "top_k 5 (generation_config.json)" in out and "repetition_penalty 1.3 (generation_config.json)" in out
    out = _table_text(ok("inspect", "--model", tiny_model).stdout)
    assert "temperature 0.0 (default; OpenAI batch lines 1.0, the API's)" in out


@pytest.mark.parametrize("key,expected", [("top_p", "a number in (0, 1]"), ("max_new_tokens", "an integer >= 1")])
def test_bad_generation_config_value(tiny_model_factory, key, expected):
    d = tiny_model_factory("llama3", tag=f"gen-bad-{key}")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, key: 0}))
    message = f"generation_config.json: {key}: expected {expected}, got 0"
    with pytest.raises(ModelError, match=re.escape(message)):
        Engine(d, EngineOptions(batch_size=1, device="cpu"))
    line = one_line_cli_error(cli("inspect", "--model", d), EXIT_USAGE)
    assert message in line


def test_logit_bias_outside_the_vocabulary_is_the_rows_error(tiny_model):
    eng = Engine(tiny_model, EngineOptions(batch_size=1, device="cpu"))
    (rec,) = eng.generate(rows(prompts(1), {"logit_bias": {320: 1.0}}), SamplingDefaults(max_tokens=2))
    assert rec["error"] == "row 0: field 'logit_bias': token id 320 is outside the model's vocabulary (size 320)"
    (rec,) = eng.generate(rows(prompts(1), {}), SamplingDefaults(max_tokens=2, logit_bias={400: 1.0}))
    assert "field 'logit_bias (--logit-bias or the recipe's sampling.logit_bias)': token id 400" in rec["error"]
    (rec,) = eng.generate(rows(prompts(1), {"min_tokens": 5}), SamplingDefaults(max_tokens=2))
    assert rec["error"] == "row 0: field 'min_tokens': 5 is more than max_tokens (2)"
    # the row's max_tokens under the run's min_tokens: the row's field is named, and where the other came from
    (rec,) = eng.generate(rows(prompts(1), {"max_tokens": 2}), SamplingDefaults(max_tokens=8, min_tokens=5))
    assert rec["error"] == ("row 0: field 'max_tokens': 2 is less than the run's min_tokens (5, --min-tokens or "
                            "the recipe's sampling.min_tokens)")


def test_run_flags(tiny_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts(2)))
    out = tmp_path / "o.jsonl"
    ok("run", src, "--model", tiny_model, "--device", "cpu", "-o", out, "-q", "--max-tokens", "6", "--n", "2",
       "--logprobs", "2", "--min-tokens", "6", "--logit-bias", "0=50", "--logit-bias", "5=1.5", "--temperature", "1",
       "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--repetition-penalty", "1.1", "--min-p", "0.01",
       "--keep-special-tokens", "--include-stop-str-in-output")
    for r in map(json.loads, open(out)):
        assert len(r["choices"]) == 2 and all(c["completion_tokens"] == 6 for c in r["choices"])   # EOS masked
        assert all(len(e["top_logprobs"]) == 2 for c in r["choices"] for e in c["logprobs"])


@pytest.mark.parametrize("flag,value,expected", [
    ("--min-p", "2", "--min-p: expected 0 <= min_p <= 1, got 2.0"),
    ("--min-tokens", "-1", "--min-tokens: expected an integer >= 0, got -1"),
    ("--presence-penalty", "5", "--presence-penalty: expected a number in [-2, 2], got 5.0"),
    ("--frequency-penalty", "-5", "--frequency-penalty: expected a number in [-2, 2], got -5.0"),
    ("--repetition-penalty", "0", "--repetition-penalty: expected a number > 0 (1 = off), got 0.0"),
    ("--logit-bias", "5:1", "--logit-bias: expected ID=BIAS (a token id and a number), got str '5:1'"),
    ("--logit-bias", "5=300", "--logit-bias: expected a bias in [-100, 100] for token id 5, got 300.0"),
    ("--logprobs", "21", "--logprobs: expected an integer in [0, 20], got 21"),
    ("--n", "0", "--n: expected an integer in [1, 1024], got 0"),
])
def test_run_flag_errors(flag, value, expected, tiny_model, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    line = one_line_cli_error(cli("run", src, "--model", tiny_model, "--device", "cpu", flag, value), EXIT_USAGE)
    assert expected in line, line


def test_a_sampling_params_object_is_used_as_given_as_vllms_llm_uses_one(gen_model, tiny_model):
    """vLLM's LLM.generate takes a SamplingParams as given: the model's generation config fills
    only params=None (its default params), as its server fills a request's unset fields. A
    mapping, a row's fields and params=None read as the server's (the config fills what they leave
    unset); a SamplingParams object, alone or in a per-prompt list, does not, so
    SamplingParams(temperature=0) is plain greedy whatever the model's config says."""
    from specbatch import LLM, SamplingParams

    texts = ["def add(a, b):", "import os", "for i in range(10):"]
    gen, plain = LLM(model=gen_model, device="cpu"), LLM(model=tiny_model, device="cpu")

    def out(llm, params, prompts=texts):
        return [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]

    greedy = out(plain, {"temperature": 0, "max_tokens": 8})
    assert out(gen, SamplingParams(temperature=0, max_tokens=8)) == greedy
    assert out(gen, [SamplingParams(temperature=0, max_tokens=8)] * 3) == greedy
    # a mapping's unset repetition_penalty is the model's (1.3): not greedy's tokens
    penalised = out(gen, {"temperature": 0, "max_tokens": 8})
    assert penalised == out(plain, {"temperature": 0, "max_tokens": 8, "repetition_penalty": 1.3}) != greedy
    # a row's own fields win over its SamplingParams either way
    rows = [{"prompt": t, "repetition_penalty": 1.3} for t in texts]
    assert out(gen, SamplingParams(temperature=0, max_tokens=8), rows) == penalised
    # an OpenAI batch line reads as the API whatever params come with it: its unset temperature is 1
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "def add(a, b):", "max_tokens": 8, "seed": 3}}
    sampled = out(plain, {"max_tokens": 8}, [line])
    assert out(plain, SamplingParams(max_tokens=8), [line]) == sampled != out(plain, {"temperature": 0}, [line])
    # the LLM's own defaults (its keywords, a recipe's sampling) stay under a SamplingParams
    assert out(LLM(model=gen_model, device="cpu", repetition_penalty=1.3),
               SamplingParams(temperature=0, max_tokens=8)) == penalised


def test_default_sampling_params_are_the_models_for_a_script_to_change(gen_model, tiny_model):
    """vLLM's example script: sp = llm.get_default_sampling_params(); sp.max_tokens = n;
    llm.generate(prompts, sp): the model's generation config values (and the LLM's own keywords)
    set in a new object, no seed of its own; changed fields then run as given."""
    from specbatch import LLM, SamplingParams

    texts = ["def add(a, b):", "import os", "for i in range(10):"]
    gen = LLM(model=gen_model, device="cpu")

    def out(params):
        return [c.token_ids for c in gen.generate(texts, params, use_tqdm=False)]

    sp = gen.get_default_sampling_params()
    assert isinstance(sp, SamplingParams)
    assert (sp.temperature, sp.top_k, sp.repetition_penalty, sp.seed, sp.max_tokens) == (0.7, 5, 1.3, None, None)
    sp.max_tokens, sp.seed = 8, 3
    assert gen.get_default_sampling_params().max_tokens is None          # a new object each call
    assert out(sp) == out({"max_tokens": 8, "seed": 3})                  # what params=None runs, as changed
    first = out(sp)
    sp.seed = 4                                                          # a pass@k loop's `sp.seed = i`
    assert out(sp) == out(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, max_tokens=8, seed=4))
    assert out(sp) != first
    keyed = LLM(model=tiny_model, device="cpu", temperature=0.5, max_tokens=6).get_default_sampling_params()
    assert (keyed.temperature, keyed.max_tokens, keyed.top_p, keyed.seed) == (0.5, 6, None, None)


def test_sampling_params_are_mutable_and_take_vllms_other_fields_at_their_defaults():
    """As vLLM's SamplingParams: fields set after construction (normalised as at it), a copy by
    clone(); vLLM's fields specbatch lacks build at their defaults (a script passing
    detokenize=True, best_of=None) and are a ValueError naming them when set; an unknown
    attribute is an AttributeError, not a field silently added."""
    from specbatch import SamplingParams

    sp = SamplingParams(max_tokens=4, best_of=None, detokenize=True, spaces_between_special_tokens=True,
                        logits_processors=None, truncate_prompt_tokens=None, bad_words=None, allowed_token_ids=None,
                        structured_outputs=None, guided_decoding=None, output_kind=None, extra_args=None,
                        flat_logprobs=False, skip_clone=False, skip_reading_prefix_cache=None)
    assert sp == SamplingParams(max_tokens=4)
    copy = sp.clone()
    sp.stop, sp.stop_token_ids, sp.logit_bias, sp.n, sp.detokenize = "x", [7], {5: 1}, 2, False   # (text anyway)
    assert (sp.stop, sp.stop_token_ids, sp.logit_bias, sp.n) == (("x",), (7,), ((5, 1.0),), 2)
    assert copy == SamplingParams(max_tokens=4) != sp
    assert SamplingParams(n=3, best_of=3).n == 3
    # vLLM's fields read back as given, else as their defaults (a script's `if sp.best_of ...`)
    assert (sp.detokenize, SamplingParams(n=3, best_of=3).best_of) == (False, 3) and sp.clone().detokenize is False
    three = SamplingParams(n=3, best_of=3)
    with pytest.raises(ValueError, match=r"'best_of': not supported by specbatch yet \(got 3\); remove it or set it "
                                         r"to n \(4\)"):
        three.n = 4
    assert (SamplingParams().detokenize, SamplingParams().best_of, SamplingParams().flat_logprobs) == (True, None, False)
    for make, message in (
            (lambda: SamplingParams(bad_words=["x"]), r"^SamplingParams: 'bad_words': not supported by specbatch yet"),
            (lambda: SamplingParams(n=2, best_of=3), r"^SamplingParams: 'best_of': .*set it to n \(2\)"),
            (lambda: setattr(sp, "spaces_between_special_tokens", False),
             r"^SamplingParams: 'spaces_between_special_tokens': not supported .* default true"),
            (lambda: SamplingParams(output_kind=1), r"^SamplingParams: 'output_kind': not supported by specbatch yet "
                                                     r"\(got 1\); remove it or set it to its default null")):
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(AttributeError, match=r"no field 'max_new_tokens' \(did you mean 'max_tokens'\?\)"):
        sp.max_new_tokens = 5
    with pytest.raises(TypeError):
        SamplingParams(nucleus=0.9)
    with pytest.raises(TypeError):                  # mutable: no hash by value
        hash(sp)


def test_sampling_params_take_keywords_only():
    """vLLM's first positional field is n: SamplingParams(4) there is 4 completions of 16 tokens."""
    from specbatch import SamplingParams

    with pytest.raises(TypeError):
        SamplingParams(4, temperature=0.8)
