"""specbatch on Ray Data (a local Ray, CPU, the demo model): the processor's rows equal
`specbatch run`'s, a bad row is reported per row, an actor killed mid-batch costs nothing, and a
resumed run with Ray's checkpointing writes each row once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from specbatch.ray import SpecbatchPredictor  # noqa: E402

pytestmark = pytest.mark.slow

WORDS = "def add(a, b): return a + b for i in range(10): print(i * i) class Point: import os".split()
N = 120


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    rows = [{"id": i, "prompt": " ".join(WORDS[i % len(WORDS):][: 3 + i % 5]), "sampling_params": {"max_tokens": 10}}
            for i in range(N)]
    rows[9] = {"id": 9, "prompt": "", "sampling_params": {"max_tokens": 10}}
    inp = d / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    # the reference: the same rows through `specbatch run`
    plain = d / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"], "max_tokens": 10}) + "\n" for r in rows))
    ref = d / "ref.jsonl"
    p = subprocess.run([sys.executable, "-m", "specbatch", "run", str(plain), "-o", str(ref), "--device", "cpu", "-q"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr                # one bad row: an error row, exit 0
    by_id = {r["id"]: r for r in map(json.loads, ref.read_text().splitlines())}
    return {"dir": d, "inp": inp, "ref": by_id}


def _config(**kw):
    from specbatch.ray import ProcessorConfig

    base = dict(concurrency=2, batch_size=16, max_concurrent_batches=3, num_cpus=1,
                engine_kwargs={"device": "cpu", "batch_size": 16})
    return ProcessorConfig(**{**base, **kw})


def _check(rows, ref):
    assert sorted(r["id"] for r in rows) == list(range(N))
    for r in rows:
        want = ref[r["id"]]
        if want["error"]:
            assert r["__inference_error__"] and "'prompt'" in r["__inference_error__"]
            assert r["generated_text"] is None
            continue
        assert r["__inference_error__"] == ""                       # as ray.data.llm writes success
        assert r["generated_text"] == want["completion"], r["id"]
        assert r["num_generated_tokens"] == want["completion_tokens"] == len(r["generated_tokens"])
        assert r["num_input_tokens"] == want["prompt_tokens"] and r["time_taken_llm"] >= 0
        assert r["spec_verify_steps"] >= 1 and r["sampling_params"] == {"max_tokens": 10}


def test_processor_rows_equal_specbatch_run(cluster, data):
    from specbatch.ray import build_processor

    proc = build_processor(_config(should_continue_on_error=True))
    rows = proc(ray.data.read_parquet(str(data["inp"]), override_num_blocks=4)).take_all()
    _check(rows, data["ref"])


def test_preprocess_and_postprocess_as_ray_data_llm_apply_them(cluster):
    """Ray Data LLM's examples: preprocess returns only the prompt and sampling_params (its fields
    land over the input row's, so `id` and `gold` reach postprocess), and a failed row bypasses
    postprocess (whose code expects a completion), keeping its error."""
    from specbatch.ray import build_processor

    items = [{"id": i, "question": "def f(x):", "gold": f"g{i}", "top_p": 0.5 if i else 7.0} for i in range(3)]
    pre = lambda r: {"messages": [{"role": "user", "content": r["question"]}],      # noqa: E731
                     "sampling_params": {"max_tokens": 4, "top_p": r["top_p"]}}
    post = lambda r: {"id": r["id"], "gold": r["gold"], "answer": r["generated_text"].strip()}      # noqa: E731
    proc = build_processor(_config(concurrency=1, should_continue_on_error=True), preprocess=pre, postprocess=post)
    rows = sorted(proc(ray.data.from_items(items)).take_all(), key=lambda r: r["id"])
    assert "top_p" in rows[0]["__inference_error__"] and rows[0]["gold"] == "g0"      # bypassed, kept whole
    assert [(r["gold"], r["__inference_error__"]) for r in rows[1:]] == [("g1", ""), ("g2", "")]
    assert all(isinstance(r["answer"], str) for r in rows[1:]) and rows[0].get("answer") is None
    # (a block mixing a bypassed row's columns with postprocess's gives each row all, null where absent)


def test_a_bad_row_fails_the_batch_without_continue_on_error(cluster, data):
    from specbatch.ray import build_processor

    proc = build_processor(_config(concurrency=1))
    rows = ray.data.read_parquet(str(data["inp"])).limit(12)          # row 9 is the bad one
    with pytest.raises(Exception) as ei:
        proc(rows).take_all()
    assert "'prompt'" in str(ei.value)


def _actor_pids() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"SpecbatchPredictor" in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_an_actor_killed_mid_batch_costs_nothing_and_checkpoints_resume(cluster, data):
    from ray.data.checkpoint import CheckpointConfig

    from specbatch.ray import build_processor

    ctx = ray.data.DataContext.get_current()
    out = data["dir"] / "out"
    ctx.checkpoint_config = CheckpointConfig(id_column="id", checkpoint_path=str(data["dir"] / "ckpt"),
                                             delete_checkpoint_on_success=False)
    try:
        proc = build_processor(_config(should_continue_on_error=True))
        done = threading.Event()
        killed = []

        def kill_one():
            while not done.is_set():
                pids = _actor_pids()
                if len(pids) >= 2:
                    time.sleep(1.0)                  # inside its first batches
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                    return
                time.sleep(0.05)

        t = threading.Thread(target=kill_one)
        t.start()
        try:
            proc(ray.data.read_parquet(str(data["inp"]), override_num_blocks=8)).write_parquet(str(out))
        finally:
            done.set()
            t.join()
        assert killed, "no actor was killed"
        rows = pq.read_table(out).to_pylist()
        _check(rows, data["ref"])
        # rerun: every id is checkpointed, nothing is generated or written again
        before = sorted(os.listdir(out))
        build_processor(_config(concurrency=1))(ray.data.read_parquet(str(data["inp"]))).write_parquet(str(out))
        assert pq.read_table(out).num_rows == N and len(os.listdir(out)) >= len(before)
    finally:
        ctx.checkpoint_config = None


def test_batches_wait_for_every_actor_unless_asked_not_to(cluster):
    """A short dataset must not all go to the first actor up (Ray's default hands batches out as
    actors come up): the processor's dataset waits for the whole pool, or not when set to None."""
    from specbatch.ray import build_processor

    assert build_processor(_config())(ray.data.range(4)).context.wait_for_min_actors_s == 1800
    assert build_processor(_config(wait_for_actors_s=None))(ray.data.range(4)).context.wait_for_min_actors_s == -1


