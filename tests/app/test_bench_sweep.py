"""`specbatch bench` on CPU: a tiny random-weight config end to end (labelled reports, simulated
acceptance, usage errors), small targets, failed points recorded while the sweep goes on, and the
job mode against its floor."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from typer.testing import CliRunner

from specbatch.bench import configs
from specbatch.bench.hf_peer import PEER_NAME
from specbatch.bench.sweep import run_bench
from specbatch.cli import EXIT_USAGE, app
from specbatch.models.config import ModelError

from bench_helpers import TINY, tiny_config, tiny_opts  # noqa: F401 (fixture)

POINT_FIELDS = ("recipe", "batch_size", "tokens_per_s", "speedup_vs_vanilla", "accept_length", "draft_ms",
                "verify_ms", "extend_ms", "host_ms", "step_ms", "floor_ms", "floor_fraction",
                "peak_memory_bytes", "capture_s", "acceptance", "simulated_acceptance")
META_FIELDS = ("device", "date", "versions", "command", "copy_bandwidth_bytes_per_s", "dtype", "model_source",
               "simulated", "simulated_acceptance", "acceptance")


pytestmark = pytest.mark.usefixtures("one_thread")




def test_bench_cli_writes_labelled_reports(tiny_config, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--batch-sizes", "1,2", "--max-tokens", "8",
                                 "--prompt-len", "16", "--device", "cpu", "--eager",
                                 "--simulate-acceptance", "1,1,1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "bench.json").read_text())
    assert all(k in res["meta"] for k in META_FIELDS)
    assert res["meta"]["simulated"] and res["meta"]["acceptance"] == "simulated acceptance 1/1/1"
    ours = [p for p in res["points"] if not p["peer"]]
    assert [(p["recipe"], p["batch_size"]) for p in ours] == [
        ("vanilla", 1), ("vanilla", 2), ("eagle3_topk1", 1), ("eagle3_topk1", 2)]
    for p in ours:
        assert all(k in p for k in POINT_FIELDS), p
        assert p["tokens_per_s"] > 0 and 0 < p["floor_ms"] and p["steady_cycles"] > 0
    for p in ours[2:]:
        assert p["accept_length"] == 4.0                   # S + 1 on every decode cycle
        assert p["acceptance_per_position"] == [1.0, 1.0, 1.0]
        assert p["simulated_acceptance"] == [1.0, 1.0, 1.0]
        assert p["speedup_vs_vanilla"] is not None
        # beside the steady windows' ratio, the whole decode phase's (a speculative run's uneven tail in it)
        assert p["e2e_speedup_vs_vanilla"] == pytest.approx(p["e2e_tokens_per_s"] / ours[p["batch_size"] - 1][
            "e2e_tokens_per_s"])
    assert [p["accept_length"] for p in ours[:2]] == [1.0, 1.0]
    assert [p["batch_size"] for p in res["points"] if p["recipe"] == PEER_NAME] == [1, 2]
    md = (out / "bench.md").read_text()
    assert md.splitlines()[0].startswith("# ") and "simulated acceptance 1/1/1" in md.splitlines()[0]
    assert "| speedup vs vanilla | end-to-end vs vanilla | accept length (simulated acceptance 1/1/1) |" in md
    assert "On a CPU the floor is an estimate, not a bound" in md
    assert md.count("| eagle3_topk1 |") == 2 and md.count(f"| {PEER_NAME} |") == 2
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "bench.png").stat().st_size > 0
    else:
        assert not (out / "bench.png").exists() and "matplotlib is not installed" in r.stderr
    assert "simulated" in r.stdout


def test_zero_simulated_acceptance_accepts_nothing(tiny_config):
    res = run_bench(tiny_opts(tiny_config, recipes=("eagle3_topk1",), batch_sizes=(2,),
                               simulate_acceptance=(0.0,)), log=lambda m: None)
    (p,) = res["points"]
    assert p["accept_length"] == 1.0 and p["acceptance_per_position"] == [0.0, 0.0, 0.0]
    assert p["speedup_vs_vanilla"] is None and res["meta"]["acceptance"] == "simulated acceptance 0"


def test_random_drafts_without_simulation_warn(tiny_config):
    logs: list[str] = []
    res = run_bench(tiny_opts(tiny_config, recipes=("eagle3_topk1",), batch_sizes=(1,), max_tokens=4),
                    log=logs.append)
    assert any("warning" in m and "~1" in m for m in logs)
    assert not res["meta"]["simulated"] and res["meta"]["acceptance"] == "measured acceptance"


@pytest.mark.parametrize("args, says", [
    (["--random-weights", "no-such-model"], "llama-3.1-8b"),
    (["--simulate-acceptance", "1.5"], "[0, 1]"),
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--random-weights", "llama-3.1-8b", "--model", "somewhere"], "--random-weights"),
    (["-r", "no_such_recipe"], "no_such_recipe"),
    (["-r", "vanilla", "--draft", "/nowhere"], "--draft /nowhere: none of the recipes (vanilla) uses a draft model"),
    (["--batch-sizes", ""], "--batch-sizes: no values given"),
    (["-r", "vanilla", "-r", "eagle3_topk1", "-r", "vanilla"], "--recipe vanilla: given twice; each recipe runs once"),
    (["-r", "vanilla", "--batch-sizes", "1", "--max-tokens", "4", "--prompt-len", "8", "--separate-graphs"],
     "--separate-graphs compares fused and separate CUDA graphs: it needs a CUDA device"),
])
def test_bench_usage_errors(args, says, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--device", "cpu", "--out", str(tmp_path), *args])
    assert r.exit_code == EXIT_USAGE, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], r.stderr


def test_run_rejects_simulated_acceptance(tmp_path):
    rows = tmp_path / "x.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    r = CliRunner().invoke(app, ["run", str(rows), "--simulate-acceptance", "0.5"])
    assert r.exit_code == 2 and "--simulate-acceptance" in r.output
    assert not (tmp_path / "x.completions.parquet").exists()


# ---------------------------------------------------------------- small targets, failed points


def test_bench_runs_a_two_layer_random_config(tmp_path):
    # the published default aux layers (1, L//2-1, L-4) are (1, 0, -2) for L = 2: clamped to (1, 0, 0)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
                               "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128}))
    res = run_bench(tiny_opts(cfg, recipes=("eagle3_topk1", "eagle3_tree"), batch_sizes=(2,),
                               simulate_acceptance=(1.0, 1.0, 1.0)), log=lambda m: None)
    assert [p["recipe"] for p in res["points"]] == ["eagle3_topk1", "eagle3_tree"]
    assert all(not p.get("failed") and p["tokens_per_s"] > 0 for p in res["points"]), res["points"]
    assert res["points"][0]["accept_length"] == 4.0 and res["meta"]["failed_points"] == 0


def test_bad_aux_layers_of_a_random_head_name_it_not_none():
    from specbatch.speculative.factory import SpecConfig, make_drafter

    m = configs.random_target(TINY, torch.float32, "cpu")
    hc = {**configs.head_config(TINY), "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}
    head = configs.random_eagle3(hc, m, torch.float32, "cpu")
    with pytest.raises(ModelError) as e:
        make_drafter(SpecConfig("eagle3", 3, 1, 4), m, 2, 32, head=head)
    msg = str(e.value)
    assert not msg.startswith("None") and "random-weight EAGLE3 head" in msg and "[1, 2, 9]" in msg


def test_a_failing_point_is_recorded_and_the_sweep_goes_on(tiny_config, tmp_path, monkeypatch):
    from specbatch.bench import sweep

    real = sweep._measure

    def flaky(engine, prompts, *args):
        if engine.opts.spec.algorithm == "eagle3" and len(prompts) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
        if engine.opts.spec.algorithm == "vanilla" and len(prompts) == 1:
            raise RuntimeError("boom | at batch 1")
        return real(engine, prompts, *args)

    monkeypatch.setattr(sweep, "_measure", flaky)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--batch-sizes", "1,2,4", "--max-tokens", "8",
                                 "--prompt-len", "16", "--device", "cpu", "--eager", "--no-hf",
                                 "--simulate-acceptance", "1,1,1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "bench.json").read_text())
    got = [(p["recipe"], p["batch_size"], bool(p.get("failed"))) for p in res["points"]]
    assert got == [("vanilla", 1, True), ("vanilla", 2, False), ("vanilla", 4, False),
                   ("eagle3_topk1", 1, False), ("eagle3_topk1", 2, True), ("eagle3_topk1", 4, False)]
    assert res["meta"]["failed_points"] == 2
    bad = {(p["recipe"], p["batch_size"]): p for p in res["points"] if p.get("failed")}
    assert bad[("vanilla", 1)]["error"] == "RuntimeError: boom | at batch 1"
    assert bad[("eagle3_topk1", 2)]["error"] == "out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert all(p["tokens_per_s"] is None and p["speedup_vs_vanilla"] is None for p in bad.values())
    ok = [p for p in res["points"] if not p.get("failed")]
    assert all(p["tokens_per_s"] > 0 for p in ok)
    assert [p["speedup_vs_vanilla"] is None for p in ok] == [False, False, True, False]   # no vanilla at 1
    md = (out / "bench.md").read_text()
    assert "| vanilla | 1 | failed: RuntimeError: boom \\| at batch 1 | - |" in md
    assert "| eagle3_topk1 | 2 | failed: out of GPU memory: CUDA out of memory." in md
    assert "2 point(s) failed" in md and md.count("| eagle3_topk1 |") == 3
    assert "FAILED" in r.stderr


def test_an_engine_that_cannot_be_built_fails_its_recipe_only(tiny_config, monkeypatch):
    from specbatch.bench import sweep

    real = sweep.build_engine

    def no_tree(eopts, src, head):
        if eopts.spec.topk == 4:
            raise ValueError("no tree today")
        return real(eopts, src, head)

    monkeypatch.setattr(sweep, "build_engine", no_tree)
    res = run_bench(tiny_opts(tiny_config, recipes=("eagle3_tree", "vanilla"), batch_sizes=(1, 2)),
                    log=lambda m: None)
    got = [(p["recipe"], p["batch_size"], p.get("error")) for p in res["points"]]
    assert got == [("eagle3_tree", 1, "engine: ValueError: no tree today"),
                   ("eagle3_tree", 2, "engine: ValueError: no tree today"),
                   ("vanilla", 1, None), ("vanilla", 2, None)]


def test_the_cpu_sweep_times_cycles_unoverlapped(tiny_config, monkeypatch):
    """On a CPU, launching a cycle computes it: overlapped, each cycle's wall time was paired with
    the next cycle's stage times (host ms below zero); the CPU sweep runs cycles one after another."""
    from specbatch.bench import sweep

    real, seen = sweep.build_engine, []

    def spy(eopts, src, head):
        seen.append(eopts.overlap)
        return real(eopts, src, head)

    monkeypatch.setattr(sweep, "build_engine", spy)
    res = run_bench(tiny_opts(tiny_config, recipes=("vanilla",), batch_sizes=(1, 2)), log=lambda m: None)
    assert seen == [False] and all(p["host_ms"] >= 0 for p in res["points"] if not p["peer"])


