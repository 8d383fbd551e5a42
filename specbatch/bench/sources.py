"""What every bench runs on: its options, the weights (demo, a model directory, or random at
real shapes), the recipes' drafters over them, the engines and the prompts. Shared by the batch
sweep (sweep.py) and the whole-job mode (job.py)."""
from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..algorithms import get_drafter
from ..data import RowError, RowRequest, open_rows
from ..engine import Engine, EngineOptions
from ..models.config import DecoderConfig
from ..models.eagle3 import Eagle3Head
from ..models.llama import CausalLM
from ..models.loader import load_target, resolve_dtype
from ..models.mtp import MTPLayer
from ..prompts import PromptError, encode_row, load_tokenizer
from ..resolve import resolve_model, spec_config
from ..speculative.factory import SpecConfig
from . import configs

DEFAULT_RECIPES = ("vanilla", "eagle3_topk1", "eagle3_tree")


class BenchError(Exception):
    """A bench that cannot run as asked; the message is one actionable line."""


@dataclass
class BenchOptions:
    recipes: tuple[str, ...] = DEFAULT_RECIPES
    model: str | None = None                 # HF directory; None: the embedded demo model
    draft: str | None = None                 # EAGLE3 head directory (needed with --model)
    random_weights: str | None = None        # builtin config name or config.json path
    batch_sizes: tuple[int, ...] | None = None   # None: GPU_BATCH_SIZES, or CPU_BATCH_SIZES on CPU
    prompt_len: int = 1024                   # generated / held-out prompts (not --prompts files)
    prompts: str | None = None               # .jsonl / .parquet rows instead
    max_tokens: int = 128
    dtype: str = "auto"
    device: str | None = None
    graphs: bool = True
    separate_graphs: bool = False            # fused-graph recipes (naive_2token) also as 3 graphs
    simulate_acceptance: tuple[float, ...] | None = None
    hf: bool = True
    hf_max_batch: int = 64
    max_model_len: int | None = None         # None: longest prompt + max_tokens
    warmup: bool = True                      # a short run on each new engine before measuring
    fixed_width: bool = False                # --job: every cycle verifies the whole proposal (no adaptive width)
    arrival_order_too: bool = False          # --job: each recipe also admits rows in input order
    reserve_too: bool = False                # --job: each recipe also runs reserving every row's max_tokens
    repeats: int = 1                         # --job: each run this many times on its engine (the median reported)
    every_size_too: bool = False             # --job: each recipe also replays the smallest graph size that fits
    seed: int = 0


@dataclass
class Source:
    """The weights every recipe runs on, loaded once."""
    name: str                                # for reports: "demo", a directory, a builtin config
    kind: str                                # "demo" | "model" | "random"
    cfg_dict: dict[str, Any]
    model: CausalLM
    tokenizer: Any
    model_dir: Path | None = None
    head_cfg: dict[str, Any] | None = None   # random weights: the EAGLE3 head's config
    heads: dict[str, Eagle3Head | MTPLayer] = field(default_factory=dict)   # random weights: per
    # algorithm, built on first use, shared by its recipes


class NoTokenizer:
    """Random weights have no vocabulary: completions decode to empty text."""
    eos_token_id = None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def parse_list(text: str, kind: type, flag: str) -> tuple:
    """'1,2,4' -> (1, 2, 4); a bad item is a one-line error naming the flag."""
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise BenchError(f"{flag} {text}: expected comma-separated {kind.__name__}s") from None
    if not values:
        raise BenchError(f"{flag}: no values given")
    return values


def acceptance_label(sim: tuple[float, ...] | None) -> str:
    if sim is None:
        return "measured acceptance"
    return "simulated acceptance " + "/".join(f"{p:g}" for p in sim)


def depth_note(sim: tuple[float, ...] | None, depth: int) -> str | None:
    """A note when --simulate-acceptance names more positions than a recipe's drafts reach."""
    if not sim or len(sim) <= depth:
        return None
    cut = f"P{depth + 1}" + (f"..P{len(sim)}" if len(sim) > depth + 1 else "")
    return f"its drafts go {depth} deep: {cut} of --simulate-acceptance do not apply to it"


