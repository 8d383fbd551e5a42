"""bench --job with a greedy n > 1 row (the bench's default temperature 0): the engine decodes the
row once, so the floor and the accept length count it once."""
import json

import pytest
import torch

from specbatch.bench.job import JobMix, job_floor, job_rows, run_job_bench
from specbatch.bench.sources import load_source
from specbatch.bench.sweep import BenchOptions

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(tmp_path, n):
    f = tmp_path / f"p{n}.jsonl"
    f.write_text(json.dumps({"prompt": "def f(x):", "max_tokens": 8, "n": n}) + "\n")
    return BenchOptions(prompts=str(f), device="cpu", recipes=("vanilla",), graphs=False, hf=False)


def test_greedy_n_row_floor_counts_what_runs(tmp_path):
    floors = []
    for n in (1, 4):
        opts = _prompts(tmp_path, n)
        src = load_source(opts, torch.device("cpu"))
        floors.append(job_floor(src, job_rows(JobMix(), opts, src), 32, 1e9, 1e12)["output_tokens"])
    assert floors[0] == floors[1]          # greedy: the row's 4 choices are one decode


def test_greedy_n_row_bench_accept_length(tmp_path):
    p = run_job_bench(_prompts(tmp_path, 4), JobMix(requests=1), log=lambda s: None)["points"][0]
    assert p["accept_length"] == pytest.approx(1.0)   # vanilla
