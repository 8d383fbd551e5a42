"""Recipes loaded by name or path: the builtin list, files with their line-numbered YAML errors, and
the config layers staying torch-free."""
from __future__ import annotations

import pytest

from specbatch.recipe import RecipeError, SamplingDefaults, builtin_recipes, load_recipe

from recipe_helpers import _write


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
    assert r.sampling.max_tokens is None      # unset: the model's max_new_tokens, else the row form's default


def test_relative_model_and_draft_paths_in_a_recipe_file(tmp_path, monkeypatch):
    """A relative path in a recipe file reads from the working directory, as a flag's does, else
    from the recipe file's directory (a recipe kept beside its models works from anywhere)."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "models" / "m").mkdir(parents=True)
    (tmp_path / "conf" / "head").mkdir()
    recipe = tmp_path / "conf" / "r.yaml"
    recipe.write_text("algorithm: vanilla\nmodel: models/m\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_recipe(str(recipe)).model == str(tmp_path / "conf" / "models" / "m")
    r = tmp_path / "conf" / "e.yaml"
    r.write_text("algorithm: eagle3\nnum_steps: 3\ntopk: 1\nnum_draft_tokens: 4\nmodel: nowhere\ndraft: head\n")
    got = load_recipe(str(r))
    assert got.draft == str(tmp_path / "conf" / "head") and got.model == "nowhere"      # (not found: left as given)
    (elsewhere / "head").mkdir()
    assert load_recipe(str(r)).draft == "head"                # the working directory's first


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
