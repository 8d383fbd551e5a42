"""The `specbatch run` CLI end to end, in process, through typer's CliRunner on tiny random models:
its outputs (columns, stats, token ids, kept columns, limits, flags over recipes over rows, seeds),
stdin and the default output, every row form, a rerun that completes a limited one."""
from __future__ import annotations

import json
import math
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from specbatch.cli import app

from cli_helpers import BASE_COLUMNS, N, PROMPTS, SPEC_FIELDS, out_columns, read_out, run_args, write_jsonl
from cli_helpers import data_dir, tokenizer  # noqa: F401
from cli_runner import cli, ok
from errors import one_line_cli_error

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def jsonl_run(tiny_model, data_dir):
    """rows.jsonl -> out.parquet with --stats-json."""
    out, stats = data_dir / "from_jsonl.parquet", data_dir / "from_jsonl.stats.json"
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--stats-json", stats))
    return out, json.loads(stats.read_text())


@pytest.fixture(scope="module")
def parquet_run(tiny_model, data_dir):
    """rows.parquet -> out.jsonl."""
    out = data_dir / "from_parquet.jsonl"
    ok(*run_args(tiny_model, data_dir / "rows.parquet", out))
    return out


def check_standard_rows(rows: list[dict], tokenizer, max_tokens: int = 8) -> None:
    assert [r["row"] for r in rows] == list(range(N))
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(N)]
    for r, prompt in zip(rows, PROMPTS):
        assert r["error"] is None
        assert isinstance(r["completion"], str)
        assert r["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
        assert 1 <= r["completion_tokens"] <= max_tokens
        assert r["finish_reason"] == ("length" if r["completion_tokens"] == max_tokens else "stop")
        spec = r["spec"]
        assert list(spec) == SPEC_FIELDS
        # vanilla: one target forward per token, no drafts
        assert spec["verify_steps"] == r["completion_tokens"]
        assert spec["draft_tokens"] == 0 and spec["accepted_tokens"] == 0
        assert spec["accept_length"] == pytest.approx(1.0)
        # one bucket (0 drafts accepted); the prefill is a verify step but not a histogram cycle
        assert spec["accept_histogram"] == [spec["verify_steps"] - 1]


# ---------------------------------------------------------------- run: outputs


def test_run_jsonl_to_parquet(jsonl_run, tokenizer):
    out, _ = jsonl_run
    schema = pq.read_schema(out)
    assert schema.names == BASE_COLUMNS
    assert pa.types.is_struct(schema.field("spec").type)
    assert [f.name for f in schema.field("spec").type] == SPEC_FIELDS
    assert not os.path.exists(str(out) + ".parts")
    check_standard_rows(read_out(out), tokenizer)


def test_run_parquet_to_jsonl(parquet_run, jsonl_run, tokenizer):
    assert out_columns(parquet_run) == BASE_COLUMNS
    rows = read_out(parquet_run)
    check_standard_rows(rows, tokenizer)
    # greedy on the same prompts: the input format does not change the completions
    assert [r["completion"] for r in rows] == [r["completion"] for r in read_out(jsonl_run[0])]


def test_stats_json_matches_output(jsonl_run):
    out, stats = jsonl_run
    rows = read_out(out)
    for key in ("requests", "errors", "completion_tokens", "mean_accept_length", "wall_s", "peak_memory_bytes"):
        assert key in stats, key
    assert stats["requests"] == N
    assert stats["errors"] == 0
    assert stats["completion_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert stats["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    steps = sum(r["spec"]["verify_steps"] for r in rows)
    assert stats["mean_accept_length"] == pytest.approx(stats["completion_tokens"] / steps)
    assert stats["wall_s"] > 0
    assert stats["peak_memory_bytes"] > 0


@pytest.fixture(scope="module")
def ids_run(tiny_model, data_dir):
    """rows.parquet -> out.jsonl with --save-token-ids --keep-columns a,b."""
    out = data_dir / "ids_keep.jsonl"
    ok(*run_args(tiny_model, data_dir / "rows.parquet", out, "--save-token-ids", "--keep-columns", "a,b"))
    return out


def test_save_token_ids_and_keep_columns(ids_run, jsonl_run, tokenizer):
    assert out_columns(ids_run) == BASE_COLUMNS + ["output_token_ids", "a", "b"]
    rows = read_out(ids_run)
    reference = read_out(jsonl_run[0])
    assert [r["a"] for r in rows] == [i * 10 for i in range(N)]
    assert [r["b"] for r in rows] == [f"b{i}" for i in range(N)]
    for r, ref in zip(rows, reference):
        assert len(r["output_token_ids"]) == r["completion_tokens"]
        text = tokenizer.decode(r["output_token_ids"], skip_special_tokens=True)
        # (a character cut by max_tokens is left out, as vLLM's detokenizer holds it back)
        assert r["completion"] == text or (text.endswith("\ufffd") and text.startswith(r["completion"]))
        assert r["completion"] == ref["completion"]


def test_limit(tiny_model, data_dir):
    out = data_dir / "limit.parquet"
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--limit", 5))
    rows = read_out(out)
    assert [r["row"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["id"] for r in rows] == ["r0", "r1", "r2", "r3", "r4"]


def test_flags_override_recipe_and_rows_override_flags(tiny_model, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(f"name: mine\nalgorithm: vanilla\nmodel: {tiny_model}\nbatch_size: 3\n"
                      "sampling:\n  max_tokens: 5\n  ignore_eos: true\n")
    rows = [{"prompt": p} for p in PROMPTS[:6]]
    rows[2]["max_tokens"] = 4
    rows[4]["max_completion_tokens"] = 1
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.parquet"
    ok("run", inp, "-r", recipe, "--max-tokens", 3, "--device", "cpu", "-o", out, "-q")
    got = {r["row"]: r for r in read_out(out)}
    assert sorted(got) == list(range(6))
    # ignore_eos comes from the recipe, so every row runs to its exact limit
    want = {0: 3, 1: 3, 2: 4, 3: 3, 4: 1, 5: 3}
    assert {i: r["completion_tokens"] for i, r in got.items()} == want
    assert all(r["finish_reason"] == "length" for r in got.values())
    # without the flag the recipe's 5 applies
    out2 = tmp_path / "out2.parquet"
    ok("run", inp, "-r", recipe, "--device", "cpu", "-o", out2, "-q")
    assert {r["row"]: r["completion_tokens"] for r in read_out(out2)} == {**want, 0: 5, 1: 5, 3: 5, 5: 5}


def test_max_tokens_flag_caps_every_row(tiny_model, data_dir, ids_run):
    out = data_dir / "max3.parquet"
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--max-tokens", 3, "--save-token-ids"))
    rows = read_out(out)
    assert len(rows) == N
    assert all(1 <= r["completion_tokens"] <= 3 for r in rows)
    assert any(r["completion_tokens"] == 3 for r in rows)
    # greedy: the 3-token completions are prefixes of the 8-token ones
    for r, ref in zip(rows, read_out(ids_run)):
        assert r["output_token_ids"] == ref["output_token_ids"][: r["completion_tokens"]]


def test_seeded_sampling_is_reproducible(tiny_model, data_dir, jsonl_run):
    def sample(seed: int, name: str) -> list[str]:
        out = data_dir / name
        ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--temperature", 0.7, "--seed", seed))
        rows = read_out(out)
        assert len(rows) == N and all(r["error"] is None for r in rows)
        return [r["completion"] for r in rows]

    first, again, other = sample(1, "s1a.parquet"), sample(1, "s1b.parquet"), sample(2, "s2.parquet")
    assert first == again
    assert first != other
    assert first != [r["completion"] for r in read_out(jsonl_run[0])]


# ---------------------------------------------------------------- stdin, default output, reruns


def test_stdin_input_and_default_output(tiny_model, data_dir, tmp_path, jsonl_run):
    inp = tmp_path / "rows.jsonl"
    shutil.copy(data_dir / "rows.jsonl", inp)
    ok("run", inp, "--model", tiny_model, "--max-tokens", 8, "--device", "cpu", "--limit", 4, "-q")
    default = tmp_path / "rows.completions.parquet"
    assert [r["id"] for r in read_out(default)] == ["r0", "r1", "r2", "r3"]

    out = tmp_path / "stdin.jsonl"
    r = CliRunner().invoke(app, ["run", "-", "--model", str(tiny_model), "--max-tokens", "8", "--device", "cpu",
                                 "-o", str(out), "-q"], input=inp.read_bytes())
    assert r.exit_code == 0, r.output
    rows = read_out(out)
    assert [x["id"] for x in rows] == [f"r{i}" for i in range(N)]
    assert [x["completion"] for x in rows] == [x["completion"] for x in read_out(jsonl_run[0])]


def test_rerun_without_limit_completes_the_rest(tiny_model, data_dir, tmp_path):
    out = tmp_path / "lim.parquet"
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--limit", 3))
    assert len(read_out(out)) == 3
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out))
    assert [r["row"] for r in read_out(out)] == list(range(N))


def test_a_stdin_resume_names_stdin_in_row_errors(tiny_model, tmp_path):
    """A resume from stdin spools it to a file; its row errors still say <stdin>, not that file."""
    data = b'{"prompt": "a"}\n{"prompt": "b"}\nnot json\n{"prompt": "c"}\n'
    out = tmp_path / "s.jsonl"
    args = ["run", "-", "--model", str(tiny_model), "--max-tokens", "2", "--device", "cpu", "-o", str(out), "-q"]
    assert CliRunner().invoke(app, [*args, "--limit", "2"], input=data).exit_code == 0
    r = CliRunner().invoke(app, args, input=data)
    assert r.exit_code == 0, r.output
    err = [x for x in read_out(out) if x["error"]]
    assert len(err) == 1 and err[0]["error"].startswith("<stdin>:3: ")


# ---------------------------------------------------------------- other row forms


def test_messages_and_openai_batch_rows(tiny_model, tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    rows = [
        {"id": "chat-1", "messages": messages},
        {"custom_id": "req-7", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "whatever", "messages": messages, "max_tokens": 3, "temperature": 0}},
        {"custom_id": "req-8", "method": "POST", "url": "/v1/completions",
         "body": {"model": "whatever", "prompt": "import os", "max_completion_tokens": 2}},
        {"prompt": "class Point:"},
    ]
    inp = write_jsonl(tmp_path / "forms.jsonl", rows)
    out = tmp_path / "forms.parquet"
    ok("run", inp, "--model", tiny_model, "--max-tokens", 5, "--ignore-eos", "--device", "cpu", "-o", out, "-q",
       "--save-token-ids")
    got = read_out(out)
    assert [r["id"] for r in got] == ["chat-1", "req-7", "req-8", "3"]
    assert all(r["error"] is None and isinstance(r["completion"], str) for r in got)
    assert [r["completion_tokens"] for r in got] == [5, 3, 2, 5]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_chat = len(tokenizer(chat, add_special_tokens=False)["input_ids"])
    assert got[0]["prompt_tokens"] == got[1]["prompt_tokens"] == n_chat
    assert got[2]["prompt_tokens"] == len(tokenizer("import os")["input_ids"])
    # same prompt through both forms, greedy: the shorter completion is a prefix of the longer
    assert got[0]["output_token_ids"][:3] == got[1]["output_token_ids"]


def test_an_openai_line_without_temperature_samples_at_the_apis_default(tiny_model, tmp_path):
    """As OpenAI and `vllm run-batch` read a body with no temperature (and no generation config):
    1.0, not specbatch's greedy default for its own row forms; a flag or the body's own still rule."""
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "ignore_eos": True}
    rows = lambda extra: [{"custom_id": f"c{i}", "body": {**body, **extra}} for i in range(4)]     # noqa: E731
    outs = {}
    for name, extra, flags in (("unset", {}, []), ("one", {"temperature": 1.0}, []), ("zero", {"temperature": 0}, []),
                               ("flag", {}, ["--temperature", "0"])):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", rows(extra))
        ok("run", inp, "--model", tiny_model, "--device", "cpu", "-o", tmp_path / f"{name}.parquet", "-q", *flags)
        outs[name] = [r["completion"] for r in read_out(tmp_path / f"{name}.parquet")]
    assert outs["unset"] == outs["one"]                    # the same rows, seeds and temperature
    assert outs["zero"] == outs["flag"] and len(set(outs["zero"])) == 1      # greedy: one answer
    assert outs["unset"] != outs["zero"] and len(set(outs["unset"])) > 1


def test_logprobs_mode_flag(tiny_model, tmp_path):
    """--logprobs-mode: raw_logprobs by default (vLLM's), processed_logprobs on request; the mode
    is part of what a rerun must match, and a bad one is a one-line error naming the flag."""
    from cli_runner import cli

    rows = [{"prompt": p, "temperature": 0.5, "top_k": 3, "logprobs": 3, "max_tokens": 4, "seed": i}
            for i, p in enumerate(PROMPTS[:3])]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    ok(*run_args(tiny_model, inp, tmp_path / "raw.jsonl"))
    ok(*run_args(tiny_model, inp, tmp_path / "proc.jsonl", "--logprobs-mode", "processed_logprobs"))
    raw, proc = read_out(tmp_path / "raw.jsonl"), read_out(tmp_path / "proc.jsonl")
    assert [r["completion"] for r in raw] == [r["completion"] for r in proc]     # the same draws
    for r, q in zip(raw, proc):
        for a, b in zip(r["logprobs"], q["logprobs"]):
            assert a["token_id"] == b["token_id"]
            # top_k 3 at temperature 0.5 keeps 3 tokens: processed tops sum to 1, raw ones less
            assert abs(sum(math.exp(t["logprob"]) for t in b["top_logprobs"]) - 1) < 1e-4
            assert sum(math.exp(t["logprob"]) for t in a["top_logprobs"]) < 1 - 1e-3
    r = cli(*run_args(tiny_model, inp, tmp_path / "raw.jsonl", "--logprobs-mode", "processed_logprobs", "--limit", 3))
    assert r.exit_code != 0 and "logprobs_mode" in r.output
    r = cli(*run_args(tiny_model, inp, tmp_path / "x.jsonl", "--logprobs-mode", "raw"))
    assert r.exit_code == 2 and "--logprobs-mode raw: expected one of raw_logprobs" in r.output


def test_no_flags_turn_off_a_recipes_true(tiny_model, tmp_path):
    """--no-ignore-eos and --no-include-stop-str-in-output override a recipe that sets them true."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: mine\nalgorithm: vanilla\nmodel: {tiny_model}\n"
                      "sampling:\n  ignore_eos: true\n  include_stop_str_in_output: true\n  max_tokens: 3\n")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def f():"}])
    for flags, want in (((), True), (("--no-ignore-eos", "--no-include-stop-str-in-output"), False)):
        out = tmp_path / f"o{want}.jsonl"
        ok("run", inp, "-r", recipe, "-o", out, "--device", "cpu", "-q", *flags)
        sampling = json.loads((tmp_path / f"o{want}.jsonl.manifest.json").read_text())["fingerprint"]["sampling"]
        assert sampling["ignore_eos"] is want and sampling["include_stop_str_in_output"] is want


def test_gpus_with_workers_or_device_is_refused():
    from specbatch.workers import devices_for

    for kw in ({"workers": 2, "device": None}, {"workers": None, "device": "cpu"}):
        with pytest.raises(ValueError, match="give either --gpus or --workers/--device"):
            devices_for("all", **kw)


def test_run_logit_bias_outside_the_vocabulary_fails_at_once(tiny_model, tmp_path):
    from cli_runner import cli

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def f():"}] * 3)
    r = cli(*run_args(tiny_model, inp, tmp_path / "o.jsonl", "--logit-bias", "99999=1"))
    assert r.exit_code == 2 and "--logit-bias" in r.output and "token id 99999 is outside" in r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_gpus_flags_fail_before_any_output(tiny_model, tmp_path):
    from cli_runner import cli

    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def f():"}])
    r = cli(*run_args(tiny_model, inp, tmp_path / "o.jsonl", "--gpus", "all", "--workers", "2"))
    assert r.exit_code == 2 and "give either --gpus or --workers/--device" in r.output
    assert not list(tmp_path.glob("o.jsonl*"))


def test_a_directory_of_shards_runs_as_one_input_and_a_new_shard_resumes(tiny_model, data_dir, jsonl_run, tmp_path):
    rows = read_out(jsonl_run[0])
    ds = tmp_path / "ds"
    (ds / "year=2026").mkdir(parents=True)
    src = pq.read_table(data_dir / "rows.parquet")
    pq.write_table(src.slice(0, 5), ds / "year=2026" / "part-00000.parquet")
    pq.write_table(src.slice(5, 4), ds / "year=2026" / "part-00001.parquet")
    (ds / "_SUCCESS").write_bytes(b"")
    out = tmp_path / "ds.completions.parquet"
    ok("run", ds, "--model", tiny_model, "--max-tokens", 8, "--device", "cpu", "-q", "--keep-columns", "a")
    got = read_out(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows[:9]] and [r["row"] for r in got] == list(range(9))
    assert [r["completion"] for r in got] == [r["completion"] for r in rows[:9]]
    assert [r["a"] for r in got] == [i * 10 for i in range(9)]
    # a shard added after the last: its rows are new rows, a rerun adds them
    pq.write_table(src.slice(9), ds / "year=2026" / "part-00002.parquet")
    ok("run", ds, "--model", tiny_model, "--max-tokens", 8, "--device", "cpu", "-q", "--keep-columns", "a")
    got = read_out(out)
    assert [r["id"] for r in got] == [r["id"] for r in rows] and [r["row"] for r in got] == list(range(N))
    assert [r["completion"] for r in got] == [r["completion"] for r in rows]
    # the output among the files it reads is refused before anything is written
    line = one_line_cli_error(cli(*run_args(tiny_model, ds, ds / "year=2026" / "o.parquet")), 2)
    assert "inside the input directory" in line and not (ds / "year=2026" / "o.parquet").exists()


def test_an_input_unreadable_midway_keeps_the_finished_rows_and_says_so(tiny_model, tmp_path):
    """A directory's later file gone (or a compressed file cut) after the input was opened: the job
    stops with one line naming it and the resume, and the rows that finished are committed."""
    from specbatch import JobError, JobOptions, load_recipe, run_job

    ds = tmp_path / "ds"
    ds.mkdir()
    write_jsonl(ds / "a.jsonl", [{"prompt": p, "max_tokens": 2} for p in PROMPTS])
    write_jsonl(ds / "b.jsonl", [{"prompt": p, "max_tokens": 2} for p in PROMPTS])
    out = tmp_path / "o.parquet"

    def progress(event, info):
        if event == "start":
            os.remove(ds / "b.jsonl")

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=4)
    with pytest.raises(JobError, match=r"b\.jsonl: cannot read JSONL: No such file or directory; finished rows are "
                                       r"committed, rerun the same command to resume"):
        run_job(str(ds), recipe, JobOptions(output=str(out), device="cpu"), progress=progress)
    parts = [os.path.join(str(out) + ".parts", p) for p in os.listdir(str(out) + ".parts") if p.startswith("part-")]
    rows = sorted(r for p in parts for r in pq.read_table(p, columns=["row"]).column("row").to_pylist())
    assert rows and set(rows) <= set(range(N))          # (rows in flight when the read failed run again)


def test_a_vllm_speculative_config_runs_the_recipe_doing_the_same(target_dir, eagle3_dir, tmp_path):
    """`--speculative-config '{"method": "eagle3", "model": HEAD, "num_speculative_tokens": 2}'`
    (vllm run-batch's way to speculate) is `--recipe eagle3_topk1 --draft HEAD` with S = 2."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6}) + "\n" for p in PROMPTS[:3]))
    config = json.dumps({"method": "eagle3", "model": str(eagle3_dir), "num_speculative_tokens": 2})
    base = ("--model", target_dir, "--device", "cpu", "--ignore-eos")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    ok("run", src, "-o", a, "--speculative-config", config, "--stats-json", tmp_path / "a.json", "-q", *base)
    ok("run", src, "-o", b, "-r", "eagle3_topk1", "--draft", eagle3_dir, "-q", *base)
    stats = json.loads((tmp_path / "a.json").read_text())
    assert stats["recipe"] == "eagle3_topk1" and stats["draft_tokens"] > 0
    got = [json.loads(x) for x in a.read_text().splitlines()]
    assert [g["completion"] for g in got] == [json.loads(x)["completion"] for x in b.read_text().splitlines()]
    assert max(len(g["spec"]["accept_histogram"]) for g in got) == 3            # S = 2: 0, 1 or 2 accepted


def test_a_vllm_run_batch_command_line_runs(tiny_model, tmp_path):
    """`vllm run-batch -i IN -o OUT --model M` with its engine flags runs as written: -i and
    --output-file name the files, --max-num-seqs and --enforce-eager are ours under vLLM's names,
    flags asking for nothing else run, a speed knob set its own way here is said, a value no
    engine here can take is one line naming the flag."""
    src = tmp_path / "batch.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": p, "max_tokens": 3, "temperature": 0}} for i, p in enumerate(PROMPTS[:3])]
    del lines[2]["body"]["model"]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "results.jsonl"
    r = ok("run", "-i", src, "--output-file", out, "--model", tiny_model, "--device", "cpu", "--max-num-seqs", 2,
           "--enforce-eager", "--tensor-parallel-size", 1, "--trust-remote-code", "--disable-log-requests",
           "--enable-chunked-prefill", "--max-num-batched-tokens", 4096, "--served-model-name", "served",
           "--output-tmp-dir", tmp_path, "--max-log-len", 10, "--enable-log-requests", "--enable-force-include-usage",
           "--generation-config", "auto", "--max-logprobs", 20, "--response-role", "assistant", "--enable-metrics",
           "--port", 9000, "--tokenizer", tiny_model, "--load-format", "auto", "--block-size", 16, "-q")
    assert "--max-num-batched-tokens 4096 is vLLM's and is not used" in r.output
    assert "--block-size 16 is vLLM's and is not used: KV pages hold 64 tokens on a GPU, 16 on a CPU" in r.output
    assert "--enable-metrics is vLLM's and is not used: no metrics server" in r.output
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == ["r0", "r1", "r2"] and all(x["error"] is None for x in got)
    # the request's name, echoed; the served name where it gives none
    assert [x["response"]["body"]["model"] for x in got] == ["m", "m", "served"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.jsonl", "results.jsonl", "results.jsonl.manifest.json"]
    same = tmp_path / "same.jsonl"
    ok("run", src, "-o", same, "--model", tiny_model, "--device", "cpu", "--batch-size", 2, "--eager", "-q")
    texts = [[c["text"] for c in json.loads(x)["response"]["body"]["choices"]] for x in same.read_text().splitlines()]
    assert texts == [[c["text"] for c in x["response"]["body"]["choices"]] for x in got]
    for flags, expected in ((["--tensor-parallel-size", 2], "--tensor-parallel-size 2: specbatch runs one engine per "
                                                              "GPU, without tensor or pipeline parallelism"),
                            (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: not supported: the KV cache holds"),
                            (["--response-role", "user"], "--response-role user: not supported: chat results' role"),
                            (["--reasoning-parser", "qwen3"], "--reasoning-parser qwen3: not supported: no reasoning "
                                                              "parser"),
                            (["--chat-template", "t.jinja"], "--chat-template t.jinja: no such file (a chat template "
                                                             "is a file's path or the template's own text)"),
                            (["--speculative-config", "{method: eagle3}"], "--speculative-config: expected a JSON "
                                                                           "object, as vLLM's"),
                            (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                             "--speculative-config: method 'ngram' is not supported"),
                            (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "-r",
                              "eagle3_tree"], "--speculative-config and recipe 'eagle3_tree' both choose the "
                                              "algorithm: give one")):
        line = one_line_cli_error(cli("run", "-i", src, "-o", tmp_path / "x.jsonl", "--model", tiny_model,
                                      "--device", "cpu", *flags), 2)
        assert line == f"error: {expected}" or line.startswith(f"error: {expected}"), line
