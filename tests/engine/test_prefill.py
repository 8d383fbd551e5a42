"""Packed prefill (engine/prefill.py): prompts' tokens packed into forwards of a token budget with
no padding, one sequence a token, grouped into query tiles of C; a prompt that does not fit
continues in the next forward. Nothing a row gets
back may depend on the budget: tokens, logprobs, prompt logprobs and the drafter's catch-up
(its acceptance) are those of a budget that holds every prompt whole."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.engine.prefill import chunk_tokens, pack, tiles_of
from specbatch.params import SamplingParams
from specbatch.recipe import SamplingDefaults
from specbatch.request import Request
from specbatch.resolve import DEMO_DIR
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _req(n: int) -> Request:
    return Request(row=0, id=0, prompt_ids=list(range(1, n + 1)), params=SamplingParams(), max_new=1)


@pytest.mark.parametrize("budget", [4, 7, 16, 40, 1000])
def test_pack_covers_every_token_once_in_order_within_the_budget(budget):
    lens = [1, 4, 5, 17, 3, 40, 8]
    admitted = [(slot, _req(n)) for slot, n in enumerate(lens)]
    forwards = pack(admitted, budget)
    seen: dict[int, list[int]] = {}
    for parts in forwards:
        assert sum(p.end - p.start for p in parts) <= budget
        for p in parts:
            seen.setdefault(p.slot, []).extend(range(p.start, p.end))
            assert p.last == (p.end == lens[p.slot])
    assert seen == {s: list(range(n)) for s, n in enumerate(lens)}
    # every forward but the last is full: no padding anywhere
    assert all(sum(p.end - p.start for p in parts) == budget for parts in forwards[:-1])


def test_pack_starts_a_prompt_past_its_cached_pages():
    req = _req(150)
    req.cached_rows = 128
    assert [(p.start, p.end, p.last) for p in pack([(0, req)], 1000)[0]] == [(128, 150, True)]


@pytest.mark.parametrize("C", [4, 32])
def test_tiles_are_runs_of_one_part_of_at_most_c_tokens(C):
    lens = [1, 4, 5, 17, 3, 40, 8]
    for parts in pack([(slot, _req(n)) for slot, n in enumerate(lens)], 23):
        start, count = tiles_of(parts, C)
        N = sum(p.end - p.start for p in parts)
        covered = [i for s, c in zip(start, count) for i in range(s, s + c)]
        assert covered == list(range(N)) and all(1 <= c <= C for c in count)
        owner = [p for p in parts for _ in range(p.start, p.end)]
        assert all(owner[s] is owner[s + c - 1] for s, c in zip(start, count))


def test_chunk_is_one_query_tile():
    assert chunk_tokens(32, 8) == 32 and chunk_tokens(8, 8) == 128 and chunk_tokens(64, 1) == 16


def _rows(n: int, seed: int = 3) -> list[RowRequest]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 64, 65, 150] + torch.randint(2, 140, (n - 4,), generator=g).tolist()
    return [RowRequest(row=i, id=i, prompt_token_ids=torch.randint(1, 200, (L,), generator=g).tolist(),
                       overrides={"max_tokens": 6 + i % 5, "logprobs": 2, "prompt_logprobs": 1 if i % 3 == 0 else None})
            for i, L in enumerate(lens)]


def _run(spec: SpecConfig, budget: int) -> tuple[Engine, list[dict]]:
    eng = Engine(DEMO_DIR / "target", EngineOptions(device="cpu", dtype="float32", batch_size=6, max_model_len=192,
                                                    prefill_tokens=budget, spec=spec))
    recs = sorted(eng.generate(_rows(12), SamplingDefaults(ignore_eos=True, temperature=0.0)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return eng, recs


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("eagle3", 3, 1, 4, draft=str(DEMO_DIR / "eagle3")),
                                  SpecConfig("nextn_mtp", 3, 1, 4, draft=str(DEMO_DIR / "nextn_mtp"),
                                             drafter="nextn_mtp")], ids=["vanilla", "eagle3", "mtp"])
@pytest.mark.parametrize("budget", ["C", 37])
def test_prompts_split_across_forwards_give_what_whole_prompts_give(spec, budget):
    whole, want = _run(spec, 4096)
    C = whole.prefiller.C
    # one tile a forward, or forwards ending inside a tile: prompts span forwards
    split, got = _run(spec, C if budget == "C" else budget)
    assert split.prefill_forwards > whole.prefill_forwards
    # the forwards computed the prompts' tokens and nothing else
    assert whole.prefiller.tokens_run == split.prefiller.tokens_run == sum(len(r.prompt_token_ids) for r in _rows(12))
    if spec.algorithm != "vanilla":
        assert sum(r["spec"]["accepted_tokens"] for r in want) > 0
    for a, b in zip(got, want):
        assert a["output_token_ids"] == b["output_token_ids"]
        assert a["spec"] == b["spec"]           # the drafter caught up on the same prompt states
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert x["token_id"] == y["token_id"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
        if b["prompt_logprobs"] is None:
            assert a["prompt_logprobs"] is None
            continue
        assert len(a["prompt_logprobs"]) == len(b["prompt_logprobs"]) == len(_rows(12)[a["row"]].prompt_token_ids)
        for x, y in zip(a["prompt_logprobs"][1:], b["prompt_logprobs"][1:]):
            assert x["token_id"] == y["token_id"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