class _BreaksOnce(SpecbatchPredictor):
    """A predictor whose engine breaks once (a CUDA error, say) at its third row: a flag file
    makes the restarted actor's engine healthy."""

    def __init__(self, flag, **kw):
        self.flag = flag
        super().__init__(**kw)

    def _feed(self):
        n = 0
        for item in super()._feed():
            if getattr(item, "row", None) is not None:
                n += 1
                if n == 3 and not os.path.exists(self.flag):
                    open(self.flag, "w").close()
                    raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            yield item


def test_an_engine_that_breaks_restarts_its_actor_and_loses_no_row(cluster, tmp_path):
    """An engine failure ends the actor (an exception from a batch would fail the whole dataset):
    Ray restarts it and retries its batches; every row comes back once."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    flag = str(tmp_path / "broke")
    ds = ray.data.from_items([{"id": i, "prompt": f"def f{i}(x):", "sampling_params": {"max_tokens": 4}}
                              for i in range(32)])
    out = ds.map_batches(_BreaksOnce, fn_constructor_kwargs={"flag": flag, "engine_kwargs": {"device": "cpu",
                                                                                             "batch_size": 8}},
                         batch_size=8, batch_format="pyarrow", num_cpus=1,
                         max_restarts=2,
                         compute=ray.data.ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=2,
                                                            max_concurrent_calls_per_actor=2))
    rows = out.take_all()
    assert os.path.exists(flag)                                   # it did break
    assert sorted(r["id"] for r in rows) == list(range(32))
    assert all(r["generated_text"] is not None for r in rows)


def test_n_and_logprobs_reach_the_columns():
    """ray.data.llm's meaning: num_generated_tokens = len(generated_tokens) (choice 0 with n > 1);
    logprobs and prompt_logprobs a row asked for are returned (null for rows that did not ask)."""
    import asyncio

    from specbatch.ray import SpecbatchPredictor

    pred = SpecbatchPredictor(engine_kwargs={"device": "cpu", "batch_size": 8})
    rows = [{"prompt": "def add(a, b):", "sampling_params": {"max_tokens": 6, "n": 2, "temperature": 0.8}},
            {"prompt": "import os", "sampling_params": {"max_tokens": 4, "logprobs": 2, "prompt_logprobs": 1}}]
    a, b = asyncio.run(pred(pa.Table.from_pylist(rows))).to_pylist()
    assert a["num_generated_tokens"] == len(a["generated_tokens"]) > 0
    assert a["logprobs"] is None and a["prompt_logprobs"] is None
    assert len(b["logprobs"]) == b["num_generated_tokens"] and all(len(e["top_logprobs"]) == 2 for e in b["logprobs"])
    assert b["prompt_logprobs"][0] is None and len(b["prompt_logprobs"]) == b["num_input_tokens"]
    # a dataset that already holds output columns (a re-run over earlier output): replaced, not doubled
    again = pa.Table.from_pylist([{**rows[1], "generated_text": "old", "logprobs": None}])
    out = asyncio.run(pred(again))
    assert out.column_names.count("generated_text") == 1 and out.column_names.count("logprobs") == 1
    assert out.column("generated_text").to_pylist() == [b["generated_text"]]


@pytest.fixture(scope="module")
def lenient():
    """One predictor for the row-contract tests below: bad rows become `__inference_error__`."""
    return SpecbatchPredictor(engine_kwargs={"device": "cpu", "batch_size": 8}, should_continue_on_error=True)


def _call(pred, rows):
    import asyncio

    return asyncio.run(pred(pa.Table.from_pylist(rows)))


def test_sampling_params_without_a_temperature_are_said_greedy(lenient, capsys):
    """Ray Data LLM rows' sampling_params are vLLM's, which sample at temperature 1.0 when unset:
    a row's {top_p} with nothing setting a temperature runs greedy here, said once per actor."""
    _call(lenient, [{"prompt": "def f(x):", "sampling_params": {"max_tokens": 2, "top_p": 0.9}}] * 2)
    _call(lenient, [{"prompt": "def f(x):", "sampling_params": {"max_tokens": 2, "top_k": 3}}])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert len(err) == 1 and "top_p is set but no temperature is" in err[0], err


