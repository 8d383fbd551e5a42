"""NextN / MTP drafting: the three published layouts (DeepSeek, MiMo, Qwen3-Next) loaded from inside
the target checkpoint or from an exported directory, the layer forward against a reference built
from the raw tensors and transformers' own decoder layer, one-line load errors, lossless greedy
output through the engine, the top-1 fast path against the softmax path, and the job / CLI."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.attention import AttnMetadata
from specbatch.models.loader import load_target
from specbatch.models.mtp import load_mtp
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative import layer_drafter
from specbatch.speculative.factory import SpecConfig, make_drafter
from specbatch.speculative.layer_drafter import LayerDrafter
from tiny_models import make_mtp_layer
from errors import one_line_cli_error, one_line_model_error

CPU = torch.device("cpu")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LAYOUTS = ("deepseek", "mimo", "qwen")
PLACES = ("inside", "exported")
SEEDS = {"deepseek": 11, "mimo": 12, "qwen": 13}
V, H, L = 320, 64, 3            # tiny targets: vocabulary, hidden size, layers
SHAPES = [(3, 1, 4), (1, 1, 2), (3, 2, 5)]           # (S, k, N): both recipes and a tree
LENS = (1, 9, 4, 14, 6, 11, 3)
MAXES = (12, 6, 1, 12, 3, 9, 12)                     # requests finish at different cycles


pytestmark = pytest.mark.usefixtures("one_thread")


# ---- fixtures: targets with an MTP layer, built once per module ------------------------------

def _own(layout: str, place: str) -> bool:
    """DeepSeek exports carry their own embedding and shared_head.head; the rest borrow the target's."""
    return layout == "deepseek" and place == "exported"


@pytest.fixture(scope="module")
def mtp_dirs(tiny_model_factory, tmp_path_factory):
    """mtp_dirs(arch, layout, place) -> (target dir, draft dir or None). `inside`: a copy of the
    plain target with the layer written into its model.safetensors; `exported`: the plain target
    and a separate directory. The plain target (mtp_dirs(arch)) is never edited."""
    cache: dict = {}

    def get(arch: str, layout: str | None = None, place: str | None = None):
        base = tiny_model_factory("qwen3", tie=True) if arch == "qwen3-tied" else tiny_model_factory(arch)
        if layout is None:
            return base
        key = (arch, layout, place)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"mtp-{arch}-{layout}-{place}")
            kw = dict(seed=SEEDS[layout], own_embedding=_own(layout, place), own_head=_own(layout, place))
            if place == "inside":
                shutil.copytree(base, root / "target")
                make_mtp_layer(root / "target", layout, **kw)
                cache[key] = (root / "target", None)
            else:
                make_mtp_layer(base, layout, root / "mtp", **kw)
                cache[key] = (base, root / "mtp")
        return cache[key]

    return get


_targets: dict = {}


def _target(d):
    if str(d) not in _targets:
        _targets[str(d)] = load_target(d, "float32", "cpu")[0]
    return _targets[str(d)]


def _load(target_dir, draft_dir, dtype=torch.float32):
    return load_mtp(_target(target_dir), target_dir, draft_dir, dtype, CPU)


# ---- 1. the layer forward against a reference from the raw tensors ---------------------------

def _layout_names(layout: str, place: str, num_layers: int) -> dict[str, str]:
    """The checkpoint names of each part, written out per layout (independent of the loader)."""
    if layout == "deepseek":
        p = f"model.layers.{num_layers if place == 'inside' else 0}."
        return dict(enorm=p + "enorm.weight", hnorm=p + "hnorm.weight", proj=p + "eh_proj",
                    final=p + "shared_head.norm.weight", layer=p, embed=p + "embed_tokens.weight",
                    head=p + "shared_head.head.weight")
    if layout == "mimo":
        p = "model.mtp_layers.0."
        return dict(enorm=p + "token_layernorm.weight", hnorm=p + "hidden_layernorm.weight",
                    proj=p + "input_proj", final=p + "final_layernorm.weight", layer=p,
                    embed=p + "embed_tokens.weight", head=p + "shared_head.head.weight")
    return dict(enorm="mtp.pre_fc_norm_embedding.weight", hnorm="mtp.pre_fc_norm_hidden.weight",
                proj="mtp.fc", final="mtp.norm.weight", layer="mtp.layers.0.",
                embed="mtp.embed_tokens.weight", head="mtp.shared_head.head.weight")


