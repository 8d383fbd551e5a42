from pathlib import Path

import pytest
import yaml

from specbatch.recipe import (
    ALGORITHMS,
    Recipe,
    RecipeError,
    SamplingDefaults,
    builtin_recipes,
    load_recipe,
    parse_recipe,
)

SRC = "recipes/x.yaml"


def _parse(**data):
    return parse_recipe(data, SRC)


def _error(data, source: str = SRC) -> str:
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data, source)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(source + ": ")
    return msg


def _write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ---------------------------------------------------------------- loading


def test_builtin_list_contains_vanilla():
    names = builtin_recipes()
    assert "vanilla" in names
    assert names == sorted(names)


def test_load_builtin_vanilla():
    r = load_recipe("vanilla")
    assert r.name == "vanilla"
    assert r.algorithm == "vanilla"
    assert (r.num_steps, r.topk, r.num_draft_tokens) == (None, None, None)
    assert r.model == "default" and r.draft is None and r.dtype == "auto"
    assert r.batch_size is None and r.max_model_len is None      # slots from memory
    assert r.sampling == SamplingDefaults()
    assert r.source == "<builtin>/vanilla.yaml"
    assert "baseline" in r.description


def test_load_from_path(tmp_path):
    p = _write(
        tmp_path,
        "algorithm: eagle3\nnum_steps: 3\ntopk: 1\nnum_draft_tokens: 4\nbatch_size: 8\n"
        "sampling:\n  temperature: 0.7\n  stop: '###'\n  stop_token_ids: [2, 7]\n",
        "chain3.yml",
    )
    r = load_recipe(str(p))
    assert r.name == "chain3"  # defaults to the file stem
    assert r.source == str(p)
    assert (r.num_steps, r.topk, r.num_draft_tokens) == (3, 1, 4)
    assert r.batch_size == 8
    assert r.sampling.temperature == 0.7
    assert r.sampling.stop == ("###",)
    assert r.sampling.stop_token_ids == (2, 7)
    assert r.sampling.max_tokens == 256


def test_unknown_recipe_name():
    with pytest.raises(RecipeError, match=r"unknown recipe 'foo' \(builtin: .*vanilla.*; or give a path to a \.yaml file\)"):
        load_recipe("foo")
    with pytest.raises(RecipeError, match="did you mean 'vanilla'"):
        load_recipe("vanila")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(RecipeError, match=f"^{missing}: recipe file not found"):
        load_recipe(missing)


def test_bad_yaml_names_file_and_line(tmp_path):
    p = _write(tmp_path, "algorithm: vanilla\nbatch_size: 4\nsampling: [1, 2\n  max_tokens: 3\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(str(p))
    msg = str(exc.value)
    assert msg.startswith(f"{p}: invalid YAML at line ")
    assert "\n" not in msg
    line = int(msg.split("at line ")[1].split(",")[0])
    assert 3 <= line <= 5


@pytest.mark.parametrize("text", ["- algorithm: vanilla\n", "just a string\n", ""])
def test_top_level_must_be_mapping(tmp_path, text):
    p = _write(tmp_path, text)
    with pytest.raises(RecipeError, match=f"^{p}: the top level must be a mapping"):
        load_recipe(str(p))


# ---------------------------------------------------------------- keys and types


def test_unknown_top_level_key_with_suggestion():
    msg = _error({"algorithm": "vanilla", "topK": 2})
    assert "unknown key 'topK'" in msg
    assert "(known: name, description, algorithm, num_steps, topk, num_draft_tokens, model, drafter, draft, dtype, batch_size, max_model_len, sampling)" in msg
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
        ({"sampling": {"max_tokens": False}}, "sampling.max_tokens: expected an integer, got bool False"),
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
        ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens: expected an integer >= 1, got 0"),
        ({"sampling": {"temperature": -0.1}}, "sampling.temperature: expected a number >= 0"),
        ({"sampling": {"top_p": 0}}, "sampling.top_p: expected 0 < top_p <= 1, got 0.0"),
        ({"sampling": {"top_p": 1.01}}, "sampling.top_p: expected 0 < top_p <= 1, got 1.01"),
        ({"sampling": {"top_k": -1}}, "sampling.top_k: expected an integer >= 0, got -1"),
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


# ---------------------------------------------------------------- overrides and round trip


def test_with_overrides_valid():
    base = load_recipe("vanilla")
    r = base.with_overrides(batch_size=8, temperature=0.5, max_tokens=None, stop=("a", "b"), model="/m", max_model_len=None)
    assert r.batch_size == 8 and r.sampling.temperature == 0.5
    assert r.sampling.max_tokens == base.sampling.max_tokens  # None is ignored
    assert r.sampling.stop == ("a", "b") and r.model == "/m"
    assert r.source == base.source
    assert base.batch_size is None  # frozen original untouched
    r = base.with_overrides(sampling={"top_k": 5})
    assert r.sampling.top_k == 5 and r.sampling.top_p == 1.0


def test_with_overrides_switching_algorithm():
    base = load_recipe("vanilla")
    tree = base.with_overrides(algorithm="eagle3", num_steps=3, topk=4, num_draft_tokens=16)
    assert (tree.algorithm, tree.num_steps, tree.topk, tree.num_draft_tokens) == ("eagle3", 3, 4, 16)
    chain = tree.with_overrides(topk=1, num_draft_tokens=4)
    assert (chain.num_steps, chain.topk, chain.num_draft_tokens) == (3, 1, 4)
    back = tree.with_overrides(algorithm="vanilla")  # the old algorithm's params are dropped
    assert (back.num_steps, back.topk, back.num_draft_tokens) == (None, None, None)
    assert tree.with_overrides(algorithm="naive_2token").num_draft_tokens == 2


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"batch_size": 0}, "batch_size: expected an integer >= 1 or null, got 0"),
        ({"temperature": -1.0}, "sampling.temperature: expected a number >= 0"),
        ({"top_p": "0.9"}, "sampling.top_p: expected a number, got str '0.9'"),
        ({"num_steps": 3}, "num_steps: algorithm vanilla takes none"),
        ({"algorithm": "eagle3"}, "algorithm eagle3 needs num_steps"),
        ({"sampling": 3}, "sampling: expected a mapping"),
    ],
)
def test_with_overrides_invalid(kw, expected):
    with pytest.raises(RecipeError) as exc:
        load_recipe("vanilla").with_overrides(**kw)
    msg = str(exc.value)
    assert msg.startswith("<builtin>/vanilla.yaml (overrides): ")
    assert expected in msg


