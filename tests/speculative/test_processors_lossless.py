"""min_tokens, logit_bias and the penalties under speculation: greedy output token for token
vanilla's for every recipe (EAGLE3 chain and tree, NextN/MTP, naive_2token with either module,
an oracle draft with long accepted runs, chain and tree), and logprobs equal to vanilla's and to a
float64 reference computed from transformers' logits (float32 engine: allclose)."""
from __future__ import annotations

import pytest
import torch

from oracle import OracleDrafter
from processors_helpers import VOCAB, all_logits, ids, law, prompts, rows, run
from specbatch.params import LOGPROBS_MODES, SamplingParams
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PENALTIES = {"frequency_penalty": 1.2, "presence_penalty": 0.6, "repetition_penalty": 1.4}
SETS = {
    "penalties": PENALTIES,
    "repeat": {"repetition_penalty": 0.5, "frequency_penalty": -1.5},        # pushes towards repeats
    "min_tokens": {"min_tokens": 9, "logit_bias": {0: 8.0}},                  # EOS likely, masked until 9
    "logit_bias": {"logit_bias": {5: 3.0, 17: -100.0, 99: 2.5}},
    "mixed": [PENALTIES, {}, {"min_tokens": 6, "logit_bias": {0: 8.0}, "presence_penalty": -0.5},
              {"logit_bias": {7: 4.0}, "logprobs": 3}, {"repetition_penalty": 0.7, "logprobs": 0},
              {"frequency_penalty": 2.0, "logit_bias": {0: 6.0}, "min_tokens": 3, "logprobs": 5}],
}
LOGPROBS = [{**SETS["mixed"][i % 6], "logprobs": 4} for i in range(6)]


def _rows(params):
    return rows(prompts(), params)


@pytest.fixture(scope="module")
def vanilla(target_dir, mtp_target_dir):
    out = {}
    for name, params in SETS.items():
        out[name] = ids(run(target_dir, _rows(params), 3))
        out["mtp", name] = ids(run(mtp_target_dir, _rows(params), 3))
    out["plain"] = ids(run(target_dir, _rows({}), 3))
    return out


def test_each_parameter_changes_the_output(vanilla):
    for name in SETS:
        assert vanilla[name] != vanilla["plain"], name
    stopped = [o for o in vanilla["min_tokens"]]
    assert all(len(o) >= 9 for o in stopped) and any(o[-1] == 0 and len(o) < 20 for o in stopped)


