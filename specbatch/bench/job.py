"""Whole-job benchmark (`specbatch bench --job`): every recipe runs the same length mix, through the
engine's own job loop (`Engine.generate`, what `specbatch run` drives), and is timed end to end
against the job's floor.

The mix: lognormal prompt and output lengths (median, sigma, clipped to a maximum), or a
`--prompts` file whose rows may carry their own `max_tokens`. Outputs are exactly their
`max_tokens` long (EOS ignored), so every recipe produces the same tokens to produce.

The floor is that of plain decoding at the engine's slot count and KV pool, from the measured machine:
prefill = 2 x non-embedding parameters FLOPs per prompt token at the measured matmul rate;
decode = the larger of its bytes at the measured copy bandwidth (the weights once a step, and
every output token's context of K/V) and its FLOPs (2 x parameters per output token) at the
matmul rate, the steps being at least output tokens / slots, the longest output, and the rows the
sequences hold step by step / the pool's rows. Each recipe's floor is its own engine's (a draft
layer's pages leave a smaller pool). A speculative recipe reads the context once per cycle for
several tokens, so it can pass 100% of this floor; plain decoding cannot.
"""
from __future__ import annotations

import math
import os
import statistics
import time
import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..data import RowError, RowRequest, open_rows
from ..engine import Engine, EngineOptions, resolve_device
from ..recipe import SamplingDefaults, load_recipe
from ..records import emitted_tokens
from ..row_notes import UnreadFields
from .floor import copy_bandwidth, kv_bytes, weight_bytes
from .report import CPU_FLOOR_NOTE
from .sources import (BenchError, BenchOptions, Source, acceptance_label, build_engine, check_options, check_recipes,
                      depth_note, failure_message, free_memory, load_source, recipe_spec, recipes_model,
                      row_token_ids)

Log = Callable[[str], None]


@dataclass
class JobMix:
    requests: int = 1024
    prompt_median: int = 256
    prompt_sigma: float = 0.8
    prompt_max: int = 1536
    output_median: int = 200
    output_sigma: float = 0.6
    output_max: int = 768
    slots: int | None = None          # engine slots (None: the engine's default, from memory)
    shared_prefix: int = 0            # tokens every prompt begins with (an instruction all rows share)
    max_tokens_factor: float = 1.0    # > 1: rows ask for F x their output as max_tokens and end by EOS
    # every row's sampling fields (--sampling; a prompts file's rows keep their own): {} greedy
    sampling: dict[str, Any] = field(default_factory=dict)


# The generated mix's fields (each its --flag) that a --prompts file's rows decide themselves.
_MIX_FIELDS = ("prompt_median", "prompt_sigma", "prompt_max", "output_sigma", "output_max", "shared_prefix",
               "max_tokens_factor")

# What ends a row early, left out of the warm-up's rows (--max-tokens-factor's EOS bias among them).
_ENDINGS = ("stop", "stop_token_ids", "logit_bias")

# Row fields that end a row or set its length: the mix's lengths decide those (EOS ignored).
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "ignore_eos", "stop", "stop_token_ids")


def parse_sampling(text: str) -> dict[str, Any]:
    """--sampling: a JSON object of row sampling fields (a row's names and ranges), validated as a
    row's are -> the overrides every row of the mix gets."""
    from ..data.fields import OVERRIDE_KEYS, BadField, parse_overrides

    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise BenchError(f"--sampling: expected a JSON object of row sampling fields, e.g. "
                         f"'{{\"temperature\": 0.7, \"top_p\": 0.8}}', got {text!r}")
    for key in obj:
        if key in LENGTH_FIELDS:
            raise BenchError(f"--sampling: '{key}' is the mix's to set (--output-median / --output-sigma / "
                             f"--output-max, EOS ignored; --max-tokens-factor)")
        if key not in OVERRIDE_KEYS:
            raise BenchError(f"--sampling: unknown field '{key}' (fields: "
                             f"{', '.join(k for k in OVERRIDE_KEYS if k not in LENGTH_FIELDS)})")
    try:
        return parse_overrides(obj, "--sampling ")
    except BadField as e:
        raise BenchError(str(e)) from None


