"""Host values onto the device without waiting for the GPU.

`torch.tensor(values, device=cuda)` and a plain `.to(cuda)` copy synchronously: the host waits for
every kernel already queued (a prefill forward, a cycle in flight) before it can queue the next
one. A copy from pageable memory with non_blocking=True is staged by the driver before the call
returns, so the source may be dropped at once and the copy stays stream-ordered (CUDA allows the
driver to synchronise while staging pageable memory: then it is no slower than the plain copy).
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) host list as a tensor on `device`, queued behind the stream's work."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
