"""The dense Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) with Hugging Face parameter names.

Module names mirror transformers' so a checkpoint loads by a plain name loop. Activations are
[B, T, ...]: B sequences, T new tokens each. The model knows nothing of speculation or graphs:
it reads token ids, an AttnMetadata and the per-layer KV caches.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .. import kernels
from .attention import AttnMetadata, attend, write_kv
from .config import DecoderConfig

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: s = x + residual and (norm(s), s), the residual stream's
        add fused into the norm that follows it (one kernel on CUDA)."""
        if kernels.active(x):
            from ..kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: DecoderConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: long wavelengths slowed by `factor`, short kept, a smooth blend between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, T, 1, D] (float32 math, cast like transformers)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope:
    """The rotary embedding of one forward: positions [B, T] and the model's inv_freq. The torch
    path builds cos / sin [B, T, 1, D] once per forward; the CUDA path rotates inside the kernel
    that also writes K/V."""

    def __init__(self, inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
        self.inv_freq, self.positions, self.dtype = inv_freq, positions, dtype

    @functools.cached_property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, self.positions, self.dtype)


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                     meta: AttnMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Rotate q and k [B, T, heads, D], write k and v to the cache rows of the new tokens;
    -> rotated q."""
    if kernels.active(q):
        from ..kernels.rope import rope_write_kv

        return rope_write_kv(q, k, v, rope.positions, rope.inv_freq, k_cache, v_cache, meta.slots,
                             meta.cache_rows(), page_table=meta.page_table)
    cos, sin = rope.cos_sin
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    write_kv(k_cache, v_cache, k, v, meta)
    return q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.functional.linear; a few rows on the GPU (decode and verify at small batches) take
    `kernels.skinny` instead: no split-K reduce kernel, each row computed alone."""
    if kernels.active(x):
        from ..kernels.skinny import serves, skinny_linear

        if serves(x, weight, bias):
            return skinny_linear(x, weight)
    return nn.functional.linear(x, weight, bias)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum of outputs, in] (and bias) whose row blocks the given layers' parameters
    become views of: one GEMM instead of several, same parameter names, no extra memory."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if all(lin.bias is not None for lin in linears):
        bias = torch.cat([lin.bias.detach() for lin in linears])
    elif any(lin.bias is not None for lin in linears):
        raise ValueError("fuse_linears: some layers have a bias and some do not")
    rows = [lin.out_features for lin in linears]
    for lin, w in zip(linears, weight.split(rows)):
        lin.weight.data = w
    if bias is not None:
        for lin, b in zip(linears, bias.split(rows)):
            lin.bias.data = b
    return weight, bias


def fuse_projections(module: nn.Module) -> None:
    """Fuse q/k/v and gate/up projections of every attention and MLP block inside `module`
    (after its weights are loaded; idempotent). Any other module is left alone, and so is a
    subclass without those linear layers (an MoE block: its expert MLPs are fused instead)."""
    for m in module.modules():
        if isinstance(m, Attention) and getattr(m, "qkv", None) is None:
            linears = _linears(m, "q_proj", "k_proj", "v_proj")
            if linears:
                m.qkv = fuse_linears(*linears)
        elif isinstance(m, MLP) and getattr(m, "gate_up", None) is None:
            linears = _linears(m, "gate_proj", "up_proj")
            if linears:
                m.gate_up = fuse_linears(*linears)


def _linears(m: nn.Module, *names: str) -> list[nn.Linear] | None:
    found = [getattr(m, n, None) for n in names]
    return found if all(isinstance(lin, nn.Linear) for lin in found) else None


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, in_features: int | None = None):
        super().__init__()
        self.cfg = cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        i = in_features or cfg.hidden_size
        self.q_proj = nn.Linear(i, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(i, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(i, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d ** -0.5
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None    # see fuse_projections

    def forward(self, x, rope: Rope, meta: AttnMetadata, k_cache, v_cache, out_tokens=None):
        """x [B, T, in] -> [B, T, H]; with `out_tokens` [K] (indices into the B * T new tokens,
        row-major) every token's K/V is written but the attention output is computed for those
        only: [K, 1, H]."""
        B, T, _ = x.shape
        d = self.cfg.head_dim
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            hq, hkv = self.cfg.num_heads * d, self.cfg.num_kv_heads * d
            q, k, v = linear(x, *self.qkv).split([hq, hkv, hkv], dim=-1)
        q, k, v = q.view(B, T, -1, d), k.view(B, T, -1, d), v.view(B, T, -1, d)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotate_and_store(q, k, v, rope, meta, k_cache, v_cache)
        if out_tokens is not None:
            q = q.reshape(B * T, 1, *q.shape[2:])[out_tokens]
            meta = meta.select_tokens(out_tokens)
        out = attend(q, k_cache, v_cache, meta, self.scale, self.cfg.sliding_window)
        return linear(out.reshape(*q.shape[:2], q.shape[2] * d), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None   # see fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, *self.gate_up)
        if kernels.active(gate_up):
            from ..kernels.activation import silu_mul

            return linear(silu_mul(gate_up), self.down_proj.weight, self.down_proj.bias)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, rope, meta, k_cache, v_cache):
        """(h, residual) -> (mlp output, residual): the layer's output h + residual is left
        unsummed, the add fused into the next norm (residual None: h is the embedding)."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope, meta, k_cache, v_cache), residual)
        return self.mlp(x), residual


class DecoderBody(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """`model.*` + `lm_head` exactly as in the HF checkpoint."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @classmethod
    def num_parameters(cls, cfg: DecoderConfig) -> int:
        """Parameters of the model `cfg` describes (tied embeddings counted once), counted on a
        build on the meta device: no memory, and right for whatever blocks a subclass uses."""
        with torch.device("meta"):
            model = cls(cfg)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return sum(p.numel() for p in model.parameters())

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv: KVLayers,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [B, T] -> (final-normed hidden [B, T, H], outputs of the `capture` layers).

        A captured state is the residual stream after layer i (before the final norm), in the
        order `capture` lists them: what EAGLE3 heads (three layers) and MTP layers consume.
        """
        h = self.model.embed_tokens(input_ids)
        rope = Rope(self.inv_freq, meta.positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        residual = None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(h, residual, rope, meta, *kv[i])
            if i in capture:
                captured[i] = h + residual
        return self.model.norm(h, residual)[0], [captured[i] for i in capture]

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in the weights' dtype (a verify's raw logits)."""
        return linear(hidden, self.lm_head.weight, self.lm_head.bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> float32 [..., V]."""
        return self.head_logits(hidden).float()
