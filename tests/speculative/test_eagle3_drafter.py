"""EAGLE3 draft heads: loading the published layout, one-line load errors, the head forward against
a plain reference written from the tensors, the catch-up that computes only the used row, the aux
layer convention, and the drafter's tree / chain proposals against a hand-built reference."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.models.attention import AttnMetadata
from specbatch.models.eagle3 import default_aux_layers, load_eagle3
from specbatch.models.loader import load_target
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.layer_drafter import LayerDrafter
from specbatch.speculative.factory import SpecConfig, make_drafter
from tiny_models import make_eagle3_head
from errors import one_line_model_error

CPU = torch.device("cpu")
V = 320          # tiny targets' vocabulary
H = 64           # tiny targets' hidden size


# ---- fixtures and helpers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tiny_model_factory):
    return tiny_model_factory("llama3", num_hidden_layers=4)


@pytest.fixture(scope="module")
def target(target_dir):
    model, _ = load_target(target_dir, "float32", "cpu")
    return model


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_dir):
    """A reduced-vocabulary head (200 draft ids) in the published layout; never edited."""
    return make_eagle3_head(tmp_path_factory.mktemp("head"), target_dir, draft_vocab=200, seed=1)


@pytest.fixture(scope="module")
def head(head_dir, target):
    return load_eagle3(head_dir, target.cfg, target.model.embed_tokens, torch.float32, CPU)


def _load(d, target, dtype=torch.float32):
    return load_eagle3(d, target.cfg, target.model.embed_tokens, dtype, CPU)


def _weights(d) -> dict[str, torch.Tensor]:
    return load_file(str(Path(d) / "model.safetensors"))


def _save_weights(d, w):
    save_file({k: v.contiguous() for k, v in w.items()}, str(Path(d) / "model.safetensors"))


def _edit_config(d, **kv):
    p = Path(d) / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(kv)
    p.write_text(json.dumps(cfg))


def _copy(src, tmp_path, name="edited") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _causal_meta(slots, T, prefix=None):
    B = slots.shape[0]
    prefix = torch.zeros(B, dtype=torch.int64) if prefix is None else prefix
    return AttnMetadata(slots=slots, positions=prefix[:, None] + torch.arange(T),
                        prefix_lens=prefix, kv_len=int(prefix.max()) + T)


# ---- the plain reference (tensors straight from the file) ------------------------------------

class Ref:
    """The EAGLE3 head written out by hand from the file's tensors (float32, one sequence)."""

    def __init__(self, head_dir, embed_weight: torch.Tensor):
        self.w = {k[len("model."):] if k.startswith("model.") else k: v.float()
                  for k, v in _weights(head_dir).items()}
        cfg = json.loads((Path(head_dir) / "config.json").read_text())
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.H = cfg["hidden_size"]
        self.d = self.H // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg["rope_theta"]
        self.emb = self.w.get("embed_tokens.weight", embed_weight.float())
        vd = self.w["lm_head.weight"].shape[0]
        self.d2t = self.w["d2t"].long() if "d2t" in self.w else torch.zeros(vd, dtype=torch.int64)

    def rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def lin(self, x, name):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def rope(self, x, pos):              # x [T, n, d], pos [T]
        d = self.d
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = pos[:, None].float() * inv
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    def layer(self, tokens, hidden, features, pos, past_k=None, past_v=None, mask=None):
        """tokens [T], hidden [T, 3H_t] or [T, H], pos [T]; attends to past rows + the new rows
        (mask [T, P+T], default causal over the new rows). -> (pre-norm h [T, H], k, v)."""
        T = tokens.shape[0]
        h = self.lin(hidden, "fc") if features else hidden
        x = torch.cat([self.rms(self.emb[tokens], "midlayer.input_layernorm.weight"),
                       self.rms(h, "midlayer.hidden_norm.weight")], -1)
        a = "midlayer.self_attn."
        q = self.rope(self.lin(x, a + "q_proj").view(T, self.heads, self.d), pos)
        k = self.rope(self.lin(x, a + "k_proj").view(T, self.kv_heads, self.d), pos)
        v = self.lin(x, a + "v_proj").view(T, self.kv_heads, self.d)
        P = 0 if past_k is None else past_k.shape[0]
        keys = k if past_k is None else torch.cat([past_k, k])
        vals = v if past_v is None else torch.cat([past_v, v])
        if mask is None:
            mask = torch.cat([torch.ones(T, P, dtype=torch.bool),
                              torch.ones(T, T, dtype=torch.bool).tril()], 1)
        g = self.heads // self.kv_heads
        kk, vv = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
        s = torch.einsum("thd,shd->hts", q, kk) * self.d ** -0.5
        s = s.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), vv).reshape(T, -1)
        h = h + self.lin(o, a + "o_proj")
        m = "midlayer.mlp."
        y = self.rms(h, "midlayer.post_attention_layernorm.weight")
        y = self.lin(torch.nn.functional.silu(self.lin(y, m + "gate_proj")) * self.lin(y, m + "up_proj"),
                     m + "down_proj")
        return h + y, k, v

    def logits(self, h):
        return self.lin(self.rms(h, "norm.weight"), "lm_head")

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