@pytest.mark.parametrize("job", [False, True])
def test_a_bench_where_every_point_failed_exits_non_zero(tiny_config, tmp_path, monkeypatch, job):
    """The reports are written, but a script running the bench must not take a run that measured
    nothing as done (it exited 0)."""
    from specbatch.bench import job as job_mod
    from specbatch.bench import sweep

    def broken(eopts, src, head):
        raise ValueError("heads do not divide")

    monkeypatch.setattr(job_mod if job else sweep, "build_engine", broken)
    mode = ["--job", "--requests", "4", "--slots", "2", "--output-median", "4", "--prompt-median", "8",
            "--prompt-max", "16"] if job else ["--batch-sizes", "1", "--max-tokens", "4", "--prompt-len", "8"]
    r = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla", *mode,
                                 "--device", "cpu", "--eager", "--no-hf", "--out", str(tmp_path / "o")])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "every point failed (the first: " in said and "heads do not divide)" in said, r.output


def test_simulated_points_are_reproducible_and_carry_the_chain_formula(tiny_config):
    opts = tiny_opts(tiny_config, recipes=("eagle3_tree",), batch_sizes=(2,), max_tokens=24,
                      simulate_acceptance=(0.8, 0.6, 0.45))
    a, b = (run_bench(opts, log=lambda m: None)["points"][0] for _ in range(2))
    assert a["accept_length"] == b["accept_length"]
    assert a["acceptance_per_position"] == b["acceptance_per_position"]
    assert a["simulated_chain_accept_length"] == pytest.approx(1 + 0.8 + 0.48 + 0.216)


