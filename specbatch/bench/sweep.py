"""The measurement: each recipe over the same prompts at every batch size of the sweep.

One engine per recipe, sized for the largest batch (graphs are captured once); each point
generates exactly `bs` rows so every slot is busy during decode. Only steady-state cycles (all
`bs` rows active) count towards tokens/s and the step breakdown.

A point that raises (out of memory at one batch size, any error of one recipe) does not end the
sweep: it is recorded as a failed point (`failed`, `error`, no figures) and the next one runs, so
what was measured before it still reaches the reports. Simulated acceptance draws from torch's
default generator, seeded with `seed` before every point: a run is reproducible.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..algorithms import AlgorithmError, get_algorithm
from ..data import RowRequest
from ..engine import CycleTime, Engine, EngineOptions, resolve_device
from ..recipe import SamplingDefaults, load_recipe
from ..stats import RunStats
from .floor import copy_bandwidth, draft_bytes, kv_bytes, step_floor_ms, weight_bytes
from .hf_peer import PEER_NAME, hf_model, hf_tokens_per_s
from .sources import (BenchError, BenchOptions, Source, acceptance_label, bench_prompts,
                      build_engine, check_options, check_recipes, depth_note, device_name, failure_message,
                      free_memory, load_source, recipe_spec, recipes_model)

GPU_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_BATCH_SIZES = (1, 2, 4, 8)
WARMUP_TOKENS = 8

Log = Callable[[str], None]


def run_bench(opts: BenchOptions, log: Log = print) -> dict[str, Any]:
    """Measure every (recipe, batch size); returns {"meta": ..., "points": [...]}."""
    check_options(opts)
    device = resolve_device(opts.device)
    if opts.separate_graphs and not (opts.graphs and device.type == "cuda"):
        raise BenchError("--separate-graphs compares fused and separate CUDA graphs: it needs a CUDA device and "
                         "no --eager")
    sizes = sorted(set(opts.batch_sizes or (GPU_BATCH_SIZES if device.type == "cuda" else CPU_BATCH_SIZES)))
    recipes = [load_recipe(r) for r in opts.recipes]
    check_recipes(recipes, log)
    opts = recipes_model(opts, recipes)
    for r in recipes:
        try:
            get_algorithm(r.algorithm)
        except AlgorithmError as e:
            raise BenchError(f"--recipe {r.name}: {e}") from None
    spec_recipes = [r for r in recipes if r.drafter is not None]
    src = load_source(opts, device)
    label = acceptance_label(opts.simulate_acceptance)
    if src.kind == "random" and spec_recipes and opts.simulate_acceptance is None:
        log("warning: random drafts are never accepted, so the accept length of "
            f"{', '.join(r.name for r in spec_recipes)} will be ~1; pass --simulate-acceptance P1,P2,... "
            "to time them under a chosen acceptance profile")
    prompts = bench_prompts(opts, src, sizes[-1], log)
    max_len = opts.max_model_len or max(map(len, prompts)) + opts.max_tokens
    limit = src.model.cfg.max_position_embeddings
    if max_len > limit:
        raise BenchError(f"prompts of up to {max(map(len, prompts))} tokens + --max-tokens {opts.max_tokens} "
                         f"exceed the model's max_position_embeddings ({limit}): lower --prompt-len or --max-tokens")
    specs = [recipe_spec(r, opts, src, device) for r in recipes]        # a missing --draft fails before any run
    log(f"measuring copy bandwidth on {device} ...")
    bandwidth = copy_bandwidth(device)
    free_memory(device)
    meta = {
        "mode": "sweep", "device": device_name(device), "device_type": device.type,
        "dtype": str(src.model.lm_head.weight.dtype).removeprefix("torch."),
        "model_source": src.kind, "model": src.name,
        "copy_bandwidth_bytes_per_s": bandwidth, "batch_sizes": sizes,
        "prompts": len(prompts), "mean_prompt_tokens": statistics.fmean(map(len, prompts)),
        "prompt_source": opts.prompts or ("random token ids" if src.kind == "random"
                                          else "held-out stdlib prefixes"),
        "max_tokens": opts.max_tokens, "max_model_len": max_len, "graphs": opts.graphs and device.type == "cuda",
        "simulated": opts.simulate_acceptance is not None,
        "simulated_acceptance": list(opts.simulate_acceptance) if opts.simulate_acceptance else None,
        "acceptance": label,
    }
    points: list[dict[str, Any]] = []
    runs = []                     # (recipe, spec, head, name, fused)
    for recipe, (spec, head) in zip(recipes, specs):
        runs.append((recipe, spec, head, recipe.name, None))
        if opts.separate_graphs and spec.fused:
            runs.append((recipe, spec, head, f"{recipe.name} (separate graphs)", False))
    noted: set[str] = set()       # recipes already noted as never reaching a simulated position
    for recipe, spec, head, name, fused in runs:
        sim = opts.simulate_acceptance if recipe.drafter is not None else None
        labels = dict(recipe=name, algorithm=recipe.algorithm, peer=False,
                      acceptance=label if recipe.drafter is not None else "none (vanilla)",
                      simulated_acceptance=list(sim) if sim else None)
        eopts = EngineOptions(batch_size=sizes[-1], max_model_len=max_len, device=str(device),
                              spec=spec, graphs=opts.graphs, fused=fused, profile=True, simulate_acceptance=sim,
                              adaptive=False,        # steady state measures the recipe's whole proposal
                              # on a CPU, launching a cycle computes it: overlapped, each cycle's time
                              # would be paired with the next one's stages (host ms below zero)
                              overlap=device.type == "cuda",
                              gpu_memory_utilization=recipe.gpu_memory_utilization)
        log(f"{name}: building the engine for batch {sizes[-1]} ...")
        engine, error = None, None
        try:
            engine = build_engine(eopts, src, head)
            deep = depth_note(sim, engine.drafter.max_depth) if sim else None
            if deep and name not in noted:
                noted.add(name)
                log(f"note: {name}: {deep}")
            if opts.warmup:
                # First-call costs (allocator, kernel selection); smallest batch: its prefill is cheap.
                warm = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts[:sizes[0]])]
                list(engine.generate(warm, SamplingDefaults(max_tokens=min(WARMUP_TOKENS, opts.max_tokens),
                                                            ignore_eos=True, temperature=0.0, repetition_penalty=1.0)))
        except Exception as e:                          # noqa: BLE001 - recorded, the sweep goes on
            error = ("warm-up: " if engine is not None else "engine: ") + failure_message(e)
            engine = None
        if engine is None:
            free_memory(device)
            for bs in sizes:                             # every point of this recipe fails the same way
                points.append(failed_point(bs, error, **labels))
            log(f"{name}: FAILED ({error}); going on with the next recipe")
            continue
        for bs in sizes:
            try:
                p = _measure(engine, prompts[:bs], opts, sizes[-1], bandwidth)
            except Exception as e:                      # noqa: BLE001 - recorded, the sweep goes on
                p = failed_point(bs, failure_message(e), **labels)
            p.update(labels, fused_graph=engine.fused)
            if p.get("failed"):
                free_memory(device)
                log(f"{name} bs={bs}: FAILED ({p['error']})")
            else:
                if sim:
                    p["simulated_chain_accept_length"] = chain_accept_length(sim, engine.drafter.max_depth)
                log(f"{name} bs={bs}: {p['tokens_per_s']:.1f} tok/s, accept {p['accept_length']:.2f} "
                    f"({label if sim else 'measured'}), step {p['step_ms']:.2f} ms, floor {p['floor_ms']:.2f} ms")
                if sim and name not in noted:
                    note = _unreached_note(sim, p)
                    if note:
                        noted.add(name)
                        log(f"note: {name}: {note}")
            points.append(p)
        del engine
        free_memory(device)
    if opts.hf:
        points += _hf_points(src, prompts, [b for b in sizes if b <= opts.hf_max_batch], opts, log)
    _speedups(points)
    meta["failed_points"] = sum(1 for p in points if p.get("failed"))
    return {"meta": meta, "points": points}


def failed_point(bs: int, error: str, **labels: Any) -> dict[str, Any]:
    """The record of a (recipe, batch size) that could not be measured: its error, no figures."""
    return {"batch_size": bs, **labels, "failed": True, "error": error, "tokens_per_s": None,
            "speedup_vs_vanilla": None}


def _unreached_note(sim: tuple[float, ...], p: dict[str, Any]) -> str | None:
    """A note when no cycle accepted a draft at a position whose simulated probability is > 0
    although the position before was reached: the proposals' trees are likely shallower there."""
    rates = p.get("acceptance_per_position") or []
    for d in range(1, min(len(sim), len(rates))):
        if sim[d] > 0 and rates[d] == 0 and rates[d - 1] > 0:
            return (f"no cycle accepted a draft at position {d + 1} although P{d + 1} = {sim[d]:g}: its "
                    f"trees likely never reach depth {d + 1} (random drafts are near-uniform, so a top-N "
                    f"tree is wide and shallow), so accept length {p['accept_length']:.2f} falls short of "
                    f"{p['simulated_chain_accept_length']:.2f} (1 + P1 + P1P2 + ... over every position)")
    return None


