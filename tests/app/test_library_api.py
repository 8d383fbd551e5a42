"""`specbatch.LLM`: the library entry point, and the README's / package docstring's snippets run
exactly as written."""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import shutil

import pytest

import specbatch
from specbatch import LLM, Completion

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _docstring_blocks(text: str) -> list[str]:
    """Indented example blocks of a docstring (4 spaces), dedented."""
    blocks, cur = [], []
    for line in text.splitlines():
        if line.startswith("    "):
            cur.append(line[4:])
        elif cur and not line.strip():
            cur.append("")
        elif cur:
            blocks.append("\n".join(cur).strip() + "\n")
            cur = []
    if cur:
        blocks.append("\n".join(cur).strip() + "\n")
    return blocks


@pytest.fixture
def in_examples_copy(tmp_path, monkeypatch):
    shutil.copytree(os.path.join(REPO, "examples"), tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), {})
    return out.getvalue()


def test_readme_library_snippets_run_as_written(in_examples_copy):
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    blocks = _python_blocks(readme[readme.index("## Library use"):])
    assert len(blocks) == 2
    printed = _run(blocks[0])
    assert len(printed.splitlines()) == 3 and printed.startswith("0 ")
    printed = _run(blocks[1])
    assert printed.split()[0] == "32"
    assert (in_examples_copy / "completions.jsonl").exists()


def test_package_docstring_snippets_run_as_written(in_examples_copy):
    blocks = _docstring_blocks(specbatch.__doc__)
    assert len(blocks) == 2
    assert len(_run(blocks[0]).splitlines()) == 2
    _run(blocks[1])
    assert (in_examples_copy / "completions.jsonl").exists()


@pytest.fixture(scope="module")
def llm():
    return LLM(recipe="eagle3_topk1", device="cpu", batch_size=3)


def test_a_row_dict_key_like_a_request_field_is_said(capsys):
    """A row dict's `max_new_tokens` (transformers' name) is not a request field: the prompt runs
    without it, and generate() says so once, naming the field it likely meant."""
    llm = LLM(recipe="vanilla", device="cpu", batch_size=2)         # its own: notes are said once an LLM
    outs = llm.generate([{"prompt": "def f():", "max_new_tokens": 2}] * 2, {"max_tokens": 5}, use_tqdm=False)
    assert [o.completion_tokens for o in outs] == [5, 5]
    assert capsys.readouterr().err.splitlines() == [
        "warning: prompt 0: 'max_new_tokens' is not a request field, so the row runs without it; did you mean "
        "'max_tokens'?"]


