"""What the sampling contract costs (issue 15): the same small job at batch 1 and 64 with plain
greedy rows, rows asking for logprobs (top 5), and rows with presence/frequency/repetition
penalties, for vanilla and a speculative recipe, through the whole-job bench's engine and rows.

    python benchmarks/sampling_cost.py --random-weights llama-3.1-8b --out runs/sampling_cost \
        --simulate-acceptance 0.8,0.6,0.45 -r vanilla -r eagle3_topk1

One engine per (recipe, batch); each feature set's job runs twice on it and the second run is
timed, so the graph variants a feature needs (captured on first use) are not in the figure.
Writes sampling_cost.md / .json: job tok/s and the cost against plain rows.

    python benchmarks/sampling_cost.py --features plain,sampled --slots 64,512 -r vanilla -r eagle3_topk1
    ACCEPT=built ADAPTIVE=0 python benchmarks/sampling_cost.py ...   # as sampled rows ran before 2026-11-27:
        # the acceptance built_walk below stands for, at the full verify width (sampled batches did not adapt)
    ADAPTIVE=0 python benchmarks/sampling_cost.py ...                # every cycle at the full width
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
    "sampled": {"temperature": 0.8, "top_p": 0.95},
    "bias": {"logit_bias": {"13": 2.0, "1000": -3.0}, "min_tokens": 8, "stop_token_ids": [2000]},
    # Qwen2.5's generation_config.json (applied by default, as vLLM does), without and with its penalty
    "qwen-sampling": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "qwen-defaults": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
}
SLOTS = {1: 3, 64: 128, 512: 1024}       # slots -> requests (batch 1: a few rows; 64, 512: two rounds)


def built_walk(logits, sp, lens, depths):
    """The acceptance sampled rows had before 2026-11-27, for its cost only (the bench's simulated
    walk decides the outcome): the filtered distribution built at every node, then per tree level
    the children's mass against a uniform, the residual and a draw from it. Returns the argmax."""
    from specbatch.speculative.accept import greedy_targets
    if sp.all_greedy:
        return greedy_targets(logits)
    import torch
    from specbatch.sampling import draw, row_keys, uniforms
    B, N, V = logits.shape
    node_tokens = depths                         # any in-vocabulary tokens: the walk's cost, not its result
    rows = torch.arange(B, device=logits.device)
    parents = depths - 1                         # a chain's (the A/B runs eagle3_topk1)
    kids_of = parents[:, None, :] == torch.arange(N, device=parents.device)[None, :, None]
    argmax = logits.argmax(dim=-1)
    probs = sp.repeat_rows(N).target_probs(logits.float().reshape(B * N, V)).view(B, N, V)
    probs = torch.where((sp.temperature == 0)[:, None, None], torch.nn.functional.one_hot(argmax, V).to(probs.dtype), probs)
    cur = torch.zeros(B, dtype=torch.int64, device=logits.device)
    for d in range(N):                          # a chain's levels (trees: an overcount)
        p, kids = probs[rows, cur], kids_of[rows, cur]
        kid_p = p.gather(1, node_tokens) * kids
        u = uniforms(row_keys(sp.seed_lo, sp.seed_hi, lens + 1 + d, 1), 1)[:, 0]
        hit = kids & (kid_p > 0) & (u[:, None] < kid_p.cumsum(dim=1))
        rejected = torch.zeros_like(p).scatter_add_(1, node_tokens, kids.to(p.dtype)) > 0
        draw(p.masked_fill(rejected, 0.0), sp, lens + 1 + d)
        cur = torch.where(hit.any(dim=1), hit.to(torch.int8).argmax(dim=1), cur)
    return greedy_targets(logits)


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
    ap.add_argument("--features", default=",".join(FEATURES), help="comma-separated: " + ", ".join(FEATURES))
    ap.add_argument("--slots", default="1,64", help="comma-separated, of " + ", ".join(map(str, SLOTS)))
    ap.add_argument("--reps", type=int, default=1, help="timed runs per point (the median is reported)")
    args = ap.parse_args()
    import os
    import torch
    if os.environ.get("ACCEPT") == "built":
        import specbatch.speculative.simulate as simulate
        simulate.target_tokens = built_walk
    features = args.features.split(",")
    slot_sizes = [int(x) for x in args.slots.split(",")]

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
    for feat in features:
        for slots in slot_sizes:
            extra, n = FEATURES[feat], SLOTS[slots]
            path = out / f"rows-{slots}-{feat.split()[0]}.jsonl"
            write_rows(path, n, args.vocab, extra)
            sets[feat, slots] = job_rows(JobMix(requests=n, slots=slots), BenchOptions(prompts=str(path)), src)
    longest = max(len(r.prompt_token_ids) + r.overrides["max_tokens"] for rows in sets.values() for r in rows)
    results = []
    for name in args.recipe or ["vanilla", "eagle3_topk1"]:
        recipe = load_recipe(name)
        spec, head = recipe_spec(recipe, base_opts, src, device)
        for slots in slot_sizes:
            eopts = EngineOptions(batch_size=slots, max_model_len=longest, device=str(device), spec=spec,
                                  profile=True, adaptive=False if os.environ.get("ADAPTIVE") == "0" else None,
                                  simulate_acceptance=sim if recipe.drafter is not None else None)
            engine = build_engine(eopts, src, head)
            for feat in features:
                rows = sets[feat, slots]
                _measure_job(engine, rows, name, src, 1.0, 1.0)              # captures what the rows need
                runs = sorted((_measure_job(engine, rows, name, src, 1.0, 1.0) for _ in range(args.reps)),
                              key=lambda p: p["job_tokens_per_s"])
                p = runs[len(runs) // 2]                                     # the median run
                results.append({"features": feat, "slots": slots, "recipe": name, "tok_s": p["job_tokens_per_s"],
                                "tok_s_runs": [r["job_tokens_per_s"] for r in runs],
                                **{k: p[k] for k in ("prefill_s", "decode_s", "cycles", "capture_in_job_s", "cycles_gpu_s",
                                                     "accept_length", "verify_widths")}})
                print(results[-1], flush=True)
            del engine
            free_memory(device)
    base = {(r["slots"], r["recipe"]): r["tok_s"] for r in results if r["features"] == "plain"}
    lines = ["| batch | recipe | features | job tok/s | vs plain rows | prefill / decode s | cycles | verify widths (cycles) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = base.get((r["slots"], r["recipe"]), math.nan)
        widths = " ".join(f"{w}: {c}" for w, c in r["verify_widths"].items())
        lines.append(f"| {r['slots']} | {r['recipe']} | {r['features']} | {r['tok_s']:,.1f} | "
                     f"{r['tok_s'] / b:.3f}x | {r['prefill_s']:.2f} / {r['decode_s']:.2f} | {r['cycles']} | {widths} |")
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "simulated_acceptance": list(sim), "random_weights": args.random_weights}
    (out / "sampling_cost.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "sampling_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
