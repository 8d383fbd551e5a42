"""NextN / MTP load errors, each one line naming the file or directory: no MTP layer in the target
or the --draft directory (the names looked for in every layout), missing, misshapen or unexpected
tensors per layout and place, an exported config that does not fit the target."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from errors import one_line_model_error
from mtp_helpers import CPU, H, L, V, load_layer, mtp_dirs, target_model  # noqa: F401
from specbatch.models.mtp import load_mtp
from specbatch.speculative.factory import SpecConfig, make_drafter
from tiny_models import make_mtp_layer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_error_no_mtp_in_target(mtp_dirs):
    base = mtp_dirs("llama")
    target = target_model(base)
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
    one_line_model_error(lambda: load_layer(base, base), base, "no MTP layer", "model.layers.0.eh_proj.weight",
                    "model.mtp_layers.0.input_proj.weight", "mtp.fc.weight")
    one_line_model_error(lambda: load_layer(base, tmp_path / "nowhere"), tmp_path / "nowhere", "safetensors")


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
    one_line_model_error(lambda: load_layer(target_dir, draft_dir), where, "missing", name, layout)


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
    one_line_model_error(lambda: load_layer(base, d), d, name, str(shape), str(expected))


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
    one_line_model_error(lambda: load_layer(t, None), t, "unexpected", name, layout)


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
    one_line_model_error(lambda: load_layer(base, d), d / "config.json", *needles)
