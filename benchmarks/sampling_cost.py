"""What the sampling contract costs (issue 15): the same whole job at batch 1 and 64 with plain
greedy rows, rows asking for logprobs (top 5), and rows with presence/frequency/repetition
penalties, for vanilla and a speculative recipe, through `specbatch bench --job --prompts`.

    python benchmarks/sampling_cost.py --random-weights llama-3.1-8b --out runs/sampling_cost \
        --simulate-acceptance 0.8,0.6,0.45 -r vanilla -r eagle3_topk1

Writes one prompts file per feature set, one bench run per (feature set, slots), and a table
(sampling_cost.md / .json) of job tok/s and the cost against plain rows.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
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
    recipes = args.recipe or ["vanilla", "eagle3_topk1"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for feat, extra in FEATURES.items():
        for slots, n in SLOTS.items():
            rows = out / f"rows-{slots}-{feat.split()[0]}.jsonl"
            write_rows(rows, n, args.vocab, extra)
            run_dir = out / f"bench-{slots}-{feat.split()[0]}"
            cmd = [sys.executable, "-m", "specbatch", "bench", "--job", "--random-weights", args.random_weights,
                   "--simulate-acceptance", args.simulate_acceptance, "--prompts", str(rows), "--requests", str(n),
                   "--slots", str(slots), "--out", str(run_dir)]
            for r in recipes:
                cmd += ["-r", r]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            data = json.loads((run_dir / "job.json").read_text())
            for p in data["points"]:
                results.append({"features": feat, "slots": slots, "recipe": p["recipe"],
                                "tok_s": None if p.get("failed") else p["job_tokens_per_s"],
                                "error": p.get("error")})
    base = {(r["slots"], r["recipe"]): r["tok_s"] for r in results if r["features"] == "plain"}
    lines = ["| batch | recipe | features | job tok/s | vs plain rows |", "|---|---|---|---|---|"]
    for r in results:
        b = base.get((r["slots"], r["recipe"]))
        rel = f"{r['tok_s'] / b:.3f}x" if r["tok_s"] and b else "-"
        tok = f"{r['tok_s']:,.1f}" if r["tok_s"] else f"failed: {r['error']}"
        lines.append(f"| {r['slots']} | {r['recipe']} | {r['features']} | {tok} | {rel} |")
    (out / "sampling_cost.json").write_text(json.dumps(results, indent=1))
    (out / "sampling_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