def test_a_batch_of_failed_rows_keeps_the_column_types(lenient, tmp_path):
    """A batch whose every row failed wrote its count columns as Arrow's null type, and a Parquet
    directory holding that file beside a good batch's could not be read back (cast int64 to null)."""
    bad = _call(lenient, [{"id": 0, "prompt": "", "sampling_params": {"max_tokens": 3}}])
    good = _call(lenient, [{"id": 1, "prompt": "def f(x):", "sampling_params": {"max_tokens": 3}}])
    assert bad.schema == good.schema
    pq.write_table(bad, tmp_path / "a.parquet")
    pq.write_table(good, tmp_path / "b.parquet")
    assert pq.read_table(tmp_path).num_rows == 2


def test_an_unknown_sampling_params_key_is_a_row_error(lenient):
    """ray.data.llm builds vLLM's SamplingParams from the dict, which refuses an unknown key; here a
    typo (max_new_tokens) or a field of another engine (guided_decoding) ran without it, silently."""
    rows = [{"prompt": "def f(x):", "sampling_params": {"max_new_tokens": 3}},
            {"prompt": "def f(x):", "sampling_params": {"max_tokens": 3, "guided_decoding": {"choice": ["a"]}}},
            {"prompt": "def f(x):", "sampling_params": {"max_tokens": 3, "max_new_tokens": None}}]   # struct fill
    a, b, c = _call(lenient, rows).to_pylist()
    assert "'sampling_params.max_new_tokens'" in a["__inference_error__"] and a["generated_text"] is None
    assert ("'sampling_params.guided_decoding': a vLLM sampling field specbatch does not support"
            in b["__inference_error__"])
    assert "not a sampling field specbatch knows" in a["__inference_error__"]                  # a typo
    assert c["__inference_error__"] == "" and c["num_generated_tokens"] == 3


