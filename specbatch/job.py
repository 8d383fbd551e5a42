"""A whole batch job: input file -> LLM -> resumable output file, with run statistics."""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .data import InputChanged, InputError, OutputError, OutputWriter, StdoutWriter, check_input, open_rows
from .data.reader import jsonl_suffix
from .data.reader import Row
from .data.writer import output_file_format
from .params import DEFAULT_LOGPROBS_MODE, OPENAI_LINES
from .prompts import load_chat_template
from .recipe import Recipe
from .row_notes import GreedyByDefault, ModelNames, RepeatedIds, UnreadFields
from .resolve import DEMO_DIR, DeviceLost, JobError, RowStopped, describe_draft, resolve_draft, resolve_model, spec_config
from .stats import RunStats
from .workers import WorkerError

__all__ = ["DEMO_DIR", "DeviceLost", "JobError", "JobOptions", "check_stats_path", "describe_draft",
           "fingerprint", "resolve_draft", "resolve_model", "run_job", "spec_config"]


@dataclass
class JobOptions:
    output: str | None = None            # default: next to the input, <stem>.completions.parquet; "-": stdout
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
    gpus: str | None = None              # all | N | 0,1,...: one engine process per GPU
    workers: int | None = None           # engine processes on --device (CPU by default); 1 = in process
    output_format: str = "auto"          # native | openai (OpenAI Batch lines) | auto: openai for OpenAI batch input
    prefix_caching: bool = True          # share the KV pages of prompts that begin alike
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE  # what logprobs hold: vLLM's --logprobs-mode (engine/logprobs.py)
    served_model_name: str | None = None  # the model OpenAI responses name (vLLM's --served-model-name)
    chat_template: str | None = None     # a chat template (a file, or its text) instead of the model's


# A job commits a part of its finished rows at most once a second (and at least every 30 s):
# at thousands of rows a second, 256-row parts were a file and two fsyncs each in the job's loop.
COMMIT_INTERVAL_S = 1.0


def default_output(input_path: str) -> str:
    if input_path == "-":
        return "completions.parquet"
    path = os.path.normpath(input_path)
    base = os.path.basename(path)
    if not os.path.isdir(path):
        suffix = jsonl_suffix(base)              # data.jsonl.gz -> data
        base = base[: -len(suffix)] if suffix else base.rsplit(".", 1)[0]
    elif base in (".", ".."):             # beside the directory's files, not among them
        name = (os.path.basename(os.path.abspath(path)) or "input") + ".completions.parquet"
        return os.path.normpath(os.path.join(path, os.pardir, name))
    return os.path.join(os.path.dirname(path), (base or "input") + ".completions.parquet")


def fingerprint(recipe: Recipe, model: Any, draft: str | None, opts: JobOptions,
                device: str | None = None) -> dict[str, Any]:
    """What must match for a rerun to resume an earlier one's output (batch size, device and
    --limit may change between runs; anything that changes the rows' content may not). The input
    itself is checked row by row (data/digests.py), not by its path. `dtype` is the one the run
    computes in (`auto` resolved on `device`), so `auto` on a GPU resumes as its checkpoint's dtype
    and a resume on the CPU is told it would mix float32 rows into bfloat16 ones."""
    r = recipe.to_dict()
    return {
        "recipe": r["name"], "algorithm": r["algorithm"], "num_steps": r["num_steps"],
        "topk": r["topk"], "num_draft_tokens": r["num_draft_tokens"],
        "model": str(model.resolve()), "draft": draft and os.path.realpath(draft),
        "dtype": _run_dtype(r["dtype"], model, device), "dtype_requested": r["dtype"],
        "max_model_len": r["max_model_len"], "sampling": r["sampling"],
        "prompt_column": opts.prompt_column, "id_column": opts.id_column,
        "keep_columns": list(opts.keep_columns), "save_token_ids": opts.save_token_ids,
        "output_format": opts.output_format, "logprobs_mode": opts.logprobs_mode, "openai_lines": OPENAI_LINES,
        "ray_fields": RAY_FIELDS,
        # (only when given: an output begun without one resumes as before)
        **({"chat_template": hashlib.blake2b(load_chat_template(opts.chat_template).encode(),
                                             digest_size=8).hexdigest()} if opts.chat_template is not None else {}),
    }