class Reference:
    """The MTP forward from the checkpoint's tensors: the layout's own input formula by hand,
    then a one-layer transformers model of the target's family (its layer 0 = the MTP decoder
    layer, its final norm = the MTP's final norm, its lm_head = the MTP's or the target's)."""

    def __init__(self, target_dir: Path, draft_dir: Path | None, layout: str, place: str):
        import transformers as tf

        raw_cfg = json.loads((Path(target_dir) / "config.json").read_text())
        tw = load_file(str(Path(target_dir) / "model.safetensors"))
        w = tw if draft_dir is None else load_file(str(Path(draft_dir) / "model.safetensors"))
        n = _layout_names(layout, place, raw_cfg["num_hidden_layers"])
        gemma = layout == "qwen"                 # every norm stored as w - 1
        norm = (lambda t: t + 1) if gemma else (lambda t: t)
        self.eps = raw_cfg["rms_norm_eps"]
        self.enorm, self.hnorm = norm(w[n["enorm"]]), norm(w[n["hnorm"]])
        self.proj_w, self.proj_b = w[n["proj"] + ".weight"], w.get(n["proj"] + ".bias")
        self.hidden_first = layout == "mimo"
        self.embed = w.get(n["embed"], tw["model.embed_tokens.weight"])
        head = w.get(n["head"], tw.get("lm_head.weight", tw["model.embed_tokens.weight"]))
        self.own_embed, self.own_head = n["embed"] in w, n["head"] in w

        cfg = tf.AutoConfig.from_pretrained(str(target_dir))
        cfg.num_hidden_layers = 1
        cfg.tie_word_embeddings = False
        m = tf.AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
        layer = {k[len(n["layer"]):]: (norm(v) if k.endswith("norm.weight") else v)
                 for k, v in w.items() if k.startswith(n["layer"]) and
                 k[len(n["layer"]):].startswith(("self_attn.", "mlp.", "input_layernorm.",
                                                 "post_attention_layernorm."))}
        m.model.layers[0].load_state_dict(layer, strict=True)    # every layer tensor, nothing else
        with torch.no_grad():
            m.model.norm.weight.copy_(norm(w[n["final"]]))
            m.lm_head.weight.copy_(head)
        self.model = m

    def rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor):
        """ids [B, T], hidden [B, T, H] (one causal sequence each, from position 0) -> (normed
        output [B, T, H], logits [B, T, V])."""
        e, h = self.rms(self.embed[ids], self.enorm), self.rms(hidden, self.hnorm)
        x = torch.cat([h, e] if self.hidden_first else [e, h], -1) @ self.proj_w.T
        if self.proj_b is not None:
            x = x + self.proj_b
        out = self.model.model(inputs_embeds=x).last_hidden_state
        return out, self.model.lm_head(out)


def _causal_meta(slots, T, prefix):
    B = slots.shape[0]
    return AttnMetadata(slots=slots, positions=prefix[:, None] + torch.arange(T).expand(B, T),
                        prefix_lens=prefix, kv_len=int(prefix.max()) + T)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "qwen3-tied"])