def test_job_mode_runs_the_mix_end_to_end_against_its_floor(tiny_config, tmp_path):
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--requests", "24", "--prompt-median", "12",
                                 "--prompt-max", "40", "--output-median", "8", "--output-max", "20",
                                 "--slots", "6", "--device", "cpu", "--eager", "--simulate-acceptance",
                                 "0.8,0.6,0.45", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "job.json").read_text())
    assert res["meta"]["mode"] == "job" and res["meta"]["requests"] == 24
    van, spec = res["points"]
    assert van["recipe"] == "vanilla" and spec["recipe"] == "eagle3_topk1"
    for p in (van, spec):
        # every row produced exactly its sampled length (EOS ignored): the same work for both
        assert p["output_tokens"] == van["output_tokens"] and p["slots"] == 6
        assert p["job_tokens_per_s"] > 0 and 0 < p["floor_fraction"] and p["floor_s"] > 0
        assert 0 < p["mean_occupancy"] <= 6 and p["prefill_forwards"] >= 1
        assert p["prefill_s"] + p["decode_s"] == pytest.approx(p["wall_s"])
        # in sequence the GEMMs and attention cannot overlap: never below the overlapped floor
        assert p["cycles_floor_in_sequence_s"] >= p["cycles_floor_s"] > 0
    assert van["accept_length"] == 1.0 and spec["accept_length"] > 1.5
    assert van["speedup_vs_vanilla"] == 1.0 and spec["speedup_vs_vanilla"] > 0
    # waves: far fewer prefill forwards than rows
    assert van["prefill_forwards"] < 24
    assert "| vanilla |" in (out / "job.md").read_text()
    assert "  cycles: CPU " in r.output and "GPU" not in r.output.split("cycles: ")[1].split("\n")[0]