# How a row's Ray Data LLM fields read (manifest.DEFERRED): an output begun when they were its data
# resumes unless a committed row has them (_ray_fields_refusal).
RAY_FIELDS = "sampling_params and tokenized_prompt read as the row's"


def _ray_fields_refusal(output: str) -> Callable[[Any], str | None]:
    def refuse(row: Any) -> str | None:
        if not getattr(row, "ray_fields", False):
            return None
        where = getattr(row, "where", "") or f"row {row.row}"
        return (f"{where}: has sampling_params or tokenized_prompt, which the specbatch that began {output} took "
                "as the row's data (this one reads them as the row's sampling fields and prompt); its committed rows "
                "would mix the two readings: pass --overwrite to start over")
    return refuse


def _run_dtype(name: str, model: Any, device: str | None) -> str:
    """The dtype name a run computes in: `auto` resolved for the model on the device."""
    if name != "auto":
        return name
    from .engine.engine import resolve_device
    from .models.config import load_config
    from .models.loader import resolve_dtype

    return str(resolve_dtype(name, load_config(model)[0], resolve_device(device))).removeprefix("torch.")


def model_name(recipe: Recipe, served: str | None = None) -> str:
    """The model an OpenAI response names when its request named none: `served` (vLLM's
    --served-model-name), else the model directory's name."""
    if served is not None:
        return served
    return "specbatch-demo" if recipe.model == "default" else os.path.basename(os.path.normpath(recipe.model))


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _output_paths(output: str) -> tuple[str, ...]:
    """What a job writes for `output`: the file, its parts, its manifest and its lock."""
    return (output, output + ".parts", output + ".manifest.json", output + ".lock")


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _check_paths(input_path: str, output: str) -> None:
    # vllm run-batch fetches an http(s) -i and uploads to an http(s) -o; pyarrow would take s3:// and
    # the like for its own filesystems, and the job would fail only when its output is assembled
    if _URL.match(input_path):
        raise JobError(f"{input_path}: a URL; specbatch reads local files: download it first and give its path")
    if _URL.match(output):
        raise JobError(f"--output {output}: a URL; specbatch writes a local file (and resumes from the parts beside "
                       "it): give a local path and copy the file up when the job ends")
    if output != "-":
        output_file_format(output)           # a bad output path fails before the input is counted
    if output == "-" or input_path == "-":
        return
    for p in _output_paths(output):
        if _same_file(input_path, p):
            raise JobError(f"--output {output}: that is the input file {input_path}; choose another --output")
    if os.path.isdir(input_path):
        inside = os.path.relpath(os.path.realpath(os.path.abspath(output)), os.path.realpath(input_path))
        if inside != os.pardir and not inside.startswith(os.pardir + os.sep):
            raise JobError(f"--output {output}: inside the input directory {input_path}, whose files are read as "
                           "input (a rerun would read the output's own); choose a path outside it")


def check_stats_path(path: str, input_path: str, output: str | None) -> None:
    """--stats-json is written when the job ends: over the input or the job's own files it would
    replace them with the summary (a JobError naming which)."""
    output = output or default_output(input_path)
    taken = [] if input_path == "-" else [(input_path, "the input file")]
    taken += [] if output == "-" else [(p, "the output's") for p in _output_paths(output)]
    for p, what in taken:
        if _same_file(path, p):
            raise JobError(f"--stats-json {path}: that is {what} {p}; choose another path")


def _spool_stdin(output: str) -> str:
    """A resume from stdin re-reads rows it must check: keep them in a file beside the output."""
    fd, path = tempfile.mkstemp(prefix=os.path.basename(output) + ".stdin-", suffix=".jsonl",
                                dir=os.path.dirname(os.path.abspath(output)))
    with os.fdopen(fd, "wb") as f:
        shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
    return path


Progress = Callable[[str, dict[str, Any]], None]


def _check_run_logit_bias(recipe: Recipe, model_dir: Any) -> None:
    """A run-wide logit_bias naming a token the model does not have fails the job at once (each
    row would be an error row)."""
    bias = recipe.sampling.logit_bias or ()
    if not bias:
        return
    from .models.config import load_config

    vocab = load_config(model_dir)[0].vocab_size
    outside = [t for t, _ in bias if t >= vocab]
    if outside:
        raise JobError(f"--logit-bias (or the recipe's sampling.logit_bias): token id {outside[0]} is outside the "
                       f"model's vocabulary (size {vocab})")


