"""The learning-rate schedule both training stages use."""
from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.0) -> float:
    """LR factor at `step` (0-based): linear warmup over `warmup` steps, then cosine from 1 down
    to `min_ratio` at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
