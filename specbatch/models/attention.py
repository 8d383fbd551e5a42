"""Attention over the static slot KV cache: metadata and the eager torch path.

Every forward (prefill, decode, verify, draft extend) is the same operation: each of B sequences
brings T new tokens whose K/V are written at cache rows `prefix_lens[b] + t` of its slot, and
each new token attends to the slot's committed prefix plus the new tokens its mask allows
(causal by default, or a tree mask). The model never learns which of these it is doing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMetadata:
    slots: torch.Tensor          # [B] int64: KV-cache slot of each sequence (pad rows -> dummy slot)
    positions: torch.Tensor      # [B, T] int64: RoPE positions of the new tokens
    prefix_lens: torch.Tensor    # [B] int64: committed cache rows [0, prefix) visible to every new token
    kv_len: int                  # cache rows read per slot, >= max(prefix_lens) + T
    tree_mask: torch.Tensor | None = None   # [B, T, T] bool, new token t sees new token j; None = causal

    @property
    def num_new(self) -> int:
        return self.positions.shape[1]

    def cache_rows(self) -> torch.Tensor:
        """[B, T] cache row of each new token."""
        t = torch.arange(self.num_new, device=self.positions.device)
        return self.prefix_lens[:, None] + t

    def visibility(self, sliding_window: int | None = None) -> torch.Tensor:
        """[B, T, kv_len] bool: may new token t read cache row l."""
        dev = self.positions.device
        T, L = self.num_new, self.kv_len
        rows = torch.arange(L, device=dev)                                    # [L]
        rel = rows[None, :] - self.prefix_lens[:, None]                       # [B, L] index among new tokens
        in_prefix = (rel < 0)[:, None, :]                                     # [B, 1, L]
        is_new = ((rel >= 0) & (rel < T))[:, None, :]
        j = rel.clamp(0, T - 1)[:, None, :].expand(-1, T, -1)                # [B, T, L]
        if self.tree_mask is None:
            new_ok = j <= torch.arange(T, device=dev)[None, :, None]
        else:
            new_ok = torch.gather(self.tree_mask, 2, j)
        visible = in_prefix | (is_new & new_ok)
        if sliding_window is not None:
            # Key position: the row itself for committed keys, the token's RoPE position for new ones.
            new_pos = torch.gather(self.positions, 1, rel.clamp(0, T - 1))    # [B, L]
            key_pos = torch.where(rel < 0, rows[None, :], new_pos)[:, None, :]
            visible &= (self.positions[:, :, None] - key_pos) < sliding_window
        return visible


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMetadata) -> None:
    """k, v: [B, T, Hkv, D] into caches [slots + 1, max_len, Hkv, D]."""
    rows = meta.cache_rows()
    slots = meta.slots[:, None].expand_as(rows)
    k_cache[slots, rows] = k.to(k_cache.dtype)
    v_cache[slots, rows] = v.to(v_cache.dtype)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [B, T, Hq, D] -> [B, T, Hq, D], reading the slots' first kv_len cache rows."""
    keys = k_cache[meta.slots, : meta.kv_len].transpose(1, 2)      # [B, Hkv, L, D]
    values = v_cache[meta.slots, : meta.kv_len].transpose(1, 2)
    mask = meta.visibility(sliding_window)[:, None]                  # [B, 1, T, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=q.shape[2] != keys.shape[1],
    )
    return out.transpose(1, 2)
