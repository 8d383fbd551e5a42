"""A real CUDA error (a device-side assert, planted through a sitecustomize for one row) ends the
process, not the job: `specbatch run` starts the same command again in a fresh process (exec),
which runs the rows that were in flight alone, writes the row that brings the device down as its
error, and starts once more to finish the job, every other row as a clean run writes it. The
fresh process inherits no handle on the failed CUDA context (its memory goes back with it)."""
from __future__ import annotations

import pytest

from failure_helpers import clean_run, only_the_poison_row_failed, plant, run_cli

pytestmark = pytest.mark.gpu

# every process started again lists its open files at start-up, before it touches CUDA
OPEN_FILES = '''
if os.environ.get("SPECBATCH_RESTART"):
    with open({path!r}, "a") as _f:
        for _fd in os.listdir("/proc/self/fd"):
            try:
                _f.write(os.readlink("/proc/self/fd/" + _fd) + "\\n")
            except OSError:
                pass
'''


def test_a_real_device_assert_is_isolated_by_restarts(tmp_path, tiny_model):
    inp, want = clean_run(tmp_path, tiny_model, "cuda")
    planted = plant(tmp_path, "torch.zeros(4, device=self.device)[torch.tensor([1 << 20], device=self.device)]"
                              ".sum().item()")
    opened = tmp_path / "opened.txt"
    site = planted / "sitecustomize.py"
    site.write_text(site.read_text() + OPEN_FILES.format(path=str(opened)))
    out = tmp_path / "o.jsonl"
    run = run_cli(inp, out, tiny_model, "cuda", planted=planted)
    assert run.returncode == 0, run.stderr
    assert "rows in flight" in run.stderr and "CUDA" in run.stderr, run.stderr
    assert "restart 1 of 3" in run.stderr and "ran alone" in run.stderr and "restart 2 of 3" in run.stderr, run.stderr
    assert "the device failed while this row ran alone" in only_the_poison_row_failed(out, want)
    files = opened.read_text().splitlines()
    assert files and not [f for f in files if f.startswith("/dev/nvidia")], files