def test_with_overrides_unknown_key():
    with pytest.raises(RecipeError, match=r"unknown key 'temprature' \(known: name, .*max_tokens, temperature.*\); did you mean 'temperature'\?"):
        load_recipe("vanilla").with_overrides(temprature=0.3)
    with pytest.raises(RecipeError, match="unknown key 'source'"):
        load_recipe("vanilla").with_overrides(source="x")


def test_to_dict_round_trip(tmp_path):
    r = _parse(
        name="tree",
        description="d",
        algorithm="nextn_mtp",
        num_steps=2,
        topk=3,
        num_draft_tokens=8,
        model="/models/x",
        draft="/heads/y",
        dtype="bfloat16",
        batch_size=16,
        max_model_len=4096,
        sampling={"max_tokens": 9, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1, "stop": "</s>", "stop_token_ids": [0], "ignore_eos": True},
    )
    d = r.to_dict()
    assert "source" not in d
    assert list(d) == ["name", "description", "algorithm", "num_steps", "topk", "num_draft_tokens", "drafter", "model", "draft", "dtype", "batch_size", "max_model_len", "sampling"]
    assert d["sampling"]["stop"] == ["</s>"]
    # YAML-able with the safe dumper, and parses back to the same recipe
    text = yaml.safe_dump(d, sort_keys=False)
    again = parse_recipe(yaml.safe_load(text), SRC)
    assert again == r
    p = _write(tmp_path, text, "tree.yaml")
    assert load_recipe(str(p)) == Recipe(**{**r.__dict__, "source": str(p)})
    vanilla = load_recipe("vanilla")
    assert parse_recipe(vanilla.to_dict(), vanilla.source) == vanilla


def test_drafter_key():
    assert _parse(algorithm="naive_2token").drafter == "eagle3"
    assert _parse(algorithm="naive_2token", drafter="nextn_mtp").drafter == "nextn_mtp"
    assert _parse(algorithm="eagle3", num_steps=2, topk=1, num_draft_tokens=3).drafter == "eagle3"
    assert _parse(algorithm="nextn_mtp", num_steps=1, topk=1, num_draft_tokens=2).drafter == "nextn_mtp"
    assert _parse(algorithm="vanilla").drafter is None
    assert "drafter: algorithm vanilla uses no draft module" in _error({"algorithm": "vanilla", "drafter": "eagle3"})
    msg = _error({"algorithm": "eagle3", "num_steps": 2, "topk": 1, "num_draft_tokens": 3, "drafter": "nextn_mtp"})
    assert "drafter: algorithm eagle3 drafts with eagle3, got 'nextn_mtp' (only naive_2token takes either)" in msg
    assert "drafter: expected one of eagle3, nextn_mtp, got str 'medusa'" in _error(
        {"algorithm": "naive_2token", "drafter": "medusa"})
    r = _parse(algorithm="naive_2token", drafter="nextn_mtp")
    assert r.with_overrides(algorithm="eagle3", num_steps=2, topk=1, num_draft_tokens=3).drafter == "eagle3"


def test_the_config_layers_import_no_torch():
    """Recipes, rows, records, sampling fields, the algorithm table and the scheduler stay
    torch-free (quick to import; what a Ray driver or a CLI error path needs)."""
    import subprocess
    import sys

    code = ("import sys, specbatch.recipe, specbatch.data, specbatch.scheduler, specbatch.algorithms, "
            "specbatch.records, specbatch.params, specbatch.resolve; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
