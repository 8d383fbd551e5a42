"""Sampling with min_tokens, logit_bias, the penalties and min-p stays exact under speculation:
the first three tokens of many seeded rows follow the exact law (float64, transformers logits,
vLLM's order of processing), with drafts accepted at depth 1 and 2 of a tree (the third token is
often drawn at a node whose penalty state must count the second) and rejected (residual draws)."""
from __future__ import annotations


import pytest
import torch

from chi_square import chi2, chi2_threshold
from processors_helpers import LikelyTree, hf_logits, law, prompts, rows, run
from specbatch.params import SamplingParams
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")

N = 3000
# Negative penalties and a repetition penalty below 1 make repeats likely, so whether t2 is counted
# when t3 is drawn changes the law a lot (total variation ~0.12); EOS is likely but masked.
PARAMS = {"temperature": 1.0, "top_k": 4, "min_p": 0.02, "frequency_penalty": -1.2, "presence_penalty": -0.5,
          "repetition_penalty": 0.8, "min_tokens": 3, "logit_bias": {0: 6.0}}


def _exact(model_dir, prompt, p, path_counted=True):
    """P(t1, t2, t3) over its support: {(t1, t2, t3): probability}. path_counted=False: the law a
    sampler that forgot t2 when drawing t3 would follow (the test must tell them apart)."""
    l1 = law(hf_logits(model_dir, [prompt])[0], p, [], prompt)
    s1 = l1.nonzero()[:, 0].tolist()
    l2 = dict(zip(s1, (law(x, p, [a], prompt) for a, x in zip(s1, hf_logits(model_dir, [prompt + [a] for a in s1])))))
    pairs = [(a, b) for a in s1 for b in l2[a].nonzero()[:, 0].tolist()]
    l3 = hf_logits(model_dir, [prompt + [a, b] for a, b in pairs])
    out = {}
    for (a, b), x in zip(pairs, l3):
        q = law(x, p, [a, b] if path_counted else [a], prompt)
        for c in q.nonzero()[:, 0].tolist():
            out[a, b, c] = float(l1[a] * l2[a][b] * q[c])
    return out


def _check(recs, exact):
    keys = list(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts = torch.zeros(len(keys))
    for r in recs:
        key = tuple(r["output_token_ids"])
        assert key in index, f"{key}: a sequence of probability zero"
        counts[index[key]] += 1
    stat, dof = chi2(counts, torch.tensor([exact[k] for k in keys]) * len(recs))
    assert stat < chi2_threshold(dof), (stat, dof)


@pytest.mark.parametrize("mode", ["vanilla", "likely-tree", "eagle3-tree"])
def test_processed_sampling_follows_the_exact_law(mode, target_dir, eagle3_dir):
    prompt = prompts()[1]
    p = SamplingParams(**PARAMS).resolved()
    exact = _exact(target_dir, prompt, p)
    assert 0.999 < sum(exact.values()) < 1.001 and len(exact) > 6
    forgot = _exact(target_dir, prompt, p, path_counted=False)
    assert sum(abs(exact.get(k, 0) - forgot.get(k, 0)) for k in {*exact, *forgot}) / 2 > 0.1
    kw = {}
    if mode == "likely-tree":
        # the processed law's top-2 at each level (a draft may propose from it): often right, not always
        kw["drafter"] = LikelyTree(lambda h: law(hf_logits(target_dir, [prompt + h])[0], p, h, prompt), width=2)
    elif mode == "eagle3-tree":
        kw["spec"] = SpecConfig("eagle3", 2, 3, 6, str(eagle3_dir))
    recs = run(target_dir, rows([prompt] * N, [{**PARAMS, "seed": i} for i in range(N)]), 64, max_tokens=3, **kw)
    if mode == "likely-tree":
        deep = sum(r["spec"]["accept_histogram"][2] for r in recs)
        assert sum(r["spec"]["accepted_tokens"] for r in recs) > N // 2 and deep > N // 10, deep
    _check(recs, exact)