# ---- 1. loading the published layout ---------------------------------------------------------

def test_reduced_draft_vocab_maps_through_d2t(head_dir, head):
    w = _weights(head_dir)
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
    assert "draft_vocab_size" not in raw and not {"d2t", "t2d"} & set(_weights(d))
    head = _load(d, target)
    assert head.cfg.draft_vocab_size == V and head.lm_head.weight.shape == (V, H)
    assert torch.equal(head.to_target(torch.arange(V)), torch.arange(V))
    assert bool(head.t2d.all()) and head.t2d.shape == (V,)


def test_own_embedding_is_the_files(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, own_embedding=True, seed=3)
    head = _load(d, target)
    w = _weights(d)["embed_tokens.weight"]
    assert head.embed_tokens is not target.model.embed_tokens
    assert torch.equal(head.embed_tokens.weight, w)
    assert not torch.equal(head.embed_tokens.weight, target.model.embed_tokens.weight)


def test_without_embedding_shares_the_targets_parameter(head_dir, head, target):
    assert "embed_tokens.weight" not in _weights(head_dir)
    assert head.embed_tokens is target.model.embed_tokens
    assert head.embed_tokens.weight is target.model.embed_tokens.weight


def test_all_file_tensors_land_in_the_head(head_dir, head):
    params = dict(head.named_parameters())
    for name, t in _weights(head_dir).items():
        if name in ("d2t", "t2d"):
            continue
        assert torch.equal(params[name], t), name
    assert head.fc.bias is None


def test_fc_bias_is_loaded(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, fc_bias=True)
    head = _load(d, target)
    assert head.fc.bias is not None
    assert torch.equal(head.fc.bias, _weights(d)["fc.bias"])


def test_model_prefix_is_stripped(tmp_path, target_dir, target):
    plain = make_eagle3_head(tmp_path / "plain", target_dir, seed=5, own_embedding=True)
    pref = make_eagle3_head(tmp_path / "pref", target_dir, seed=5, own_embedding=True, prefix="model.")
    assert all(k.startswith("model.") for k in _weights(pref))
    a, b = _load(plain, target), _load(pref, target)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert b.embed_tokens is not target.model.embed_tokens     # own embedding found under the prefix


def test_aux_layer_ids_explicit_and_default(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "x", target_dir, aux_ids=[0, 2, 3])
    assert _load(d, target).cfg.aux_layer_ids == (0, 2, 3)
    drafter = make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32)
    assert drafter.capture_layers == (0, 2, 3)

    d = make_eagle3_head(tmp_path / "y", target_dir)
    assert _load(d, target).cfg.aux_layer_ids is None
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
    for name, t in _weights(head_dir).items():
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
        out.append(hd(ids, feats.to(dt), _causal_meta(slots, 6), cache.layers[0], features=True))
    assert out[0].dtype == torch.bfloat16
    err = (out[0].float() - out[1]).norm() / out[1].norm()
    assert err < 3e-2, err


# ---- 2. errors -------------------------------------------------------------------------------

def test_error_not_eagle3(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    _edit_config(d, architectures=["LlamaForCausalLM"])
    one_line_model_error(lambda: _load(d, target), d / "config.json", "LlamaForCausalLMEagle3", "EAGLE3")


def test_error_vocab_mismatch(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    _edit_config(d, vocab_size=300)
    one_line_model_error(lambda: _load(d, target), d / "config.json", "vocab_size 300", "320")


def test_error_target_hidden_mismatch(tmp_path, tiny_model_factory, head_dir):
    wide_dir = tiny_model_factory("llama3", num_hidden_layers=4, hidden_size=96)
    wide, _ = load_target(wide_dir, "float32", "cpu")
    assert wide.cfg.hidden_size == 96
    one_line_model_error(lambda: _load(head_dir, wide), head_dir, "64", "96", "hidden size")
    # the same through the factory
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(head_dir)), wide, 2, 32),
                    head_dir, "96")


