"""How many of the drafter's nodes a cycle verifies: the width that emits the most tokens per
second at this batch size, measured as the job runs.

Verifying a prefix of the proposal (its first w nodes; parents come before children, so every
prefix is a tree, and a prefix of two nodes is a chain) is lossless: it is the same proposal with
the later drafts rejected. At a few rows a verify forward costs about one plain step, so the
whole tree pays; at hundreds of rows verify is compute-bound and every node costs time, so a
narrower prefix wins (w = 1 is a plain decoding step; the drafter still catches up on the emitted
token, so it can draft again next cycle).

Every batch adapts, sampled rows included: acceptance emits at each position the very token plain
decoding draws there (its seeded race, speculative/accept.py), so the width decides how many tokens
a cycle emits, never which (a row's sample does not depend on the rows it ran with).

    choose(bucket) -> width               bucket: the padded batch size (a captured graph size)
    record(bucket, width, emitted, seconds)    emitted: the tokens each row emitted

Per width w, the tokens a row emits per cycle: every cycle also says what each narrower width
would have emitted, min(n, w) for a row that emitted n (exact for chains: the accepted drafts are
the path's first ones; for trees an upper bound, as a sibling outside the prefix may have been the
one accepted), so the full width's cycles keep every narrower estimate current. Per (bucket,
width), the seconds a cycle takes (an exponential average). Each width is tried at each bucket
before the rates decide; every REFRESH-th cycle of a bucket retries the width measured longest
ago there, since costs drift as contexts grow and acceptance changes.

Buckets inform each other. A wider verify adds GEMM rows, and what a row costs grows with the
batch (weight reads are shared, FLOPs are not), so the cost of width u over width w < u grows
with the bucket. If u emitted faster than w at some bucket, it does at every smaller one, and if w
did, at every larger one. A width so beaten is dropped from a bucket's candidates, so it is
neither explored nor refreshed there: a job that drains through ever smaller batches does not
spend two plain-step cycles per bucket relearning that the whole proposal pays. A bucket keeps
the width its own measurements rank best, and should the buckets contradict each other
altogether (GEMM speed is not monotone in rows), every width stays.
"""
from __future__ import annotations

ALPHA = 0.25          # weight of a new sample in the cycle-time averages
DECAY = 0.995         # per cycle, of the acceptance sums (a memory of a few hundred cycles)
REFRESH = 16          # every REFRESH-th cycle of a bucket retries the width measured longest ago


def candidate_widths(full: int) -> list[int]:
    """Plain step, one draft, the whole proposal."""
    return sorted({1, min(2, full), full})


class WidthPolicy:
    def __init__(self, full: int, enabled: bool = True):
        self.full = full
        self.widths = candidate_widths(full) if enabled and full > 1 else [full]
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (a new job on the same engine learns its own rates)."""
        self.emitted: dict[int, float] = {w: 0.0 for w in self.widths}   # width -> decayed tokens
        self.rows: dict[int, float] = {w: 0.0 for w in self.widths}      # width -> decayed rows
        self.seconds: dict[tuple[int, int], float] = {}        # (bucket, width) -> seconds per cycle
        self.samples: dict[tuple[int, int], int] = {}
        self.last: dict[tuple[int, int], int] = {}             # (bucket, width) -> the bucket cycle it last ran
        self.cycles: dict[int, int] = {}
        self.used: dict[int, int] = {}                         # width -> cycles (reported in stats)

    @property
    def adaptive(self) -> bool:
        return len(self.widths) > 1

    def per_row(self, w: int) -> float:
        """Tokens a row emits per cycle at width w (1 for a plain step; no data yet: w, so untried
        widths look their best)."""
        return 1.0 if w == 1 else self.emitted[w] / self.rows[w] if self.rows[w] > 0 else float(w)

    def rate(self, bucket: int, w: int) -> float:
        """Tokens a row emits per second of cycle at width w (measured at this bucket)."""
        return self.per_row(w) / self.seconds[(bucket, w)]

    def beaten(self, bucket: int) -> set[int]:
        """Widths that another width outran at another bucket that settles this one: a wider
        width at a larger bucket, or a narrower one at a smaller bucket. (At this bucket itself
        its own rates pick the best, and refresh cycles retry the rest.)"""
        rates: dict[int, dict[int, float]] = {}                # other bucket -> width -> rate
        for b, w in self.seconds:
            if b != bucket:
                rates.setdefault(b, {})[w] = self.rate(b, w)
        out = set()
        for b, r in rates.items():
            for w in r:
                if any((u > w) == (b > bucket) and r[u] > r[w] for u in r if u != w):
                    out.add(w)
        return out

    def candidates(self, bucket: int) -> list[int]:
        """The widths this bucket explores and picks from: those no other bucket settles against,
        and always the one this bucket's own measurements rank best (so two buckets whose data
        disagree cannot each lock the other onto a width its own timings call slower)."""
        beaten = self.beaten(bucket)
        if beaten >= set(self.widths):
            return self.widths
        own = [w for w in self.widths if (bucket, w) in self.seconds]
        if len(own) > 1:
            beaten.discard(max(own, key=lambda w: self.rate(bucket, w)))
        return [w for w in self.widths if w not in beaten]

    def choose(self, bucket: int) -> int:
        if not self.adaptive:
            return self.full
        live = self.candidates(bucket)
        for w in reversed(live):                               # untried first, widest first
            if self.samples.get((bucket, w), 0) < 2:           # the first sample is dropped: see record
                return w
        n = self.cycles[bucket] = self.cycles.get(bucket, 0) + 1
        best = max(live, key=lambda w: self.rate(bucket, w))
        others = [w for w in live if w != best]
        if n % REFRESH == 0 and others:
            return min(others, key=lambda w: self.last.get((bucket, w), -1))
        return best

    def record(self, bucket: int, width: int, emitted: list[int], seconds: float) -> None:
        """A cycle at `width` over rows that emitted `emitted` tokens each, in `seconds`."""
        self.used[width] = self.used.get(width, 0) + 1
        if not self.adaptive or not emitted:
            return
        for w in self.widths:
            if 1 < w <= width:
                self.emitted[w] = self.emitted[w] * DECAY + sum(min(n, w) for n in emitted)
                self.rows[w] = self.rows[w] * DECAY + len(emitted)
        key = (bucket, width)
        seen = self.samples[key] = self.samples.get(key, 0) + 1
        self.last[key] = self.cycles.get(bucket, 0)
        if seen == 1:                 # the first replay of a graph (or a first eager call) runs slow
            return
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + ALPHA * (seconds - old)
