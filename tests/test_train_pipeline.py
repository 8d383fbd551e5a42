"""`specbatch train --smoke`: every stage of the demo pipeline at toy size on the CPU."""
from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from specbatch.cli import app


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo")
    res = CliRunner().invoke(app, ["train", "--smoke", "--work-dir", str(work), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    return work, json.loads((work / "pipeline.json").read_text())


def test_every_stage_ran_and_losses_fell(smoke):
    work, report = smoke
    assert set(report) == {"tokenizer", "target", "eagle3", "bundle"}
    t, h = report["target"], report["eagle3"]
    vocab = json.loads((work / "target" / "config.json").read_text())["vocab_size"]
    # an untrained LM scores about ln(vocab); the smoke run must learn well below that
    assert t["best_heldout_loss"] < math.log(vocab) - 0.5, t
    history = json.loads((work / "eagle3" / "train_log.json").read_text())["eval_history"]
    # soft CE against a barely trained target has that target's entropy as its floor: judge the
    # drop in loss and the gain in top-1 agreement with the target
    assert history[0]["step"] == 0 and h["best_eval_loss"] < history[0]["loss"] - 0.1, history
    assert h["eval_agree"][0] > history[0]["agree"][0] + 0.2, history
    assert report["bundle"]["total_bytes"] < 24 * 2**20


def test_smoke_bundle_runs_losslessly(smoke):
    from specbatch.data import RowRequest
    from specbatch.engine import Engine, EngineOptions
    from specbatch.recipe import SamplingDefaults
    from specbatch.spec.factory import SpecConfig

    work, _ = smoke
    target, head = work / "bundle" / "target", work / "bundle" / "eagle3"
    rows = [RowRequest(row=i, id=str(i), prompt="def f(x):\n    return x" + " " * i) for i in range(4)]
    out = {}
    for name, spec in (("vanilla", SpecConfig()), ("eagle3", SpecConfig("eagle3", 3, 1, 4, str(head)))):
        eng = Engine(target, EngineOptions(batch_size=2, device="cpu", dtype="float32", spec=spec))
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=16)), key=lambda r: r["row"])
        out[name] = [r["output_token_ids"] for r in recs]
    assert out["vanilla"] == out["eagle3"]


def test_unknown_stage_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(app, ["train", "--stages", "tokenizer,nope", "--work-dir", str(tmp_path)])
    assert res.exit_code == 2 and "unknown stage 'nope'" in res.output
