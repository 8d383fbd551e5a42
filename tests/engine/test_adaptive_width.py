"""Adaptive verify width (engine/adaptive.py): cycles, greedy or sampled, verify the prefix of the
proposal that emits the most tokens per second at the batch size. The policy against synthetic costs; the
engine (eager, and the graph path emulated on the CPU) with every recipe shape: outputs identical
to vanilla whatever widths were chosen, every candidate width used, and with an oracle draft every
verified draft accepted (so a width-w cycle emits exactly w tokens)."""
from __future__ import annotations

import pytest
import torch

from graph_emulation import EmulatedGraphs
from oracle import OracleDrafter
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.engine.adaptive import REFRESH, WidthPolicy, candidate_widths
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _drive(policy: WidthPolicy, bucket: int, cost, accepted, cycles: int) -> list[int]:
    """Run `cycles` choices against cost(w) seconds; rows accept drafts in a chain with the
    per-position probabilities `accepted` (a fixed pattern of rows, so estimates are exact)."""
    # 20 rows: row r accepts its first d drafts where d follows the conditional probabilities
    drafts = []
    for r in range(20):
        d, u = 0, (r + 0.5) / 20
        for p in accepted:
            u /= p
            if u >= 1:
                break
            d += 1
        drafts.append(d)
    chosen = []
    for _ in range(cycles):
        w = policy.choose(bucket)
        policy.record(bucket, w, [min(d + 1, w) for d in drafts], seconds=cost(w))
        chosen.append(w)
    return chosen


def test_candidates():
    assert candidate_widths(4) == [1, 2, 4] and candidate_widths(2) == [1, 2] and candidate_widths(1) == [1]
    assert WidthPolicy(8).widths == [1, 2, 8]
    assert WidthPolicy(8, enabled=False).widths == [8] and not WidthPolicy(1).adaptive


def test_narrower_widths_are_estimated_from_wider_cycles():
    p = WidthPolicy(4)
    p.record(1, 4, [1, 2, 3, 4], 0.01)            # emitted per row at width 4
    assert p.per_row(4) == 2.5 and p.per_row(2) == (1 + 2 + 2 + 2) / 4 and p.per_row(1) == 1.0
    p.record(1, 2, [2, 2, 2, 2], 0.01)            # a width-2 cycle says nothing about width 4
    assert p.per_row(4) == pytest.approx(2.5, rel=0.01)


ACCEPT = (0.8, 0.6, 0.45)          # per-row tokens: width 1 -> 1, 2 -> 1.8, 4 -> 2.5


def test_explores_every_width_widest_first_then_picks_the_best_rate():
    flat = WidthPolicy(4)                      # verify costs the same at any width (a small batch)
    chosen = _drive(flat, 4, lambda w: 0.010, ACCEPT, 6 + 100)
    assert chosen[:6] == [4, 4, 2, 2, 1, 1]
    assert chosen[6:].count(4) > 90            # other widths only on refresh cycles
    steep = WidthPolicy(4)                     # compute-bound: cost grows with the width
    chosen = _drive(steep, 256, lambda w: 0.010 * w, ACCEPT, 6 + 100)
    assert chosen[6:].count(1) > 90
    middle = WidthPolicy(4)                    # cost 1 : 1.2 : 2 -> rates 1, 1.5, 1.25: one draft pays best
    chosen = _drive(middle, 64, {1: 0.010, 2: 0.012, 4: 0.020}.get, ACCEPT, 6 + 4 * REFRESH)
    assert chosen[6:].count(2) >= 4 * REFRESH - 4
    assert set(chosen[6:]) == {1, 2, 4}        # refresh cycles rotate through the other widths


def test_buckets_are_separate():
    p = WidthPolicy(4)
    _drive(p, 1, lambda w: 0.010, ACCEPT, 20)
    assert p.choose(256) == 4                  # a new bucket explores afresh
    assert WidthPolicy(4, enabled=False).choose(1) == 4


FLAT = lambda w: 0.010                 # noqa: E731  (a few rows: verify costs the same at any width)
STEEP = lambda w: 0.010 * w            # noqa: E731  (compute-bound: cost grows with the width)


def test_a_width_beaten_at_a_larger_bucket_is_not_explored_at_smaller_ones():
    p = WidthPolicy(4)
    _drive(p, 64, FLAT, ACCEPT, 6)              # 64 rows: the whole proposal pays
    assert p.beaten(32) == {1, 2} and p.beaten(64) == set()
    drained = [c for b in (48, 32, 16, 8, 4, 2, 1) for c in _drive(p, b, FLAT, ACCEPT, 3 * REFRESH)]
    assert set(drained) == {4}                  # neither explored nor refreshed while draining
    chosen = _drive(p, 64, FLAT, ACCEPT, 4 * REFRESH)
    assert set(chosen) == {1, 2, 4}             # at the bucket itself refresh cycles still retry
    assert p.beaten(128) == set()               # says nothing about a larger batch
    assert _drive(p, 128, FLAT, ACCEPT, 6) == [4, 4, 2, 2, 1, 1]