def test_job_mode_with_a_shared_prefix_counts_it_once_in_the_floor(tiny_config, tmp_path):
    """--shared-prefix N: every prompt begins with the same N tokens; prefix caching finds them
    (the warm-up's and an earlier order's pages are forgotten first) and the floor's prefill
    counts each distinct prompt prefix once."""
    from specbatch.bench.job import distinct_prompt_tokens

    assert distinct_prompt_tokens([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3], [7]]) == 3 + 2 + 0 + 1
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "10", "--prompt-median", "12", "--prompt-max", "30",
                                 "--output-median", "4", "--output-max", "8", "--slots", "4", "--device", "cpu",
                                 "--eager", "--shared-prefix", "140", "--arrival-order-too", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "job.json").read_text())
    assert res["meta"]["mix"]["shared_prefix"] == 140
    for p in res["points"]:
        assert p["distinct_prompt_tokens"] <= p["prompt_tokens"] - 9 * 140
        # whole pages of the 140 shared tokens: each of the 9 later prompts skips at least one,
        # the same in both orders (a cold pool each time)
        assert p["prompt_tokens_cached"] >= 9 * 64
    assert res["points"][0]["prompt_tokens_cached"] == res["points"][1]["prompt_tokens_cached"]
    assert "the same 140 tokens" in (out / "job.md").read_text()


def test_job_mode_repeats_report_the_median_run_and_the_range(tiny_config, tmp_path):
    """--repeats N: each recipe's job runs N times on its engine; its point is the median run (its
    figures together), every run's job tok/s beside it, and the table shows the range."""
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--simulate-acceptance", "0.8,0.6", "--requests", "6",
                                 "--prompt-median", "8", "--prompt-max", "16", "--output-median", "6",
                                 "--output-max", "12", "--slots", "4", "--device", "cpu", "--eager", "--repeats", "3",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "job.json").read_text())
    assert res["meta"]["repeats"] == 3
    for p in res["points"]:
        runs = p["runs_job_tokens_per_s"]
        assert len(runs) == 3 and p["job_tokens_per_s"] == sorted(runs)[1]        # (runs in the order they ran)
        assert p["output_tokens"] / p["wall_s"] == pytest.approx(sorted(runs)[1])
    van, spec = res["points"]
    assert spec["speedup_vs_vanilla"] == pytest.approx(spec["job_tokens_per_s"] / van["job_tokens_per_s"])
    md = (out / "job.md").read_text()
    assert f"| vanilla | {van['job_tokens_per_s']:,.0f} ({min(van['runs_job_tokens_per_s']):,.0f}-" in md
    assert "the median of each recipe's runs on its engine" in md


def test_job_mode_measures_input_order_admission_on_the_same_engine(tiny_config, tmp_path):
    """--arrival-order-too: each recipe runs the mix admitting in input order, then longest
    max_tokens first (as runs do); same tokens, and longest first needs no more decode cycles."""
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "32", "--prompt-median", "8", "--prompt-max", "16",
                                 "--output-median", "8", "--output-sigma", "1.0", "--output-max", "40",
                                 "--slots", "8", "--device", "cpu", "--eager", "--arrival-order-too",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    arrival, longest = json.loads((out / "job.json").read_text())["points"]
    assert (arrival["recipe"], longest["recipe"]) == ("vanilla (input order)", "vanilla")
    assert arrival["output_tokens"] == longest["output_tokens"]
    assert longest["cycles"] < arrival["cycles"]
    assert longest["speedup_vs_vanilla"] == 1.0


@pytest.mark.parametrize("flag", [["--every-size-too"], ["--arrival-order-too"], ["--shared-prefix", "8"], ["--slots", "4"],
                                  ["--requests", "4"], ["--output-median", "50"], ["--prompt-max", "64"],
                                  ["--repeats", "3"]])
