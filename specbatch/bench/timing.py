"""Kernel timing inside one CUDA graph: what the kernel microbenchmarks in benchmarks/ share."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def graph_us(calls: list[Callable[[], object]], replays: int = 50) -> float:
    """Median microseconds per call: one graph holds every call once (callers pass enough
    distinct inputs to overflow L2), replayed `replays` times between CUDA events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls[:3]:
            call()                                  # compile / allocate outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)
