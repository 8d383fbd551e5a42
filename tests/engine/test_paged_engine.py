"""The engine on its paged KV pool: many sequences share few pages, admission waits for pages
rather than failing, a prompt beyond the pool is an error row naming both, and outputs never
depend on how the pool is laid out (greedy: identical to a pool that holds everything)."""
from __future__ import annotations

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig


pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [RowRequest(row=i, id=i, prompt_token_ids=torch.randint(1, 200, (L,), generator=g).tolist(),
                       overrides={"max_tokens": 4 + i % 9}) for i, L in enumerate(lens)]


def _run(model, **opts):
    eng = Engine(model, EngineOptions(device="cpu", dtype="float32", profile=True, **opts))
    recs = sorted(eng.generate(_rows(30), SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    return eng, recs


def test_few_pages_many_slots_same_tokens(tiny_model):
    big, want = _run(tiny_model, batch_size=8, max_model_len=64)
    small, got = _run(tiny_model, batch_size=8, max_model_len=64, kv_rows=160, page_size=8)
    assert small.num_pages < big.num_pages and small.waited > 0          # requests waited for pages
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    assert all(r["error"] is None for r in got)
    assert max(small.occupancy) < 8                                        # pages, not slots, bound it
    assert small.pages.free_pages == small.pages.usable                    # every page came back


def test_a_prompt_beyond_the_pool_is_an_error_row(tiny_model):
    eng = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=4, kv_rows=48, page_size=8))
    assert eng.max_len < 48
    rows = [RowRequest(row=0, id="long", prompt_token_ids=list(range(1, 60)), where="in.jsonl:1"),
            RowRequest(row=1, id="ok", prompt_token_ids=[5, 6, 7])]
    recs = {r["id"]: r for r in eng.generate(rows, SamplingDefaults(max_tokens=4))}
    assert "prompt has 59 tokens but the context is" in recs["long"]["error"]
    assert str(eng.max_len) in recs["long"]["error"] and recs["long"]["prompt_tokens"] == 59
    assert recs["ok"]["error"] is None and recs["ok"]["completion_tokens"] >= 1


def test_waves_prefill_many_rows_per_forward(tiny_model):
    eng, recs = _run(tiny_model, batch_size=16, max_model_len=64, wave=0.5)
    assert len(recs) == 30 and eng.prefill_forwards < 15


@pytest.mark.parametrize("recipe", [("eagle3", 5, 4, 8), ("eagle3", 3, 1, 4), ("nextn_mtp", 3, 1, 4)])
def test_speculative_recipes_on_a_small_pool_are_lossless(recipe):
    """The draft layer's own pages share the target's page table; tree compaction moves rows
    inside pages. Greedy output equals vanilla on a pool that holds everything."""
    from specbatch.resolve import DEMO_DIR

    algo, S, k, N = recipe
    target = DEMO_DIR / "target"
    rows = [RowRequest(row=i, id=i, prompt_token_ids=p.prompt_token_ids, overrides={"max_tokens": 12})
            for i, p in enumerate(_rows(12, seed=1))]
    ref = Engine(target, EngineOptions(device="cpu", dtype="float32", batch_size=12, max_model_len=64))
    want = sorted(ref.generate(rows, SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    spec = SpecConfig(algo, S, k, N, draft=str(DEMO_DIR / algo), drafter=algo)
    eng = Engine(target, EngineOptions(device="cpu", dtype="float32", batch_size=6, max_model_len=64,
                                       kv_rows=200, page_size=8, spec=spec))
    got = sorted(eng.generate(rows, SamplingDefaults(ignore_eos=True)), key=lambda r: r["row"])
    assert [r["output_token_ids"] for r in got] == [r["output_token_ids"] for r in want]
    assert eng.waited > 0 and sum(r["spec"]["accepted_tokens"] for r in got) > 0


@pytest.mark.parametrize("shape", [(2, 2, 7), (3, 2, 11)])
def test_a_tree_request_that_used_its_whole_context_rides_the_next_cycle_inside_its_pages(shape):
    """A request that finishes commits up to D drafts past its max_tokens on the device and rides
    in the cycle launched before the host saw it finish: trees with N >= (S - 1) k + 3 wrote past
    the page table there (an IndexError on CPU; another slot's pages on GPU) when prompt + max_tokens
    filled the context and the table was exactly full. Every row now runs, as without the overlap."""
    from specbatch.resolve import DEMO_DIR

    S, k, N = shape
    spec = SpecConfig("eagle3", S, k, N, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3")
    ids = list(range(20, 60))
    rows = [RowRequest(row=i, id=i, prompt_token_ids=ids[:L]) for i, L in enumerate(range(5, 39, 3))]
    out = {}
    for overlap in (True, False):
        eng = Engine(DEMO_DIR / "target", EngineOptions(device="cpu", dtype="float32", batch_size=4, max_model_len=41,
                                                        page_size=16, spec=spec, overlap=overlap))
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=1000, ignore_eos=True)), key=lambda r: r["row"])
        assert len(recs) == len(rows) and all(r["error"] is None for r in recs)
        assert all(r["prompt_tokens"] + r["completion_tokens"] == 41 for r in recs)     # each filled its context
        assert eng.pages.free_pages == eng.pages.usable
        out[overlap] = [r["output_token_ids"] for r in recs]
    assert out[True] == out[False]


