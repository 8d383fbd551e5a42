"""Decoder configuration parsed from a Hugging Face `config.json`; what differs by family
(Llama / Mistral / Qwen2 / Qwen3, ...) comes from `registry.py`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import registry

DTYPE_NAMES = ("float32", "bfloat16", "float16")     # weights and KV cache; "auto" picks one

# The builtin families (registry.supported() also lists any registered later).
SUPPORTED_ARCHITECTURES = registry.supported()
SUPPORTED_ROPE_TYPES = registry.ROPE_TYPES


class ModelError(Exception):
    """A model directory that cannot be used (missing files, unsupported architecture, bad weights)."""


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None          # {"rope_type": ..., factor, ...}; None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool                      # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> "DecoderConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        fam = registry.family(arch)
        if fam is None:
            what = f"unsupported architecture {arch!r}" if arch is not None else "no 'architectures' entry"
            raise ModelError(f"{where}: {what} (supported: {', '.join(registry.supported())})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{where}: hidden_act {act!r} is not supported (expected 'silu')")
        hidden = _count(d, "hidden_size", where)
        heads = _count(d, "num_attention_heads", where)
        kv_heads = _count(d, "num_key_value_heads", where, default=heads)
        if heads % kv_heads:
            raise ModelError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads} (each key/value head serves a whole group of query heads)")
        if fam.head_dim and d.get("head_dim") is not None:
            head_dim = _count(d, "head_dim", where)
        elif hidden % heads:
            raise ModelError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                             "(and no head_dim is given)")
        else:
            head_dim = hidden // heads
        rope_theta, scaling = _rope(d, where, fam.rope_types)
        attention_bias = bool(d.get("attention_bias", False))
        quant = d.get("quantization_config") or d.get("compression_config")
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else None
            raise ModelError(f"{where}: quantization_config (quant_method {method!r}) is not supported "
                             "(expected unquantized float32 / bfloat16 / float16 weights)")
        window = d.get("sliding_window", fam.default_window) if fam.sliding_window == "window" else None
        if fam.sliding_window == "unsupported" and d.get("use_sliding_window", False):
            raise ModelError(f"{where}: use_sliding_window is not supported for {arch}")
        return cls(
            architecture=arch,
            vocab_size=_count(d, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_count(d, "intermediate_size", where),
            num_layers=_count(d, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if fam.qkv_bias is None else fam.qkv_bias,
            o_bias=attention_bias if fam.o_bias is None else fam.o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=fam.qk_norm,
            sliding_window=int(window) if window else None,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            eos_token_ids=_ids(d.get("eos_token_id")),
        )


def _not_a_directory(name: str) -> str:
    """Why a model path is not a model directory, and what to pass instead."""
    if Path(name).exists():
        return f"{name}: is a file, not a model directory; pass the directory that holds config.json and the weights"
    first = name.split("/")[0]
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not first.startswith(".") and not Path(first).exists():
        return (f"{name}: model directory not found (specbatch loads local directories and downloads nothing: "
                f"fetch it first, e.g. `huggingface-cli download {name} --local-dir DIR`, then pass DIR)")
    return f"{name}: model directory not found"


def load_config_dict(model_dir: str | Path) -> tuple[dict, str]:
    """The raw `config.json` of a model directory, and its path for messages."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelError(_not_a_directory(str(model_dir)))
    if not path.is_file():
        raise ModelError(
            f"{model_dir}: no config.json (expected a Hugging Face model directory with "
            "config.json and *.safetensors)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return raw, str(path)


def load_config(model_dir: str | Path) -> tuple[DecoderConfig, dict]:
    """Parse `config.json`; also return the raw dict (drafters read extra keys from it)."""
    raw, where = load_config_dict(model_dir)
    return DecoderConfig.from_dict(raw, where), raw


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """All EOS ids from generation_config.json (int or list), empty when absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _ids(json.loads(path.read_text()).get("eos_token_id"))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


def model_eos_ids(model_dir: str | Path, cfg: DecoderConfig) -> tuple[int, ...]:
    """The EOS ids generation stops on: generation_config.json's, else config.json's (else, for
    the engine, the tokenizer's)."""
    return generation_eos_ids(model_dir) or cfg.eos_token_ids


def generation_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The sampling values generation_config.json sets (temperature, top_p, top_k,
    repetition_penalty, max_new_tokens as max_tokens; null or absent ones are left out): what
    rows that set none of them run with when neither the flags nor the recipe set them either,
    as vLLM applies them (whatever `do_sample` says). A value out of range is a one-line
    ModelError naming the file and key."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        return {}
    out: dict[str, Any] = {}

    def number(key: str, ok, expected: str) -> None:
        v = raw.get(key)
        if v is None:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not ok(v):
            raise ModelError(f"{path}: {key}: expected {expected}, got {v!r}")
        out[key] = v

    number("temperature", lambda v: 0 <= v < float("inf"), "a number >= 0")
    number("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
    number("top_k", lambda v: float(v).is_integer() and v >= -1, "an integer >= 0 (0 or -1: off)")
    number("repetition_penalty", lambda v: 0 < v < float("inf"), "a number > 0")
    number("max_new_tokens", lambda v: float(v).is_integer() and v >= 1, "an integer >= 1")
    if "temperature" in out:
        out["temperature"] = float(out["temperature"])
    if "top_p" in out:
        out["top_p"] = float(out["top_p"])
    if "top_k" in out:
        out["top_k"] = max(int(out["top_k"]), 0)
    if "repetition_penalty" in out:
        out["repetition_penalty"] = float(out["repetition_penalty"])
    if "max_new_tokens" in out:                  # vLLM's name for it: max_tokens
        out["max_tokens"] = int(out.pop("max_new_tokens"))
    return out


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _req(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ModelError(f"{where}: missing required key {key!r}")
    return d[key]


def _count(d: dict, key: str, where: str, default: Any = None) -> int:
    """A size or count of the model: an integer >= 1 (a whole float as JSON may write it)."""
    v = _req(d, key, where) if default is None else (d.get(key) if d.get(key) is not None else default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelError(f"{where}: {key} must be an integer >= 1, got {v!r}")
    return v


# what llama.rope_inv_freq reads for each scaling kind (transformers requires the same keys)
_ROPE_KEYS = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope(d: dict, where: str, accepted: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> tuple[float, dict | None]:
    # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters (theta inside).
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in accepted:
        raise ModelError(
            f"{where}: rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(accepted)})"
        )
    if rope_type == "default":
        return theta, None
    for key in _ROPE_KEYS.get(rope_type, ()):
        if not isinstance(params.get(key), (int, float)) or isinstance(params.get(key), bool):
            raise ModelError(f"{where}: rope type {rope_type!r} needs a number for {key!r} "
                             f"(got {params.get(key)!r})")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return theta, scaling
