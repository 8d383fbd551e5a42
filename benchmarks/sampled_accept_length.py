"""Accept length of the demo bundle's drafts on seeded sampled rows (CPU, float32): drafts of the
argmax / top-k against drafts of the race winner on the target's uniforms (layer_drafter.py: a
chain's draft, a tree's first child), for eagle3_topk1, nextn_mtp, naive_2token_mtp and eagle3_tree
at three sampling settings; 16 rows x 64 tokens, batch 8. Also checks every run writes vanilla's
tokens.

    python benchmarks/sampled_accept_length.py [recipe ...]
"""
import sys
import torch, transformers as tf
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.job import DEMO_DIR
from specbatch.recipe import SamplingDefaults, load_recipe
from specbatch.speculative.factory import SpecConfig
import specbatch.speculative.layer_drafter as ld
torch.set_num_threads(1)
TARGET = DEMO_DIR / "target"
tok = tf.AutoTokenizer.from_pretrained(str(TARGET))
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef walk(top):\n    for", "class Stack:\n    def __init__(self):\n",
           "# sort a list\n", "for i in range(", "def main():\n    args =", "import numpy as np\n", "while True:\n"]
def run(name, fields, coupled):
    orig = ld.LayerDrafter.sample_as
    if not coupled:
        ld.LayerDrafter.sample_as = lambda self, slots, sp: None
    try:
        if name == "vanilla":
            spec = SpecConfig()
        else:
            r = load_recipe(name)
            draft = DEMO_DIR / ("eagle3" if r.algorithm == "eagle3" else "nextn_mtp")
            spec = SpecConfig(r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, str(draft), r.drafter)
        eng = Engine(TARGET, EngineOptions(batch_size=8, device="cpu", dtype="float32", max_model_len=256, spec=spec))
        rows = [RowRequest(row=i, id=str(i), prompt_token_ids=tok(p)["input_ids"], overrides=dict(fields, seed=i))
                for i, p in enumerate(PROMPTS * 2)]
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=64)), key=lambda r: r["row"])
    finally:
        ld.LayerDrafter.sample_as = orig
    out = [r["output_token_ids"] for r in recs]
    if name == "vanilla":
        return out, 0
    steps = sum(r["spec"]["verify_steps"] for r in recs)
    return out, sum(len(o) for o in out) / steps
for fields in (dict(temperature=0.8, top_p=0.95), dict(temperature=1.0), dict(temperature=0.6, top_k=20)):
    van, _ = run("vanilla", fields, True)
    for name in sys.argv[1:] or ("eagle3_topk1", "nextn_mtp", "naive_2token_mtp", "eagle3_tree"):
        a, la = run(name, fields, False)
        b, lb = run(name, fields, True)
        print(fields, name, f"accept length argmax {la:.3f} coupled {lb:.3f}", "same as vanilla:", a == van, b == van, flush=True)
