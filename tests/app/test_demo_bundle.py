"""The shipped demo bundle: a trained Llama target and its EAGLE3 head, the recipes' default."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.job import DEMO_DIR, resolve_draft, resolve_model
from specbatch.recipe import SamplingDefaults, load_recipe
from specbatch.speculative.factory import SpecConfig

TARGET, HEAD = DEMO_DIR / "target", DEMO_DIR / "eagle3"
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(top):\n    for", "class Stack:\n    def __init__(self):\n"]


def test_bundle_layout_and_size():
    total = sum(p.stat().st_size for d in (TARGET, HEAD) for p in d.iterdir())
    assert total <= 24 * 2**20
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    head = json.loads((HEAD / "config.json").read_text())
    assert head["architectures"] == ["LlamaForCausalLMEagle3"] and head["draft_vocab_size"] < cfg["vocab_size"]
    assert resolve_model("default") == TARGET
    assert resolve_draft(load_recipe("eagle3_topk1")) == str(HEAD)


@pytest.fixture(scope="module")
def prompts():
    tok = tf.AutoTokenizer.from_pretrained(str(TARGET))
    return [tok(p)["input_ids"] for p in PROMPTS]


def _ours(prompts, spec=SpecConfig(), n=24):
    eng = Engine(TARGET, EngineOptions(batch_size=2, device="cpu", dtype="float32", max_model_len=256, spec=spec))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=n)), key=lambda r: r["row"])
    return [r["output_token_ids"] for r in recs], recs


def test_demo_target_greedy_equals_transformers(prompts):
    model = tf.AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    ref = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                 eos_token_id=0, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    assert _ours(prompts)[0] == ref


def test_demo_head_is_lossless_and_accepted(prompts):
    vanilla = _ours(prompts)[0]
    for name in ("eagle3_topk1", "eagle3_tree"):
        r = load_recipe(name)
        out, recs = _ours(prompts, SpecConfig("eagle3", r.num_steps, r.topk, r.num_draft_tokens, str(HEAD)))
        assert out == vanilla, name
        steps = sum(x["spec"]["verify_steps"] for x in recs)
        assert sum(len(o) for o in out) / steps > 1.5, name       # a trained head gets accepted