def test_job_flags_without_job_are_refused(flag, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--random-weights", "llama-3.1-8b", *flag, "--out", str(tmp_path)])
    assert r.exit_code != 0 and f"{flag[0]} applies to whole jobs only" in r.output


def test_every_size_too_needs_cuda_graphs(tiny_config, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "4", "--device", "cpu", "--every-size-too", "--out", str(tmp_path)])
    assert r.exit_code != 0
    assert "--every-size-too" in r.output and "CUDA" in r.output


def test_lognormal_mix_is_seeded_and_clipped():
    from specbatch.bench.job import lognormal_lengths

    a = lognormal_lengths(2000, 256, 0.8, 1536, torch.Generator().manual_seed(0))
    b = lognormal_lengths(2000, 256, 0.8, 1536, torch.Generator().manual_seed(0))
    assert a == b and min(a) >= 1 and max(a) == 1536
    assert 230 < sorted(a)[1000] < 280                      # the median


def test_device_name_of_a_cuda_device(monkeypatch):
    """The GPU branch, with the CUDA call stubbed (CI has no GPU)."""
    from specbatch.bench import sources

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: f"GPU {d}")
    assert sources.device_name(torch.device("cuda:0")) == "GPU cuda:0"


def test_job_floor_counts_the_longest_output_as_a_chain_of_steps():
    """Plain decoding reads every weight once a step and emits one token per sequence a step:
    a job whose longest output outlasts output tokens / slots needs that output's steps, however
    many slots there are; a job of many short outputs needs output tokens / slots."""
    from types import SimpleNamespace

    from specbatch.bench.floor import kv_bytes, weight_bytes
    from specbatch.bench.job import job_floor
    from specbatch.data import RowRequest

    model = configs.random_target(TINY, torch.float32, "cpu")
    src = SimpleNamespace(model=model)
    w = weight_bytes(model)
    bw, rate = 1e9, 1e30                        # FLOPs free: the floor is the bytes

    def rows(outputs, prompt=10):
        return [RowRequest(row=i, id=i, prompt_token_ids=[i + 1] * prompt, overrides={"max_tokens": o})
                for i, o in enumerate(outputs)]

    def ctx(outputs, prompt=10):
        return kv_bytes(model.cfg, torch.float32, sum(o * prompt + o * (o - 1) / 2 for o in outputs))

    long_tail = [100, 2, 2, 2]
    f = job_floor(src, rows(long_tail), 4, bw, rate)
    assert f["decode_steps"] == 100 and f["decode_steps_spread"] == 27      # ceil(106 / 4)
    assert f["decode_s"] == pytest.approx((100 * w + ctx(long_tail)) / bw)
    assert f["total_spread_s"] == pytest.approx(f["prefill_s"] + (27 * w + ctx(long_tail)) / bw)
    assert f["total_s"] > f["total_spread_s"]

    many_short = [5] * 40
    f = job_floor(src, rows(many_short), 4, bw, rate)
    assert f["decode_steps"] == f["decode_steps_spread"] == 50
    assert f["total_s"] == pytest.approx(f["total_spread_s"])
    # FLOPs bound the floor when they cost more than the bytes
    f = job_floor(src, rows(many_short), 4, 1e30, 1.0)
    assert f["decode_s"] == pytest.approx(2 * (w / 4) * 200)
    # the lengths a run's rows generated (stops, EOS) replace their max_tokens; a sampled row's
    # choices each decode at their own length, a greedy row's once (its copies are free)
    sampled = [RowRequest(row=0, id=0, prompt_token_ids=[1] * 10, overrides={"max_tokens": 50, "n": 2,
                                                                             "temperature": 0.8}),
               RowRequest(row=1, id=1, prompt_token_ids=[2] * 10, overrides={"max_tokens": 50, "n": 3})]
    f = job_floor(src, sampled, 4, bw, rate, lengths={0: [30, 7], 1: [4, 4, 4]})
    assert f["output_tokens"] == 30 + 7 + 4 and f["decode_steps"] == 30
    assert f["decode_s"] == pytest.approx((30 * w + ctx([30, 7, 4])) / bw)