def test_error_missing_tensor(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    del w["midlayer.mlp.up_proj.weight"]
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), d, "missing", "midlayer.mlp.up_proj.weight")


def test_error_lm_head_rows(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    w["lm_head.weight"] = w["lm_head.weight"][:199]
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), d, "lm_head.weight", "(199, 64)", "(200, 64)")


def test_error_unexpected_tensor(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    w["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), d, "unexpected", "midlayer.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("index,value", [(-1, 1000), (0, -1)])   # draft 199 -> 1199; draft 0 -> -1
def test_error_d2t_outside_target_vocab(tmp_path, head_dir, target, index, value):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    w["d2t"][index] = value
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), d, "d2t", "outside the target vocabulary")


def test_error_d2t_shape_names_the_file(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    w["d2t"] = w["d2t"][:199]
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), "d2t", "(199,)", "(200,)", d)


def test_error_t2d_shape(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    w = _weights(d)
    w["t2d"] = w["t2d"][:100]
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), "t2d", "(100,)", f"({V},)")


def test_error_head_hidden_without_embedding(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, hidden_size=32)
    raw = json.loads((d / "config.json").read_text())
    assert raw["target_hidden_size"] == 64 and raw["hidden_size"] == 32
    head = _load(d, target)                      # with its own 32-wide embedding: fine
    assert head.embed_tokens.weight.shape == (V, 32) and head.fc.weight.shape == (32, 3 * 64)
    w = _weights(d)
    del w["embed_tokens.weight"]
    _save_weights(d, w)
    one_line_model_error(lambda: _load(d, target), d, "embed_tokens", "32", "64")


def test_error_missing_config(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    (d / "config.json").unlink()
    one_line_model_error(lambda: _load(d, target), d, "config.json")
    one_line_model_error(lambda: _load(tmp_path / "nowhere", target), tmp_path / "nowhere", "not found")


def test_error_no_safetensors(tmp_path, head_dir, target):
    d = _copy(head_dir, tmp_path)
    (d / "model.safetensors").unlink()
    one_line_model_error(lambda: _load(d, target), d, "safetensors")


def test_factory_aux_ids_out_of_range(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, aux_ids=[0, 1, 9])
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32),
                    d, "[0, 1, 9]", "eagle_aux_hidden_state_layer_ids", "4 layers")
    d = make_eagle3_head(tmp_path / "two", target_dir, aux_ids=[0, 1])
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32),
                    d, "[0, 1]")
    d = make_eagle3_head(tmp_path / "neg", target_dir, aux_ids=[-1, 1, 2])
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(d)), target, 2, 32),
                    d, "[-1, 1, 2]")


def test_factory_needs_a_draft(target):
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4), target, 2, 32), "draft")


def test_factory_topk_exceeds_draft_vocab(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, draft_vocab=4)
    assert isinstance(make_drafter(SpecConfig("eagle3", 2, 4, 5, draft=str(d)), target, 2, 32), LayerDrafter)
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 2, 5, 6, draft=str(d)), target, 2, 32),
                    "topk 5", "4")


# ---- 3. head forward equals the reference ----------------------------------------------------

@pytest.mark.parametrize("features", [True, False])
@pytest.mark.parametrize("variant", ["plain", "own_embedding_bias"])
def test_head_forward_matches_reference(tmp_path, target_dir, target, head_dir, features, variant):
    if variant == "plain":
        d = head_dir
    else:
        d = make_eagle3_head(tmp_path / "h", target_dir, own_embedding=True, fc_bias=True, seed=7)
    head = _load(d, target)
    ref = Ref(d, target.model.embed_tokens.weight)
    g = torch.Generator().manual_seed(11)
    B, T = 2, 9
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, 3 * H if features else H, generator=g)
    slots = torch.tensor([1, 0])
    cache = KVCache(head.cfg.layer, 2, 16, torch.float32, CPU)
    out = head(ids, hidden, _causal_meta(slots, T), cache.layers[0], features=features)
    assert out.shape == (B, T, H)
    for b in range(B):
        want, k, v = ref.layer(ids[b], hidden[b], features, torch.arange(T))
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
        # the K/V landed in this sequence's slot
        torch.testing.assert_close(cache.layers[0][0][slots[b], :T], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.layers[0][1][slots[b], :T], v, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.logits(out[b]), ref.logits(want), atol=1e-5, rtol=1e-5)
    assert head.logits(out).dtype == torch.float32 and head.logits(out).shape == (B, T, 200)