def test_a_narrower_width_that_won_settles_larger_buckets():
    p = WidthPolicy(4)
    _drive(p, 256, STEEP, ACCEPT, 6)            # compute-bound: a plain step wins
    assert p.beaten(512) == {2, 4} and p.beaten(128) == set()
    assert set(_drive(p, 512, STEEP, ACCEPT, 2 * REFRESH)) == {1}
    assert _drive(p, 128, FLAT, ACCEPT, 6) == [4, 4, 2, 2, 1, 1]      # smaller: explored afresh


def test_contradicting_buckets_leave_every_width():
    p = WidthPolicy(4)
    for bucket, cost in ((64, FLAT), (16, STEEP)):   # the whole proposal wins at 64 rows, a plain
        for w in (4, 4, 2, 2, 1, 1):                 # step at 16 (not what GPUs do; noise might)
            p.record(bucket, w, [min(n, w) for n in (1, 2, 3, 4)], cost(w))
    assert p.beaten(32) == {1, 2, 4}
    assert _drive(p, 32, FLAT, ACCEPT, 6) == [4, 4, 2, 2, 1, 1]


def test_buckets_that_disagree_cannot_lock_each_other_onto_a_slower_width():
    # per-row tokens 1 / 1.8 / 2.5: a plain step wins at 64 rows, the whole proposal at 128
    # (the reverse of what GPUs do: noise, or GEMM speed not monotone in rows)
    at64 = {1: 0.010, 2: 0.0190, 4: 0.0265}.get
    at128 = {1: 0.010, 2: 0.0190, 4: 0.0235}.get
    p = WidthPolicy(4)
    for bucket, cost in ((64, at64), (128, at128)):          # both measured before either settles
        for w in (4, 4, 1, 1):
            p.record(bucket, w, [min(n, w) for n in (1, 2, 3, 4)], cost(w))
    assert 1 in p.beaten(64) and 4 in p.beaten(128)           # each settles the other's best away...
    chosen64, chosen128 = [], []
    for _ in range(4 * REFRESH):
        chosen64 += _drive(p, 64, at64, ACCEPT, 1)
        chosen128 += _drive(p, 128, at128, ACCEPT, 1)
    assert chosen64.count(1) >= 4 * REFRESH - 8               # ...yet each keeps its own measured best
    assert chosen128.count(4) >= 4 * REFRESH - 8


def _rows(n=7, seed=0, sampled=False):
    g = torch.Generator().manual_seed(seed)
    extra = lambda i: dict(temperature=0.9, top_p=0.9, seed=i) if sampled else {}      # noqa: E731
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 300, (4 + 5 * i,), generator=g).tolist(),
                       overrides={"max_tokens": 24 + 3 * i, **extra(i)}) for i in range(n)]


def _run(model, spec, adaptive, graphs=False, drafter=None, bs=3, sampled=False):
    eng = Engine(model, EngineOptions(batch_size=bs, device="cpu", dtype="float32", spec=spec, adaptive=adaptive),
                 drafter=drafter)
    if graphs:
        eng.cycle.graphs = EmulatedGraphs(eng.cycle, eng.fused)
    recs = sorted(eng.generate(_rows(sampled=sampled), SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return [r["output_token_ids"] for r in recs], recs, eng


@pytest.mark.parametrize("shape", ["chain", "tree", "naive_2token"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_adaptive_equals_vanilla(shape, graphs, sampled, target_dir, eagle3_dir):
    spec = {"chain": SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)),
            "tree": SpecConfig("eagle3", 3, 3, 6, str(eagle3_dir)),
            "naive_2token": SpecConfig("naive_2token", 1, 1, 2, str(eagle3_dir), "eagle3")}[shape]
    want, _, _ = _run(target_dir, SpecConfig(), False, sampled=sampled)
    got, recs, eng = _run(target_dir, spec, True, graphs=graphs, sampled=sampled)
    assert got == want                                             # seeded rows: plain sampling's tokens
    used = eng.cycle.policy.used
    assert set(used) == set(eng.cycle.policy.widths), used       # each width ran (exploration)
    if graphs:
        assert set(eng.cycle.graphs.widths) == set(used)
        sizes = {size for size, _ in eng.cycle.graphs._graphs}
        assert set(eng.cycle.graphs._graphs) == {(s, (v, w)) for s in sizes for w in used       # every width of a
                                                 for _, (v, _w) in eng.cycle.graphs._graphs}  # size at once
    full = [(r["spec"]["verify_steps"] - 1) * (spec.num_draft_tokens - 1) for r in recs]
    for r, most in zip(recs, full):                                # drafts counted as verified
        assert r["spec"]["accepted_tokens"] <= r["spec"]["draft_tokens"] <= most
    assert sum(r["spec"]["draft_tokens"] for r in recs) < sum(full)     # narrower cycles count fewer


def test_oracle_draft_accepts_every_verified_draft(target_dir):
    want, _, _ = _run(target_dir, SpecConfig(), False)
    table = {tuple(r.prompt_token_ids): w for r, w in zip(_rows(), want)}
    drafter = OracleDrafter(table, 4, 320)
    got, recs, eng = _run(target_dir, SpecConfig(), True, drafter=drafter)      # host-side oracle: eager
    assert got == want and set(eng.cycle.policy.used) == {1, 2, 4}
    for r in recs:
        s = r["spec"]
        # every verified draft is right; only the cycle cut by max_tokens may keep fewer
        assert s["draft_tokens"] - s["accepted_tokens"] <= 3
