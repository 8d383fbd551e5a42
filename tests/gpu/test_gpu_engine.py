"""The eager engine on CUDA (run on a GPU machine: `pytest -m gpu`)."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from conftest import ARCHS
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults

pytestmark = pytest.mark.gpu


def _rows(n=5, seed=0, **overrides):
    g = torch.Generator().manual_seed(seed)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 320, (3 + 7 * i,), generator=g).tolist(),
                       overrides=dict(overrides)) for i in range(n)]


def _generate(model_dir, device, dtype="float32", batch_size=3, **defaults):
    eng = Engine(model_dir, EngineOptions(batch_size=batch_size, device=device, dtype=dtype))
    recs = eng.generate(_rows(), SamplingDefaults(**{"max_tokens": 16, **defaults}))
    return [r["output_token_ids"] for r in sorted(recs, key=lambda r: r["row"])], eng


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_greedy_matches_transformers_on_cuda(arch, tiny_model_factory):
    d = tiny_model_factory(arch)
    ours, eng = _generate(d, "cuda")
    assert eng.device.type == "cuda" and eng.cache.layers[0][0].is_cuda
    hf = tf.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).cuda().eval()
    for row, got in zip(_rows(), ours):
        ids = torch.tensor([row.prompt_token_ids], device="cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=16, eos_token_id=0, pad_token_id=0)
        assert got == ref[0, ids.shape[1]:].tolist()


def test_cuda_equals_cpu_greedy_and_seeded_sampling(tiny_model):
    for defaults in ({}, {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 3}):
        cpu, _ = _generate(tiny_model, "cpu", **defaults)
        gpu, _ = _generate(tiny_model, "cuda", **defaults)
        assert cpu == gpu, defaults


def test_cuda_bfloat16_runs_and_sizes_cache_from_memory(tiny_model):
    out, eng = _generate(tiny_model, "cuda", dtype="bfloat16", batch_size=4)
    assert eng.cache.layers[0][0].dtype == torch.bfloat16
    assert eng.max_len == eng.cfg.max_position_embeddings       # tiny model: memory is no limit
    assert all(len(o) >= 1 for o in out)


def test_cuda_prefill_rows_split_across_forwards_equal_whole_prompts(tiny_model):
    """Packed prefill on the Triton kernels: prompts that span forwards (a budget of one token;
    of 100: captured forwards, pad tokens after the live ones) give the tokens of a budget holding
    every prompt whole (eager), of --eager, and the CPU's."""
    g = torch.Generator().manual_seed(5)
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, 320, (n,), generator=g).tolist())
            for i, n in enumerate([3, 31, 32, 33, 70, 150, 9])]
    outs = {}
    for device, budget, graphs in (("cuda", 1, True), ("cuda", 100, True), ("cuda", 8192, True),
                                   ("cuda", 100, False), ("cpu", 8192, False)):
        eng = Engine(tiny_model, EngineOptions(batch_size=4, device=device, dtype="float32", prefill_tokens=budget,
                                               graphs=graphs))
        assert (eng.prefiller.graphs is not None) == (device == "cuda" and graphs)
        recs = eng.generate(rows, SamplingDefaults(max_tokens=8, ignore_eos=True))
        outs[device, budget, graphs] = [r["output_token_ids"] for r in sorted(recs, key=lambda r: r["row"])]
    assert len({str(o) for o in outs.values()}) == 1, outs


def test_loading_in_bfloat16_never_holds_float32_weights(tiny_model):
    """Weights are allocated in their dtype (a float32 copy first would double the peak and leave
    its blocks in torch's cache, where the KV pool's sizing would not see them as free)."""
    from specbatch.models.loader import load_target

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, _ = load_target(tiny_model, "bfloat16", "cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16
    largest = max(p.numel() * p.element_size() for p in model.parameters())   # one tensor in flight
    assert torch.cuda.max_memory_allocated() - base < weights + largest + (1 << 20)


def test_cuda_prefix_caching_gives_the_tokens_of_a_full_prefill(tiny_model):
    """Prompts sharing prefixes on the Triton kernels (64-row pages): later prompts start past
    the shared pages, in captured and eager prefill forwards, within a wave and across waves;
    their tokens equal those without prefix caching and the CPU's."""
    g = torch.Generator().manual_seed(11)
    head = torch.randint(1, 320, (192,), generator=g).tolist()
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=head[: 192 - 64 * (i % 3)] +
                       torch.randint(1, 320, (1 + 5 * i,), generator=g).tolist()) for i in range(9)]
    outs, cached = {}, {}
    for device, caching, graphs, slots in (("cuda", True, True, 9), ("cuda", True, True, 3), ("cuda", True, False, 3),
                                           ("cuda", False, True, 3), ("cpu", False, False, 3)):
        eng = Engine(tiny_model, EngineOptions(batch_size=slots, device=device, dtype="float32", graphs=graphs,
                                               prefix_caching=caching))
        recs = eng.generate(rows, SamplingDefaults(max_tokens=8, ignore_eos=True))
        key = (device, caching, graphs, slots)
        outs[key] = [r["output_token_ids"] for r in sorted(recs, key=lambda r: r["row"])]
        cached[key] = eng.cached_tokens
    assert len({str(o) for o in outs.values()}) == 1, outs
    assert all(n >= 6 * 64 for k, n in cached.items() if k[1]) and cached["cuda", False, True, 3] == 0


def test_cuda_draft_layer_copies_the_page_whose_next_token_differs():
    """EAGLE3 on the demo model with 64-row pages: prompts share 192 tokens and then differ, so a
    draft layer's page 2 (its last row reads token 192) is copied by later waves' requests, who
    prefill only its last row, in captured and eager forwards; tokens and accepted drafts equal a
    run without prefix caching."""
    from specbatch.resolve import DEMO_DIR
    from specbatch.speculative.factory import SpecConfig

    g = torch.Generator().manual_seed(17)
    head = torch.randint(1, 200, (192,), generator=g).tolist()
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=head + [200 + i] +
                       torch.randint(1, 200, (3 + 7 * i,), generator=g).tolist()) for i in range(6)]
    spec = SpecConfig("eagle3", 3, 1, 4, draft=str(DEMO_DIR / "eagle3"), drafter="eagle3")
    outs, accepted, cached = {}, {}, {}
    for caching, graphs in ((False, True), (True, True), (True, False)):
        # (adaptive widths follow measured times: the accepted drafts compared need the whole proposal)
        eng = Engine(DEMO_DIR / "target", EngineOptions(batch_size=2, device="cuda", dtype="float32", spec=spec,
                                                        graphs=graphs, prefix_caching=caching, adaptive=False))
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=8, ignore_eos=True)), key=lambda r: r["row"])
        outs[caching, graphs] = [r["output_token_ids"] for r in recs]
        accepted[caching, graphs] = [r["spec"]["accepted_tokens"] for r in recs]
        cached[caching, graphs] = eng.cached_tokens
        assert eng.page_size == 64
    assert len({str(o) for o in outs.values()}) == 1 and len({str(a) for a in accepted.values()}) == 1
    # row 1 (row 0's wave) shares pages 0-1; rows 2-5 (later waves) a copy of page 2 as well
    assert cached[True, True] == cached[True, False] == 128 + 4 * 191
