"""benchmarks/scale_out.py (the multi-GPU measurement, issue 17) runs its CPU form end to end:
2 worker processes on the demo model, and a worker, then the parent, SIGKILLed mid-job with
each rerun holding every id exactly once, so the script is ready for a machine of several GPUs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scale_out_script_cpu_form(tmp_path):
    out = tmp_path / "scale"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_out.py"), "--device", "cpu",
                        "--gpus", "2", "--rows-per-gpu", "16", "--max-output", "32", "--kill-test", "--kill-after", "0.05",
                        "--kill-rows", "24",
                        "--model-dir", str(ROOT / "specbatch" / "assets" / "demo" / "target"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads((out / "scale_out.json").read_text())
    kinds = [(r["gpus"], r["kind"]) for r in report["results"]]
    assert kinds == [(2, "parallel")]
    assert all(r["tokens"] > 0 for r in report["results"])
    assert [k["victim"] for k in report["kill_test"]] == ["worker", "parent"]
    for kill in report["kill_test"]:
        assert kill["killed_pid"] and kill["rerun_rc"] == 0, kill
        assert kill["rows"] == kill["unique"] == kill["expected"] == 24 and kill["missing"] == 0
    assert report["kill_test"][1]["first_rc"] == -9      # the parent itself was killed
    assert "| 2 | specbatch run --workers 2 |" in (out / "scale_out.md").read_text()