def test_default_slots_do_not_depend_on_the_models_whole_context(monkeypatch):
    """Llama-3.1-8B (131,072 positions) on an 80 GB GPU: admission reserves each request's own
    pages, so the default slot count follows the pool, not slots x max_position_embeddings."""
    from specbatch.bench.configs import BUILTIN
    from specbatch.engine import pool
    from specbatch.models.config import DecoderConfig

    cfg = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])
    monkeypatch.setattr(pool, "memory_budget", lambda device, reserve, utilization=None, held=0: 60 * 2**30)
    plan = pool.plan_pool(cfg, torch.bfloat16, torch.device("cuda"), headroom=8, drafting=True, batch_size=None,
                          max_model_len=None, page_size=None, kv_rows=None, prefill_tokens=8192)
    assert plan.max_len == 131072 and plan.num_slots == pool.MAX_DEFAULT_SLOTS
    monkeypatch.setattr(pool, "memory_budget",
                        lambda device, reserve, utilization=None, held=0: 2 * 2**30)    # a small pool: fewer slots
    small = pool.plan_pool(cfg, torch.bfloat16, torch.device("cuda"), headroom=8, drafting=False, batch_size=None,
                           max_model_len=8192, page_size=None, kv_rows=None, prefill_tokens=8192)
    assert 16 <= small.num_slots < pool.MAX_DEFAULT_SLOTS
    assert small.num_pages * small.page_size >= small.max_len


