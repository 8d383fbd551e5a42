"""The `specbatch` command: thin wrappers over recipe loading and `run_job`."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import algorithms
from .engine_args import engine_args
from .speculative_config import speculative_base
from .progress import ProgressView, print_summary           # torch-free: the help strings that name algorithms and drafters

if TYPE_CHECKING:
    from .resolve import DeviceLost

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation with speculative decoding.")
err = Console(stderr=True)
out = Console()

EXIT_FAILED = 1     # --fail-fast stopped on a bad row
EXIT_USAGE = 2      # unknown recipe, unusable model, unreadable input, output conflict
EXIT_PIPE = 141     # -o -: its reader closed stdout (128 + SIGPIPE, as a piped tool ends)
RESTART_ENV = "SPECBATCH_RESTART"   # set in a run that started itself again after its device failed: how often


def _fail(message: str, code: int = EXIT_USAGE) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _restart(e: DeviceLost) -> None:
    """A device failure ends this process, not the job: the same command starts again in a fresh
    process (exec: the same pid, terminal and arguments, a fresh CUDA context), which resumes and
    goes past the failing row (job.py), up to MAX_RESTARTS times a command. Returns if it may not."""
    from .workers import MAX_RESTARTS

    done = int(os.environ.get(RESTART_ENV) or 0)
    if not e.restartable or done >= MAX_RESTARTS:
        return
    err.print(f"[yellow]warning:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
    err.print(f"specbatch: the same command starts again in a fresh process to resume "
              f"(restart {done + 1} of {MAX_RESTARTS})", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[RESTART_ENV] = str(done + 1)
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError as failed:
        err.print(f"[yellow]warning:[/] could not start again ({failed})", highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        from . import __version__

        typer.echo(f"specbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Offline batch generation with speculative decoding."""


# Recipe keys set from `run` flags: errors in their values name the flag, not the key.
_FLAGS = {"model": "--model", "draft": "--draft", "batch_size": "--batch-size", "max_tokens": "--max-tokens",
          "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed",
          "stop": "--stop", "ignore_eos": "--ignore-eos", "dtype": "--dtype", "max_model_len": "--max-model-len",
          "gpu_memory_utilization": "--gpu-memory-utilization",
          "min_p": "--min-p", "min_tokens": "--min-tokens", "presence_penalty": "--presence-penalty",
          "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty",
          "logit_bias": "--logit-bias", "logprobs": "--logprobs", "prompt_logprobs": "--prompt-logprobs", "n": "--n",
          "include_stop_str_in_output": "--include-stop-str-in-output", "skip_special_tokens": "--skip-special-tokens"}


class Terminated(BaseException):
    """SIGTERM (what schedulers send): handled like Ctrl-C."""