# ---- 4. catch-up computes only the used row (seed 003) ---------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("features", [True, False])
def test_out_rows_writes_all_rows_and_returns_the_used_one(head, features, dtype):
    """float64 shows the two ways compute the same thing (1e-12); float32 agrees to 1e-6 of the
    output's scale (outputs reach ~20 here, where one float32 ulp is ~2e-6)."""
    if dtype == torch.float64:
        head = copy.deepcopy(head).double()
    g = torch.Generator().manual_seed(3)
    B, T, num_slots, rows_per_slot = 3, 5, 4, 16
    slots = torch.tensor([3, 0, 1])
    prefix = torch.tensor([0, 3, 7])
    rows = torch.tensor([0, T - 1, 2])
    ids = torch.randint(0, V, (B, T), generator=g)
    hidden = torch.randn(B, T, 3 * H if features else H, generator=g, dtype=dtype)

    base = KVCache(head.cfg.layer, num_slots, rows_per_slot, dtype, CPU)
    for k, v in base.layers:
        k.copy_(torch.randn(k.shape, generator=g, dtype=dtype))
        v.copy_(torch.randn(v.shape, generator=g, dtype=dtype))
    full_kv = [t.clone() for t in base.layers[0]]
    sel_kv = [t.clone() for t in base.layers[0]]

    meta = _causal_meta(slots, T, prefix)
    full = head(ids, hidden, meta, full_kv, features=features)
    sel = head(ids, hidden, meta, sel_kv, features=features, out_rows=rows)
    assert full.shape == (B, T, H) and sel.shape == (B, 1, H)

    # K/V: every row of every sequence written, identically to the full forward, nothing else touched
    for a, b, orig in zip(full_kv, sel_kv, base.layers[0]):
        assert torch.equal(a, b)
        written = torch.zeros(a.shape[:2], dtype=torch.bool)
        for i in range(B):
            written[slots[i], prefix[i]: prefix[i] + T] = True
        changed = (a != orig).flatten(2).any(-1)
        assert torch.equal(changed, written)

    tol = 1e-12 if dtype == torch.float64 else 1e-6 * float(full.abs().max())
    for i in range(B):
        torch.testing.assert_close(sel[i, 0], full[i, rows[i]], atol=tol, rtol=0)

    # a later forward reading the cache sees the same thing whichever way it was written
    T2 = 2
    ids2 = torch.randint(0, V, (B, T2), generator=g)
    hidden2 = torch.randn(B, T2, 3 * H if features else H, generator=g, dtype=dtype)
    meta2 = _causal_meta(slots, T2, prefix + T)
    after_full = head(ids2, hidden2, meta2, full_kv, features=features)
    after_sel = head(ids2, hidden2, meta2, sel_kv, features=features)
    assert torch.equal(after_full, after_sel)
    assert torch.equal(full_kv[0], sel_kv[0]) and torch.equal(full_kv[1], sel_kv[1])


def test_causal_write_offset_sees_own_row_like_select_rows():
    T, off = 3, 2
    meta = AttnMetadata(slots=torch.tensor([0]), positions=torch.tensor([[5, 6, 7]]),
                        prefix_lens=torch.tensor([3]), kv_len=3 + off + T, write_offset=off)
    rows = meta.cache_rows()[0]
    vis = meta.visibility()[0]
    for t in range(T):
        assert vis[t, rows[t]], f"new token {t} does not see its own cache row {int(rows[t])}"
        assert torch.equal(vis[t], meta.select_rows(torch.tensor([t])).visibility()[0, 0])