def test_a_stale_error_column_from_an_earlier_output_is_replaced():
    """A dataset re-run over an earlier output brings its __inference_error__ along: without
    should_continue_on_error the column was left as it came, so postprocess skipped a row that
    succeeded now as failed."""
    strict = SpecbatchPredictor(engine_kwargs={"device": "cpu", "batch_size": 2})
    out = _call(strict, [{"prompt": "def f(x):", "sampling_params": {"max_tokens": 2}, "__inference_error__": "old"}])
    assert out.column("__inference_error__").to_pylist() == [""] and out.column("generated_text")[0].as_py()
    plain = _call(strict, [{"prompt": "def f(x):", "sampling_params": {"max_tokens": 2}}])
    assert "__inference_error__" not in plain.column_names          # as before: no column unless asked


def test_a_bad_tokenized_prompt_is_a_row_error(lenient):
    """A null or fractional token id raised from the batch (failing the whole dataset even with
    should_continue_on_error) or was truncated to an integer and generated from."""
    rows = [{"id": 0, "tokenized_prompt": [5, None]}, {"id": 1, "tokenized_prompt": [5.7, 9.2]},
            {"id": 2, "tokenized_prompt": [5, 9], "sampling_params": {"max_tokens": 2}}]
    a, b, c = _call(lenient, rows).to_pylist()
    assert "'tokenized_prompt[1]'" in a["__inference_error__"]
    assert "'tokenized_prompt[0]'" in b["__inference_error__"]
    assert c["__inference_error__"] == "" and c["num_input_tokens"] == 2
    assert not lenient.waiting                         # no row of a batch is left waiting


