"""Model families: a Hugging Face architecture name -> the module and class that build it (imported
lazily, on first use) and the facts of that family's `config.json` that `config.py` reads.

Adding a dense family is one model file and one line in `ARCHITECTURES`. The class is built as
`cls(cfg)` (a `DecoderConfig`) with HF parameter names (`model.embed_tokens`, `model.layers.*`,
`lm_head`, an `inv_freq` buffer), takes `forward(input_ids, meta, kv, capture)`,
`head_logits(hidden)` and `logits(hidden)` like `llama.CausalLM`, and has `num_parameters(cfg)`:
subclassing `CausalLM` and replacing a block gives all of it. Torch-free: nothing is imported
until a class is asked for.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3")         # what llama.rope_inv_freq computes
_WINDOWS = ("ignored", "window", "unsupported")


@dataclass(frozen=True)
class Family:
    module: str                        # ".llama" (inside specbatch.models) or an absolute module path
    cls: str                           # the class in `module` that builds the model
    qkv_bias: bool | None = None       # q/k/v biases; None: the config's `attention_bias`
    o_bias: bool | None = None         # o_proj bias; None: the config's `attention_bias`
    qk_norm: bool = False              # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    head_dim: bool = True              # the config's `head_dim` when given (else hidden / heads)
    sliding_window: str = "ignored"    # ignored | window: `sliding_window` is the window (Mistral)
                                       # | unsupported: `use_sliding_window: true` is an error (Qwen)
    rope_types: tuple[str, ...] = ROPE_TYPES    # rope scaling kinds accepted
    default_window: int | None = None  # `sliding_window` when config.json lacks the key
                                       # (transformers' config default; an explicit null is off)

    def __post_init__(self):
        if self.sliding_window not in _WINDOWS:
            raise ValueError(f"sliding_window {self.sliding_window!r}: expected one of {_WINDOWS}")


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(".llama", "CausalLM"),
    "MistralForCausalLM": Family(".llama", "CausalLM", sliding_window="window", default_window=4096),
    "Qwen2ForCausalLM": Family(".llama", "CausalLM", qkv_bias=True, o_bias=False, sliding_window="unsupported"),
    "Qwen3ForCausalLM": Family(".llama", "CausalLM", qk_norm=True, sliding_window="unsupported"),
}


def supported() -> tuple[str, ...]:
    """Every architecture name a checkpoint may carry, in registration order."""
    return tuple(ARCHITECTURES)


def family(arch: str | None) -> Family | None:
    return ARCHITECTURES.get(arch) if isinstance(arch, str) else None


def model_class(arch: str) -> type:
    """The class that builds `arch` (KeyError when it is not registered)."""
    fam = ARCHITECTURES[arch]
    return getattr(importlib.import_module(fam.module, __package__), fam.cls)


def register(arch: str, fam: Family) -> None:
    """Add a family (tests, plugins); an architecture already registered is an error."""
    if arch in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is already registered")
    ARCHITECTURES[arch] = fam


def unregister(arch: str) -> None:
    ARCHITECTURES.pop(arch, None)
