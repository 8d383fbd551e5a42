"""Every GPU of a host from one command (`--gpus all`), or several CPU workers (`--workers N`):
one engine process per device, fed by the parent from the one streaming reader.

    parent: reader -> dispatch (to the worker with the fewest rows in hand) -> records -> writer
    worker: its queue -> Engine.generate (a live feed: WAIT when nothing is ready) -> records

The parent keeps the output (its lock, its parts, the input check), so exactly-once is the
single-process writer's, unchanged: a record counts once it is committed. Dispatch is a work
queue, not a static split: each worker holds at most about its engine's lookahead, so a slow
worker never holds rows another could run. A worker that dies (killed, out of memory) loses
nothing committed; the rows it held are handed to the others, and a new worker starts on its
device (MAX_RESTARTS times in a worker's place, a replacement that dies while loading counted; a job
fails only when no worker is left, after committing what finished). A stop (Ctrl-C, SIGTERM) tells
the workers to end and leaves the waiting for them until the finished rows are committed. A worker
whose device failed (engine.failures.DeviceFailed), or that hung (no progress in hung_limit()
seconds: killed), names the rows it had in flight: each then runs alone on one worker, and one
that brings a device down (or hangs) alone is written as its error. A row that failed alone in a
worker's engine is held here until that engine finishes a row after it; STRIKES of them in a row
end the worker (its engine is at fault, not the rows) and they run elsewhere, as its other rows
do. Workers die with the parent (PR_SET_PDEATHSIG, and a watch on the parent's pid), so a killed
parent leaves no orphan engines; the rerun resumes.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .params import DEFAULT_LOGPROBS_MODE
from .recipe import Recipe

POLL_S = 0.005
CHUNK = 8              # rows per turn of the dispatch
MAX_RESTARTS = 3       # new workers started in the place of one that died mid-job (as Ray's max_restarts)
# A worker holding rows whose engine makes no forward in this long is hung (a wedged device call, a
# stopped process): killed, its rows run elsewhere and a new worker starts in its place. Its engine
# says it moves (a "beat") every HUNG_S / 8 while its forward count grows; far longer than any step.
HUNG_ENV = "SPECBATCH_WORKER_HUNG_S"
HUNG_S = 600.0


def hung_limit() -> float:
    """HUNG_S, or the environment's HUNG_ENV (seconds, >= 1); a ValueError naming it otherwise."""
    raw = os.environ.get(HUNG_ENV)
    if not raw:
        return HUNG_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise ValueError(f"{HUNG_ENV}={raw}: expected the seconds a worker may make no progress, a number >= 1")
    return value


class WorkerError(RuntimeError):
    """Every worker is gone (one line: what the last one said)."""


@dataclass
class WorkerSpec:
    recipe: Recipe
    device: str                      # cuda:N or cpu
    eager: bool
    bucket: int
    threads: int | None = None       # CPU: torch threads of this worker
    prefix_caching: bool = True
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    chat_template: str | None = None         # a chat template (a file, or its text) instead of the model's
    hung_s: float = HUNG_S                   # beats come every hung_s / 8 (the parent's watch)


def devices_for(gpus: str | None, workers: int | None, device: str | None) -> list[str]:
    """The workers' devices: --gpus all | N | 0,1,... (CUDA), or --workers N (on --device, CPU by
    default). One device, one worker: the caller runs in process instead."""
    if gpus is not None:
        import torch

        if workers is not None or device is not None:      # --gpus picks both: one engine per listed GPU
            raise ValueError(f"--gpus with {'--workers' if workers is not None else '--device'}: --gpus runs one "
                             "engine on each GPU it names; give either --gpus or --workers/--device")
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("--gpus: no CUDA device is available (use --workers N on the CPU)")
        text = gpus.strip().lower()
        if text == "all":
            ids = list(range(count))
        elif text.isdigit() and "," not in text:
            ids = list(range(int(text)))
        else:
            try:
                ids = [int(x) for x in text.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"--gpus {gpus}: expected all, a count, or device ids like 0,1,3") from None
        bad = [i for i in ids if not 0 <= i < count]
        if not ids or bad or len(set(ids)) != len(ids) or (text.isdigit() and int(text) > count):
            raise ValueError(f"--gpus {gpus}: this machine has {count} CUDA device{'s' if count != 1 else ''} "
                             f"(0 to {count - 1})")
        return [f"cuda:{i}" for i in ids]
    n = workers or 1
    if n < 1:
        raise ValueError(f"--workers {workers}: expected an integer >= 1")
    return [device or "cpu"] * n


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when its parent dies (also by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)            # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                   # it died before the prctl took effect
        os._exit(1)


