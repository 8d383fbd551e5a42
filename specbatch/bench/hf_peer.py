"""The transformers peer: `generate` (greedy, static cache, not compiled) on the very same
weights, so the table shows what the plain HF loop does at each batch size. The HF model is
built on the meta device and takes our parameters by assignment (our names are the HF ones):
no second copy."""
from __future__ import annotations

import time
from typing import Any

import torch

from ..models.config import ModelError
from ..models.llama import CausalLM

PEER_NAME = "transformers (static cache)"
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def hf_model(cfg_dict: dict[str, Any], model: CausalLM) -> Any:
    """transformers' CausalLM for `cfg_dict` whose parameters are `model`'s tensors."""
    import transformers as tf

    d = dict(cfg_dict)
    model_type = d.pop("model_type", None) or _MODEL_TYPES.get((d.get("architectures") or [None])[0])
    if model_type is None:
        raise ModelError(f"transformers peer: no model_type for architectures {d.get('architectures')} "
                         "(use --no-hf)")
    cfg = tf.AutoConfig.for_model(model_type, **d)
    with torch.device("meta"):
        hf = tf.AutoModelForCausalLM.from_config(cfg)
    hf.load_state_dict(model.state_dict(), assign=True)
    device = model.lm_head.weight.device
    # Non-persistent buffers (RoPE frequencies) are not in a state dict: build them for real.
    for name, mod in list(hf.named_modules()):
        if type(mod).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            setattr(hf.get_submodule(parent) if parent else hf, attr, type(mod)(config=hf.config).to(device))
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ModelError(f"transformers peer: {left[0]} was left uninitialised (use --no-hf)")
    # No EOS at all: generate would otherwise take the config's, and min_new_tokens would mask it
    # (changing the greedy tokens) where our engine only ignores it.
    hf.generation_config.eos_token_id = None
    return hf.eval()


@torch.inference_mode()
def hf_generate(hf: Any, prompts: list[list[int]], max_new: int, pad_id: int = 0) -> torch.Tensor:
    """Greedy continuations [B, max_new] of left-padded `prompts`, never stopping early (no EOS)."""
    from transformers import GenerationConfig

    device = hf.lm_head.weight.device
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    # disable_compile: on CUDA a static cache would otherwise torch.compile the forward, once per
    # batch size (minutes each at 8B), inside the timed generate(N).
    gc = GenerationConfig(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                          cache_implementation="static", pad_token_id=pad_id, eos_token_id=None,
                          disable_compile=True)
    out = hf.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gc)
    return out[:, T:]


def hf_tokens_per_s(hf: Any, prompts: list[list[int]], max_new: int) -> float | None:
    """Decode tokens/s: B * (N - 1) new tokens over time(generate N) - time(generate 1); None
    when noise makes the difference meaningless (generate N no slower than generate 1)."""
    hf_generate(hf, prompts, 1)                                        # warm-up
    t1 = _timed(hf, prompts, 1)
    tn = _timed(hf, prompts, max_new)
    return len(prompts) * (max_new - 1) / (tn - t1) if tn > t1 else None


def _timed(hf: Any, prompts: list[list[int]], max_new: int) -> float:
    sync = torch.cuda.synchronize if hf.lm_head.weight.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    hf_generate(hf, prompts, max_new)
    sync()
    return time.perf_counter() - t0