def test_default_slots_plan_the_reserve_for_the_slots_the_pool_holds(monkeypatch):
    """Llama-3.1-8B on a 24 GB GPU (~7 GiB free after the weights) with a wide tree's headroom:
    the logits kept for 512 slots would leave no pool at all. The default slots are the most
    whose own reserve leaves a pool that holds them."""
    from specbatch.bench.configs import BUILTIN
    from specbatch.engine import pool
    from specbatch.models.config import DecoderConfig

    cfg = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])
    free = 7 * 2**30
    monkeypatch.setattr(pool, "memory_budget",
                        lambda device, reserve, utilization=None, held=0: max(int(free * 0.9) - reserve, 0))
    args = dict(dtype=torch.bfloat16, device=torch.device("cuda"), drafting=True, max_model_len=None,
                page_size=None, kv_rows=None, prefill_tokens=8192)
    headroom = 12                                     # eagle3_tree: 8 nodes + the draft's scratch
    assert pool._reserve(cfg, torch.bfloat16, torch.device("cuda"), headroom, 8192, 512) > free * 0.9
    plan = pool.plan_pool(cfg, headroom=headroom, batch_size=None, **args)
    assert 16 < plan.num_slots < pool.MAX_DEFAULT_SLOTS
    row_bytes = pool.bytes_per_row(cfg, torch.bfloat16)
    row_bytes += row_bytes // cfg.num_layers                                     # the draft layer's pages
    P, dummy = plan.page_size, -(-headroom // plan.page_size)

    def pool_rows(slots: int) -> int:
        reserve = pool._reserve(cfg, torch.bfloat16, torch.device("cuda"), headroom, 8192, slots, drafting=True)
        return (max(int(free * 0.9) - reserve, 0) // (row_bytes * P) - 1 - dummy) * P

    assert pool_rows(plan.num_slots) >= plan.num_slots * pool.ROWS_PER_DEFAULT_SLOT    # the pool holds them
    assert pool_rows(plan.num_slots + 1) < (plan.num_slots + 1) * pool.ROWS_PER_DEFAULT_SLOT   # the most that fit
    assert plan.num_pages * P * row_bytes <= int(free * 0.9)
    # a given batch size keeps its own reserve, as before
    assert pool.plan_pool(cfg, headroom=2, batch_size=64, **args).num_slots == 64


def test_the_reserve_counts_the_verified_tokens_and_leaves_a_small_card_its_pool(monkeypatch):
    """The room kept out of the pool is counted part by part: the verify logits of the tokens a
    row verifies (not its whole headroom, which counts draft scratch too), an EAGLE3 prefill's
    captured hidden states, and no flat margin that would take a third of a 24 GB card's KV."""
    from specbatch.bench.configs import BUILTIN
    from specbatch.engine import pool
    from specbatch.models.config import DecoderConfig

    cfg = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])
    cuda, bf = torch.device("cuda"), torch.bfloat16
    free = int(7.4 * 2**30)                    # Llama-3.1-8B on a 24 GB card, after the weights
    monkeypatch.setattr(pool, "memory_budget",
                        lambda device, reserve, utilization=None, held=0: max(int(free * 0.9) - reserve, 0))
    args = dict(dtype=bf, device=cuda, max_model_len=None, page_size=None, kv_rows=None, prefill_tokens=8192)
    reserve = pool._reserve(cfg, bf, cuda, 4, 8192, 100, drafting=True)
    widest = 7 * cfg.hidden_size + 3 * cfg.intermediate_size          # a drafting forward's, per token
    per_node = 100 * (cfg.vocab_size * pool.LOGIT_BYTES + widest * 2)   # a verified token's logits and activations
    assert reserve - pool._reserve(cfg, bf, cuda, 3, 8192, 100, drafting=True) == per_node
    assert reserve - pool._reserve(cfg, bf, cuda, 4, 8192, 100) == (8192 + 400) * 3 * cfg.hidden_size * 2
    plan = pool.plan_pool(cfg, headroom=6, verify_nodes=4, drafting=True, batch_size=100, **args)
    row_bytes = pool.bytes_per_row(cfg, bf) * (cfg.num_layers + 1) // cfg.num_layers
    assert plan.num_pages == (int(free * 0.9) - reserve) // (row_bytes * plan.page_size)
    vanilla = pool.plan_pool(cfg, headroom=1, drafting=False, batch_size=None, **args)
    kv = vanilla.num_pages * vanilla.page_size * pool.bytes_per_row(cfg, bf)
    assert kv > 0.6 * free and vanilla.num_slots > 128


def test_the_summary_says_how_many_admissions_waited_for_pages(tiny_model, tmp_path, monkeypatch):
    """A pool too small for every slot at once: rows wait (never out of memory), and the run's
    summary, its JSON and its table say so."""
    import io
    import json

    from rich.console import Console

    from specbatch.job import JobOptions, run_job
    from specbatch.llm import LLM
    from specbatch.progress import print_summary
    from specbatch.recipe import load_recipe

    real = LLM.__init__

    def small_pool(self, *a, **kw):               # the job's engine with a pool of 160 rows
        real(self, *a, **kw)
        self.engine = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=8,
                                                       max_model_len=64, kv_rows=160, page_size=8))

    monkeypatch.setattr(LLM, "__init__", small_pool)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": 12}) + "\n"
                           for r in _rows(30)))
    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=8, ignore_eos=True)
    s = run_job(str(inp), recipe, JobOptions(output=str(tmp_path / "out.jsonl"), device="cpu"))
    assert s["waited_for_pages"] > 0 and s["errors"] == 0 and s["requests"] == 30
    # the pool as planned, beside it: what the waits came from
    assert s["slots"] == 8 and s["kv_page_rows"] == 8 and 160 <= s["kv_rows"] < 160 + 8
    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), s)
    assert "waited for KV pages" in buf.getvalue() and f"KV pool: {s['kv_rows']:,} rows" in buf.getvalue()
    assert f"{s['kv_rows']:,} token rows, 8 slots" in buf.getvalue()


