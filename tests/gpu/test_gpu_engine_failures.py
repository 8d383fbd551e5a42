"""A failed step on CUDA, with graphs and overlapped cycles (a cycle in flight when the failure
comes): the rows in flight rerun apart, the failing row is its error record, every other row's
tokens equal a run without the failure; an out-of-memory is survived the same way."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.gpu


def _rows(count=40):
    g = torch.Generator().manual_seed(4)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 300, (3 + (5 * i) % 90,),
                                                                         generator=g).tolist(),
                       overrides={"max_tokens": 4 + i % 13, **({"temperature": 0.8, "seed": i} if i % 3 else {})})
            for i in range(count)]


def _engine(model_dir, spec):
    return Engine(model_dir, EngineOptions(batch_size=16, device="cuda", dtype="float32", spec=spec))


@pytest.mark.parametrize("shape", ["vanilla", "eagle3"])
@pytest.mark.parametrize("error", [RuntimeError("planted"), torch.OutOfMemoryError("CUDA out of memory (planted)")])
def test_cuda_failed_steps_cost_only_their_row(target_dir, eagle3_dir, shape, error):
    spec = SpecConfig() if shape == "vanilla" else SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir))
    defaults = SamplingDefaults(ignore_eos=True)
    want = {r["row"]: r["output_token_ids"] for r in _engine(target_dir, spec).generate(_rows(), defaults)}
    eng = _engine(target_dir, spec)
    assert eng.graphs is not None and eng.prefiller.graphs is not None
    launch, prefill = eng.cycle.launch, eng._prefill

    def failing_launch(active):
        if any(req.row == 21 and len(req.output_ids) >= 3 for _, req in active):
            raise error
        return launch(active)

    def failing_prefill(admitted):
        if any(req.row == 30 for _, req in admitted):
            raise error
        return prefill(admitted)
    eng.cycle.launch, eng._prefill = failing_launch, failing_prefill
    got = {r["row"]: r for r in eng.generate(_rows(), defaults)}
    assert sorted(got) == sorted(want)
    for row, tokens in want.items():
        if row in (21, 30):
            assert "again when it ran alone" in got[row]["error"] and type(error).__name__ in got[row]["error"]
        else:
            assert got[row]["error"] is None and got[row]["output_token_ids"] == tokens, row
    assert eng.failure_counts.failed_alone == 2
    assert eng.pages.free_pages == eng.pages.usable
