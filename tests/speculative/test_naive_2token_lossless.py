"""naive_2token (S=1, k=1, N=2) end to end on the CPU: verify [last token, one draft] per slot,
then the draft catch-up over both rows. Lossless greedy output with both drafters (EAGLE3 head,
MTP layer), an exact MTP draft accepted every cycle, the recipes through the job, the eager
profile, and lossless sampling (statistical). Stops on the draft: test_naive_2token_stops.py; the
cycle as one CUDA graph: tests/gpu/test_naive_2token_gpu.py."""
from __future__ import annotations

import json
import math

import pytest
import torch

from chi_square import chi2, chi2_threshold
from naive_2token_helpers import (VOCAB, check_stats, greedy_table, make_engine, n2_rows,  # noqa: F401
                                  n2_spec, oracle, output_ids, run_engine, vanilla)
from specbatch.data import RowRequest
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- greedy, both drafters -------------------------------------------------------------------

@pytest.mark.parametrize("drafter", ["eagle3", "nextn_mtp"])
def test_greedy_is_lossless(drafter, target_dir, mtp_target_dir, eagle3_dir, vanilla):
    model = target_dir if drafter == "eagle3" else mtp_target_dir
    spec = n2_spec(drafter, eagle3_dir)
    if drafter == "nextn_mtp":
        # the MTP layer in the checkpoint changes nothing about the target itself
        assert output_ids(run_engine(mtp_target_dir, n2_rows(), 4)) == vanilla
    for bs in (1, 3, 8):
        eng = make_engine(model, bs, spec)
        assert eng.drafter.num_draft_tokens == 2 and eng.drafter.max_depth == 1
        assert eng.fused and eng.graphs is None                 # the recipe's choice; CPU: eager
        recs = run_engine(model, n2_rows(), bs, engine=eng)
        assert output_ids(recs) == vanilla, f"{drafter} batch {bs}"
        check_stats(recs)
    assert not make_engine(model, 2, spec, fused=False).fused
    assert not make_engine(target_dir, 2, SpecConfig("eagle3", 1, 1, 2, str(eagle3_dir))).fused


def test_exact_mtp_draft_is_always_accepted(bigram):
    """The MTP layer predicts exactly what the target will: every cycle accepts its draft, so the
    catch-up kept the right row (the bonus after an acceptance, the correction after none)."""
    rows = n2_rows()
    ref = output_ids(run_engine(bigram, rows, 4))
    for bs in (1, 3, 8):
        recs = run_engine(bigram, rows, bs, n2_spec("nextn_mtp"))
        assert output_ids(recs) == ref, f"batch {bs}"
        check_stats(recs)
        for r in recs:
            s = r["spec"]
            assert s["accept_histogram"][0] == 0, (bs, r["row"], s)
            if r["finish_reason"] == "length":
                assert s["verify_steps"] == 1 + math.ceil((r["completion_tokens"] - 1) / 2)
        assert sum(r["spec"]["accepted_tokens"] for r in recs) > 40


@pytest.mark.parametrize("name", ["naive_2token", "naive_2token_mtp"])
def test_recipe_through_the_job(name, target_dir, mtp_target_dir, eagle3_dir, tmp_path):
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    model = target_dir if name == "naive_2token" else mtp_target_dir
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": 12}) + "\n"
                           for r in n2_rows(n=5)))
    outs = {}
    for rname in ("vanilla", name):
        draft = None if rname == "vanilla" else (str(eagle3_dir) if name == "naive_2token" else None)
        recipe = load_recipe(rname).with_overrides(model=str(model), batch_size=3, draft=draft)
        out = tmp_path / f"{rname}.jsonl"
        summary = run_job(str(src), recipe, JobOptions(output=str(out), device="cpu", save_token_ids=True))
        outs[rname] = [json.loads(line) for line in open(out)]
        assert summary["errors"] == 0 and summary["requests"] == 5
    assert recipe.algorithm == "naive_2token" and recipe.num_draft_tokens == 2
    assert recipe.drafter == ("eagle3" if name == "naive_2token" else "nextn_mtp")
    assert summary["draft"] == (str(eagle3_dir) if name == "naive_2token"
                                else "the MTP layer inside the target checkpoint")
    assert summary["recipe"] == name and summary["graphs"] is False
    assert len(summary["acceptance_per_position"]) == 1 and len(summary["accept_histogram"]) == 2
    assert summary["draft_tokens"] == summary["verify_steps"] - summary["requests"] > 0
    assert 1.0 <= summary["mean_accept_length"] <= 2.0
    key = lambda recs: [(r["completion"], r["output_token_ids"]) for r in recs]
    assert key(outs[name]) == key(outs["vanilla"])


