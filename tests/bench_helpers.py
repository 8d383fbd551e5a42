"""Shared by the bench tests (tests/app/test_bench_*.py): a tiny Llama config for random weights."""
from __future__ import annotations

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "eos_token_id": 0, "tie_word_embeddings": False}