def _on_sigterm(signum: int, frame: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once: the commit that follows must not be cut
    raise Terminated()


def _check_stats_path(path: str) -> None:
    """--stats-json is written after the job: a path that cannot be written fails now, not then."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        _fail(f"--stats-json {path}: is a directory")
    if not os.path.isdir(parent):
        _fail(f"--stats-json {path}: no such directory {parent}")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        _fail(f"--stats-json {path}: not writable")


@app.command()
def run(
    input: Optional[str] = typer.Argument(None, show_default=False, help="Input rows: a .jsonl (or .jsonl.gz, .zst, .bz2, .lz4) or .parquet file, a directory of them (a dataset's files, read in path order), or - for JSONL on stdin (or -i, as vllm run-batch takes it)."),
    input_file: Optional[str] = typer.Option(None, "--input-file", "-i", help="The input, as vllm run-batch's -i (or give it as INPUT)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-r", show_default=False, help="Builtin recipe name or a recipe .yaml path (default: vanilla; vLLM's --speculative-config chooses one too)."),
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the recipe's model)."),
    draft: Optional[str] = typer.Option(None, help=algorithms.draft_help("run")),
    output: Optional[str] = typer.Option(None, "--output", "-o", "--output-file", help="Output .parquet or .jsonl, or - for JSONL on stdout (default: beside the input, data.jsonl -> data.completions.parquet; stdin: completions.parquet)."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", "--max-num-seqs", help="Scheduler slots (sequences decoded together; vLLM's --max-num-seqs)."),
    max_tokens: Optional[int] = typer.Option(None, help="Completion length limit of rows that set none (default: the recipe's, else the model's max_new_tokens, else 256; OpenAI /v1/completions lines 16, /v1/chat/completions lines the model's max_new_tokens, else up to the context)."),
    temperature: Optional[float] = typer.Option(None, help="Default temperature (0 = greedy)."),
    top_p: Optional[float] = typer.Option(None, help="Default nucleus sampling mass."),
    top_k: Optional[int] = typer.Option(None, help="Default top-k (0 = off)."),
    seed: Optional[int] = typer.Option(None, help="Run seed; rows without a seed derive theirs from it and their row number."),
    stop: Optional[list[str]] = typer.Option(None, help="Default stop string (repeatable)."),
    ignore_eos: Optional[bool] = typer.Option(None, "--ignore-eos/--no-ignore-eos", help="Do not stop at EOS (benchmarks); --no-ignore-eos overrides a recipe's true."),
    min_p: Optional[float] = typer.Option(None, help="Default min-p: drop tokens below min_p x the top token's probability."),
    min_tokens: Optional[int] = typer.Option(None, help="Default minimum completion tokens (EOS and stop token ids masked until then)."),
    presence_penalty: Optional[float] = typer.Option(None, help="Default presence penalty in [-2, 2] (over generated tokens)."),
    frequency_penalty: Optional[float] = typer.Option(None, help="Default frequency penalty in [-2, 2] (over generated tokens)."),
    repetition_penalty: Optional[float] = typer.Option(None, help="Default repetition penalty > 0 (over prompt and generated tokens; 1 = off)."),
    logit_bias: Optional[list[str]] = typer.Option(None, help="Default logit bias ID=BIAS, BIAS in [-100, 100] (repeatable)."),
    logprobs: Optional[int] = typer.Option(None, help="Default logprobs: each token's logprob and its top K alternatives (0-20)."),
    prompt_logprobs: Optional[int] = typer.Option(None, help="Default prompt_logprobs: each prompt token's logprob under the model (raw distribution) and its top K alternatives (0-20)."),
    n: Optional[int] = typer.Option(None, "--n", help="Default completions per row."),
    include_stop_str_in_output: Optional[bool] = typer.Option(None, "--include-stop-str-in-output/--no-include-stop-str-in-output", help="Keep the matched stop string (or stop token) in the text (--no-...: leave it out, over a recipe's true)."),
    skip_special_tokens: Optional[bool] = typer.Option(None, "--skip-special-tokens/--keep-special-tokens", help="Skip special tokens in the text (default) or keep them."),
    dtype: Optional[str] = typer.Option(None, help="auto | float32 | bfloat16 | float16 (vLLM's half and float too)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    gpus: Optional[str] = typer.Option(None, help="Every GPU of this host: all, a count, or ids like 0,1,3 (one engine process each, fed from one work queue)."),
    workers: Optional[int] = typer.Option(None, min=1, help="Engine processes on --device (CPU by default); 1 = in this process."),
    max_model_len: Optional[int] = typer.Option(None, help="Context per slot, prompt + completion (default: model and memory limit)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, help="Share of each GPU's whole memory the engine may take, weights, activations and KV pool together, as vLLM's (default: the KV pool takes 90% of what is free once the model is loaded)."),
    limit: Optional[int] = typer.Option(None, min=0, help="Only the first N input rows."),
    prompt_column: str = typer.Option("prompt", help="Column holding the text prompt."),
    id_column: Optional[str] = typer.Option(None, help="Column holding the row id (default: id, then custom_id (custom_id first for OpenAI batch lines), then the row number)."),
    keep_columns: Optional[str] = typer.Option(None, help="Comma-separated input columns copied to the output."),
    save_token_ids: bool = typer.Option(False, "--save-token-ids", help="Add output_token_ids to each output row."),
    output_format: str = typer.Option("auto", help="native | openai (OpenAI Batch output lines, JSONL) | auto: openai for OpenAI batch input written to .jsonl."),
    bucket: int = typer.Option(0, min=0, help="Length-bucketing window: admit similar prompt lengths together (0 = none: the largest max_tokens first among the rows read ahead)."),
    eager: bool = typer.Option(False, "--eager", "--enforce-eager", help="No CUDA graphs: run every cycle eagerly (the reference path; vLLM's --enforce-eager)."),
    logprobs_mode: str = typer.Option("raw_logprobs", help="What logprobs hold (vLLM's --logprobs-mode): raw_logprobs (the model's distribution, default), processed_logprobs (the one each token was drawn from: after bias, penalties, temperature and filters), raw_logits or processed_logits."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", "--enable-prefix-caching/--no-enable-prefix-caching", help="Prompts that begin alike share the KV pages of their common prefix, and prefill skips it (default; the same outputs, up to the rounding batching already varies)."),
    stats_json: Optional[str] = typer.Option(None, help="Also write the run summary as JSON to this path."),
    fail_fast: bool = typer.Option(False, "--fail-fast", help="Stop at the first bad row (exit 1), assembling the rows that finished."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Discard an existing specbatch output or unfinished parts instead of resuming."),
    progress_every: float = typer.Option(30.0, min=0.1, help="Seconds between progress lines when stderr is not a terminal (a scheduler's log)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Errors and warnings only: no progress, no summary."),
    # vllm run-batch's engine flags, read as LLM(...) reads them (engine_args.py): not in --help
    tensor_parallel_size: Optional[int] = typer.Option(None, hidden=True),
    pipeline_parallel_size: Optional[int] = typer.Option(None, hidden=True),
    data_parallel_size: Optional[int] = typer.Option(None, hidden=True),
    quantization: Optional[str] = typer.Option(None, hidden=True),
    trust_remote_code: Optional[bool] = typer.Option(None, "--trust-remote-code", hidden=True),
    disable_log_stats: Optional[bool] = typer.Option(None, "--disable-log-stats", hidden=True),
    disable_log_requests: Optional[bool] = typer.Option(None, "--disable-log-requests", hidden=True),
    enable_chunked_prefill: Optional[bool] = typer.Option(None, "--enable-chunked-prefill", hidden=True),
    kv_cache_dtype: Optional[str] = typer.Option(None, hidden=True),
    max_num_batched_tokens: Optional[int] = typer.Option(None, hidden=True),
    swap_space: Optional[float] = typer.Option(None, hidden=True),
    block_size: Optional[int] = typer.Option(None, hidden=True),
    speculative_config: Optional[str] = typer.Option(None, hidden=True),
    tokenizer: Optional[str] = typer.Option(None, hidden=True),
    tokenizer_mode: Optional[str] = typer.Option(None, hidden=True),
    revision: Optional[str] = typer.Option(None, hidden=True),
    tokenizer_revision: Optional[str] = typer.Option(None, hidden=True),
    load_format: Optional[str] = typer.Option(None, hidden=True),
    generation_config: Optional[str] = typer.Option(None, hidden=True),
    max_logprobs: Optional[int] = typer.Option(None, hidden=True),
    chat_template: Optional[str] = typer.Option(None, help="A chat template instead of the model's, for chat rows: a file's path or the template's text (vLLM's --chat-template; a resume must be given the same one)."),
    served_model_name: Optional[str] = typer.Option(None, hidden=True),
    response_role: Optional[str] = typer.Option(None, hidden=True),
    reasoning_parser: Optional[str] = typer.Option(None, hidden=True),
    enable_prompt_tokens_details: Optional[bool] = typer.Option(None, "--enable-prompt-tokens-details", hidden=True),
    output_tmp_dir: Optional[str] = typer.Option(None, hidden=True),
    enable_metrics: Optional[bool] = typer.Option(None, "--enable-metrics", hidden=True),
    port: Optional[int] = typer.Option(None, hidden=True),
    url: Optional[str] = typer.Option(None, hidden=True),
    max_log_len: Optional[int] = typer.Option(None, hidden=True),
    enable_log_requests: Optional[bool] = typer.Option(None, "--enable-log-requests", hidden=True),
    enable_force_include_usage: Optional[bool] = typer.Option(None, "--enable-force-include-usage", hidden=True),
) -> None:
    """Generate a completion for every row of INPUT. Rerunning the same command resumes. A vllm
    run-batch command line runs too: -i, --output-file and its engine flags (README)."""
    import signal

    from .data import InputError, OutputError, StdoutClosed
    from .job import DeviceLost, JobError, JobOptions, check_stats_path, run_job
    from .resolve import RowStopped
    from .models.config import ModelError
    from .params import check_logprobs_mode
    from .recipe import RecipeError, load_recipe

    if os.environ.get(RESTART_ENV):          # started again after a device failure: resume what it wrote
        overwrite = False
    if (input is None) == (input_file is None):
        _fail("give the input once: as INPUT or as -i/--input-file" if input else
              "missing the input: INPUT (or -i/--input-file), a .jsonl or .parquet file, a directory of them, or -")
    input = input if input is not None else input_file
    vllm = dict(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                data_parallel_size=data_parallel_size, quantization=quantization,
                trust_remote_code=trust_remote_code, disable_log_stats=disable_log_stats,
                disable_log_requests=disable_log_requests, enable_chunked_prefill=enable_chunked_prefill,
                kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens, swap_space=swap_space,
                block_size=block_size, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode, revision=revision,
                tokenizer_revision=tokenizer_revision, load_format=load_format, generation_config=generation_config,
                max_logprobs=max_logprobs, served_model_name=served_model_name,
                response_role=response_role, reasoning_parser=reasoning_parser,
                enable_prompt_tokens_details=enable_prompt_tokens_details, output_tmp_dir=output_tmp_dir,
                enable_metrics=enable_metrics, port=port, url=url, max_log_len=max_log_len,
                enable_log_requests=enable_log_requests, enable_force_include_usage=enable_force_include_usage)
    if speculative_config is not None:
        try:
            vllm["speculative_config"] = json.loads(speculative_config)
        except ValueError as e:
            _fail(f"--speculative-config: expected a JSON object, as vLLM's ({e})")
    spec: dict[str, Any] = {}
    if chat_template is not None:        # a file or the template's text, as vllm run-batch takes it: read now
        from .prompts import load_chat_template   # to fail now; the job and its engines read it as given

        try:
            load_chat_template(chat_template, "--chat-template")
        except ValueError as e:
            _fail(str(e))
    try:
        taken = engine_args({k: v for k, v in vllm.items() if v is not None}, model=model,
                            spell=lambda k, v: "--speculative-config" if k == "speculative_config" else _flag(k, v))
        if "speculative" in taken:        # the recipe doing what vLLM's speculative config asks
            recipe, spec = speculative_base(recipe or "vanilla", draft, taken["speculative"], "--speculative-config")
            draft = spec.pop("draft")
    except ValueError as e:
        _fail(str(e))
    recipe = recipe or "vanilla"
    overrides = dict(model=model, draft=draft, batch_size=batch_size, max_tokens=max_tokens,
                     temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                     stop=list(stop) if stop else None, ignore_eos=ignore_eos, dtype=dtype,
                     max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                     min_p=min_p, min_tokens=min_tokens,
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, logit_bias=list(logit_bias) if logit_bias else None,
                     logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=n,
                     include_stop_str_in_output=include_stop_str_in_output,
                     skip_special_tokens=skip_special_tokens)
    try:
        rec = load_recipe(recipe)
    except RecipeError as e:
        _fail(str(e))
    try:
        rec = rec.with_overrides(**spec)
    except RecipeError as e:
        _fail(f"--speculative-config: {e.detail or e}")
    try:
        rec = rec.with_overrides(**overrides)
    except RecipeError as e:
        key = (e.key or "").removeprefix("sampling.").split("[")[0]
        # a flag cannot be null: the recipe key's "or null" is not the flag's to offer
        _fail(f"{_FLAGS[key]}: {e.detail.replace(' or null', '')}" if overrides.get(key) is not None else str(e))
    if stats_json:
        _check_stats_path(stats_json)
        try:
            check_stats_path(stats_json, input, output)
        except JobError as e:
            _fail(str(e))
    try:
        check_logprobs_mode(logprobs_mode)
    except ValueError as e:
        _fail(str(e))
    opts = JobOptions(
        output=output, limit=limit, prompt_column=prompt_column, id_column=id_column,
        keep_columns=[c.strip() for c in keep_columns.split(",") if c.strip()] if keep_columns else (),
        save_token_ids=save_token_ids, fail_fast=fail_fast, overwrite=overwrite, device=device,
        bucket_window=bucket, eager=eager, output_format=output_format, gpus=gpus, workers=workers,
        prefix_caching=prefix_caching, logprobs_mode=logprobs_mode, served_model_name=served_model_name,
        chat_template=chat_template)
    view = ProgressView(err, quiet=quiet, every=progress_every)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with view:
            summary = run_job(input, rec, opts, progress=view.update)
        # the output is complete: a SIGTERM from here on (a scheduler's, at the job's end) does not
        # turn it into a failure, nor cut the summary and --stats-json short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _report(summary, quiet, stats_json)
    except JobError as e:
        if isinstance(e, DeviceLost) and e.hard_exit:   # the CUDA context failed: its teardown may abort the exit
            _restart(e)
            err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_USAGE)
        _fail(str(e), EXIT_FAILED if isinstance(e, RowStopped) else EXIT_USAGE)   # 1: --fail-fast at a bad row
    except StdoutClosed as e:
        # -o - read by `head` and the like: the reader had what it wanted; stop as a piped tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (no second error flushing at exit)
        if not quiet:
            try:
                err.print(f"specbatch: {e}; stopped", highlight=False, soft_wrap=True)
            except OSError:
                pass                         # stderr went with it (2>&1 | head)
        raise typer.Exit(EXIT_PIPE) from None
    except (InputError, OutputError, ModelError, RecipeError, ValueError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.filename or 'specbatch'}: {e.strerror or e}")
    except KeyboardInterrupt as e:
        _stopped_stats(e, stats_json, "interrupted")
        _fail(f"interrupted; {_kept(view, output, e)}", 130)
    except Terminated as e:
        _stopped_stats(e, stats_json, "terminated")
        _fail(f"terminated (SIGTERM); {_kept(view, output, e)}", 143)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _flag(key: str, value: Any) -> str:
    """A vLLM engine argument as its run-batch flag reads."""
    return f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")


def _write_stats(path: str, summary: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(summary, indent=2) + "\n")


def _report(summary: dict, quiet: bool, stats_json: str | None) -> None:
    """A finished job's summary on stderr, its --stats-json, and exit 1 when every row failed."""
    if not quiet:
        print_summary(err, summary)
    if stats_json:
        try:
            _write_stats(stats_json, summary)
        except OSError as e:
            _fail(f"--stats-json {stats_json}: {e.strerror or e} (the job itself finished: {summary['output']})")
    # every row of the output (a resume's committed rows too: not only this run's), where it is known
    rows, errors = summary.get("rows_in_output"), summary.get("errors_in_output")
    if rows is None or errors is None:
        rows, errors = summary.get("requests"), summary.get("errors")
    if rows and errors == rows:
        where = ("the lines on stdout hold" if summary["output"] == "-" else f"{summary['output']} holds")
        _fail(f"every row failed ({errors} rows); {where} each one's error (its error column, or each OpenAI "
              "result line's error)", EXIT_FAILED)


def _stopped_stats(e: BaseException, stats_json: str | None, how: str) -> None:
    """A stopped run's --stats-json: what it did before the stop (`stopped` says how); best effort,
    the stop's own line follows either way."""
    summary = getattr(e, "partial_summary", None)
    if not stats_json or summary is None:
        return
    try:
        _write_stats(stats_json, {**summary, "stopped": how})
    except OSError as failed:
        err.print(f"warning: --stats-json {escape(stats_json)}: {escape(failed.strerror or str(failed))}",
                  highlight=False, soft_wrap=True)


def _kept(view: ProgressView, output: str | None, stop: BaseException) -> str:
    """What a stopped run leaves: committed parts to resume from (earlier runs' included, as the
    job counted them), or lines already on stdout."""
    from .job import NO_RESUME, resume_note

    if output != "-":
        return f"{getattr(stop, 'committed', view.done):,} {resume_note(output or '')}"
    written = view.on_stdout or 0
    behind = view.done - written
    held = f" ({behind:,} finished rows waited behind unfinished ones and were not)" if behind else ""
    return f"{written:,} rows were written to stdout{held}; {NO_RESUME} (-o PATH writes parts a rerun resumes)"


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
    table = Table("recipe", "algorithm", "drafter", "S", "k", "N", "model", "description")
    for n in builtin_recipes():
        r = load_recipe(n)
        spec = (str(v) if v is not None else "-" for v in (r.num_steps, r.topk, r.num_draft_tokens))
        table.add_row(n, r.algorithm, r.drafter or "-", *spec, escape(r.model), escape(r.description))
    out.print(table)


@app.command()
def inspect(
    recipe: str = typer.Option("vanilla", "--recipe", "-r", help="Recipe whose model to show."),
    model: Optional[str] = typer.Option(None, help="Model directory (overrides the recipe's)."),
    draft: Optional[str] = typer.Option(None, help=algorithms.draft_help("inspect")),
) -> None:
    """Show which model and draft a recipe resolves to, and the model's shape."""
    from .job import JobError, describe_draft, resolve_draft, resolve_model
    from .resolve import drafter_check
    from .models.config import ModelError, generation_sampling_defaults, load_config, model_eos_ids
    from .models.registry import model_class
    from .params import describe_defaults
    from .recipe import RecipeError, load_recipe

    try:
        r = load_recipe(recipe).with_overrides(model=model, draft=draft)
        path = resolve_model(r.model)
        cfg, _ = load_config(path)
        draft = resolve_draft(r)
        # what loading will need, checked without reading tensors: the target's weights and
        # tokenizer, a draft directory's config and weights, an MTP layer the target is to hold
        from .models.config import load_config_dict
        from .models.loader import safetensors_files, tensor_names
        from .prompts import load_tokenizer

        names = tensor_names(safetensors_files(path))          # (the headers: a git-lfs pointer is named)
        load_tokenizer(path)
        if draft is not None:
            load_config_dict(draft)
            tensor_names(safetensors_files(draft))
        check = drafter_check(r)
        if check is not None:
            check(draft, path, cfg)
        sampling = describe_defaults(r.sampling, generation_sampling_defaults(path))
    except (RecipeError, JobError, ModelError) as e:
        _fail(str(e))
    params = model_class(cfg.architecture).num_parameters(cfg)      # counted on the meta device
    rope = f"theta {cfg.rope_theta:g}" + ("" if not cfg.rope_scaling else ", " + ", ".join(
        f"{k} {v}" for k, v in cfg.rope_scaling.items() if v is not None))
    biases = [b for b, on in (("q/k/v", cfg.qkv_bias), ("o", cfg.o_bias), ("mlp", cfg.mlp_bias)) if on]
    layout = (f"rope {rope}; sliding window {cfg.sliding_window or 'none'}; biases {', '.join(biases) or 'none'}"
              f"{'; q/k norm' if cfg.qk_norm else ''}; output layer "
              f"{'tied to the embeddings' if 'lm_head.weight' not in names else 'its own'}")
    eos = model_eos_ids(path, cfg)
    table = Table(show_header=False)
    table.add_column("key")
    table.add_column("value", overflow="fold")          # paths shown whole, wrapped
    for k, v in [("recipe", f"{r.name} ({r.source})"), ("algorithm", r.algorithm), ("model", str(path)),
                 ("architecture", cfg.architecture), ("layers", cfg.num_layers),
                 ("hidden / heads / kv heads / head dim", f"{cfg.hidden_size} / {cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
                 ("vocab", cfg.vocab_size), ("parameters (approx.)", f"{params / 1e6:.1f} M"),
                 ("layout", layout), ("EOS ids", ", ".join(map(str, eos)) or "the tokenizer's"),
                 ("checkpoint dtype", cfg.torch_dtype), ("max positions", cfg.max_position_embeddings),
                 ("draft", describe_draft(r, draft) or "-"), ("sampling defaults", sampling)]:
        table.add_row(k, escape(str(v)))
    out.print(table)


@app.command()
def bench(
    recipe: Optional[list[str]] = typer.Option(None, "--recipe", "-r", help="Recipe to measure (repeatable; default: vanilla, eagle3_topk1, eagle3_tree)."),
    model: Optional[str] = typer.Option(None, help="HF model directory (default: the recipes' model; the embedded demo model for builtin recipes)."),
    draft: Optional[str] = typer.Option(None, help=algorithms.draft_help("bench")),
    random_weights: Optional[str] = typer.Option(None, help="Random weights at real shapes: llama-3.1-8b, or a config.json path (no download)."),
    batch_sizes: Optional[str] = typer.Option(None, help="Comma-separated batch sizes (default 1,2,...,256 on GPU; 1,2,4,8 on CPU)."),
    prompt_len: int = typer.Option(1024, help="Prompt tokens (random ids, or held-out prefixes of about this length)."),
    prompts: Optional[str] = typer.Option(None, help="Prompts from a .jsonl / .parquet file instead."),
    max_tokens: int = typer.Option(128, help="Tokens generated per request (greedy, EOS ignored)."),
    dtype: str = typer.Option("auto", help="auto | float32 | bfloat16 | float16 (auto: the recipes' dtype when they set one, else the checkpoint's on a GPU, float32 on the CPU)."),
    device: Optional[str] = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    eager: bool = typer.Option(False, "--eager", help="No CUDA graphs."),
    simulate_acceptance: Optional[str] = typer.Option(None, help="Per-position acceptance probabilities P1,P2,... for the drafts (random weights: step times at a chosen acceptance); every output is labelled simulated."),
    separate_graphs: bool = typer.Option(False, "--separate-graphs", help=algorithms.fused_help()),
    no_hf: bool = typer.Option(False, "--no-hf", help="Skip the transformers generate peer."),
    hf_max_batch: int = typer.Option(64, help="Largest batch size the transformers peer runs."),
    out_dir: str = typer.Option("bench", "--out", help="Directory for bench.json, bench.md, bench.png."),
    max_model_len: Optional[int] = typer.Option(None, help="Context per slot (default: longest prompt + --max-tokens)."),
    job: bool = typer.Option(False, "--job", help="Whole-job mode: every recipe runs one length mix end to end, against the job's floor."),
    fixed_width: bool = typer.Option(False, "--fixed-width", help="--job: every cycle verifies the recipe's whole proposal (default: cycles verify the prefix that pays best, as runs do; steady state always verifies it all)."),
    arrival_order_too: bool = typer.Option(False, "--arrival-order-too", help="--job: also run each recipe admitting rows in input order (default admission: longest max_tokens first, as runs do), on the same engine."),
    every_size_too: bool = typer.Option(False, "--every-size-too", help="--job: also run each recipe replaying the smallest captured graph size that holds the batch (default: the fastest size that holds it, timed at capture), on the same engine."),
    requests: int = typer.Option(1024, min=1, help="--job: rows in the mix."),
    prompt_median: int = typer.Option(256, min=1, help="--job: median prompt tokens (lognormal)."),
    prompt_sigma: float = typer.Option(0.8, min=0.0, help="--job: lognormal sigma of prompt lengths."),
    prompt_max: int = typer.Option(1536, min=1, help="--job: longest prompt (clip)."),
    output_median: int = typer.Option(200, min=1, help="--job: median output tokens (lognormal; EOS ignored); a --prompts row without max_tokens generates this many."),
    output_sigma: float = typer.Option(0.6, min=0.0, help="--job: lognormal sigma of output lengths."),
    output_max: int = typer.Option(768, min=1, help="--job: longest output (clip)."),
    slots: Optional[int] = typer.Option(None, min=1, help="--job: engine slots (default: the recipe's, else from memory)."),
    shared_prefix: int = typer.Option(0, min=0, help="--job: every prompt begins with the same N tokens (an instruction all rows share), before its own lognormal part."),
    max_tokens_factor: float = typer.Option(1.0, min=1.0, help="--job: rows ask for F x their output length as max_tokens and end at their length by EOS (min_tokens and an EOS logit bias: the processors' cost rides along), as generous max_tokens meet EOS in runs."),
    sampling: Optional[str] = typer.Option(None, help="--job: sampling fields every row gets, as a JSON object of a row's fields (e.g. '{\"temperature\": 0.7, \"top_p\": 0.8, \"top_k\": 20}'; a --prompts file's rows keep their own); default greedy."),
    reserve_too: bool = typer.Option(False, "--reserve-too", help="--job: also run each recipe with admission reserving every row's prompt + max_tokens up front (no preemption; default: pages as rows write), on the same engine."),
    repeats: int = typer.Option(1, min=1, help="--job: run each recipe's job this many times on its engine; the table shows the median run and the range of job tok/s."),
) -> None:
    """Measure recipes over the same prompts at a sweep of batch sizes, against the memory-bandwidth
    floor; with --job, whole jobs on a length mix against the job's floor."""
    import shlex
    import sys

    from .bench.report import environment, table, title, write_all
    from .bench.sources import DEFAULT_RECIPES, BenchError, BenchOptions, parse_list
    from .bench.sweep import run_bench
    from .data import InputError
    from .job import JobError
    from .models.config import ModelError
    from .recipe import RecipeError

    from .bench.job import JobMix

    log = lambda m: err.print(m, highlight=False, markup=False)      # noqa: E731
    # the mix as the flags give it (--sampling parsed later, with the rest of the job's options)
    mix = JobMix(requests=requests, prompt_median=prompt_median, prompt_sigma=prompt_sigma, prompt_max=prompt_max,
                 output_median=output_median, output_sigma=output_sigma, output_max=output_max, slots=slots,
                 shared_prefix=shared_prefix, max_tokens_factor=max_tokens_factor)
    if not job:
        asked = [flag for flag, on in (("--fixed-width", fixed_width), ("--arrival-order-too", arrival_order_too),
                                       ("--every-size-too", every_size_too), ("--reserve-too", reserve_too),
                                       ("--repeats", repeats != 1),
                                       ("--sampling", sampling is not None)) if on]
        default = JobMix()
        asked += ["--" + f.replace("_", "-") for f in vars(mix) if getattr(mix, f) != getattr(default, f)]
        if asked:
            _fail(f"{asked[0]} applies to whole jobs only: add --job")
    else:
        asked = [flag for flag, on in (("--batch-sizes", batch_sizes is not None), ("--prompt-len", prompt_len != 1024),
                                       ("--max-tokens", max_tokens != 128), ("--max-model-len", max_model_len is not None),
                                       ("--separate-graphs", separate_graphs),
                                       ("--hf-max-batch", hf_max_batch != 64)) if on]   # --no-hf: a job runs no peer
        if asked:
            _fail(f"{asked[0]} applies to the batch sweep only, not --job (the mix sets lengths: --output-median ...)")
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"--out {out_dir}: {e.strerror or e}")
    if not os.access(out_dir, os.W_OK):
        _fail(f"--out {out_dir}: not writable")
    try:
        opts = BenchOptions(
            recipes=tuple(recipe) if recipe else DEFAULT_RECIPES, model=model, draft=draft,
            random_weights=random_weights,
            batch_sizes=parse_list(batch_sizes, int, "--batch-sizes") if batch_sizes is not None else None,
            prompt_len=prompt_len, prompts=prompts, max_tokens=max_tokens, dtype=dtype, device=device,
            graphs=not eager, separate_graphs=separate_graphs, hf=not no_hf, hf_max_batch=hf_max_batch, max_model_len=max_model_len,
            fixed_width=fixed_width, arrival_order_too=arrival_order_too, every_size_too=every_size_too,
            reserve_too=reserve_too, repeats=repeats,
            simulate_acceptance=parse_list(simulate_acceptance, float, "--simulate-acceptance")
            if simulate_acceptance is not None else None)
        if job:
            from .bench.job import job_markdown, parse_sampling, run_job_bench

            mix.sampling = parse_sampling(sampling) if sampling else {}
            result = run_job_bench(opts, mix, log)
        else:
            result = run_bench(opts, log)
    except (BenchError, JobError, ModelError, RecipeError, InputError, ValueError) as e:
        _fail(str(e))
    result["meta"].update(environment(shlex.join(["specbatch", *sys.argv[1:]])))
    if job:
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "job.json").write_text(json.dumps(result, indent=2) + "\n")
        text = job_markdown(result)
        (folder / "job.md").write_text(text)
        typer.echo(text)
        log(f"wrote {folder / 'job.json'}, {folder / 'job.md'}")
    else:
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
    ours = [p for p in result["points"] if not p.get("peer")]
    if ours and all(p.get("failed") for p in ours):      # nothing measured: a script must not take it as done
        _fail(f"every point failed (the first: {ours[0].get('error')}); see the reports in {out_dir}", EXIT_FAILED)


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
    from .engine.engine import resolve_device
    from .models.config import ModelError
    from .train.pipeline import build_demo, check_stages

    chosen = tuple(s.strip() for s in stages.split(",") if s.strip())
    try:
        check_stages(work_dir, chosen)
        resolve_device(device)
        report = build_demo(work_dir, stages=chosen, smoke=smoke, device=device, seed=seed,
                            log=lambda m: err.print(m, highlight=False, markup=False))
    except (ValueError, ModelError) as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"{e.filename or work_dir}: {e.strerror or e}")
    typer.echo(json.dumps({k: report[k] for k in chosen}, indent=2, default=str))


class _StderrGone:
    """sys.stderr once its reader may close it (`2>&1 | head`): writes after that are dropped, so a
    warning or progress line cannot end the job (nor rich's console, which on a broken pipe points
    stdout at /dev/null and exits: the job would then generate every row into nothing)."""

    def __init__(self, stream: Any):
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self.gone = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def main() -> None:
    """The console script: a malformed flag or argument is one line naming it (the CLI framework's
    own form is a usage block and a box), as every other error here is."""
    if not isinstance(sys.stderr, _StderrGone):
        sys.stderr = _StderrGone(sys.stderr)
    # click's exception classes, whether typer vendors click (0.2x) or imports it
    usage_error, click_error = (next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
                                for name in ("UsageError", "ClickException"))
    try:
        code = app(standalone_mode=False)
    except click_error as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare command: its help
            e.show()
            sys.exit(e.exit_code)
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if isinstance(e, usage_error) and ctx is not None else ""
        if ctx is not None and ctx.info_name == "run" and "unexpected extra argument" in e.format_message():
            hint = ("; run takes one input: for several files (a shell glob), pass their directory, whose .jsonl or "
                    ".parquet files are read in path order")
        err.print(f"[bold red]error:[/] {escape(e.format_message())}{escape(hint)}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
