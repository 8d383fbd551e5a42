"""A real CUDA error (a device-side assert, planted through a sitecustomize for one row) ends the
process; the rows in flight are noted, the rerun runs them alone and writes the row that brings
the device down as its error, and the next rerun finishes the job with every other row as a
clean run writes it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

PLANT = '''
import os
import torch
from specbatch.engine import engine as _engine

_prefill = _engine.Engine._prefill
_poison = int(os.environ["SPECBATCH_TEST_POISON_ROW"])


def _failing(self, admitted):
    if any(req.row == _poison for _, req in admitted):
        torch.zeros(4, device=self.device)[torch.tensor([1 << 20], device=self.device)].sum().item()
    return _prefill(self, admitted)


_engine.Engine._prefill = _failing
'''


def _run(inp, out, model, plant=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if plant is not None:
        env.update(PYTHONPATH=os.pathsep.join([str(plant), env.get("PYTHONPATH", "")]), SPECBATCH_TEST_POISON_ROW="9")
    cmd = [sys.executable, "-m", "specbatch", "run", str(inp), "-o", str(out), "--model", str(model),
           "--device", "cuda", "--max-tokens", "6", "--batch-size", "4", "--ignore-eos", "-q"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_real_device_assert_is_isolated_over_reruns(tmp_path, tiny_model):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"row {i} " + "ab " * (i % 4)}) + "\n"
                           for i in range(16)))
    clean = tmp_path / "clean.jsonl"
    assert _run(inp, clean, tiny_model).returncode == 0
    want = {r["row"]: r["completion"] for r in map(json.loads, open(clean))}
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANT)
    out = tmp_path / "o.jsonl"
    first = _run(inp, out, tiny_model, plant)
    assert first.returncode == 2 and "rows in flight" in first.stderr and "CUDA" in first.stderr, first.stderr
    second = _run(inp, out, tiny_model, plant)
    assert second.returncode == 2 and "ran alone" in second.stderr, second.stderr
    third = _run(inp, out, tiny_model, plant)
    assert third.returncode == 0, third.stderr
    got = {r["row"]: r for r in map(json.loads, open(out))}
    assert sorted(got) == list(range(16)) and "the device failed while this row ran alone" in got[9]["error"]
    assert all(got[i]["completion"] == want[i] and got[i]["error"] is None for i in got if i != 9)