def test_job_floor_counts_the_rows_a_small_pool_holds():
    """On a small GPU the KV pool, not the slots, bounds the sequences in flight: each holds its
    prompt and what it wrote at every step it decodes, so plain decoding takes at least the rows
    held step by step over the pool's rows; a pool that holds everything changes nothing."""
    from types import SimpleNamespace

    from specbatch.bench.floor import kv_bytes, weight_bytes
    from specbatch.bench.job import job_floor, unshared_prompt_lengths
    from specbatch.data import RowRequest

    model = configs.random_target(TINY, torch.float32, "cpu")
    src = SimpleNamespace(model=model)
    w = weight_bytes(model)
    bw, rate = 1e9, 1e30
    rows = [RowRequest(row=i, id=i, prompt_token_ids=[i + 1] * 10, overrides={"max_tokens": 5}) for i in range(40)]
    # the prefill emits each first token; the steps emitting tokens 2-5 hold 11, 12, 13, 14 rows
    held = 40 * (4 * 10 + 1 + 2 + 3 + 4)                    # 2,000 rows held over the job's steps
    roomy = job_floor(src, rows, 4, bw, rate, pool_rows=10_000)
    assert roomy["decode_steps"] == 50 and roomy["decode_steps_kv"] == 1          # the slots bound it
    assert roomy["decode_s"] == pytest.approx(job_floor(src, rows, 4, bw, rate)["decode_s"])
    small = job_floor(src, rows, 4, bw, rate, pool_rows=20)
    assert small["decode_steps"] == small["decode_steps_spread"] == small["decode_steps_kv"] == held // 20
    ctx = kv_bytes(model.cfg, torch.float32, 40 * (5 * 10 + 5 * 4 / 2))
    assert small["decode_s"] == pytest.approx((held // 20 * w + ctx) / bw)
    long_tail = rows[:3] + [RowRequest(row=9, id=9, prompt_token_ids=[7] * 10, overrides={"max_tokens": 300})]
    f = job_floor(src, long_tail, 4, bw, rate, pool_rows=1_000)
    assert f["decode_steps_kv"] < 300 == f["decode_steps"]               # the longest output's chain still binds
    # a prompt prefix other prompts share may be held once: it counts for none of them
    assert unshared_prompt_lengths([[1, 2, 3], [5], [1, 2, 4, 6], [1, 9]]) == [1, 1, 2, 1]
    same = [RowRequest(row=i, id=i, prompt_token_ids=[7] * 10, overrides={"max_tokens": 5}) for i in range(40)]
    assert job_floor(src, same, 4, bw, rate, pool_rows=20)["decode_steps_kv"] == 40 * 10 // 20
    one = [RowRequest(row=i, id=i, prompt_token_ids=[i + 1] * 2000, overrides={"max_tokens": 1}) for i in range(8)]
    assert job_floor(src, one, 4, bw, rate, pool_rows=100)["decode_steps_kv"] == 0     # the prefill emits them


def test_job_floor_counts_the_pool_the_engine_has(tiny_config, tmp_path, monkeypatch):
    """A pool of a few pages (memory modelled): the job's floor takes its steps from the rows the
    sequences hold over the engine's pool rows, more than output tokens / slots."""
    from specbatch.engine import pool
    from specbatch.models.config import DecoderConfig

    row = pool.bytes_per_row(DecoderConfig.from_dict(TINY), torch.float32)
    monkeypatch.setattr(pool, "memory_budget", lambda device, reserve, utilization=None, held=0: 12 * 16 * row)
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "16", "--prompt-median", "40", "--prompt-max", "60",
                                 "--output-median", "6", "--output-max", "12", "--slots", "8", "--device", "cpu",
                                 "--eager", "--out", str(out)])
    assert r.exit_code == 0, r.output
    (p,) = json.loads((out / "job.json").read_text())["points"]
    assert p["pages"] <= 12
    assert p["floor_decode_steps"] == p["floor_decode_steps_kv"] > -(-p["output_tokens"] // 8)


def test_job_mode_with_generous_max_tokens_ends_rows_by_eos_and_compares_reserving(tiny_config, tmp_path):
    """--max-tokens-factor F: rows ask for F x their output and end at their length by EOS (the
    floor counts the tokens they generate, not max_tokens); --reserve-too runs the mix again with
    admission reserving every row's max_tokens (no preemption): the same tokens."""
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "16", "--prompt-median", "8", "--prompt-max", "16",
                                 "--output-median", "6", "--output-max", "12", "--slots", "8", "--device", "cpu",
                                 "--eager", "--max-tokens-factor", "4", "--reserve-too", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "job.json").read_text())
    grown, reserved = res["points"]
    assert (grown["recipe"], reserved["recipe"]) == ("vanilla", "vanilla (reserve max_tokens)")
    assert grown["output_tokens"] == reserved["output_tokens"] == grown["floor_output_tokens"]
    assert reserved["preempted"] == 0
    assert "max_tokens 4x the output, ending by EOS" in (out / "job.md").read_text()
    refused = CliRunner().invoke(app, ["bench", "--random-weights", str(tiny_config), "-r", "vanilla",
                                       "--max-tokens-factor", "2", "--out", str(out)])
    assert refused.exit_code == 2 and "--max-tokens-factor applies to whole jobs only" in refused.output


