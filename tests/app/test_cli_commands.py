"""The `specbatch recipes` and `specbatch inspect` commands, in process: listing and printing recipes,
a model's shape, the draft a recipe resolves to, one-line errors."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from specbatch.cli import EXIT_USAGE
from specbatch.recipe import builtin_recipes, load_recipe

from cli_helpers import broken_models  # noqa: F401
from cli_runner import cli, ok
from errors import one_line_cli_error

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- recipes / inspect


def test_recipes_lists_vanilla(monkeypatch):
    """Every builtin recipe, with its drafter: it tells naive_2token (an EAGLE3 head) from
    naive_2token_mtp (the MTP layer). Printed wide, so no cell wraps whatever the terminal."""
    import io

    from rich.console import Console

    from specbatch import cli as cli_mod

    wide = io.StringIO()
    monkeypatch.setattr(cli_mod, "out", Console(file=wide, width=300))     # no cell wrapped
    cli_mod.recipes(None)
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in wide.getvalue().splitlines() if line.count("│") > 3 and line.split("│")[1].strip()}
    assert rows["naive_2token"][2] == "eagle3" and rows["naive_2token_mtp"][2] == "nextn_mtp"
    assert rows["vanilla"][1:3] == ["vanilla", "-"] and set(rows) == set(builtin_recipes())


def test_recipes_prints_yaml():
    r = ok("recipes", "vanilla")
    data = yaml.safe_load(r.stdout)
    assert data == load_recipe("vanilla").to_dict()
    assert data["name"] == "vanilla" and data["algorithm"] == "vanilla"
    shipped = Path(__file__).resolve().parents[2] / "specbatch" / "recipes" / "vanilla.yaml"
    assert data == yaml.safe_load(shipped.read_text())


def test_recipes_unknown():
    line = one_line_cli_error(cli("recipes", "nope"), EXIT_USAGE)
    assert "unknown recipe 'nope'" in line


@pytest.mark.parametrize("arch, name, norm", [("llama3", "LlamaForCausalLM", False),
                                               ("qwen3", "Qwen3ForCausalLM", True)])
def test_inspect(tiny_model_factory, arch, name, norm):
    """The shape and what decides the outputs: RoPE, window, biases, q/k norm, the output layer, EOS ids."""
    r = ok("inspect", "--model", tiny_model_factory(arch))
    assert name in r.stdout
    assert re.search(r"layers\s*│\s*3\b", r.stdout)
    flat = " ".join(line.strip("│ ").split("│")[-1].strip() for line in r.stdout.splitlines())
    assert "rope theta " in flat and "sliding window none" in flat and ("q/k norm" in flat) is norm
    assert re.search(r"output layer (tied to the embeddings|its own)", flat) and "EOS ids" in r.stdout


def test_inspect_bad_model(broken_models):
    line = one_line_cli_error(cli("inspect", "--model", broken_models["gpt2"]), EXIT_USAGE)
    assert "GPT2LMHeadModel" in line


def test_inspect_shows_the_resolved_draft(tiny_model):
    from specbatch.job import DEMO_DIR

    r = ok("inspect", "--recipe", "eagle3_tree")
    flat = "".join(line.strip("│ ").split("│")[-1].strip() for line in r.output.splitlines())
    assert str(DEMO_DIR / "eagle3") in flat, r.output
    one_line_cli_error(cli("inspect", "--recipe", "eagle3_topk1", "--model", str(tiny_model)), EXIT_USAGE)
    r = ok("inspect", "--recipe", "eagle3_topk1", "--model", str(DEMO_DIR / "target"),
           "--draft", str(DEMO_DIR / "eagle3"))
    flat = "".join(line.strip("│ ").split("│")[-1].strip() for line in r.output.splitlines())
    assert str(DEMO_DIR / "eagle3") in flat, r.output
    # a head for another target is refused as loading it would be
    line = one_line_cli_error(cli("inspect", "--recipe", "eagle3_topk1", "--model", str(tiny_model), "--draft",
                                  str(DEMO_DIR / "eagle3")), EXIT_USAGE)
    assert "draft head vocab_size 8192 does not match the target's" in line
    # a directory that holds no draft is said, as loading it would (it was shown as the draft)
    line = one_line_cli_error(cli("inspect", "--recipe", "eagle3_topk1", "--model", str(tiny_model),
                                  "--draft", "/some/head"), EXIT_USAGE)
    assert "/some/head: model directory not found" in line


def test_inspect_says_a_target_holds_no_mtp_layer_as_run_does(tiny_model, tmp_path):
    """nextn_mtp without --draft reads the MTP layer inside the target: inspect said so of a target
    holding none, and run then refused it."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    line = one_line_cli_error(cli("inspect", "--recipe", "nextn_mtp", "--model", str(tiny_model)), EXIT_USAGE)
    assert f"{tiny_model}: no MTP layer found (looked for " in line
    ran = one_line_cli_error(cli("run", inp, "-r", "nextn_mtp", "--model", str(tiny_model), "--device", "cpu",
                                 "-o", tmp_path / "o.jsonl"), EXIT_USAGE)
    assert f"{tiny_model}: no MTP layer found (looked for " in ran
    from specbatch.job import DEMO_DIR

    line = one_line_cli_error(cli("inspect", "--recipe", "nextn_mtp", "--draft", str(DEMO_DIR / "eagle3")), EXIT_USAGE)
    assert f"{DEMO_DIR / 'eagle3'}: no MTP layer found" in line              # an EAGLE3 head given as the MTP draft
    line = one_line_cli_error(cli("inspect", "--recipe", "eagle3_tree", "--draft", str(tiny_model)), EXIT_USAGE)
    assert "not an EAGLE3 head (architectures ['LlamaForCausalLM']" in line  # a target given as the head
