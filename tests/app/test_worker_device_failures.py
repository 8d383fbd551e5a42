"""`--workers 2` with a row that brings its worker's device down (a planted CUDA error, through a
sitecustomize every process of the run loads): the rows that worker had in flight run alone on
one worker; the row that fails alone is written as its error, and the job ends or goes on with
every other row as one clean process writes it (the rerun finishes what a job left)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PLANT = '''
import os
from specbatch.engine import engine as _engine

_prefill = _engine.Engine._prefill
_poison = int(os.environ["SPECBATCH_TEST_POISON_ROW"])


def _failing(self, admitted):
    if any(req.row == _poison for _, req in admitted):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (planted)")
    return _prefill(self, admitted)


_engine.Engine._prefill = _failing
'''


def _run(inp: Path, out: Path, tiny_model, *extra: str, plant: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if plant is not None:
        env.update(PYTHONPATH=os.pathsep.join([str(plant), env.get("PYTHONPATH", "")]), SPECBATCH_TEST_POISON_ROW="9")
    cmd = [sys.executable, "-m", "specbatch", "run", str(inp), "-o", str(out), "--model", str(tiny_model),
           "--device", "cpu", "--max-tokens", "6", "--batch-size", "4", "--ignore-eos", "-q", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_a_worker_device_failure_isolates_the_row(tmp_path, tiny_model):
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
    runs = []
    for _ in range(3):                    # each run gets past what the last one found
        runs.append(_run(inp, out, tiny_model, "--workers", "2", plant=plant))
        if runs[-1].returncode == 0:
            break
    assert runs[-1].returncode == 0, [r.stderr for r in runs]
    assert "rows in flight" in runs[0].stderr and len(runs) > 1, runs[0].stderr
    got = {r["row"]: r for r in map(json.loads, open(out))}
    assert sorted(got) == list(range(16))
    assert "the device failed while this row ran alone" in got[9]["error"] and "planted" in got[9]["error"]
    assert all(got[i]["completion"] == want[i] and got[i]["error"] is None for i in got if i != 9)
