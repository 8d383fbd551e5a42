"""vLLM's speculative_config read as the recipe doing the same (speculative_config.py): the
mapping, and every key or method it cannot honour refused in one line naming it. Torch-free."""
from __future__ import annotations

import pytest

from specbatch.recipe import load_recipe
from specbatch.speculative_config import speculative_base, speculative_recipe


def test_eagle3_and_mtp_configs_are_chains_of_their_length(tmp_path):
    assert speculative_recipe({"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 5}) == \
        ("eagle3_topk1", {"num_steps": 5, "topk": 1, "num_draft_tokens": 6, "draft": "/heads/e3"})
    for method in ("mtp", "deepseek_mtp", "qwen3_next_mtp", "mimo_mtp"):
        assert speculative_recipe({"method": method, "num_speculative_tokens": 1}) == \
            ("nextn_mtp", {"num_steps": 1, "topk": 1, "num_draft_tokens": 2, "draft": None})
    # an MTP 'model' that is the target means its own layers; another directory, exported layers
    (tmp_path / "t").mkdir()
    assert speculative_recipe({"method": "mtp", "model": str(tmp_path / "t/"), "num_speculative_tokens": 2},
                              target=tmp_path / "t")[1]["draft"] is None
    assert speculative_recipe({"method": "mtp", "model": "/layers", "num_speculative_tokens": 2},
                              target=tmp_path / "t")[1]["draft"] == "/layers"
    # the recipe it names takes those values (the algorithm's own checks apply)
    name, over = speculative_recipe({"method": "eagle3", "model": "/h", "num_speculative_tokens": 2})
    r = load_recipe(name).with_overrides(**over)
    assert (r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, r.draft) == ("eagle3", 2, 1, 3, "/h")


@pytest.mark.parametrize("config, said", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "method 'eagle3' needs 'model': the EAGLE3 head's directory"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, "prompt_lookup_max 4: n-gram drafting"),
    ({"method": "ngram", "num_speculative_tokens": 3}, "method 'ngram' is not supported; expected 'eagle3'"),
    ({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}, "method 'draft_model' is not supported"),
    ({"method": "eagle", "model": "/d", "num_speculative_tokens": 3}, "EAGLE-1/2 heads are not supported"),
    ({"model": "/d", "num_speculative_tokens": 3}, "method: required here (vLLM guesses it from the draft's name)"),
    ({"method": "eagle3", "model": "/d"}, "num_speculative_tokens: expected an integer >= 1"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": True}, "num_speculative_tokens: expected"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size 2: the draft runs beside the target on one GPU"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,)]"},
     "a tree is a recipe here: --recipe eagle3_tree"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
      "acceptance_method": "typical_acceptance_sampler"}, "acceptance is lossless rejection sampling here"),
    ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "speculative_disable_mqa_scorer": True},
     "'speculative_disable_mqa_scorer' is not supported by specbatch (known: method, model"),
    ("eagle3", "expected a mapping (vLLM's speculative config), got str"),
])
def test_what_cannot_be_honoured_is_one_line_naming_it(config, said):
    with pytest.raises(ValueError) as e:
        speculative_recipe(config, "X")
    assert str(e.value).startswith("X: ") and said in str(e.value) and "\n" not in str(e.value)


def test_disable_by_batch_size_is_taken_and_said(capsys):
    speculative_recipe({"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": 8}, "X")
    assert "X: disable_by_batch_size is vLLM's and is not used: each batch's verify width" in capsys.readouterr().err
    speculative_recipe({"method": "mtp", "num_speculative_tokens": 1, "disable_by_batch_size": 8}, "X", say=False)
    assert capsys.readouterr().err == ""


def test_the_base_recipe_and_draft_must_agree():
    spec = speculative_recipe({"method": "eagle3", "model": "/h", "num_speculative_tokens": 2})
    assert speculative_base("vanilla", None, spec)[0] == "eagle3_topk1"
    assert speculative_base(load_recipe("vanilla"), "/h/", spec)[1]["draft"] == "/h"        # the same directory
    with pytest.raises(ValueError, match="speculative_config and recipe 'eagle3_tree' both choose the algorithm"):
        speculative_base("eagle3_tree", None, spec)
    with pytest.raises(ValueError, match="speculative_config's model '/h' and draft '/other' disagree"):
        speculative_base("vanilla", "/other", spec)
    mtp = speculative_recipe({"method": "mtp", "num_speculative_tokens": 2})
    assert speculative_base("vanilla", "/layers", mtp)[1]["draft"] == "/layers"      # draft= gives the layers
