"""What the sampling contract costs (issue 15): the same small job at batch 1 and 64 with plain
greedy rows, rows asking for logprobs (top 5), and rows with presence/frequency/repetition
penalties, for vanilla and a speculative recipe, through the whole-job bench's engine and rows.

    python benchmarks/sampling_cost.py --random-weights llama-3.1-8b --out runs/sampling_cost \
        --simulate-acceptance 0.8,0.6,0.45 -r vanilla -r eagle3_topk1

One engine per (recipe, batch); each feature set's job runs twice on it and the second run is
timed, so the graph variants a feature needs (captured on first use) are not in the figure.
Writes sampling_cost.md / .json: job tok/s and the cost against plain rows.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

FEATURES = {
    "plain": {},
    "logprobs top 5": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
}
SLOTS = {1: 3, 64: 128}       # slots -> requests (batch 1: a few rows; 64: two rounds)


def write_rows(path: Path, n: int, vocab: int, extra: dict, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            p = int(min(1024, max(16, math.exp(rng.gauss(math.log(256), 0.5)))))
            o = int(min(256, max(16, math.exp(rng.gauss(math.log(128), 0.4)))))
            row = {"id": i, "prompt_token_ids": [rng.randrange(vocab) for _ in range(p)], "max_tokens": o, **extra}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-weights", default="llama-3.1-8b")
    ap.add_argument("--simulate-acceptance", default="0.8,0.6,0.45")
    ap.add_argument("-r", "--recipe", action="append", default=None)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", default="runs/sampling_cost")
    args = ap.parse_args()
    import torch

    from specbatch.bench.job import JobMix, _measure_job, job_rows
    from specbatch.bench.sources import BenchOptions, build_engine, free_memory, load_source, recipe_spec
    from specbatch.engine import EngineOptions, resolve_device
    from specbatch.recipe import load_recipe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = tuple(float(x) for x in args.simulate_acceptance.split(","))
    base_opts = BenchOptions(random_weights=args.random_weights, simulate_acceptance=sim)
    device = resolve_device(None)
    src = load_source(base_opts, device)
    sets = {}
    for feat, extra in FEATURES.items():
        for slots, n in SLOTS.items():
            path = out / f"rows-{slots}-{feat.split()[0]}.jsonl"
            write_rows(path, n, args.vocab, extra)
            sets[feat, slots] = job_rows(JobMix(requests=n, slots=slots), BenchOptions(prompts=str(path)), src)
    longest = max(len(r.prompt_token_ids) + r.overrides["max_tokens"] for rows in sets.values() for r in rows)
    results = []
    for name in args.recipe or ["vanilla", "eagle3_topk1"]:
        recipe = load_recipe(name)
        spec, head = recipe_spec(recipe, base_opts, src, device)
        for slots in SLOTS:
            eopts = EngineOptions(batch_size=slots, max_model_len=longest, device=str(device), spec=spec,
                                  profile=True, simulate_acceptance=sim if recipe.drafter is not None else None)
            engine = build_engine(eopts, src, head)
            for feat in FEATURES:
                rows = sets[feat, slots]
                _measure_job(engine, rows, name, src, 1.0, 1.0)              # captures what the rows need
                p = _measure_job(engine, rows, name, src, 1.0, 1.0)
                results.append({"features": feat, "slots": slots, "recipe": name, "tok_s": p["job_tokens_per_s"],
                                "verify_widths": p["verify_widths"]})
                print(results[-1], flush=True)
            del engine
            free_memory(device)
    base = {(r["slots"], r["recipe"]): r["tok_s"] for r in results if r["features"] == "plain"}
    lines = ["| batch | recipe | features | job tok/s | vs plain rows | verify widths (cycles) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        b = base.get((r["slots"], r["recipe"]))
        widths = " ".join(f"{w}: {c}" for w, c in r["verify_widths"].items())
        lines.append(f"| {r['slots']} | {r['recipe']} | {r['features']} | {r['tok_s']:,.1f} | "
                     f"{r['tok_s'] / b:.3f}x | {widths} |")
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "simulated_acceptance": list(sim), "random_weights": args.random_weights}
    (out / "sampling_cost.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "sampling_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