def run_job(input_path: str, recipe: Recipe, opts: JobOptions | None = None,
            progress: Progress | None = None) -> dict[str, Any]:
    """Run `recipe` over every row of `input_path`; returns the run summary.

    `progress(event, info)` is called with "start" (total, resumed, engine facts) and then
    "record" (the record, the engine's emitted-token count) for every finished row.
    """
    opts = opts or JobOptions()
    opts = replace(opts, keep_columns=tuple(dict.fromkeys(opts.keep_columns)))     # a column named twice: once
    notify = progress or (lambda event, info: None)
    stats = RunStats()
    spec = spec_config(recipe)
    model_dir = resolve_model(recipe.model)
    _check_run_logit_bias(recipe, model_dir)
    from .workers import devices_for, hung_limit

    devices = devices_for(opts.gpus, opts.workers, opts.device)   # a bad --gpus / --workers fails before any output
    if _pooled(devices, opts):
        hung_limit()
    output = opts.output or default_output(input_path)
    _check_paths(input_path, output)
    source = open_rows(input_path, prompt_column=opts.prompt_column, id_column=opts.id_column,
                       keep_columns=opts.keep_columns)
    if output == "-":
        writer: OutputWriter | StdoutWriter = StdoutWriter(
            save_token_ids=opts.save_token_ids, keep_columns=opts.keep_columns,
            output_format=opts.output_format, model_name=model_name(recipe, opts.served_model_name))
    else:
        fp = fingerprint(recipe, model_dir, spec.draft, opts, devices[0] if _pooled(devices, opts) else opts.device)
        writer = OutputWriter(output, fingerprint=fp, commit_interval=COMMIT_INTERVAL_S,
                              save_token_ids=opts.save_token_ids, keep_columns=opts.keep_columns,
                              overwrite=opts.overwrite, output_format=opts.output_format,
                              model_name=model_name(recipe, opts.served_model_name), keep_types=source.column_types)
    spooled = None
    try:
        if len(writer.done_rows) or writer.complete:      # complete with no rows: --limit 0, an empty input
            if input_path == "-":
                spooled = _spool_stdin(output)
                source = open_rows(spooled, prompt_column=opts.prompt_column, id_column=opts.id_column,
                                   keep_columns=opts.keep_columns, display="<stdin>")
            try:
                refuse = _ray_fields_refusal(output) if "ray_fields" in writer.deferred else None
                if len(writer.done_rows):
                    notify("checking", {"committed": len(writer.done_rows), "output": output})
                items = iter(source) if refuse is not None else source.digested()   # (refuse reads the rows)
                digests, pending = check_input(items, writer.expected(), limit=opts.limit,
                                               input_name="<stdin>" if input_path == "-" else input_path,
                                               output=output, refuse=refuse)
            except InputChanged as e:
                raise JobError(str(e)) from None
            if writer.complete:
                if not pending:
                    return stats.summary(output=output, complete_before=True, resumed=len(writer.done_rows))
                writer.reopen(digests)       # finished before with a smaller --limit, or new rows: add them
            elif not pending:                # every row (below --limit) is committed: assemble, no model
                notify("assembling", {"rows": len(writer.done_rows), "output": output})
                rows = writer.finalize()
                return stats.summary(output=output, assembled=True, resumed=len(writer.done_rows),
                                     rows_in_output=rows, limit=opts.limit)
            del digests                      # (a digest per committed row: not held through the job)
        writer.settle_deferred()         # the committed rows (if any) passed: record what they predate
        return _generate(source, writer, recipe, opts, devices, output, stats, notify)
    except DeviceLost as e:
        e.restartable = e.restartable and input_path != "-"      # stdin is read once
        raise
    except BaseException as e:
        if output != "-":                # what a stop leaves to resume from, earlier runs' rows included
            e.committed = len(writer.done_rows)
        raise
    finally:
        writer.close()
        if spooled:
            os.remove(spooled)


def _pooled(devices: list[str], opts: JobOptions) -> bool:
    """Whether the job runs engine processes (workers.py) rather than one engine in this process."""
    return len(devices) > 1 or opts.gpus is not None