def chain_accept_length(sim: tuple[float, ...], depth: int) -> float:
    """1 + P1 + P1 P2 + ... over `depth` positions (past the profile: 0): the mean emitted tokens
    per cycle the profile gives a proposal reaching that depth. A tree whose deepest node is
    shallower (random-weight trees favour width) gets less: compare with accept_length."""
    total, run = 1.0, 1.0
    for d in range(depth):
        run *= sim[d] if d < len(sim) else 0.0
        total += run
    return total


# ---- one point ---------------------------------------------------------------------------------


def _measure(engine: Engine, prompts: list[list[int]], opts: BenchOptions, max_bs: int,
             bandwidth: float) -> dict[str, Any]:
    bs = len(prompts)
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    defaults = SamplingDefaults(max_tokens=opts.max_tokens, ignore_eos=True, temperature=0.0, repetition_penalty=1.0)   # greedy, whatever the model's generation_config says
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    engine.cycle_times.clear()
    engine.reset_prefix_cache()               # earlier points ran the same prompts
    torch.manual_seed(opts.seed)              # simulated acceptance draws from the default generator
    t0 = time.perf_counter()
    recs = list(engine.generate(rows, defaults))
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in recs if r["error"]]
    if errors:
        raise BenchError(f"batch {bs}: {errors[0]}")
    stats = RunStats()
    for r in recs:
        stats.add(r)
    steady, lens = _steady(engine.cycle_times, bs, statistics.fmean(map(len, prompts)))
    if not steady:
        raise BenchError(f"batch {bs}: no decode cycle ran with every row active (raise --max-tokens)")
    tokens = sum(c.tokens for c in steady)
    decode_cycles = sum(stats.histogram)
    step_ms = statistics.median(c.wall_ms for c in steady)
    w_bytes, kv = _cycle_bytes(engine, bs, statistics.fmean(lens))
    floor_ms = step_floor_ms(w_bytes + kv, bandwidth)
    return {
        "batch_size": bs,
        # Mean tokens per cycle over the median cycle: one host hiccup (a GC pause) in ~100
        # sub-millisecond cycles would otherwise swing a small model's figure by 2x.
        "tokens_per_s": tokens / len(steady) / (step_ms / 1e3),
        "mean_tokens_per_s": tokens / (sum(c.wall_ms for c in steady) / 1e3),
        "e2e_tokens_per_s": stats.completion_tokens / wall,
        "accept_length": 1 + stats.accepted_tokens / decode_cycles if decode_cycles else 1.0,
        "accept_length_with_prefill": stats.accept_length,
        "acceptance_per_position": stats.acceptance_per_position(),
        "steady_cycles": len(steady), "steady_tokens": tokens, "cycles": len(engine.cycle_times),
        "step_ms": step_ms,
        "draft_ms": statistics.median(c.draft_ms for c in steady),
        "verify_ms": statistics.median(c.verify_ms for c in steady),
        "extend_ms": statistics.median(c.extend_ms for c in steady),
        "host_ms": statistics.median(c.wall_ms - c.draft_ms - c.verify_ms - c.extend_ms for c in steady),
        "mean_committed_len": statistics.fmean(lens),
        "weight_bytes_per_step": w_bytes, "kv_bytes_per_step": kv,
        "floor_ms": floor_ms, "floor_fraction": floor_ms / step_ms,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(engine.device)) if cuda else None,
        "capture_s": engine.capture_seconds, "engine_batch": max_bs,
    }


