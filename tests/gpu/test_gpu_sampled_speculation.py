"""Seeded sampled rows under speculation on CUDA (graphs, the filtered-draw and walk kernels, adaptive
verify widths): every recipe writes plain sampling's tokens, with the shipped demo bundle."""
from __future__ import annotations

import pytest
import transformers as tf

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.job import DEMO_DIR
from specbatch.recipe import SamplingDefaults, load_recipe
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.gpu

TARGET = DEMO_DIR / "target"
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(top):\n    for", "class Stack:\n    def __init__(self):\n",
           "# sort a list\n", "for i in range(", "def main():\n    args ="]


def _sampled(i: int) -> dict:
    return [dict(temperature=0.8, top_p=0.95, seed=i), dict(temperature=1.0, top_k=20, seed=7 * i),
            dict(temperature=0.6, min_p=0.05, seed=i)][i % 3]


def _run(spec: SpecConfig, adaptive: bool = False) -> tuple[list[list[int]], list[dict]]:
    tok = tf.AutoTokenizer.from_pretrained(str(TARGET))
    eng = Engine(TARGET, EngineOptions(batch_size=4, device="cuda", dtype="float32", max_model_len=256, spec=spec,
                                       adaptive=adaptive))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=tok(p)["input_ids"], overrides=_sampled(i))
            for i, p in enumerate(PROMPTS * 2)]
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=40)), key=lambda r: r["row"])
    return [r["output_token_ids"] for r in recs], recs


@pytest.mark.parametrize("adaptive", [False, True], ids=["full-width", "adaptive"])
@pytest.mark.parametrize("name", ["eagle3_topk1", "eagle3_tree", "nextn_mtp", "naive_2token_mtp"])
def test_cuda_seeded_sampling_under_speculation_is_vanillas(name, adaptive):
    want, _ = _run(SpecConfig())
    r = load_recipe(name)
    draft = DEMO_DIR / ("eagle3" if r.algorithm == "eagle3" else "nextn_mtp")
    got, recs = _run(SpecConfig(r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, str(draft), r.drafter), adaptive)
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(want), (name, same)
    if not adaptive:                 # (adaptive widths may pick plain steps on a model this small)
        # drafts are accepted while sampling: they bring a good share of the tokens
        assert sum(x["spec"]["accepted_tokens"] for x in recs) > 0.25 * sum(len(o) for o in got), name


@pytest.mark.parametrize("name", ["eagle3_topk1", "eagle3_tree"])
def test_cuda_sampled_drafts_race_on_the_targets_uniforms(name, monkeypatch):
    # the draft's race (its logits laid out by target id, the filtered-draw kernel) inside the
    # sampled variant's graphs: accepted more often than the argmax / top-k, the tokens unchanged
    from specbatch.speculative.layer_drafter import LayerDrafter

    r = load_recipe(name)
    spec = SpecConfig(r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, str(DEMO_DIR / "eagle3"), r.drafter)
    want, _ = _run(SpecConfig())
    coupled, recs = _run(spec)
    monkeypatch.setattr(LayerDrafter, "sample_as", lambda self, slots, sp: None)
    argmax, recs_argmax = _run(spec)
    def length(rr):
        return sum(len(x["output_token_ids"]) for x in rr) / sum(x["spec"]["verify_steps"] for x in rr)

    assert coupled == argmax == want
    assert length(recs) > length(recs_argmax) + 0.1, (length(recs), length(recs_argmax))
