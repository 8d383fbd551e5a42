"""Random-weight models at real shapes (no download): builtin HF config dicts, and builders that
allocate straight on the device (meta -> to_empty -> in-place init; no CPU copy of the weights)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..models.config import DecoderConfig, ModelError
from ..models.eagle3 import Eagle3Config, Eagle3Head
from ..models.llama import CausalLM, RMSNorm, rope_inv_freq
from ..models.mtp import MTPConfig, MTPLayer
from ..models.registry import model_class

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

BUILTIN: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "rope_theta": 500000.0, "rope_scaling": dict(_LLAMA31_ROPE), "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
    "eagle3-llama-3.1-8b": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 1,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "draft_vocab_size": 32000, "target_hidden_size": 4096,
        "rope_theta": 500000.0, "rope_scaling": dict(_LLAMA31_ROPE), "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    },
}
BUILTIN_HEADS = {"llama-3.1-8b": "eagle3-llama-3.1-8b"}     # target -> its draft head
TARGETS = tuple(n for n in BUILTIN if n in BUILTIN_HEADS)


def resolve_config(value: str) -> tuple[dict[str, Any], str]:
    """A `--random-weights` value -> (HF config dict, name for reports): a builtin target name,
    a config.json path, or a directory holding one."""
    if value in BUILTIN:
        return json.loads(json.dumps(BUILTIN[value])), value
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelError(f"--random-weights {value}: not a builtin config ({', '.join(TARGETS)}) "
                         "nor a config.json path")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return d, str(path)


def head_config(target_cfg: dict[str, Any], target_name: str | None = None) -> dict[str, Any]:
    """The EAGLE3 head config for a target: the builtin one when the target is builtin, else a
    one-layer head shaped like the target (draft vocabulary min(32000, vocab))."""
    if target_name in BUILTIN_HEADS:
        return json.loads(json.dumps(BUILTIN[BUILTIN_HEADS[target_name]]))
    t = DecoderConfig.from_dict(target_cfg, target_name or "target config")
    d = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "draft_vocab_size": min(32000, t.vocab_size),
        "target_hidden_size": t.hidden_size, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "rms_norm_eps": t.rms_norm_eps,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": t.torch_dtype,
    }
    if t.rope_scaling is not None:
        d["rope_scaling"] = dict(t.rope_scaling)
    return d


def random_target(cfg_dict: dict[str, Any], dtype: torch.dtype, device: torch.device | str,
                  seed: int = 0) -> CausalLM:
    """The model of this config (its registered class) with random weights, allocated once on
    `device` in `dtype`."""
    device = torch.device(device)
    cfg = DecoderConfig.from_dict(cfg_dict, "--random-weights config")
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)          # the class the registry names
    model = model.to(dtype).to_empty(device=device)         # meta .to() is free: allocate in dtype
    model.inv_freq = rope_inv_freq(cfg).to(device)          # float32, as the loader keeps it
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _init(model, seed)
    return model.eval().requires_grad_(False)


def random_eagle3(head_cfg_dict: dict[str, Any], target: CausalLM, dtype: torch.dtype,
                  device: torch.device | str, seed: int = 1) -> Eagle3Head:
    """An EAGLE3 head with random weights for `target`: its embedding shared from the target
    (as load_eagle3 does for a head without one) when the hidden sizes agree, and a d2t mapping
    the draft vocabulary onto distinct target ids."""
    device = torch.device(device)
    cfg = Eagle3Config.from_dict(head_cfg_dict, "--random-weights draft head config")
    tcfg = target.cfg
    if cfg.layer.vocab_size != tcfg.vocab_size or cfg.target_hidden_size != tcfg.hidden_size:
        raise ModelError(f"draft head config (vocab {cfg.layer.vocab_size}, target hidden "
                         f"{cfg.target_hidden_size}) does not fit the target (vocab {tcfg.vocab_size}, "
                         f"hidden {tcfg.hidden_size})")
    own = cfg.layer.hidden_size != tcfg.hidden_size
    with torch.device("meta"):
        head = Eagle3Head(cfg, tcfg.vocab_size, fc_bias=False, own_embedding=own)
    head = head.to(dtype).to_empty(device=device)
    head.inv_freq = rope_inv_freq(cfg.layer).to(device)
    if not own:
        head.embed_tokens = target.model.embed_tokens
    g = torch.Generator().manual_seed(seed)
    Vd, V = cfg.draft_vocab_size, tcfg.vocab_size
    chosen = torch.randperm(V, generator=g)[:Vd].sort().values          # [Vd] distinct target ids
    head.d2t = (chosen - torch.arange(Vd)).to(device)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    head.t2d = t2d.to(device)
    _init(head, seed, skip=() if own else (id(target.model.embed_tokens.weight),))
    return head.eval().requires_grad_(False)


def random_mtp(target: CausalLM, dtype: torch.dtype, device: torch.device | str, seed: int = 2) -> MTPLayer:
    """A NextN/MTP layer with random weights shaped like one of `target`'s layers, borrowing the
    target's embedding and lm_head (as DeepSeek-style checkpoints without their own do)."""
    cfg = MTPConfig(layer=target.cfg, layout="deepseek", hidden_first=False)
    with torch.device("meta"):
        layer = MTPLayer(cfg, own_embedding=False, own_head=False)
    layer = layer.to(dtype).to_empty(device=torch.device(device))
    layer.inv_freq = rope_inv_freq(target.cfg).to(device)
    _init(layer, seed)
    return layer.attach(target).eval().requires_grad_(False)


# The drafter kinds' random-weight modules (algorithms.DrafterKind.random), one signature for all.

def random_eagle3_draft(target: CausalLM, head_cfg: dict[str, Any], dtype: torch.dtype,
                        device: torch.device | str, seed: int = 0) -> Eagle3Head:
    return random_eagle3(head_cfg, target, dtype, device, seed=seed + 1)


def random_mtp_draft(target: CausalLM, head_cfg: dict[str, Any], dtype: torch.dtype,
                     device: torch.device | str, seed: int = 0) -> MTPLayer:
    return random_mtp(target, dtype, device, seed=seed + 2)


@torch.no_grad()
def _init(module: torch.nn.Module, seed: int, skip: tuple[int, ...] = ()) -> None:
    """Matrices ~ N(0, 0.02), norm weights 1, biases 0; on the parameters' own device."""
    norms = {id(m.weight) for m in module.modules() if isinstance(m, RMSNorm)}
    gens: dict[torch.device, torch.Generator] = {}
    for p in module.parameters():
        if id(p) in skip or p.device.type == "meta":
            continue
        if id(p) in norms:
            p.fill_(1.0)
        elif p.dim() < 2:
            p.zero_()
        else:
            g = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
            p.normal_(0.0, 0.02, generator=g)