def test_layer_forward_matches_reference(mtp_dirs, arch, layout, place):
    target_dir, draft_dir = mtp_dirs(arch, layout, place)
    target = _target(target_dir)
    layer = _load(target_dir, draft_dir)
    assert layer.cfg.layout == layout and layer.cfg.hidden_first == (layout == "mimo")
    ref = Reference(target_dir, draft_dir, layout, place)
    # own embedding / own head when the checkpoint has them, the target's (same parameter) otherwise
    assert ref.own_embed == ref.own_head == _own(layout, place)
    if _own(layout, place):
        assert layer.embed_tokens is not target.model.embed_tokens
        assert layer.lm_head is layer.shared_head.head
        assert torch.equal(layer.embed_tokens.weight, ref.embed)
    else:
        assert layer.embed_tokens is target.model.embed_tokens
        assert layer.lm_head is target.lm_head
    if arch == "qwen3-tied":
        assert layer.lm_head.weight is layer.embed_tokens.weight or _own(layout, place)
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

    # out_rows: one row per sequence out of the same step, every row's K/V written the same way
    kv = [t.clone() for t in kv_after_prefill]
    rows = torch.tensor([T - 1, 0])
    sel = layer(ids[:, P:], hidden[:, P:], meta, kv, out_rows=rows)
    assert sel.shape == (B, 1, H)
    for b in range(B):
        torch.testing.assert_close(sel[b, 0], want[b, P + rows[b]], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(kv, cache.layers[0]))


def test_drafter_cache_holds_one_layer(mtp_dirs):
    """The MTP layer is one decoder layer: its draft KV cache must not be sized for the target's L."""
    for place in PLACES:
        target_dir, draft_dir = mtp_dirs("llama", "mimo", place)
        drafter = make_drafter(SpecConfig("nextn_mtp", 3, 1, 4, str(draft_dir) if draft_dir else None),
                               _target(target_dir), 2, 32, target_dir=str(target_dir))
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
    assert torch.equal(layer.inv_freq, _load(target_dir, None).inv_freq)
    w = load_file(str(target_dir / "model.safetensors"))
    # Gemma-style norms made plain before the cast
    assert torch.equal(layer.shared_head.norm.weight, (w["mtp.norm.weight"] + 1).to(torch.bfloat16))


# ---- 2. load errors --------------------------------------------------------------------------

def test_error_no_mtp_in_target(mtp_dirs):
    base = mtp_dirs("llama")
    target = _target(base)
    msg = one_line_model_error(lambda: load_mtp(target, base, None, torch.float32, CPU), base, "no MTP layer",
                          f"model.layers.{L}.eh_proj.weight", "model.mtp_layers.0.input_proj.weight",
                          "mtp.fc.weight", "--draft")
    assert "DeepSeek" in msg and "MiMo" in msg and "Qwen3-Next" in msg
    # the same through the factory
    one_line_model_error(lambda: make_drafter(SpecConfig("nextn_mtp", 3, 1, 4), target, 2, 32, target_dir=str(base)),
                    base, "--draft")
    # neither a target directory nor --draft
    one_line_model_error(lambda: make_drafter(SpecConfig("nextn_mtp", 3, 1, 4), target, 2, 32), "--draft")


def test_error_no_mtp_in_draft_dir(mtp_dirs, tmp_path):
    base = mtp_dirs("llama")
    # a plain checkpoint passed as --draft: its layer 0 is no NextN layer
    one_line_model_error(lambda: _load(base, base), base, "no MTP layer", "model.layers.0.eh_proj.weight",
                    "model.mtp_layers.0.input_proj.weight", "mtp.fc.weight")
    one_line_model_error(lambda: _load(base, tmp_path / "nowhere"), tmp_path / "nowhere", "safetensors")


def test_whole_deepseek_checkpoint_as_draft_dir(mtp_dirs):
    # --draft pointing at a checkpoint that keeps its NextN layer after the last decoder layer
    target, _ = mtp_dirs("llama", "deepseek", "inside")
    inside, as_draft = _load(target, None), _load(target, target)
    assert all(torch.equal(a, b) for a, b in zip(inside.state_dict().values(), as_draft.state_dict().values()))


