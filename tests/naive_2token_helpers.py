"""Shared by the naive_2token tests (tests/speculative/test_naive_2token_*.py,
tests/gpu/test_naive_2token_gpu.py): engine runs at N = 2 and their statistics, the oracle drafter
at width 2, and the vanilla outputs. Test modules import the `vanilla` fixture; `target_dir`,
`eagle3_dir`, `mtp_target_dir` and `bigram` (a target whose MTP layer drafts exactly: the draft
after an accepted draft is right only if the catch-up kept the bonus row) come from
tests/conftest.py."""
from __future__ import annotations

import pytest
import torch

from oracle import OracleDrafter
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig

LENS = (1, 23, 9, 40, 5, 17, 3, 30, 12)
MAXES = (20, 7, 16, 1, 20, 11, 20, 2, 14)      # requests finish at different cycles
VOCAB = 320


def n2_rows(n=len(LENS), seed=0, overrides=None):
    g = torch.Generator().manual_seed(seed)
    return [RowRequest(row=i, id=str(i),
                       prompt_token_ids=torch.randint(1, VOCAB, (LENS[i % len(LENS)],), generator=g).tolist(),
                       overrides={"max_tokens": MAXES[i % len(MAXES)], **(overrides or {})}) for i in range(n)]


def plain_rows(rows):
    return [RowRequest(row=r.row, id=r.id, prompt_token_ids=r.prompt_token_ids) for r in rows]


def make_engine(model, bs, spec=SpecConfig(), drafter=None, device="cpu", **opts):
    opts.setdefault("adaptive", False)          # check_stats: every cycle full width
    return Engine(model, EngineOptions(batch_size=bs, device=device, dtype="float32", spec=spec, **opts),
                  drafter=drafter)


def run_engine(model, rows, bs, spec=SpecConfig(), drafter=None, device="cpu", engine=None, **defaults):
    eng = engine or make_engine(model, bs, spec, drafter, device)
    recs = sorted(eng.generate(rows, SamplingDefaults(**{"max_tokens": 20, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs


def output_ids(recs):
    return [r["output_token_ids"] for r in recs]


def n2_spec(drafter, eagle3_dir=None):
    """The naive_2token spec for `drafter` (eagle3: the head dir; nextn_mtp: inside the target)."""
    return SpecConfig("naive_2token", 1, 1, 2, str(eagle3_dir) if drafter == "eagle3" else None, drafter)


def check_stats(recs):
    for r in recs:
        s = r["spec"]
        assert s["draft_tokens"] == s["verify_steps"] - 1
        assert len(s["accept_histogram"]) == 2
        assert sum(s["accept_histogram"]) == s["verify_steps"] - 1
        assert s["accepted_tokens"] == s["accept_histogram"][1]
        # every cycle emits one or two tokens; the last one may be cut by a stop or max_tokens
        assert s["verify_steps"] <= r["completion_tokens"] <= 2 * s["verify_steps"] - 1


def greedy_table(model, rows, max_tokens=40):
    """Each prompt's greedy continuation (EOS ignored), for the oracle drafter."""
    recs = run_engine(model, plain_rows(rows), 4, max_tokens=max_tokens, ignore_eos=True)
    return {tuple(r.prompt_token_ids): rec["output_token_ids"] for r, rec in zip(rows, recs)}


@pytest.fixture(scope="module")
def vanilla(target_dir):
    return output_ids(run_engine(target_dir, n2_rows(), 4))


def oracle(table):
    return OracleDrafter(table, 2, VOCAB)        # one draft, always the target's next token
