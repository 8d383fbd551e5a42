"""EAGLE3 head load errors: each is one line naming the file or directory and what is wrong (not an
EAGLE3 config, vocabulary or hidden size that does not fit the target, missing / misshapen /
unexpected tensors, d2t / t2d out of range or inconsistent, aux layer ids the target lacks, a
top-k wider than the draft vocabulary)."""
from __future__ import annotations

import json

import pytest
import torch

from eagle3_helpers import V, copy_dir, edit_config, head_dir, load_head, save_weights, target, weights  # noqa: F401
from errors import one_line_model_error
from specbatch.models.loader import load_target
from specbatch.speculative.factory import SpecConfig, make_drafter
from specbatch.speculative.layer_drafter import LayerDrafter
from tiny_models import make_eagle3_head


def test_error_not_eagle3(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    edit_config(d, architectures=["LlamaForCausalLM"])
    one_line_model_error(lambda: load_head(d, target), d / "config.json", "LlamaForCausalLMEagle3", "EAGLE3")


def test_error_vocab_mismatch(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    edit_config(d, vocab_size=300)
    one_line_model_error(lambda: load_head(d, target), d / "config.json", "vocab_size 300", "320")


def test_error_draft_vocab_larger_than_the_target(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    edit_config(d, draft_vocab_size=V + 80)
    one_line_model_error(lambda: load_head(d, target), d / "config.json", f"draft_vocab_size {V + 80}",
                         f"vocab_size {V}")


def test_error_target_hidden_mismatch(tmp_path, tiny_model_factory, head_dir):
    wide_dir = tiny_model_factory("llama3", num_hidden_layers=4, hidden_size=96)
    wide, _ = load_target(wide_dir, "float32", "cpu")
    assert wide.cfg.hidden_size == 96
    one_line_model_error(lambda: load_head(head_dir, wide), head_dir, "64", "96", "hidden size")
    # the same through the factory
    one_line_model_error(lambda: make_drafter(SpecConfig("eagle3", 3, 1, 4, draft=str(head_dir)), wide, 2, 32),
                    head_dir, "96")


def test_error_missing_tensor(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    del w["midlayer.mlp.up_proj.weight"]
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), d, "missing", "midlayer.mlp.up_proj.weight")


def test_error_lm_head_rows(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    w["lm_head.weight"] = w["lm_head.weight"][:199]
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), d, "lm_head.weight", "(199, 64)", "(200, 64)")


def test_error_unexpected_tensor(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    w["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), d, "unexpected", "midlayer.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("index,value", [(-1, 1000), (0, -1)])   # draft 199 -> 1199; draft 0 -> -1
def test_error_d2t_outside_target_vocab(tmp_path, head_dir, target, index, value):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    w["d2t"][index] = value
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), d, "d2t", "outside the target vocabulary")


def test_error_d2t_shape_names_the_file(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    w["d2t"] = w["d2t"][:199]
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), "d2t", "(199,)", "(200,)", d)


def test_error_t2d_shape(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    w = weights(d)
    w["t2d"] = w["t2d"][:100]
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), "t2d", "(100,)", f"({V},)")


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


def test_error_head_hidden_without_embedding(tmp_path, target_dir, target):
    d = make_eagle3_head(tmp_path / "h", target_dir, hidden_size=32)
    raw = json.loads((d / "config.json").read_text())
    assert raw["target_hidden_size"] == 64 and raw["hidden_size"] == 32
    head = load_head(d, target)                      # with its own 32-wide embedding: fine
    assert head.embed_tokens.weight.shape == (V, 32) and head.fc.weight.shape == (32, 3 * 64)
    w = weights(d)
    del w["embed_tokens.weight"]
    save_weights(d, w)
    one_line_model_error(lambda: load_head(d, target), d, "embed_tokens", "32", "64")


def test_error_missing_config(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    (d / "config.json").unlink()
    one_line_model_error(lambda: load_head(d, target), d, "config.json")
    one_line_model_error(lambda: load_head(tmp_path / "nowhere", target), tmp_path / "nowhere", "not found")


def test_error_no_safetensors(tmp_path, head_dir, target):
    d = copy_dir(head_dir, tmp_path)
    (d / "model.safetensors").unlink()
    one_line_model_error(lambda: load_head(d, target), d, "safetensors")


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
