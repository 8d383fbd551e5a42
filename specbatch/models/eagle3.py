"""EAGLE3 draft heads in the published layout (`LlamaForCausalLMEagle3`: fc, midlayer.*, norm,
lm_head, d2t, t2d, optional embed_tokens), loaded directly from config.json + safetensors.

One forward: h = fc(cat(aux_1, aux_2, aux_3)) for target features (3 * H_target wide), or the
head's own previous pre-norm output (H wide); x = cat(input_layernorm(embed(token)), hidden_norm(h));
h = h + attn(x); h = h + mlp(post_attention_layernorm(h)). The pre-norm h feeds the next step;
logits = lm_head(norm(h)) over the draft vocabulary, target id = draft id + d2t[draft id].
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .attention import AttnMetadata
from .config import DecoderConfig, ModelError, load_config_dict
from .llama import MLP, Attention, RMSNorm, Rope, linear, rope_inv_freq
from .loader import iter_tensors, load_weights, safetensors_files, tensor_names


@dataclass(frozen=True)
class Eagle3Config:
    layer: DecoderConfig                 # the midlayer's shape; hidden_size is the head's H
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None    # eagle_config.eagle_aux_hidden_state_layer_ids

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Eagle3Config":
        archs = d.get("architectures") or []
        if not any("Eagle3" in a for a in archs):
            raise ModelError(f"{where}: not an EAGLE3 head (architectures {archs}, expected "
                             "['LlamaForCausalLMEagle3'])")
        layer = DecoderConfig.from_dict({**d, "architectures": ["LlamaForCausalLM"],
                                         "num_hidden_layers": 1}, where)
        eagle = d.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(layer=layer, draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
                   target_hidden_size=int(d.get("target_hidden_size") or layer.hidden_size),
                   aux_layer_ids=tuple(int(i) for i in ids) if ids else None)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Outputs of target layers 1, L//2 - 1 and L - 4 (the layout EAGLE3 heads are trained on),
    each clamped into 0..L-1 so that any target of L >= 1 layers gets three valid ids.

    The published values are valid, and kept as they are, for L >= 4 (L = 4: (1, 1, 0)); below
    that an out-of-range id is clamped to the nearest layer: L = 3 and L = 2: (1, 0, 0), L = 1:
    (0, 0, 0). Only random-weight or hand-built heads on such toy targets rely on this (a trained
    head names its layers in eagle_aux_hidden_state_layer_ids)."""
    if num_layers < 1:
        raise ValueError(f"a target needs at least one layer (got {num_layers})")
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_vocab: int, fc_bias: bool, own_embedding: bool):
        super().__init__()
        c = cfg.layer
        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, c.hidden_size, bias=fc_bias)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(target_vocab, c.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(target_vocab, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], features: bool,
                out_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T], hidden [B, T, 3*H_target] (features) or [B, T, H] -> pre-norm [B, T, H].

        With `out_tokens` [K] (indices into the B * T new tokens, row-major), every token's K/V is
        written but only those go through attention output, O-proj and MLP: [K, 1, H].
        """
        layer = self.midlayer
        h = linear(hidden, self.fc.weight, self.fc.bias) if features else hidden
        emb = self.embed_tokens(input_ids)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        attn = layer.self_attn(x, Rope(self.inv_freq, meta.positions, x.dtype), meta, *kv, out_tokens=out_tokens)
        if out_tokens is not None:
            h = h.reshape(-1, h.shape[-1])[out_tokens][:, None]
        x, h = layer.post_attention_layernorm(attn, h)
        return h + layer.mlp(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm [..., H] -> draft-vocabulary logits [..., V_draft] in the weights' dtype (the
        draft's top-k reads bf16 as it is; a float32 copy would cost a kernel a draft step)."""
        return linear(self.norm(hidden), self.lm_head.weight, self.lm_head.bias)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _head_config(head_dir: str | Path, target_cfg: DecoderConfig) -> Eagle3Config:
    """The head's config.json, checked against the target's shape."""
    raw, where = load_config_dict(head_dir)
    cfg = Eagle3Config.from_dict(raw, where)
    if cfg.layer.vocab_size != target_cfg.vocab_size:
        raise ModelError(f"{where}: draft head vocab_size {cfg.layer.vocab_size} does not match the "
                         f"target's {target_cfg.vocab_size}")
    if cfg.draft_vocab_size > target_cfg.vocab_size:
        raise ModelError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} is larger than the target's vocab_size "
                         f"{target_cfg.vocab_size} (the draft vocabulary is a subset of the target's)")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ModelError(f"{where}: draft head reads target hidden size {cfg.target_hidden_size} "
                         f"(fc takes 3 x that), the target has {target_cfg.hidden_size}")
    return cfg


