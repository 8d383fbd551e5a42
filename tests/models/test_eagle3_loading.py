"""EAGLE3 heads loaded from the published layout: the reduced draft vocabulary through d2t / t2d,
own or shared embedding, every file tensor in place, the `model.` prefix, bfloat16, the head
forward against a plain reference written from the tensors, and the aux layer convention (what
the target captures, which layers the factory asks for). Load errors: test_eagle3_load_errors.py."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3_helpers import CPU, H, V, Ref, causal_meta, head, head_dir, load_head, target, weights  # noqa: F401
from errors import one_line_model_error
from specbatch.models.eagle3 import default_aux_layers
from specbatch.models.loader import load_target
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.factory import SpecConfig, make_drafter
from tiny_models import make_eagle3_head


# ---- 1. loading the published layout ---------------------------------------------------------

def test_reduced_draft_vocab_maps_through_d2t(head_dir, head):
    w = weights(head_dir)
    chosen = torch.arange(200) + w["d2t"]
    assert head.cfg.draft_vocab_size == 200 and head.lm_head.weight.shape == (200, H)
    assert torch.equal(head.to_target(torch.arange(200)), chosen)
    # a few ids in a [B, T] layout map elementwise
    ids = torch.tensor([[0, 199, 7], [3, 3, 150]])
    assert torch.equal(head.to_target(ids), chosen[ids])
    assert head.t2d.dtype == torch.bool and head.t2d.shape == (V,)
    assert torch.equal(head.t2d.nonzero().flatten(), chosen)
    assert torch.equal(head.t2d, w["t2d"])
    # the chosen ids are a proper subset: a mapping that ignored d2t would fail here
    assert not torch.equal(chosen, torch.arange(200))


def test_full_vocab_head_is_identity(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, draft_vocab=None)
    raw = json.loads((d / "config.json").read_text())
    assert "draft_vocab_size" not in raw and not {"d2t", "t2d"} & set(weights(d))
    head = load_head(d, target)
    assert head.cfg.draft_vocab_size == V and head.lm_head.weight.shape == (V, H)
    assert torch.equal(head.to_target(torch.arange(V)), torch.arange(V))
    assert bool(head.t2d.all()) and head.t2d.shape == (V,)


def test_own_embedding_is_the_files(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, own_embedding=True, seed=3)
    head = load_head(d, target)
    w = weights(d)["embed_tokens.weight"]
    assert head.embed_tokens is not target.model.embed_tokens
    assert torch.equal(head.embed_tokens.weight, w)
    assert not torch.equal(head.embed_tokens.weight, target.model.embed_tokens.weight)


def test_without_embedding_shares_the_targets_parameter(head_dir, head, target):
    assert "embed_tokens.weight" not in weights(head_dir)
    assert head.embed_tokens is target.model.embed_tokens
    assert head.embed_tokens.weight is target.model.embed_tokens.weight


def test_all_file_tensors_land_in_the_head(head_dir, head):
    params = dict(head.named_parameters())
    for name, t in weights(head_dir).items():
        if name in ("d2t", "t2d"):
            continue
        assert torch.equal(params[name], t), name
    assert head.fc.bias is None


def test_fc_bias_is_loaded(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, fc_bias=True)
    head = load_head(d, target)
    assert head.fc.bias is not None
    assert torch.equal(head.fc.bias, weights(d)["fc.bias"])


def test_model_prefix_is_stripped(tmp_path, target_dir, target):
    plain = make_eagle3_head(tmp_path / "plain", target_dir, seed=5, own_embedding=True)
    pref = make_eagle3_head(tmp_path / "pref", target_dir, seed=5, own_embedding=True, prefix="model.")
    assert all(k.startswith("model.") for k in weights(pref))
    a, b = load_head(plain, target), load_head(pref, target)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert b.embed_tokens is not target.model.embed_tokens     # own embedding found under the prefix


def test_aux_layer_ids_explicit_and_default(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "x", target_dir, aux_ids=[0, 2, 3])
    assert load_head(d, target).cfg.aux_layer_ids == (0, 2, 3)
    drafter = make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32)
    assert drafter.capture_layers == (0, 2, 3)

    d = make_eagle3_head(tmp_path / "y", target_dir)
    assert load_head(d, target).cfg.aux_layer_ids is None
    drafter = make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32)
    assert drafter.capture_layers == default_aux_layers(4) == (1, 1, 0)
    assert default_aux_layers(32) == (1, 15, 28)
    assert default_aux_layers(36) == (1, 17, 32)


def test_bfloat16_loading(target_dir, head_dir, head):
    t16, _ = load_target(target_dir, "bfloat16", "cpu")
    drafter = make_drafter(SpecConfig("eagle3", 3, 2, 6, draft=str(head_dir)), t16, 2, 32)
    h16 = drafter.head
    for name, p in h16.named_parameters():
        assert p.dtype == torch.bfloat16, name
    assert h16.embed_tokens.weight is t16.model.embed_tokens.weight
    assert h16.d2t.dtype == torch.int64 and h16.t2d.dtype == torch.bool
    assert torch.equal(h16.d2t, head.d2t) and torch.equal(h16.t2d, head.t2d)
    assert h16.inv_freq.dtype == torch.float32 and torch.equal(h16.inv_freq, head.inv_freq)
    for name, t in weights(head_dir).items():
        if name not in ("d2t", "t2d"):
            assert torch.equal(dict(h16.named_parameters())[name], t.to(torch.bfloat16)), name
    assert drafter.cache.layers[0][0].dtype == torch.bfloat16
    # a bf16 forward runs and stays close to the float32 one
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, 6), generator=g)
    feats = torch.randn(1, 6, 3 * H, generator=g)
    slots = torch.tensor([0])
    out = []
    for hd, dt in ((h16, torch.bfloat16), (head, torch.float32)):
        cache = KVCache(hd.cfg.layer, 1, 8, dt, CPU)
        out.append(hd(ids, feats.to(dt), causal_meta(slots, 6), cache.layers[0], features=True))
    assert out[0].dtype == torch.bfloat16
    err = (out[0].float() - out[1]).norm() / out[1].norm()
    assert err < 3e-2, err


# ---- 2. head forward equals the reference ----------------------------------------------------

@pytest.mark.parametrize("features", [True, False])
@pytest.mark.parametrize("variant", ["plain", "own_embedding_bias"])
def test_head_forward_matches_reference(tmp_path, target_dir, target, head_dir, features, variant):
    if variant == "plain":
        d = head_dir
    else:
        d = make_eagle3_head(tmp_path / "h", target_dir, own_embedding=True, fc_bias=True, seed=7)
    head = load_head(d, target)
    ref = Ref(d, target.model.embed_tokens.weight)
    g = torch.Generator().manual_seed(11)
    B, T = 2, 9
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, 3 * H if features else H, generator=g)
    slots = torch.tensor([1, 0])
    cache = KVCache(head.cfg.layer, 2, 16, torch.float32, CPU)
    out = head(ids, hidden, causal_meta(slots, T), cache.layers[0], features=features)
    assert out.shape == (B, T, H)
    for b in range(B):
        want, k, v = ref.layer(ids[b], hidden[b], features, torch.arange(T))
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
        # the K/V landed in this sequence's slot
        torch.testing.assert_close(cache.layers[0][0][slots[b], :T], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.layers[0][1][slots[b], :T], v, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.logits(out[b]), ref.logits(want), atol=1e-5, rtol=1e-5)
    assert head.logits(out).dtype == torch.float32 and head.logits(out).shape == (B, T, 200)


# ---- 3. aux layer convention -----------------------------------------------------------------

def test_capture_is_layer_output_like_hf_hidden_states(target_dir, target):
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    T = 7
    ids = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    assert len(hs) == 5
    cache = KVCache(target.cfg, 1, T, torch.float32, CPU)
    normed, cap = target(ids, causal_meta(torch.tensor([0]), T), cache.layers, capture=(0, 2, 3))
    torch.testing.assert_close(cap[0], hs[1], atol=1e-5, rtol=1e-5)       # output of layer 0
    torch.testing.assert_close(cap[1], hs[3], atol=1e-5, rtol=1e-5)       # output of layer 2
    # transformers' last entry is normalised; ours is the residual stream before the norm
    torch.testing.assert_close(target.model.norm(cap[2]), hs[4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, hs[4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(cap[2], hs[4], atol=1e-3)
    # order follows `capture`, repeats allowed (default ids of a 4-layer target repeat layer 1)
    cache = KVCache(target.cfg, 1, T, torch.float32, CPU)
    _, cap2 = target(ids, causal_meta(torch.tensor([0]), T), cache.layers, capture=(3, 1, 1, 0))
    assert len(cap2) == 4
    torch.testing.assert_close(cap2[0], cap[2], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cap2[1], hs[2], atol=1e-5, rtol=1e-5)
    assert torch.equal(cap2[1], cap2[2])
    torch.testing.assert_close(cap2[3], hs[1], atol=1e-5, rtol=1e-5)


def test_factory_uses_aux_ids_verbatim(tmp_path, target_dir, target):
    for ids in ([0, 2, 3], [3, 1, 2], [1, 1, 2]):
        d = make_eagle3_head(tmp_path / "-".join(map(str, ids)), target_dir, aux_ids=ids)
        drafter = make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32)
        assert drafter.head.cfg.aux_layer_ids == tuple(ids)
        assert drafter.capture_layers == tuple(ids)


def test_default_aux_layers_fit_any_depth():
    # published (1, L//2-1, L-4) wherever those ids exist; out-of-range ids clamped into 0..L-1
    for L in range(1, 65):
        ids = default_aux_layers(L)
        assert len(ids) == 3 and all(0 <= i < L for i in ids), (L, ids)
        if L >= 4:
            assert ids == (1, L // 2 - 1, L - 4)
    assert [default_aux_layers(L) for L in (1, 2, 3)] == [(0, 0, 0), (1, 0, 0), (1, 0, 0)]
    with pytest.raises(ValueError):
        default_aux_layers(0)


def test_factory_default_aux_ids_on_a_shallow_target(tmp_path, tiny_model_factory):
    # replaces test_factory_default_aux_ids_too_shallow: the default is now valid for any depth
    t3_dir = tiny_model_factory("llama3")          # 3 layers: (1, 0, -1) clamped to (1, 0, 0)
    t3, _ = load_target(t3_dir, "float32", "cpu")
    d = make_eagle3_head(tmp_path / "h", t3_dir)
    assert make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), t3, 2, 32).capture_layers == (1, 0, 0)
    bad = make_eagle3_head(tmp_path / "bad", t3_dir, aux_ids=[0, 1, 3])   # named ids are not clamped
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(bad)), t3, 2, 32),
                         bad, "eagle_aux_hidden_state_layer_ids", "3 layers", "[0, 1, 3]")
