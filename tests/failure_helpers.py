"""Shared by the engine-failure tests: rows with a `where`, and a `specbatch run` subprocess whose
every Python process (workers included) loads a sitecustomize that makes one row's prefill fail."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from specbatch.data import RowRequest

POISON_ROW = 9

# sitecustomize: Engine._prefill runs `{action}` when `{when}` (by default: the poison row is admitted)
PLANT = '''
import os
import torch
from specbatch.engine import engine as _engine

_prefill = _engine.Engine._prefill
_poison = int(os.environ["SPECBATCH_TEST_POISON_ROW"])


def _failing(self, admitted):
    if {when}:
        {action}
    return _prefill(self, admitted)


_engine.Engine._prefill = _failing
'''


def failure_rows(count: int, draw: int = 0, **overrides) -> list[RowRequest]:
    g = torch.Generator().manual_seed(draw)
    lens = torch.randint(3, 30, (count,), generator=g).tolist()
    return [RowRequest(row=i, id=f"r{i}", prompt_token_ids=torch.randint(1, 200, (L,), generator=g).tolist(),
                       overrides={"max_tokens": 3 + i % 7, **overrides}, where=f"in.jsonl:{i + 1}")
            for i, L in enumerate(lens)]


def write_input(tmp_path: Path, count: int = 16) -> Path:
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"row {i} " + "ab " * (i % 4)}) + "\n"
                           for i in range(count)))
    return inp


POISON_ADMITTED = "any(req.row == _poison for _, req in admitted)"


def plant(tmp_path: Path, action: str, when: str = POISON_ADMITTED) -> Path:
    """A directory holding the sitecustomize, for run_cli's `plant`."""
    d = tmp_path / "plant"
    d.mkdir()
    (d / "sitecustomize.py").write_text(PLANT.replace("{action}", action).replace("{when}", when))
    return d


def run_cli(inp: Path, out: Path, model: Path, device: str, *extra: str,
            planted: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if planted is not None:
        env.update(PYTHONPATH=os.pathsep.join([str(planted), env.get("PYTHONPATH", "")]),
                   SPECBATCH_TEST_POISON_ROW=str(POISON_ROW))
    cmd = [sys.executable, "-m", "specbatch", "run", str(inp), "-o", str(out), "--model", str(model),
           "--device", device, "--max-tokens", "6", "--batch-size", "4", "--ignore-eos", "-q", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def completions(path: Path) -> dict[int, dict]:
    return {r["row"]: r for r in map(json.loads, open(path))}


def clean_run(tmp_path: Path, model: Path, device: str) -> tuple[Path, dict[int, dict]]:
    """The input, and what a run with nothing planted writes for it."""
    inp = write_input(tmp_path)
    clean = tmp_path / "clean.jsonl"
    assert run_cli(inp, clean, model, device).returncode == 0
    return inp, completions(clean)


def only_the_poison_row_failed(out: Path, want: dict[int, dict]) -> str:
    """Every row is in `out`, each as the clean run wrote it but the poison row: -> its error."""
    got = completions(out)
    assert sorted(got) == sorted(want)
    assert all(got[i]["completion"] == want[i]["completion"] and got[i]["error"] is None
               for i in got if i != POISON_ROW)
    return got[POISON_ROW]["error"]


JOB_ROWS = [{"id": f"r{i}", "prompt": f"row {i}: " + "abc " * (i % 5)} for i in range(10)]


def job_input(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in JOB_ROWS))
    return path


def job_flags(tiny_model: Path) -> list:
    return ["--model", tiny_model, "--max-tokens", 5, "--batch-size", 4, "--device", "cpu", "--ignore-eos"]


def plant_in_process(monkeypatch, fails, error: str = "planted") -> None:
    """Engine._prefill (this process) raises RuntimeError(error) for admitted rows `fails(row)` names."""
    from specbatch.engine import Engine

    prefill = Engine._prefill

    def failing(self, admitted):
        if any(fails(req.row) for _, req in admitted):
            raise RuntimeError(error)
        return prefill(self, admitted)
    monkeypatch.setattr(Engine, "_prefill", failing)