@pytest.mark.parametrize("layout,place,name", [
    ("deepseek", "inside", f"model.layers.{L}.mlp.up_proj.weight"),
    ("deepseek", "exported", "model.layers.0.hnorm.weight"),
    ("deepseek", "exported", "model.layers.0.shared_head.norm.weight"),
    ("mimo", "inside", "model.mtp_layers.0.token_layernorm.weight"),
    ("mimo", "exported", "model.mtp_layers.0.final_layernorm.weight"),
    ("mimo", "exported", "model.mtp_layers.0.self_attn.o_proj.weight"),
    ("qwen", "inside", "mtp.pre_fc_norm_hidden.weight"),
    ("qwen", "exported", "mtp.norm.weight"),
    ("qwen", "exported", "mtp.layers.0.post_attention_layernorm.weight"),
    ("qwen", "inside", "mtp.layers.0.self_attn.q_norm.weight"),
])
def test_error_missing_tensor(mtp_dirs, tmp_path, layout, place, name):
    arch = "qwen3" if "q_norm" in name else "llama"
    base = mtp_dirs(arch)
    if place == "inside":
        shutil.copytree(base, tmp_path / "t")
        make_mtp_layer(tmp_path / "t", layout, drop=(name,))
        target_dir, draft_dir, where = tmp_path / "t", None, tmp_path / "t"
    else:
        make_mtp_layer(base, layout, tmp_path / "d", drop=(name,))
        target_dir, draft_dir, where = base, tmp_path / "d", tmp_path / "d"
    one_line_model_error(lambda: _load(target_dir, draft_dir), where, "missing", name, layout)


@pytest.mark.parametrize("layout,name,shape", [
    ("mimo", "model.mtp_layers.0.input_proj.weight", (H, H)),
    ("deepseek", "model.layers.0.mlp.down_proj.weight", (H, 100)),
    ("qwen", "mtp.pre_fc_norm_embedding.weight", (H + 1,)),
])
def test_error_wrong_shape(mtp_dirs, tmp_path, layout, name, shape):
    base = mtp_dirs("llama")
    d = tmp_path / "d"
    w = make_mtp_layer(base, layout, d)
    expected = tuple(w[name].shape)
    w[name] = torch.zeros(shape)
    save_file(w, str(d / "model.safetensors"))
    one_line_model_error(lambda: _load(base, d), d, name, str(shape), str(expected))


@pytest.mark.parametrize("layout,name", [
    ("deepseek", f"model.layers.{L}.mlp.experts.0.gate_proj.weight"),
    ("mimo", "model.mtp_layers.0.mlp.experts.0.gate_proj.weight"),
    ("qwen", "mtp.layers.0.mlp.experts.0.gate_proj.weight"),
])
def test_error_unexpected_tensor(mtp_dirs, tmp_path, layout, name):
    base = mtp_dirs("llama")
    t = tmp_path / "t"
    shutil.copytree(base, t)
    make_mtp_layer(t, layout)
    w = load_file(str(t / "model.safetensors"))
    w[name] = torch.zeros(2 * H, H)
    save_file(w, str(t / "model.safetensors"))
    one_line_model_error(lambda: _load(t, None), t, "unexpected", name, layout)


@pytest.mark.parametrize("key,value,needles", [
    ("hidden_size", 96, ("hidden_size 96", str(H))),
    ("vocab_size", 300, ("vocab_size 300", str(V))),
])
def test_error_exported_config_mismatch(mtp_dirs, tmp_path, key, value, needles):
    base = mtp_dirs("llama")
    d = tmp_path / "d"
    make_mtp_layer(base, "deepseek", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    one_line_model_error(lambda: _load(base, d), d / "config.json", *needles)


def test_target_with_mtp_loads_as_plain_target(mtp_dirs):
    base = mtp_dirs("llama")
    plain = dict(_target(base).named_parameters())
    rows = _rows()
    vanilla = _ids(_run(base, rows, 3))
    for layout in LAYOUTS:
        target_dir, _ = mtp_dirs("llama", layout, "inside")
        assert set(load_file(str(target_dir / "model.safetensors"))) > set(load_file(str(base / "model.safetensors")))
        params = dict(_target(target_dir).named_parameters())
        assert params.keys() == plain.keys()
        assert all(torch.equal(params[k], plain[k]) for k in plain)
        assert _ids(_run(target_dir, rows, 3)) == vanilla, layout


# ---- 3. lossless greedy through the engine ---------------------------------------------------

def _rows(n=len(LENS)):
    g = torch.Generator().manual_seed(0)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, V, (LENS[i],), generator=g).tolist(),
                       overrides={"max_tokens": MAXES[i]}) for i in range(n)]


