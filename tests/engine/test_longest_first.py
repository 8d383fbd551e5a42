"""Longest output budget first: the scheduler's priority order, and the engine's job finishing in
fewer decode cycles (the weights are read once a cycle) with the same tokens."""
from __future__ import annotations

import math
import random

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.scheduler import SlotScheduler

pytestmark = pytest.mark.usefixtures("one_thread")


def test_priority_order_ties_by_arrival_and_fits_stops_in_that_order():
    s = SlotScheduler(3, priority=lambda r: r[1])
    for r in [("a", 5), ("b", 9), ("c", 5), ("d", 9), ("e", 1)]:
        s.add(r)
    assert [r[0] for _, r in s.admit()] == ["b", "d", "a"]
    s.release(0)
    assert [r[0] for _, r in s.admit(fits=lambda r: r[0] != "c")] == []      # c (next by priority) waits
    assert s.queued() == 2
    s2 = SlotScheduler(2)                                                     # no priority: FIFO
    for r in [("a", 5), ("b", 9), ("c", 5)]:
        s2.add(r)
    assert [r[0] for _, r in s2.admit()] == ["a", "b"]


def _mix(n=8, seed=3):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        m = int(min(48, max(2, round(math.exp(rng.gauss(math.log(8), 0.9))))))
        ids = torch.randint(1, 300, (3 + i % 7,), generator=g).tolist()
        out.append(RowRequest(row=i, id=i, prompt_token_ids=ids, overrides={"max_tokens": m}))
    return out


def _run(model, longest_first):
    eng = Engine(model, EngineOptions(device="cpu", dtype="float32", batch_size=4, longest_first=longest_first))
    recs = sorted(eng.generate(_mix(), SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    return [r["output_token_ids"] for r in recs], eng.cycle.forwards


def test_longest_first_needs_fewer_cycles_for_the_same_tokens(tiny_model):
    fifo, fifo_cycles = _run(tiny_model, False)
    lpt, lpt_cycles = _run(tiny_model, True)
    assert lpt == fifo
    rows = _mix()
    longest = max(r.overrides["max_tokens"] for r in rows)
    work = sum(r.overrides["max_tokens"] for r in rows)
    assert lpt_cycles < fifo_cycles
    # the prefill emits each row's first token: no schedule needs fewer cycles than this (the
    # engine looks 2 x slots rows ahead: here the whole mix)
    bound = max(longest - 1, math.ceil((work - len(rows)) / 4))
    assert bound <= lpt_cycles <= bound + 4, (lpt_cycles, bound, fifo_cycles)
