"""Configs and checkpoints transformers reads differently, or that must be refused: rope scaling
missing a key, Mistral without a sliding_window key, FP8 checkpoints, a missing lm_head with
tie_word_embeddings false."""
from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from specbatch.models.config import DecoderConfig, ModelError
from specbatch.models.loader import load_target

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 320}


@pytest.mark.parametrize("scaling, key", [
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "original_max_position_embeddings"),
    ({"type": "linear"}, "factor"),
])
def test_rope_scaling_missing_a_key_is_a_one_line_error(tmp_path, scaling, key):
    """Was: accepted, then a KeyError traceback from rope_inv_freq when the model is built."""
    with pytest.raises(ModelError, match=key):
        DecoderConfig.from_dict({**BASE, "rope_scaling": scaling})


@pytest.mark.parametrize("change, said", [
    ({"hidden_size": "64"}, "hidden_size must be an integer >= 1, got '64'"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be an integer >= 1, got 0"),
    ({"vocab_size": -3}, "vocab_size must be an integer >= 1, got -3"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_attention_heads": 5, "num_key_value_heads": 5}, "hidden_size 64 is not a multiple of num_attention_heads 5"),
    ({"architectures": []}, "no 'architectures' entry (supported: "),
])
def test_impossible_shapes_are_one_line_errors(change, said):
    """A config whose sizes are not positive integers, or whose heads do not divide, was accepted
    and failed later: a TypeError traceback, or every row of the job failing as if it were the row's."""
    with pytest.raises(ModelError) as ei:
        DecoderConfig.from_dict({**BASE, **change}, "c.json")
    assert str(ei.value).startswith("c.json: ") and said in str(ei.value)
    assert DecoderConfig.from_dict({**BASE, "hidden_size": 64.0}).hidden_size == 64      # a whole float is fine


def test_mistral_without_sliding_window_key_uses_transformers_default():
    """transformers' MistralConfig (and so vLLM) default sliding_window to 4096 when the key is
    absent; an explicit null turns it off."""
    d = {**BASE, "architectures": ["MistralForCausalLM"]}
    assert tf.MistralConfig.from_dict(d).sliding_window == 4096
    assert DecoderConfig.from_dict(d).sliding_window == 4096
    assert DecoderConfig.from_dict({**d, "sliding_window": None}).sliding_window is None


def test_fp8_checkpoint_is_refused(tiny_model_factory, tmp_path):
    """A block-FP8 checkpoint in the layout of Qwen/Qwen3-8B-FP8 (quant_method fp8: F8_E4M3
    weights with weight_scale_inv) was loaded silently: fp8 codes copied as weights, scales
    dropped, garbage output."""
    import shutil
    src = tiny_model_factory("qwen3")
    d = tmp_path / "fp8"
    shutil.copytree(src, d)
    sd = load_file(str(d / "model.safetensors"))
    for n in [n for n in sd if n.endswith("proj.weight")]:
        w = sd[n]
        scale = w.abs().amax().clamp(min=1e-12) / 448.0
        sd[n] = (w / scale).to(torch.float8_e4m3fn)
        sd[n[: -len("weight")] + "weight_scale_inv"] = scale.reshape(1, 1).float()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="quantization_config"):
        load_target(d, "float32", "cpu")
    # the same tensors without the config key: refused by the tensor's dtype
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="float8"):
        load_target(d, "float32", "cpu")


def test_missing_lm_head_with_untied_config_is_refused(tiny_model_factory, tmp_path):
    """No lm_head.weight: the head is tied to the embeddings, unless config.json says it is not
    (a checkpoint missing its output layer would run on the embeddings)."""
    import shutil
    d = tmp_path / "untied"
    shutil.copytree(tiny_model_factory("llama"), d)
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("lm_head.weight", None)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(ModelError, match="tie_word_embeddings: false"):
        load_target(d, "float32", "cpu")
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    model, _ = load_target(d, "float32", "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_device_error_while_reading_weights_is_not_blamed_on_the_file(tmp_path, monkeypatch):
    """Out of memory (or a CUDA error) while safetensors copies a tensor to the device is the
    device's: it propagates as itself, not as 'the file is cut short or damaged'."""
    import torch

    from specbatch.models import loader
    from specbatch.models.config import ModelError

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * 16)
    for exc, kind in ((torch.OutOfMemoryError("CUDA out of memory"), torch.OutOfMemoryError),
                      (RuntimeError("CUDA error: an illegal memory access"), RuntimeError),
                      (OSError(13, "Permission denied"), ModelError)):
        def boom(*a, **k):
            raise exc
        monkeypatch.setattr(loader, "safe_open", boom)
        with pytest.raises(kind) as ei:
            loader.tensor_names([f])
        assert "damaged" not in str(ei.value)
