"""Prefix caching: prompts that begin alike share the pages of their common prefix (target and
draft layer), prefill skips those rows, and no output changes (greedy: identical tokens to a run
without it), whether the sharing request came in the same wave, a later one, or after the pages
went idle and some were taken back."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.pages import PageAllocator
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _alloc(pages=40, P=4, copies=True):
    a = PageAllocator(pages, P, num_slots=4, pages_per_slot=16, device=torch.device("cpu"), dummy_rows=1)
    a.copies = copies
    return a


def test_a_prompt_finds_the_pages_of_one_that_began_alike():
    a = _alloc()
    A = list(range(100, 114))                                 # 14 tokens: pages 0-2 end before the last
    ga = a.grant(20, A)
    assert ga.cached_rows == 0 and len(ga.pages) == 5
    a.assign([(0, ga)])
    B = A[:9] + [7, 7, 7, 7]                                  # pages 0, 1 and the token after page 1 alike
    gb = a.grant(16, B)
    assert gb.pages[:2] == ga.pages[:2] and gb.cached_rows == 8 and not set(gb.pages[2:]) & set(ga.pages)
    C = A[:8] + [5] * 6                                       # page 1 alike, the token after it not:
    gc = a.grant(16, C)                                       # a draft row there reads that token
    assert gc.pages[:1] == ga.pages[:1] and gc.cached_rows == 4
    assert a.grant(16, A[:8] + [5] * 6, reuse=False).cached_rows == 0
    assert gc.copy is None                                    # page 1 is not written yet: same wave
    a.new_wave()
    # a later wave: page 1's rows but its last are E's too, so E takes a copy and computes that row
    holders = {ga.pages[1], gc.pages[1]}                      # A's page 1 and C's: the same own tokens
    E = A[:8] + [6] * 6
    ge = a.grant(16, E)
    assert ge.pages[:1] == ga.pages[:1] and ge.cached_rows == 7
    assert ge.copy[0] in holders and ge.copy[1] == ge.pages[1]
    D = A[:8]                                                 # ends with page 1: only its last token runs
    gd = a.grant(12, D)
    assert gd.cached_rows == 7 and gd.copy[0] in holders and gd.copy[1] == gd.pages[1]
    # E's page 1 (this wave, not written yet) holds those tokens too: never the one copied
    assert a.index.near(A[:8] + [9] * 6, ga.pages[:1]) == sorted(holders | {ge.pages[1]})
    assert a.grant(16, A[:8] + [9] * 6).copy[0] in holders
    b = _alloc(copies=False)                                  # a drafter that cannot copy its rows
    b.assign([(0, b.grant(20, A))])
    b.new_wave()
    assert b.grant(16, E).copy is None and b.grant(16, E[:8] + [3] * 6).cached_rows == 4
    assert a.grant(16, [1] + A[1:8] + [5] * 6).copy is None    # page 0 differs: nothing under it
    with pytest.raises(RuntimeError, match="lookahead"):
        a.index.set_lookahead(0)                              # pages indexed with 1 already
    a = _alloc()
    a.index.set_lookahead(0)                                  # no draft layer: the page's own tokens decide
    a.assign([(0, a.grant(20, A))])
    a.new_wave()
    g = a.grant(16, C)
    assert g.cached_rows == 8 and g.copy is None


def test_vanilla_shares_a_prefix_that_ends_on_a_page_whatever_follows_it(tiny_model):
    """The target's K/V of a position reads no later token, so vanilla shares every page of a
    common prefix; a draft layer's last row of a page reads the next token, so an EAGLE3 engine
    shares a page only where that token matches too (here: one page less)."""
    from specbatch.resolve import DEMO_DIR

    g = torch.Generator().manual_seed(11)
    head = torch.randint(1, 200, (128,), generator=g).tolist()            # eight pages
    rows = [RowRequest(row=i, id=i, prompt_token_ids=head + [200 + i] + torch.randint(1, 200, (9,), generator=g).tolist(),
                       overrides={"max_tokens": 3}) for i in range(6)]
    eng, got = _generate(tiny_model, rows, batch_size=6)
    _, want = _generate(tiny_model, rows, batch_size=6, prefix_caching=False)
    assert eng.pages.index.lookahead == 0 and _tokens(got) == _tokens(want)
    assert eng.cached_tokens == 5 * 128
    target = DEMO_DIR / "target"
    spec = SpecConfig("eagle3", 3, 1, 4, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3")
    eng, got = _generate(target, rows, batch_size=6, spec=spec)
    _, want = _generate(target, rows, batch_size=6)
    assert eng.pages.index.lookahead == 1 and _tokens(got) == _tokens(want)
    assert eng.cached_tokens == 5 * (128 - eng.page_size)


def test_idle_pages_stay_readable_until_a_new_page_needs_them():
    a = _alloc(pages=12)                                      # 11 usable (page 0 is trash), 1 the dummy's
    A = list(range(50, 63))                                   # 13 tokens: 3 shareable pages
    g = a.grant(16, A)
    a.assign([(0, g)])
    a.release(0)
    assert a.free_pages == 10 and a.index.holds(g.pages[0])   # idle, counted free, still indexed
    again = a.grant(16, A)
    assert again.pages[:3] == g.pages[:3] and again.cached_rows == 12
    a.assign([(1, again)])
    a.release(1)
    filler = a.grant(40, None)                                 # every free page, then the idle ones
    assert filler is not None and a.free_pages == 0 and len(a.index) == 0
    assert a.grant(4, None) is None                            # nothing left: the request waits
    a.assign([(2, filler)])
    a.release(2)
    assert a.grant(16, A).cached_rows < 12                     # what was taken back is gone


def _shared_rows(n, prefix, seed=0, n_choices=None, step=20):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, 200, (prefix,), generator=g).tolist()
    rows = []
    for i in range(n):
        tail = torch.randint(1, 200, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        own = head[: prefix - step * (i % 3)] + tail          # three prefix lengths, own tails
        over = {"max_tokens": 4 + i % 7}
        if n_choices and i % 4 == 1:
            over["n"] = n_choices
        rows.append(RowRequest(row=i, id=i, prompt_token_ids=own, overrides=over))
    return rows


def _generate(model, rows, **opts):
    eng = Engine(model, EngineOptions(device="cpu", dtype="float32", **opts))
    recs = sorted(eng.generate(rows, SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    return eng, recs


def _tokens(recs):
    return [[c["output_token_ids"] for c in r["choices"]] if r.get("choices") else r["output_token_ids"]
            for r in recs]


def _flat(x):
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in [k, *_flat(x[k])]]
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _flat(e)]
    return [x]


@pytest.mark.parametrize("batch_size,kv_rows", [(16, None), (4, None), (4, 900)])
def test_vanilla_outputs_do_not_change_and_prefill_skips_the_shared_rows(tiny_model, batch_size, kv_rows):
    """16 slots: every request in the first wave (sharing within it); 4: later waves find the
    pages of finished requests; a pool of 900 rows: idle pages are taken back on the way."""
    rows = _shared_rows(14, prefix=200)
    ref, want = _generate(tiny_model, rows, batch_size=batch_size, prefix_caching=False, kv_rows=kv_rows)
    eng, got = _generate(tiny_model, rows, batch_size=batch_size, kv_rows=kv_rows)
    assert _tokens(got) == _tokens(want) and all(r["error"] is None for r in got)
    assert ref.cached_tokens == 0 and eng.prompt_tokens == ref.prompt_tokens
    assert eng.cached_tokens >= 64 * 10 and eng.cached_tokens % eng.page_size == 0     # whole pages
    if kv_rows is None:      # a short pool: waves differ with the pages each run holds, forwards with them
        assert eng.prefill_forwards <= ref.prefill_forwards
    assert ref.prefiller.tokens_run - eng.prefiller.tokens_run == eng.cached_tokens    # skipped, not rerun
    assert eng.pages.free_pages == eng.pages.usable                            # every page came back


def test_choices_and_prompt_logprobs_with_a_shared_prefix(tiny_model):
    """n > 1 choices share their prompt's pages; a row asking for prompt logprobs computes every
    position (its logprobs equal a run without caching) and its pages serve the others."""
    rows = _shared_rows(8, prefix=150, seed=3, n_choices=3)
    rows[0].overrides["prompt_logprobs"] = 2
    rows[5].overrides["prompt_logprobs"] = 1
    _, want = _generate(tiny_model, rows, batch_size=8, prefix_caching=False)
    eng, got = _generate(tiny_model, rows, batch_size=8)
    assert _tokens(got) == _tokens(want) and eng.cached_tokens > 0
    for i in (0, 5):
        a, b = _flat(got[i]["prompt_logprobs"]), _flat(want[i]["prompt_logprobs"])
        assert len(a) == len(b) > 100
        assert [x == pytest.approx(y, abs=1e-4) if isinstance(x, float) else x == y for x, y in zip(a, b)] == [True] * len(a)


@pytest.mark.parametrize("algo,S,k,N", [("eagle3", 3, 1, 4), ("eagle3", 5, 4, 8), ("nextn_mtp", 3, 1, 4)])
def test_draft_layer_pages_are_shared_too(algo, S, k, N):
    """The draft layer's rows of the shared prefix sit in the same pages (its table is the
    target's): greedy output equals vanilla without caching, drafts still accepted."""
    from specbatch.resolve import DEMO_DIR

    target = DEMO_DIR / "target"
    rows = _shared_rows(10, prefix=192, seed=5, step=64)   # prefixes end on a row
    _, want = _generate(target, rows, batch_size=10, prefix_caching=False)
    spec = SpecConfig(algo, S, k, N, draft=str(DEMO_DIR / algo), drafter=algo)
    ref, plain = _generate(target, rows, batch_size=5, spec=spec, prefix_caching=False)
    eng, got = _generate(target, rows, batch_size=5, spec=spec)
    assert eng.prefix_caching and eng.cached_tokens >= 64 * 6
    assert ref.prefiller.tokens_run - eng.prefiller.tokens_run == eng.cached_tokens
    assert _tokens(got) == _tokens(want) == _tokens(plain)
    # lossless either way; the drafts show whether the draft layer read the right rows
    accepted = [r["spec"]["accepted_tokens"] for r in got]
    assert accepted == [r["spec"]["accepted_tokens"] for r in plain] and sum(accepted) > 0