def test_profile_eager_reports_three_stages(target_dir, eagle3_dir):
    """Without graphs (CPU) the fused recipe still runs and times the three stages apart."""
    eng = make_engine(target_dir, 4, n2_spec("eagle3", eagle3_dir), profile=True)
    recs = run_engine(target_dir, n2_rows(6), 4, engine=eng)
    cycles = max(r["spec"]["verify_steps"] for r in recs) - 1
    assert len(eng.cycle_times) >= cycles > 0
    assert all(t.draft_ms > 0 and t.verify_ms > 0 and t.extend_ms > 0 for t in eng.cycle_times)
    assert sum(t.tokens for t in eng.cycle_times) == sum(r["completion_tokens"] for r in recs) - len(recs)


# ---- sampling (statistical) ------------------------------------------------------------------

def _exact(model, prompt, T, g1):
    """Exact target probabilities from transformers: p1 [V] of the first token, p2 [V, V] of the
    second given the first, p3 [V, V] of the third given (g1, second)."""
    import transformers as tf

    m = tf.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    V = m.config.vocab_size
    with torch.no_grad():
        p1 = (m(torch.tensor([prompt])).logits[0, -1] / T).softmax(-1)
        p2 = (m(torch.tensor([prompt + [t] for t in range(V)])).logits[:, -1] / T).softmax(-1)
        p3 = (m(torch.tensor([prompt + [g1, t] for t in range(V)])).logits[:, -1] / T).softmax(-1)
    return p1.double(), p2.double(), p3.double()


@pytest.mark.parametrize("mode", ["eagle3", "nextn_mtp", "oracle", "exact_mtp", "exact_mtp_argmax"])
def test_sampling_is_lossless_statistically(mode, target_dir, mtp_target_dir, eagle3_dir, bigram, monkeypatch):
    """Many seeds of one prompt: the first two tokens follow the target's joint distribution,
    and the next two after the most likely first token too (the bonus tokens among them)."""
    T, n = 0.6, 3000
    model = {"eagle3": target_dir, "nextn_mtp": mtp_target_dir, "oracle": target_dir, "exact_mtp": bigram,
             "exact_mtp_argmax": bigram}[mode]
    if mode == "exact_mtp_argmax":            # the draft's argmax, not its race on the target's uniforms
        from specbatch.speculative.layer_drafter import LayerDrafter
        monkeypatch.setattr(LayerDrafter, "sample_as", lambda self, slots, sp: None)
    prompt = n2_rows(n=3)[2].prompt_token_ids       # p(greedy 2 tokens) ~ 0.6 at T = 0.6: drafts accepted
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=prompt, overrides={"seed": i}) for i in range(n)]
    if mode == "oracle":
        table = greedy_table(target_dir, rows[:1], 8)
        kw = dict(drafter=oracle(table))
        g1, g2 = table[tuple(prompt)][:2]
    else:
        kw = dict(spec=n2_spec("eagle3" if mode == "eagle3" else "nextn_mtp", eagle3_dir))
    recs = run_engine(model, rows, 64, temperature=T, max_tokens=3, ignore_eos=True, **kw)
    check_stats(recs)
    toks = torch.tensor(output_ids(recs))                                       # [n, 3]
    first_accepted = torch.tensor([r["spec"]["verify_steps"] == 2 for r in recs])
    if mode != "oracle":
        g1 = int(torch.bincount(toks[:, 0], minlength=VOCAB).argmax())
    p1, p2, p3 = _exact(model, prompt, T, g1)
    accepted = sum(r["spec"]["accepted_tokens"] for r in recs)
    if mode == "oracle":
        # after the greedy first token the draft is the greedy second one: accepted iff emitted
        on = toks[:, 0] == g1
        assert torch.equal(first_accepted[on], toks[on, 1] == g2)
        assert accepted > n // 10
    elif mode == "exact_mtp":
        # the draft draws the target's own distribution on the target's uniforms for that position:
        # the very token the target draws, every time
        assert first_accepted.all() and accepted == n
    elif mode == "exact_mtp_argmax":
        # the draft after any first token t is the target's argmax there: accepted iff emitted
        best = p2.argmax(-1)                 # a bigram: the argmax after t is best[t] wherever t is
        assert torch.equal(first_accepted, toks[:, 1] == best[toks[:, 0]])
        # after a rejection the catch-up kept the correction's row: the next draft is right too
        again = ~first_accepted
        second = torch.tensor([r["spec"]["accepted_tokens"] for r in recs])[again]
        assert torch.equal(second == 1, toks[again, 2] == best[toks[again, 1]])
        assert accepted > n // 10 and int(second.sum()) > 100
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_((toks[:, 0], toks[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    stat, dof = chi2(counts, p1[:, None] * p2 * n)
    assert stat < chi2_threshold(dof), ("first two", stat, dof)
    on = toks[:, 0] == g1
    m = int(on.sum())
    assert m > 200
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_((toks[on, 1], toks[on, 2]), torch.ones(m, dtype=torch.float64), accumulate=True)
    stat, dof = chi2(counts, p2[g1][:, None] * p3 * m)
    assert stat < chi2_threshold(dof), ("second and third after the top first token", stat, dof)
