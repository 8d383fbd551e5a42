"""Pages that grow as rows write, and preemption by recompute, on CUDA: the page table's new
entries reach the captured cycles and prefills (graphs read the table in place), and a request
resumed after preemption writes the tokens of a pool that holds everything (run on a GPU machine:
`pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.gpu


def _rows(n=24, draw=0, **fields):
    g = torch.Generator().manual_seed(draw)
    out = []
    for i in range(n):
        L = int(torch.randint(3, 60, (1,), generator=g))
        out.append(RowRequest(row=i, id=i, prompt_token_ids=torch.randint(1, 300, (L,), generator=g).tolist(),
                              overrides={"max_tokens": int(torch.randint(100, 300, (1,), generator=g)), **fields}))
    return out


def _run(target, rows, defaults, **opts):
    eng = Engine(target, EngineOptions(device="cuda", dtype="float32", max_model_len=384, batch_size=12, **opts))
    recs = sorted(eng.generate(rows, defaults), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs), [r["error"] for r in recs if r["error"]]
    assert eng.pages.free_pages == eng.pages.usable
    return eng, recs


@pytest.mark.parametrize("recipe", ["vanilla", "eagle3_chain", "eagle3_tree"])
def test_cuda_preempted_rows_write_the_tokens_of_a_pool_that_holds_everything(recipe):
    from specbatch.resolve import DEMO_DIR

    spec = {"vanilla": None,
            "eagle3_chain": SpecConfig("eagle3", 3, 1, 4, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3"),
            "eagle3_tree": SpecConfig("eagle3", 5, 4, 8, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3")}[recipe]
    extra = {"spec": spec} if spec else {}
    rows = _rows()
    defaults = SamplingDefaults(ignore_eos=True)
    _, want = _run(DEMO_DIR / "target", rows, defaults, graphs=False, **extra)
    eng, got = _run(DEMO_DIR / "target", rows, defaults, kv_rows=1280, **extra)
    assert eng.graphs is not None and eng.preempted > 0
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]


def test_cuda_seeded_vanilla_sampling_with_penalties_resumes_the_same():
    from specbatch.resolve import DEMO_DIR

    rows = _rows(draw=1, temperature=0.9, seed=4, frequency_penalty=0.4, repetition_penalty=1.1, logprobs=1)
    _, want = _run(DEMO_DIR / "target", rows, SamplingDefaults(ignore_eos=True), graphs=False)
    eng, got = _run(DEMO_DIR / "target", rows, SamplingDefaults(ignore_eos=True), kv_rows=1280)
    assert eng.preempted > 0
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
