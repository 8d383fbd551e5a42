"""Recipe files: a key given twice is an error naming both lines, exponent numbers are numbers
(YAML 1.2, as rows and flags); `specbatch bench` runs on the recipes' own `model:`."""
from __future__ import annotations

import pytest

from specbatch.recipe import RecipeError, load_recipe

from recipe_helpers import _write


def test_a_key_given_twice_is_an_error_naming_file_line_and_key(tmp_path):
    # PyYAML keeps the last value silently: the second `sampling:` dropped max_tokens 5
    p = _write(tmp_path, "algorithm: vanilla\nsampling:\n  max_tokens: 5\nbatch_size: 4\n"
                         "sampling:\n  stop: ['###']\n", "dup.yaml")
    with pytest.raises(RecipeError, match=r"dup\.yaml: invalid YAML at line 5, column 1: key 'sampling' "
                                          r"given twice \(first at line 2\)"):
        load_recipe(str(p))
    p = _write(tmp_path, "algorithm: vanilla\nsampling:\n  max_tokens: 5\n  max_tokens: 8\n", "dup2.yaml")
    with pytest.raises(RecipeError, match="key 'max_tokens' given twice"):
        load_recipe(str(p))


def test_merge_keys_still_override(tmp_path):
    p = _write(tmp_path, "algorithm: vanilla\nsampling:\n  <<: {max_tokens: 5, n: 2}\n  max_tokens: 7\n", "m.yaml")
    r = load_recipe(str(p))
    assert (r.sampling.max_tokens, r.sampling.n) == (7, 2)


def test_exponent_numbers_are_numbers(tmp_path):
    # `--min-p 5e-2` and a row's 5e-2 are numbers; the recipe said "expected a number, got str '5e-2'"
    p = _write(tmp_path, "algorithm: vanilla\nsampling:\n  min_p: 5e-2\n  temperature: 1E-3\n"
                         "  stop: ['1e5']\n", "sci.yaml")
    r = load_recipe(str(p))
    assert r.sampling.min_p == pytest.approx(0.05)
    assert r.sampling.temperature == pytest.approx(0.001)
    assert r.sampling.stop == ("1e5",)          # quoted: still a string


def test_bench_runs_on_the_recipes_model(tiny_model, tmp_path):
    """`specbatch bench -r mine.yaml` (mine.yaml: `model: DIR`) benchmarked the demo model."""
    from specbatch.bench.sources import BenchError, BenchOptions, recipes_model
    from specbatch.bench.sweep import run_bench

    mine = _write(tmp_path, f"name: mine\nalgorithm: vanilla\nmodel: {tiny_model}\n", "mine.yaml")
    opts = BenchOptions(recipes=(str(mine),), batch_sizes=(1,), prompt_len=4, max_tokens=2, device="cpu",
                        graphs=False, hf=False, warmup=False)
    res = run_bench(opts, log=lambda m: None)
    assert res["meta"]["model"] == str(tiny_model) and res["meta"]["model_source"] == "model"
    assert not res["points"][0].get("failed")
    # recipes naming different targets: one actionable line, not the demo model in silence
    with pytest.raises(BenchError, match="the recipes name different models .*pass --model DIR"):
        recipes_model(BenchOptions(), [load_recipe("vanilla"), load_recipe(str(mine))])
    # --model and --random-weights still win
    assert recipes_model(BenchOptions(model="x"), [load_recipe(str(mine))]).model == "x"
    assert recipes_model(BenchOptions(random_weights="llama-3.1-8b"), [load_recipe(str(mine))]).model is None
    assert recipes_model(BenchOptions(), [load_recipe("vanilla")]).model is None


def test_bench_takes_the_recipes_dtype_unless_given_and_refuses_two():
    from specbatch.bench.sources import BenchError, BenchOptions, recipes_model
    from specbatch.recipe import load_recipe

    half = load_recipe("vanilla").with_overrides(dtype="bfloat16")
    full = load_recipe("eagle3_topk1").with_overrides(dtype="float32")
    assert recipes_model(BenchOptions(recipes=["vanilla"]), [half]).dtype == "bfloat16"
    assert recipes_model(BenchOptions(recipes=["vanilla"], dtype="float16"), [half]).dtype == "float16"
    assert recipes_model(BenchOptions(recipes=["vanilla"]), [load_recipe("vanilla")]).dtype == "auto"
    with pytest.raises(BenchError, match=r"different dtypes \(vanilla: bfloat16, eagle3_topk1: float32\).*--dtype"):
        recipes_model(BenchOptions(recipes=["vanilla", "eagle3_topk1"]), [half, full])