def failure_message(e: BaseException) -> str:
    """One line for a point that raised: out-of-memory errors shortened, others as
    `Type: message` (BenchError: just the message)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "out of GPU memory: " + (str(e).strip().splitlines() or [""])[0][:200]
    text = " ".join(str(e).split())
    if isinstance(e, BenchError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def check_options(opts: BenchOptions) -> None:
    if opts.random_weights and (opts.model or opts.draft):
        raise BenchError("--random-weights builds the target and the draft head itself: drop --model/--draft")
    if opts.max_tokens < 2:
        raise BenchError("--max-tokens must be at least 2 (one prefill token, then decode)")
    if opts.prompt_len < 1:
        raise BenchError("--prompt-len must be positive")
    if opts.batch_sizes and min(opts.batch_sizes) < 1:
        raise BenchError("--batch-sizes must be positive")
    sim = opts.simulate_acceptance
    if sim is not None and not all(0.0 <= p <= 1.0 for p in sim):
        raise BenchError(f"--simulate-acceptance {','.join(map(str, sim))}: probabilities must be in [0, 1]")


def check_recipes(recipes: list[Any], log: Callable[[str], None]) -> None:
    """Each recipe once (a second copy was compared with itself, the baseline the last one), and a
    word for a recipe whose `sampling:` block the bench does not apply (its rows run greedy, with the
    mix's lengths; --sampling sets sampling fields for every recipe)."""
    from ..recipe import load_recipe

    names = [r.name for r in recipes]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise BenchError(f"--recipe {twice}: given twice; each recipe runs once (a recipe file of the same "
                         "name needs a name of its own)")
    unset = load_recipe("vanilla").sampling.to_dict()
    for r in recipes:
        own = {k: v for k, v in r.sampling.to_dict().items() if v != unset[k]}
        if own:
            log(f"warning: {r.name}: its sampling ({', '.join(f'{k} {v}' for k, v in own.items())}) is not "
                "applied: bench rows run greedy with the mix's lengths (--sampling sets sampling fields "
                "for every recipe)")


def recipes_model(opts: BenchOptions, recipes: list[Any]) -> BenchOptions:
    """Without --model (or --random-weights), the target is the recipes' own `model:`, and with
    --dtype auto their `dtype:`, as in `specbatch run`; every recipe runs on the one target, so
    they must name the same ones. A --draft none of them drafts with is refused, as `run` refuses it."""
    if opts.draft is not None and all(r.drafter is None for r in recipes):
        raise BenchError(f"--draft {opts.draft}: none of the recipes ({', '.join(r.name for r in recipes)}) "
                         "uses a draft model")
    if opts.dtype == "auto":
        dtypes = dict.fromkeys(r.dtype for r in recipes if r.dtype != "auto")
        if len(dtypes) > 1:
            named = ", ".join(f"{r.name}: {r.dtype}" for r in recipes)
            raise BenchError(f"the recipes name different dtypes ({named}); bench runs every recipe on one "
                             "target: pass --dtype")
        if dtypes:
            opts = replace(opts, dtype=next(iter(dtypes)))
    if opts.model is not None or opts.random_weights:
        return opts
    models = dict.fromkeys(r.model for r in recipes)
    if len(models) > 1:
        named = ", ".join(f"{r.name}: {'the demo model' if r.model == 'default' else r.model}" for r in recipes)
        raise BenchError(f"the recipes name different models ({named}); bench runs every recipe on one "
                         "target: pass --model DIR")
    model = next(iter(models), "default")
    return opts if model == "default" else replace(opts, model=model)


def load_source(opts: BenchOptions, device: torch.device) -> Source:
    if opts.random_weights:
        cfg, name = configs.resolve_config(opts.random_weights)
        dtype = resolve_dtype(opts.dtype, DecoderConfig.from_dict(cfg, name), device)
        model = configs.random_target(cfg, dtype, device, seed=opts.seed)
        return Source(name=name, kind="random", cfg_dict=cfg, model=model, tokenizer=NoTokenizer(),
                      head_cfg=configs.head_config(cfg, name))
    model_dir = resolve_model(opts.model or "default")
    model, raw = load_target(model_dir, opts.dtype, device)
    demo = opts.model is None
    return Source(name="demo" if demo else str(model_dir), kind="demo" if demo else "model", cfg_dict=raw,
                  model=model, tokenizer=load_tokenizer(model_dir), model_dir=model_dir)


def recipe_spec(recipe: Any, opts: BenchOptions, src: Source,
          device: torch.device) -> tuple[SpecConfig, Eagle3Head | MTPLayer | None]:
    """The recipe's SpecConfig and, on random weights, its drafter kind's random-weight module
    (built on first use, shared by the recipes using that kind)."""
    spec = spec_config(recipe, resolve=False)
    kind = None if spec.module is None else get_drafter(spec.module)
    if kind is None or kind.directory is None:          # vanilla: --draft is for the others
        return spec, None
    if src.kind != "random":
        return spec_config(recipe.with_overrides(model=opts.model, draft=opts.draft)), None
    build = kind.random_builder()
    if build is None:
        return spec, None
    head = src.heads.get(spec.module)
    if head is None:
        head = src.heads[spec.module] = build(src.model, src.head_cfg, src.model.lm_head.weight.dtype,
                                              device, seed=opts.seed)
    return spec, head


def build_engine(eopts: EngineOptions, src: Source, head: Eagle3Head | MTPLayer | None) -> Engine:
    try:
        return Engine(src.model_dir, eopts, model=src.model, tokenizer=src.tokenizer, draft_head=head)
    except torch.cuda.OutOfMemoryError:
        raise BenchError(f"out of GPU memory building an engine for batch {eopts.batch_size} and "
                         f"{eopts.max_model_len} positions: lower --batch-sizes or --max-model-len") from None


def row_token_ids(opts: BenchOptions, src: Source, row: RowRequest) -> list[int]:
    """A --prompts row's prompt as token ids (random weights have no tokenizer: token-id rows only)."""
    if src.kind == "random" and row.prompt_token_ids is None:
        raise BenchError(f"{opts.prompts}: random weights have no tokenizer; give prompt_token_ids rows")
    try:
        return encode_row(src.tokenizer, row, src.model.cfg.vocab_size)
    except PromptError as e:
        raise BenchError(str(e)) from None


def bench_prompts(opts: BenchOptions, src: Source, n: int, log: Callable[[str], None] = print) -> list[list[int]]:
    """n prompts (token ids), the same for every recipe and batch size."""
    vocab = src.model.cfg.vocab_size
    if opts.prompts:
        ids = []
        for row in open_rows(opts.prompts):
            if isinstance(row, RowError):
                raise BenchError(row.error)
            ids.append(row_token_ids(opts, src, row))
            if len(ids) == n:
                break
        if not ids:
            raise BenchError(f"{opts.prompts}: no rows")
        if len(ids) < n:
            log(f"note: {opts.prompts} holds {len(ids)} rows, fewer than the largest batch ({n}): its prompts are "
                "reused (prefix caching shares the repeats)")
        return [ids[i % len(ids)] for i in range(n)]
    if src.kind == "random":
        g = torch.Generator().manual_seed(opts.seed)
        return torch.randint(0, vocab, (n, opts.prompt_len), generator=g).tolist()
    from ..train.heldout import heldout_prefixes

    try:
        texts = heldout_prefixes(src.tokenizer, n=n, prefix_tokens=opts.prompt_len, seed=1)
    except ValueError as e:
        raise BenchError(f"held-out prompts: {e} (lower --prompt-len or pass --prompts FILE)") from None
    return [src.tokenizer(t["prompt"])["input_ids"] for t in texts]


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
