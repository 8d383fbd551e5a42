"""Demo-model quality: target held-out loss, and per-recipe acceptance on held-out code prefixes.

    python benchmarks/quality.py --device cuda --out quality.json

Defaults to the embedded demo model, its EAGLE3 head and its MTP layer. Greedy, 128 new tokens, 64 held-out prefixes of
~128 tokens (seed 1, not the examples' seed). Every speculative run is compared token for token
with vanilla in the same dtype (float32: must match exactly; bfloat16: the match rate is reported).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from pathlib import Path

import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.job import DEMO_DIR
from specbatch.recipe import SamplingDefaults, load_recipe
from specbatch.speculative.factory import SpecConfig
from specbatch.stats import RunStats
from specbatch.train.corpus import iter_corpus
from specbatch.train.heldout import heldout_prefixes

RECIPES = ("eagle3_topk1", "eagle3_deep", "eagle3_tree", "nextn_mtp", "nextn_mtp_1", "naive_2token",
           "naive_2token_mtp")


def heldout_loss(model_dir: Path, device: str, seq_len: int = 512) -> dict:
    """Mean next-token loss over the held-out stdlib files (EOS-joined, non-overlapping windows)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    for _, text in iter_corpus("heldout"):
        ids += tok(text)["input_ids"] + [tok.eos_token_id]
    model = tf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    n = (len(ids) - 1) // seq_len
    x = torch.tensor(ids[: n * seq_len + 1], device=device)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 32):
            rows = torch.arange(i, min(n, i + 32), device=device)
            idx = rows[:, None] * seq_len + torch.arange(seq_len + 1, device=device)
            w = x[idx]
            logits = model(w[:, :-1]).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
    loss = total / (n * seq_len)
    return {"heldout_tokens": n * seq_len, "loss": loss, "perplexity": math.exp(loss)}


def run(model_dir: Path, prompts: list[list[int]], spec: SpecConfig, dtype: str, device: str,
        batch_size: int, max_tokens: int) -> dict:
    eng = Engine(model_dir, EngineOptions(batch_size=batch_size, device=device, dtype=dtype, spec=spec))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=max_tokens)), key=lambda r: r["row"])
    wall = time.perf_counter() - t0
    stats = RunStats()
    for r in recs:
        stats.add(r)
    return {
        "outputs": [r["output_token_ids"] for r in recs],
        "completion_tokens": stats.completion_tokens,
        "mean_accept_length": stats.accept_length,
        "accept_histogram": stats.histogram,
        "acceptance_per_position": stats.acceptance_per_position(),
        "eager_tokens_per_s": stats.completion_tokens / wall,
    }


def match(a: list[list[int]], b: list[list[int]]) -> dict:
    same_rows = sum(x == y for x, y in zip(a, b))
    agree = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))) for x, y in zip(a, b))
    return {"identical_requests": f"{same_rows}/{len(a)}",
            "token_match_rate": agree / max(1, sum(len(x) for x in a))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEMO_DIR / "target"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "eagle3"), help="EAGLE3 head directory")
    ap.add_argument("--mtp-draft", default=str(DEMO_DIR / "nextn_mtp"), help="exported MTP layer directory")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="quality.json")
    a = ap.parse_args()
    model = Path(a.model)
    tok_prompts = heldout_prefixes(str(model), n=a.n, prefix_tokens=a.prefix_tokens, seed=1)
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(model))
    prompts = [tok(p["prompt"])["input_ids"] for p in tok_prompts]
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu",
        "command": "python benchmarks/quality.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()),
        "prompts": len(prompts), "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "target": heldout_loss(model, a.device),
        "runs": {},
    }
    for dtype in a.dtypes.split(","):
        base = run(model, prompts, SpecConfig(), dtype, a.device, a.batch_size, a.max_tokens)
        report["runs"][f"vanilla/{dtype}"] = {k: v for k, v in base.items() if k != "outputs"}
        for name in a.recipes.split(","):
            r = load_recipe(name)
            draft = a.mtp_draft if r.drafter == "nextn_mtp" else a.draft
            spec = SpecConfig(r.algorithm, r.num_steps, r.topk, r.num_draft_tokens, draft, drafter=r.drafter)
            res = run(model, prompts, spec, dtype, a.device, a.batch_size, a.max_tokens)
            res.update(match(base["outputs"], res.pop("outputs")))
            report["runs"][f"{name}/{dtype}"] = res
            print(f"{name:14s} {dtype:9s} accept {res['mean_accept_length']:.3f} "
                  f"per-position {[round(x, 3) for x in res['acceptance_per_position']]} "
                  f"match {res['identical_requests']} ({res['token_match_rate']:.4f})", flush=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["target"]))


if __name__ == "__main__":
    main()