def lognormal_lengths(n: int, median: int, sigma: float, most: int, gen: torch.Generator) -> list[int]:
    """n lengths exp(N(log median, sigma)) rounded, clipped into [1, most]."""
    x = torch.randn(n, generator=gen, dtype=torch.float64) * sigma + math.log(median)
    return [int(v) for v in x.exp().round().clamp(1, most).tolist()]


class JobRows(list):
    """job_rows' rows, and how many --prompts rows took --output-median for want of a max_tokens."""
    defaulted = 0


def job_rows(mix: JobMix, opts: BenchOptions, src: Source) -> JobRows:
    """The job's rows: token-id prompts (random ids, or held-out text of the demo/model) with
    per-row max_tokens; or a --prompts file."""
    if opts.prompts:
        generated = ["--" + f.replace("_", "-") for f in _MIX_FIELDS if getattr(mix, f) != getattr(JobMix(), f)]
        if generated:
            raise BenchError(f"{', '.join(generated)}: the generated mix's, not --prompts' (rows set their own "
                             "prompts and lengths; --output-median is the max_tokens of rows that set none)")
        rows = JobRows()
        unread = UnreadFields()                # a typo'd field runs without it, as in `run`: said
        for item in open_rows(opts.prompts):
            if isinstance(item, RowError):
                raise BenchError(item.error)
            unread.check(item)
            ids = row_token_ids(opts, src, item)
            # the row's own sampling fields ride along (logprobs, penalties, ...): their cost is measured
            # a row without max_tokens generates --output-median tokens (EOS ignored, as every bench row)
            overrides = {**mix.sampling, **item.overrides,
                         "max_tokens": item.overrides.get("max_tokens", mix.output_median)}
            rows.defaulted += "max_tokens" not in item.overrides
            rows.append(RowRequest(row=len(rows), id=len(rows), prompt_token_ids=ids, overrides=overrides))
            if len(rows) == mix.requests:
                break
        return rows
    if mix.max_tokens_factor > 1 and "logit_bias" in mix.sampling:
        raise BenchError("--sampling logit_bias: --max-tokens-factor sets the rows' logit_bias (EOS at their length)")
    gen = torch.Generator().manual_seed(opts.seed)
    p_lens = lognormal_lengths(mix.requests, mix.prompt_median, mix.prompt_sigma, mix.prompt_max, gen)
    o_lens = lognormal_lengths(mix.requests, mix.output_median, mix.output_sigma, mix.output_max, gen)
    vocab = src.model.cfg.vocab_size
    if src.kind == "random":
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in p_lens]
    else:
        from ..train.heldout import heldout_prefixes

        texts = heldout_prefixes(src.tokenizer, n=mix.requests, prefix_tokens=max(p_lens), seed=1)
        prompts = [src.tokenizer(t["prompt"])["input_ids"][:n] for t, n in zip(texts, p_lens)]
    if mix.shared_prefix:
        head = torch.randint(0, vocab, (mix.shared_prefix,), generator=gen).tolist()
        prompts = [head + p for p in prompts]
    return JobRows(RowRequest(row=i, id=i, prompt_token_ids=p, overrides={**mix.sampling, **_lengths(o, mix, src)})
                   for i, (p, o) in enumerate(zip(prompts, o_lens)))


def _lengths(out: int, mix: JobMix, src: Source) -> dict[str, Any]:
    """A generated row's length fields: max_tokens = its output length, or with a max_tokens factor
    F > 1, F times it, the output still ending at its length: EOS masked before it (min_tokens)
    and the greedy choice there (an EOS logit bias), as a generous max_tokens meets EOS in a run."""
    if mix.max_tokens_factor <= 1:
        return {"max_tokens": out}
    eos = sorted(src.model.cfg.eos_token_ids or ())
    if not eos:
        raise BenchError(f"--max-tokens-factor: the model {src.name} names no EOS token to end rows with")
    return {"max_tokens": math.ceil(mix.max_tokens_factor * out), "min_tokens": out - 1, "ignore_eos": False,
            "logit_bias": {str(eos[0]): 100.0}}


