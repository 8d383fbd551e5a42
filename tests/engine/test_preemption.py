"""Admission without reserving max_tokens: a request holds pages for what it has written and the
next cycles', grows as it runs, and when the pool runs short the request admitted last gives its
pages back and resumes by recompute. Every row comes out as on a pool that holds everything
(greedy: the same tokens; seeded sampling under every recipe, penalties, logprobs: the same draws)."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.pages import PageAllocator
from specbatch.scheduler import SlotScheduler
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(count, draw=0, max_tokens=(20, 45), **fields):
    g = torch.Generator().manual_seed(draw)
    out = []
    for i in range(count):
        L = int(torch.randint(3, 20, (1,), generator=g))
        m = int(torch.randint(*max_tokens, (1,), generator=g))
        out.append(RowRequest(row=i, id=i, prompt_token_ids=torch.randint(1, 200, (L,), generator=g).tolist(),
                              overrides={"max_tokens": m, **fields}))
    return out


def _run(model, rows, defaults=SamplingDefaults(ignore_eos=True), **opts):
    opts = {"device": "cpu", "dtype": "float32", "max_model_len": 64, "profile": True, **opts}
    eng = Engine(model, EngineOptions(**opts))
    recs = sorted(eng.generate(rows, defaults), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs), [r["error"] for r in recs if r["error"]]
    assert eng.pages.free_pages == eng.pages.usable                    # every page came back
    return eng, recs


def _fields(recs, *names):
    return [{k: r[k] for k in names} for r in recs]


def test_a_short_pool_preempts_and_every_row_comes_out_as_on_a_big_one(tiny_model):
    rows = _rows(16)
    _, want = _run(tiny_model, rows, batch_size=8)
    eng, got = _run(tiny_model, rows, batch_size=8, kv_rows=200, page_size=8)
    assert eng.preempted > 0 and eng.preemptions >= eng.preempted and eng.recomputed_tokens > 0
    assert _fields(got, "output_token_ids", "completion", "finish_reason", "prompt_tokens", "completion_tokens") == \
        _fields(want, "output_token_ids", "completion", "finish_reason", "prompt_tokens", "completion_tokens")
    facts = eng.pool_facts()
    assert facts["preempted"] == eng.preempted and facts["recomputed_tokens"] == eng.recomputed_tokens


def test_reserving_max_tokens_never_preempts_and_holds_fewer_rows(tiny_model):
    """The old admission, kept as an option: pages for prompt + max_tokens up front. On a pool
    where outputs are shorter than max_tokens (EOS), growing as rows write keeps more in flight."""
    rows = _rows(16, max_tokens=(200, 201))
    eos = SamplingDefaults()                              # the tiny model's EOS ends rows early
    _, want = _run(tiny_model, rows, eos, batch_size=8, max_model_len=256)
    reserved, a = _run(tiny_model, rows, eos, batch_size=8, max_model_len=256, kv_rows=480, page_size=8,
                       reserve_max_tokens=True)
    grown, b = _run(tiny_model, rows, eos, batch_size=8, max_model_len=256, kv_rows=480, page_size=8)
    assert reserved.preempted == 0 and reserved.waited > 0
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b] == \
        [r["output_token_ids"] for r in want]
    assert max(grown.occupancy) > max(reserved.occupancy)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("recipe", [("eagle3", 3, 1, 4), ("eagle3", 5, 4, 8), ("nextn_mtp", 3, 1, 4),
                                    ("naive_2token", 1, 1, 2)])
def test_speculative_recipes_preempted_are_lossless(recipe, sampled):
    """The drafter's own state is rebuilt by the recompute's prefill (the draft layer's K/V over
    prompt and output; a tree's compaction rows inside the pages it holds). Seeded sampled rows
    write plain sampling's tokens under a draft, preempted or not: vanilla's on a big pool."""
    from specbatch.resolve import DEMO_DIR

    algo, S, k, N = recipe
    target = DEMO_DIR / "target"
    rows = _rows(10, draw=1, **(dict(temperature=0.8, top_p=0.95, seed=3) if sampled else {}))
    _, want = _run(target, rows, batch_size=10)
    drafter = "eagle3" if algo == "naive_2token" else algo
    spec = SpecConfig(algo, S, k, N, draft=str(DEMO_DIR / drafter), drafter=drafter)
    eng, got = _run(target, rows, batch_size=6, kv_rows=200, page_size=8, spec=spec)
    assert eng.preempted > 0
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    assert sum(r["spec"]["accepted_tokens"] for r in got) > 0


def test_seeded_sampling_penalties_min_tokens_and_logprobs_resume_where_they_were(tiny_model):
    """Vanilla draws its token at each position from the row's seed stream: a request resumed by
    recompute draws the same tokens, with its generated tokens counted for the penalties (not
    taken for prompt tokens) and min_tokens counting what it had generated."""
    rows = _rows(12, draw=2, temperature=0.9, seed=5, presence_penalty=0.5, frequency_penalty=0.3,
                 repetition_penalty=1.2, min_tokens=15, logprobs=2)
    _, want = _run(tiny_model, rows, SamplingDefaults(), batch_size=8)
    eng, got = _run(tiny_model, rows, SamplingDefaults(), batch_size=8, kv_rows=200, page_size=8)
    assert eng.preempted > 0
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    for g, w in zip(got, want):
        assert [t["logprob"] for t in g["logprobs"]] == pytest.approx([t["logprob"] for t in w["logprobs"]], abs=1e-4)


def test_prompt_logprobs_and_n_choices_survive_a_preemption(tiny_model):
    rows = _rows(8, draw=3, n=2, temperature=0.8, seed=9, prompt_logprobs=1)
    _, want = _run(tiny_model, rows, SamplingDefaults(ignore_eos=True), batch_size=8)
    eng, got = _run(tiny_model, rows, SamplingDefaults(ignore_eos=True), batch_size=8, kv_rows=200, page_size=8)
    assert eng.preempted > 0
    for g, w in zip(got, want):
        assert [c["output_token_ids"] for c in g["choices"]] == [c["output_token_ids"] for c in w["choices"]]
        assert len(g["prompt_logprobs"]) == len(w["prompt_logprobs"]) == g["prompt_tokens"]
        assert [p and p["logprob"] for p in g["prompt_logprobs"]] == \
            pytest.approx([p and p["logprob"] for p in w["prompt_logprobs"]], abs=1e-4)


def test_the_summary_says_how_many_requests_were_preempted(tiny_model, tmp_path, monkeypatch):
    import io
    import json

    from rich.console import Console

    from specbatch.job import JobOptions, run_job
    from specbatch.llm import LLM
    from specbatch.progress import print_summary
    from specbatch.recipe import load_recipe

    real = LLM.__init__

    def small_pool(self, *a, **kw):
        real(self, *a, **kw)
        self.engine = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=8,
                                                       max_model_len=64, kv_rows=200, page_size=8))

    monkeypatch.setattr(LLM, "__init__", small_pool)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, **r.overrides}) + "\n"
                           for r in _rows(16)))
    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=8, ignore_eos=True)
    s = run_job(str(inp), recipe, JobOptions(output=str(tmp_path / "out.jsonl"), device="cpu"))
    assert s["preempted"] > 0 and s["preemptions"] >= s["preempted"] and s["recomputed_tokens"] > 0
    assert s["errors"] == 0 and s["requests"] == 16
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), s)
    assert f"{s['preempted']} requests gave their KV pages back" in buf.getvalue()


def test_a_requeued_request_is_admitted_before_any_other():
    sched: SlotScheduler[str] = SlotScheduler(2, priority=len)
    for r in ("a", "bbbb", "cc"):
        sched.add(r)
    assert [r for _, r in sched.admit()] == ["bbbb", "cc"]
    slot = next(s for s, r in sched.active() if r == "cc")
    sched.release(slot)
    sched.requeue("cc")
    sched.add("dddddd")                                     # a higher priority, arrived later
    assert [r for _, r in sched.admit()] == ["cc"]
    assert sched.queued_requests() == ["a", "dddddd"]
    fifo: SlotScheduler[str] = SlotScheduler(1, bucket_window=4)
    for r in ("x", "yy"):
        fifo.add(r)
    fifo.requeue("z")
    fifo.requeue("w")                                       # put back later: behind the first put back
    assert [r for _, r in fifo.admit()] == ["z"]


def test_pages_grow_and_reach_the_device_table_once_written():
    pages = PageAllocator(12, 4, 2, 6, torch.device("cpu"), dummy_rows=4)
    pages.assign([(0, pages.grant(5))])
    assert pages.rows_held(0) == 8
    assert pages.grow(0, 15)
    assert pages.rows_held(0) == 16 and pages.layout.page_table[0, 2:4].tolist() == [0, 0]   # not written yet
    pages.write_grown()
    row = pages.layout.page_table[0].tolist()
    assert all(p > 0 for p in row[:4]) and len(set(row[:4])) == 4 and row[4:] == [0, 0]
    pages.assign([(1, pages.grant(20))])                                 # 5 of the 6 pages left
    assert pages.free_pages == 1
    assert not pages.grow(0, 24) and pages.rows_held(0) == 16           # 2 pages wanted, 1 free: nothing taken
    assert pages.grow(0, 20) and pages.free_pages == 0
    pages.release(1)
    pages.release(0)                                                     # its unwritten entry goes with it
    pages.assign([(0, pages.grant(4))])
    pages.write_grown()
    assert pages.layout.page_table[0].tolist()[1:] == [0] * 5
    assert pages.free_pages == pages.usable - 1


def _preempt_at(eng: Engine, row: int, tokens: int) -> None:
    """Preempt row `row`'s request once it has `tokens` output tokens or more (the engine runs
    without the overlap, so no cycle is in flight then): a preemption at a chosen point."""
    grow = eng._grow

    def growing(sched, pending, done):
        pending = grow(sched, pending, done)
        for slot, req in sched.active():
            if req.row == row and len(req.output_ids) >= tokens and not req.preempted:
                eng._preempt(sched, slot, req)
        return pending
    eng._grow = growing


@pytest.mark.parametrize("recipe, at", [("vanilla", 5), ("vanilla", 6), ("eagle3", 3), ("eagle3", 5)])
def test_a_request_resumed_at_min_tokens_counts_what_it_generated(recipe, at):
    """EOS is the greedy choice wherever it is not masked: every row stops right at min_tokens = 6,
    the one resumed just before or at that point too (its recompute's token counts the 5 or 6 it had;
    EAGLE3's chain passes through some length from 3 on)."""
    from specbatch.resolve import DEMO_DIR

    spec = SpecConfig("eagle3", 3, 1, 4, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3") if recipe == "eagle3" else None
    target = DEMO_DIR / "target"
    eos = Engine(target, EngineOptions(device="cpu", dtype="float32", max_model_len=64)).stops.eos_ids
    rows = [RowRequest(row=i, id=i, prompt_token_ids=[5 + i, 17, 40 + i],
                       overrides={"max_tokens": 20, "min_tokens": 6, "logit_bias": {str(min(eos)): 100.0}})
            for i in range(3)]
    eng = Engine(target, EngineOptions(device="cpu", dtype="float32", max_model_len=64, batch_size=3,
                                       overlap=False, **({"spec": spec} if spec else {})))
    _preempt_at(eng, 1, at)
    recs = sorted(eng.generate(rows, SamplingDefaults()), key=lambda r: r["row"])
    assert eng.preempted == 1
    assert [r["completion_tokens"] for r in recs] == [7, 7, 7] and {r["finish_reason"] for r in recs} == {"stop"}