def check_head(head_dir: str | Path | None, target_dir: str | Path, target_cfg: DecoderConfig) -> None:
    """What load_eagle3 would refuse of `head_dir`'s config and weight headers (for inspect)."""
    if head_dir is None:
        raise ModelError("the eagle3 drafter needs a draft head: pass --draft DIR (an EAGLE3 head directory)")
    _head_config(head_dir, target_cfg)
    tensor_names(safetensors_files(head_dir))


def load_eagle3(head_dir: str | Path, target_cfg: DecoderConfig, target_embedding: nn.Embedding,
                dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """Load an EAGLE3 head for this target; every mismatch is a one-line ModelError."""
    cfg = _head_config(head_dir, target_cfg)
    files = safetensors_files(head_dir)
    names = {_strip(n) for n in tensor_names(files)}
    own = "embed_tokens.weight" in names
    if not own and cfg.layer.hidden_size != target_cfg.hidden_size:
        raise ModelError(f"{head_dir}: the head has no embed_tokens and its hidden size "
                         f"{cfg.layer.hidden_size} differs from the target's {target_cfg.hidden_size}")
    with torch.device("meta"):
        head = Eagle3Head(cfg, target_cfg.vocab_size, fc_bias="fc.bias" in names, own_embedding=own)
    head = head.to(dtype).to_empty(device=device)        # meta .to() is free: allocate in dtype
    head.inv_freq = rope_inv_freq(cfg.layer).to(device)
    head.d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
    head.t2d = torch.ones(target_cfg.vocab_size, dtype=torch.bool, device=device)
    if not own:
        head.embed_tokens = target_embedding
    reduced = cfg.draft_vocab_size != target_cfg.vocab_size
    if reduced and "d2t" not in names:
        raise ModelError(f"{head_dir}: missing weights d2t (draft_vocab_size {cfg.draft_vocab_size} < "
                         f"vocab_size {target_cfg.vocab_size} needs the draft-to-target id offsets)")
    tensors = ((_strip(n), t) for n, t in iter_tensors(files, device))
    extra = load_weights(head, _with_buffers(head, tensors, str(head_dir)), str(head_dir),
                         optional=() if own else ("embed_tokens.weight",))
    unknown = [n for n in extra if n not in ("d2t", "t2d")]
    if unknown:
        raise ModelError(f"{head_dir}: unexpected tensor {unknown[0]} for an EAGLE3 head")
    mapped = torch.arange(cfg.draft_vocab_size, device=device) + head.d2t
    if int(mapped.min()) < 0 or int(mapped.max()) >= target_cfg.vocab_size:
        raise ModelError(f"{head_dir}: d2t maps draft ids outside the target vocabulary")
    if "t2d" in names and (int(head.t2d.sum()) != cfg.draft_vocab_size or not bool(head.t2d[mapped].all())):
        raise ModelError(f"{head_dir}: t2d does not mark exactly the target ids d2t maps to")
    return head.eval().requires_grad_(False)


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _with_buffers(head: Eagle3Head, tensors, where: str):
    """Copy d2t / t2d into the buffers (checking shape) and pass the parameters on."""
    for name, t in tensors:
        if name in ("d2t", "t2d"):
            buf = getattr(head, name)
            if tuple(t.shape) != tuple(buf.shape):
                size = ("one entry a draft token: the draft vocabulary is config.json's draft_vocab_size, the "
                        "target's vocab_size where it is absent") if name == "d2t" else "one entry a target token"
                raise ModelError(f"{where}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(buf.shape)} "
                                 f"({size})")
            buf.copy_(t.to(buf.dtype))
        yield name, t