class _Runner:
    """What generates the records: one engine in this process, or a pool of worker processes
    (workers.py); the job reads both the same way."""

    def __init__(self, recipe: Recipe, opts: JobOptions, devices: list[str]):
        """`devices`: workers.devices_for's answer for the job's flags."""
        from .workers import WorkerPool

        self.pool = self.llm = None
        # --gpus always means one engine process per GPU (a 1-GPU box runs the machinery an 8-GPU box
        # runs); --workers 1 (the default) runs the engine in this process.
        if _pooled(devices, opts):
            self.pool = WorkerPool(recipe, devices, eager=opts.eager, bucket=opts.bucket_window,
                                   prefix_caching=opts.prefix_caching, logprobs_mode=opts.logprobs_mode,
                                   chat_template=opts.chat_template)
            try:
                self.pool.wait_ready()
            except WorkerError as e:         # e.g. every engine refused the settings: one line, exit 2
                self.pool.close()
                raise JobError(str(e)) from None
            per = self.pool.per_worker()
            live = [w for w in per if "max_model_len" in w and not w["died"]]
            self.device, self.max_len = ",".join(devices), min(w["max_model_len"] for w in live)
            if len({w["max_model_len"] for w in live}) > 1:      # GPUs of different memory, --max-model-len unset
                names = [w["device"] for w in live]
                held = ", ".join(f"{d if names.count(d) == 1 else f'{d} #{i}'}: {w['max_model_len']}"
                                 for i, (d, w) in enumerate(zip(names, live)))
                print(f"warning: the workers' engines hold different contexts ({held} tokens): rows reaching past "
                      f"{self.max_len} tokens end differently by worker; a new output started with --max-model-len "
                      f"{self.max_len} has one", file=sys.stderr)
            self.capture_s = max(w.get("capture_s", 0.0) for w in per)
            from .models.config import generation_sampling_defaults

            self.model_defaults = generation_sampling_defaults(resolve_model(recipe.model))   # as each engine read it
            self.pool.context = self.max_len     # a worker restarted mid-job is compared with it
        else:
            from .llm import LLM

            self.llm = LLM(recipe=recipe, device=opts.device, eager=opts.eager,
                           bucket=opts.bucket_window, enable_prefix_caching=opts.prefix_caching,
                           logprobs_mode=opts.logprobs_mode, chat_template=opts.chat_template)
            eng = self.llm.engine
            self.device, self.max_len, self.capture_s = str(eng.device), eng.max_len, eng.capture_seconds
            self.model_defaults = eng.model_defaults

    def stream(self, rows: Iterator[Row]) -> Iterator[dict[str, Any]]:
        return self.pool.stream(rows) if self.pool else self.llm.stream(rows)

    @property
    def tokens(self) -> int:
        if self.pool:
            return sum(w.get("tokens_emitted", 0) for w in self.pool.per_worker())
        return self.llm.engine.tokens_emitted

    def facts(self) -> dict[str, Any]:
        from .engine.failures import FailureCounts

        if self.pool:
            per = self.pool.per_worker()
            forwards = sum(w.get("target_forwards", 0) for w in per)
            tokens = sum(w.get("tokens_emitted", 0) for w in per)
            summed = ("waited_for_pages", *FailureCounts().facts(), "prompt_tokens_admitted", "prompt_tokens_cached",
                      "preempted", "preemptions", "recomputed_tokens")       # counts the workers add up
            widths: dict[int, int] = {}
            for w in per:
                for k, n in (w.get("verify_widths") or {}).items():
                    widths[int(k)] = widths.get(int(k), 0) + n
            return dict(target_forwards=forwards, graphs=any(w["device"].startswith("cuda") for w in per) and
                        not self.pool.eager, capture_s=self.capture_s, workers=per,
                        tokens_per_target_forward=tokens / max(forwards, 1),
                        **{k: sum(w.get(k, 0) for w in per) for k in summed},
                        kv_rows=min((w["kv_rows"] for w in per if "kv_rows" in w), default=0),
                        workers_lost=sum(w["lost"] for w in per),
                        peak_memory_bytes=max((w.get("peak_memory_bytes", 0) for w in per), default=0),
                        verify_widths=dict(sorted(widths.items())))
        eng = self.llm.engine
        return dict(target_forwards=eng.target_forwards, graphs=eng.graphs is not None, capture_s=eng.capture_seconds,
                    tokens_per_target_forward=eng.tokens_emitted / max(eng.target_forwards, 1),
                    waited_for_pages=eng.waited, **eng.pool_facts(), **eng.failure_counts.facts(),
                    verify_widths={w: n for w, n in sorted(eng.cycle.policy.used.items())})


