"""A stand-in for GraphRunner on the CPU: "replays" by calling the stages on the static batch the
runner would capture (fixed size, pad rows on the dummy slot, buffers refilled by `_fill` when
the active set changes, kv_bound the whole cache), so CPU tests run the code CUDA graphs capture."""
from __future__ import annotations

from specbatch.engine.graphs import Captured, capture_sizes


class _Replay:
    def __init__(self, stages, batch):
        self.stages, self.batch = stages, batch

    def replay(self):
        for stage in self.stages:
            stage(self.batch)


class EmulatedGraphs:
    """GraphRunner's interface, stages run eagerly on the static batches it would capture."""

    def __init__(self, cycle, fused: bool):
        stages = [cycle._propose, cycle._verify, cycle._extend]
        self.groups = [stages] if fused else [[s] for s in stages]
        self.make_batch = cycle._static_batch
        self.sizes = capture_sizes(len(cycle.state.seq_lens) - 1)[-1:]    # always padded to the largest: pad rows
        self.capture_seconds = 0.0
        self.variants: list = []
        self.widths: list = []
        self.captured_all: list = []              # variants captured at every size (a job's first)
        self.timed: set = set()                   # variants whose sizes were timed (GraphRunner._route)
        self._graphs: dict = {}

    def capture_all(self, variant, time_sizes: bool = False):
        self.captured_all.append(variant)
        for size in self.sizes:
            if (size, variant) not in self._graphs:
                batch = self.make_batch(size, variant)
                self._graphs[(size, variant)] = Captured(batch, [_Replay(g, batch) for g in self.groups])
        if time_sizes and variant not in self.timed:
            # GraphRunner.time_sizes: each size's graphs replayed on whatever its buffers hold
            for size in self.sizes:
                for g in self._graphs[(size, variant)].graphs:
                    g.replay()
            self.timed.add(variant)

    def captured(self, variant):
        return [c for (_, v), c in self._graphs.items() if v == variant]

    def drop(self, which):
        for key in [k for k in self._graphs if which(k[1])]:
            del self._graphs[key]
        self.timed = {v for v in self.timed if not which(v)}

    def get(self, n, variant):
        size = next(s for s in self.sizes if s >= n)
        self.variants.append(variant[0])          # (sampling variant, verified width)
        self.widths.append(variant[1])
        key = (size, variant)
        if key not in self._graphs:
            batch = self.make_batch(size, variant)
            self._graphs[key] = Captured(batch, [_Replay(g, batch) for g in self.groups])
        return self._graphs[key]