def _worker(wid: int, spec: WorkerSpec, parent: int, inbox: Any, outbox: Any) -> None:
    """A worker process: an engine fed from `inbox` (a queue), records to `outbox` (its own pipe:
    if the worker dies mid-message the parent reads EOF, never a half message)."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the parent decides when to stop
    lock = threading.Lock()

    def send(message: tuple) -> None:      # (the beat thread sends too: one message at a time on the pipe)
        with lock:
            outbox.send(message)

    try:
        import torch

        if spec.threads:
            torch.set_num_threads(spec.threads)
        from .engine import WAIT
        from .engine.failures import IDLE, FailedAlone, Vouching
        from .llm import LLM

        t0 = time.perf_counter()
        # what loading says about the model and settings (the same in every worker) is said once, by worker 0
        with contextlib.redirect_stderr(io.StringIO()) if wid else contextlib.nullcontext():
            llm = LLM(recipe=spec.recipe, device=spec.device, eager=spec.eager, bucket=spec.bucket,
                      enable_prefix_caching=spec.prefix_caching, logprobs_mode=spec.logprobs_mode,
                      chat_template=spec.chat_template)
        eng = llm.engine
        send(("ready", wid, {"device": str(eng.device), "max_model_len": eng.max_len,
                             "capture_s": eng.capture_seconds, "load_s": time.perf_counter() - t0,
                             "slots": eng.num_slots}))
        threading.Thread(target=_beat, args=(wid, eng, send, spec.hung_s / 8), daemon=True).start()
        ended = False

        def feed() -> Iterator[Any]:
            nonlocal ended
            pending: list = []
            while True:
                if pending:
                    yield pending.pop(0)
                    continue
                if ended:
                    return
                if os.getppid() != parent:
                    os._exit(1)
                try:
                    msg = inbox.get_nowait()
                except queue.Empty:
                    yield WAIT
                    continue
                if msg is None:
                    ended = True
                else:
                    pending.extend(msg)

        # the parent holds a row that failed alone until this engine finishes one; the strikes are
        # counted here: the third in a row ends this worker (EngineFailed), its rows run elsewhere
        strikes = Vouching()
        for rec in llm.stream(feed(), vouch=False):
            if isinstance(rec, FailedAlone):
                strikes.failed(None, rec.error)
                send(("failed_alone", wid, rec.record))
            elif rec is not IDLE:
                if rec["error"] is None:
                    strikes.finished()
                send(("rec", wid, rec))
        send(("done", wid, _counts(eng)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as one line
        text = " ".join(str(e).split()) or type(e).__name__
        try:
            if hasattr(e, "items") and hasattr(e, "cause"):     # engine.failures.DeviceFailed
                send(("in_flight", wid, [item.row for item in e.items]))
            send(("error", wid, f"{spec.device}: {type(e).__name__}: {text}"))
        except OSError:
            pass
        sys.exit(1)


def _counts(eng: Any) -> dict[str, Any]:
    """What the engine did so far: the summary adds the workers' up."""
    from .stats import peak_memory

    return {"device": str(eng.device), "target_forwards": eng.target_forwards,
            "peak_memory_bytes": peak_memory(eng.device), "tokens_emitted": eng.tokens_emitted,
            "capture_s": eng.capture_seconds, "waited_for_pages": eng.waited,
            "verify_widths": dict(eng.cycle.policy.used), **eng.pool_facts(), **eng.failure_counts.facts()}


def _beat(wid: int, eng: Any, send: Callable[[tuple], None], every: float) -> None:
    """Say the engine moves, `every` seconds while its forward count grows (the parent's watch for
    a hung worker; a stalled main thread stalls the count, not this thread), with its counts so far
    (a worker that dies takes only what it did since its last beat out of the summary)."""
    last = -1
    while True:
        time.sleep(every)
        now = eng.target_forwards
        if now != last:
            try:
                counts = _counts(eng)
            except Exception:  # noqa: BLE001 - (a dict the engine was changing...): the beat goes, the counts next time
                counts = None
            try:
                rows = eng.rows_in_flight()
            except Exception:  # noqa: BLE001 - as above
                rows = None
            try:
                send(("beat", wid, {"counts": counts, "rows": rows}))
            except OSError:
                return
            last = now


