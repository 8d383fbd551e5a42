"""The pieces `specbatch bench` stands on, on CPU: the floor's byte counts and arithmetic, builtin
configs at real shape (on the meta device), derived EAGLE3 heads, and the transformers peer."""
from __future__ import annotations

import pytest
import torch

from specbatch.bench import configs
from specbatch.bench.floor import copy_bandwidth, draft_bytes, kv_bytes, step_floor_ms, weight_bytes
from specbatch.bench.hf_peer import hf_generate, hf_model
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.config import ModelError
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import bytes_per_row

from bench_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- floor helpers


@pytest.mark.parametrize("tie", [False, True])
def test_weight_bytes_counts_storage_once_without_embeddings(tie):
    m = configs.random_target({**TINY, "tie_word_embeddings": tie}, torch.float32, "cpu")
    emb = m.model.embed_tokens.weight.numel() * 4
    every = sum(p.numel() for p in m.parameters()) * 4       # parameters() yields a tied weight once
    if tie:
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert weight_bytes(m) == weight_bytes(m, exclude_embeddings=False) == every   # the head reads it all
    else:
        assert weight_bytes(m) == every - emb
        assert weight_bytes(m, exclude_embeddings=False) == every
    head = configs.random_eagle3(configs.head_config(TINY), m, torch.float32, "cpu")
    assert head.embed_tokens is m.model.embed_tokens               # shared, as load_eagle3 does
    h_all = sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens")) * 4
    assert weight_bytes(head) == h_all
    fc = head.fc.weight.numel() * 4
    assert draft_bytes(head, 3) == 2 * (h_all - fc) + h_all
    # a second Parameter object over the same storage is still one read
    twin = torch.nn.Module()
    twin.a = torch.nn.Linear(64, 64, bias=False)
    twin.b = torch.nn.Linear(64, 64, bias=False)
    twin.b.weight = torch.nn.Parameter(twin.a.weight.detach())
    assert weight_bytes(twin) == 64 * 64 * 4


def test_kv_and_floor_arithmetic():
    from specbatch.models.config import DecoderConfig

    cfg = DecoderConfig.from_dict(TINY)
    assert bytes_per_row(cfg, torch.bfloat16) == 2 * 4 * 2 * 16 * 2
    assert kv_bytes(cfg, torch.bfloat16, 10) == 10 * bytes_per_row(cfg, torch.bfloat16)
    assert step_floor_ms(2e9, 1e12) == pytest.approx(2.0)
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, iters=3) > 1e6


# ---------------------------------------------------------------- configs


def test_builtin_configs_build_at_real_shape_on_meta():
    cfg, name = configs.resolve_config("llama-3.1-8b")
    assert name == "llama-3.1-8b" and cfg["rope_scaling"]["rope_type"] == "llama3"
    m = configs.random_target(cfg, torch.bfloat16, "meta")
    assert m.lm_head.weight.device.type == "meta" and m.lm_head.weight.dtype == torch.bfloat16
    assert sum(p.numel() for p in m.parameters()) == 8_030_261_248
    assert m.cfg.num_kv_heads == 8 and m.cfg.eos_token_ids == (128001, 128008, 128009)
    assert weight_bytes(m) == (8_030_261_248 - 128256 * 4096) * 2
    head = configs.random_eagle3(configs.head_config(cfg, name), m, torch.bfloat16, "meta")
    assert tuple(head.lm_head.weight.shape) == (32000, 4096)
    assert tuple(head.fc.weight.shape) == (4096, 3 * 4096)
    assert tuple(head.d2t.shape) == (32000,) and head.embed_tokens is m.model.embed_tokens
    with pytest.raises(ModelError, match="llama-3.1-8b"):
        configs.resolve_config("llama-9b")


def test_derived_head_fits_a_tiny_target_with_distinct_ids():
    hc = configs.head_config(TINY)
    assert hc["draft_vocab_size"] == 320 and hc["hidden_size"] == 64 and hc["target_hidden_size"] == 64
    m = configs.random_target(TINY, torch.float32, "cpu")
    small = configs.random_eagle3({**hc, "draft_vocab_size": 100}, m, torch.float32, "cpu")
    mapped = torch.arange(100) + small.d2t
    assert len(set(mapped.tolist())) == 100 and int(mapped.max()) < 320
    assert int(small.t2d.sum()) == 100 and bool(small.t2d[mapped].all())


# ---------------------------------------------------------------- the transformers peer


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_hf_peer_matches_our_greedy_on_the_same_weights():
    m = configs.random_target(TINY, torch.float32, "cpu", seed=3)
    with torch.no_grad():
        m.lm_head.weight.mul_(10)                   # decisive logits: no near-ties between the two stacks
    hf = hf_model(TINY, m)
    assert hf.lm_head.weight.data_ptr() == m.lm_head.weight.data_ptr()            # shared, not copied
    assert hf.model.layers[1].mlp.up_proj.weight.data_ptr() == m.model.layers[1].mlp.up_proj.weight.data_ptr()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 320, (n,), generator=g).tolist() for n in (12, 12, 7)]
    got = hf_generate(hf, prompts, 10).tolist()
    eng = Engine(None, EngineOptions(batch_size=3, device="cpu", graphs=False, max_model_len=32),
                 model=m, tokenizer=_NoText())
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=10, ignore_eos=True)), key=lambda r: r["row"])
    assert got == [r["output_token_ids"] for r in recs]
