"""Data-parallel scaling (issues 16 and 17): the same job through plain `specbatch run`, through
`specbatch run --gpus N` (one engine process per GPU) and through `specbatch.ray` (one actor per
GPU on a local Ray), with the same rows per GPU; and a worker, then a parent, SIGKILLed mid-job,
each followed by the rerun.

    python benchmarks/scale_out.py --gpus 1 --gpus 2 --gpus 8 --ray --kill-test --out runs/scale
    python benchmarks/scale_out.py --device cpu --gpus 1 --gpus 2 --model-dir specbatch/assets/demo/target \
        --rows-per-gpu 12 --kill-test        # the same machinery with CPU workers (a smoke test)

The model: Llama-3.1-8B shapes with random weights (bf16), saved once to --model-dir with the
demo's tokenizer (vocabulary resized to it, so outputs decode), since nothing is downloaded. Rows:
random token-id prompts, lognormal lengths (median 256, sigma 0.8, max 1,536) and max_tokens
(median 200, sigma 0.6, max 768), EOS ignored: the mix of `specbatch bench --job`. Recipe vanilla
(`specbatch run` has no simulated acceptance; a real draft for random weights accepts nothing).
Scaling efficiency = tok/s(N) / (N x tok/s(1)), on the wall clock (process start, model load and
Ray start included) and on generation alone (from every engine loaded to the end: what a long job
sees). With --device cpu the counts are CPU worker
processes (`--workers N`) and --model-dir (default: the demo model) is used as it is. Writes scale_out.json /
scale_out.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "specbatch" / "assets" / "demo" / "target"


def build_model(model_dir: Path, shapes: str) -> None:
    """Random weights at `shapes` (a builtin of the bench) with the demo tokenizer, saved as HF.
    Built in a child process: this one must not hold GPU memory (torch's cache keeps the freed
    weights) while the runs it starts size their KV pools from what is free."""
    if (model_dir / "config.json").exists():
        return
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=_build_model, args=(model_dir, shapes))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise SystemExit(f"building {model_dir} failed (exit {p.exitcode})")


def _build_model(model_dir: Path, shapes: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specbatch.bench.configs import resolve_config

    cfg, _ = resolve_config(shapes)
    demo = json.loads((DEMO / "config.json").read_text())
    cfg = {**cfg, "vocab_size": demo["vocab_size"], "bos_token_id": demo.get("bos_token_id"),
           "eos_token_id": demo.get("eos_token_id"), "max_position_embeddings": 8192}
    cfg.pop("architectures", None)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, model_dir / f)
    del model
    print(f"built {model_dir} in {time.perf_counter() - t0:.0f} s", flush=True)


def write_rows(path: Path, n: int, vocab: int, seed: int = 0, max_output: int = 768) -> None:
    """n rows of `specbatch bench --job`'s mix, drawn as the bench draws them (its lognormal lengths,
    then random ids, from one generator: seed 0 gives the bench's own lengths), outputs clipped at
    max_output."""
    import torch

    from specbatch.bench.job import JobMix, lognormal_lengths

    mix, gen = JobMix(), torch.Generator().manual_seed(seed)
    p_lens = lognormal_lengths(n, mix.prompt_median, mix.prompt_sigma, mix.prompt_max, gen)
    o_lens = lognormal_lengths(n, mix.output_median, mix.output_sigma, min(mix.output_max, max_output), gen)
    with path.open("w") as f:
        for i, (p, o) in enumerate(zip(p_lens, o_lens)):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": torch.randint(0, vocab, (p,), generator=gen).tolist(),
                                "max_tokens": o, "ignore_eos": True}) + "\n")


def parallel_flags(n: int, device: str) -> list[str]:
    """The `specbatch run` flags for n engine processes: --gpus N, or --workers N on the CPU."""
    return ["--gpus", str(n)] if device == "cuda" else ["--workers", str(n), "--device", "cpu"]


def run_command(rows: Path, out: Path, model: Path, *extra: str) -> list[str]:
    """`specbatch run` of the rows with the vanilla recipe, greedy, and `extra` flags."""
    return [sys.executable, "-m", "specbatch", "run", str(rows), "-o", str(out), "--model", str(model),
            "--recipe", "vanilla", "--temperature", "0", *extra]


def run_cli(rows: Path, out: Path, model: Path, extra: list[str], log: Path) -> dict:
    stats = out.with_suffix(".stats.json")
    cmd = run_command(rows, out, model, "--stats-json", str(stats), "-q", *extra)
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}: see {log}")
    s = json.loads(stats.read_text())
    return {"wall_s": wall, "tokens": s["completion_tokens"], "gen_tok_s": s["output_tokens_per_s"],
            "job_tok_s": s["completion_tokens"] / wall}


RAY_DRIVER = """
import json, sys, time
import ray
from specbatch.ray import ProcessorConfig, build_processor
rows, device, model, n, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
if device == "cuda":
    ray.init(num_gpus=n, include_dashboard=False)
