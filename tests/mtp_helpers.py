"""Shared by the NextN / MTP tests (tests/models/test_mtp_loading.py, test_mtp_load_errors.py,
tests/speculative/test_mtp_drafter.py, tests/app/test_mtp_cli.py): tiny targets with a random MTP
layer in each published layout (DeepSeek, MiMo, Qwen3-Next) inside the checkpoint or exported, a
reference forward from the raw tensors, "mimic" layers that draft well, and engine runs. Test
modules import the fixtures they use."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.loader import load_target
from specbatch.models.mtp import load_mtp
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.factory import SpecConfig
from tiny_models import make_mtp_layer

CPU = torch.device("cpu")
LAYOUTS = ("deepseek", "mimo", "qwen")
PLACES = ("inside", "exported")
SEEDS = {"deepseek": 11, "mimo": 12, "qwen": 13}
V, H, L = 320, 64, 3            # tiny targets: vocabulary, hidden size, layers
SHAPES = [(3, 1, 4), (1, 1, 2), (3, 2, 5)]           # (S, k, N): both recipes and a tree
LENS = (1, 9, 4, 14, 6, 11, 3)
MAXES = (12, 6, 1, 12, 3, 9, 12)                     # requests finish at different cycles


# ---- targets with an MTP layer, built once per module ----------------------------------------

def owns_weights(layout: str, place: str) -> bool:
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
            own = owns_weights(layout, place)
            kw = dict(seed=SEEDS[layout], own_embedding=own, own_head=own)
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


def target_model(d):
    if str(d) not in _targets:
        _targets[str(d)] = load_target(d, "float32", "cpu")[0]
    return _targets[str(d)]


def load_layer(target_dir, draft_dir, dtype=torch.float32):
    return load_mtp(target_model(target_dir), target_dir, draft_dir, dtype, CPU)


# ---- the reference forward from the raw tensors ----------------------------------------------

def layout_names(layout: str, place: str, num_layers: int) -> dict[str, str]:
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
        n = layout_names(layout, place, raw_cfg["num_hidden_layers"])
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


# ---- engine runs -----------------------------------------------------------------------------

def mtp_rows(n=len(LENS)):
    g = torch.Generator().manual_seed(0)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, V, (LENS[i],), generator=g).tolist(),
                       overrides={"max_tokens": MAXES[i]}) for i in range(n)]


def run_engine(target_dir, rows, bs, device="cpu", spec=SpecConfig(), **defaults):
    eng = Engine(target_dir, EngineOptions(batch_size=bs, device=device, dtype="float32", spec=spec,
                                           adaptive=False))        # check_stats: every cycle full width
    recs = sorted(eng.generate(rows, SamplingDefaults(**{"max_tokens": 12, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return recs


def output_ids(recs):
    return [r["output_token_ids"] for r in recs]


def mtp_spec(S, k, N, draft_dir):
    return SpecConfig("nextn_mtp", S, k, N, None if draft_dir is None else str(draft_dir))


def check_stats(recs, S, N):
    for r in recs:
        s = r["spec"]
        assert s["draft_tokens"] == (s["verify_steps"] - 1) * (N - 1)
        assert sum(s["accept_histogram"]) == s["verify_steps"] - 1
        assert len(s["accept_histogram"]) == S + 1
        assert s["accepted_tokens"] == sum(i * c for i, c in enumerate(s["accept_histogram"]))


# ---- mimic layers: an MTP layer that drafts well ---------------------------------------------

def write_mimic(target_dir: Path, layout: str, out_dir: Path | None = None, own: bool = False) -> None:
    """An MTP layer that drafts well for a one-layer target with unit-RMS embedding rows: the
    embedding path only (enorm = 1, projection [I | 0], [0 | I] for MiMo's reversed concat), the
    target's own layer and final norm. It then runs the target without the sequence's first
    token, so most drafts are accepted and some are not. Identical in every layout, so every
    layout and place must draft the same tokens; `own`: the target's embedding and lm_head
    copied in as the layer's own."""
    written = make_mtp_layer(target_dir, layout, out_dir, own_embedding=own, own_head=own)
    tw = load_file(str(Path(target_dir) / "model.safetensors"))
    n = layout_names(layout, "inside" if out_dir is None else "exported", 1)
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
                write_mimic(root / f"{layout}-inside", layout)
                cache[layout, place] = (root / f"{layout}-inside", None)
            else:
                write_mimic(base, layout, root / f"{layout}-exported", own=owns_weights(layout, place))
                cache[layout, place] = (base, root / f"{layout}-exported")
        return cache[layout, place]

    return get


@pytest.fixture(scope="module")
def vanilla(mimic_dirs):
    cache: dict = {}

    def get(device: str):
        if device not in cache:
            cache[device] = output_ids(run_engine(mimic_dirs(), mtp_rows(), 4, device))
        return cache[device]

    return get
