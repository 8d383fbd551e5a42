"""The engine failing mid-job: which failures a job survives, and what a row that fails alone becomes.

A Python exception in a prefill or a cycle (a bug that some row's length or parameters reach, a
CUDA out-of-memory) leaves the process usable: the engine puts the rows that were in flight
aside, reruns them in halves (each half a job of its own, which recovers the same way) until a
row fails alone, and that row becomes its error record; every other row runs to its end as it
would have. A failed allocation is one of these, whichever layer reports it (`out_of_memory`).
A CUDA error (an illegal address, a device-side assert) leaves the device unusable for this
process: it ends the job (DeviceFailed, naming the rows in flight), finished rows
committed; the rerun runs those rows one at a time before the rest, so a row that brings the
device down alone is written as its error and the job goes past it.

When rows keep failing alone with no row finishing between them, the fault is the engine's, not
the rows': the job stops (EngineFailed) and those rows are not written, so a rerun retries them.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..data import RowRequest
from ..prompts import exception_line
from ..records import DEVICE_FAILED, ENGINE_FAILED, error_record

STRIKES = 3     # rows failing alone one after another, none finishing between them: the engine's fault
IDLE = object()  # the job loop to `vouched`: a live feed has nothing ready and nothing runs


class EngineFailed(RuntimeError):
    """The engine failed on several rows in a row, each run alone: not a row's fault."""


class DeviceFailed(RuntimeError):
    """A failure the process cannot go on after (a CUDA error), with the rows it had in flight:
    one of them may be its cause (the job runs them one at a time on the rerun, job.py)."""

    def __init__(self, items: list[RowRequest], cause: BaseException, device: torch.device):
        self.items, self.cause = items, exception_line(cause)
        # a CUDA context in error state can abort the interpreter's exit (destructors that call
        # into it): the CLI leaves with os._exit once the output is committed
        self.hard_exit = device.type == "cuda"
        super().__init__(f"{self.cause} (with {len(items)} row{'s' if len(items) != 1 else ''} in flight)")


@dataclass
class FailedAlone:
    """A row that failed when it ran alone: its error record, held until a later row finishes."""
    record: dict[str, Any]
    error: BaseException


@dataclass
class FailureCounts:
    failures: int = 0       # failures survived (each put its in-flight rows aside)
    rows_rerun: int = 0     # rows put aside and rerun
    failed_alone: int = 0   # rows that failed alone (error records)

    def facts(self) -> dict[str, int]:
        return {"engine_failures": self.failures, "rows_rerun": self.rows_rerun, "rows_failed_alone": self.failed_alone}


# an allocation outside torch's allocator that failed (a graph's instantiation, a library's
# workspace), reported as a CUDA error: cudaErrorMemoryAllocation does not poison the context
_ALLOCATION_FAILED = ("CUDA error: out of memory", "cudaErrorMemoryAllocation", "CUBLAS_STATUS_ALLOC_FAILED",
                      "Triton Error [CUDA]: out of memory")


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed, the device unharmed: torch's own allocator
    (OutOfMemoryError) or one outside it, or an error raised while one propagated (a graph
    capture that the allocation invalidated fails again as the capture ends)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or (
                isinstance(e, RuntimeError) and any(t in str(e) for t in _ALLOCATION_FAILED)):
            return True
        e = e.__cause__ or e.__context__
    return False


def survivable(e: BaseException, device: torch.device) -> bool:
    """Whether the engine can go on after `e`: a Python exception or a failed allocation, the
    device still answering."""
    if not isinstance(e, Exception) or isinstance(e, (EngineFailed, DeviceFailed)):
        return False
    if not out_of_memory(e):
        accelerator_error = getattr(torch, "AcceleratorError", None)      # torch >= 2.8: CUDA errors
        if accelerator_error is not None and isinstance(e, accelerator_error):
            return False
        text = str(e)
        if "CUDA error" in text or "CUBLAS_STATUS" in text or "CUDNN_STATUS" in text:
            return False
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)        # work still queued may fail too: the device decides
            torch.cuda.empty_cache()              # an out-of-memory: what the failed step held goes back
        except Exception:  # noqa: BLE001 - a device that cannot synchronise cannot go on
            return False
    return True


def warn_failure(e: BaseException, rows: int) -> None:
    print(f"warning: the engine failed with {rows} row{'s' if rows != 1 else ''} in flight ({exception_line(e)}); "
          "rerunning them apart to find the row that fails", file=sys.stderr, flush=True)


def failed_alone(item: RowRequest, e: BaseException) -> FailedAlone:
    return FailedAlone(error_record(item.row, item.id, f"{item.place}: {ENGINE_FAILED}, "
                                    f"and again when it ran alone ({exception_line(e)}); the other rows ran without it",
                                    item.keep, batch_line=item.batch_line), e)


def device_failed_alone(item: RowRequest, cause: str) -> dict[str, Any]:
    """The error record of a row that brought the device down running alone (job.py, workers.py)."""
    return error_record(item.row, item.id, f"{item.place}: {DEVICE_FAILED} ({cause}); "
                        "it was left out", item.keep, batch_line=item.batch_line)


def engine_failed(e: BaseException) -> EngineFailed:
    return EngineFailed(f"the engine failed on {STRIKES} rows one after another, each run alone, with no row "
                        f"finishing between them ({exception_line(e)}): the fault is not the rows'")


class Vouching:
    """Rows that failed alone, held until a row finishes after them on the same engine (it works:
    the rows are at fault) or their caller lets them go (the input ended); STRIKES of them in a
    row, none finishing between them, raise EngineFailed. `vouched` keeps one for a job loop; a
    pool's worker one for its strikes alone (the parent holds its rows: workers.py)."""

    def __init__(self) -> None:
        self.held: list[Any] = []
        self.strikes = 0

    def failed(self, held: Any, error: BaseException) -> None:
        self.strikes += 1
        if self.strikes >= STRIKES:
            raise engine_failed(error) from error
        self.held.append(held)

    def finished(self) -> list[Any]:
        """A row finished: -> what was held, now vouched for."""
        self.strikes = 0
        return self.release()

    def release(self) -> list[Any]:
        held, self.held = self.held, []
        return held


def vouched(records: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """The job loop's records, a row that failed alone held (Vouching) until a row finishes after
    it, or until the input ends or a live feed idles (IDLE: it may wait for that row before it ends)."""
    vouching = Vouching()
    for rec in records:
        if rec is IDLE:
            yield from vouching.release()
        elif isinstance(rec, FailedAlone):
            vouching.failed(rec.record, rec.error)
        else:
            if rec["error"] is None:
                yield from vouching.finished()
            yield rec
    yield from vouching.release()


def touched(sched: Any, inputs: dict[int, tuple[RowRequest, list]]) -> list[int]:
    """Rows (of `inputs`: row -> its input and requests) with a request in one of `sched`'s slots,
    or taken from its queue by a step that failed before it took a slot."""
    active = {id(req) for _, req in sched.active()}
    queued = {id(req) for req in sched.queued_requests()}
    return [row for row, (_, reqs) in inputs.items()
            if any(id(r) in active or (not r.finished and id(r) not in queued) for r in reqs)]