else:
    ray.init(num_cpus=n + 1, include_dashboard=False)
ds = ray.data.read_json(rows).map(lambda r: {"id": r["id"], "tokenized_prompt": r["prompt_token_ids"],
    "sampling_params": {"max_tokens": r["max_tokens"], "ignore_eos": True, "temperature": 0.0}})
proc = build_processor(ProcessorConfig(model_source=model, recipe="vanilla", concurrency=n, batch_size=64,
                                       max_concurrent_batches=k, engine_kwargs={"device": device}))
res = proc(ds).select_columns(["id", "num_generated_tokens"]).take_all()
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "end": time.time(), "tokens": sum(r["num_generated_tokens"] for r in res),
                  "rows": len(res)}))
"""

READY = re.compile(r"specbatch: engine ready at (\d\d:\d\d:\d\d\.\d{3})")
FIRST = re.compile(r"specbatch: first rows at (\d\d:\d\d:\d\d\.\d{3})")


def _times(pattern: re.Pattern, text: str) -> list[float]:
    return [datetime.datetime.combine(datetime.date.today(), datetime.time.fromisoformat(t)).timestamp()
            for t in pattern.findall(text)]


def run_ray(rows: Path, model: Path, n: int, device: str, log: Path, in_flight: int) -> dict:
    """The rows through `specbatch.ray` with n actors, `in_flight` batches of 64 per actor. Its
    generation rate runs from the last actor's "engine ready" line (batches are handed out once
    every actor is up) to the end, as `specbatch run`'s runs from every worker loaded."""
    cmd = [sys.executable, "-c", RAY_DRIVER, str(rows), device, str(model), str(n), str(in_flight)]
    print(f"ray: {n} actor(s) on {rows}", flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"the Ray driver exited {p.returncode}: see {log}")
    # Ray may forward the actors' last log lines after the driver's own
    r = json.loads(next(line for line in reversed(p.stdout.splitlines()) if line.startswith('{"wall_s"')))
    out = {"wall_s": time.perf_counter() - t0, "tokens": r["tokens"], "job_tok_s": r["tokens"] / r["wall_s"],
           "rows": r["rows"]}
    ready, first = _times(READY, p.stdout + p.stderr), _times(FIRST, p.stdout + p.stderr)
    if len(ready) >= n:
        out["gen_tok_s"] = r["tokens"] / (r["end"] - max(ready))
    if len(first) >= n and len(ready) >= n:      # Ray's hand-over: engine ready -> its first rows
        out["first_rows_after_ready_s"] = max(first) - max(ready)
    return out


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _is_worker(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"multiprocessing" in cmd and b"resource_tracker" not in cmd


def kill_test(rows: Path, out: Path, model: Path, flags: list[str], log: Path, after_s: float = 2.0,
              victim: str = "worker") -> dict:
    """SIGKILL one engine process (victim "worker": the job goes on, its rows go to the others) or
    the parent ("parent": its workers die with it) `after_s` into generation (after the `started:`
    line, once every engine is loaded); rerun to completion; check every id exactly once."""
    stats = out.with_suffix(".stats.json")
    cmd = run_command(rows, out, model, "--progress-every", "1000", "--stats-json", str(stats), *flags)
    parent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in parent.stderr:
        seen.append(line)
        if line.startswith("started:"):
            break
    time.sleep(after_s)
    workers = [k for k in children(parent.pid) if _is_worker(k)]
    pid = None
    if parent.poll() is None:
        pid = parent.pid if victim == "parent" else (workers[0] if workers else None)
    if pid:
        os.kill(pid, signal.SIGKILL)
    seen.append(parent.stderr.read())
    first_rc = parent.wait()
    again = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text("".join(seen) + "\n--- rerun ---\n" + again.stderr)
    import pyarrow.parquet as pq

    ids = pq.read_table(out, columns=["id"]).column("id").to_pylist()
    want = [json.loads(line)["id"] for line in rows.open()]
    resumed = json.loads(stats.read_text()).get("resumed") if stats.exists() else None
    return {"victim": victim, "killed_pid": pid, "first_rc": first_rc, "rerun_rc": again.returncode,
            "resumed_rows": resumed, "rows": len(ids), "unique": len(set(ids)),
            "missing": len(set(want) - set(ids)), "expected": len(want)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, action="append",
                    help="GPU counts to run (repeatable; default 1 and all); with --device cpu, worker counts")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--rows-per-gpu", type=int, default=1024)
    ap.add_argument("--shapes", default="llama-3.1-8b")
    ap.add_argument("--model-dir", default=None,
                    help="the checkpoint (default: a random-weight 8B built at /tmp/specbatch-random-8b on CUDA, "
                         "the demo model on CPU)")
    ap.add_argument("--ray", action="store_true", help="also through specbatch.ray (needs ray[data])")
    ap.add_argument("--kill-test", action="store_true",
                    help="SIGKILL a worker mid-job, then the parent of another job; rerun each, count rows")
    ap.add_argument("--kill-rows", type=int, default=512, help="rows of each kill test's job")
    ap.add_argument("--ray-in-flight", type=int, default=16,
                    help="batches of 64 rows in flight per Ray actor (2 x 512 slots: 16)")
    ap.add_argument("--max-output", type=int, default=768, help="clip of the output lengths")
    ap.add_argument("--kill-after", type=float, default=2.0, help="seconds into generation of the kill")
    ap.add_argument("--out", default="runs/scale")
    args = ap.parse_args()
    import torch

    count = torch.cuda.device_count() if args.device == "cuda" else 2
    counts = sorted(set(args.gpus or [1, count]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model_dir or ("/tmp/specbatch-random-8b" if args.device == "cuda" else DEMO))
    if args.device == "cuda":
        build_model(model, args.shapes)
    elif not (model / "config.json").exists():
        raise SystemExit(f"--model-dir {model}: no config.json (on CPU a model is not built; give a checkpoint)")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    results = []
    for n in counts:
        rows = out / f"rows-{n}.jsonl"
        write_rows(rows, n * args.rows_per_gpu, vocab, max_output=args.max_output)
        flags = parallel_flags(n, args.device)
        paths = [("parallel", "specbatch run " + " ".join(flags[:2]), flags)]
        if n == 1:
            paths.insert(0, ("one", "specbatch run (one process)", [] if args.device == "cuda" else ["--device", "cpu"]))
        for kind, name, extra in paths:
            dst = out / f"out-{n}-{kind}.parquet"
            r = run_cli(rows, dst, model, extra, out / f"log-{n}-{kind}.txt")
            results.append({"gpus": n, "kind": kind, "path": name, **r})
            print(results[-1], flush=True)
            (out / "scale_out.partial.json").write_text(json.dumps(results, indent=1))
        if args.ray:
            r = run_ray(rows, model, n, args.device, out / f"log-ray-{n}.txt", args.ray_in_flight)
            results.append({"gpus": n, "kind": "ray", "path": "specbatch.ray", **r})
            print(results[-1], flush=True)
            (out / "scale_out.partial.json").write_text(json.dumps(results, indent=1))
    one = {r["kind"]: r for r in results if r["gpus"] == 1}
    lines = ["| GPUs | path | rows | output tokens | wall s | job tok/s (wall) | efficiency (wall) | "
             "generation tok/s | efficiency (generation) | generation vs N x one process |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def eff(r: dict, key: str) -> str:
        base = one.get(r["kind"], {}).get(key)
        return f"{r[key] / (r['gpus'] * base):.3f}" if base and key in r else "-"

    def vs_one(r: dict) -> str:
        base = one.get("one", {}).get("gen_tok_s")
        return f"{r['gen_tok_s'] / (r['gpus'] * base):.3f}" if base and "gen_tok_s" in r else "-"

    for r in results:
        gen = f"{r['gen_tok_s']:,.0f}" if "gen_tok_s" in r else "-"
        lines.append(f"| {r['gpus']} | {r['path']} | {r['gpus'] * args.rows_per_gpu} | {r['tokens']:,} | "
                     f"{r['wall_s']:.1f} | {r['job_tok_s']:,.0f} | {eff(r, 'job_tok_s')} | {gen} | "
                     f"{eff(r, 'gen_tok_s')} | {vs_one(r)} |")
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
              "gpus_available": count, "results": results}
    if args.kill_test:
        n = max(counts)
        rows = out / "rows-kill.jsonl"
        write_rows(rows, args.kill_rows, vocab, seed=1, max_output=args.max_output)
        report["kill_test"] = []
        for victim in ("worker", "parent"):
            report["kill_test"].append(kill_test(rows, out / f"out-kill-{victim}.parquet", model,
                                                 parallel_flags(n, args.device), out / f"log-kill-{victim}.txt",
                                                 args.kill_after, victim))
            lines += ["", f"Kill test ({n} GPU(s)): {report['kill_test'][-1]}"]
            print(lines[-1], flush=True)
    (out / "scale_out.json").write_text(json.dumps(report, indent=1))
    (out / "scale_out.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
