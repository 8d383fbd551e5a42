"""Attention over the slot KV cache (static or paged): metadata and the eager torch path.

Every forward (prefill, decode, verify, draft steps, draft extend) is the same operation: each of
B sequences brings T new tokens whose K/V are written at cache rows
`prefix_lens[b] + write_offset + t` of its slot. Each new token sees every committed row
`< prefix_lens[b]` and, inside the region of M rows that follows, the rows its mask allows:
causal among the new tokens by default (M = T), or an explicit tree mask (verify of a draft tree;
draft steps whose earlier tree levels sit in the region). The model never learns which it is doing.

A packed prefill brings one new token a sequence (T = 1): each prompt token is its own sequence,
seeing its prompt's earlier rows, so the forward holds the prompts' tokens and nothing else.
`QueryTiles` groups runs of such sequences (one prompt's consecutive positions) so attention reads
their K/V once per tile; it is a grouping, not a mode: the result is the same without it.

A cache row is an address in the slot's own row space. With a page table the cache is a pool of
pages [pages, P, Hkv, D] and row l of slot s lives at row l % P of page page_table[s, l // P];
without one the cache is [slots, L, Hkv, D]. The model never learns which either.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import kernels

# Not cuDNN: on Hopper it serves bf16 by default and builds a plan for every new key length,
# about 116 ms each (measured on an H100: benchmarks/sdpa_shapes.py), and the key length here
# grows every decode step. The other backends take 0.35 ms for the same call.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class QueryTiles:
    """Sequences of one new token each grouped for attention: tile r is sequences [start[r],
    start[r] + count[r]), consecutive positions of one slot (prefix_lens rising by one), count
    <= size. A tile of count 0 is unused (a captured forward's spare tiles)."""
    start: torch.Tensor          # [R] int64
    count: torch.Tensor          # [R] int64
    size: int                    # most sequences a tile holds


@dataclass
class AttnMetadata:
    slots: torch.Tensor          # [B] int64: KV-cache slot of each sequence (pad rows -> dummy slot)
    positions: torch.Tensor      # [B, T] int64: RoPE positions of the new tokens
    prefix_lens: torch.Tensor    # [B] int64: committed cache rows [0, prefix) visible to every new token
    kv_len: int                  # cache rows read per slot, >= max(prefix_lens) + region width
    tree_mask: torch.Tensor | None = None   # [B, T, M] bool: new token t sees region row m; None = causal
    write_offset: int = 0        # new tokens are written at region rows write_offset + t
    page_table: torch.Tensor | None = None   # [slots, pages per slot]: the cache is paged
    tiles: QueryTiles | None = None          # one-token sequences grouped into query tiles

    @property
    def num_new(self) -> int:
        return self.positions.shape[1]

    @property
    def region(self) -> int:
        """Rows after the prefix under the mask: the offset rows and the new tokens when causal."""
        return self.write_offset + self.num_new if self.tree_mask is None else self.tree_mask.shape[2]

    def cache_rows(self) -> torch.Tensor:
        """[B, T] cache row of each new token (computed once: every layer asks)."""
        return self.memo("_cache_rows", lambda: self.prefix_lens[:, None] + self.write_offset
                         + torch.arange(self.num_new, device=self.positions.device))

    def program_rows(self) -> torch.Tensor:
        """[programs] committed rows each attention program reads past: a sequence's prefix, or a
        query tile's last (longest) sequence's."""
        if self.tiles is None:
            return self.prefix_lens
        last = (self.tiles.start + self.tiles.count - 1).clamp(0, self.prefix_lens.shape[0] - 1)
        return self.prefix_lens[last]

    def memo(self, key: str, make):
        """`make()` once per metadata (a forward's layers share it), kept under `key`."""
        if key not in self.__dict__:
            self.__dict__[key] = make()
        return self.__dict__[key]

    def select_tokens(self, idx: torch.Tensor) -> "AttnMetadata":
        """A causal view of the new tokens idx [K] (row-major over [B, T]), each its own sequence
        whose K/V (and those of the new tokens before it) are already written: it sees every row
        up to its own."""
        assert self.tree_mask is None, "token selection is for causal forwards"
        b, t = idx // self.num_new, idx % self.num_new
        return AttnMetadata(slots=self.slots[b], positions=self.positions[b, t][:, None],
                            prefix_lens=self.prefix_lens[b] + self.write_offset + t, kv_len=self.kv_len,
                            page_table=self.page_table)

    def flat_rows(self, rows: torch.Tensor, rows_per_slot: int) -> torch.Tensor:
        """Cache rows [B, R] of the sequences' slots -> row indices into the cache viewed as
        [slots * L, ...] (static) or [pages * P, ...] (paged; rows_per_slot = P)."""
        if self.page_table is None:
            return self.slots[:, None] * rows_per_slot + rows
        pages = self.page_table[self.slots[:, None], rows // rows_per_slot]
        return pages.to(torch.int64) * rows_per_slot + rows % rows_per_slot

    def visibility(self, sliding_window: int | None = None) -> torch.Tensor:
        """[B, T, kv_len] bool: may new token t read cache row l."""
        dev = self.positions.device
        T, M, L = self.num_new, self.region, self.kv_len
        rows = torch.arange(L, device=dev)                                    # [L]
        rel = rows[None, :] - self.prefix_lens[:, None]                       # [B, L] index in the region
        in_prefix = (rel < 0)[:, None, :]                                     # [B, 1, L]
        in_region = ((rel >= 0) & (rel < M))[:, None, :]
        m = rel.clamp(0, M - 1)[:, None, :].expand(-1, T, -1)                # [B, T, L]
        if self.tree_mask is None:
            region_ok = m <= self.write_offset + torch.arange(T, device=dev)[None, :, None]
        else:
            region_ok = torch.gather(self.tree_mask, 2, m)
        visible = in_prefix | (in_region & region_ok)
        if sliding_window is not None:
            # Committed rows sit at their own positions; region rows are the last few positions,
            # always inside a window wider than the region.
            assert sliding_window > M, "sliding window narrower than the verify region"
            visible &= ~in_prefix | ((self.positions[:, :, None] - rows[None, None, :]) < sliding_window)
        return visible


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMetadata) -> None:
    """k, v: [B, T, Hkv, D] into caches [slots + 1, max_len, Hkv, D] or pages [pages, P, Hkv, D]."""
    rows = meta.flat_rows(meta.cache_rows(), k_cache.shape[1])
    k_cache.view(-1, *k_cache.shape[2:])[rows] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[rows] = v.to(v_cache.dtype)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
           scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [B, T, Hq, D] -> [B, T, Hq, D], reading the slots' first kv_len cache rows.

    On CUDA the Triton kernel serves every forward (prefill in query tiles, decode, verify,
    draft steps), reading each slot's own length from the device; its programs start longest
    first (the order found once a forward)."""
    if kernels.active(q):
        from ..kernels.attention import longest_first, slot_attention

        hkv = k_cache.shape[2]
        order = meta.memo(f"_longest_first_{hkv}", lambda: longest_first(meta.program_rows(), hkv))
        return slot_attention(q, k_cache, v_cache, meta.slots, meta.prefix_lens, scale,
                              tree_mask=meta.tree_mask, write_offset=meta.write_offset,
                              positions=meta.positions, sliding_window=sliding_window,
                              max_rows=meta.kv_len, page_table=meta.page_table, order=order,
                              **({} if meta.tiles is None else dict(
                                  tile_start=meta.tiles.start, tile_count=meta.tiles.count,
                                  tile_size=meta.tiles.size)))
    if meta.tiles is not None:
        return _attend_tiles(q, k_cache, v_cache, meta, scale, sliding_window)
    rows = meta.flat_rows(torch.arange(meta.kv_len, device=q.device).expand(q.shape[0], -1), k_cache.shape[1])
    keys = k_cache.view(-1, *k_cache.shape[2:])[rows].transpose(1, 2)       # [B, Hkv, L, D]
    values = v_cache.view(-1, *v_cache.shape[2:])[rows].transpose(1, 2)
    mask = meta.visibility(sliding_window)[:, None]                  # [B, 1, T, L]
    with sdpa_kernel(_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
            enable_gqa=q.shape[2] != keys.shape[1],
        )
    return out.transpose(1, 2)


def _attend_tiles(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMetadata,
                  scale: float, sliding_window: int | None) -> torch.Tensor:
    """One-token sequences q [N, 1, Hq, D] gathered into their tiles [R, size] (each tile one
    causal sequence of `size` new tokens at its first token's prefix), attended, and scattered
    back: the keys gathered are [R, ...], not [N, ...]. Tile columns past a tile's count are
    computed and dropped; no key row past kv_len is read (those columns see fewer rows)."""
    tiles, N = meta.tiles, q.shape[0]
    col = torch.arange(tiles.size, device=q.device)
    idx = tiles.start[:, None] + col                                       # [R, size]
    real = col[None, :] < tiles.count[:, None]
    idx = torch.where(real, idx, 0).clamp(max=max(N - 1, 0))
    first = tiles.start.clamp(max=max(N - 1, 0))
    rows = AttnMetadata(slots=meta.slots[first], positions=meta.positions[idx, 0],
                        prefix_lens=meta.prefix_lens[first], kv_len=meta.kv_len,
                        page_table=meta.page_table)
    got = attend(q[idx, 0], k_cache, v_cache, rows, scale, sliding_window)   # [R, size, Hq, D]
    out = q.new_zeros(N + 1, *q.shape[2:])                                 # row N: the dropped columns
    out[torch.where(real, idx, N).view(-1)] = got.reshape(-1, *q.shape[2:])
    return out[:N, None]
