"""What `specbatch run` shows on stderr: a progress bar on a terminal, plain progress lines in a
scheduler's log, nothing with --quiet; and the summary table at the end."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .records import emitted_tokens


class ProgressView:
    """Progress on stderr: a rich bar on a terminal; plain lines every `every` seconds otherwise
    (a scheduler's log), whether or not a row finished meanwhile (long rows on a full batch finish
    minutes apart: the log must not look hung); nothing with --quiet."""

    def __init__(self, err: Console, quiet: bool, every: float):
        self.err = err
        self.quiet = quiet
        self.every = every
        self.bar = not quiet and self.err.is_terminal
        self.progress: Progress | None = None
        self.task = None
        self.total: int | None = None
        self.done = 0
        self.first_done = 0.0                  # when the first row finished: the rows' pace is timed from it
        self.on_stdout: int | None = None      # -o -: rows written (in input order) so far
        self.errors = 0
        self.tokens = 0
        self.completion_tokens = 0
        self.verify_steps = 0
        self.started = time.perf_counter()
        self.last_line = self.started
        self.tokens_now: Callable[[], int] | None = None   # tokens generated so far, unfinished rows' too
        self.gone = False                      # stderr was closed under us
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.beat: threading.Thread | None = None

    def __enter__(self) -> "ProgressView":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.beat is not None:
            self.beat.join(timeout=1.0)
        if self.progress is not None:
            self.progress.stop()

    def _heartbeat(self) -> None:
        """A line every `every` seconds while the job runs, between finished rows too."""
        while not self.stop.wait(min(self.every, 1.0)):
            with self.lock:
                now = time.perf_counter()
                if now - self.last_line < self.every:
                    continue
                try:
                    self.tokens = max(self.tokens, int(self.tokens_now())) if self.tokens_now else self.tokens
                except Exception:  # noqa: BLE001 - a count read mid-update: the last one stays
                    pass
                self.last_line = now
                text = self.line(now, *self._rates(now))
            self._say(text)                    # (outside the lock: a stalled stderr must not stall the job)

    def _rates(self, now: float) -> tuple[float, str]:
        """Tokens a second, and the mean accept length ("-" until a finished row reports cycles:
        the first rows done may be error rows)."""
        al = f"{self.completion_tokens / self.verify_steps:.2f}" if self.verify_steps else "-"
        return self.tokens / max(now - self.started, 1e-9), al

    def _say(self, text: str) -> None:
        if self.gone:
            return
        try:
            self.err.print(text, highlight=False, markup=False, soft_wrap=True)
        except OSError:                        # stderr unwritable (a log on a full disk; a closed pipe is the
            self.gone = True                   # console script's own stderr's to absorb): the job goes on

    def update(self, event: str, info: dict[str, Any]) -> None:
        if event in ("checking", "assembling"):   # steps that read every committed row: say them
            if event == "assembling":             # no more progress lines: every row is done
                self.stop.set()
                if self.beat is not None:
                    self.beat.join(timeout=1.0)   # (a line it is writing comes before this one)
            if not self.quiet:
                what = (f"checking the input against the {info['committed']:,} rows committed in {info['output']}"
                        if event == "checking" else f"assembling {info['rows']:,} rows into {info['output']}")
                self._say(what)
            return
        if event == "start":
            self.total, self.started = info["total"], time.perf_counter()
            self.last_line = self.started
            if self.quiet:
                return
            if info["resumed"]:
                self._say(f"resuming: {info['resumed']:,} rows already committed")
            if not self.bar:
                todo = "?" if self.total is None else f"{self.total:,}"
                self._say(f"started: {todo} rows on {info['device']} (model loaded in {info['load_s']:.1f} s)")
                self.tokens_now = info.get("tokens_now")
                self.beat = threading.Thread(target=self._heartbeat, name="specbatch-progress", daemon=True)
                self.beat.start()
                return
            self.progress = Progress(
                TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>8.1f} tok/s"), TextColumn("accept {task.fields[al]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.err, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("rows", total=info["total"], rate=0.0, al="-")
        elif event == "record":
            rec = info["record"]
            with self.lock:                    # (the heartbeat reads these)
                self.done += 1
                if self.done == 1:
                    self.first_done = time.perf_counter()
                self.on_stdout = info.get("on_stdout")
                self.errors = info.get("errors", self.errors)
                self.tokens = info["tokens"]
                if rec.get("spec"):
                    self.completion_tokens += emitted_tokens(rec["spec"])
                    self.verify_steps += rec["spec"]["verify_steps"]
                if self.progress is not None:          # (in a log, the heartbeat writes the lines)
                    rate, al = self._rates(time.perf_counter())
                    self.progress.update(self.task, advance=1, rate=rate, al=al)

    def line(self, now: float, rate: float, al: str) -> str:
        elapsed = now - self.started
        if self.total:
            share = f"{self.done:,}/{self.total:,} rows ({100 * self.done / self.total:.1f}%)"
            # Rows finish at the pace of the batch only once it runs full: time the pace from the first
            # finished row (the start also holds loading and the first rows' whole generation), and
            # say nothing until a few rows show it.
            paced = self.done - 1
            eta = "ETA ?"
            if paced >= ETA_AFTER_ROWS and now > self.first_done:
                eta = f"ETA {hms((self.total - self.done) * (now - self.first_done) / paced)}"
        else:
            share, eta = f"{self.done:,} rows", "ETA ?"
        return (f"progress: {share}, {rate:,.0f} tok/s, {self.errors:,} errors, accept {al}, "
                f"elapsed {hms(elapsed)}, {eta}")


ETA_AFTER_ROWS = 8


def hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _errors(s: dict[str, Any]) -> str:
    """This run's error rows, and the output's when rows were resumed (a restart after a device
    failure resumes too: the row it wrote as its error was an earlier process's)."""
    whole = s.get("errors_in_output")
    if s.get("resumed") and whole is not None and whole != s["errors"]:
        return f"{s['errors']} ({whole} in the output, resumed rows included)"
    return str(s["errors"])


def print_summary(err: Console, s: dict[str, Any]) -> None:
    table = Table(title="specbatch run", show_header=False)
    if s.get("complete_before"):
        table.add_row("output", escape(f"{s['output']} is already complete ({s['resumed']} rows); pass --overwrite to redo it"))
        err.print(table)
        return
    if s.get("assembled"):                            # nothing left to run: the committed rows, assembled
        below = "" if s.get("limit") is None else f" below --limit {s['limit']}"
        table.add_row("output", escape(f"{s['output']}: no row left to run{below}; assembled from its "
                                       f"{s['rows_in_output']} committed rows"))
        err.print(table)
        return
    rows = [
        ("output", s["output"]), ("recipe", s["recipe"]), ("model", s["model"]),
        ("draft", s["draft"] or "-"), ("device", s["device"]),
        ("requests", f"{s['requests']} ({s['resumed']} resumed from an earlier run)" if s["resumed"] else s["requests"]),
        ("errors", _errors(s)), ("prompt tokens", s["prompt_tokens"]), ("completion tokens", s["completion_tokens"]),
        ("finish reasons", ", ".join(f"{r} {n}" for r, n in (s.get("finish_reasons") or {}).items()) or "-"),
        ("output tokens/s", f"{s['output_tokens_per_s']:.1f} while generating ({s['job_output_tokens_per_s']:.1f} over the whole job)"),
        ("mean accept length", f"{s['mean_accept_length']:.3f}"),
        ("acceptance per draft position", " ".join(f"{r:.2f}" for r in s["acceptance_per_position"]) or "-"),
        ("tokens per target forward", f"{s['tokens_per_target_forward']:.2f} ({s['target_forwards']} batched forwards)"),
        ("wall time", f"{s['wall_s']:.1f} s (model load {s['load_s']:.1f} s, generation {s['generate_s']:.1f} s)"), ("peak memory", f"{s['peak_memory_bytes'] / 2**20:.0f} MiB"),
        ("CUDA graphs", f"captured in {s['capture_s']:.2f} s" if s.get("graphs") else "off (eager)"),
    ]
    if s.get("kv_rows"):                              # what memory (or --gpu-memory-utilization) gave the pool
        where = f", {s['slots']} slots" if s.get("slots") else " in each worker's pool (the smallest)"
        rows.append(("KV pool", f"{s['kv_rows']:,} token rows{where}"))
    if s.get("waited_for_pages"):                     # admission control, never out of memory
        pool = f" (KV pool: {s['kv_rows']:,} rows)" if s.get("kv_rows") else ""
        rows.append(("waited for KV pages", f"{s['waited_for_pages']} requests waited in the queue until pages freed{pool}"))
    if s.get("preempted"):                            # the pool ran short mid-run: recompute, never lost
        rows.append(("preempted", f"{s['preempted']} requests gave their KV pages back when the pool ran short "
                                  f"({s['preemptions']} times) and resumed by recompute "
                                  f"({s['recomputed_tokens']:,} tokens prefilled again)"))
    if s.get("workers_lost"):                         # died or hung mid-job (workers.py): their rows ran elsewhere
        rows.append(("workers lost", f"{s['workers_lost']} died or hung (their unfinished rows ran on the others; "
                                     "their counts end at their last report)"))
    if s.get("engine_failures"):                      # failed steps survived (engine/failures.py)
        rows.append(("engine failures", f"{s['engine_failures']} survived: {s['rows_rerun']} rows in flight rerun "
                                        f"apart, {s['rows_failed_alone']} failed alone (error rows)"))
    if s.get("prompt_tokens_cached"):                 # prefix caching: prefill skipped these
        cached, admitted = s["prompt_tokens_cached"], s["prompt_tokens_admitted"]
        rows.append(("prefix cache", f"{cached:,} of {admitted:,} prompt tokens admitted found in the KV pool "
                                     f"({100 * cached / admitted:.0f}%; a row's n choices each count its prompt): "
                                     "not prefilled again"))
    if s.get("repeated_ids"):                         # ids are the user's join key: say when they are not one
        rows.append(("repeated ids", f"{s['repeated_ids']} rows have the id of an earlier row (the row column "
                                     "tells them apart)"))
    if len(s.get("verify_widths") or {}) > 1:         # adaptive: how many draft nodes the cycles verified
        rows.append(("verify widths", ", ".join(f"{w} nodes: {n} cycles" for w, n in s["verify_widths"].items())))
    for k, v in rows:
        table.add_row(k, escape(str(v)))
    err.print(table)
