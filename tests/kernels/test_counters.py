"""The kernels' shared arrival counters (kernels/counters.py): zeros of at least the size asked,
one buffer per user and device, a larger need adding a buffer while the smaller ones stay alive
(graphs captured with them still write there)."""
from __future__ import annotations

import torch

from specbatch.kernels.counters import _buffers, zeroed_counters


def test_counters_grow_without_freeing_the_smaller_ones():
    cpu = torch.device("cpu")
    small = zeroed_counters("test-user", cpu, 10, least=16)
    assert small.dtype == torch.int32 and small.numel() == 16 and not small.any()
    assert zeroed_counters("test-user", cpu, 16) is small            # fits: the same buffer
    big = zeroed_counters("test-user", cpu, 40, least=16)
    assert big.numel() == 40 and not big.any() and big is not small
    kept = _buffers[("test-user", cpu)]
    assert len(kept) == 2 and kept[0] is small and kept[1] is big     # the smaller one kept alive
    assert zeroed_counters("other-user", cpu, 10) is not big         # one buffer per user
