"""How many of the drafter's nodes a cycle verifies: the width that emits the most tokens per
second at this batch size, measured as the job runs.

Verifying a prefix of the proposal (its first w nodes; parents come before children, so every
prefix is a tree, and a prefix of two nodes is a chain) is lossless: it is the same proposal with
the later drafts rejected. At a few rows a verify forward costs about one plain step, so the
whole tree pays; at hundreds of rows verify is compute-bound and every node costs time, so a
narrower prefix wins (w = 1 is a plain decoding step; the drafter still catches up on the emitted
token, so it can draft again next cycle).

Only all-greedy batches adapt. With sampling, which width a cycle verified decides which uniform
draws a row consumes, and a row's sample must not depend on the rows it ran with (a resumed job
or a Ray retry writes the same bytes), so sampled batches verify the full width.

    choose(bucket, greedy) -> width       bucket: the padded batch size (a captured graph size)
    record(bucket, width, rows, emitted, seconds)

Per width, the tokens a row emits per cycle (the acceptance; w = 1 emits exactly one); per
(bucket, width), the seconds a cycle takes (exponential averages). Each width is tried at each
bucket before the rates decide, and the runner-up is retried now and then, since the costs drift
as contexts grow.
"""
from __future__ import annotations

ALPHA = 0.25          # weight of a new sample in the averages
REFRESH = 24          # every REFRESH-th cycle of a bucket retries the runner-up


def candidate_widths(full: int) -> list[int]:
    """Plain step, one draft, the whole proposal."""
    return sorted({1, min(2, full), full})


class WidthPolicy:
    def __init__(self, full: int, enabled: bool = True):
        self.full = full
        self.widths = candidate_widths(full) if enabled and full > 1 else [full]
        self.per_row: dict[int, float] = {1: 1.0}              # width -> tokens a row emits per cycle
        self.seconds: dict[tuple[int, int], float] = {}        # (bucket, width) -> seconds per cycle
        self.samples: dict[tuple[int, int], int] = {}
        self.cycles: dict[int, int] = {}
        self.used: dict[int, int] = {}                         # width -> cycles (reported in stats)

    @property
    def adaptive(self) -> bool:
        return len(self.widths) > 1

    def choose(self, bucket: int, greedy: bool) -> int:
        if not greedy or not self.adaptive:
            return self.full
        for w in reversed(self.widths):                        # untried first, widest first
            if self.samples.get((bucket, w), 0) < 2:           # the first sample is dropped: see record
                return w
        rates = sorted(((self.per_row[w] / self.seconds[(bucket, w)], w) for w in self.widths), reverse=True)
        n = self.cycles[bucket] = self.cycles.get(bucket, 0) + 1
        return rates[1][1] if n % REFRESH == 0 else rates[0][1]

    def record(self, bucket: int, width: int, rows: int, emitted: int, seconds: float) -> None:
        self.used[width] = self.used.get(width, 0) + 1
        if not self.adaptive or rows == 0:
            return
        key = (bucket, width)
        seen = self.samples[key] = self.samples.get(key, 0) + 1
        if seen == 1:                 # the first replay of a graph (or a first eager call) runs slow
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + ALPHA * (seconds - old)
        if width > 1:
            per = emitted / rows
            old = self.per_row.get(width)
            self.per_row[width] = per if old is None else old + ALPHA * (per - old)