def test_max_tokens_factor_with_simulated_acceptance_is_refused_for_drafting_recipes(tiny_config, tmp_path):
    """Rows given F x their output end at their length by the target's EOS; simulated acceptance
    accepts planted drafts the target did not choose, so a speculative recipe's rows ran past that
    EOS (more tokens than vanilla's and than the floor counts: 156 against 145 here) and the job
    compared unequal work. Refused, as the other options that cannot combine are."""
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--requests", "16", "--prompt-median", "8",
                                 "--prompt-max", "16", "--output-median", "10", "--output-max", "20",
                                 "--slots", "8", "--device", "cpu", "--eager", "--max-tokens-factor", "4",
                                 "--simulate-acceptance", "0.8,0.6,0.45", "--out", str(out)])
    assert r.exit_code == 2 and "--simulate-acceptance" in r.output, r.output
    # vanilla drafts nothing: its rows still end by EOS with the option given
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--requests", "8", "--prompt-median", "8", "--prompt-max", "16",
                                 "--output-median", "6", "--output-max", "12", "--slots", "4", "--device", "cpu",
                                 "--eager", "--max-tokens-factor", "4", "--simulate-acceptance", "0.8",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads((out / "job.json").read_text())["points"][0]
    assert p["output_tokens"] == p["floor_output_tokens"]


def test_job_mode_prompts_rows_that_end_their_own_way_count_what_they_generated_in_the_floor(tiny_config, tmp_path):
    """A --prompts row's own `ignore_eos: false` (with or without min_tokens) or stop ids is not the
    mix's --max-tokens-factor ending (it failed the recipe with KeyError: 'min_tokens'): the floor
    counts the tokens each row generated (it charged a row ending at its first token all of its
    max_tokens)."""
    prompts = tmp_path / "p.jsonl"
    stop_all = {"stop_token_ids": list(range(json.loads(tiny_config.read_text())["vocab_size"]))}
    extras = [{"ignore_eos": False}, stop_all, {"ignore_eos": False, "min_tokens": 2}, {}]
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7, 8 + i], "max_tokens": 8, **e}) + "\n"
                               for i, e in enumerate(extras)))
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "--prompts", str(prompts), "--requests", "4", "--slots", "4", "--device", "cpu",
                                 "--eager", "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = json.loads((out / "job.json").read_text())["points"][0]
    assert not p.get("failed"), p.get("error")
    assert p["floor_output_tokens"] == p["output_tokens"] <= 3 * 8 + 1
    assert "EOS ignored unless a row sets ignore_eos false; its stops apply" in (out / "job.md").read_text()


def test_job_mode_prompts_refuse_the_generated_mixs_flags_and_say_an_unapplied_recipe_sampling(tiny_config,
                                                                                              tmp_path):
    """With --prompts the rows set their prompts and lengths: the generated mix's flags are refused
    naming the first (they were recorded as if applied); a recipe whose sampling block the bench
    does not apply is said, and a row's typo'd field, as `run` says it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temprature": 0.5}) + "\n")
    base = ["bench", "--job", "--random-weights", str(tiny_config), "--prompts", str(prompts), "--requests", "1",
            "--slots", "1", "--device", "cpu", "--eager", "--out", str(tmp_path / "job")]
    r = CliRunner().invoke(app, [*base, "-r", "vanilla", "--shared-prefix", "100", "--output-max", "4"])
    assert r.exit_code == EXIT_USAGE and "error: --output-max, --shared-prefix: the generated mix's, not " \
                                          "--prompts'" in " ".join(r.stderr.split()), r.output
    sampled = tmp_path / "sampled.yaml"
    sampled.write_text("algorithm: vanilla\nname: sampled\nsampling:\n  temperature: 0.8\n  max_tokens: 24\n")
    r = CliRunner().invoke(app, [*base, "-r", str(sampled)])
    assert r.exit_code == 0, r.output
    assert "warning: sampled: its sampling (max_tokens 24, temperature 0.8) is not applied: bench rows run greedy" \
        in " ".join(r.output.split())
    assert "'temprature' is not a request field, so the row runs without it; did you mean 'temperature'?" in \
        " ".join(r.output.split())            # as `run` says it


def test_job_mode_prompts_file_is_named_with_its_rows_default_length(tiny_config, tmp_path):
    """A --prompts file's rows without max_tokens generate --output-median tokens: the report names
    the file and says so, rather than describing a lognormal mix it did not run; a vanilla recipe of
    another name is the speedup baseline; simulated positions past a recipe's depth are noted."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n"
                       + json.dumps({"prompt_token_ids": [5, 6, 8], "max_tokens": 6}) + "\n")
    plain = tmp_path / "plain.yaml"
    plain.write_text("algorithm: vanilla\n")
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", str(plain),
                                 "-r", "eagle3_topk1", "--simulate-acceptance", "0.5,0.5,0.5,0.5,0.5",
                                 "--prompts", str(prompts), "--requests", "2", "--slots", "2", "--output-median", "4",
                                 "--device", "cpu", "--eager", "--out", str(out)])
    assert r.exit_code == 0, r.output
    md = (out / "job.md").read_text()
    assert f"prompts and max_tokens from {prompts} (1 row without max_tokens: --output-median 4)" in md
    assert "lognormal" not in md
    res = json.loads((out / "job.json").read_text())
    assert [p["floor_output_tokens"] for p in res["points"]][0] == 4 + 6
    assert all(p["speedup_vs_vanilla"] is not None for p in res["points"])
    assert "note: eagle3_topk1: its drafts go 3 deep: P4..P5 of --simulate-acceptance do not apply" in " ".join(
        r.output.split())


