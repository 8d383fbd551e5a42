"""The `specbatch` command: thin wrappers over recipe loading and `run_job`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation with speculative decoding.")
err = Console(stderr=True)
out = Console()

EXIT_FAILED = 1     # --fail-fast stopped on a bad row
EXIT_USAGE = 2      # unknown recipe, unusable model, unreadable input, output conflict


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command()
def run(
    input: str = typer.Argument(..., help="Input rows: a .jsonl or .parquet file, or - for JSONL on stdin."),
    recipe: str = typer.Option("vanilla", "--recipe", "-r", help="Builtin recipe name or a recipe .yaml path."),
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the recipe's model)."),
    draft: Optional[str] = typer.Option(None, help="Draft directory: an EAGLE3 head, or an exported MTP layer (nextn_mtp reads the one inside --model without it)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output .parquet or .jsonl (default: <input>.completions.parquet)."),
    batch_size: Optional[int] = typer.Option(None, help="Scheduler slots (sequences decoded together)."),
    max_tokens: Optional[int] = typer.Option(None, help="Default completion length limit."),
    temperature: Optional[float] = typer.Option(None, help="Default temperature (0 = greedy)."),
    top_p: Optional[float] = typer.Option(None, help="Default nucleus sampling mass."),
    top_k: Optional[int] = typer.Option(None, help="Default top-k (0 = off)."),
    seed: Optional[int] = typer.Option(None, help="Run seed; rows without a seed derive theirs from it and their row number."),
    stop: Optional[list[str]] = typer.Option(None, help="Default stop string (repeatable)."),
    ignore_eos: Optional[bool] = typer.Option(None, "--ignore-eos", help="Do not stop at EOS (benchmarks)."),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 | float16."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    max_model_len: Optional[int] = typer.Option(None, help="Context per slot, prompt + completion (default: model and memory limit)."),
    limit: Optional[int] = typer.Option(None, help="Only the first N input rows."),
    prompt_column: str = typer.Option("prompt", help="Column holding the text prompt."),
    id_column: Optional[str] = typer.Option(None, help="Column holding the row id (default: id, then custom_id, then the row number)."),
    keep_columns: Optional[str] = typer.Option(None, help="Comma-separated input columns copied to the output."),
    save_token_ids: bool = typer.Option(False, "--save-token-ids", help="Add output_token_ids to each output row."),
    bucket: int = typer.Option(0, help="Length-bucketing window: admit similar prompt lengths together (0 = FIFO)."),
    eager: bool = typer.Option(False, "--eager", help="No CUDA graphs: run every cycle eagerly (the reference path)."),
    stats_json: Optional[str] = typer.Option(None, help="Also write the run summary as JSON to this path."),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop at the first bad row (exit 1) after committing finished rows."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard an existing output or unfinished parts instead of resuming."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Generate a completion for every row of INPUT. Rerunning the same command resumes."""
    from .data import InputError, OutputError
    from .job import JobError, JobOptions, run_job
    from .models.config import ModelError
    from .recipe import RecipeError, load_recipe

    try:
        rec = load_recipe(recipe).with_overrides(
            model=model, draft=draft, batch_size=batch_size, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            stop=list(stop) if stop else None, ignore_eos=ignore_eos, dtype=dtype,
            max_model_len=max_model_len)
    except RecipeError as e:
        _fail(str(e))
    opts = JobOptions(
        output=output, limit=limit, prompt_column=prompt_column, id_column=id_column,
        keep_columns=[c.strip() for c in keep_columns.split(",") if c.strip()] if keep_columns else (),
        save_token_ids=save_token_ids, fail_fast=fail_fast, overwrite=overwrite, device=device,
        bucket_window=bucket, eager=eager)
    view = _ProgressView(enabled=not quiet)
    try:
        with view:
            summary = run_job(input, rec, opts, progress=view.update)
    except JobError as e:
        _fail(str(e), EXIT_FAILED if fail_fast else EXIT_USAGE)
    except (InputError, OutputError, ModelError, RecipeError, ValueError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted; finished rows are committed, rerun the same command to resume", 130)
    _print_summary(summary)
    if stats_json:
        Path(stats_json).write_text(json.dumps(summary, indent=2) + "\n")


@app.command()
def recipes(name: Optional[str] = typer.Argument(None, help="Print this recipe in full.")) -> None:
    """List the builtin recipes, or print one."""
    import yaml

    from .recipe import RecipeError, builtin_recipes, load_recipe

    if name:
        try:
            r = load_recipe(name)
        except RecipeError as e:
            _fail(str(e))
        typer.echo(f"# {r.source}\n" + yaml.safe_dump(r.to_dict(), sort_keys=False, width=1000).rstrip())
        return
    table = Table("recipe", "algorithm", "S", "k", "N", "model", "description")
    for n in builtin_recipes():
        r = load_recipe(n)
        table.add_row(n, r.algorithm, *(str(v) if v is not None else "-" for v in (r.num_steps, r.topk, r.num_draft_tokens)),
                      escape(r.model), escape(r.description))
    out.print(table)


@app.command()
def inspect(
    recipe: str = typer.Option("vanilla", "--recipe", "-r", help="Recipe whose model to show."),
    model: Optional[str] = typer.Option(None, help="Model directory (overrides the recipe's)."),
    draft: Optional[str] = typer.Option(None, help="Draft directory: an EAGLE3 head or an exported MTP layer (overrides the recipe's)."),
) -> None:
    """Show which model and draft a recipe resolves to, and the model's shape."""
    from .job import JobError, describe_draft, resolve_draft, resolve_model
    from .models.config import ModelError, load_config
    from .recipe import RecipeError, load_recipe

    try:
        r = load_recipe(recipe).with_overrides(model=model, draft=draft)
        path = resolve_model(r.model)
        cfg, _ = load_config(path)
        draft = resolve_draft(r)
    except (RecipeError, JobError, ModelError) as e:
        _fail(str(e))
    params = (cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
              + cfg.num_layers * (cfg.hidden_size * cfg.head_dim * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
                                  + 3 * cfg.hidden_size * cfg.intermediate_size))
    table = Table(show_header=False)
    table.add_column("key")
    table.add_column("value", overflow="fold")          # paths shown whole, wrapped
    for k, v in [("recipe", f"{r.name} ({r.source})"), ("algorithm", r.algorithm), ("model", str(path)),
                 ("architecture", cfg.architecture), ("layers", cfg.num_layers),
                 ("hidden / heads / kv heads / head dim", f"{cfg.hidden_size} / {cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
                 ("vocab", cfg.vocab_size), ("parameters (approx.)", f"{params / 1e6:.1f} M"),
                 ("checkpoint dtype", cfg.torch_dtype), ("max positions", cfg.max_position_embeddings),
                 ("draft", describe_draft(r, draft) or "-")]:
        table.add_row(k, escape(str(v)))
    out.print(table)


@app.command()
def bench(
    recipe: Optional[list[str]] = typer.Option(None, "--recipe", "-r", help="Recipe to measure (repeatable; default: vanilla, eagle3_topk1, eagle3_tree)."),
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the embedded demo model)."),
    draft: Optional[str] = typer.Option(None, help="Draft directory (EAGLE3: required with --model; nextn_mtp: default the MTP inside the target; default: the demo model's)."),
    random_weights: Optional[str] = typer.Option(None, help="Random weights at real shapes: llama-3.1-8b, or a config.json path (no download)."),
    batch_sizes: Optional[str] = typer.Option(None, help="Comma-separated batch sizes (default 1,2,...,256 on GPU; 1,2,4,8 on CPU)."),
    prompt_len: int = typer.Option(1024, help="Prompt tokens (random ids, or held-out prefixes of about this length)."),
    prompts: Optional[str] = typer.Option(None, help="Prompts from a .jsonl / .parquet file instead."),
    max_tokens: int = typer.Option(128, help="Tokens generated per request (greedy, EOS ignored)."),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    eager: bool = typer.Option(False, "--eager", help="No CUDA graphs."),
    simulate_acceptance: Optional[str] = typer.Option(None, help="Per-position acceptance probabilities P1,P2,... for the drafts (random weights: step times at a chosen acceptance); every output is labelled simulated."),
    separate_graphs: bool = typer.Option(False, "--separate-graphs", help="Also run naive_2token recipes with verify and extend as separate graphs (to time the fusion)."),
    no_hf: bool = typer.Option(False, "--no-hf", help="Skip the transformers generate peer."),
    hf_max_batch: int = typer.Option(64, help="Largest batch size the transformers peer runs."),
    out_dir: str = typer.Option("bench", "--out", help="Directory for bench.json, bench.md, bench.png."),
    max_model_len: Optional[int] = typer.Option(None, help="Context per slot (default: longest prompt + --max-tokens)."),
) -> None:
    """Measure recipes over the same prompts at a sweep of batch sizes, against the memory-bandwidth floor."""
    import shlex
    import sys

    from .bench.report import environment, table, title, write_all
    from .bench.sweep import DEFAULT_RECIPES, BenchError, BenchOptions, parse_list, run_bench
    from .data import InputError
    from .job import JobError
    from .models.config import ModelError
    from .recipe import RecipeError

    log = lambda m: err.print(m, highlight=False, markup=False)      # noqa: E731
    try:
        opts = BenchOptions(
            recipes=tuple(recipe) if recipe else DEFAULT_RECIPES, model=model, draft=draft,
            random_weights=random_weights,
            batch_sizes=parse_list(batch_sizes, int, "--batch-sizes") if batch_sizes else None,
            prompt_len=prompt_len, prompts=prompts, max_tokens=max_tokens, dtype=dtype, device=device,
            graphs=not eager, separate_graphs=separate_graphs, hf=not no_hf, hf_max_batch=hf_max_batch, max_model_len=max_model_len,
            simulate_acceptance=parse_list(simulate_acceptance, float, "--simulate-acceptance")
            if simulate_acceptance else None)
        result = run_bench(opts, log)
    except (BenchError, JobError, ModelError, RecipeError, InputError, ValueError) as e:
        _fail(str(e))
    result["meta"].update(environment(shlex.join(["specbatch", *sys.argv[1:]])))
    paths, note = write_all(result, out_dir)
    if note:
        log(f"note: {note}")
    head, rows = table(result, short=True)
    view = Table(*head, title=escape(title(result["meta"])))
    for cells in rows:
        view.add_row(*map(escape, cells))
    # Logs are not terminals: give the table its full width there rather than rich's 80 columns.
    Console(width=None if out.is_terminal else 200).print(view)
    log("wrote " + ", ".join(str(p) for p in paths.values()))


@app.command()
def train(
    work_dir: str = typer.Option(".demo_build", help="Where every stage reads and writes its outputs."),
    stages: str = typer.Option("tokenizer,target,eagle3,mtp,bundle",
                               help="Comma-separated stages to run, in order (tokenizer, target, eagle3, mtp, bundle)."),
    smoke: bool = typer.Option(False, "--smoke", help="Toy sizes on the CPU in seconds (CI); bundles into WORK_DIR/bundle."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    seed: int = typer.Option(0, help="Seed for every stage."),
) -> None:
    """Rebuild the embedded demo model: corpus -> tokenizer -> target -> EAGLE3 head -> NextN/MTP
    layer -> bundle (target, eagle3, nextn_mtp)."""
    from .train.pipeline import STAGES, build_demo

    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    bad = [s for s in chosen if s not in STAGES]
    if bad:
        _fail(f"--stages: unknown stage {bad[0]!r} (stages: {', '.join(STAGES)})")
    report = build_demo(work_dir, stages=chosen, smoke=smoke, device=device, seed=seed,
                        log=lambda m: err.print(m, highlight=False, markup=False))
    typer.echo(json.dumps({k: report[k] for k in chosen}, indent=2, default=str))


class _ProgressView:
    """A rich progress bar on stderr: rows done/total, output tokens/s, mean accept length."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and err.is_terminal
        self.progress: Progress | None = None
        self.task = None
        self.completion_tokens = 0
        self.verify_steps = 0

    def __enter__(self) -> "_ProgressView":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, event: str, info: dict[str, Any]) -> None:
        if event == "start":
            if info["resumed"]:
                err.print(f"resuming: {info['resumed']} rows already committed", highlight=False, markup=False)
            if not self.enabled:
                return
            self.progress = Progress(
                TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("accept {task.fields[al]:.2f}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("rows", total=info["total"], rate=0.0, al=0.0)
        elif event == "record" and self.progress is not None:
            spec = info["record"].get("spec")
            if spec:
                self.completion_tokens += info["record"]["completion_tokens"]
                self.verify_steps += spec["verify_steps"]
            elapsed = self.progress.tasks[0].elapsed or 1e-9
            self.progress.update(self.task, advance=1, rate=info["tokens"] / elapsed,
                                 al=self.completion_tokens / max(self.verify_steps, 1))


def _print_summary(s: dict[str, Any]) -> None:
    table = Table(title="specbatch run", show_header=False)
    if s.get("complete_before"):
        table.add_row("output", escape(f"{s['output']} is already complete ({s['resumed']} rows); pass --overwrite to redo it"))
        err.print(table)
        return
    rows = [
        ("output", s["output"]), ("recipe", s["recipe"]), ("model", s["model"]),
        ("draft", s["draft"] or "-"), ("device", s["device"]),
        ("requests", f"{s['requests']} ({s['resumed']} resumed from an earlier run)" if s["resumed"] else s["requests"]),
        ("errors", s["errors"]), ("prompt tokens", s["prompt_tokens"]), ("completion tokens", s["completion_tokens"]),
        ("output tokens/s", f"{s['output_tokens_per_s']:.1f}"), ("mean accept length", f"{s['mean_accept_length']:.3f}"),
        ("acceptance per draft position", " ".join(f"{r:.2f}" for r in s["acceptance_per_position"]) or "-"),
        ("tokens per target forward", f"{s['tokens_per_target_forward']:.2f} ({s['target_forwards']} batched forwards)"),
        ("wall time", f"{s['wall_s']:.1f} s"), ("peak memory", f"{s['peak_memory_bytes'] / 2**20:.0f} MiB"),
        ("CUDA graphs", f"captured in {s['capture_s']:.2f} s" if s.get("graphs") else "off (eager)"),
    ]
    for k, v in rows:
        table.add_row(k, escape(str(v)))
    err.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
