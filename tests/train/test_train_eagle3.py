"""EAGLE3 head training: the training-time-test forward reproduces the drafter's inference path
row by row (catch-up and chain draft steps, through the real LayerDrafter and KV cache), the
features are what the engine captures, the loss falls, the saved head loads and drafts losslessly,
and the draft vocabulary is the deterministic most-frequent set."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbatch.models.config import load_config
from specbatch.models.eagle3 import load_eagle3
from specbatch.models.loader import load_target
from specbatch.speculative.factory import SpecConfig
from specbatch.train.eagle3 import build_head, head_config, select_draft_vocab, train_eagle3
from train_helpers import (V, check_loss_falls, check_ttt_matches_drafter_inference,  # noqa: F401
                           frozen_and_engine_features, generate, randomize, tokens_dir)

AUX = (1, 2, 3)          # layer 3 is the tiny target's last layer: its pre-norm output is the feature


@pytest.fixture(scope="module")
def trained(target_dir, tokens_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    lines: list[str] = []
    m = train_eagle3(target_dir, tokens_dir, out, draft_vocab=96, aux_layers=AUX, ttt_steps=3,
                     seq_len=64, batch_size=8, steps=40, lr=3e-3, warmup=5, eval_every=20,
                     device="cpu", log=lines.append, eval_windows=16)
    return out, m, lines


def _random_head(target_dir, Vd=100, seed=0):
    """A head with random (not init-shaped) weights, norms included, so a wrong norm, shift or
    mask anywhere changes the outputs."""
    tcfg, _ = load_config(target_dir)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head = build_head(head_config(tcfg, Vd, AUX), ids - torch.arange(Vd), t2d)
    return randomize(head, g)


# ---- (1) training forward == inference path ---------------------------------------------------

def test_ttt_forward_matches_drafter_inference(target_dir):
    """Catch-up at the last committed row (step 0) and a chain draft of depth S (steps 1..S-1)
    through LayerDrafter + its KV cache, fed by the engine's own target capture, equal the
    training forward at (row L-1+j, step j) on the window prefix + first token + drafted tokens."""
    target, _ = load_target(target_dir, "float32", "cpu")
    head = _random_head(target_dir)
    head.embed_tokens = target.model.embed_tokens          # what load_eagle3 does for the engine
    check_ttt_matches_drafter_inference(target_dir, target, head, AUX, head.cfg.layer.hidden_size,
                                        lambda h: head.to_target(head.logits(h).argmax()))


def test_features_are_the_engines_capture(target_dir):
    """The HF hooks give the residual stream after each aux layer, the last layer pre-norm (bit
    for bit at equal shapes on the CPU)."""
    target, _, _, normed, captured, aux, logits = frozen_and_engine_features(target_dir, AUX)
    torch.testing.assert_close(aux, torch.cat(captured, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, target.logits(normed), rtol=0, atol=1e-4)


# ---- (2) training ---------------------------------------------------------------------------

def test_loss_falls_and_log(trained):
    out, m, lines = trained
    evals = check_loss_falls(out, m, lines)
    assert m["steps"] == 40 and m["best_step"] == 40 and m["best_eval_loss"] == evals[-1]["loss"]


def test_saved_layout(trained, target_dir):
    out, m, _ = trained
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    assert "embed_tokens.weight" not in w
    assert set(w) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for n, t in w.items() if n not in ("d2t", "t2d"))
    H = tcfg["hidden_size"]
    assert w["fc.weight"].shape == (H, 3 * H) and w["lm_head.weight"].shape == (96, H)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (H, 2 * H)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(AUX), "use_aux_hidden_state": True}
    assert cfg["draft_vocab_size"] == 96 and cfg["vocab_size"] == V and cfg["torch_dtype"] == "bfloat16"
    assert cfg["num_key_value_heads"] == tcfg["num_key_value_heads"]
    assert cfg["intermediate_size"] == tcfg["intermediate_size"]
    assert cfg["rope_scaling"]["rope_type"] == "llama3"


# ---- (3) the saved head drafts losslessly -----------------------------------------------------

def test_trained_head_loads_and_is_lossless(trained, target_dir):
    out, _, _ = trained
    target, _ = load_target(target_dir, "float32", "cpu")
    head = load_eagle3(out, target.cfg, target.model.embed_tokens, torch.float32, torch.device("cpu"))
    assert head.cfg.aux_layer_ids == AUX and head.cfg.draft_vocab_size == 96
    vanilla = generate(target_dir, SpecConfig())
    spec = generate(target_dir, SpecConfig("eagle3", 3, 1, 4, str(out)))
    assert spec == vanilla
    assert all(len(v) == 24 for v in vanilla)


# ---- (4) draft vocabulary ---------------------------------------------------------------------

def test_draft_vocab_most_frequent_ties_by_id():
    # counts: 7 -> 5, 3 -> 3, 9 -> 3, 1 -> 3, 4 -> 2, 2 -> 1; ties among 1/3/9 broken by id
    toks = torch.tensor([7] * 5 + [9] * 3 + [3] * 3 + [1] * 3 + [4] * 2 + [2])
    ids, d2t, t2d = select_draft_vocab(toks[torch.randperm(len(toks))], 12, 3)
    assert ids.tolist() == [1, 3, 7]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 2, 5]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [1, 3, 7]
    ids4, _, _ = select_draft_vocab(toks, 12, 4)
    assert ids4.tolist() == [1, 3, 7, 9]
    # more than the distinct ids: zero-count ids fill in by id
    ids8, _, _ = select_draft_vocab(toks, 12, 8)
    assert ids8.tolist() == [0, 1, 2, 3, 4, 5, 7, 9]


def test_draft_vocab_consistent_and_deterministic(trained, tokens_dir):
    out, m, _ = trained
    w = load_file(str(out / "model.safetensors"))
    d2t, t2d = w["d2t"], w["t2d"]
    mapped = torch.arange(len(d2t)) + d2t
    assert (mapped.diff() > 0).all() and int(t2d.sum()) == len(d2t) and bool(t2d[mapped].all())
    from specbatch.train.corpus import token_tensor as _stream

    train = _stream(tokens_dir / "train.bin")
    counts = torch.bincount(train, minlength=V)
    chosen = counts[mapped]
    assert int(chosen.min()) >= int(counts[~t2d].max())      # the most frequent ones
    again = select_draft_vocab(train, V, 96)
    assert torch.equal(again[0], mapped) and torch.equal(again[1], d2t) and torch.equal(again[2], t2d)
    assert 0 < m["draft_vocab_coverage"] <= 1
