"""Edges of the bench, the library API and recipes: the accept length of greedy n > 1 rows, the run
seed with one SamplingParams, `draft: default` on vanilla, bench --job option checks, its floor with
n, its table without vanilla, an unwritable --out, steady cycles that all emit."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from specbatch.bench.sweep import BenchOptions, run_bench
from specbatch.cli import app

from bench_helpers import tiny_config, tiny_opts  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")




# 1. a greedy n>1 row: vanilla's mean accept length must be exactly 1.0 (README), not n
def test_vanilla_greedy_n_rows_keep_accept_length_one(tmp_path):
    from specbatch import JobOptions, load_recipe, run_job

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def f(x):", "n": 3, "max_tokens": 5, "temperature": 0}) + "\n")
    s = run_job(str(src), load_recipe("vanilla"), JobOptions(output=str(tmp_path / "o.jsonl"), device="cpu"))
    assert s["mean_accept_length"] == pytest.approx(1.0), s["mean_accept_length"]


# 2. LLM(seed=...) run seed: one SamplingParams for all must equal the list form (and the dict form)
def test_one_samplingparams_keeps_the_run_seed_like_the_list_form():
    from specbatch import LLM, SamplingParams

    prompts = ["def add(a, b):", "import os"]
    sp = SamplingParams(max_tokens=8, temperature=1.0)
    one = [c.text for c in LLM(recipe="vanilla", device="cpu", seed=5).generate(prompts, sp)]     # first calls
    lst = [c.text for c in LLM(recipe="vanilla", device="cpu", seed=5).generate(prompts, [sp, sp])]
    assert one == lst


# 3. `draft: default` means "the demo's draft, if any": a vanilla recipe carrying it must run,
#    and overriding algorithm=vanilla on a builtin speculative recipe must give a runnable recipe
def test_vanilla_with_draft_default_runs(tmp_path):
    from specbatch.recipe import load_recipe
    from specbatch.resolve import spec_config

    p = tmp_path / "van.yaml"
    p.write_text("algorithm: vanilla\nmodel: default\ndraft: default\n")
    spec_config(load_recipe(str(p)))                                    # JobError: "--draft default: ..."
    spec_config(load_recipe("eagle3_topk1").with_overrides(algorithm="vanilla"))


# 4. bench --job never validates the shared options: out-of-range simulated acceptance runs
def test_job_bench_rejects_bad_simulated_acceptance(tiny_config, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "eagle3_topk1",
                                 "--requests", "2", "--prompt-median", "8", "--prompt-max", "8",
                                 "--output-median", "4", "--output-max", "4", "--device", "cpu",
                                 "--simulate-acceptance", "1.5,-3", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output


# 4b. ... and sweep-only flags are silently ignored in --job mode
def test_job_bench_refuses_sweep_only_flags(tiny_config, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "2", "--prompt-median", "8", "--prompt-max", "8",
                                 "--output-median", "4", "--output-max", "4", "--device", "cpu",
                                 "--max-tokens", "1", "--batch-sizes", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output


# 5. job.md without a vanilla point: "vs vanilla" must not print 0.00x
def test_job_markdown_without_vanilla_has_no_zero_speedup():
    from specbatch.bench.job import job_markdown

    p = dict(recipe="eagle3_topk1", job_tokens_per_s=100.0, wall_s=1.0, prefill_s=0.1, prefill_forwards=1,
             decode_s=0.9, cycles=3, floor_s=0.5, floor_fraction=0.5, floor_spread_fraction=0.4,
             mean_occupancy=2, slots=4, accept_length=2.0, verify_widths={4: 3}, peak_memory_bytes=None)
    meta = dict(model="m", device="cpu", acceptance="measured acceptance", dtype="float32", requests=2,
                copy_bandwidth_bytes_per_s=1e9, matmul_flops_per_s=1e12,
                mix=dict(prompt_median=8, prompt_sigma=0.8, prompt_max=8, output_median=4, output_sigma=0.6,
                         output_max=4, shared_prefix=0))
    assert "0.00x" not in job_markdown({"meta": meta, "points": [p]})


# 6. bench --job --prompts FILE with an `n` row: the floor must count every choice's tokens
def test_job_floor_counts_every_choice_of_an_n_row(tmp_path):
    from specbatch.bench.job import JobMix, job_floor, job_rows
    from specbatch.bench.sources import load_source

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "def f(x):", "max_tokens": 6, "n": 4, "temperature": 1.0}) + "\n"
                 + json.dumps({"prompt": "import os", "max_tokens": 6}) + "\n")
    opts = BenchOptions(prompts=str(f), device="cpu")
    src = load_source(opts, torch.device("cpu"))
    rows = job_rows(JobMix(), opts, src)
    assert job_floor(src, rows, 32, 1e9, 1e12)["output_tokens"] == 4 * 6 + 6


# 7. bench --out that cannot be written: a one-line error (and before measuring), not a traceback
def test_bench_unwritable_out_is_a_one_line_error(tiny_config):
    r = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--batch-sizes", "1", "--max-tokens", "4", "--prompt-len", "8", "--no-hf",
                                 "--device", "cpu", "--out", "/dev/null/x"])
    assert r.exit_code == 2 and not isinstance(r.exception, OSError), repr(r.exception)


# 8. sweep: the ride-along cycle after every row finished is not "a cycle with every row active"
def test_sweep_steady_cycles_all_emit(tiny_config):
    p = run_bench(tiny_opts(tiny_config, recipes=("vanilla",), batch_sizes=(2,), max_tokens=12),
                  log=lambda m: None)["points"][0]
    assert p["steady_tokens"] == 2 * p["steady_cycles"], (p["steady_tokens"], p["steady_cycles"])


# 9. bench --job: a recipe that cannot resolve its draft fails before any recipe is measured
def test_job_bench_checks_every_recipe_before_measuring(tmp_path):
    from specbatch.bench.job import JobMix, run_job_bench
    from specbatch.bench.sources import BenchError
    from specbatch.job import JobError

    from tiny_models import make_checkpoint

    model = make_checkpoint("llama", tmp_path / "m")
    said = []
    with pytest.raises((JobError, BenchError)):
        run_job_bench(BenchOptions(model=str(model), recipes=("vanilla", "eagle3_topk1"), device="cpu",
                                   graphs=False),
                      JobMix(requests=2, prompt_median=8, prompt_max=8, output_median=4, output_max=4),
                      log=said.append)
    assert not any(m.startswith("vanilla: building") for m in said), said


# 4c. --sampling: a row's fields, validated as a row's; lengths stay the mix's; --job only
@pytest.mark.parametrize("value, says", [
    ("temperature=0.7", "expected a JSON object"),
    ('{"temperature": -1}', "--sampling temperature"),
    ('{"max_tokens": 9}', "'max_tokens' is the mix's to set"),
    ('{"response_format": {}}', "unknown field 'response_format'"),
])
def test_job_bench_sampling_flag_is_checked(value, says, tiny_config, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "2", "--device", "cpu", "--sampling", value, "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and says in r.output, r.output
    assert len([line for line in r.output.splitlines() if line.strip()]) == 1


def test_sampling_flag_needs_the_job_mode_and_no_eos_bias(tiny_config, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla", "--device", "cpu",
                                 "--sampling", '{"temperature": 0.5}', "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "add --job" in r.output, r.output
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "2", "--device", "cpu", "--max-tokens-factor", "2",
                                 "--sampling", '{"logit_bias": {"3": 1.0}}', "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--max-tokens-factor sets the rows' logit_bias" in r.output, r.output
