"""Greedy output equals transformers `generate` token for token (float32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from conftest import ARCHS
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from tiny_models import hf_greedy

PROMPT_LENS = (1, 23, 9, 40)
MAX_NEW = 12


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _ours(model_dir, prompts, batch_size, max_new, **opts):
    eng = Engine(model_dir, EngineOptions(batch_size=batch_size, device="cpu", dtype="float32", **opts))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=max_new)), key=lambda r: r["row"])
    assert [r["error"] for r in recs] == [None] * len(prompts)
    return [r["output_token_ids"] for r in recs], recs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_model_factory):
    d = tiny_model_factory(arch)
    prompts = _prompts(320, seed=ARCHS.index(arch))
    ref = hf_greedy(d, prompts, MAX_NEW, eos_token_id=0)
    assert any(len(r) == MAX_NEW for r in ref)            # the comparison covers long outputs too
    for bs in (1, 3):
        got, recs = _ours(d, prompts, bs, MAX_NEW)
        assert got == ref, f"{arch} batch {bs}"
        for r, ids in zip(recs, ref):
            assert r["finish_reason"] == ("stop" if ids[-1] == 0 else "length")


def test_sliding_window_narrower_than_a_prefill_tile_matches_transformers(tiny_model_factory):
    """A window of 12 rows, prompts up to 40: the prefill's query tiles shrink to fit inside the
    window (a tile's tokens read one another's rows), decode reads only the window."""
    d = tiny_model_factory("mistral", sliding_window=12)
    prompts = _prompts(320, seed=3)
    eng = Engine(d, EngineOptions(batch_size=2, device="cpu", dtype="float32"))
    assert eng.cfg.sliding_window == 12 and eng.prefiller.C == 11
    assert _ours(d, prompts, 2, MAX_NEW)[0] == hf_greedy(d, prompts, MAX_NEW, eos_token_id=0)


def test_a_window_narrower_than_a_cycle_is_refused_at_load(tiny_model_factory, tmp_path):
    """A cycle's new rows must all fit in the window: a recipe writing more rows per cycle than
    a (toy) model's window is a one-line ModelError when the engine loads, not an assertion
    mid-job that fails every row; vanilla runs the same model."""
    from specbatch.models.config import ModelError
    from specbatch.speculative.factory import SpecConfig

    d = tiny_model_factory("mistral", sliding_window=3)
    with pytest.raises(ModelError, match=r"sliding_window 3 is not wider than the \d+ rows a cycle writes"):
        Engine(d, EngineOptions(batch_size=2, device="cpu", dtype="float32",
                                spec=SpecConfig("eagle3", 3, 1, 4, str(tmp_path / "head"))))
    prompts = _prompts(320, seed=5)
    assert _ours(d, prompts, 2, MAX_NEW)[0] == hf_greedy(d, prompts, MAX_NEW, eos_token_id=0)


@pytest.mark.parametrize("variant", [dict(tie=True), dict(max_shard_size="60KB")])
def test_tied_and_sharded_checkpoints(variant, tiny_model_factory):
    d = tiny_model_factory("llama", **variant)
    if "max_shard_size" in variant:
        assert len(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    else:
        from safetensors import safe_open
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()          # tied: the head is the embedding
    prompts = _prompts(320, seed=7)
    assert _ours(d, prompts, 2, MAX_NEW)[0] == hf_greedy(d, prompts, MAX_NEW, eos_token_id=0)


def test_eos_from_generation_config_list(tiny_model_factory, tmp_path):
    """All EOS ids of generation_config.json stop generation, and the EOS id ends the output."""
    d = tiny_model_factory("qwen2")
    prompts = _prompts(320, seed=3)
    free = _ours(d, prompts, 3, MAX_NEW)[0]
    # Make the 4th generated token of prompt 0 an EOS id (alongside one never produced).
    eos = free[0][3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [317, eos]}))
    try:
        got, recs = _ours(d, prompts, 3, MAX_NEW)
        ref = hf_greedy(d, prompts, MAX_NEW, eos_token_id=[317, eos])
    finally:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert got == ref
    assert got[0][-1] == eos and len(got[0]) <= 4 and recs[0]["finish_reason"] == "stop"
    # not the tokenizer's EOS: its id is the stop_reason, as vLLM adds the config's other EOS ids to stop_token_ids
    assert eos != tf.AutoTokenizer.from_pretrained(d).eos_token_id and recs[0]["stop_reason"] == eos


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_agrees(dtype, tiny_model_factory):
    """Weights and cache in the requested dtype; logits within that dtype's error of float32."""
    from specbatch.models.attention import AttnMetadata

    d = tiny_model_factory("qwen3")
    eng = Engine(d, EngineOptions(batch_size=1, device="cpu", dtype=dtype))
    assert eng.model.lm_head.weight.dtype == getattr(torch, dtype)
    assert eng.cache.layers[0][0].dtype == getattr(torch, dtype)
    assert eng.model.inv_freq.dtype == torch.float32
    hf = tf.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = torch.tensor([_prompts(320, seed=11)[1]])
    T = ids.shape[1]
    meta = AttnMetadata(slots=torch.tensor([0]), positions=torch.arange(T)[None],
                        prefix_lens=torch.tensor([0]), kv_len=T)
    with torch.no_grad():
        ours = eng.model.logits(eng.model(ids, meta, eng.cache.layers)[0])
        ref = hf(ids).logits
    rel = (ours - ref).norm() / ref.norm()
    assert rel < (0.03 if dtype == "bfloat16" else 0.005), rel
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_length_bucketing_gives_same_outputs(tiny_model):
    prompts = _prompts(320, seed=5) * 2
    plain = _ours(tiny_model, prompts, 3, 8)[0]
    bucketed = _ours(tiny_model, prompts, 3, 8, bucket_window=6)[0]
    assert plain == bucketed


def test_captured_layer_outputs(tiny_model):
    """Captured states are the residual stream after each requested layer, in the order asked."""
    from specbatch.models.attention import AttnMetadata
    from specbatch.runtime.kv_cache import KVCache

    eng = Engine(tiny_model, EngineOptions(batch_size=1, device="cpu"))
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    ids = torch.tensor([_prompts(320)[3]])
    T = ids.shape[1]
    cache = KVCache(eng.cfg, 1, 64, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slots=torch.tensor([0]), positions=torch.arange(T)[None], prefix_lens=torch.tensor([0]), kv_len=T)
    with torch.no_grad():
        _, caps = eng.model(ids, meta, cache.layers, capture=(2, 0))
        ref = hf(ids, output_hidden_states=True).hidden_states   # [emb, after layer 0, ...]
    torch.testing.assert_close(caps[1], ref[1], rtol=1e-4, atol=1e-4)
    # The last HF entry is after the final norm; ours is the raw output of layer 2.
    last = hf.model.norm(caps[0])
    torch.testing.assert_close(last, ref[-1], rtol=1e-4, atol=1e-4)
