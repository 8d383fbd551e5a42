"""CUDA graphs of the cycle's device stages.

The engine hands over its stage functions (propose; verify + accept + commit; extend), grouped
into the graphs to capture, and a factory of static batches (input buffers: slots and sampling
parameters). Each (padded batch size, sampling variant) gets one graph per group, captured
largest batch first with one shared memory pool (a job's first variant: every size at once, as
the all-greedy one at start; a variant first met later in a job: its largest size, then the
size asked for). A smaller batch replays the next captured size;
its pad rows point at the dummy slot. Nothing here knows what the stages compute.

Sizes a batch may replay: a GEMM's speed does not grow smoothly with its rows (cuBLAS picks its
kernel per shape; on an H100 at Llama-3.1-8B shapes, 448 rows take 14.4 ms of GEMMs where 512
take 10.5 ms), so once a variant's sizes are captured they can be timed, replayed with pad rows
only, and a size that a larger one beats is skipped: its batches replay the larger graph.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

Stage = Callable[[Any], None]


def capture_sizes(max_batch: int) -> list[int]:
    """Every size to 8, then steps growing with the batch (pad waste stays under ~25%)."""
    steps = [*range(1, 9), 12, 16, 24, 32, 40, 48, 56, 64, *range(80, 129, 16), *range(160, 257, 32),
             *range(320, max(max_batch, 320) + 1, 64)]
    return sorted({s for s in steps if s < max_batch} | {max_batch})


def padded_size(sizes: list[int], rows: int) -> int:
    """The smallest of the sorted `sizes` that holds `rows` rows."""
    i = bisect.bisect_left(sizes, rows)
    if i == len(sizes):
        raise ValueError(f"batch of {rows} rows exceeds the largest captured size {sizes[-1]}")
    return sizes[i]


def replay_sizes(ms: dict[int, float], margin: float = 0.03) -> dict[int, int]:
    """size -> the size its batches replay, from each size's replay time: the fastest size at
    least as large (the smallest of equals), where that one is more than `margin` faster (its
    batches fit there too, and finish sooner); else the size itself."""
    route, best = {}, None
    for size in sorted(ms, reverse=True):
        if best is None or ms[size] <= ms[best]:
            best = size
        route[size] = best if ms[best] < ms[size] * (1 - margin) else size
    return route


@contextlib.contextmanager
def _no_collection(collect: bool = True):
    """Collect garbage now (`collect`), and none while capturing: an unreachable engine of an
    earlier job (its graphs and buffers; engines hold reference cycles) freed by the collector in
    the middle of a capture breaks it ("operation failed due to a previous error during
    capture"), and torch no longer collects before a capture itself. The collection frees such an
    engine's memory before the captures of an engine's start; a variant first met mid-job skips it
    (~0.1-0.2 s with a model's objects loaded, at each size the job's occupancy reaches)."""
    if collect:
        gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class Captured:
    batch: Any                                   # the engine's batch over static buffers
    graphs: list[torch.cuda.CUDAGraph]           # one per stage group, replayed in order
    layout: Any = None                           # the (slot, request) pairs the buffers hold now (skips refilling)


@dataclass
class GraphRunner:
    make_batch: Callable[[int, Hashable], Any]   # (padded size, variant) -> static batch
    groups: list[list[Stage]]                    # stage functions, one list per graph
    sizes: list[int]
    capture_seconds: float = 0.0                 # capturing, and timing the sizes
    timing_seconds: float = 0.0                  # ... of it timing the sizes
    _pool: Any = None
    _stream: Any = None                          # every capture's stream: the pool reuses blocks per stream
    _graphs: dict[tuple[int, Hashable], Captured] = field(default_factory=dict)
    replay_ms: dict[Hashable, dict[int, float]] = field(default_factory=dict)   # variant -> size -> ms
    _route: dict[Hashable, dict[int, int]] = field(default_factory=dict)        # variant -> size -> size replayed
    route_by_time: bool = True                   # False: the smallest captured size (bench A/B)

    def capture_all(self, variant: Hashable, time_sizes: bool = False) -> None:
        """Capture every size of `variant` not captured yet; with `time_sizes`, time each (once)
        and keep the fastest."""
        missing = [size for size in sorted(self.sizes, reverse=True) if (size, variant) not in self._graphs]
        if missing:
            with _no_collection():
                for size in missing:
                    self._capture(size, variant)
        if time_sizes and variant not in self._route:
            self.time_sizes(variant)

    def drop(self, which: Callable[[Hashable], bool]) -> None:
        """Forget the graphs of the variants `which` picks (their pool blocks free for others)."""
        for key in [k for k in self._graphs if which(k[1])]:
            del self._graphs[key]
        for variant in [v for v in self._route if which(v)]:
            del self._route[variant]
            self.replay_ms.pop(variant, None)

    def captured(self, variant: Hashable) -> list[Captured]:
        """`variant`'s graphs captured so far, one entry per size."""
        return [c for (_, v), c in self._graphs.items() if v == variant]

    def complete(self, variant: Hashable) -> bool:
        """Whether every size of `variant` is captured."""
        return all((size, variant) in self._graphs for size in self.sizes)

    def time_sizes(self, variant: Hashable) -> None:
        """Time each captured size of `variant` and route its batches (replay_sizes). Its batches
        must hold pad rows only (a filled one would run its rows again: SpecCycle._replays empties
        them first)."""
        t0 = time.perf_counter()
        # two passes, largest first then smallest first (clocks settling, neighbours' caches)
        runs: dict[int, list[float]] = {size: [] for size in self.sizes}
        for first, order in ((True, sorted(self.sizes, reverse=True)), (False, sorted(self.sizes))):
            for size in order:
                runs[size] += self._replay_ms(size, variant, warm=first)
        ms = self.replay_ms[variant] = {size: sorted(t)[len(t) // 2] for size, t in runs.items()}
        self._route[variant] = replay_sizes(ms)
        spent = time.perf_counter() - t0
        self.timing_seconds += spent
        self.capture_seconds += spent

    def skipped(self, variant: Hashable) -> dict[int, int]:
        """size -> the larger size `variant`'s batches of that size replay (it was timed faster)."""
        return {s: r for s, r in self._route.get(variant, {}).items() if r != s}

    def padded(self, rows: int, variant: Hashable = None) -> int:
        """The captured size a batch of `rows` rows replays."""
        size = padded_size(self.sizes, rows)
        return self._route[variant][size] if self.route_by_time and variant in self._route else size

    def get(self, rows: int, variant: Hashable) -> Captured:
        """The graphs for `rows` active rows (captured now if this variant was not used yet)."""
        key = (self.padded(rows, variant), variant)
        if key in self._graphs:
            return self._graphs[key]
        with _no_collection(collect=False):
            top = (self.sizes[-1], variant)
            if top not in self._graphs:
                # A new variant's largest size first, as capture_all does: the blocks its temporaries
                # leave free in the shared pool serve every smaller size after it, where sizes
                # captured smallest first (a job's occupancy ramping up) each took new blocks of
                # their own and grew the pool past the room planned for it (out of memory at 512
                # slots with processors, Llama-3.1-8B shapes, an 80 GB GPU)
                self._capture(*top)
            return self._graphs[key] if key == top else self._capture(*key)

    def _capture(self, size: int, variant: Hashable) -> Captured:
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            # One side stream for every capture: the caching allocator hands a freed block only to
            # allocations on the stream it was made on, so a fresh stream per capture left each
            # capture's temporaries in blocks no later capture could take (the shared pool grew by
            # ~260 MB a graph for rows with processors at 512 slots, Llama-3.1-8B shapes)
            self._stream = torch.cuda.Stream()
        batch = self.make_batch(size, variant)
        # Warm-up outside capture, on a side stream as torch asks: compiles Triton kernels and
        # sets up cuBLAS workspaces. Every row of a fresh batch is a pad row (dummy slot).
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for group in self.groups:
                for stage in group:
                    stage(batch)
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        # The outer stream context puts the caller's stream back whatever happens: torch.cuda.graph's
        # own exit instantiates the graph before it restores the stream, so an allocation failing
        # there (a CUDA error: out of memory, which the caller survives) would leave the process on
        # `side` for good.
        with torch.cuda.stream(side):
            for group in self.groups:
                g = torch.cuda.CUDAGraph()
                with warnings.catch_warnings():
                    # a stage with no device work (vanilla's extend) captures an empty graph
                    warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
                    # on our own stream: torch's default capture stream is made once per process, on
                    # whichever device was current then
                    with torch.cuda.graph(g, pool=self._pool, stream=side):
                        for stage in group:
                            stage(batch)
                graphs.append(g)
        torch.cuda.synchronize()
        captured = self._graphs[(size, variant)] = Captured(batch, graphs)
        self.capture_seconds += time.perf_counter() - t0
        return captured

    def _replay_ms(self, size: int, variant: Hashable, reps: int = 2, warm: bool = True) -> list[float]:
        """ms of `reps` replays of a size's graphs, every row a pad row (with `warm`, a first
        replay not counted). Pad rows write only the dummy slot, which every cycle resets."""
        graphs = self._graphs[(size, variant)].graphs
        out = []
        for i in range(reps + warm):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for g in graphs:
                g.replay()
            end.record()
            end.synchronize()
            if i or not warm:
                out.append(start.elapsed_time(end))
        return out
