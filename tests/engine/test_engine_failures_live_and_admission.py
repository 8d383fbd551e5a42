"""A failed step meeting a live feed (workers.py) and a failed admission: the held error record
of a row that failed alone reaches a feed that waits for it; pages granted or indexed by a failed
admission of a row run alone come back and are never read as written."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specbatch.engine import WAIT, Engine, EngineOptions
from specbatch.recipe import SamplingDefaults

from failure_helpers import failure_rows as _rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(model, **opts) -> Engine:
    return Engine(model, EngineOptions(device="cpu", dtype="float32", batch_size=8, max_model_len=96, **opts))


def test_a_live_feed_gets_the_record_of_a_row_that_failed_alone(tiny_model):
    """workers.py's parent ends a worker's feed only once every row it handed out came back. A
    row that fails alone with no row finishing after it is held by generate until the feed
    ends: the worker waits for the parent, the parent for the row, and the job hangs."""
    rows = _rows(10)
    eng = _engine(tiny_model)
    prefill = eng._prefill

    def failing(admitted):
        if any(req.row == 9 for _, req in admitted):
            raise RuntimeError("planted")
        return prefill(admitted)
    eng._prefill = failing
    got: dict[int, dict] = {}

    def feed():                                   # as the parent feeds a worker: WAIT while nothing is ready
        for i, row in enumerate(rows):
            yield row
            while i == 8 and len(got) < 9:        # the last row comes later than the others
                yield WAIT
        for _ in range(2000):
            if len(got) == len(rows):
                return                            # every row came back: the parent ends the feed
            yield WAIT
        raise TimeoutError(f"the feed still waits for rows {sorted(set(range(10)) - set(got))}")

    for rec in eng.generate(feed(), SamplingDefaults(ignore_eos=True)):
        got[rec["row"]] = rec
    assert sorted(got) == list(range(10)) and "ran alone" in got[9]["error"]


def test_a_row_failing_alone_in_admission_leaves_no_pages_granted_or_indexed(tiny_model):
    """A row run alone (recover=False) that fails in admission after its pages were granted (as
    when copy_page, or a later choice's grant, fails): nothing resets the pool, so the pages leak,
    and the prompt pages stay in the prefix index unwritten; a later row with that prompt reads
    them as if prefilled and comes out wrong."""
    rows = _rows(30, draw=1)
    poison = list(rows[7].prompt_token_ids) + [5] * 20           # more than a page (16 rows on the CPU)
    rows[7] = replace(rows[7], prompt_token_ids=poison)
    rows[29] = replace(rows[29], prompt_token_ids=list(poison))  # a later row with the same prompt
    defaults = SamplingDefaults(ignore_eos=True)
    want = {r["row"]: r for r in _engine(tiny_model).generate(rows, defaults)}
    eng = _engine(tiny_model)
    grant = eng.pages.grant

    def failing(n, prompt=None, **kw):
        g = grant(n, prompt, **kw)
        if prompt == poison and eng.failure_counts.failed_alone == 0:    # until the row is given up
            raise MemoryError("planted, after the grant")
        return g
    eng.pages.grant = failing
    got = {r["row"]: r for r in eng.generate(rows, defaults)}
    assert "MemoryError: planted" in got[7]["error"]
    for row in want:
        if row != 7:
            assert got[row]["error"] is None and got[row]["output_token_ids"] == want[row]["output_token_ids"], row
    assert eng.pages.free_pages == eng.pages.usable