RECIPES = {
    "eagle3-chain": lambda d: dict(spec=SpecConfig("eagle3", 3, 1, 4, str(d))),
    "eagle3-tree": lambda d: dict(spec=SpecConfig("eagle3", 3, 3, 6, str(d))),
    "eagle3-tree-wide": lambda d: dict(spec=SpecConfig("eagle3", 5, 4, 8, str(d))),
    "naive_2token": lambda d: dict(spec=SpecConfig("naive_2token", 1, 1, 2, str(d), "eagle3")),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_greedy_with_processors_is_vanillas(recipe, target_dir, eagle3_dir, vanilla):
    for name, params in SETS.items():
        got = ids(run(target_dir, _rows(params), 3, **RECIPES[recipe](eagle3_dir)))
        assert got == vanilla[name], (recipe, name)


@pytest.mark.parametrize("spec", [SpecConfig("nextn_mtp", 3, 1, 4), SpecConfig("naive_2token", 1, 1, 2, None, "nextn_mtp")],
                         ids=["nextn_mtp", "naive_2token_mtp"])
def test_greedy_with_processors_is_vanillas_mtp(spec, mtp_target_dir, vanilla):
    for name, params in SETS.items():
        assert ids(run(mtp_target_dir, _rows(params), 3, spec=spec)) == vanilla["mtp", name], name


@pytest.mark.parametrize("decoys", [False, True], ids=["chain", "tree"])
def test_oracle_long_runs_count_the_path(decoys, target_dir, vanilla):
    """The oracle knows each row's penalised greedy continuation: whole cycles are accepted, so
    every node deep in a cycle must see the drafts above it counted (or the runs diverge)."""
    for name, params in SETS.items():
        table = {tuple(p): o for p, o in zip(prompts(), vanilla[name])}
        drafter = OracleDrafter(table, 6, VOCAB, decoys=decoys)
        recs = run(target_dir, _rows(params), 3, drafter=drafter)
        assert ids(recs) == vanilla[name], name
        assert sum(r["spec"]["accepted_tokens"] for r in recs) >= 40, name


def _lp(recs):
    return [[(e["token_id"], e["logprob"], [(t["token_id"], t["logprob"]) for t in e["top_logprobs"]])
             for e in r["logprobs"]] for r in recs]


def _assert_close(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert [t for t, _, _ in ra] == [t for t, _, _ in rb]
        assert torch.allclose(torch.tensor([x for _, x, _ in ra]), torch.tensor([x for _, x, _ in rb]), atol=1e-4)
        for (_, _, ta), (_, _, tb) in zip(ra, rb):
            assert torch.allclose(torch.tensor([x for _, x in ta]), torch.tensor([x for _, x in tb]), atol=1e-4)
            # the top ids agree up to near-ties
            assert [i for i, _ in ta][:1] == [i for i, _ in tb][:1] or abs(ta[0][1] - ta[1][1]) < 1e-4


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_equal_vanilla_and_the_reference(target_dir, eagle3_dir, mode):
    """Greedy rows: the same tokens with and without speculation, so their logprobs compare one
    to one; each against the float64 reference at that point (teacher-forced transformers), in
    each of vLLM's modes."""
    plain = run(target_dir, _rows(LOGPROBS), 3, logprobs_mode=mode)
    for r, p in zip(plain, LOGPROBS):
        assert len(r["logprobs"]) == r["completion_tokens"]
        assert all(len(e["top_logprobs"]) == 4 for e in r["logprobs"])
    for kw in (RECIPES["eagle3-chain"](eagle3_dir), RECIPES["eagle3-tree"](eagle3_dir)):
        _assert_close(_lp(run(target_dir, _rows(LOGPROBS), 3, logprobs_mode=mode, **kw)), _lp(plain))
    table = {tuple(p): r["output_token_ids"] for p, r in zip(prompts(), plain)}
    oracle = run(target_dir, _rows(LOGPROBS), 3, drafter=OracleDrafter(table, 6, VOCAB, decoys=True),
                 logprobs_mode=mode)
    assert sum(r["spec"]["accepted_tokens"] for r in oracle) >= 40
    _assert_close(_lp(oracle), _lp(plain))
    for r, prompt, o in zip(plain, prompts(), LOGPROBS):
        _check_reference(target_dir, r, prompt, SamplingParams(**{**o, "temperature": 0.0}).resolved(), mode)


def _check_reference(model_dir, rec, prompt, p, mode="processed_logprobs"):
    """Each token's value and top list against the reference: log of the float64 law sampled from
    (processed) or log_softmax of the model's logits (raw); *_logits modes differ from those by a
    constant a position, so they are compared relative to the top entry."""
    out = rec["output_token_ids"]
    logits = all_logits(model_dir, prompt + out)
    for i, e in enumerate(rec["logprobs"]):
        at = logits[len(prompt) - 1 + i]
        ref = law(at, p, out[:i], prompt).log() if mode.startswith("processed") else at.double().log_softmax(-1)
        top = ref.topk(len(e["top_logprobs"])).values.clamp(min=-9999.0)
        got = torch.tensor([t["logprob"] for t in e["top_logprobs"]], dtype=torch.float64)
        mine, want = e["logprob"], float(ref[out[i]])
        if mode.endswith("_logits"):
            mine, want, got, top = mine - got[0].item(), want - top[0].item(), got - got[0], top - top[0]
            if mode.startswith("raw"):
                assert abs(e["logprob"] - float(at[out[i]])) < 1e-4      # the logit itself
        assert abs(mine - want) < 1e-4, (i, mine, want)
        assert torch.allclose(got, top, atol=1e-4)


@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_sampled_logprobs_are_the_law_sampled_from(target_dir, eagle3_dir, mode):
    """Sampled rows (drafts accepted and rejected): each token's logprob is log p of the
    processed, tempered, filtered law at its point (processed modes; raw: of the model's own
    distribution), whichever cycle and node produced it."""
    params = [{**PENALTIES, "temperature": 0.8, "top_k": 12, "min_p": 0.02, "logprobs": 3, "seed": i}
              for i in range(6)]
    from processors_helpers import LikelyTree, hf_logits

    for kw in ({}, RECIPES["eagle3-tree"](eagle3_dir)):
        recs = run(target_dir, _rows(params), 3, logprobs_mode=mode, **kw)
        for r, prompt, o in zip(recs, prompts(), params):
            _check_reference(target_dir, r, prompt, SamplingParams(**o).resolved(), mode)
    # A drafter that proposes likely tokens: the in-tree nodes' logprobs are checked too.
    for r_i, prompt in enumerate(prompts()[:2]):
        drafter = LikelyTree(lambda h, prompt=prompt: hf_logits(target_dir, [prompt + h])[0], width=2)
        recs = run(target_dir, _rows(params)[r_i: r_i + 1], 1, drafter=drafter, logprobs_mode=mode)
        assert recs[0]["spec"]["accepted_tokens"] > 0
        _check_reference(target_dir, recs[0], prompt, SamplingParams(**params[r_i]).resolved(), mode)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_removed_tokens_in_a_top_list_are_the_lowest_ids(target_dir, eagle3_dir, mode):
    """A row asking for more top logprobs than its filters keep gets -inf entries: they are the
    lowest removed ids, ascending, whatever the batch or the recipe (topk's choice among equal
    -inf values varies with both)."""
    params = [{"temperature": 0.8, "top_k": 2, "logprobs": 5, "seed": i} for i in range(4)]
    got = []
    for bs, kw in ((4, {}), (1, {}), (3, RECIPES["eagle3-tree"](eagle3_dir))):
        recs = run(target_dir, _rows(params), bs, logprobs_mode=mode, max_tokens=6, **kw)
        got.append([[[t["token_id"] for t in e["top_logprobs"]] for e in r["logprobs"]] for r in recs])
        for r in recs:
            for e in r["logprobs"]:
                kept = [t["token_id"] for t in e["top_logprobs"] if t["logprob"] > -9999.0]
                removed = [t["token_id"] for t in e["top_logprobs"] if t["logprob"] <= -9999.0]     # (-inf, as written)
                assert len(kept) == 2 and removed == [i for i in range(5) if i not in kept][:3], e
    assert got[0] == got[1] == got[2]
