"""NextN / MTP layers loaded from the three published layouts (DeepSeek, MiMo, Qwen3-Next), from
inside the target checkpoint or from an exported directory: the layer forward against a reference
built from the raw tensors and transformers' own decoder layer, the one-layer draft cache,
bfloat16, and a target carrying an MTP layer loading as the plain target. Load errors:
test_mtp_load_errors.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mtp_helpers import (CPU, H, LAYOUTS, PLACES, V, Reference, load_layer, mtp_dirs, mtp_rows,  # noqa: F401
                         output_ids, owns_weights, run_engine, target_model)
from specbatch.models.attention import AttnMetadata
from specbatch.models.loader import load_target
from specbatch.models.mtp import load_mtp
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.factory import SpecConfig, make_drafter
from specbatch.speculative.layer_drafter import LayerDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. the layer forward against a reference from the raw tensors ---------------------------

def _causal_meta(slots, T, prefix):
    B = slots.shape[0]
    return AttnMetadata(slots=slots, positions=prefix[:, None] + torch.arange(T).expand(B, T),
                        prefix_lens=prefix, kv_len=int(prefix.max()) + T)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "qwen3-tied"])
def test_layer_forward_matches_reference(mtp_dirs, arch, layout, place):
    target_dir, draft_dir = mtp_dirs(arch, layout, place)
    target = target_model(target_dir)
    layer = load_layer(target_dir, draft_dir)
    assert layer.cfg.layout == layout and layer.cfg.hidden_first == (layout == "mimo")
    ref = Reference(target_dir, draft_dir, layout, place)
    # own embedding / own head when the checkpoint has them, the target's (same parameter) otherwise
    assert ref.own_embed == ref.own_head == owns_weights(layout, place)
    if owns_weights(layout, place):
        assert layer.embed_tokens is not target.model.embed_tokens
        assert layer.lm_head is layer.shared_head.head
        assert torch.equal(layer.embed_tokens.weight, ref.embed)
    else:
        assert layer.embed_tokens is target.model.embed_tokens
        assert layer.lm_head is target.lm_head
    if arch == "qwen3-tied":
        assert layer.lm_head.weight is layer.embed_tokens.weight or owns_weights(layout, place)
    assert not any(p.requires_grad for p in layer.parameters())

    g = torch.Generator().manual_seed(5)
    B, P, T = 2, 6, 3                     # a prefill of P rows, then T rows on the cached prefix
    ids = torch.randint(0, V, (B, P + T), generator=g)
    hidden = torch.randn(B, P + T, H, generator=g)
    want, want_logits = ref(ids, hidden)

    slots = torch.tensor([1, 0])
    cache = KVCache(layer.cfg.layer, 2, 16, torch.float32, CPU)
    first = layer(ids[:, :P], hidden[:, :P], _causal_meta(slots, P, torch.zeros(B, dtype=torch.int64)),
                  cache.layers[0])
    kv_after_prefill = [t.clone() for t in cache.layers[0]]
    meta = _causal_meta(slots, T, torch.full((B,), P))
    second = layer(ids[:, P:], hidden[:, P:], meta, cache.layers[0])
    out = torch.cat([first, second], 1)
    assert out.shape == (B, P + T, H)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    logits = layer.logits(out)
    assert logits.dtype == torch.float32 and logits.shape == (B, P + T, V)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-5)

    # out_tokens: one token per sequence out of the same step, every row's K/V written the same way
    kv = [t.clone() for t in kv_after_prefill]
    rows = torch.tensor([T - 1, 0])
    sel = layer(ids[:, P:], hidden[:, P:], meta, kv, out_tokens=torch.arange(B) * T + rows)
    assert sel.shape == (B, 1, H)
    for b in range(B):
        torch.testing.assert_close(sel[b, 0], want[b, P + rows[b]], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kv, cache.layers[0]))


def test_drafter_cache_holds_one_layer(mtp_dirs):
    """The MTP layer is one decoder layer: its draft KV cache must not be sized for the target's L."""
    for place in PLACES:
        target_dir, draft_dir = mtp_dirs("llama", "mimo", place)
        drafter = make_drafter(SpecConfig("nextn_mtp", 3, 1, 4, str(draft_dir) if draft_dir else None),
                               target_model(target_dir), 2, 32, target_dir=str(target_dir))
        assert isinstance(drafter, LayerDrafter)
        assert drafter.reads_final_hidden and drafter.capture_layers == ()
        assert drafter.head.cfg.layer.num_layers == 1
        assert drafter.cache.data.shape[0] == 2 and len(drafter.cache.layers) == 1


def test_bfloat16_loading(mtp_dirs):
    target_dir, _ = mtp_dirs("qwen3", "qwen", "inside")
    t16, _ = load_target(target_dir, "bfloat16", "cpu")
    layer = load_mtp(t16, target_dir, None, torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    assert layer.inv_freq.dtype == torch.float32
    assert torch.equal(layer.inv_freq, load_layer(target_dir, None).inv_freq)
    w = load_file(str(target_dir / "model.safetensors"))
    # Gemma-style norms made plain before the cast
    assert torch.equal(layer.shared_head.norm.weight, (w["mtp.norm.weight"] + 1).to(torch.bfloat16))


# ---- 2. where the layer is read from ---------------------------------------------------------

def test_whole_deepseek_checkpoint_as_draft_dir(mtp_dirs):
    # --draft pointing at a checkpoint that keeps its NextN layer after the last decoder layer
    target, _ = mtp_dirs("llama", "deepseek", "inside")
    inside, as_draft = load_layer(target, None), load_layer(target, target)
    assert all(torch.equal(a, b) for a, b in zip(inside.state_dict().values(), as_draft.state_dict().values()))


def test_target_with_mtp_loads_as_plain_target(mtp_dirs):
    base = mtp_dirs("llama")
    plain = dict(target_model(base).named_parameters())
    rows = mtp_rows()
    vanilla = output_ids(run_engine(base, rows, 3))
    for layout in LAYOUTS:
        target_dir, _ = mtp_dirs("llama", layout, "inside")
        assert set(load_file(str(target_dir / "model.safetensors"))) > set(load_file(str(base / "model.safetensors")))
        params = dict(target_model(target_dir).named_parameters())
        assert params.keys() == plain.keys()
        assert all(torch.equal(params[k], plain[k]) for k in plain)
        assert output_ids(run_engine(target_dir, rows, 3)) == vanilla, layout
