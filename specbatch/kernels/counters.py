"""Arrival counters for kernels whose last-arriving program finishes the work (top-1's combine,
split attention's merge): int32 zeros that those kernels leave at zero, one buffer per (user,
device) shared by every launch there (launches run one after another on one stream)."""
from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device], list[torch.Tensor]] = {}


def zeroed_counters(user: str, device: torch.device, n: int, least: int = 1024) -> torch.Tensor:
    """int32 [>= n] zeros for `user`'s launches on `device`. A larger need adds a buffer and keeps
    the smaller ones alive: graphs captured with them still write there. A buffer first needed
    while a graph is being captured is that capture's own (allocated and zeroed in the graph)."""
    bufs = _buffers.setdefault((user, device), [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(n, least), dtype=torch.int32, device=device))
    return bufs[-1]