def _generate(source: Any, writer: OutputWriter | StdoutWriter, recipe: Recipe, opts: JobOptions, devices: list[str],
              output: str, stats: RunStats, notify: Progress) -> dict[str, Any]:
    t0 = time.perf_counter()
    runner = _Runner(recipe, opts, devices)
    stats.start_generation(time.perf_counter() - t0)
    changed = writer.set_context(runner.max_len)
    if changed:
        print(changed, file=sys.stderr)
    done = writer.done_rows
    limit = opts.limit
    total = source.total if limit is None or source.total is None else min(source.total, limit)
    resumed = len(done) if limit is None else done.count_below(limit)
    digests: dict[int, bytes] = {}
    named, ids = ModelNames(model_name(recipe, opts.served_model_name)), RepeatedIds()
    unread = UnreadFields("(rename the column, or name it in --keep-columns, to keep this quiet)")
    greedy = GreedyByDefault(recipe.sampling, runner.model_defaults)

    def todo() -> Iterator[Row]:
        rows = source.skipping(done)         # committed rows: their ids only (for `ids`), not parsed
        if limit is not None:
            rows = itertools.takewhile(lambda r: r.row < limit, rows)
        for r in rows:
            ids.add(r)
            if r.row not in done:
                named.check(r)
                unread.check(r)
                greedy.check(r)
                digests[r.row] = getattr(r, "digest", b"")
                yield r

    # rows in flight when the device failed in an earlier run: one at a time, before the rest
    suspects = writer.suspects()
    if runner.pool:
        runner.pool.suspects.update(suspects)     # the pool runs each alone on one worker

    def generated() -> Iterator[dict[str, Any]]:
        rows = todo()
        if suspects and runner.llm:
            ahead, alone = [], []
            last = max(suspects)
            for r in rows:
                (alone if r.row in suspects else ahead).append(r)
                if r.row >= last:
                    break
            # one stream: the engine's record filter (STRIKES) sees the suspects and the rest in a row
            yield from runner.llm.stream(itertools.chain(ahead, rows), alone=alone)
            return
        yield from runner.stream(rows)

    def tokens() -> int:
        """Tokens generated so far (in process: unfinished rows' too; workers report theirs when they
        end, so finished rows' until then)."""
        return runner.tokens if runner.llm else stats.completion_tokens

    notify("start", {"total": None if total is None else total - resumed, "resumed": resumed,
                     "device": runner.device, "max_model_len": runner.max_len,
                     "model": str(resolve_model(recipe.model)), "capture_s": runner.capture_s,
                     "load_s": stats.load_s, "tokens_now": tokens})
    try:
        for rec in generated():
            if opts.fail_fast and rec["error"]:
                digests.pop(rec["row"], None)
                raise RowStopped(rec["error"])
            if not opts.save_token_ids:
                rec.pop("output_token_ids", None)
            writer.add(rec, digests.pop(rec["row"], b""))
            stats.add(rec)
            notify("record", {"record": rec, "tokens": tokens(),
                              "errors": stats.errors, "on_stdout": getattr(writer, "count", None)})
    except BaseException as e:
        if isinstance(e, OutputError):     # the output itself failed (disk full...): committed parts stay
            if runner.pool:
                runner.pool.close()          # now, not once the caller lets go of the traceback
            raise
        from .engine.failures import DeviceFailed, EngineFailed

        failure, assembled = None, None
        with _signals_held():        # a second Ctrl-C (or a SIGTERM after it) must not cut the commit
            try:
                if isinstance(e, DeviceFailed):
                    failure = _device_failed(e, writer, digests, suspects, opts.fail_fast)
                elif runner.pool and runner.pool.suspects:
                    writer.set_suspects({**suspects, **{r: "a worker's device failed (or hung) with it in flight"
                                                        for r in runner.pool.suspects}})
                writer.commit()      # what finished is kept; a rerun resumes after it
                if isinstance(e, RowStopped):
                    assembled = writer.finalize()    # --fail-fast: what finished is assembled into the output
            except Exception as failed:  # noqa: BLE001 - the first error is the one to report
                print(f"warning: could not commit the finished rows: {failed}", file=sys.stderr)
        if runner.pool:
            runner.pool.close()      # (told to end as the stop passed through the pool: joined after the commit)
        if failure is not None:
            raise failure from None
        if assembled is not None:
            raise RowStopped(f"{e} (--fail-fast: {_fail_fast_note(assembled, writer.path)})") from None
        if isinstance(e, (WorkerError, EngineFailed, InputError)):   # (an input unreadable midway: a cut file)
            raise JobError(f"{e}; {resume_note(writer.path)}") from None
        # a stop (Ctrl-C, SIGTERM): what this run did, for --stats-json (a scheduler's log of it)
        e.partial_summary = stats.summary(output=output, resumed=resumed, device=runner.device,
                                          max_model_len=runner.max_len, recipe=recipe.name)
        raise
    if output != "-":
        notify("assembling", {"rows": len(writer.done_rows) + writer.buffered, "output": output})
    rows_written = writer.finalize()
    repeated, first = ids.count()
    if first is not None:
        print(f"warning: {repeated} rows have the id of an earlier row (the first: row {first[0]}, the id of row "
              f"{first[1]}); results joined back by id would reach the wrong rows: the output's row column tells "
              "them apart", file=sys.stderr)
    import torch

    return stats.summary(torch.device(runner.device.split(",")[0]), output=output, rows_in_output=rows_written,
                         repeated_ids=repeated,
                         errors_in_output=getattr(writer, "error_rows", None),
                         resumed=resumed, device=runner.device, max_model_len=runner.max_len,
                         recipe=recipe.name, model=str(resolve_model(recipe.model)),
                         draft=describe_draft(recipe, spec_config(recipe).draft), **runner.facts())


