"""NextN / MTP draft layers in the three published layouts, loaded into one module.

One forward: h = eh_proj(cat(enorm(embed(token)), hnorm(hidden))) -> one decoder layer of the
target's family -> final norm. `hidden` is the target's final-normed hidden state (what its
lm_head reads) for committed positions, and the layer's own normed output while drafting; the
logits are lm_head(output). The module keeps DeepSeek's names; the others map onto them:

    DeepSeek-V3 NextN   model.layers.{L}.*  (inside the target; L = num_hidden_layers)
                        model.layers.0.*    (an exported single-layer checkpoint)
        enorm, hnorm, eh_proj, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm,
        shared_head.norm, optional shared_head.head and embed_tokens
    MiMo                model.mtp_layers.0.*: token_layernorm -> enorm, hidden_layernorm -> hnorm,
                        input_proj -> eh_proj (concat reversed: hidden first), final_layernorm
    Qwen3-Next / 3.5    mtp.*: fc -> eh_proj, pre_fc_norm_embedding -> enorm, pre_fc_norm_hidden
                        -> hnorm, layers.0.* -> the layer, norm; every norm weight stored as an
                        offset from 1 (Gemma style), made plain at load time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .attention import AttnMetadata
from .config import DecoderConfig, ModelError, load_config_dict
from .llama import MLP, Attention, CausalLM, RMSNorm, Rope, linear, rope_inv_freq
from .loader import check_tensor, iter_tensors, safetensors_files, tensor_names

LAYOUTS = ("deepseek", "mimo", "qwen")

# Layout-specific tensor names -> the module's (DeepSeek) names; the rest are shared.
_RENAMES = {
    "deepseek": {},
    "mimo": {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
             "final_layernorm": "shared_head.norm"},
    "qwen": {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"},
}
# What marks each layout in a checkpoint ({i}: the layer index looked for).
_MARKERS = {"deepseek": "model.layers.{i}.eh_proj.weight", "mimo": "model.mtp_layers.0.input_proj.weight",
            "qwen": "mtp.fc.weight"}
_PREFIXES = {"deepseek": "model.layers.{i}.", "mimo": "model.mtp_layers.0.", "qwen": "mtp."}
# Layer dimensions an exported checkpoint's config.json may set (else the target's).
_SHAPE_KEYS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
               "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps"}


@dataclass(frozen=True)
class MTPConfig:
    layer: DecoderConfig          # the decoder layer's shape (the target's family)
    layout: str                   # one of LAYOUTS
    hidden_first: bool            # MiMo: input_proj(cat(hidden, embedding))


class SharedHead(nn.Module):
    def __init__(self, cfg: DecoderConfig, own_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    """A NextN/MTP module; `forward` has the EAGLE3 head's signature so one drafter runs both."""

    def __init__(self, cfg: MTPConfig, own_embedding: bool, own_head: bool, proj_bias: bool = False):
        super().__init__()
        # One decoder layer, whatever the target's depth: the drafter sizes its KV cache from it.
        cfg = replace(cfg, layer=replace(cfg.layer, num_layers=1))
        c = cfg.layer
        self.cfg = cfg
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=proj_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)
        self.shared_head = SharedHead(c, own_head)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        self.register_buffer("inv_freq", rope_inv_freq(c), persistent=False)
        self.lm_head: nn.Linear | None = None           # set by attach(): own head or the target's

    def attach(self, target: CausalLM) -> "MTPLayer":
        """Use the target's embedding / lm_head where the checkpoint carries none."""
        if self.embed_tokens is None:
            self.embed_tokens = target.model.embed_tokens
        self.lm_head = self.shared_head.head if self.shared_head.head is not None else target.lm_head
        return self

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttnMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], features: bool = True,
                out_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T], hidden [B, T, H] (target's or own; `features` makes no difference)
        -> normed output [B, T, H], or [K, 1, H] for `out_tokens` [K] (indices into the B * T new
        tokens, row-major: every token's K/V written, only those through attention output, O-proj
        and MLP)."""
        e, h = self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)
        x = self.eh_proj(torch.cat([h, e] if self.cfg.hidden_first else [e, h], dim=-1))
        attn = self.self_attn(self.input_layernorm(x), Rope(self.inv_freq, meta.positions, x.dtype),
                              meta, *kv, out_tokens=out_tokens)
        if out_tokens is not None:
            x = x.reshape(-1, x.shape[-1])[out_tokens][:, None]
        y, residual = self.post_attention_layernorm(attn, x)
        return self.shared_head.norm(self.mlp(y), residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed output [..., H] -> target-vocabulary logits [..., V] in the weights' dtype (the
        draft's top-k reads bf16 as it is)."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias)

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids                     # the full target vocabulary: no reduced draft vocab


@dataclass(frozen=True)
class MTPSource:
    files: list[Path]
    where: str                    # the directory, for messages
    layout: str
    prefix: str                   # checkpoint names of the layer start with this
    names: frozenset[str]         # every tensor name in `files` (read once)


def find_mtp(directory: str | Path, layer_index: int) -> MTPSource | None:
    """The MTP layer stored in `directory`, if any: DeepSeek's at model.layers.{layer_index}."""
    files = safetensors_files(directory)
    names = frozenset(tensor_names(files))
    for layout in LAYOUTS:
        if _MARKERS[layout].format(i=layer_index) in names:
            return MTPSource(files, str(directory), layout, _PREFIXES[layout].format(i=layer_index), names)
    return None


def looked_for(layer_index: int) -> str:
    return ", ".join(f"{_MARKERS[l].format(i=layer_index)} ({name})" for l, name in
                     zip(LAYOUTS, ("DeepSeek NextN", "MiMo", "Qwen3-Next")))


def mtp_source(target_dir: str | Path | None, draft_dir: str | Path | None, layers: int) -> MTPSource:
    """Where the MTP layer is: `draft_dir` (an exported checkpoint: DeepSeek's at model.layers.0,
    or a whole checkpoint's after its last layer) or, without one, inside the target (at
    model.layers.{layers}); none is a one-line ModelError."""
    if draft_dir is not None:
        src, index = find_mtp(draft_dir, 0), 0
        if src is None and (Path(draft_dir) / "config.json").is_file():
            # a whole checkpoint given as --draft: DeepSeek keeps its MTP after the last layer
            n = load_config_dict(draft_dir)[0].get("num_hidden_layers")
            if isinstance(n, int) and n > 0:
                src = find_mtp(draft_dir, n)
    elif target_dir is not None:
        src, index = find_mtp(target_dir, layers), layers
    else:
        raise ModelError("nextn_mtp needs an MTP layer: pass --draft DIR")
    if src is None:
        where = draft_dir if draft_dir is not None else target_dir
        hint = "" if draft_dir is not None else "; pass --draft DIR for an exported MTP checkpoint"
        raise ModelError(f"{where}: no MTP layer found (looked for {looked_for(index)}){hint}")
    return src


def check_source(draft_dir: str | Path | None, target_dir: str | Path, target_cfg: DecoderConfig) -> None:
    """What load_mtp would refuse of where the layer is to be (for inspect)."""
    mtp_source(target_dir, draft_dir, target_cfg.num_layers)


def load_mtp(target: CausalLM, target_dir: str | Path | None, draft_dir: str | Path | None,
             dtype: torch.dtype, device: torch.device) -> MTPLayer:
    """The MTP layer of `draft_dir` (an exported checkpoint: DeepSeek's at model.layers.0) or,
    without one, the one inside the target's checkpoint (DeepSeek's at model.layers.{L});
    every missing, unexpected or mis-shaped tensor is a one-line ModelError."""
    src = mtp_source(target_dir, draft_dir, target.cfg.num_layers)
    layer_cfg = _layer_config(target.cfg, draft_dir)
    tensors = {n[len(src.prefix):]: n for n in src.names if n.startswith(src.prefix)}
    renames = _RENAMES[src.layout]
    canon = {_canonical(short, renames): full for short, full in tensors.items()}
    cfg = MTPConfig(layer=layer_cfg, layout=src.layout, hidden_first=src.layout == "mimo")
    with torch.device("meta"):
        layer = MTPLayer(cfg, own_embedding="embed_tokens.weight" in canon,
                         own_head="shared_head.head.weight" in canon, proj_bias="eh_proj.bias" in canon)
    layer = layer.to(dtype).to_empty(device=device)      # meta .to() is free: allocate in dtype
    layer.inv_freq = rope_inv_freq(layer_cfg).to(device)
    params = dict(layer.named_parameters())
    unknown = [full for name, full in canon.items() if name not in params]
    if unknown:
        raise ModelError(f"{src.where}: unexpected tensor {unknown[0]} for a {src.layout} MTP layer "
                         f"(a dense {target.cfg.architecture} layer is expected)")
    missing = [n for n in params if n not in canon]
    if missing:
        names = [_original(n, renames, src.prefix) for n in missing]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        raise ModelError(f"{src.where}: {src.layout} MTP layer is missing weights {', '.join(names[:3])}{more}")
    wanted = set(canon.values())
    by_full = {full: name for name, full in canon.items()}
    # Qwen: Gemma-style norms, weight stored as w - 1; the 1 added in float32, before the cast
    gemma = {f"{n}.weight" for n, m in layer.named_modules() if isinstance(m, RMSNorm)} \
        if src.layout == "qwen" else set()
    for full, t in iter_tensors(src.files, device, keep=wanted.__contains__):
        p = params[by_full[full]]
        check_tensor(src.where, full, p, t, " for this target")
        with torch.no_grad():
            p.copy_(t.float() + 1.0 if by_full[full] in gemma else t)
    return layer.attach(target).eval().requires_grad_(False)


def _canonical(short: str, renames: dict[str, str]) -> str:
    if short.startswith("layers.0."):              # Qwen: mtp.layers.0.<decoder layer>
        return short[len("layers.0."):]
    head, _, rest = short.partition(".")
    return f"{renames[head]}.{rest}" if head in renames else short


def _original(name: str, renames: dict[str, str], prefix: str) -> str:
    inverse = {v: k for k, v in renames.items()}
    for new, old in inverse.items():
        if name.startswith(new + "."):
            return prefix + old + name[len(new):]
    if prefix == "mtp." and not name.startswith(("eh_proj", "enorm", "hnorm", "shared_head")):
        return prefix + "layers.0." + name
    return prefix + name


def _layer_config(target: DecoderConfig, draft_dir: str | Path | None) -> DecoderConfig:
    """The target's layer shape, with the dimensions an exported checkpoint's config.json sets."""
    if draft_dir is None or not (Path(draft_dir) / "config.json").is_file():
        return target
    raw, where = load_config_dict(draft_dir)
    cfg = replace(target, **{f: type(getattr(target, f))(raw[k]) for k, f in _SHAPE_KEYS.items()
                             if raw.get(k) is not None})
    if cfg.hidden_size != target.hidden_size:
        raise ModelError(f"{where}: MTP hidden_size {cfg.hidden_size} differs from the target's "
                         f"{target.hidden_size} (the layer reads the target's hidden states)")
    if raw.get("vocab_size") not in (None, target.vocab_size):
        raise ModelError(f"{where}: MTP vocab_size {raw['vocab_size']} does not match the target's "
                         f"{target.vocab_size}")
    return cfg