def test_job_mode_with_sampling_fields_runs_every_row_sampled(tiny_config, tmp_path):
    """--sampling '{...}': every row of the mix gets those fields (validated as a row's), the
    lengths stay the mix's, and the report names the sampling."""
    from specbatch.bench.job import JobMix, job_rows
    from specbatch.bench.sources import BenchOptions, load_source

    fields = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.1, "seed": 3}
    out = tmp_path / "job"
    r = CliRunner().invoke(app, ["bench", "--job", "--random-weights", str(tiny_config), "-r", "vanilla",
                                 "-r", "eagle3_topk1", "--requests", "12", "--prompt-median", "12",
                                 "--prompt-max", "30", "--output-median", "6", "--output-max", "12",
                                 "--slots", "4", "--device", "cpu", "--eager", "--simulate-acceptance",
                                 "0.8,0.6,0.45", "--sampling", json.dumps(fields), "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "job.json").read_text())
    assert res["meta"]["mix"]["sampling"] == fields
    van, spec = res["points"]
    assert van["output_tokens"] == spec["output_tokens"] > 12          # EOS ignored: the mix's lengths
    assert "sampling temperature 0.8, top_p 0.9, top_k 5" in (out / "job.md").read_text()
    # generated rows carry the fields next to their length; a prompts file's rows keep their own
    opts = BenchOptions(random_weights=str(tiny_config), device="cpu")
    src = load_source(opts, torch.device("cpu"))
    rows = job_rows(JobMix(requests=3, sampling=fields), opts, src)
    assert all(row.overrides == {**fields, "max_tokens": row.overrides["max_tokens"]} for row in rows)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "temperature": 0.2, "max_tokens": 5}) + "\n")
    (row,) = job_rows(JobMix(sampling=fields), BenchOptions(random_weights=str(tiny_config), prompts=str(f)), src)
    assert row.overrides == {**fields, "temperature": 0.2, "max_tokens": 5}


def test_a_cycles_floor_counts_every_token_it_verifies():
    """The cycle floors of `bench --job`: a width-w cycle's GEMMs do w tokens a row, so at a
    compute-bound batch its floor is w times a plain step's."""
    from types import SimpleNamespace

    from specbatch.bench.job import _weights, cycle_split
    from specbatch.engine.profile import CycleTime

    model = configs.random_target(TINY, torch.float32, "cpu")
    _, params = _weights(model)
    src = SimpleNamespace(model=model)
    bandwidth, rate = 1e30, 1e12                        # bytes free: every floor is its FLOPs
    plain = CycleTime(batch=64, draft_ms=0, verify_ms=1, extend_ms=0, wall_ms=1, tokens=64, context=100)
    wide = CycleTime(batch=64, draft_ms=0, verify_ms=1, extend_ms=0, wall_ms=1, tokens=150, context=100, width=4)
    floors = [cycle_split(SimpleNamespace(cycle_times=[c], num_slots=64), src, bandwidth, rate)["cycles_floor_s"]
              for c in (plain, wide)]
    assert floors[0] == pytest.approx(2 * params * 64 / rate)
    assert floors[1] == pytest.approx(4 * floors[0])
