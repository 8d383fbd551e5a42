"""Recipes changed by overrides (flags over the recipe, switching algorithm, validated the same way),
the drafter key, and the round trip through to_dict and YAML."""
from __future__ import annotations

import pytest
import yaml

from specbatch.recipe import Recipe, RecipeError, load_recipe, parse_recipe

from recipe_helpers import SRC, _error, _parse, _write


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
    assert r.sampling.top_k == 5 and r.sampling.top_p is None      # unset: the model's generation_config, else 1.0


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
    assert list(d) == ["name", "description", "algorithm", "num_steps", "topk", "num_draft_tokens", "drafter", "model", "draft", "dtype", "batch_size", "max_model_len", "gpu_memory_utilization", "sampling"]
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
