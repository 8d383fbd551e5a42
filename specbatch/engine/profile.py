"""Per-cycle stage timings, when profiling: CUDA events around each stage (or the host clock on
CPU), read after the cycle's one synchronisation."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class CycleTime:
    batch: int                 # active rows
    draft_ms: float
    verify_ms: float           # verify + accept + commit (the whole cycle when fused in one graph)
    extend_ms: float
    wall_ms: float             # its share of the wall clock: launch (or the previous cycle's
                               # finish, if later) to its finish; cycles overlap the host's commit
    tokens: int                # tokens emitted
    context: int = 0           # committed cache rows of the active rows at the cycle's start
    width: int = 1             # nodes verified a row: the target's tokens a row this cycle


class StageTimer:
    """mark() between the cycle's stages, record() after its host copy; a no-op when disabled."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device = enabled, device
        self.times: list[CycleTime] = []

    def mark(self):
        if not self.enabled:
            return None
        if self.device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def record(self, rows: int, marks: list, t0: float, tokens: int, context: int = 0, width: int = 1) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            marks[-1].synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        if len(ms) == 1:                     # one fused graph: all of it counts as verify
            ms = [0.0, ms[0], 0.0]
        self.times.append(CycleTime(batch=rows, draft_ms=ms[0], verify_ms=ms[1], extend_ms=ms[2],
                                    wall_ms=(time.perf_counter() - t0) * 1e3, tokens=tokens,
                                    context=context, width=width))
