"""The demo target: a small Llama with GQA, saved as an ordinary HF checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

# Shape of the shipped demo target (bf16 on disk).
DEMO_SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def write_untrained_target(out_dir: str | Path, tokenizer_dir: str | Path, seed: int = 0,
                           shape: dict | None = None) -> Path:
    """A randomly initialised Llama checkpoint with the given tokenizer: the starting point of
    training, and the stand-in default model until a trained one is bundled."""
    import torch
    import transformers as tf
    from transformers import AutoTokenizer

    out = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = tf.LlamaConfig(**(shape or DEMO_SHAPE), vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, out / f.name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id]}) + "\n")
    return out


def write_examples(path: str | Path, tokenizer_dir: str | Path, n: int = 32, prefix_tokens: int = 64,
                   seed: int = 0) -> None:
    """examples/prompts.jsonl: held-out stdlib code prefixes."""
    from .corpus import heldout_prefixes

    rows = heldout_prefixes(str(tokenizer_dir), n=n, prefix_tokens=prefix_tokens, seed=seed)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