def _run(target_dir, rows, bs, device="cpu", spec=SpecConfig(), **defaults):
    eng = Engine(target_dir, EngineOptions(batch_size=bs, device=device, dtype="float32", spec=spec))
    recs = sorted(eng.generate(rows, SamplingDefaults(**{"max_tokens": 12, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs


def _ids(recs):
    return [r["output_token_ids"] for r in recs]


def _spec(S, k, N, draft_dir):
    return SpecConfig("nextn_mtp", S, k, N, None if draft_dir is None else str(draft_dir))


def _check_stats(recs, S, N):
    for r in recs:
        s = r["spec"]
        assert s["draft_tokens"] == (s["verify_steps"] - 1) * (N - 1)
        assert sum(s["accept_histogram"]) == s["verify_steps"] - 1
        assert len(s["accept_histogram"]) == S + 1
        assert s["accepted_tokens"] == sum(i * c for i, c in enumerate(s["accept_histogram"]))


def _write_mimic(target_dir: Path, layout: str, out_dir: Path | None = None, own: bool = False) -> None:
    """An MTP layer that drafts well for a one-layer target with unit-RMS embedding rows: the
    embedding path only (enorm = 1, projection [I | 0], [0 | I] for MiMo's reversed concat), the
    target's own layer and final norm. It then runs the target without the sequence's first
    token, so most drafts are accepted and some are not. Identical in every layout, so every
    layout and place must draft the same tokens; `own`: the target's embedding and lm_head
    copied in as the layer's own."""
    written = make_mtp_layer(target_dir, layout, out_dir, own_embedding=own, own_head=own)
    tw = load_file(str(Path(target_dir) / "model.safetensors"))
    n = _layout_names(layout, "inside" if out_dir is None else "exported", 1)
    off = 1.0 if layout == "qwen" else 0.0         # Gemma-style storage
    new = {}
    for k, v in written.items():
        if k in (n["enorm"], n["hnorm"]):
            new[k] = torch.ones_like(v) - off
        elif k == n["proj"] + ".weight":
            eye, zero = torch.eye(H), torch.zeros(H, H)
            new[k] = torch.cat([zero, eye] if layout == "mimo" else [eye, zero], 1)
        elif k == n["final"]:
            new[k] = tw["model.norm.weight"] - off
        elif k == n["embed"]:
            new[k] = tw["model.embed_tokens.weight"].clone()
        elif k == n["head"]:
            new[k] = tw["lm_head.weight"].clone()
        else:
            assert k.startswith(n["layer"]), k
            s = k[len(n["layer"]):]
            new[k] = tw["model.layers.0." + s] - (off if s.endswith("norm.weight") else 0.0)
    path = Path(out_dir or target_dir) / "model.safetensors"
    save_file({**load_file(str(path)), **new}, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mimic_dirs(tmp_path_factory):
    """mimic_dirs() -> the one-layer target without an MTP layer; mimic_dirs(layout, place) ->
    (target dir, draft dir or None) with a mimic MTP layer (own embedding / head: DeepSeek exported)."""
    from tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("mimic")
    base = make_checkpoint("llama", root / "base", num_hidden_layers=1)
    p = base / "model.safetensors"
    w = load_file(str(p))
    e = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True))
    save_file(w, str(p), metadata={"format": "pt"})
    cache: dict = {}

    def get(layout: str | None = None, place: str | None = None):
        if layout is None:
            return base
        if (layout, place) not in cache:
            if place == "inside":
                shutil.copytree(base, root / f"{layout}-inside")
                _write_mimic(root / f"{layout}-inside", layout)
                cache[layout, place] = (root / f"{layout}-inside", None)
            else:
                _write_mimic(base, layout, root / f"{layout}-exported", own=_own(layout, place))
                cache[layout, place] = (base, root / f"{layout}-exported")
        return cache[layout, place]

    return get


@pytest.fixture(scope="module")
def vanilla(mimic_dirs):
    cache: dict = {}

    def get(device: str):
        if device not in cache:
            cache[device] = _ids(_run(mimic_dirs(), _rows(), 4, device))
        return cache[device]

    return get


_stats_seen: dict = {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "S{}k{}N{}".format(*s))
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_greedy_is_lossless(mimic_dirs, vanilla, layout, place, shape, device):
    S, k, N = shape
    target_dir, draft_dir = mimic_dirs(layout, place)
    for bs in (1, 3):
        recs = _run(target_dir, _rows(), bs, device, _spec(S, k, N, draft_dir))
        assert _ids(recs) == vanilla(device), f"{layout} {place} {shape} batch {bs}"
        _check_stats(recs, S, N)
        accepted = [r["spec"]["accepted_tokens"] for r in recs]
        steps = [r["spec"]["verify_steps"] for r in recs]
        assert sum(accepted) >= 10, accepted          # acceptance exercised, not only rejection
        assert any(s > 1 and a < (s - 1) * S for a, s in zip(accepted, steps)), (accepted, steps)
        # the same mimic layer in every layout and place: the same drafts, the same statistics
        seen = _stats_seen.setdefault((shape, device, bs), (layout, place, accepted, steps))
        assert (accepted, steps) == tuple(seen[2:]), f"{layout} {place} drafts differ from {seen[:2]}"


@pytest.mark.parametrize("device", DEVICES)
def test_random_mtp_on_a_deeper_target_is_lossless(mtp_dirs, device):
    """Random (rarely accepted) layers on a 3-layer target, every layout and place."""
    base = mtp_dirs("llama")
    want = _ids(_run(base, _rows(), 4, device))
    for i, (layout, place) in enumerate((lo, pl) for lo in LAYOUTS for pl in PLACES):
        S, k, N = SHAPES[i % len(SHAPES)]
        target_dir, draft_dir = mtp_dirs("llama", layout, place)
        recs = _run(target_dir, _rows(), 3, device, _spec(S, k, N, draft_dir))
        assert _ids(recs) == want, (layout, place)
        _check_stats(recs, S, N)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_feeds_final_hidden_and_drafts_like_the_reference(mtp_dirs, layout):
    """Through the engine (random layer, 3-layer target): the drafter reads the target's
    final-normed hidden state (prefill and extend), and the first chain it proposes is the
    reference layer's greedy chain, its own normed output fed back at each step."""
    import transformers as tf

    S, N = 3, 4
    target_dir, _ = mtp_dirs("llama", layout, "inside")
    eng = Engine(target_dir, EngineOptions(batch_size=2, device="cpu", dtype="float32", spec=_spec(S, 1, N, None)))
    d, rec = eng.drafter, {}
    real_prefill, real_propose, real_extend = d.prefill, d.propose, d.extend

    def prefill(slots, input_ids, lengths, captured, first):
        real_prefill(slots, input_ids, lengths, captured, first)
        rec["prefill"] = [c.clone() for c in captured], int(first[0]), d.first_logp[slots].clone()

    def propose(*args, **kw):
        return rec.setdefault("prop", real_propose(*args, **kw))

    def extend(slots, lens, acc, captured, kv_bound=None):
        rec.setdefault("extend", [c.clone() for c in captured])
        return real_extend(slots, lens, acc, captured, kv_bound)

    d.prefill, d.propose, d.extend = prefill, propose, extend
    prompt = _rows()[3].prompt_token_ids
    n = len(prompt)
    list(eng.generate([RowRequest(row=0, id="0", prompt_token_ids=prompt)], SamplingDefaults(max_tokens=3)))

    hf = tf.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        final = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]    # normed
    captured, first, first_logp = rec["prefill"]
    assert len(captured) == 1 and captured[0].shape == (1, n, H)
    torch.testing.assert_close(captured[0], final, atol=1e-5, rtol=1e-5)

    ref = Reference(target_dir, None, layout, "inside")
    ids, hid, chain, logps = prompt[1:] + [first], final[0], [first], []
    for s in range(S):
        out, logits = ref(torch.tensor([ids]), hid[None])
        draft = int(logits[0, -1].argmax())
        chain.append(draft)
        logps.append(float(logits[0, -1].log_softmax(-1)[draft]))
        ids, hid = ids + [draft], torch.cat([hid, out[0, -1:]])
    prop = rec["prop"]
    assert prop.tokens[0].tolist() == chain
    assert first_logp[0, 0].item() == pytest.approx(logps[0], abs=1e-5) and logps[0] < -1e-3

    # the first extend reads the target's final-normed hidden over the verified tokens
    with torch.no_grad():
        full = hf(torch.tensor([prompt + chain]), output_hidden_states=True).hidden_states[-1]
    assert len(rec["extend"]) == 1
    torch.testing.assert_close(rec["extend"][0][0], full[0, n: n + N], atol=1e-5, rtol=1e-5)


# ---- 4. the top-1 fast path equals the softmax path ------------------------------------------

def _softmax_topk(logits, k):
    vals, idx = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return idx, vals


def _recording(fn, log):
    def wrapped(logits, k):
        idx, logp = fn(logits, k)
        log.append((idx.clone(), logp.clone()))
        return idx, logp
    return wrapped


def _draft_once(target_dir, device, S=3):
    """Prefill + one proposal of a k=1 MTP drafter on two prompts; -> proposal tokens."""
    dev = torch.device(device)
    target, _ = load_target(target_dir, "float32", dev)
    drafter = make_drafter(SpecConfig("nextn_mtp", S, 1, S + 1), target, 3, 48, target_dir=str(target_dir))
    prompts = [[11, 47, 203, 5, 88], [3, 9, 150, 151, 77, 31, 260, 14]]
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    ids = ids.to(dev)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    slots = torch.tensor([2, 0], device=dev)
    cache = KVCache(target.cfg, 3, 48, torch.float32, dev)
    meta = AttnMetadata(slots=slots, positions=torch.arange(T, device=dev).expand(B, T),
                        prefix_lens=torch.zeros_like(slots), kv_len=T)
    with torch.inference_mode():
        hidden, captured = target(ids, meta, cache.layers, drafter.capture_layers)
        assert captured == []
        first = target.logits(hidden[torch.arange(B, device=dev), lengths - 1]).argmax(-1)
        drafter.prefill(slots, ids, lengths, [hidden], first)
        prop = drafter.propose(slots, first, lengths)
    return prop.tokens.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_top1_fast_path_equals_softmax_path(mimic_dirs, vanilla, monkeypatch, device):
    target_dir, _ = mimic_dirs("deepseek", "inside")
    real = layer_drafter.topk_logprobs
    logs = {}
    tokens = {}
    for name, fn in (("fast", real), ("softmax", _softmax_topk)):
        logs[name] = []
        monkeypatch.setattr(layer_drafter, "topk_logprobs", _recording(fn, logs[name]))
        tokens[name] = _draft_once(target_dir, device)
    assert torch.equal(tokens["fast"], tokens["softmax"])
    assert len(logs["fast"]) == len(logs["softmax"]) == 3       # prefill + S - 1 draft steps
    for (fi, fl), (si, sl) in zip(logs["fast"], logs["softmax"]):
        assert torch.equal(fi, si)
        assert fl.dtype == torch.float32
        torch.testing.assert_close(fl, sl, atol=1e-5, rtol=0)
        # real probabilities, not the constant 1.0 of a shortcut
        p = fl.exp()
        assert bool((p > 0).all() and (p <= 1).all()) and bool((fl < -1e-3).any()), fl

    # and the engine's output stays lossless with either
    for fn in (real, _softmax_topk):
        monkeypatch.setattr(layer_drafter, "topk_logprobs", fn)
        recs = _run(target_dir, _rows(), 3, device, _spec(3, 1, 4, None))
        assert _ids(recs) == vanilla(device)
        _check_stats(recs, 3, 4)
        assert sum(r["spec"]["accepted_tokens"] for r in recs) >= 10


# ---- 5. the job and the CLI ------------------------------------------------------------------

PROMPTS = ["def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox"]


def _cli(*args):
    from typer.testing import CliRunner

    from specbatch.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}\n{result.output}")
    return result


def _cli_run(tmp_path, name, model, *extra):
    src = tmp_path / "in.jsonl"
    if not src.exists():
        src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / f"{name}.jsonl"
    res = _cli("run", src, "--model", model, "--max-tokens", 10, "--batch-size", 3, "--device", "cpu",
               "-o", out, "-q", "--save-token-ids", *extra)
    return res, out


def _completions(out):
    return [(r["completion"], r["output_token_ids"]) for r in map(json.loads, open(out)) if r]


def test_cli_nextn_mtp_inside_and_exported(mimic_dirs, tmp_path):
    inside, _ = mimic_dirs("mimo", "inside")
    base, exported = mimic_dirs("deepseek", "exported")
    res, out = _cli_run(tmp_path, "vanilla", base)
    assert res.exit_code == 0, res.output
    want = _completions(out)
    assert len(want) == len(PROMPTS)
    for name, model, extra in [("inside", inside, ()), ("inside_1", inside, ("--recipe", "nextn_mtp_1")),
                               ("exported", base, ("--draft", exported))]:
        recipe = () if extra[:1] == ("--recipe",) else ("--recipe", "nextn_mtp")
        res, out = _cli_run(tmp_path, name, model, *recipe, *extra)
        assert res.exit_code == 0, (name, res.output)
        assert _completions(out) == want, name
        rows = [json.loads(line) for line in open(out)]
        S, N = (1, 2) if name == "inside_1" else (3, 4)
        for r in rows:
            assert r["error"] is None
            assert len(r["spec"]["accept_histogram"]) == S + 1
            assert r["spec"]["draft_tokens"] == (r["spec"]["verify_steps"] - 1) * (N - 1)
        assert sum(r["spec"]["accepted_tokens"] for r in rows) > 0


def test_cli_target_without_mtp_is_aone_line_model_error(mtp_dirs, tmp_path):
    base = mtp_dirs("llama")
    res, out = _cli_run(tmp_path, "nomtp", base, "--recipe", "nextn_mtp")
    line = one_line_cli_error(res, 2)
    for needle in (str(base), "no MTP layer", "mtp.fc.weight", "--draft"):
        assert needle in line, (needle, line)
    assert not out.exists()
    # a --draft directory without an MTP layer names that directory
    other = mtp_dirs("qwen3")
    res, _ = _cli_run(tmp_path, "nomtp2", base, "--recipe", "nextn_mtp", "--draft", other)
    line = one_line_cli_error(res, 2)
    assert str(other) in line and "model.layers.0.eh_proj.weight" in line


def test_job_resolves_the_draft(mimic_dirs, tmp_path):
    from specbatch.job import JobOptions, resolve_draft, run_job
    from specbatch.recipe import load_recipe

    inside, _ = mimic_dirs("qwen", "inside")
    recipe = load_recipe("nextn_mtp").with_overrides(model=str(inside), batch_size=2)
    assert resolve_draft(recipe) is None                       # the MTP inside the target
    assert resolve_draft(recipe.with_overrides(draft="/some/mtp")) == "/some/mtp"
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in PROMPTS[:3]))
    summary = run_job(str(src), recipe, JobOptions(output=str(tmp_path / "o.jsonl"), device="cpu"))
    assert summary["errors"] == 0 and summary["requests"] == 3
    assert summary["draft_tokens"] > 0 and len(summary["acceptance_per_position"]) == 3