NO_RESUME = "-o - keeps nothing to resume from, so a rerun starts over"


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM are held off (dropped: the job is stopping already) while the block runs,
    in the main thread (where Python handles signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda signum, frame: None) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def resume_note(output: str) -> str:
    """What a stopped job leaves for a rerun: committed parts, or (-o -) nothing."""
    if output == "-":
        return f"finished rows went to stdout; {NO_RESUME}"
    return "finished rows are committed, rerun the same command to resume"


def _fail_fast_note(rows: int, output: str) -> str:
    """Where a --fail-fast stop leaves the rows that finished before it."""
    if output == "-":
        return f"stopped there; {rows:,} finished rows went to stdout"
    return (f"stopped there; {rows:,} finished rows are in {output}: mend that row and rerun the same command "
            "to add the rest")


def _device_failed(e: Any, writer: OutputWriter | StdoutWriter, digests: dict[int, bytes],
                   suspects: dict[int, str], fail_fast: bool) -> DeviceLost:
    """The device failed (engine.failures.DeviceFailed) and the process cannot go on: a row that
    was alone in flight is written as its error (under --fail-fast it stays a suspect, unwritten);
    several are remembered beside the parts, for the rerun to run one at a time. -> the job's
    one line, marked for the CLI's hard exit on CUDA and its restart where a rerun resumes."""
    from .engine.failures import device_failed_alone

    if not e.items:                          # an asynchronous error surfacing once every row had finished
        line = f"the device failed ({e.cause}) with no row in flight; {resume_note(writer.path)}"
    elif len(e.items) == 1:
        item = e.items[0]
        if fail_fast:                        # a failing row stops --fail-fast, never an error row
            writer.set_suspects({**suspects, item.row: e.cause})
            how = " (--fail-fast: that row is not written); finished rows are committed"
        else:
            writer.add(device_failed_alone(item, e.cause), digests.pop(item.row, b""))
            writer.set_suspects({r: m for r, m in suspects.items() if r != item.row})
            how = f"; that row is written as its error, {resume_note(writer.path)}"
        line = f"the device failed while {item.place} ran alone ({e.cause}), and this process cannot go on{how}"
    else:
        writer.set_suspects({**suspects, **{i.row: e.cause for i in e.items}})
        if writer.path == "-":               # no parts, no suspects.json: nothing for a rerun to go on from
            line = (f"the device failed with {len(e.items)} rows in flight ({e.cause}); -o - cannot resume, "
                    "so a rerun fails the same way: write to a file (-o PATH) to have those rows run one "
                    "at a time on the rerun")
        else:
            then = ("stops the run there (--fail-fast)" if fail_fast else "is written as its error")
            line = (f"the device failed with {len(e.items)} rows in flight ({e.cause}); finished rows are "
                    "committed: rerun the same command to resume, and those rows run one at a time first, so a "
                    f"row that brings the device down {then}")
    return DeviceLost(line, e.hard_exit, writer.path != "-" and not fail_fast)
