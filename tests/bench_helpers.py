"""Shared by the bench tests (tests/app/test_bench_*.py): a tiny Llama config for random weights,
written once a module (`tiny_config`), and sweep options over it (`tiny_opts`)."""
from __future__ import annotations

import json

import pytest

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "eos_token_id": 0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def tiny_opts(cfg, **kw):
    from specbatch.bench.sweep import BenchOptions

    base = dict(random_weights=str(cfg), batch_sizes=(1, 2), prompt_len=16, max_tokens=8, device="cpu",
                graphs=False, hf=False)
    return BenchOptions(**{**base, **kw})
