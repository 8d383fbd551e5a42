"""`specbatch train --smoke`: every stage of the demo pipeline (tokenizer, target, EAGLE3 head,
NextN/MTP layer, bundle) at toy size on the CPU."""
from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from specbatch.cli import app


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    work = tmp_path_factory.mktemp("demo")
    res = CliRunner().invoke(app, ["train", "--smoke", "--work-dir", str(work), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    return work, json.loads((work / "pipeline.json").read_text())


def test_every_stage_ran_and_losses_fell(smoke):
    work, report = smoke
    assert set(report) == {"tokenizer", "target", "eagle3", "mtp", "bundle"}
    t = report["target"]
    vocab = json.loads((work / "target" / "config.json").read_text())["vocab_size"]
    # an untrained LM scores about ln(vocab); the smoke run must learn well below that
    assert t["best_heldout_loss"] < math.log(vocab) - 0.5, t
    for stage in ("eagle3", "mtp"):
        h = report[stage]
        history = json.loads((work / stage / "train_log.json").read_text())["eval_history"]
        # soft CE against a barely trained target has that target's entropy as its floor: judge
        # the drop in loss and the gain in top-1 agreement with the target
        assert history[0]["step"] == 0 and h["best_eval_loss"] < history[0]["loss"] - 0.1, (stage, history)
        assert h["eval_agree"][0] > history[0]["agree"][0] + 0.2, (stage, history)
    b = report["bundle"]
    assert set(b["bytes"]) == {"target", "eagle3", "nextn_mtp"} and b["total_bytes"] < 24 * 2**20
    assert {p.name for p in (work / "bundle").iterdir()} == {"target", "eagle3", "nextn_mtp"}
    assert (work / "bundle" / "nextn_mtp" / "train_log.json").is_file()


def test_smoke_bundle_runs_losslessly(smoke):
    from specbatch.data import RowRequest
    from specbatch.engine import Engine, EngineOptions
    from specbatch.recipe import SamplingDefaults
    from specbatch.speculative.factory import SpecConfig

    work, _ = smoke
    bundle = work / "bundle"
    target = bundle / "target"
    rows = [RowRequest(row=i, id=str(i), prompt="def f(x):\n    return x" + " " * i) for i in range(4)]
    out = {}
    for name, spec in (("vanilla", SpecConfig()),
                       ("eagle3", SpecConfig("eagle3", 3, 1, 4, str(bundle / "eagle3"))),
                       ("nextn_mtp", SpecConfig("nextn_mtp", 3, 1, 4, str(bundle / "nextn_mtp")))):
        eng = Engine(target, EngineOptions(batch_size=2, device="cpu", dtype="float32", spec=spec))
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=16)), key=lambda r: r["row"])
        out[name] = [r["output_token_ids"] for r in recs]
    assert out["vanilla"] == out["eagle3"] == out["nextn_mtp"]


def test_unknown_stage_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(app, ["train", "--stages", "tokenizer,nope", "--work-dir", str(tmp_path)])
    assert res.exit_code == 2 and "unknown stage 'nope'" in res.output


@pytest.mark.parametrize("args, said", [
    (["--stages", "bundle"], "--stages bundle: needs {w}/target, which the target stage makes: run it first "
                             "(--stages target,bundle)"),
    (["--stages", "target", "--smoke"], "--stages target: needs {w}/tokenizer, which the tokenizer stage makes"),
    (["--stages", "tokenizer,eagle3", "--smoke"], "--stages eagle3: needs {w}/target, which the target stage makes"),
    (["--stages", ""], "--stages: no stage given"),
    (["--stages", "tokenizer", "--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
])
def test_a_stage_missing_its_inputs_is_refused_before_any_runs(tmp_path, args, said):
    """Each stage's inputs (made earlier in the run, or already in --work-dir) and the device are
    checked first: one line, exit 2, nothing run; they were tracebacks after the earlier stages ran."""
    work = tmp_path / "w"
    res = CliRunner().invoke(app, ["train", "--work-dir", str(work), *args])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and said.format(w=work) in " ".join(res.output.split()), res.output
    assert not (work / "tokenizer").exists()
    f = tmp_path / "file"
    f.write_text("x")
    res = CliRunner().invoke(app, ["train", "--work-dir", str(f), "--stages", "tokenizer", "--smoke"])
    assert res.exit_code == 2 and "is a file, not a directory" in res.output


def test_bundle_needs_every_stage_and_checks_the_limit_first(tmp_path, monkeypatch):
    from specbatch.train import pipeline

    work, dest = tmp_path / "work", tmp_path / "dest"
    for stage in ("target", "eagle3"):
        (work / stage).mkdir(parents=True)
        (work / stage / "model.safetensors").write_bytes(b"x" * 100)
    with pytest.raises(FileNotFoundError, match="no trained mtp \\(run the mtp stage first\\)"):
        pipeline.bundle(work, dest)
    (work / "mtp").mkdir()
    (work / "mtp" / "model.safetensors").write_bytes(b"x" * 100)
    (work / "mtp" / "config.json").write_text("{}")
    monkeypatch.setattr(pipeline, "BUNDLE_LIMIT", 301)
    with pytest.raises(ValueError, match="over the"):
        pipeline.bundle(work, dest)
    assert not dest.exists()                       # nothing copied before the checks pass
    monkeypatch.setattr(pipeline, "BUNDLE_LIMIT", 302)
    m = pipeline.bundle(work, dest)
    assert m["bytes"] == {"target": 100, "eagle3": 100, "nextn_mtp": 102} and m["total_bytes"] == 302
    assert sorted(p.name for p in (dest / "nextn_mtp").iterdir()) == ["config.json", "model.safetensors"]