@pytest.mark.parametrize("algo,S,k,N", [("eagle3", 3, 1, 4), ("nextn_mtp", 3, 1, 4)])
def test_a_draft_layer_copies_the_page_whose_next_token_differs(algo, S, k, N):
    """Prompts share 128 tokens and then differ: a draft layer's last row of page 7 reads the
    token after it, so that page is not shared; a request of a later wave copies it and computes
    its last row only (one of the same wave cannot: the page is not written yet). Tokens and
    accepted drafts are those of a run without caching."""
    from specbatch.resolve import DEMO_DIR

    target = DEMO_DIR / "target"
    g = torch.Generator().manual_seed(13)
    head = torch.randint(1, 200, (128,), generator=g).tolist()
    rows = [RowRequest(row=i, id=i, prompt_token_ids=head + [200 + i] + torch.randint(1, 200, (20,), generator=g).tolist(),
                       overrides={"max_tokens": 6}) for i in range(6)]
    spec = SpecConfig(algo, S, k, N, draft=str(DEMO_DIR / algo), drafter=algo)
    ref, plain = _generate(target, rows, batch_size=2, spec=spec, prefix_caching=False)
    eng, got = _generate(target, rows, batch_size=2, spec=spec)
    P = eng.page_size
    # row 0 finds nothing, row 1 (same wave) the 7 pages before, the four later rows a copy too
    assert eng.cached_tokens == (128 - P) + 4 * (128 - 1)
    assert ref.prefiller.tokens_run - eng.prefiller.tokens_run == eng.cached_tokens
    assert _tokens(got) == _tokens(plain)
    accepted = [r["spec"]["accepted_tokens"] for r in got]
    assert accepted == [r["spec"]["accepted_tokens"] for r in plain] and sum(accepted) > 0
    assert eng.pages.free_pages == eng.pages.usable


