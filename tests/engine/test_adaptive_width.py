"""Adaptive verify width (engine/adaptive.py): greedy cycles verify the prefix of the proposal that
emits the most tokens per second at the batch size. The policy against synthetic costs; the
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


def _drive(policy: WidthPolicy, bucket: int, cost, accepted, cycles: int, greedy: bool = True) -> list[int]:
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
        w = policy.choose(bucket, greedy)
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


def test_buckets_are_separate_and_sampling_keeps_the_full_width():
    p = WidthPolicy(4)
    _drive(p, 1, lambda w: 0.010, ACCEPT, 20)
    assert p.choose(256, True) == 4            # a new bucket explores afresh
    assert all(p.choose(1, False) == 4 for _ in range(10))
    assert WidthPolicy(4, enabled=False).choose(1, True) == 4


def _rows(n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 300, (4 + 5 * i,), generator=g).tolist(),
                       overrides={"max_tokens": 24 + 3 * i}) for i in range(n)]


def _run(model, spec, adaptive, graphs=False, drafter=None, bs=3):
    eng = Engine(model, EngineOptions(batch_size=bs, device="cpu", dtype="float32", spec=spec, adaptive=adaptive),
                 drafter=drafter)
    if graphs:
        eng.cycle.graphs = EmulatedGraphs(eng.cycle, eng.fused)
    recs = sorted(eng.generate(_rows(), SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return [r["output_token_ids"] for r in recs], recs, eng


@pytest.mark.parametrize("shape", ["chain", "tree", "naive_2token"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_adaptive_greedy_equals_vanilla(shape, graphs, target_dir, eagle3_dir):
    spec = {"chain": SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)),
            "tree": SpecConfig("eagle3", 3, 3, 6, str(eagle3_dir)),
            "naive_2token": SpecConfig("naive_2token", 1, 1, 2, str(eagle3_dir), "eagle3")}[shape]
    want, _, _ = _run(target_dir, SpecConfig(), False)
    got, recs, eng = _run(target_dir, spec, True, graphs=graphs)
    assert got == want
    used = eng.cycle.policy.used
    assert set(used) == set(eng.cycle.policy.widths), used       # each width ran (exploration)
    if graphs:
        assert set(eng.cycle.graphs.widths) == set(used)
        sizes = {size for size, _ in eng.cycle.graphs._graphs}
        assert set(eng.cycle.graphs._graphs) == {(s, (v, w)) for s in sizes for w in used       # every width of a
                                                 for _, (v, _w) in eng.cycle.graphs._graphs}  # size at once
    for r in recs:                                                 # drafts counted as verified
        s = r["spec"]
        assert s["accepted_tokens"] <= s["draft_tokens"] < (s["verify_steps"] - 1) * (spec.num_draft_tokens - 1)


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