def _output_tokens(row: RowRequest) -> int:
    """The tokens a bench row generates: its max_tokens, or where it ends by EOS (_lengths) one
    past its min_tokens."""
    o = row.overrides
    # all three of _lengths' fields: a --prompts row's own ignore_eos / min_tokens end it nowhere known
    ends_by_eos = o.get("ignore_eos") is False and "min_tokens" in o and "logit_bias" in o
    return o["min_tokens"] + 1 if ends_by_eos else o["max_tokens"]


def distinct_prompt_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens a job must prefill at least once: a token whose prefix another prompt
    already brought (prefix caching at its best) counts once. Sorted, each prompt shares the
    most with its neighbour, so the sum of neighbours' common prefixes is what repeats."""
    ordered = sorted(prompts)
    repeated = sum(len(os.path.commonprefix([a, b])) for a, b in zip(ordered, ordered[1:]))
    return sum(len(p) for p in prompts) - repeated


def unshared_prompt_lengths(prompts: list[list[int]]) -> list[int]:
    """Each prompt's tokens less its longest common prefix with any other prompt (which prefix
    caching may hold once for both): sorted, that prefix is shared with a neighbour."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    shared = [0] * len(prompts)
    for a, b in zip(order, order[1:]):
        common = len(os.path.commonprefix([prompts[a], prompts[b]]))
        shared[a], shared[b] = max(shared[a], common), max(shared[b], common)
    return [len(p) - c for p, c in zip(prompts, shared)]


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (median of `iters`; CPU: n 1024, float32)."""
    if device.type != "cuda":
        n, dtype = 1024, torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


def _weights(model) -> tuple[int, float]:
    """(weight bytes a forward reads, non-embedding parameters (+ lm_head))."""
    w_bytes = weight_bytes(model)
    return w_bytes, w_bytes / model.lm_head.weight.element_size()


def job_floor(src: Source, rows: list[RowRequest], slots: int, bandwidth: float, rate: float,
              pool_rows: int | None = None, lengths: dict[int, list[int]] | None = None) -> dict[str, float]:
    """Seconds the job cannot beat with plain decoding at `slots` sequences in flight (prefill:
    each distinct prompt prefix once).

    Plain decoding emits one token per sequence a step and reads every weight each step, so it
    takes at least max(output tokens / slots, the longest output) steps: a long output is a
    chain of steps that no number of slots shortens (`decode_steps_spread` leaves that term
    out). With `pool_rows` (the KV pool's capacity) a third term: a sequence holds its context
    in the pool at every step it decodes, so the steps are at least the sum over sequences and
    their steps of the rows held, over the pool's rows (on a small GPU this, not the slots,
    bounds how many sequences run at once).

    Prefill FLOPs are 2 x the non-embedding parameters, lm_head included, per distinct prompt
    token (issue 13's definition); the prefill runs lm_head at each prompt's last position only,
    so that term is above the FLOPs actually needed by lm_head's share (~7% at Llama-3.1-8B shapes).

    `lengths`: the tokens each row's choices generated (row -> per choice), where the run knows
    them (a --prompts row ending by its stop strings or EOS), else _output_tokens' reading of its fields."""
    model = src.model

    def decoded(r: RowRequest) -> list[int]:
        """The lengths of a row's sequences: a sampled row's n choices each decode; a greedy row's
        (the bench's default) decode once, the others copies."""
        n = r.overrides.get("n", 1) if (r.overrides.get("temperature") or 0) > 0 else 1
        got = lengths.get(r.row) if lengths else None
        return list(got[:n]) if got else [_output_tokens(r)] * n

    dtype = model.lm_head.weight.dtype
    w_bytes, params = _weights(model)
    prompt = sum(len(r.prompt_token_ids) for r in rows)
    distinct = distinct_prompt_tokens([r.prompt_token_ids for r in rows])
    seqs = [(r, o) for r in rows for o in decoded(r)]
    outputs = [o for _, o in seqs]
    out_tokens = sum(outputs)
    kv_steps = 0
    if pool_rows:
        # the prefill emits a sequence's first token; the step that emits its t-th (t >= 2) holds
        # its prompt and t - 1 tokens. A prompt's prefix another prompt shares (and a row's prompt
        # for its other choices) may be held once, so it counts for none of them: a row's own
        # prompt rows count once, whatever its choices
        own = unshared_prompt_lengths([r.prompt_token_ids for r in rows])
        held = (sum(o * (o - 1) / 2 for _, o in seqs)
                + sum(max(max(decoded(r)) - 1, 0) * u for r, u in zip(rows, own)))
        kv_steps = math.ceil(held / pool_rows)
    spread = max(math.ceil(out_tokens / slots), kv_steps)
    steps = max(spread, math.ceil(max(outputs, default=0)))
    # each output token reads its whole context once: sum over t < o of (p + t)
    ctx_bytes = kv_bytes(model.cfg, dtype, sum(o * len(r.prompt_token_ids) + o * (o - 1) / 2 for r, o in seqs))
    flops_s = 2 * params * out_tokens / rate

    def decode(n_steps: int) -> float:                 # the weights once a step, every context once
        return max((n_steps * w_bytes + ctx_bytes) / bandwidth, flops_s)

    prefill_s = 2 * params * distinct / rate
    decode_s = decode(steps)
    return {"prefill_s": prefill_s, "decode_s": decode_s, "total_s": prefill_s + decode_s,
            "decode_steps": steps, "decode_steps_spread": spread, "decode_steps_kv": kv_steps,
            "total_spread_s": prefill_s + decode(spread),
            "prompt_tokens": prompt, "distinct_prompt_tokens": distinct, "output_tokens": out_tokens}