def test_a_drafter_that_keeps_prompt_state_elsewhere_turns_it_off(tiny_model):
    from specbatch.speculative.drafter import Drafter

    class Elsewhere(Drafter):                 # the base: shares_prompt_pages is False
        pass

    eng = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=4), drafter=Elsewhere())
    list(eng.generate(_shared_rows(4, prefix=150), SamplingDefaults(ignore_eos=True)))
    assert not eng.prefix_caching and eng.cached_tokens == 0 and eng.prompt_tokens > 0


def test_the_same_prompts_again_find_everything_until_the_cache_is_reset(tiny_model):
    """A second pass over the same rows (a bench's warm-up, a retried batch) skips every shareable
    row and writes the same tokens; after reset_prefix_cache (what the benches call before each
    measured run) nothing is found."""
    rows = _shared_rows(6, prefix=150, seed=7)
    eng = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=6))

    def run():
        before = eng.cached_tokens
        recs = sorted(eng.generate(rows, SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
        return recs, eng.cached_tokens - before

    first, hit1 = run()
    again, hit2 = run()
    assert _tokens(again) == _tokens(first) and hit2 > hit1
    P = eng.page_size
    assert hit2 == sum((len(r.prompt_token_ids) - 1) // P * P for r in rows)    # every whole page before the last token
    eng.reset_prefix_cache()
    cold, hit3 = run()
    assert _tokens(cold) == _tokens(first) and hit3 == hit1


def test_run_reports_the_cached_prompt_tokens_and_the_flag_turns_it_off(tiny_model, tmp_path):
    """`specbatch run` on prompts sharing a prefix: --stats-json and the summary say how many
    prompt tokens the pool held; --no-prefix-caching finds none and writes the same rows."""
    import json

    from typer.testing import CliRunner

    from specbatch.cli import app

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": 6}) + "\n"
                           for r in _shared_rows(8, prefix=150, seed=9)))
    outs = {}
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        out, stats = tmp_path / f"{flag}.jsonl", tmp_path / f"{flag}.json"
        r = CliRunner().invoke(app, ["run", str(inp), "--model", str(tiny_model), "--device", "cpu", "--ignore-eos",
                                     "--save-token-ids", "-o", str(out), "--stats-json", str(stats), flag])
        assert r.exit_code == 0, r.output
        s = json.loads(stats.read_text())
        assert s["prompt_tokens_admitted"] == s["prompt_tokens"]
        outs[flag] = ([json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()],
                      s["prompt_tokens_cached"], r.output)
    (on, cached, shown), (off, none, plain) = outs["--prefix-caching"], outs["--no-prefix-caching"]
    assert sorted(on) == sorted(off) and cached >= 7 * 64 and none == 0
    assert f"{cached:,} of" in shown and "prefix cache" not in plain


def test_the_library_and_ray_take_vllms_flag(tiny_model):
    """LLM(..., enable_prefix_caching=False), as vLLM spells it: also what Ray's engine_kwargs pass."""
    from specbatch.llm import LLM

    llm = LLM(model=tiny_model, device="cpu", max_tokens=2)
    assert llm.engine.prefix_caching
    assert not LLM(model=tiny_model, device="cpu", enable_prefix_caching=False).engine.prefix_caching
    prompt = {"prompt_token_ids": list(range(1, 140))}
    llm.generate([prompt])
    llm.generate([prompt])
    assert llm.engine.cached_tokens == 128                    # the second call found the first's pages
    llm.reset_prefix_cache()
    llm.generate([prompt])
    assert llm.engine.cached_tokens == 128                    # ... and after the reset, nothing


@pytest.mark.parametrize("algo", ["vanilla", "eagle3"])
def test_a_stream_stopped_midway_leaves_the_engine_ready(algo):
    """A caller that stops reading (breaks out of LLM.stream) leaves requests whose pages were
    granted, some indexed before their prefill ran: the next call starts from an empty pool and
    index, and writes what a fresh engine writes (it raised 'slot already holds pages' before)."""
    from specbatch.resolve import DEMO_DIR

    target = DEMO_DIR / "target"
    spec = {} if algo == "vanilla" else dict(spec=SpecConfig(algo, 3, 1, 4, draft=str(DEMO_DIR / algo), drafter=algo))
    rows = _shared_rows(10, prefix=180, seed=13)
    fresh, want = _generate(target, rows, batch_size=4, **spec)
    eng = Engine(target, EngineOptions(device="cpu", dtype="float32", batch_size=4, **spec))
    stream = eng.generate(rows, SamplingDefaults(ignore_eos=True))
    next(stream)
    stream.close()
    assert eng.pages.free_pages == eng.pages.usable and len(eng.pages.index) == 0
    got = sorted(eng.generate(rows, SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    assert _tokens(got) == _tokens(want)
    assert [r["spec"]["accepted_tokens"] for r in got] == [r["spec"]["accepted_tokens"] for r in want]
