"""A real CUDA error (a device-side assert, planted through a sitecustomize for one row) ends the
process; the rows in flight are noted, the rerun runs them alone and writes the row that brings
the device down as its error, and the next rerun finishes the job with every other row as a
clean run writes it."""
from __future__ import annotations

import pytest

from failure_helpers import clean_run, only_the_poison_row_failed, plant, run_cli

pytestmark = pytest.mark.gpu


def test_a_real_device_assert_is_isolated_over_reruns(tmp_path, tiny_model):
    inp, want = clean_run(tmp_path, tiny_model, "cuda")
    planted = plant(tmp_path, "torch.zeros(4, device=self.device)[torch.tensor([1 << 20], device=self.device)]"
                              ".sum().item()")
    out = tmp_path / "o.jsonl"
    first = run_cli(inp, out, tiny_model, "cuda", planted=planted)
    assert first.returncode == 2 and "rows in flight" in first.stderr and "CUDA" in first.stderr, first.stderr
    second = run_cli(inp, out, tiny_model, "cuda", planted=planted)
    assert second.returncode == 2 and "ran alone" in second.stderr, second.stderr
    third = run_cli(inp, out, tiny_model, "cuda", planted=planted)
    assert third.returncode == 0, third.stderr
    assert "the device failed while this row ran alone" in only_the_poison_row_failed(out, want)