def run_job_bench(opts: BenchOptions, mix: JobMix, log: Log = print) -> dict[str, Any]:
    device = resolve_device(opts.device)
    if opts.every_size_too and not (opts.graphs and device.type == "cuda"):
        raise BenchError("--every-size-too compares CUDA graph sizes: it needs a CUDA device and no --eager")
    check_options(opts)
    recipes = [load_recipe(r) for r in opts.recipes]
    check_recipes(recipes, log)
    if mix.max_tokens_factor > 1 and opts.simulate_acceptance and any(r.drafter is not None for r in recipes):
        # rows end by the target's EOS; the simulated walk accepts drafts the target did not choose
        raise BenchError("--max-tokens-factor ends rows by the target's EOS, which --simulate-acceptance's "
                         "planted drafts run past (a speculative recipe would generate more tokens than "
                         "vanilla and the floor): drop one of them")
    opts = recipes_model(opts, recipes)
    src = load_source(opts, device)
    specs = [recipe_spec(r, opts, src, device) for r in recipes]     # a missing --draft fails before any run
    rows = job_rows(mix, opts, src)
    longest = max(len(r.prompt_token_ids) + r.overrides["max_tokens"] for r in rows)
    if longest > src.model.cfg.max_position_embeddings:
        raise BenchError(f"the mix reaches {longest} tokens, past the model's max_position_embeddings "
                         f"({src.model.cfg.max_position_embeddings}): lower the maxima")
    log(f"measuring copy bandwidth and matmul rate on {device} ...")
    bandwidth = copy_bandwidth(device)
    rate = matmul_rate(device, src.model.lm_head.weight.dtype)
    free_memory(device)
    meta = {"mode": "job", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "model": src.name, "model_source": src.kind,
            "dtype": str(src.model.lm_head.weight.dtype).removeprefix("torch."),
            "requests": len(rows), "repeats": opts.repeats, "prompt_source": opts.prompts or (
                "random ids" if src.kind == "random" else "held-out Python stdlib text"),
            "mix": {**vars(mix), "prompts": opts.prompts,
                                           "rows_without_max_tokens": rows.defaulted if opts.prompts else None},
            "copy_bandwidth_bytes_per_s": bandwidth,
            "matmul_flops_per_s": rate, "acceptance": acceptance_label(opts.simulate_acceptance),
            "simulated_acceptance": list(opts.simulate_acceptance) if opts.simulate_acceptance else None,
            "graphs": opts.graphs and device.type == "cuda"}
    points = []
    for recipe, (spec, head) in zip(recipes, specs):
        sim = opts.simulate_acceptance if recipe.drafter is not None else None
        eopts = EngineOptions(batch_size=mix.slots or recipe.batch_size, max_model_len=longest, device=str(device),
                              spec=spec, graphs=opts.graphs, profile=True, simulate_acceptance=sim,
                              adaptive=False if opts.fixed_width else None,
                              gpu_memory_utilization=recipe.gpu_memory_utilization)
        log(f"{recipe.name}: building the engine ...")
        try:
            engine = build_engine(eopts, src, head)
            deep = depth_note(sim, engine.drafter.max_depth) if sim else None
            if deep:
                log(f"note: {recipe.name}: {deep}")
            # warm-up: the first rows, short whatever max_tokens they ask (a --prompts row's own wins over defaults)
            # (and decoding: no stop, EOS ignored, no EOS bias ending it at its first token)
            warm = [replace(r, overrides={**{k: v for k, v in r.overrides.items() if k not in _ENDINGS},
                                          "max_tokens": 4, "min_tokens": 0, "n": 1, "ignore_eos": True})
                    for r in rows[:8]]
            list(engine.generate(warm, SamplingDefaults(ignore_eos=True, temperature=0.0, repetition_penalty=1.0)))
            # one engine: input order (--arrival-order-too), as runs do, replaying every size (--every-size-too)
            # and admission reserving every row's max_tokens (--reserve-too)
            runs = ([(False, True, False)] * opts.arrival_order_too + [(True, True, False)] +
                    [(True, False, False)] * opts.every_size_too)
            if engine.graphs is None and opts.every_size_too:
                log(f"{recipe.name}: its drafter runs without CUDA graphs: no every-size run")
                runs = runs[:-1]
            runs += [(True, True, True)] * opts.reserve_too
            for longest_first, timed_sizes, reserve in runs:
                engine.opts.longest_first = longest_first
                engine.opts.reserve_max_tokens = reserve
                if engine.graphs is not None:
                    engine.graphs.route_by_time = timed_sizes
                name = (recipe.name + ("" if longest_first else " (input order)") + ("" if timed_sizes else " (every size)")
                        + (" (reserve max_tokens)" if reserve else ""))
                # repeats: the median run by job tok/s (the lower one of an even count; its figures
                # together), with every run's rate in the order they ran
                tries = [_measure_job(engine, rows, name, src, bandwidth, rate) for _ in range(opts.repeats)]
                median = sorted(tries, key=lambda p: p["job_tokens_per_s"])[(len(tries) - 1) // 2]
                points.append({**median, "algorithm": recipe.algorithm, "plain": name == recipe.name,
                               "runs_job_tokens_per_s": [p["job_tokens_per_s"] for p in tries]})
                _log_point(points[-1], log)
        except Exception as e:                          # noqa: BLE001 - recorded, the next recipe runs
            points.append({"recipe": recipe.name, "failed": True, "error": failure_message(e)})
            log(f"{recipe.name}: FAILED ({points[-1]['error']})")
            engine = None
        del engine
        free_memory(device)
    # the baseline: the first plain-decoding recipe (vanilla, or a recipe file of that algorithm), as run
    base = next((p for p in points if p.get("algorithm") == "vanilla" and p.get("plain") and not p.get("failed")),
                None)
    for p in points:
        if base and not p.get("failed"):
            p["speedup_vs_vanilla"] = p["job_tokens_per_s"] / base["job_tokens_per_s"]
    return {"meta": meta, "points": points}


def _log_point(p: dict[str, Any], log: Log) -> None:
    log(f"{p['recipe']}: {p['job_tokens_per_s']:.0f} tok/s, wall {p['wall_s']:.1f} s (prefill "
        f"{p['prefill_s']:.1f} s in {p['prefill_forwards']} forwards, decode {p['decode_s']:.1f} s, "
        f"{p['cycles']} cycles), {100 * p['floor_fraction']:.0f}% of the floor ({100 * p['floor_spread_fraction']:.0f}% "
        f"of the spread floor: the longest output left out), occupancy "
        f"{p['mean_occupancy']:.0f}/{p['slots']}"
        + (f", {p['prompt_tokens_cached']:,} prompt tokens found in the pool" if p.get("prompt_tokens_cached") else ""))
    log("  prefill calls (s): " + " ".join(f"{t:.2f}" for t in p["prefill_call_s"]))
    dev = p.get("processor", "GPU")
    log(f"  cycles: {dev} {p['cycles_gpu_s']:.1f} s (their own floors {p['cycles_floor_s']:.1f} s, GEMMs and "
        f"attention in sequence {p['cycles_floor_in_sequence_s']:.1f} s); {dev} idle "
        f"~{p['decode_s'] - p['cycles_gpu_s']:.1f} s; {p['prefill_calls']} prefill calls; graph capture in the job "
        f"{p['capture_in_job_s']:.1f} s; {p['alloc_retries']} allocator retries; drain {p['drain_cycles']} cycles under 1/8 full, {p['drain_wall_s']:.1f} s "
        f"(floor {p['drain_floor_s']:.1f} s)"
        + "".join(f"; width {w} replays " + ", ".join(f"{s} as {r}" for s, r in skipped.items())
                  for w, skipped in p.get("graph_sizes_skipped", {}).items() if skipped))


def _measure_job(engine: Engine, rows: list[RowRequest], name: str, src: Source, bandwidth: float,
                 rate: float) -> dict[str, Any]:
    cuda = engine.device.type == "cuda"
    engine.reset_profile()
    engine.reset_prefix_cache()               # the warm-up and an earlier order ran the same prompts
    engine.cycle.policy.reset()               # each run learns its widths' rates as a fresh job does
    capture0 = engine.capture_seconds
    forwards0 = engine.prefill_forwards
    if cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        retries0 = torch.cuda.memory_stats(engine.device).get("num_alloc_retries", 0)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    recs = list(engine.generate(rows, SamplingDefaults(ignore_eos=True, temperature=0.0, repetition_penalty=1.0)))
    if cuda:
        torch.cuda.synchronize(engine.device)
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in recs if r["error"]]
    if errors:
        raise BenchError(f"{len(errors)} rows failed, first: {errors[0]}")
    out = sum(r["completion_tokens"] for r in recs)
    # each row's choices as they ended (a greedy row's n choices are one decode, copied)
    lengths = {r["row"]: [c["completion_tokens"] for c in r["choices"]] if r.get("choices")
               else [r["completion_tokens"]] for r in recs}
    floor = job_floor(src, rows, engine.num_slots, bandwidth, rate, engine.pages.usable * engine.page_size, lengths)
    steps = sum(r["spec"]["verify_steps"] - 1 for r in recs)
    emitted = sum(emitted_tokens(r["spec"]) for r in recs)
    return {
        "recipe": name, "processor": "GPU" if cuda else "CPU", "slots": engine.num_slots, "pages": engine.num_pages, "page_size": engine.page_size,
        "wall_s": wall, "job_tokens_per_s": out / wall, "output_tokens": out,
        "prompt_tokens": floor["prompt_tokens"], "distinct_prompt_tokens": floor["distinct_prompt_tokens"],
        "prefill_s": engine.prefill_s, "prefill_forwards": engine.prefill_forwards - forwards0,
        "decode_s": wall - engine.prefill_s, "cycles": len(engine.cycle_times),
        "mean_occupancy": statistics.fmean(engine.occupancy) if engine.occupancy else 0.0,
        "admissions_waiting_for_pages": engine.waited, "prompt_tokens_cached": engine.cached_tokens,
        "preempted": engine.preempted, "preemptions": engine.preemptions, "recomputed_tokens": engine.recomputed_tokens,
        "accept_length": emitted / max(steps + len(recs), 1) if steps else 1.0,
        "floor_s": floor["total_s"], "floor_output_tokens": floor["output_tokens"], "floor_prefill_s": floor["prefill_s"], "floor_decode_s": floor["decode_s"],
        "floor_decode_steps": floor["decode_steps"], "floor_decode_steps_kv": floor["decode_steps_kv"],
        "floor_spread_s": floor["total_spread_s"],
        "floor_spread_fraction": floor["total_spread_s"] / wall,
        "floor_tokens_per_s": out / floor["total_s"], "floor_fraction": floor["total_s"] / wall,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(engine.device)) if cuda else None,
        # the caching allocator freed its cache and retried a cudaMalloc (a device sync each)
        "alloc_retries": torch.cuda.memory_stats(engine.device).get("num_alloc_retries", 0) - retries0 if cuda else 0,
        "capture_s": engine.capture_seconds, "capture_in_job_s": engine.capture_seconds - capture0,
        "graph_size_timing_s": engine.graphs.timing_seconds if engine.graphs is not None else 0.0,   # part of capture_s
        "prefill_calls": engine.prefill_calls, "prefill_call_s": engine.prefill_call_s,
        "verify_widths": {int(w): n for w, n in sorted(engine.cycle.policy.used.items())},   # width -> cycles
        # width -> {captured size skipped: the larger size its batches replayed, timed faster}
        "graph_sizes_skipped": {int(v[1]): engine.graphs.skipped(v) for v in engine.graphs.replay_ms}
        if engine.graphs is not None and engine.graphs.route_by_time else {},
        **cycle_split(engine, src, bandwidth, rate),
    }


