"""KV caches: the static slot cache (one row of `max_len` positions per slot, tests and tools),
the paged pool the engine runs on (pages shared by every slot through a page table), and the
accepted-path compaction over either."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..models.config import DecoderConfig, ModelError

GiB = 1 << 30


class KVCache:
    def __init__(self, cfg: DecoderConfig, num_slots: int, rows: int, dtype: torch.dtype,
                 device: torch.device):
        # One tensor [2 * layers, slots + 1, rows, Hkv, D]: planes 2i / 2i+1 are layer i's K / V,
        # so a kernel (accepted-path compaction) reaches every layer in one launch.
        # Zeroed, never empty: a NaN bit pattern in a masked row would still poison softmax @ V.
        self.data = torch.zeros(2 * cfg.num_layers, num_slots + 1, rows, cfg.num_kv_heads, cfg.head_dim,
                                dtype=dtype, device=device)
        self.layers = [(self.data[2 * i], self.data[2 * i + 1]) for i in range(cfg.num_layers)]
        self.num_slots = num_slots
        self.dummy_slot = num_slots
        self.rows = rows


@dataclass
class PageLayout:
    """How a paged pool is addressed: `page_table` [slots + 1, pages per slot] (int32, device)
    maps row l of slot s to row l % page_size of page page_table[s, l // page_size]."""
    num_pages: int
    page_size: int
    page_table: torch.Tensor


class PagedKVCache:
    """A pool [2 * layers, pages, P, Hkv, D] (planes 2i / 2i+1 = layer i's K / V, so one kernel
    compacts every layer) that every slot reaches through the layout's page table. Zeroed, never
    empty: a NaN bit pattern in a row a query masks out would still poison softmax @ V."""

    def __init__(self, cfg: DecoderConfig, layout: PageLayout, dtype: torch.dtype, device: torch.device):
        self.layout = layout
        self.data = torch.zeros(2 * cfg.num_layers, layout.num_pages, layout.page_size, cfg.num_kv_heads,
                                cfg.head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[2 * i], self.data[2 * i + 1]) for i in range(cfg.num_layers)]

    @property
    def page_table(self) -> torch.Tensor:
        return self.layout.page_table

    def copy_page(self, src: int, dst: int) -> None:
        """Every layer's rows of page src into page dst (queued on the current stream)."""
        if src != dst:
            self.data[:, dst] = self.data[:, src]


def gpu_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a GPU, blocks torch caches but no tensor uses counted free."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def bytes_per_row(cfg: DecoderConfig, dtype: torch.dtype) -> int:
    """K and V bytes of one cache position in one slot, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def memory_budget(device: torch.device, reserve: int, utilization: float | None = None, held: int = 0) -> int:
    """Bytes the cache may take, `reserve` kept out: 90% of free GPU memory; with `utilization`,
    that share of the GPU's whole memory less what this engine holds already (`held`: its
    weights), as vLLM's gpu_memory_utilization (a per-engine share: other processes' memory is
    not counted in it); on a CPU a quarter of available RAM (<= 8 GiB)."""
    if device.type == "cuda":
        free, total = gpu_memory(device)
        avail = int(free * 0.9) if utilization is None else int(total * utilization) - held
        return max(avail - reserve, 0)
    avail = 16 * GiB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return min(avail // 4, 8 * GiB)


def plan_max_len(cfg: DecoderConfig, num_slots: int, dtype: torch.dtype, device: torch.device,
                 requested: int | None, headroom: int, reserve: int = 0) -> int:
    """Context per slot (prompt + completion): --max-model-len, else what the model and memory allow."""
    limit = cfg.max_position_embeddings
    if requested is not None:
        if requested > limit:
            raise ModelError(f"--max-model-len {requested} exceeds the model's "
                             f"max_position_embeddings ({limit})")
        return requested
    per_pos = bytes_per_row(cfg, dtype) * (num_slots + 1)
    fit = memory_budget(device, reserve) // per_pos - headroom
    if fit < 16:
        raise ModelError(f"not enough {device.type} memory for a KV cache of {num_slots} slots "
                         "(lower --batch-size or set --max-model-len)")
    return int(min(limit, fit))


def compact_path(kv: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, path: torch.Tensor,
                 num: torch.Tensor, page_table: torch.Tensor | None = None) -> None:
    """After a tree verify: move the accepted path's K/V to contiguous rows.

    The node emitted as row j sat at cache row start + path[:, j]; it belongs at start + j.
    path[:, j] >= j, so reading every source before writing is safe. Rows past num stay put.
    kv: KVCache.data [planes, slots + 1, rows, Hkv, D], or PagedKVCache.data [planes, pages, P,
    Hkv, D] with its `page_table`; on CUDA one Triton launch for every plane.
    """
    if kernels.active(kv):
        from ..kernels.compact import compact_path as fused_compact

        fused_compact(kv, slots, start, path, num, page_table=page_table)
        return
    j = torch.arange(path.shape[1], device=path.device)
    keep = j[None, :] < num[:, None]
    src = start[:, None] + torch.where(keep, path, j[None, :])
    dst = start[:, None] + j[None, :]
    if page_table is None:
        s = slots[:, None].expand_as(dst)
        kv[:, s, dst] = kv[:, s, src]
        return
    P = kv.shape[2]
    flat = kv.view(kv.shape[0], -1, *kv.shape[3:])
    at = lambda rows: page_table[slots[:, None], rows // P].to(torch.int64) * P + rows % P  # noqa: E731
    flat[:, at(dst)] = flat[:, at(src)]
