"""Which captured graph size a batch replays: the smallest that holds it, unless a larger size
was timed faster (graphs.replay_sizes; GraphRunner.padded). The GPU side, timing real graphs and
replaying a larger size with the same tokens, is in tests/gpu/test_gpu_graphs.py."""
from __future__ import annotations

from specbatch.engine.graphs import GraphRunner, capture_sizes, replay_sizes


def test_sizes_that_time_monotonically_replay_themselves():
    ms = {s: 1.0 + s / 100 for s in capture_sizes(512)}
    assert replay_sizes(ms) == {s: s for s in capture_sizes(512)}


def test_a_size_a_larger_one_beats_replays_that_one():
    # H100, Llama-3.1-8B GEMMs (benchmarks/gemm_rows.py): 448 rows 14.4 ms, 512 rows 10.5 ms
    ms = {256: 6.5, 320: 7.3, 384: 8.5, 448: 14.4, 512: 10.5}
    assert replay_sizes(ms) == {256: 256, 320: 320, 384: 384, 448: 512, 512: 512}


def test_a_size_replays_the_fastest_larger_size_not_the_next():
    ms = {64: 3.0, 128: 5.0, 192: 6.0, 256: 4.0}
    assert replay_sizes(ms) == {64: 64, 128: 256, 192: 256, 256: 256}
    # 8 is beaten by 16 past the margin, 12 is not: 8 goes to 16, not to 12 (a gain within noise)
    assert replay_sizes({8: 1.0, 12: 0.985, 16: 0.96}) == {8: 16, 12: 12, 16: 16}


def test_within_the_margin_a_size_replays_itself():
    # timing noise of a few percent must not send small batches to a larger graph
    assert replay_sizes({8: 1.02, 16: 1.0}) == {8: 8, 16: 16}
    assert replay_sizes({8: 1.02, 16: 1.0}, margin=0.0) == {8: 16, 16: 16}
    assert replay_sizes({8: 1.10, 16: 1.0}) == {8: 16, 16: 16}
    assert replay_sizes({8: 1.0, 16: 1.0}, margin=0.0) == {8: 8, 16: 16}    # equal: the smaller


def test_the_largest_size_replays_itself():
    assert replay_sizes({512: 99.0}) == {512: 512}
    assert replay_sizes({1: 1.0, 512: 99.0}) == {1: 1, 512: 512}


def runner(sizes):
    return GraphRunner(make_batch=None, groups=[], sizes=sizes)


def test_padded_follows_each_variants_routes():
    r = runner([256, 320, 384, 448, 512])
    r._route[("greedy", 1)] = {256: 256, 320: 320, 384: 384, 448: 512, 512: 512}
    r._route[("greedy", 2)] = {256: 256, 320: 512, 384: 512, 448: 512, 512: 512}
    assert r.padded(400, ("greedy", 1)) == 512          # 448 skipped at width 1
    assert r.padded(300, ("greedy", 1)) == 320
    assert r.padded(300, ("greedy", 2)) == 512
    assert r.padded(400, ("sampled", 4)) == 448          # a variant never timed: every size
    assert r.padded(400) == 448
    assert r.skipped(("greedy", 1)) == {448: 512} and r.skipped(("sampled", 4)) == {}


def test_route_by_time_off_replays_the_smallest_size_that_holds_the_rows():
    r = runner([256, 320, 384, 448, 512])
    r._route[("greedy", 1)] = {256: 256, 320: 512, 384: 512, 448: 512, 512: 512}
    r.route_by_time = False
    assert r.padded(300, ("greedy", 1)) == 320


class _Clock:
    now = 0.0


class _Event:
    """torch.cuda.Event on a fake clock that graph replays advance."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _Clock.now

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.t - self.t


class _Graph:
    def __init__(self, ms, log, size):
        self.ms, self.log, self.size = ms, log, size

    def replay(self):
        self.log.append(self.size)
        _Clock.now += self.ms


def test_timing_replays_every_size_in_two_passes_and_routes_the_batches(monkeypatch):
    from specbatch.engine.graphs import Captured

    monkeypatch.setattr("torch.cuda.Event", _Event)
    ms = {64: 3.0, 128: 5.0, 192: 6.0, 256: 4.0}
    r, log, variant = runner(sorted(ms)), [], ("greedy", 1)
    for size, t in ms.items():             # two graphs per size (propose, verify), half the time each
        r._graphs[(size, variant)] = Captured(None, [_Graph(t / 2, log, size), _Graph(t / 2, log, size)])
    r.time_sizes(variant)
    assert r.replay_ms[variant] == ms
    # largest first with a warm-up replay, then smallest first: 5 replays of both graphs a size
    assert log[:6] == [256] * 6 and log[-4:] == [256] * 4 and sorted(log) == sorted(list(ms) * 10)
    assert r.skipped(variant) == {128: 256, 192: 256}
    assert [r.padded(n, variant) for n in (1, 64, 65, 129, 200)] == [64, 64, 256, 256, 256]
    assert r.timing_seconds > 0 and r.capture_seconds >= r.timing_seconds