# ---- 5. aux layer convention -----------------------------------------------------------------

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
    normed, cap = target(ids, _causal_meta(torch.tensor([0]), T), cache.layers, capture=(0, 2, 3))
    torch.testing.assert_close(cap[0], hs[1], atol=1e-5, rtol=1e-5)       # output of layer 0
    torch.testing.assert_close(cap[1], hs[3], atol=1e-5, rtol=1e-5)       # output of layer 2
    # transformers' last entry is normalised; ours is the residual stream before the norm
    torch.testing.assert_close(target.model.norm(cap[2]), hs[4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, hs[4], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(cap[2], hs[4], atol=1e-3)
    # order follows `capture`, repeats allowed (default ids of a 4-layer target repeat layer 1)
    cache = KVCache(target.cfg, 1, T, torch.float32, CPU)
    _, cap2 = target(ids, _causal_meta(torch.tensor([0]), T), cache.layers, capture=(3, 1, 1, 0))
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


# ---- 6. drafter tree layout ------------------------------------------------------------------

PROMPTS = [[11, 47, 203, 5, 88], [3, 9, 150, 151, 77, 31, 260, 14]]


def _prefilled(target, head_dir, S, k, N, num_slots=3):
    drafter = make_drafter(SpecConfig("eagle3", S, k, N, draft=str(head_dir)), target, num_slots, 48)
    assert isinstance(drafter, LayerDrafter)
    B, T = len(PROMPTS), max(map(len, PROMPTS))
    ids = torch.zeros(B, T, dtype=torch.int64)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    slots = torch.tensor([2, 0])
    cache = KVCache(target.cfg, num_slots, 48, torch.float32, CPU)
    meta = AttnMetadata(slots=slots, positions=torch.arange(T).expand(B, T),
                        prefix_lens=torch.zeros_like(slots), kv_len=T)
    hidden, captured = target(ids, meta, cache.layers, drafter.capture_layers)
    first = target.logits(hidden[torch.arange(B), lengths - 1]).argmax(-1)
    drafter.prefill(slots, ids, lengths, captured, first)
    return drafter, slots, lengths, first, torch.cat(captured, -1)


def _ref_prefill(ref, b, lengths, first, feats):
    n = int(lengths[b])
    toks = torch.tensor(PROMPTS[b][1:] + [int(first[b])])
    return ref.layer(toks, feats[b, :n], True, torch.arange(n))


def _ref_tree(ref, b, lengths, first, feats, S, k, N):
    """Beam-search tree by hand. Returns (the paths of target ids of the best N-1 candidates,
    the K and V each draft step writes: [(S-1)*k, Hkv, d], beam node j of step s at (s-1)*k + j)."""
    n = int(lengths[b])
    h, K, Vv = _ref_prefill(ref, b, lengths, first, feats)
    logp = ref.logits(h[n - 1]).log_softmax(-1)
    lp, di = logp.topk(k)
    # beam entries: (path, score, hidden, k rows, v rows), best first
    beam = [((int(ref.to_target(di[j])),), float(lp[j]), h[n - 1], K, Vv) for j in range(k)]
    cands = [(p, s) for p, s, *_ in beam]
    scratch_k, scratch_v = [], []
    for s in range(1, S):
        children = []
        for path, score, hh, pk, pv in beam:
            out, kk, vv = ref.layer(torch.tensor([path[-1]]), hh[None], False,
                                    torch.tensor([n + s - 1]), pk, pv)
            scratch_k.append(kk[0])
            scratch_v.append(vv[0])
            lp, di = ref.logits(out[0]).log_softmax(-1).topk(k)
            for c in range(k):
                children.append((path + (int(ref.to_target(di[c])),), score + float(lp[c]), out[0],
                                 torch.cat([pk, kk]), torch.cat([pv, vv])))
        cands += [(c[0], c[1]) for c in children]
        beam = sorted(children, key=lambda c: -c[1])[:k]
    best = sorted(cands, key=lambda c: -c[1])[: N - 1]
    return {p for p, _ in best}, torch.stack(scratch_k), torch.stack(scratch_v)


def _paths(prop, b):
    out = set()
    toks, par = prop.tokens[b].tolist(), prop.parents[b].tolist()
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = par[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("S,k,N", [(3, 2, 6), (3, 2, 9), (4, 2, 8), (4, 2, 15)])
def test_tree_proposal_layout_and_content(target, head_dir, S, k, N):
    drafter, slots, lengths, first, feats = _prefilled(target, head_dir, S, k, N)
    ref = Ref(head_dir, target.model.embed_tokens.weight)

    # first level = top-k of the head at the last prompt row, mapped through d2t
    for b in range(2):
        h, _, _ = _ref_prefill(ref, b, lengths, first, feats)
        want = ref.to_target(ref.logits(h[-1]).topk(k).indices)
        assert drafter.first_tokens[slots[b]].tolist() == want.tolist()
        torch.testing.assert_close(drafter.hidden[slots[b]], h[-1], atol=1e-5, rtol=1e-5)

    prop = drafter.propose(slots, first, lengths)
    B = 2
    assert prop.tokens.shape == prop.parents.shape == prop.depths.shape == (B, N)
    assert prop.tree_mask is not None and prop.tree_mask.shape == (B, N, N)
    assert torch.equal(prop.tokens[:, 0], first)
    for b in range(B):
        par, dep = prop.parents[b].tolist(), prop.depths[b].tolist()
        assert par[0] == -1 and dep[0] == 0
        for i in range(1, N):
            assert 0 <= par[i] < i
            assert dep[i] == dep[par[i]] + 1 <= S
        # ancestor mask, built by walking the parents
        mask = torch.zeros(N, N, dtype=torch.bool)
        for i in range(N):
            j = i
            while j >= 0:
                mask[i, j] = True
                j = par[j]
        assert torch.equal(prop.tree_mask[b], mask)
        # depth-1 nodes are first-level candidates; the best one is always node 1
        level1 = drafter.first_tokens[slots[b]].tolist()
        assert prop.tokens[b, 1].item() == level1[0]
        assert all(prop.tokens[b, i].item() in level1 for i in range(N) if dep[i] == 1)
        # the whole tree equals the hand-built beam search, and so do the draft K/V of every
        # beam node (positions, parents' hidden states and ancestor rows all enter these)
        paths, ref_k, ref_v = _ref_tree(ref, b, lengths, first, feats, S, k, N)
        assert _paths(prop, b) == paths
        assert len(paths) == N - 1
        n = int(lengths[b])
        kc, vc = drafter.cache.layers[0]
        torch.testing.assert_close(kc[slots[b], n: n + (S - 1) * k], ref_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vc[slots[b], n: n + (S - 1) * k], ref_v, atol=1e-5, rtol=1e-5)
        if N - 1 > k + k * k:            # more nodes than two levels hold: the tree goes deeper
            assert max(dep) >= 3
        if N - 1 == k + (S - 1) * k * k:  # every candidate kept: the full beam tree
            assert max(dep) == S and sorted(dep).count(S) == k * k


def test_chain_proposal_equals_greedy_by_hand(target, head_dir):
    S = 3
    drafter, slots, lengths, first, feats = _prefilled(target, head_dir, S, 1, S + 1)
    prop = drafter.propose(slots, first, lengths)
    assert prop.tree_mask is None
    assert prop.tokens.shape == (2, S + 1)
    assert prop.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert prop.depths.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.equal(prop.tokens[:, 0], first)

    head = drafter.head
    for b in range(2):
        n = int(lengths[b])
        cache = KVCache(head.cfg.layer, 1, 32, torch.float32, CPU)
        one = torch.tensor([0])
        toks = torch.tensor([PROMPTS[b][1:] + [int(first[b])]])
        h = head(toks, feats[b: b + 1, :n], _causal_meta(one, n), cache.layers[0], features=True)[:, -1:]
        chain = [int(first[b])]
        for s in range(S):
            draft = head.to_target(head.logits(h[0, 0]).argmax())
            chain.append(int(draft))
            if s == S - 1:
                break
            h = head(draft.view(1, 1), h, _causal_meta(one, 1, torch.tensor([n + s])), cache.layers[0],
                     features=False)
        assert prop.tokens[b].tolist() == chain, b
        # the draft cache: prompt rows from the prefill, then one scratch row per draft step
        for mine, theirs in zip(cache.layers[0], drafter.cache.layers[0]):
            torch.testing.assert_close(theirs[slots[b], : n + S - 1], mine[0, : n + S - 1],
                                       atol=1e-5, rtol=1e-5)


def test_reduced_vocab_needs_d2t_and_consistent_t2d(tmp_path, tiny_model_factory):
    from safetensors.torch import load_file, save_file

    from specbatch.models.config import ModelError
    from specbatch.models.eagle3 import load_eagle3
    from specbatch.models.loader import load_target

    target_dir = tiny_model_factory("llama3", num_hidden_layers=4)
    target, _ = load_target(target_dir, "float32", "cpu")
    head_dir = make_eagle3_head(tmp_path / "h", target_dir)
    w = load_file(str(head_dir / "model.safetensors"))
    for edit, msg in [(lambda w: w.pop("d2t"), "missing weights d2t"),
                      (lambda w: w["t2d"].__setitem__(int(w["t2d"].nonzero()[0]), False),
                       "t2d does not mark exactly")]:
        broken = dict(w)
        broken["t2d"] = w["t2d"].clone()
        edit(broken)
        save_file(broken, str(head_dir / "model.safetensors"))
        with pytest.raises(ModelError, match=msg) as e:
            load_eagle3(head_dir, target.cfg, target.model.embed_tokens, torch.float32, torch.device("cpu"))
        assert str(head_dir) in str(e.value) and "\n" not in str(e.value)


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
