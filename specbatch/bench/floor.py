"""The memory-bandwidth floor of a decode step: the bytes it must read (weights + KV) over the
machine's measured copy bandwidth. Decode is memory-bound, so no step beats this."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from ..models.config import DecoderConfig
from ..runtime.kv_cache import bytes_per_row

CPU_COPY_BYTES = 256 << 20      # CPU copies are capped here (past the last-level cache, quick)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes/s of dst.copy_(src) on `device`: 2 * nbytes (read + write) over the median copy time."""
    device = torch.device(device)
    if device.type != "cuda":
        nbytes = min(nbytes, CPU_COPY_BYTES)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)                                          # warm-up: first touch, allocator
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(module: nn.Module, exclude_embeddings: bool = True) -> int:
    """Parameter bytes a forward of `module` reads, each storage counted once.

    An embedding table is read only for the batch's rows, so it is left out unless another
    module uses the same storage (a tied lm_head reads all of it).
    """
    seen: set = set()
    total = 0
    for mod in module.modules():
        if exclude_embeddings and isinstance(mod, nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):
            key = _storage_key(p)
            if key not in seen:
                seen.add(key)
                total += p.numel() * p.element_size()
    return total


def _storage_key(t: torch.Tensor) -> object:
    if t.device.type == "meta":
        return id(t)                                        # meta tensors have no storage address
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset())


def kv_bytes(cfg: DecoderConfig, dtype: torch.dtype, rows: float) -> float:
    """K and V bytes of `rows` cache positions (summed over the batch), all layers."""
    return bytes_per_row(cfg, dtype) * rows


def step_floor_ms(nbytes: float, bandwidth: float) -> float:
    """The shortest a step reading `nbytes` can take at `bandwidth` bytes/s."""
    return nbytes / bandwidth * 1e3


def draft_bytes(head: nn.Module, num_steps: int) -> int:
    """Draft-module weights read per cycle: S - 1 tree steps and one catch-up forward. An EAGLE3
    head's tree steps skip fc (they take the head's own state); an MTP layer reads all of its
    weights every step, the target's lm_head it borrows included."""
    full = weight_bytes(head)
    fc = weight_bytes(head.fc) if hasattr(head, "fc") else 0
    return (num_steps - 1) * (full - fc) + full
