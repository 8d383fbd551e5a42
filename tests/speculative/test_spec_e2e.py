"""Speculative decoding end to end: lossless greedy output for every EAGLE3 shape, long accepted
runs with an oracle draft, stops inside accepted runs, and lossless sampling (statistical)."""
from __future__ import annotations

import math

import pytest
import torch

from chi_square import chi2, chi2_threshold
from oracle import OracleDrafter
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig
from tiny_models import make_eagle3_head

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = [(3, 1, 4), (5, 4, 8), (6, 1, 7), (1, 1, 2), (2, 3, 7), (4, 2, 9)]   # (S, k, N)
LENS = (1, 23, 9, 40, 5, 17, 3, 30, 12)
MAXES = (20, 7, 16, 1, 20, 11, 20, 3, 14)      # requests finish at different cycles


def _rows(n=len(LENS), seed=0, overrides=None):
    g = torch.Generator().manual_seed(seed)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 320, (LENS[i % len(LENS)],), generator=g).tolist(),
                       overrides={"max_tokens": MAXES[i % len(MAXES)], **(overrides or {})}) for i in range(n)]


def _run(model, rows, bs, device="cpu", spec=SpecConfig(), drafter=None, **defaults):
    eng = Engine(model, EngineOptions(batch_size=bs, device=device, dtype="float32", spec=spec, adaptive=False),
                 drafter=drafter)                              # exact stats below: every cycle full width
    recs = sorted(eng.generate(rows, SamplingDefaults(**{"max_tokens": 20, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs


def _ids(recs):
    return [r["output_token_ids"] for r in recs]


@pytest.fixture(scope="module")
def vanilla(target_dir):
    return _ids(_run(target_dir, _rows(), 4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "S{}k{}N{}".format(*s))
def test_eagle3_greedy_is_lossless(shape, device, target_dir, eagle3_dir, vanilla):
    S, k, N = shape
    for bs in (1, 3, 8):
        recs = _run(target_dir, _rows(), bs, device, SpecConfig("eagle3", S, k, N, str(eagle3_dir)))
        assert _ids(recs) == vanilla, f"{shape} batch {bs}"
        for r in recs:
            s = r["spec"]
            assert s["draft_tokens"] == (s["verify_steps"] - 1) * (N - 1)
            assert sum(s["accept_histogram"]) == s["verify_steps"] - 1
            assert len(s["accept_histogram"]) == S + 1


def _table(target_dir, rows, max_tokens=48):
    plain = [RowRequest(row=r.row, id=r.id, prompt_token_ids=r.prompt_token_ids) for r in rows]
    recs = _run(target_dir, plain, 4, max_tokens=max_tokens, ignore_eos=True)
    return {tuple(r.prompt_token_ids): rec["output_token_ids"] for r, rec in zip(plain, recs)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("decoys", [False, True], ids=["chain", "tree"])
def test_oracle_draft_long_runs_are_lossless(decoys, device, target_dir, vanilla):
    rows = _rows()
    N = 6
    drafter = OracleDrafter(_table(target_dir, rows), N, 320, decoys=decoys)
    recs = _run(target_dir, rows, 3, device, drafter=drafter)
    assert _ids(recs) == vanilla
    depth = drafter.max_depth
    long = [r for r in recs if r["completion_tokens"] >= 16 and r["finish_reason"] == "length"]
    assert long
    for r in long:
        s = r["spec"]
        # Always right: after the prefill's token, every cycle emits the whole path plus the
        # bonus (depth + 1 tokens), the last one cut by max_tokens.
        n = r["completion_tokens"]
        assert s["verify_steps"] == 1 + math.ceil((n - 1) / (depth + 1))
        assert s["accept_histogram"][depth] == s["verify_steps"] - 1
        assert s["accepted_tokens"] == depth * (s["verify_steps"] - 1)


def test_oracle_partial_acceptance_is_lossless(target_dir, vanilla):
    rows = _rows()
    drafter = OracleDrafter(_table(target_dir, rows), 5, 320, decoys=True, corrupt=lambda i: i == 2)
    recs = _run(target_dir, rows, 4, drafter=drafter)
    assert _ids(recs) == vanilla
    hist = [sum(c) for c in zip(*(r["spec"]["accept_histogram"] for r in recs))]
    assert hist[2] > 0 and sum(hist[3:]) == 0        # the third draft is always wrong


def test_stops_inside_an_accepted_run(target_dir, tiny_model_factory):
    rows = [RowRequest(row=r.row, id=r.id, prompt_token_ids=r.prompt_token_ids) for r in _rows(n=4)]
    table = _table(target_dir, rows)
    free = _run(target_dir, rows, 2, max_tokens=30, ignore_eos=True)
    oracle = lambda: OracleDrafter(table, 7, 320)       # 6 drafts + bonus: 7 tokens a cycle
    for cut in (1, 3, 5, 6, 9, 14):
        # max_tokens lands inside a cycle's accepted run: nothing is emitted past it
        capped = _run(target_dir, rows, 2, drafter=oracle(), max_tokens=cut, ignore_eos=True)
        assert _ids(capped) == [f["output_token_ids"][:cut] for f in free]
        assert all(r["finish_reason"] == "length" for r in capped)
    # a stop token id in the middle of an accepted run: the output ends on it
    ids = free[0]["output_token_ids"]
    stop = ids[4]
    first = ids.index(stop)
    recs = _run(target_dir, rows[:1], 1, drafter=oracle(), ignore_eos=True, max_tokens=30,
                stop_token_ids=(stop,))
    assert recs[0]["output_token_ids"] == ids[: first + 1] and recs[0]["finish_reason"] == "stop"
    # the same through EOS: a copy of the target whose generation_config names that token
    eos_target = tiny_model_factory("llama3", tag="eos-mid-run", num_hidden_layers=4)
    (eos_target / "generation_config.json").write_text('{"eos_token_id": [%d]}' % stop)
    recs = _run(eos_target, rows[:1], 1, drafter=oracle(), max_tokens=30)
    assert recs[0]["output_token_ids"] == ids[: first + 1] and recs[0]["finish_reason"] == "stop"
    assert recs[0]["spec"]["verify_steps"] == (1 if first == 0 else 2)     # stopped inside one cycle


def _exact_pairs(target_dir, prompt, temperature):
    """Exact target probabilities of the first two sampled tokens, from transformers."""
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = (m(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        seqs = torch.tensor([prompt + [t] for t in range(p1.shape[0])])
        p2 = (m(seqs).logits[:, -1] / temperature).softmax(-1)
    return p1[:, None] * p2                                                     # [V, V]


@pytest.mark.parametrize("mode", ["oracle-tree", "eagle3-tree", "eagle3-chain"])
def test_sampling_is_lossless_statistically(mode, target_dir, eagle3_dir):
    """Many seeds of one prompt: the first two tokens follow the target's own distribution."""
    T, n = 0.6, 3000
    prompt = _rows(n=1)[0].prompt_token_ids
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=prompt, overrides={"seed": i}) for i in range(n)]
    if mode == "oracle-tree":
        table = _table(target_dir, rows[:1], 8)
        kw = dict(drafter=OracleDrafter(table, 4, 320, decoys=True))
    elif mode == "eagle3-tree":
        kw = dict(spec=SpecConfig("eagle3", 3, 3, 6, str(eagle3_dir)))
    else:
        kw = dict(spec=SpecConfig("eagle3", 2, 1, 3, str(eagle3_dir)))
    recs = _run(target_dir, rows, 64, temperature=T, max_tokens=2, ignore_eos=True, **kw)
    if mode == "oracle-tree":      # drafts must actually be accepted for the test to mean anything
        assert sum(r["spec"]["accepted_tokens"] for r in recs) > n // 10
    exact = _exact_pairs(target_dir, prompt, T)
    counts = torch.zeros_like(exact)
    for r in recs:
        a, b = r["output_token_ids"]
        counts[a, b] += 1
    stat, dof = chi2(counts, exact * n)
    assert stat < chi2_threshold(dof), (stat, dof)


def test_eagle3_recipe_through_the_job(target_dir, eagle3_dir, tmp_path):
    import json

    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": 12}) + "\n"
                           for r in _rows(n=5)))
    outs = {}
    for name in ("vanilla", "eagle3_topk1", "eagle3_tree"):
        recipe = load_recipe(name).with_overrides(model=str(target_dir), batch_size=3,
                                                  draft=None if name == "vanilla" else str(eagle3_dir))
        summary = run_job(str(src), recipe, JobOptions(output=str(tmp_path / f"{name}.jsonl"), device="cpu"))
        outs[name] = [json.loads(line)["completion"] for line in open(tmp_path / f"{name}.jsonl")]
        assert summary["errors"] == 0 and summary["requests"] == 5
        if name != "vanilla":
            S = recipe.num_steps
            assert len(summary["acceptance_per_position"]) == S
            assert summary["draft_tokens"] > 0 and summary["draft"] == str(eagle3_dir)
            assert 1.0 <= summary["mean_accept_length"] <= S + 1
    assert outs["eagle3_topk1"] == outs["vanilla"] == outs["eagle3_tree"]


def test_eagle3_draft_resolution_errors(target_dir, eagle3_dir, tmp_path, tiny_model_factory):
    from specbatch.job import JobError, resolve_draft
    from specbatch.recipe import load_recipe

    with pytest.raises(JobError, match="pass --draft DIR"):
        resolve_draft(load_recipe("eagle3_topk1").with_overrides(model=str(target_dir)))
    with pytest.raises(JobError, match="uses no draft"):
        resolve_draft(load_recipe("vanilla").with_overrides(draft=str(eagle3_dir)))
    recipe = load_recipe("eagle3_tree").with_overrides(model=str(target_dir), draft=str(eagle3_dir))
    assert resolve_draft(recipe) == str(eagle3_dir)


def test_incompatible_draft_is_a_one_line_error(target_dir, tmp_path, tiny_model_factory):
    from typer.testing import CliRunner

    from specbatch.cli import app

    other = tiny_model_factory("qwen2", vocab_size=300)         # a head made for another vocabulary
    bad_head = make_eagle3_head(tmp_path / "bad", other)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "def f(x):"}\n')
    res = CliRunner().invoke(app, ["run", str(src), "--recipe", "eagle3_topk1", "--model", str(target_dir),
                                   "--draft", str(bad_head), "--device", "cpu", "-o", str(tmp_path / "o.jsonl")])
    assert res.exit_code == 2
    msg = res.output.strip().splitlines()
    assert any("vocab_size 300 does not match the target's 320" in line for line in msg)