def test_waited_for_pages_counts_requests_not_cycles(tiny_model):
    """A pool that holds one request's reservation at a time, two slots, two rows: one request
    waited for pages (the count said 40: one per cycle it sat out)."""
    eng = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=2, max_model_len=64,
                                           kv_rows=72, page_size=8, reserve_max_tokens=True))
    rows = [RowRequest(row=i, id=i, prompt_token_ids=[5, 6, 7, 8], overrides={"max_tokens": 40}) for i in range(2)]
    recs = list(eng.generate(rows, SamplingDefaults(ignore_eos=True)))
    assert len(recs) == 2 and all(r["error"] is None for r in recs)
    assert eng.waited == 1


def test_a_prompt_that_fills_the_context_says_so(tiny_model):
    eng = Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=2, max_model_len=32))
    full, over = eng.generate([RowRequest(row=0, id=0, prompt_token_ids=list(range(1, 33))),
                               RowRequest(row=1, id=1, prompt_token_ids=list(range(1, 34)))],
                              SamplingDefaults(max_tokens=4))
    assert "prompt has 32 tokens, no room for a completion, but the context is 32 tokens" in full["error"]
    assert "prompt has 33 tokens but the context is 32 tokens" in over["error"]


def test_more_slots_than_pages_is_an_error_naming_the_flag(tiny_model):
    from specbatch.models.config import ModelError

    with pytest.raises(ModelError, match=r"--batch-size \(or the recipe's batch_size\) 100000000: the cpu KV pool "
                                         r"holds \d+ pages of 8 rows .* use at most \d+"):
        Engine(tiny_model, EngineOptions(device="cpu", dtype="float32", batch_size=10**8, kv_rows=480, page_size=8))


def test_gpu_memory_utilization_is_this_engines_share_of_the_whole_gpu(monkeypatch):
    """As vLLM's: the engine may take that share of the GPU's whole memory, so the pool gets it
    less what the engine holds already (its weights) and the reserve; memory other processes
    hold is not counted in it, but the share must have been free when the engine started.
    Without it the pool takes 90% of what is free. Each refusal names the setting."""
    from specbatch.bench.configs import BUILTIN
    from specbatch.engine import pool
    from specbatch.models.config import DecoderConfig, ModelError
    from specbatch.runtime import kv_cache

    G = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * G, 24 * G))
    cuda = torch.device("cuda")
    assert kv_cache.memory_budget(cuda, G) == int(8 * G * 0.9) - G
    assert kv_cache.memory_budget(cuda, G, 0.95, held=16 * G) == int(24 * G * 0.95) - 16 * G - G
    cfg = DecoderConfig.from_dict(BUILTIN["llama-3.1-8b"])
    args = dict(dtype=torch.bfloat16, device=cuda, headroom=1, drafting=False, batch_size=None, page_size=None,
                kv_rows=None, prefill_tokens=8192, max_model_len=None)
    roomy = pool.plan_pool(cfg, utilization=0.98, held=16 * G, **args)
    default = pool.plan_pool(cfg, **args)
    tight = pool.plan_pool(cfg, utilization=0.8, held=16 * G, **args)
    assert roomy.num_pages > default.num_pages > tight.num_pages
    # another process holds 6 GiB: a share of 0.7 (16.8 GiB) still gets 6.8 GiB beside 10 of weights
    assert kv_cache.memory_budget(cuda, 0, 0.7, held=10 * G) == int(24 * G * 0.7) - 10 * G
    assert pool.plan_pool(cfg, utilization=0.7, held=10 * G, **args).num_pages > tight.num_pages
    with pytest.raises(ModelError, match=r"gpu_memory_utilization 0\.95 asks for 22\.8 GiB .* 18\.0 GiB were free"):
        pool.plan_pool(cfg, utilization=0.95, held=10 * G, **args)
    with pytest.raises(ModelError, match=r"gpu_memory_utilization 0\.7 gives .* weights hold 16\.0 GiB .* raise it"):
        pool.plan_pool(cfg, utilization=0.7, held=16 * G, **args)