def cycle_split(engine: Engine, src: Source, bandwidth: float, rate: float) -> dict[str, float]:
    """Where decode time went: the cycles' GPU time (stage events), their shares of the wall
    clock (CycleTime.wall_ms), each cycle's own floor (the target's weights + its rows' K/V at the
    bandwidth, or the FLOPs of every token it verifies: rows x width; the draft's own work is not
    counted, so a speculative cycle's floor is a lower bound); the same floor with the GEMMs and
    attention in sequence, as the forward runs them (the larger of weight bytes and FLOPs, then
    the K/V bytes: at a few hundred rows the GEMMs are compute-bound while attention reads K/V,
    and one kernel after the other cannot overlap the two); and the drain's part of each: cycles
    under 1/8 full."""
    times = engine.cycle_times
    model = src.model
    dtype = model.lm_head.weight.dtype
    w_bytes, params = _weights(model)
    w_s = w_bytes / bandwidth
    kv_s = [kv_bytes(model.cfg, dtype, c.context) / bandwidth for c in times]
    flops_s = [2 * params * c.batch * c.width / rate for c in times]
    # the same terms in both sums, so in_sequence >= floors holds in floating point too
    floors = [max(w_s + k, f) for k, f in zip(kv_s, flops_s)]
    in_sequence = [max(w_s, f) + k for k, f in zip(kv_s, flops_s)]
    drain = [i for i, c in enumerate(times) if c.batch * 8 < engine.num_slots]
    wall = sum(c.wall_ms for c in times) / 1e3
    return {"cycles_gpu_s": sum(c.draft_ms + c.verify_ms + c.extend_ms for c in times) / 1e3,
            "cycles_wall_s": wall, "cycles_floor_s": sum(floors), "cycles_floor_in_sequence_s": sum(in_sequence),
            "drain_cycles": len(drain), "drain_wall_s": sum(times[i].wall_ms for i in drain) / 1e3,
            "drain_floor_s": sum(floors[i] for i in drain)}