def _steady(cycles: list[CycleTime], bs: int, prompt_len: float) -> tuple[list[CycleTime], list[float]]:
    """Cycles with all `bs` rows active, and the mean committed length each one read.

    Rows start together and only leave, so these are a prefix. A cycle's tokens / batch is the
    rows' mean advance (exact until the last cycles, where stops cut the emitted tokens).
    """
    steady, lens, length = [], [], prompt_len
    for c in cycles:
        if c.batch == bs and c.tokens >= bs:        # every row active emits at least one token
            steady.append(c)
            lens.append(length)
        length += c.tokens / c.batch
    return steady, lens


def _cycle_bytes(engine: Engine, bs: int, mean_len: float) -> tuple[int, float]:
    """(weight bytes, KV bytes) one cycle must read: the target once; the draft module S times
    (S - 1 tree steps + 1 catch-up), each forward over its own cache."""
    model = engine.model
    dtype = model.lm_head.weight.dtype
    w = weight_bytes(model)
    kv = kv_bytes(model.cfg, dtype, mean_len * bs)
    head = getattr(engine.drafter, "head", None)
    if head is not None:
        S = engine.drafter.max_depth
        w += draft_bytes(head, S)
        kv += S * kv_bytes(head.cfg.layer, dtype, mean_len * bs)
    return w, kv


