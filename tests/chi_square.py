"""Chi-square goodness of fit for the statistical sampling tests."""
from __future__ import annotations

import math

import torch


def chi2_threshold(dof: int, z: float = 3.09) -> float:
    """Chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic over bins of expected count >= 5, the rest merged into one bin;
    tokens of zero probability must not appear at all."""
    counts, expected = counts.double().flatten(), expected.double().flatten()
    assert counts[expected <= 0].sum() == 0, "a token of zero probability was emitted"
    big = expected >= 5
    stat = float((((counts - expected) ** 2 / expected)[big]).sum())
    other_e, other_c = float(expected[~big].sum()), float(counts[~big].sum())
    stat += (other_c - other_e) ** 2 / max(other_e, 1e-9)
    return stat, max(int(big.sum()), 1)


def assert_law(samples, p, what):
    n = samples.numel()
    stat, dof = chi2(torch.bincount(samples, minlength=p.shape[0]), n * p)
    assert stat < chi2_threshold(dof), (what, stat, dof)