def _speedup(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _tflops(rate: float) -> str:
    """A GPU's hundreds as whole numbers, a CPU's fraction of one still readable (not "0")."""
    t = rate / 1e12
    return f"{t:,.0f}" if t >= 10 else f"{t:.2g}"


def job_markdown(result: dict[str, Any]) -> str:
    meta, mix = result["meta"], result["meta"]["mix"]
    shared = f"every prompt begins with the same {mix['shared_prefix']} tokens · " if mix.get("shared_prefix") else ""
    factor = mix.get("max_tokens_factor", 1.0)
    ending = f"max_tokens {factor:g}x the output, ending by EOS" if factor > 1 else "EOS ignored"
    sampling = ("sampling " + ", ".join(f"{k} {v}" for k, v in mix["sampling"].items()) + " · "
                if mix.get("sampling") else "greedy · ")
    if mix.get("prompts"):
        unset = mix.get("rows_without_max_tokens") or 0
        lengths = (f"prompts and max_tokens from {mix['prompts']}"
                   + (f" ({unset} row{'s' if unset != 1 else ''} without max_tokens: --output-median "
                      f"{mix['output_median']})" if unset else "")
                   + " (EOS ignored unless a row sets ignore_eos false; its stops apply)")
    else:
        lengths = (f"prompts ({meta.get('prompt_source', 'generated')}) lognormal median {mix['prompt_median']} "
                   f"sigma {mix['prompt_sigma']} max "
                   f"{mix['prompt_max']} · outputs median {mix['output_median']} sigma {mix['output_sigma']} max "
                   f"{mix['output_max']} ({ending})")
    lines = [f"# specbatch bench --job: {meta['model']} on {meta['device']}, {meta['acceptance']}", "",
             f"{meta.get('date', '')} · {meta['dtype']} · {meta['requests']} requests · {lengths} · "
             f"{sampling}{shared}copy {meta['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s · matmul "
             f"{_tflops(meta['matmul_flops_per_s'])} TFLOP/s", ""]
    if meta.get("command"):
        lines += [f"`{meta['command']}`", ""]
    lines += ["| recipe | job tok/s | vs vanilla | wall s | prefill s (forwards) | decode s (cycles) | floor s | "
              "of floor | of spread floor | occupancy | waited / preempted | accept len | verify widths (cycles) | "
              "peak GiB |", "|" + "---|" * 14]
    for p in result["points"]:
        if p.get("failed"):
            lines.append(f"| {p['recipe']} | failed: {p['error']} |" + " |" * 13)
            continue
        mem = f"{p['peak_memory_bytes'] / 2**30:.1f}" if p.get("peak_memory_bytes") else "-"
        widths = " ".join(f"{w}: {n}" for w, n in p.get("verify_widths", {}).items()) or "-"
        runs = p.get("runs_job_tokens_per_s") or []
        spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
        lines.append(f"| {p['recipe']} | {p['job_tokens_per_s']:,.0f}{spread} | "
                     f"{_speedup(p.get('speedup_vs_vanilla'))} | "
                     f"{p['wall_s']:.1f} | {p['prefill_s']:.1f} ({p['prefill_forwards']}) | {p['decode_s']:.1f} ({p['cycles']}) | "
                     f"{p['floor_s']:.1f} | {100 * p['floor_fraction']:.0f}% | {100 * p['floor_spread_fraction']:.0f}% | "
                     f"{p['mean_occupancy']:.0f}/{p['slots']} | {p.get('admissions_waiting_for_pages', 0)} / {p.get('preempted', 0)} | "
                     f"{p['accept_length']:.2f} | {widths} | {mem} |")
    if any(len(p.get("runs_job_tokens_per_s") or []) > 1 for p in result["points"]):
        lines += ["", "Job tok/s: the median of each recipe's runs on its engine (the lower of the middle two for "
                  "an even count; its other figures are that run's), the range of all its runs in brackets; vs "
                  "vanilla compares medians."]
    lines += ["", "Floor: plain decoding of this mix at the engine's slot count and KV pool on this machine "
              "(prefill FLOPs at the matmul rate + decode bytes at the copy bandwidth, or decode FLOPs if "
              "larger; the weights are read once a step, and plain decoding takes at least max(output "
              "tokens / slots, the rows its sequences hold step by step / the pool's rows, the longest "
              "output) steps; the spread floor leaves the last term out). "
              "Occupancy: mean active sequences per cycle / slots. Waited / preempted: requests that "
              "waited in the queue for KV pages / gave theirs back mid-run (resumed by recompute). "
              "Prefill s: device time of the prefill forwards (recomputes included); decode s: the rest "
              "of the wall time. Accept len: tokens emitted per target forward of a row, its prefill "
              "counted as one (as `specbatch run`'s mean accept length; the batch sweep's counts decode "
              "cycles only, so it reads higher for the same drafts)."]
    if meta["device"] == "cpu":
        lines += ["", CPU_FLOOR_NOTE]
    return "\n".join(lines) + "\n"