@dataclass
class _Worker:
    proc: Any
    inbox: Any
    reader: Any                      # the parent's end of the worker's result pipe
    device: str
    wid: int = 0
    restarts: int = 0                # workers that died on this device before this one
    held: dict[int, Any] = field(default_factory=dict)   # row -> the row it was given, not yet returned
    cap: int = 64
    ready: bool = False
    done: bool = False
    dead: bool = False
    ended: bool = False              # told that no more rows come
    stats: dict[str, Any] = field(default_factory=dict)
    records: int = 0
    error: str = ""                  # what it reported before dying, if anything
    in_flight: list[int] | None = None   # the rows its engine had in flight when its device failed
    alone: int | None = None         # the one row it was given to run alone (a suspect)
    draining: bool = False           # takes no rows but suspects, one at a time, once empty
    unvouched: list[tuple[Any, dict]] = field(default_factory=list)   # (row given, record): failed alone in it
    heard_at: float = 0.0            # time.monotonic() it last said anything, or was given rows empty-handed
    engine_rows: list[int] | None = None     # the rows its engine held at its last beat


class WorkerPool:
    """Engines in worker processes, one per device; `stream(rows)` yields their records in
    completion order, as `Engine.generate` does in process."""

    def __init__(self, recipe: Recipe, devices: list[str], *, eager: bool = False, bucket: int = 0,
                 prefix_caching: bool = True, logprobs_mode: str = DEFAULT_LOGPROBS_MODE,
                 chat_template: str | None = None):
        self.ctx = mp.get_context("spawn")
        threads = None
        if all(d == "cpu" for d in devices):
            threads = max(1, (os.cpu_count() or 1) // len(devices))
        self.hung_s = hung_limit()
        self.specs = [WorkerSpec(recipe=recipe, device=dev, eager=eager, bucket=bucket, threads=threads,
                                 prefix_caching=prefix_caching, logprobs_mode=logprobs_mode,
                                 chat_template=chat_template, hung_s=self.hung_s) for dev in devices]
        self.workers: list[_Worker] = [self._spawn(wid) for wid in range(len(devices))]
        self.delivered: set[int] = set()
        # rows in flight when a worker's device failed (and those an earlier run noted): each runs
        # alone on one worker, so a row that brings a device down alone is written as its error
        self.suspects: set[int] = set()
        self.eager = eager
        self.context: int | None = None      # the job's context (the smallest at start): a restart is held to it
        self.last_error = ""
        self.errors: list[str] = []
        self.unstarted: list[str] = []       # workers that died at the job's start (said by wait_ready)

    def _spawn(self, wid: int, restarts: int = 0) -> _Worker:
        spec = self.specs[wid]
        inbox = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_worker, args=(wid, spec, os.getpid(), inbox, writer), daemon=True)
        proc.start()
        writer.close()                       # the child's copy is the only one: its death reads as EOF
        return _Worker(proc=proc, inbox=inbox, reader=reader, device=spec.device, wid=wid, restarts=restarts)

    # ---- the facts a summary wants ---------------------------------------------------------------

    def wait_ready(self) -> None:
        """Block until every worker loaded its engine (or died); a WorkerError where none did.
        Their facts: per_worker()."""
        while not all(w.ready or w.dead for w in self.workers):
            self._drain([])
        if not any(w.ready and not w.dead for w in self.workers):
            raise WorkerError(f"every worker failed to start: {self.last_error}")
        for failed in self.unstarted:        # (where none started, the error above says it once)
            print(f"warning: {failed}; the job runs on the others", file=sys.stderr)

    def per_worker(self) -> list[dict[str, Any]]:
        # lost: died or hung once started (a replacement dying while loading too), not one failing at the start
        return [{"device": w.device, "records": w.records, "died": w.dead,
                 "lost": w.dead and (w.ready or w.restarts > 0), **w.stats} for w in self.workers]

    # ---- the stream ------------------------------------------------------------------------------

    def stream(self, rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
        source = iter(rows)
        exhausted = False
        redo: list[Any] = []               # rows a dead worker held
        alone: list[Any] = []              # suspects, to run one at a time
        out: list[dict[str, Any]] = []
        stopping = False
        try:
            while True:
                live = [w for w in self.workers if w.ready and not w.dead and not w.ended]
                if not any(not w.dead for w in self.workers):
                    raise WorkerError(f"every worker died; the last said: {self.last_error or 'nothing'}")
                self._run_alone(live, alone)
                # hand rows out in small turns, fewest in hand first, while anyone has room: the
                # rows spread over the workers even when the job is short
                batches: dict[int, list] = {}
                takers = [w for w in live if not w.draining]
                while takers:
                    w = min(takers, key=lambda w: len(w.held))
                    if len(w.held) >= w.cap:
                        break
                    turn = []
                    if not w.held:                  # its silence counts from now (HUNG_S)
                        w.heard_at = time.monotonic()
                    while len(turn) < CHUNK and len(w.held) < w.cap:
                        if redo:
                            item = redo.pop(0)
                        elif not exhausted:
                            item = next(source, None)
                            if item is None:
                                exhausted = True
                                break
                        else:
                            break
                        if item.row in self.suspects:
                            alone.append(item)
                            continue
                        turn.append(item)
                        w.held[item.row] = item
                    if not turn:
                        break
                    batches.setdefault(id(w), []).extend(turn)
                for w in live:
                    if id(w) in batches:
                        w.inbox.put(batches[id(w)])
                # the end: only once no row is in anyone's hands (a dying worker's rows need a taker);
                # rows that failed alone and wait for their engine to finish a row are written
                if exhausted and not redo and not alone and not any(w.held for w in self.workers):
                    for w in self.workers:
                        if not w.dead:
                            yield from self._deliver(w, self._release(w))
                    for w in live:
                        w.inbox.put(None)
                        w.ended = True
                    if all(w.done or w.dead or not w.ready for w in self.workers):
                        return               # (a new worker still loading is not waited for: close() stops it)
                out.clear()
                redo.extend(self._drain(out))
                yield from out
        except BaseException as e:
            # a stop (Ctrl-C, SIGTERM) or a failure passing through: the workers are told to end and
            # not waited for (a hung one would hold it up to 15 s), so that the caller commits the
            # finished rows first and then close()s; the consumer letting go (GeneratorExit): closed
            if not isinstance(e, GeneratorExit):
                stopping = True
                self.stop()
            raise
        finally:
            if not stopping:
                self.close()

    def _run_alone(self, live: list[_Worker], alone: list[Any]) -> None:
        """Suspects go to one worker (the one holding fewest rows), which takes nothing else from
        then on: once it holds nothing it runs them one at a time."""
        if not alone and not any(w.alone is not None for w in live):
            for w in live:
                w.draining = False
            return
        drainer = next((w for w in live if w.draining), None)
        if drainer is None and live:
            drainer = min(live, key=lambda w: len(w.held))
            drainer.draining = True
        if drainer is not None and alone and not drainer.held:
            item = alone.pop(0)
            drainer.alone = item.row
            drainer.heard_at = time.monotonic()     # (empty-handed until now: its silence counts from here)
            drainer.held[item.row] = item
            drainer.inbox.put([item])

    def _drain(self, out: list) -> list[Any]:
        """Read what the workers said (waiting up to POLL_S); notice the dead. -> the rows dead
        workers held, to hand to others. A row redone elsewhere is delivered once."""
        from multiprocessing.connection import wait

        redo: list[Any] = []
        readers = {w.reader: w for w in self.workers if not w.dead and not w.done}
        for reader in wait(list(readers), timeout=POLL_S) if readers else []:
            w = readers[reader]
            while not w.dead and not w.done:     # "done" is its last word: the EOF of its exit is no death
                try:
                    if not reader.poll():
                        break
                    kind, _, payload = reader.recv()
                except (EOFError, OSError):
                    self._bury(w, redo, out)
                    break
                w.heard_at = time.monotonic()
                self._heard(w, kind, payload, out)
        now = time.monotonic()
        for w in list(self.workers):          # (a burial may add a worker)
            if not w.dead and not w.done and not w.proc.is_alive() and not w.reader.poll():
                self._bury(w, redo, out)
            elif (w.ready and not w.dead and not w.done and w.held and now - w.heard_at > self.hung_s
                  and not w.reader.poll()):
                w.error = f"{w.device}: its engine made no progress in {self.hung_s:.0f} s (hung: killed)"
                w.proc.kill()
                w.proc.join(timeout=5)
                # the rows its engine held (at its last beat; all it holds if it never said) run alone
                # elsewhere, as a failed device's in flight: one that hangs alone is its error; the
                # rows it had not taken up yet run as any others
                known = w.engine_rows if w.engine_rows is not None else list(w.held)
                w.in_flight = [w.alone] if w.alone is not None else [r for r in known if r in w.held]
                self._bury(w, redo, out)
        return redo

    def _heard(self, w: _Worker, kind: str, payload: Any, out: list) -> None:
        """One message of worker `w`. A row that failed alone in it is held (`unvouched`) until its
        engine finishes a row after it, or the job ends; the worker ends itself on its third in a
        row (EngineFailed), and _bury hands the held rows to the others."""
        if kind == "ready":
            w.ready, w.stats = True, dict(payload)
            w.cap = max(8, 2 * int(payload.get("slots", 32)) + 8)
            held = payload.get("max_model_len")
            if w.restarts and self.context is not None and held is not None and held != self.context:
                print(f"warning: the new worker on {w.device} holds a context of {held} tokens where the job's "
                      f"is {self.context}: rows reaching past {min(held, self.context)} tokens end differently on "
                      f"it; a new output started with --max-model-len {min(held, self.context)} has one",
                      file=sys.stderr)
        elif kind in ("rec", "failed_alone"):       # payload: the row's record
            item = w.held.pop(payload["row"], None)
            if w.alone == payload["row"]:
                w.alone = None
            if kind == "failed_alone":
                w.unvouched.append((item, payload))
                return
            vouched = self._release(w) if payload["error"] is None else []
            out.extend(self._deliver(w, vouched + [payload]))
        elif kind == "beat":
            w.stats.update(payload.get("counts") or {})
            if payload.get("rows") is not None:
                w.engine_rows = payload["rows"]
        elif kind == "done":
            w.done = True
            w.stats.update(payload)
            out.extend(self._deliver(w, self._release(w)))
        elif kind == "in_flight":
            w.in_flight = list(payload)
        elif kind == "error":
            self.last_error = w.error = payload
            self.errors.append(payload)

    @staticmethod
    def _release(w: _Worker) -> list[dict[str, Any]]:
        held, w.unvouched = w.unvouched, []
        return [rec for _, rec in held]

    def _deliver(self, w: _Worker, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`records` of worker `w` not delivered before (a row redone elsewhere is delivered once)."""
        fresh = [r for r in records if r["row"] not in self.delivered]
        self.delivered.update(r["row"] for r in fresh)
        w.records += len(fresh)
        return fresh

    def _bury(self, w: _Worker, redo: list, out: list) -> None:
        w.dead = True
        for item, _ in w.unvouched:           # rows that failed alone in it, not vouched for: run elsewhere
            if item is not None:
                w.held.setdefault(item.row, item)
        w.unvouched = []
        if not w.error:                      # its own report, else how it ended
            w.proc.join(timeout=1)           # its pipe closed first: reap it for the exit code
            code = w.proc.exitcode
            how = (f"killed by signal {-code}" if code is not None and code < 0 else
                   f"exited with code {code}" if code is not None else "stopped answering")
            w.error = f"{w.device}: worker {how}"
        self.last_error = w.error
        culprit = ""
        if w.in_flight is not None:
            if w.alone is not None and w.in_flight == [w.alone]:      # it brought the device down alone
                rec = self._failed_alone(w.held.pop(w.alone), w.error)
                out.append(rec)
                culprit = f"; it ran row {rec['row']} alone, which is written as its error"
            else:
                self.suspects.update(r for r in w.in_flight if r in w.held)
        # died mid-job, or a replacement died loading (its device's memory not yet freed, say): a new
        # one takes its place; one that died at the job's start is wait_ready's to say
        started = w.ready or w.restarts > 0
        restart = ""
        if started and w.restarts < MAX_RESTARTS:
            self.workers.append(self._spawn(w.wid, w.restarts + 1))
            restart = f" (a new worker starts on {w.device}: restart {w.restarts + 1} of {MAX_RESTARTS})"
        elif started:
            restart = f" (no new worker on {w.device}: its {MAX_RESTARTS} restarts are spent)"
        who = f"worker {w.wid} on cpu" if w.device == "cpu" else f"worker on {w.device}"   # (CPU workers share it)
        if not started:
            self.unstarted.append(f"{who} failed to start ({w.error})")
        else:
            rest = ("go to the other workers" if any(not o.dead for o in self.workers)
                    else "stay unfinished: rerun to resume") + restart
            when = "died" if w.ready else "died while loading its engine"
            print(f"warning: {who} {when} ({w.error}){culprit}; its {len(w.held)} unfinished rows {rest}",
                  file=sys.stderr)
        redo.extend(w.held.values())
        w.held.clear()
        # rows still in its inbox's pipe have no reader: the queue's feeder thread would block on
        # them forever, and this process's exit joins that thread (a finished job that never exits)
        w.inbox.cancel_join_thread()

    def _failed_alone(self, item: Any, error: str) -> dict[str, Any]:
        from .engine.failures import device_failed_alone

        self.delivered.add(item.row)
        self.suspects.discard(item.row)
        return device_failed_alone(item, error)

    def stop(self) -> None:
        """Tell every worker to end, without waiting for them (close() waits)."""
        for w in self.workers:
            w.inbox.cancel_join_thread()     # nobody reads what is still queued for a stopped worker
            if w.proc.is_alive():
                w.proc.terminate()

    def close(self) -> None:
        self.stop()
        for w in self.workers:
            w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5)