def test_sampling_params_without_a_temperature_are_said_greedy(capsys):
    """A vLLM user's SamplingParams(top_p=0.95, n=4) samples there (temperature 1.0 by default);
    here it runs greedy, so generate() says so once an LLM, naming the fields."""
    llm = LLM(recipe="vanilla", device="cpu", batch_size=2)
    from specbatch import SamplingParams

    outs = llm.generate(["def f():", "def g():"], SamplingParams(top_p=0.95, n=2, max_tokens=3), use_tqdm=False)
    assert len({c["completion"] for c in outs[0].choices}) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: prompt 0: top_p and n > 1 are set but no temperature is")
    llm.generate(["def f():"], SamplingParams(top_p=0.95, n=2, max_tokens=3, temperature=0.8), use_tqdm=False)
    llm.generate(["def f():"], [{"top_k": 3, "temperature": 0.5, "max_tokens": 2}], use_tqdm=False)
    llm.generate(["def f():"], SamplingParams(top_k=4, max_tokens=2), use_tqdm=False)     # said once an LLM
    assert capsys.readouterr().err == ""
    # a seed of its own is a sign too (a pass@k loop seeding each call), a prompt's or every prompt's
    for params in (SamplingParams(seed=7, max_tokens=2), [{"seed": 7, "max_tokens": 2}], {"seed": 7}):
        llm._greedy.said = False                  # (as a fresh LLM's)
        llm.generate(["def f():"], params, use_tqdm=False)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("warning: prompt 0: a seed is set but no temperature is"), err
    llm._greedy.said = False
    llm.generate(["def f():"], {"seed": 7, "temperature": 0.5, "max_tokens": 2}, use_tqdm=False)
    assert capsys.readouterr().err == ""
    # a bare SamplingParams: vLLM's samples at 1.0 (a pass@k loop of them), specbatch's is greedy: said once
    for params in (SamplingParams(max_tokens=2), [SamplingParams(max_tokens=2)]):
        llm._greedy.said = False
        llm.generate(["def f():"], params, use_tqdm=False)
        llm.generate(["def f():"], params, use_tqdm=False)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("warning: sampling_params: a SamplingParams with no temperature "
                                                   "runs greedy here"), err
    llm._greedy.said = False
    for params in (SamplingParams(max_tokens=2, temperature=0), {"max_tokens": 2}, None):
        llm.generate(["def f():"], params, use_tqdm=False)
    llm.generate([{"prompt": "def f():", "temperature": 0}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_every_prompt_form_in_order_and_reusable(llm):
    prompts = ["def add(a, b):", [{"role": "user", "content": "hi"}], [5, 6, 7, 8],
               {"prompt": "import os", "max_tokens": 3}, {"prompt": ""}, "class Point:"]
    outs = llm.generate(prompts, {"max_tokens": 6})
    assert [c.index for c in outs] == list(range(6)) and all(isinstance(c, Completion) for c in outs)
    assert [c.error is None for c in outs] == [True, True, True, True, False, True]
    assert "'prompt'" in outs[4].error and outs[4].text is None
    assert outs[3].completion_tokens <= 3 and all(c.completion_tokens <= 6 for c in outs)
    for c in outs:
        if c.error is None:
            assert c.spec["verify_steps"] >= 1 and len(c.token_ids) == c.completion_tokens
    again = llm.generate(prompts, {"max_tokens": 6})                 # same engine, same results
    assert [c.text for c in again] == [c.text for c in outs]
    single = llm.generate("def add(a, b):", {"max_tokens": 6})
    assert len(single) == 1 and single[0].text == outs[0].text


def test_generate_matches_vanilla(llm):
    vanilla = LLM(recipe="vanilla", device="cpu")
    prompts = ["def add(a, b):", "for i in range(10):", "import sys"]
    a = llm.generate(prompts, {"max_tokens": 12})
    b = vanilla.generate(prompts, {"max_tokens": 12})
    assert [c.token_ids for c in a] == [c.token_ids for c in b]      # lossless


def test_bad_arguments_are_clear(llm):
    with pytest.raises(TypeError, match="chat message"):
        llm.generate([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="prompt 0"):
        llm.generate([b"bytes"])
    from specbatch.recipe import RecipeError

    with pytest.raises(RecipeError, match="top_p"):
        llm.generate(["x"], {"top_p": 3})
    with pytest.raises(ValueError, match="1 sampling params for 2 prompts"):
        llm.generate(["x", "y"], [{"max_tokens": 3}])


def test_a_seed_in_params_is_each_requests_own(llm):
    """As vLLM's SamplingParams(seed=7): identical prompts with the same seed draw the same
    tokens (the seed is not a run seed the rows derive different ones from)."""
    p = "def fib(n):"
    seeded = llm.generate([p, p, p], {"max_tokens": 10, "temperature": 1.0, "seed": 7})
    assert len({tuple(c.token_ids) for c in seeded}) == 1
    unseeded = llm.generate([p, p, p], {"max_tokens": 10, "temperature": 1.0})
    assert len({tuple(c.token_ids) for c in unseeded}) > 1
    own = llm.generate([{"prompt": p, "seed": 8}], {"max_tokens": 10, "temperature": 1.0, "seed": 7})
    alone = llm.generate([p], {"max_tokens": 10, "temperature": 1.0, "seed": 8})
    assert own[0].token_ids == alone[0].token_ids                    # a row's own seed wins


def test_one_params_per_prompt(llm):
    """vLLM's list form: each prompt takes its own complete params; a row's own fields win."""
    p = "def fib(n):"
    outs = llm.generate([p, p, {"prompt": p, "max_tokens": 2}],
                        [{"temperature": 0, "max_tokens": 4}, {"temperature": 1.0, "max_tokens": 6, "seed": 3},
                         {"max_tokens": 9}])
    assert [c.completion_tokens for c in outs] == [4, 6, 2] and all(c.error is None for c in outs)
    alone = llm.generate([p], {"temperature": 1.0, "max_tokens": 6, "seed": 3})
    assert outs[1].token_ids == alone[0].token_ids
    assert outs[0].token_ids == llm.generate([p], {"temperature": 0, "max_tokens": 4})[0].token_ids
    # without a seed of its own a prompt derives one from the run seed, as with one params for all
    each = LLM(recipe="eagle3_topk1", device="cpu", batch_size=3, seed=5).generate(
        [p, p], [{"temperature": 1.0, "max_tokens": 10}] * 2)
    shared = LLM(recipe="eagle3_topk1", device="cpu", batch_size=3, seed=5).generate(
        [p, p], {"temperature": 1.0, "max_tokens": 10})
    assert [c.token_ids for c in each] == [c.token_ids for c in shared] and each[0].token_ids != each[1].token_ids


@pytest.mark.parametrize("params", [{"temperature": 1e39, "min_tokens": 3}, {"temperature": 1.0, "repetition_penalty": 1e-45},
                                    {"temperature": 1.0, "repetition_penalty": 1e300}])
def test_extreme_sampling_values_stay_numbers(llm, params):
    """Values valid as fields but past float32's range: a temperature of 1e39 is inf in float32
    (-inf / inf = NaN for the tokens min_tokens masks) and x / 1e-45 overflows; a NaN distribution
    drew token 0 (EOS) every time. Now the first is uniform over the allowed tokens and the
    second boosts the repeated ones, as their limits do."""
    (c,) = llm.generate(["def fib(n):"], {**params, "max_tokens": 8, "seed": 1})
    assert c.error is None and c.finish_reason == "length" and c.completion_tokens == 8
    assert llm.engine.tokenizer.eos_token_id not in c.token_ids


def test_chat_template_options_change_the_prompt(llm):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    base, no_turn, cont, kw = llm.generate(
        [{"messages": chat}, {"messages": chat, "add_generation_prompt": False},
         {"messages": chat, "add_generation_prompt": False, "continue_final_message": True},
         {"messages": chat, "chat_template_kwargs": {"unused_variable": 1}}], {"max_tokens": 2})
    assert all(c.error is None for c in (base, no_turn, cont, kw))
    assert base.prompt_tokens > no_turn.prompt_tokens > cont.prompt_tokens          # each reached the template
    assert kw.prompt_tokens == base.prompt_tokens


def test_stop_reason_reaches_the_outputs(llm, tmp_path):
    p = "def fib(n):"
    (free,) = llm.generate([p], {"max_tokens": 6})
    stop_id = free.token_ids[2]
    (c,) = llm.generate([p], {"max_tokens": 6, "stop_token_ids": [stop_id]})
    assert c.finish_reason == "stop" and c.stop_reason == c.record["stop_reason"] == stop_id
    assert free.record["stop_reason"] is None                                  # length
    from specbatch.data.openai_out import from_openai_line, to_openai_line

    line = to_openai_line({**c.record, "endpoint": "completion", "batch_line": True}, "m")
    assert line["response"]["body"]["choices"][0]["stop_reason"] == stop_id
    assert from_openai_line(line)["stop_reason"] == stop_id                   # a reopened output keeps it


def test_sampling_params_take_one_stop_string_as_vllms_do(llm):
    """vLLM's SamplingParams(stop="...") takes one string as well as a list. The dataclass kept
    the string, and turning it into the run's mapping (list(stop)) made each character a stop
    string: stop="single" stopped at the first 'n'."""
    from specbatch import SamplingParams

    assert SamplingParams(stop="single").stop == ("single",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).to_dict()["stop_token_ids"] == [3]
    p = "def add(a, b):"
    (free,) = llm.generate([p], {"max_tokens": 30})
    assert "single" in free.text and "n" in free.text.split("single")[0]
    for params in (SamplingParams(max_tokens=30, stop="single"), [SamplingParams(max_tokens=30, stop="single")]):
        (c,) = llm.generate([p], params)
        assert (c.text, c.stop_reason) == (free.text.split("single")[0], "single")


def test_a_null_seed_in_params_keeps_the_run_seed():
    """{"seed": None} is no seed of its own, as SamplingParams(seed=None) and a per-prompt
    mapping's are: the rows derive theirs from LLM(seed=...). The mapping replaced the run seed
    with None, so LLM(seed=5) drew what an LLM without a seed draws."""
    from specbatch import SamplingParams

    p, params = ["def f(x):"] * 2, {"temperature": 1.0, "max_tokens": 8}
    want = [c.token_ids for c in LLM(device="cpu", seed=5).generate(p, params)]
    for given in ({**params, "seed": None}, SamplingParams(**params), [{**params, "seed": None}] * 2):
        assert [c.token_ids for c in LLM(device="cpu", seed=5).generate(p, given)] == want   # each a first call
    assert [c.token_ids for c in LLM(device="cpu").generate(p, params)] != want


@pytest.mark.parametrize("bad", [None, float("nan")])
def test_a_bad_first_prompt_does_not_swallow_the_list(llm, bad):
    """A list whose first item is not a prompt (None, a NaN from a pandas column) was taken for ONE
    prompt of token ids: one error Completion came back for the whole list. It is refused as the
    same item anywhere else in the list is."""
    with pytest.raises(TypeError, match="prompt 0: .* got (NoneType|float)"):
        llm.generate([bad, "def f():", "import os"], {"max_tokens": 2})
    with pytest.raises(TypeError, match="prompt 1: .* got (NoneType|float)"):
        llm.generate(["def f():", bad], {"max_tokens": 2})
    (c,) = llm.generate([5, 6, None], {"max_tokens": 2})            # one token-id prompt stays one
    assert "prompt_token_ids[2]" in c.error


def test_multi_modal_data_is_refused_not_ignored(llm):
    """vLLM's prompt dict carries images as multi_modal_data (vLLM refuses it for a text model);
    specbatch dropped the key as the user's metadata and answered from the text alone."""
    ok, c = llm.generate([{"prompt": "Describe:", "multi_modal_data": None},
                          {"prompt": "Describe:", "multi_modal_data": {"image": "x.png"}}], {"max_tokens": 2})
    assert ok.error is None
    assert c.text is None and "field 'multi_modal_data': not supported by specbatch yet" in c.error


def test_each_generate_call_draws_fresh_samples_and_a_rerun_the_same():
    """As vLLM's generator moves on between calls: a pass@k loop of generate() calls without a
    seed gets k samples, not one k times; a script run again (a new LLM) draws the same ones; a
    request's own seed draws the same in every call."""
    params = {"temperature": 1.0, "max_tokens": 10}

    def three_calls(extra):
        llm = LLM(device="cpu", seed=5)
        return [llm.generate(["def f(x):"], {**params, **extra})[0].token_ids for _ in range(3)]

    fresh = three_calls({})
    assert len({tuple(t) for t in fresh}) == 3 and three_calls({}) == fresh
    seeded = three_calls({"seed": 11})
    assert seeded[0] == seeded[1] == seeded[2]


def test_max_tokens_none_runs_to_the_context_as_vllms_does():
    """vLLM's SamplingParams(max_tokens=None) generates until the context is full (or a stop); it
    was refused as 'expected an integer', naming a recipe file the user never wrote."""
    from specbatch import SamplingParams

    llm = LLM(device="cpu", max_model_len=64)
    for params in ({"max_tokens": None, "ignore_eos": True}, [{"max_tokens": None, "ignore_eos": True}]):
        (c,) = llm.generate(["def f():"], params)
        assert c.error is None and c.finish_reason == "length" and c.prompt_tokens + c.completion_tokens == 64
    # specbatch's SamplingParams leaves max_tokens unset (None) by default: the recipe's, else the row's
    # default (256), as a mapping without max_tokens; not up to the context
    llm = LLM(device="cpu", max_model_len=400)
    for params in (SamplingParams(ignore_eos=True), [SamplingParams(ignore_eos=True)], {"ignore_eos": True}):
        (c,) = llm.generate(["def f():"], params)
        assert c.completion_tokens == 256
    (c,) = LLM(device="cpu", max_model_len=400, max_tokens=5).generate(["def f():"], SamplingParams(ignore_eos=True))
    assert c.completion_tokens == 5


def test_chat_takes_one_conversation_or_many_as_vllms_does(llm):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    other = [{"role": "user", "content": "Sort a list."}]
    params = {"max_tokens": 3, "temperature": 0}
    (one,) = llm.chat(chat, params, use_tqdm=False)
    both = llm.chat([chat, other], sampling_params=params, use_tqdm=False)
    want = llm.generate([chat, other], params, use_tqdm=False)
    assert [c.token_ids for c in both] == [c.token_ids for c in want] and one.token_ids == want[0].token_ids
    (cont,) = llm.chat(chat, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    (kw,) = llm.chat(chat, params, use_tqdm=False, chat_template_kwargs={"unused_variable": 1})
    assert one.prompt_tokens > cont.prompt_tokens and kw.prompt_tokens == one.prompt_tokens
    assert llm.chat([], params) == []
    with pytest.raises(TypeError, match=r"messages\[1\]: expected a conversation"):
        llm.chat([chat, "hi"], params)
    with pytest.raises(ValueError, match="continue_final_message"):                 # needs no generation prompt
        llm.chat(chat, params, use_tqdm=False, continue_final_message=True)


def test_use_tqdm_shows_progress_or_none_as_asked(llm, capsys):
    prompts, params = ["def f():", "import os", "x = 1"], {"max_tokens": 2, "temperature": 0}
    llm.generate(prompts, params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(prompts, sampling_params=params)                   # vLLM's default: a bar
    assert "Processed prompts" in capsys.readouterr().err

    class Bar:                                                      # a tqdm-like class, as vLLM takes
        made: list = []

        def __init__(self, total, desc):
            self.total, self.n, self.closed = total, 0, False
            Bar.made.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True
    llm.generate(prompts, params, use_tqdm=Bar)
    (b,) = Bar.made
    assert (b.total, b.n, b.closed) == (3, 3, True)
    with pytest.raises(TypeError, match="use_tqdm"):
        llm.generate(prompts, params, use_tqdm="yes")


def test_gpu_memory_utilization_reaches_the_engine_and_a_cpu_says_it_ignores_it(capsys):
    """vLLM's engine argument (also Ray's engine_kwargs): the engine plans with it on a GPU; a CPU
    engine warns that it does not apply instead of dropping it silently."""
    from specbatch.recipe import RecipeError

    llm = LLM(device="cpu", gpu_memory_utilization=0.8)
    assert llm.engine.opts.gpu_memory_utilization == 0.8
    assert "warning: gpu_memory_utilization 0.8" in capsys.readouterr().err
    with pytest.raises(RecipeError, match="gpu_memory_utilization: expected a number in"):
        LLM(device="cpu", gpu_memory_utilization=2)


@pytest.mark.parametrize("recipe, width", [("vanilla", 1), ("eagle3_topk1", 4), ("eagle3_tree", 8),
                                           ("nextn_mtp", 4)])
def test_the_pool_plan_follows_the_draft_weights_and_reserves_the_verified_tokens(monkeypatch, recipe, width):
    """The draft module's weights load before the pool is planned (free memory then leaves them
    room), and the reserve's logits are the verify width's (the proposal's tokens), not the
    headroom (which also counts the draft's scratch rows)."""
    from specbatch.engine import engine as engine_mod

    seen, calls = {}, []
    plan, load = engine_mod.plan_pool, engine_mod.load_draft_module

    def spy_plan(*args, **kw):
        calls.append("plan")
        seen.update(kw)
        return plan(*args, **kw)

    def spy_load(*args, **kw):
        calls.append("load")
        seen["module"] = load(*args, **kw)
        return seen["module"]

    monkeypatch.setattr(engine_mod, "plan_pool", spy_plan)
    monkeypatch.setattr(engine_mod, "load_draft_module", spy_load)
    engine = LLM(recipe=recipe, device="cpu").engine
    assert calls == ["load", "plan"]
    assert seen["verify_nodes"] == width < engine.headroom + (recipe == "vanilla")
    if recipe == "vanilla":
        assert seen["module"] is None
    else:
        assert width == engine.drafter.num_draft_tokens and engine.drafter.head is seen["module"]



def test_bad_sampling_params_are_a_value_error_naming_the_field_and_prompt(tiny_model):
    """As vLLM's SamplingParams raises ValueError: the field, and for a per-prompt list which prompt,
    never a recipe file the caller did not write; best_of as a row reads it (null or n)."""
    from specbatch.llm import LLM, SamplingParamsError

    llm = LLM(tiny_model, device="cpu", batch_size=2)
    with pytest.raises(ValueError, match=r"^sampling_params: top_p: expected 0 < top_p <= 1, got 2.0$"):
        llm.generate(["hi"], {"top_p": 2}, use_tqdm=False)
    with pytest.raises(SamplingParamsError, match=r"^sampling_params\[1\]: top_p: expected 0 < top_p <= 1, got 5.0$"):
        llm.generate(["hi", "yo"], [{"max_tokens": 2}, {"top_p": 5}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params: unknown key 'temprature' .*did you mean 'temperature'"):
        llm.generate(["hi"], {"temprature": 0.5}, use_tqdm=False)
    with pytest.raises(SamplingParamsError, match=r"^sampling_params\[1\]: logit_bias: token id 99999 is outside the "
                       r"model's vocabulary \(size \d+\)$"):
        llm.generate(["hi", "yo"], [{"max_tokens": 2}, {"logit_bias": {"99999": 5}}], use_tqdm=False)
    with pytest.raises(SamplingParamsError, match=r"^sampling_params: logit_bias: token id 99999 is outside"):
        llm.generate(["hi"], {"logit_bias": {99999: 5}}, use_tqdm=False)
    assert llm.generate(["hi"], {"max_tokens": 2, "best_of": None}, use_tqdm=False)[0].error is None
    assert llm.generate(["hi"], {"max_tokens": 2, "n": 2, "best_of": 2}, use_tqdm=False)[0].error is None
    assert llm.generate(["hi"], {"max_tokens": 2, "n": None, "best_of": 1}, use_tqdm=False)[0].error is None
    with pytest.raises(ValueError, match=r"best_of: not supported by specbatch yet \(got 3\)"):
        llm.generate(["hi"], {"max_tokens": 2, "best_of": 3}, use_tqdm=False)
    # vLLM's fields specbatch lacks: named as unsupported, not as a typo; at their defaults, nothing asked
    with pytest.raises(ValueError, match=r"^sampling_params: guided_decoding: a vLLM sampling field specbatch does "):
        llm.generate(["hi"], {"guided_decoding": {"choice": ["a"]}}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^sampling_params: 'bad_words': not supported by specbatch yet \(got "):
        llm.generate(["hi"], {"bad_words": ["x"]}, use_tqdm=False)
    at_defaults = {"max_tokens": 2, "bad_words": None, "detokenize": True}
    assert llm.generate(["hi"], at_defaults, use_tqdm=False)[0].error is None


def test_vllms_engine_arguments_run_as_specbatchs_or_name_what_it_has_instead(tiny_model, capsys):
    """A migrated script's LLM(model, tensor_parallel_size=1, trust_remote_code=True,
    max_num_seqs=..., enforce_eager=True, ...) runs: the arguments with a setting here become it,
    those asking for nothing else are taken, speed knobs specbatch sets its own way are said; a
    value it cannot honour is a ValueError naming it, and a vLLM argument with no reading here
    names what specbatch has instead."""
    from specbatch.llm import LLM
    from specbatch.recipe import RecipeError

    llm = LLM(tiny_model, device="cpu", tensor_parallel_size=1, trust_remote_code=True, max_num_seqs=3,
              tokenizer=str(tiny_model), distributed_executor_backend="mp",
              enforce_eager=True, disable_log_stats=True, enable_chunked_prefill=True, kv_cache_dtype="auto",
              max_num_batched_tokens=4096)
    assert llm.recipe.batch_size == 3 and llm.engine.graphs is None
    assert "LLM(max_num_batched_tokens=4096) is vLLM's and is not used: prefill packs" in capsys.readouterr().err
    assert llm.generate(["hi"], {"max_tokens": 2}, use_tqdm=False)[0].error is None
    for kw, message in (({"tensor_parallel_size": 2}, r"^LLM\(tensor_parallel_size=2\): specbatch runs one engine per "
                                                       r"GPU, without tensor or pipeline parallelism"),
                        ({"kv_cache_dtype": "fp8"}, r"^LLM\(kv_cache_dtype='fp8'\): not supported: the KV cache holds"),
                        ({"tokenizer": "/elsewhere"}, r"^LLM\(tokenizer='/elsewhere'\): specbatch reads the tokenizer "
                                                      r"in the model directory"),
                        ({"max_num_seqs": 4, "batch_size": 8}, r"^LLM\(max_num_seqs=4\) and LLM\(batch_size=8\) "
                                                                r"disagree: max_num_seqs is vLLM's name for batch_size")):
        with pytest.raises(ValueError, match=message):
            LLM(tiny_model, device="cpu", **kw)
    with pytest.raises(RecipeError, match=r"^LLM\(\.\.\.\): unknown key 'max_loras'"):
        LLM(tiny_model, device="cpu", max_loras=2)


def test_vllms_speculative_config_runs_the_recipe_doing_the_same(target_dir, eagle3_dir, capsys):
    """LLM(model, speculative_config={"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}),
    vLLM's way to speculate, is eagle3_topk1 with S = K and that head: its greedy tokens are plain
    decoding's; what it cannot honour is a ValueError naming it."""
    from specbatch.llm import LLM

    config = {"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 2}
    llm = LLM(target_dir, device="cpu", speculative_config=config)
    r = llm.recipe
    assert (r.name, r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, r.draft) == \
        ("eagle3_topk1", "eagle3", 2, 1, 3, str(eagle3_dir))
    prompts, params = ["The cat", "def f(x):"], {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = llm.generate(prompts, params, use_tqdm=False)
    assert sum(c.record["spec"]["draft_tokens"] for c in got) > 0                      # it speculated
    plain = LLM(target_dir, device="cpu").generate(prompts, params, use_tqdm=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    with pytest.raises(ValueError, match=r"^LLM\(speculative_config=\{.*\}\): method 'ngram' is not supported"):
        LLM(target_dir, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="and recipe 'eagle3_tree' both choose the algorithm: give one"):
        LLM(target_dir, "eagle3_tree", device="cpu", speculative_config=config)
    # a vanilla Recipe of the caller's keeps its own settings; the algorithm comes from the config
    from specbatch.recipe import load_recipe

    mine = load_recipe("vanilla").with_overrides(max_model_len=256, temperature=0.5, dtype="float32")
    r = LLM(target_dir, mine, device="cpu", speculative_config=config).recipe
    assert (r.name, r.algorithm, r.num_steps, r.max_model_len, r.dtype, r.sampling.temperature, r.draft) == \
        ("eagle3_topk1", "eagle3", 2, 256, "float32", 0.5, str(eagle3_dir))
    for name in (5, "", [" "]):
        with pytest.raises(ValueError, match=r"served_model_name=.*: expected a non-empty name"):
            LLM(target_dir, device="cpu", served_model_name=name)


def test_a_completion_reads_as_vllms_request_output(llm):
    """A migrated script's o.outputs[0].text, .token_ids, .finish_reason, .stop_reason,
    .cumulative_logprob and .logprobs[i][token_id].logprob run unchanged, o.prompt,
    o.prompt_token_ids and o.request_id too; llm.get_tokenizer() too."""
    from specbatch import SamplingParams

    one, bad, many = llm.generate(["def add(a, b):", "", "import os"],
                                  [SamplingParams(max_tokens=6, logprobs=2, stop=["("]), SamplingParams(max_tokens=4),
                                   SamplingParams(max_tokens=5, n=3, temperature=0.9, seed=1, logprobs=1)],
                                  use_tqdm=False)
    (out,) = one.outputs
    assert (out.index, out.text, out.token_ids, out.finish_reason, out.stop_reason) == \
        (0, one.text, one.token_ids, one.finish_reason, one.stop_reason)
    assert one.finished and out.finished()
    assert len(out.logprobs) == len(out.token_ids)
    for tok, entry, raw in zip(out.token_ids, out.logprobs, one.logprobs):
        assert entry[tok].logprob == raw["logprob"] and entry[tok].decoded_token == raw["token"]
        tops = raw["top_logprobs"]
        assert [entry[t["token_id"]].rank for t in tops] == [1, 2]
        assert entry[tok].rank == next((i for i, t in enumerate(tops, 1) if t["token_id"] == tok), None)
    assert out.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in one.logprobs))
    assert bad.error and bad.outputs == []
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert [o.text for o in many.outputs] == [c["completion"] for c in many.choices]
    assert [o.token_ids for o in many.outputs] == [c["output_token_ids"] for c in many.choices]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1            # sampled: distinct choices
    assert llm.generate(["x"], {"max_tokens": 2}, use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    tok = llm.get_tokenizer()
    assert tok.decode(out.token_ids, skip_special_tokens=True).startswith(out.text)
    # the prompt as the model read it: vLLM's basic example prints output.prompt beside the text
    first = int(one.request_id)                     # vLLM's counter, across calls
    assert [c.request_id for c in (one, bad, many)] == [str(first + i) for i in range(3)]
    a, b = (llm.generate(["x"], {"max_tokens": 1}, use_tqdm=False)[0].request_id for _ in range(2))
    assert int(a) > first + 2 and int(b) == int(a) + 1
    assert (one.prompt, one.prompt_token_ids) == ("def add(a, b):", tok("def add(a, b):")["input_ids"])
    assert len(one.prompt_token_ids) == one.prompt_tokens and (bad.prompt, bad.prompt_token_ids) == (None, None)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (chat,) = llm.chat(conv, {"max_tokens": 2}, use_tqdm=False)
    assert chat.prompt == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == tok(chat.prompt, add_special_tokens=False)["input_ids"]
    assert len(chat.prompt_token_ids) == chat.prompt_tokens
    (ids,) = llm.generate([[5, 6, 7]], {"max_tokens": 2}, use_tqdm=False)
    assert (ids.prompt, ids.prompt_token_ids) == (None, [5, 6, 7])
    # pickled (a process pool, Ray) with its prompt, not with the tokenizer
    fresh = llm.generate(["def add(a, b):"], {"max_tokens": 2}, use_tqdm=False)[0]
    blob = pickle.dumps(fresh)
    back = pickle.loads(blob)
    assert (back.prompt, back.prompt_token_ids, back.text) == (one.prompt, one.prompt_token_ids, fresh.text)
    assert len(blob) < len(pickle.dumps(tok)) and back.outputs[0].text == fresh.text


def test_vllms_other_arguments_at_their_defaults_run_and_set_are_refused_by_name():
    """A migrated call passing vLLM's arguments at their defaults (generate(..., lora_request=None),
    chat's positional order) runs; one that asks for something specbatch lacks is a ValueError
    naming it, not a TypeError or a silent drop; chat's conflicting options raise as vLLM's."""
    from specbatch import SamplingParams

    llm = LLM(recipe="vanilla", device="cpu")
    conv = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(max_tokens=2)
    assert len(llm.generate(["x", "y"], sp, False, None, priority=[0, 0], tokenization_kwargs=None)) == 2
    assert len(llm.chat(conv, sp, False, None, None, "string", True, False, None, None)) == 1
    for kw, named in (({"lora_request": object()}, "lora_request"), ({"priority": [0, 1]}, "priority")):
        with pytest.raises(ValueError, match=rf"^generate\({named}=\.\.\.\): not supported by specbatch yet"):
            llm.generate(["x", "y"], sp, False, **kw)
    for kw, named in (({"tools": [{"type": "function"}]}, "tools"),
                      ({"mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs")):
        with pytest.raises(ValueError, match=rf"^chat\({named}=\.\.\.\): not supported by specbatch yet"):
            llm.chat(conv, sp, False, **kw)
    with pytest.raises(ValueError, match=r"^chat\(chat_template_content_format='openai'\): this model's chat template "
                       r"reads message content as 'string' \(the form 'auto' picks"):
        llm.chat(conv, sp, False, chat_template_content_format="openai")
    with pytest.raises(ValueError, match="continue_final_message=True\\) needs add_generation_prompt=False"):
        llm.chat(conv, sp, False, continue_final_message=True)
    assert len(llm.chat(conv + [{"role": "assistant", "content": "he"}], sp, False, add_generation_prompt=False,
                        continue_final_message=True)) == 1
    with pytest.raises(TypeError, match="unexpected keyword argument 'sampling'"):
        llm.generate(["x"], sampling=sp)


def test_an_lm_eval_loglikelihood_over_prompt_logprobs_runs_as_on_vllm(llm):
    """lm-eval's vLLM backend scores a continuation with SamplingParams(temperature=0,
    prompt_logprobs=1, max_tokens=1, detokenize=False) and reads o.prompt_logprobs as vLLM's
    [None, {token_id: Logprob}, ...]; the output column's form stays in o.record and to_dict()."""
    from specbatch import SamplingParams

    tok = llm.get_tokenizer()
    ctx, cont = "def add(a, b):", "\n    return a + b"
    ids, ctxlen = tok(ctx + cont)["input_ids"], len(tok(ctx)["input_ids"])
    sp = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids) == out.prompt_tokens
    column = out.record["prompt_logprobs"]
    assert out.to_dict()["prompt_logprobs"] == column
    for tok_id, entry, col in zip(ids[1:], plp[1:], column[1:]):
        assert entry[tok_id].logprob == col["logprob"] and entry[tok_id].rank == col["rank"]
        (top,) = col["top_logprobs"]
        assert entry[top["token_id"]].rank == 1 and entry[top["token_id"]].decoded_token == top["token"]
    total = sum(e[t].logprob for t, e in zip(ids[ctxlen:], plp[ctxlen:]))
    assert total == pytest.approx(sum(c["logprob"] for c in column[ctxlen:]))
    greedy = all(max(e, key=lambda k: e[k].logprob) == t for t, e in zip(ids[ctxlen:], plp[ctxlen:]))
    assert greedy == all(c["rank"] == 1 for c in column[ctxlen:])
    assert llm.generate(["x"], {"max_tokens": 1}, use_tqdm=False)[0].prompt_logprobs is None


def test_logprob_dicts_rank_a_tied_token_as_vllm_does():
    """vLLM builds a position's {token_id: Logprob} from the token's rank, then the top ones'
    places over it: a token tied with a likelier-listed one reads its place in the list."""
    from specbatch.request_output import outputs, prompt_logprobs

    top = [{"token_id": 3, "token": "c", "logprob": -0.5}, {"token_id": 7, "token": "g", "logprob": -1.0},
           {"token_id": 5, "token": "e", "logprob": -1.0}]
    tied = {"token_id": 5, "token": "e", "logprob": -1.0, "rank": 2, "top_logprobs": top}
    past = {"token_id": 9, "token": "i", "logprob": -4.0, "rank": 40, "top_logprobs": top}
    (out,) = outputs({"error": None, "completion": "ei", "output_token_ids": [5, 9], "logprobs": [tied, past],
                      "finish_reason": "length", "stop_reason": None, "choices": None})
    assert [(d[5].rank, d[3].rank) for d in out.logprobs[:1]] == [(3, 1)] and out.logprobs[1][9].rank == 40
    assert list(out.logprobs[1]) == [9, 3, 7, 5]                    # the token first, then the top ones
    plp = prompt_logprobs({"prompt_logprobs": [None, tied]})
    assert plp[0] is None and plp[1][5].rank == 3
