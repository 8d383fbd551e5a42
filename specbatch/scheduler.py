"""Static-batch slot scheduler: a fixed number of slots filled from a queue of requests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

R = TypeVar("R")


class SlotError(KeyError):
    """A slot was released that holds no request."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class _Entry(Generic[R]):
    req: R
    length: int
    order: int  # arrival number, for FIFO ties
    skips: int = 0  # times a later request was admitted ahead of this one
    first: bool = False  # put back after preemption: admitted before any other


class SlotScheduler(Generic[R]):
    """Assigns queued requests to `num_slots` slots.

    bucket_window = 0 admits in FIFO order, or with `priority` the queued requests of highest
    priority first (arrival order among equals): the engine gives the longest output budget
    first, so the rows that take the most steps start earliest and a finite job's tail, when few
    rows are left to batch, is short. With W > 0, each admit() looks at the first
    max(W, n) queued requests (n = requests being admitted) and takes the run of n
    consecutive requests, by length, that pads least, so prefill batches waste less. A request
    passed over W times (a later one admitted before it) is admitted before any other.
    """

    def __init__(self, num_slots: int, *, bucket_window: int = 0, length: Callable[[R], int] = len,
                 priority: Callable[[R], int] | None = None) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be an integer >= 1, got {num_slots!r}")
        if isinstance(bucket_window, bool) or not isinstance(bucket_window, int) or bucket_window < 0:
            raise ValueError(f"bucket_window must be an integer >= 0, got {bucket_window!r}")
        self.num_slots = num_slots
        self.bucket_window = bucket_window
        self._length = length
        self._priority = priority
        self._queue: deque[_Entry[R]] = deque()
        self._active: dict[int, R] = {}
        self._arrivals = 0
        self._requeued = 0

    def add(self, req: R) -> None:
        self._queue.append(_Entry(req, int(self._length(req)), self._arrivals))
        self._arrivals += 1

    def requeue(self, req: R) -> None:
        """Put a request taken out of its slot (preempted) back at the front of the queue: the
        next admission takes it before any other (preempted ones in the order they were put back)."""
        behind = next((i for i, e in enumerate(self._queue) if not e.first), len(self._queue))
        self._queue.insert(behind, _Entry(req, int(self._length(req)), self._requeued - 2**62, self.bucket_window, True))
        self._requeued += 1

    def queued(self) -> int:
        return len(self._queue)

    def free_slots(self) -> list[int]:
        return [s for s in range(self.num_slots) if s not in self._active]

    def active(self) -> list[tuple[int, R]]:
        return sorted(self._active.items(), key=lambda item: item[0])

    def admit(self, fits: Callable[[R], bool] | None = None) -> list[tuple[int, R]]:
        """Fill free slots, lowest first, from the queue; returns the new (slot, request) pairs.
        `fits(req)`: whether memory holds one more request (called in admission order; the
        first that does not fit stops the admission, so a large request is never starved)."""
        free = self.free_slots()
        n = min(len(free), len(self._queue))
        if n == 0:
            return []
        if self.bucket_window:
            chosen = self._take_bucketed(n)
        elif self._priority is not None:
            chosen = self._take_first(n)
        else:
            chosen = self._take_fifo(n)
        if self._priority is not None and not self.bucket_window:
            chosen.sort(key=lambda e: (not e.first, -self._priority(e.req), e.order))
        else:
            chosen.sort(key=lambda e: (not e.first, e.order))
        if fits is not None:
            for i, e in enumerate(chosen):
                if not fits(e.req):
                    self._queue.extendleft(reversed(chosen[i:]))     # back at the front, in order
                    chosen = chosen[:i]
                    break
        pairs = list(zip(free, (e.req for e in chosen)))
        self._active.update(pairs)
        return pairs

    def release(self, slot: int) -> R:
        """Free `slot` and return the request it held."""
        if slot not in self._active:
            busy = sorted(self._active)
            raise SlotError(f"slot {slot} is not active (active slots: {busy}, num_slots={self.num_slots})")
        return self._active.pop(slot)

    def clear_active(self) -> list[tuple[int, R]]:
        """Free every slot; returns what they held."""
        held = self.active()
        self._active.clear()
        return held

    def queued_requests(self) -> list[R]:
        return [e.req for e in self._queue]

    def drop(self, pred: Callable[[R], bool]) -> list[R]:
        """Remove the queued requests for which `pred` holds; returns them."""
        kept: deque[_Entry[R]] = deque()
        gone = []
        for e in self._queue:
            (gone.append(e.req) if pred(e.req) else kept.append(e))
        self._queue = kept
        return gone

    def _take_fifo(self, n: int) -> list[_Entry[R]]:
        return [self._queue.popleft() for _ in range(n)]

    def _take_first(self, n: int) -> list[_Entry[R]]:
        """The n queued entries of highest priority (earliest arrival among equals); the rest keep
        their order."""
        ranked = sorted(self._queue, key=lambda e: (not e.first, -self._priority(e.req), e.order))[:n]
        taken = {id(e) for e in ranked}
        self._queue = deque(e for e in self._queue if id(e) not in taken)
        return ranked

    def _take_bucketed(self, n: int) -> list[_Entry[R]]:
        size = min(len(self._queue), max(self.bucket_window, n))
        window = [self._queue.popleft() for _ in range(size)]
        starved = [e for e in window if e.skips >= self.bucket_window]
        if len(starved) >= n:
            chosen = starved[:n]
        else:
            rest = sorted((e for e in window if e.skips < self.bucket_window), key=lambda e: (e.length, e.order))
            chosen = starved + self._best_run(rest, n - len(starved), starved)
        taken = {id(e) for e in chosen}
        newest = max(e.order for e in chosen)
        kept = [e for e in window if id(e) not in taken]
        for e in kept:
            if e.order < newest:
                e.skips += 1
        self._queue.extendleft(reversed(kept))
        return chosen

    @staticmethod
    def _best_run(by_length: list[_Entry[R]], m: int, forced: list[_Entry[R]]) -> list[_Entry[R]]:
        """The m consecutive entries of `by_length` that, together with `forced`, pad least."""
        if m == 0:
            return []
        forced_max = max((e.length for e in forced), default=0)
        total = m + len(forced)
        prefix = [0]
        for e in by_length:
            prefix.append(prefix[-1] + e.length)
        best: tuple[int, int] | None = None
        best_start = 0
        for start in range(len(by_length) - m + 1):
            run_max = max(by_length[start + m - 1].length, forced_max)
            padding = run_max * total - (prefix[start + m] - prefix[start])
            oldest = min(e.order for e in by_length[start : start + m])
            key = (padding, oldest)  # ties go to the run holding the oldest request
            if best is None or key < best:
                best, best_start = key, start
        return by_length[best_start : best_start + m]