def test_rows_that_differ_only_in_id_sample_independently(lenient):
    """A prompt repeated under several ids (pass@k) drew the same sample for each: the content seed
    left every column but the prompt and its params out. A retried row still draws the same."""
    row = {"prompt": "def f(x):", "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
    rows = [{"id": f"q#{k}", **row} for k in range(4)]
    first = [r["generated_tokens"] for r in _call(lenient, rows).to_pylist()]
    assert len({tuple(t) for t in first}) > 1
    assert [r["generated_tokens"] for r in _call(lenient, rows).to_pylist()] == first


def test_rows_identical_in_every_column_sample_independently(lenient):
    """pass@k by repeating a row k times, no id column: every repeat drew the content seed's one
    sample. The k-th repeat within a batch counts into its seed; the same batch again (a retry)
    draws the same samples, and the first repeat keeps the seed a lone row has."""
    row = {"prompt": "def f(x):", "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
    first = [tuple(r["generated_tokens"]) for r in _call(lenient, [row] * 4).to_pylist()]
    assert len(set(first)) > 1
    assert [tuple(r["generated_tokens"]) for r in _call(lenient, [row] * 4).to_pylist()] == first
    assert [tuple(r["generated_tokens"]) for r in _call(lenient, [row]).to_pylist()] == first[:1]


def test_concurrency_takes_ray_data_llms_autoscaling_range(cluster):
    """vLLMEngineProcessorConfig(concurrency=(min, max)) is an autoscaling pool; here a range failed
    inside Ray with "'<' not supported between instances of 'tuple' and 'int'"."""
    from specbatch.ray import build_processor

    rows = build_processor(_config(concurrency=(1, 2), wait_for_actors_s=None))(
        ray.data.from_items([{"id": i, "prompt": f"def f{i}(x):", "sampling_params": {"max_tokens": 2}}
                             for i in range(8)])).take_all()
    assert sorted(r["id"] for r in rows) == list(range(8))
    for bad in ((2, 1), (0, 0), (1, 2, 3), "2"):
        with pytest.raises(ValueError, match="concurrency"):
            build_processor(_config(concurrency=bad))


def test_the_run_seed_in_engine_kwargs_reaches_unseeded_rows(lenient):
    """engine_kwargs={"seed": S} is LLM's run seed (rows without a seed derive theirs from it, as in
    `specbatch run --seed`); the content seed replaced it, so every seed drew the same samples."""
    rows = [{"id": k, "prompt": "def f(x):", "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
            for k in range(3)]
    other = SpecbatchPredictor(engine_kwargs={"device": "cpu", "batch_size": 8, "seed": 1})
    ours = [r["generated_tokens"] for r in _call(lenient, rows).to_pylist()]
    theirs = [r["generated_tokens"] for r in _call(other, rows).to_pylist()]
    assert ours != theirs
    seeded = [{**r, "sampling_params": {**r["sampling_params"], "seed": 3}} for r in rows]   # a row's own seed wins
    assert _call(lenient, seeded).column("generated_tokens") == _call(other, seeded).column("generated_tokens")


def test_vllms_engine_kwargs_run_and_a_value_no_engine_takes_is_refused_before_the_actors_start():
    """Ray Data LLM's examples pass vLLM engine_kwargs (max_num_seqs, enable_chunked_prefill,
    max_num_batched_tokens, tensor_parallel_size=1): they run as LLM(...) reads them; a value no
    engine here can take fails build_processor at once, not each actor as it starts."""
    from specbatch.ray import ProcessorConfig, build_processor

    pred = SpecbatchPredictor(engine_kwargs={"device": "cpu", "max_num_seqs": 2, "enable_chunked_prefill": True,
                                             "max_num_batched_tokens": 4096, "tensor_parallel_size": 1})
    assert pred.llm.recipe.batch_size == 2
    out = _call(pred, [{"prompt": "def f(x):", "sampling_params": {"max_tokens": 3}}])
    assert out.column("num_generated_tokens").to_pylist() == [3]
    with pytest.raises(ValueError, match=r"^LLM\(tensor_parallel_size=4\): specbatch runs one engine per GPU"):
        build_processor(ProcessorConfig(engine_kwargs={"device": "cpu", "tensor_parallel_size": 4}))
    from specbatch.recipe import RecipeError

    for key, named in (("max_num_partial_prefills", "known: name"), ("batchsize", "did you mean 'batch_size'")):
        with pytest.raises(RecipeError, match=rf"unknown key '{key}' .*{named}"):
            build_processor(ProcessorConfig(engine_kwargs={"device": "cpu", key: {}}))
    # vLLM's speculative_config is the recipe doing the same, checked as each actor's LLM will read it
    for config, said in (({"method": "ngram", "num_speculative_tokens": 2}, "method 'ngram' is not supported"),
                         ({"method": "eagle3", "model": "/h", "num_speculative_tokens": 0},
                          "num_speculative_tokens: expected an integer >= 1")):
        with pytest.raises(ValueError, match=said):
            build_processor(ProcessorConfig(engine_kwargs={"device": "cpu", "speculative_config": config}))
    with pytest.raises(ValueError, match=r"^engine_kwargs\['speculative_config'\] and recipe 'eagle3_tree' both"):
        build_processor(ProcessorConfig(recipe="eagle3_tree", engine_kwargs={"speculative_config": {
            "method": "mtp", "num_speculative_tokens": 2}}))