# ---- the peer and the comparisons -----------------------------------------------------------------


def _hf_points(src: Source, prompts: list[list[int]], sizes: list[int], opts: BenchOptions,
               log: Log) -> list[dict[str, Any]]:
    log(f"{PEER_NAME}: batch sizes {', '.join(map(str, sizes)) or 'none'} (--hf-max-batch {opts.hf_max_batch})")
    labels = dict(recipe=PEER_NAME, algorithm="vanilla", peer=True, acceptance="none (vanilla)",
                  simulated_acceptance=None)
    device = src.model.lm_head.weight.device
    try:
        hf = hf_model(src.cfg_dict, src.model)
    except Exception as e:                              # noqa: BLE001 - recorded, the bench goes on
        error = "transformers model: " + failure_message(e)
        free_memory(device)
        log(f"{PEER_NAME}: FAILED ({error})")
        return [failed_point(bs, error, **labels) for bs in sizes]
    points = []
    for bs in sizes:
        p: dict[str, Any] = {**labels, "batch_size": bs}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            p["tokens_per_s"] = hf_tokens_per_s(hf, prompts[:bs], opts.max_tokens)
            if p["tokens_per_s"] is None:
                p["error"] = "timing noise"
        except torch.cuda.OutOfMemoryError:
            p.update(tokens_per_s=None, failed=True, error="out of memory")
            free_memory(device)
        except Exception as e:                          # noqa: BLE001 - recorded, the bench goes on
            p.update(tokens_per_s=None, failed=True, error=failure_message(e))
            free_memory(device)
        if device.type == "cuda":
            p["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated(device))
        points.append(p)
        rate = p["error"] if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.1f} tok/s"
        log(f"{PEER_NAME} bs={bs}: {rate}")
    del hf
    free_memory(device)
    return points


def _speedups(points: list[dict[str, Any]]) -> None:
    """speedup_vs_vanilla: tokens/s over plain decoding's (ours: the first recipe of algorithm
    vanilla, whatever its name) at the same batch size."""
    plain = next((p["recipe"] for p in points if p["algorithm"] == "vanilla" and not p["peer"]), None)
    base = {p["batch_size"]: p for p in points if p["recipe"] == plain and not p["peer"] and not p.get("failed")}
    for p in points:
        ref = base.get(p["batch_size"], {})
        for key, rate in (("speedup_vs_vanilla", "tokens_per_s"), ("e2e_speedup_vs_vanilla", "e2e_tokens_per_s")):
            p[key] = p[rate] / ref[rate] if ref.get(rate) and p.get(rate) is not None else None


