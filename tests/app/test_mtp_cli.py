"""NextN / MTP through the job and the CLI: the layer inside the target or --draft DIR gives the
vanilla completions, a target without an MTP layer is a one-line error, the job resolves the draft."""
from __future__ import annotations

import json

import pytest

from cli_runner import cli
from errors import one_line_cli_error
from mtp_helpers import mimic_dirs, mtp_dirs  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox"]


def _cli_run(tmp_path, name, model, *extra):
    src = tmp_path / "in.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / f"{name}.jsonl"
    res = cli("run", src, "--model", model, "--max-tokens", 10, "--batch-size", 3, "--device", "cpu",
              "-o", out, "-q", "--save-token-ids", *extra)
    return res, out


def _completions(out):
    return [(r["completion"], r["output_token_ids"]) for r in map(json.loads, open(out)) if r]


def test_cli_nextn_mtp_inside_and_exported(mimic_dirs, tmp_path):
    inside, _ = mimic_dirs("mimo", "inside")
    base, exported = mimic_dirs("deepseek", "exported")
    res, out = _cli_run(tmp_path, "vanilla", base)
    assert res.exit_code == 0, res.output
    want = _completions(out)
    assert len(want) == len(PROMPTS)
    for name, model, extra in [("inside", inside, ()), ("inside_1", inside, ("--recipe", "nextn_mtp_1")),
                               ("exported", base, ("--draft", exported))]:
        recipe = () if extra[:1] == ("--recipe",) else ("--recipe", "nextn_mtp")
        res, out = _cli_run(tmp_path, name, model, *recipe, *extra)
        assert res.exit_code == 0, (name, res.output)
        assert _completions(out) == want, name
        rows = [json.loads(line) for line in open(out)]
        S, N = (1, 2) if name == "inside_1" else (3, 4)
        for r in rows:
            assert r["error"] is None
            assert len(r["spec"]["accept_histogram"]) == S + 1
            assert r["spec"]["draft_tokens"] == (r["spec"]["verify_steps"] - 1) * (N - 1)
        assert sum(r["spec"]["accepted_tokens"] for r in rows) > 0


def test_cli_target_without_mtp_is_aone_line_model_error(mtp_dirs, tmp_path):
    base = mtp_dirs("llama")
    res, out = _cli_run(tmp_path, "nomtp", base, "--recipe", "nextn_mtp")
    line = one_line_cli_error(res, 2)
    for needle in (str(base), "no MTP layer", "mtp.fc.weight", "--draft"):
        assert needle in line, (needle, line)
    assert not out.exists()
    # a --draft directory without an MTP layer names that directory
    other = mtp_dirs("qwen3")
    res, _ = _cli_run(tmp_path, "nomtp2", base, "--recipe", "nextn_mtp", "--draft", other)
    line = one_line_cli_error(res, 2)
    assert str(other) in line and "model.layers.0.eh_proj.weight" in line


def test_job_resolves_the_draft(mimic_dirs, tmp_path):
    from specbatch.job import JobOptions, resolve_draft, run_job
    from specbatch.recipe import load_recipe

    inside, _ = mimic_dirs("qwen", "inside")
    recipe = load_recipe("nextn_mtp").with_overrides(model=str(inside), batch_size=2)
    assert resolve_draft(recipe) is None                       # the MTP inside the target
    assert resolve_draft(recipe.with_overrides(draft="/some/mtp")) == "/some/mtp"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in PROMPTS[:3]))
    summary = run_job(str(src), recipe, JobOptions(output=str(tmp_path / "o.jsonl"), device="cpu"))
    assert summary["errors"] == 0 and summary["requests"] == 3
    assert summary["draft_tokens"] > 0 and len(summary["acceptance_per_position"]) == 3
