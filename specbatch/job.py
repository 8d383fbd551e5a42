"""A whole batch job: input file -> engine -> resumable output file, with run statistics."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .data import OutputWriter, open_rows
from .engine import Engine, EngineOptions
from .recipe import Recipe
from .spec.factory import AVAILABLE, SpecConfig
from .stats import RunStats

DEMO_DIR = Path(__file__).parent / "assets" / "demo"


class JobError(Exception):
    """A job that must stop with a non-zero exit; the message is one actionable line."""


@dataclass
class JobOptions:
    output: str | None = None            # default: next to the input, <stem>.completions.parquet
    limit: int | None = None             # only the first N input rows
    prompt_column: str = "prompt"
    id_column: str | None = None
    keep_columns: Sequence[str] = ()
    save_token_ids: bool = False
    fail_fast: bool = False
    overwrite: bool = False
    device: str | None = None
    bucket_window: int = 0
    eager: bool = False                  # no CUDA graphs (the reference path)


def resolve_model(name: str) -> Path:
    """A model directory, or `default`: the demo model shipped inside the package."""
    if name == "default":
        path = DEMO_DIR / "target"
        if not (path / "config.json").is_file():
            raise JobError(f"the embedded demo model is missing from {path} (reinstall specbatch)")
        return path
    return Path(name).expanduser()


def resolve_draft(recipe: Recipe) -> str | None:
    """The draft directory a recipe uses; `default` = the one shipped with the demo model. For
    nextn_mtp on another model, None: the MTP layer inside the target's own checkpoint."""
    if recipe.algorithm == "vanilla":
        if recipe.draft is not None:
            raise JobError(f"--draft {recipe.draft}: recipe {recipe.name!r} (vanilla) uses no draft model")
        return None
    if recipe.draft not in (None, "default"):
        return str(Path(recipe.draft).expanduser())
    if recipe.model != "default":
        if recipe.drafter == "nextn_mtp":
            return None
        raise JobError(f"recipe {recipe.name!r} with --model {recipe.model}: pass --draft DIR, a "
                       f"{recipe.drafter} draft for that model (the embedded one fits the demo model only)")
    path = DEMO_DIR / recipe.drafter
    if not (path / "config.json").is_file():
        raise JobError(f"recipe {recipe.name!r}: no embedded {recipe.drafter} draft is bundled in this "
                       f"version ({path}); pass --model DIR --draft DIR")
    return str(path)


def describe_draft(recipe: Recipe, draft: str | None) -> str | None:
    """The draft for summaries: its directory, where the MTP layer is read from, or None."""
    if draft is None and recipe.drafter == "nextn_mtp":
        return "the MTP layer inside the target checkpoint"
    return draft


def spec_config(recipe: Recipe) -> SpecConfig:
    return SpecConfig(algorithm=recipe.algorithm, num_steps=recipe.num_steps, topk=recipe.topk,
                      num_draft_tokens=recipe.num_draft_tokens, draft=resolve_draft(recipe),
                      drafter=recipe.drafter)


def default_output(input_path: str) -> str:
    if input_path == "-":
        return "completions.parquet"
    p = Path(input_path)
    return str(p.with_name(p.name.rsplit(".", 1)[0] + ".completions.parquet"))


def fingerprint(input_path: str, recipe: Recipe, model: Path, draft: str | None,
                opts: JobOptions) -> dict[str, Any]:
    """What must match for a rerun to resume an earlier one's output (batch size, device and
    --limit may change between runs; anything that changes the rows' content may not)."""
    r = recipe.to_dict()
    return {
        "input": input_path if input_path == "-" else os.path.abspath(input_path),
        "recipe": r["name"], "algorithm": r["algorithm"], "num_steps": r["num_steps"],
        "topk": r["topk"], "num_draft_tokens": r["num_draft_tokens"],
        "model": str(model.resolve()), "draft": draft and str(Path(draft).resolve()), "dtype": r["dtype"],
        "max_model_len": r["max_model_len"], "sampling": r["sampling"],
        "prompt_column": opts.prompt_column, "id_column": opts.id_column,
        "keep_columns": list(opts.keep_columns), "save_token_ids": opts.save_token_ids,
    }


Progress = Callable[[str, dict[str, Any]], None]


def run_job(input_path: str, recipe: Recipe, opts: JobOptions | None = None,
            progress: Progress | None = None) -> dict[str, Any]:
    """Run `recipe` over every row of `input_path`; returns the run summary.

    `progress(event, info)` is called with "start" (total, resumed, engine facts) and then
    "record" (the record, the engine's emitted-token count) for every finished row.
    """
    opts = opts or JobOptions()
    notify = progress or (lambda event, info: None)
    if recipe.algorithm not in AVAILABLE:
        raise JobError(f"{recipe.source}: algorithm {recipe.algorithm!r} is not available in this "
                       f"version yet (available: {', '.join(AVAILABLE)})")
    spec = spec_config(recipe)
    model_dir = resolve_model(recipe.model)
    source = open_rows(input_path, prompt_column=opts.prompt_column, id_column=opts.id_column,
                       keep_columns=opts.keep_columns)
    output = opts.output or default_output(input_path)
    writer = OutputWriter(output, fingerprint=fingerprint(input_path, recipe, model_dir, spec.draft, opts),
                          save_token_ids=opts.save_token_ids, keep_columns=opts.keep_columns,
                          overwrite=opts.overwrite)
    stats = RunStats()
    total = source.total
    if total is not None and opts.limit is not None:
        total = min(total, opts.limit)
    if writer.complete:
        if total is None or all(r in writer.done_rows for r in range(total)):
            return stats.summary(output=output, complete_before=True, resumed=len(writer.done_rows))
        writer.reopen()      # finished by an earlier run with a smaller --limit: add the rest

    engine = Engine(model_dir, EngineOptions(
        batch_size=recipe.batch_size, max_model_len=recipe.max_model_len, dtype=recipe.dtype,
        device=opts.device, bucket_window=opts.bucket_window, spec=spec, graphs=not opts.eager))
    rows = iter(source)
    if opts.limit is not None:
        rows = itertools.takewhile(lambda r: r.row < opts.limit, rows)
    done = writer.done_rows
    todo = (r for r in rows if r.row not in done)
    resumed = len(done) if opts.limit is None else sum(1 for r in done if r < opts.limit)
    notify("start", {"total": None if total is None else total - resumed, "resumed": resumed,
                     "device": str(engine.device), "max_model_len": engine.max_len,
                     "model": str(model_dir), "capture_s": engine.capture_seconds})
    try:
        for rec in engine.generate(todo, recipe.sampling):
            if opts.fail_fast and rec["error"]:
                raise JobError(rec["error"])
            if not opts.save_token_ids:
                rec.pop("output_token_ids", None)
            writer.add(rec)
            stats.add(rec)
            notify("record", {"record": rec, "tokens": engine.tokens_emitted})
    except BaseException:
        writer.commit()      # what finished is kept; a rerun resumes after it
        raise
    rows_written = writer.finalize()
    return stats.summary(engine.device, output=output, rows_in_output=rows_written, resumed=resumed,
                         device=str(engine.device), max_model_len=engine.max_len,
                         recipe=recipe.name, model=str(model_dir), draft=describe_draft(recipe, spec.draft),
                         target_forwards=engine.target_forwards,
                         graphs=engine.graphs is not None, capture_s=engine.capture_seconds,
                         tokens_per_target_forward=engine.tokens_emitted / max(engine.target_forwards, 1))
