"""NextN/MTP layer training: the training-time-test forward reproduces LayerDrafter's inference
path row by row (catch-up and chain draft steps through the real KV cache, fed the engine's
final-normed hidden state), the frozen target's MTP features are the engine's, the init copies the
target's last layer, the loss falls, and the saved layer loads with load_mtp and drafts losslessly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbatch.models.config import load_config
from specbatch.models.loader import load_target
from specbatch.models.mtp import load_mtp
from specbatch.speculative.factory import SpecConfig
from specbatch.train.frozen import FrozenTarget
from specbatch.train.mtp import build_mtp, train_mtp
from train_helpers import (V, check_loss_falls, check_ttt_matches_drafter_inference,  # noqa: F401
                           frozen_and_engine_features, generate, randomize, tokens_dir)


@pytest.fixture(scope="module")
def trained(target_dir, tokens_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp")
    lines: list[str] = []
    m = train_mtp(target_dir, tokens_dir, out, ttt_steps=3, seq_len=64, batch_size=8, steps=40,
                  lr=3e-3, warmup=5, eval_every=20, device="cpu", log=lines.append, eval_windows=16)
    return out, m, lines


def _random_mtp(target_dir, seed=0):
    """An MTP layer with random (not init-shaped) weights, norms included, so a wrong norm, shift
    or mask anywhere changes the outputs."""
    tcfg, _ = load_config(target_dir)
    layer = build_mtp(tcfg, init="default")
    return randomize(layer, torch.Generator().manual_seed(seed))


# ---- (1) training forward == inference path ---------------------------------------------------

def test_ttt_forward_matches_drafter_inference(target_dir):
    """Catch-up at the last committed row (step 0) and a chain draft of depth S (steps 1..S-1)
    through LayerDrafter + its KV cache, fed the engine's final-normed hidden state, equal the
    training forward at (row L-1+j, step j) on the window prefix + first token + drafted tokens."""
    target, _ = load_target(target_dir, "float32", "cpu")
    layer = _random_mtp(target_dir).attach(target)          # what load_mtp does for the engine
    # the drafted token is the row's top-1 over the full vocabulary
    check_ttt_matches_drafter_inference(target_dir, target, layer, (), target.cfg.hidden_size,
                                        lambda h: layer.logits(h).argmax())


def test_features_are_the_engines_hidden(target_dir):
    """With no aux layers the frozen target gives the final-normed hidden state (the lm_head's
    input) and lm_head of it: the engine's `hidden` and logits."""
    target, ft, ids, normed, _, hidden, logits = frozen_and_engine_features(target_dir, ())
    with torch.no_grad():
        full = ft.model(input_ids=ids).logits
    torch.testing.assert_close(hidden, normed, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, target.logits(normed), rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, full, rtol=0, atol=0)


def test_init_from_target_last_layer(target_dir):
    tcfg, _ = load_config(target_dir)
    ft = FrozenTarget(target_dir, (), torch.device("cpu"))
    layer = build_mtp(tcfg, ft, init="target")
    dec = ft.model.get_decoder()
    last = dec.layers[-1].state_dict()
    own = layer.state_dict()
    assert all(torch.equal(own[k], v) for k, v in last.items())
    assert torch.equal(layer.shared_head.norm.weight, dec.norm.weight)
    H = tcfg.hidden_size
    assert torch.equal(layer.enorm.weight, torch.ones(H)) and torch.equal(layer.hnorm.weight, torch.ones(H))
    with pytest.raises(ValueError, match="init 'nope'"):
        build_mtp(tcfg, ft, init="nope")


# ---- (2) training, saving, loading, drafting --------------------------------------------------

def test_loss_falls_and_log(trained):
    out, m, lines = trained
    evals = check_loss_falls(out, m, lines)
    assert m["best_eval_loss"] == min(e["loss"] for e in evals)
    assert m["eval_in_vocab"] == 1 and m["eval_agree_in_vocab"] == m["eval_agree"]    # full vocab
    assert m["init"] == "target" and m["config"]["ttt_steps"] == 3


def test_saved_layout(trained, target_dir):
    out, _, _ = trained
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    names = {"enorm", "hnorm", "eh_proj", "input_layernorm", "post_attention_layernorm",
             "shared_head.norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(w) == {f"model.layers.0.{n}.weight" for n in names}
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    H = tcfg["hidden_size"]
    assert w["model.layers.0.eh_proj.weight"].shape == (H, 2 * H)
    assert cfg["num_hidden_layers"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "num_nextn_predict_layers",
                                                     "torch_dtype", "dtype")} == \
        {k: v for k, v in tcfg.items() if k not in ("num_hidden_layers", "torch_dtype", "dtype")}


def test_training_runs_with_the_kernels_off(target_dir, tokens_dir, tmp_path, monkeypatch):
    """On CUDA RMSNorm dispatches to a Triton kernel that has no backward; the loop must switch
    the kernels off (here `active` is made to follow only that switch, as on a GPU)."""
    from specbatch import kernels

    monkeypatch.setattr(kernels, "active", lambda t: kernels._enabled)
    m = train_mtp(target_dir, tokens_dir, tmp_path, ttt_steps=2, seq_len=32, batch_size=2, steps=2,
                  lr=3e-3, warmup=1, eval_every=2, device="cpu", log=lambda _: None, eval_windows=2)
    assert m["best_eval_loss"] > 0 and kernels._enabled


def test_trained_layer_loads_and_is_lossless(trained, target_dir):
    out, _, _ = trained
    target, _ = load_target(target_dir, "float32", "cpu")
    layer = load_mtp(target, None, out, torch.float32, torch.device("cpu"))
    assert layer.cfg.layout == "deepseek" and layer.lm_head is target.lm_head
    vanilla = generate(target_dir, SpecConfig())
    assert all(len(v) == 24 for v in vanilla)
    for spec in (SpecConfig("nextn_mtp", 3, 1, 4, str(out)), SpecConfig("nextn_mtp", 3, 2, 5, str(out))):
        assert generate(target_dir, spec) == vanilla, spec
