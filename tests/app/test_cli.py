"""The `specbatch` CLI end to end, in process, through typer's CliRunner on tiny random models."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

from specbatch.cli import EXIT_FAILED, EXIT_USAGE, app
from specbatch.models.config import SUPPORTED_ARCHITECTURES
from specbatch.recipe import load_recipe

from cli_runner import cli, ok
from errors import one_line_cli_error

BASE_COLUMNS = ["row", "id", "completion", "prompt_tokens", "completion_tokens", "finish_reason", "error",
                "spec"]
SPEC_FIELDS = ["verify_steps", "draft_tokens", "accepted_tokens", "accept_length", "accept_histogram"]
PROMPTS = [
    "def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox",
    "while True:", "print(i * i)", "Hello world!", "return a + b", "self.x = x", "if not line:",
    "import sys",
]
N = len(PROMPTS)


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- helpers


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def read_out(path: Path) -> list[dict]:
    if str(path).endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def out_columns(path: Path) -> list[str]:
    if str(path).endswith(".parquet"):
        return pq.read_schema(path).names
    cols = {tuple(json.loads(line)) for line in open(path, encoding="utf-8") if line.strip()}
    assert len(cols) == 1, cols
    return list(cols.pop())


def base_rows() -> list[dict]:
    return [{"id": f"r{i}", "prompt": p, "a": i * 10, "b": f"b{i}"} for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    rows = base_rows()
    write_jsonl(d / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), d / "rows.parquet")
    return d


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def run_args(tiny_model, inp, out, *extra):
    return ["run", inp, "--model", tiny_model, "--max-tokens", 8, "--device", "cpu", "-o", out, "-q", *extra]


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
        assert tokenizer.decode(r["output_token_ids"], skip_special_tokens=True) == r["completion"]
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


# ---------------------------------------------------------------- run: bad rows


def test_bad_rows_are_reported_on_their_rows(tiny_model, tmp_path, tokenizer):
    inp = tmp_path / "mixed.jsonl"
    long_prompt = " ".join(PROMPTS)
    lines = [
        json.dumps({"id": "good0", "prompt": "def add"}),                    # line 1, row 0
        '{"id": "broken", "prompt": "x"',                                     # line 2, row 1
        "",                                                                   # line 3: blank, skipped
        json.dumps({"id": "noprompt", "text": "hello"}),                      # line 4, row 2
        json.dumps({"id": "good3", "prompt": "import os"}),                   # line 5, row 3
        json.dumps({"id": "badtype", "prompt": "hi", "max_tokens": "ten"}),   # line 6, row 4
        json.dumps({"id": "notstr", "prompt": 5}),                            # line 7, row 5
        json.dumps({"id": "empty", "prompt": "   "}),                         # line 8, row 6
        None,                                                                 # line 9, row 7: bad UTF-8
        json.dumps({"id": "long", "prompt": long_prompt}),                    # line 10, row 8
        json.dumps({"id": "good9", "prompt": "class Point:"}),                # line 11, row 9
    ]
    with open(inp, "wb") as f:
        for line in lines:
            f.write(b'{"id": "utf", "prompt": "caf\xe9 \xff"}\n' if line is None else line.encode() + b"\n")
    assert len(tokenizer(long_prompt)["input_ids"]) >= 16
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    ok("run", inp, "--model", tiny_model, "--max-tokens", 4, "--device", "cpu", "--max-model-len", 16,
       "-o", out, "--stats-json", stats, "-q")
    rows = read_out(out)
    assert [r["row"] for r in rows] == list(range(10))
    errors = {r["row"]: r["error"] for r in rows if r["error"] is not None}
    assert sorted(errors) == [1, 2, 4, 5, 6, 7, 8]
    p = str(inp)
    assert errors[1].startswith(f"{p}:2: malformed JSON")
    assert errors[2].startswith(f"{p}:4: ") and "'prompt'" in errors[2]
    assert errors[4].startswith(f"{p}:6: ") and "'max_tokens'" in errors[4] and '"ten"' in errors[4]
    assert errors[5].startswith(f"{p}:7: ") and "'prompt'" in errors[5]
    assert errors[6].startswith(f"{p}:8: ") and "'prompt'" in errors[6] and "non-empty" in errors[6]
    assert errors[7].startswith(f"{p}:9: ") and "UTF-8" in errors[7]
    assert errors[8].startswith(f"{p}:10: ") and "context is 16 tokens" in errors[8]
    assert all("\n" not in e for e in errors.values())
    by_row = {r["row"]: r for r in rows}
    for i in (1, 2, 4, 5, 6, 7, 8):
        r = by_row[i]
        assert r["completion"] is None and r["completion_tokens"] == 0 and r["spec"] is None
    assert by_row[8]["id"] == "long" and by_row[4]["id"] == "badtype"
    for i, rid in ((0, "good0"), (3, "good3"), (9, "good9")):
        r = by_row[i]
        assert r["id"] == rid and r["error"] is None and isinstance(r["completion"], str)
        assert 1 <= r["completion_tokens"] <= 4
    s = json.loads(stats.read_text())
    assert s["requests"] == 10 and s["errors"] == 7
    assert s["completion_tokens"] == sum(r["completion_tokens"] for r in rows)


def test_fail_fast_commits_finished_rows_and_resumes(tiny_model, tmp_path):
    rows = [{"id": f"g{i}", "prompt": PROMPTS[i % N]} for i in range(14)]
    rows[10] = {"id": "bad", "prompt": "x", "temperature": "hot"}
    inp = write_jsonl(tmp_path / "ff.jsonl", rows)
    out = tmp_path / "ff.parquet"
    args = ["run", inp, "--model", tiny_model, "--max-tokens", 6, "--batch-size", 2, "--device", "cpu",
            "-o", out, "-q"]
    line = one_line_cli_error(cli(*args, "--fail-fast"), EXIT_FAILED)
    assert f"{inp}:11" in line and "'temperature'" in line
    # what finished before the bad row is assembled into the output
    assert not (tmp_path / "ff.parquet.parts").exists()
    committed = [x["row"] for x in read_out(out)]
    assert committed and set(committed) <= set(range(10)) and committed == sorted(committed)

    r = ok(*args[:-1])          # not -q: the resume says what it kept
    assert f"resuming: {len(committed)} rows already committed" in r.stderr
    final = read_out(out)
    assert [x["row"] for x in final] == list(range(14))
    assert [x["id"] for x in final] == [x["id"] for x in rows]
    assert [x["row"] for x in final if x["error"]] == [10]
    assert all(isinstance(x["completion"], str) for x in final if x["row"] != 10)


# ---------------------------------------------------------------- run: usage errors


@pytest.fixture(scope="module")
def broken_models(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken_models")
    src = Path(tiny_model)

    def copy(name: str, skip) -> Path:
        d = root / name
        d.mkdir()
        for f in src.iterdir():
            if not skip(f.name):
                shutil.copy(f, d / f.name)
        return d

    no_config = copy("no_config", lambda n: n == "config.json")
    gpt2 = copy("gpt2", lambda n: False)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    no_weights = copy("no_weights", lambda n: n.endswith(".safetensors"))
    assert (no_weights / "config.json").is_file()
    return {"no_config": no_config, "gpt2": gpt2, "no_weights": no_weights, "missing": root / "missing"}


def test_unknown_recipe(data_dir, tmp_path):
    line = one_line_cli_error(cli("run", data_dir / "rows.jsonl", "-r", "nope", "-o", tmp_path / "o.parquet"),
                          EXIT_USAGE)
    assert "unknown recipe 'nope'" in line and "vanilla" in line


def test_unknown_key_in_recipe_file(tiny_model, data_dir, tmp_path):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(f"algorithm: vanilla\nmodel: {tiny_model}\nbatchsize: 4\n")
    line = one_line_cli_error(cli("run", data_dir / "rows.jsonl", "-r", recipe, "-o", tmp_path / "o.parquet"),
                          EXIT_USAGE)
    assert str(recipe) in line and "'batchsize'" in line and "batch_size" in line


@pytest.mark.parametrize("which, expect", [
    ("missing", "model directory not found"),
    ("no_config", "no config.json"),
    ("no_weights", "no *.safetensors"),
])
def test_unusable_model_dir(broken_models, data_dir, tmp_path, which, expect):
    model = broken_models[which]
    line = one_line_cli_error(cli(*run_args(model, data_dir / "rows.jsonl", tmp_path / "o.parquet")), EXIT_USAGE)
    assert str(model) in line and expect in line


def test_unsupported_architecture(broken_models, data_dir, tmp_path):
    line = one_line_cli_error(cli(*run_args(broken_models["gpt2"], data_dir / "rows.jsonl", tmp_path / "o.parquet")),
                          EXIT_USAGE)
    assert "GPT2LMHeadModel" in line and str(broken_models["gpt2"] / "config.json") in line
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in line


def test_bad_input_files(tiny_model, tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all\n" * 10)
    line = one_line_cli_error(cli(*run_args(tiny_model, garbage, tmp_path / "o1.parquet")), EXIT_USAGE)
    assert str(garbage) in line and "Parquet" in line

    missing = tmp_path / "missing.jsonl"
    line = one_line_cli_error(cli(*run_args(tiny_model, missing, tmp_path / "o2.parquet")), EXIT_USAGE)
    assert str(missing) in line and "no such file" in line

    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\nhello\n")
    line = one_line_cli_error(cli(*run_args(tiny_model, csv, tmp_path / "o3.parquet")), EXIT_USAGE)
    assert str(csv) in line and ".jsonl" in line and ".parquet" in line


def test_unknown_output_extension(tiny_model, data_dir, tmp_path):
    out = tmp_path / "o.csv"
    line = one_line_cli_error(cli(*run_args(tiny_model, data_dir / "rows.jsonl", out)), EXIT_USAGE)
    assert str(out) in line and ".parquet" in line
    assert not out.exists()


def test_output_from_a_different_job(tiny_model, tmp_path):
    """An output left by a stopped run of the same input and model with another --max-tokens is
    refused (naming the setting), left alone, and the original command still completes it."""
    rows = [{"id": f"g{i}", "prompt": PROMPTS[i % N]} for i in range(12)]
    rows[10] = {"id": "bad", "prompt": ""}
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "o.parquet"
    base = ["run", inp, "--model", tiny_model, "--batch-size", 2, "--device", "cpu", "-o", out, "-q"]
    one_line_cli_error(cli(*base, "--max-tokens", 4, "--fail-fast"), EXIT_FAILED)
    before = out.read_bytes()

    line = one_line_cli_error(cli(*base, "--max-tokens", 5), EXIT_USAGE)
    assert str(out) in line and "different job" in line and "--overwrite" in line
    assert "sampling.max_tokens: 4 -> 5" in line
    assert out.read_bytes() == before

    ok(*base, "--max-tokens", 4)
    assert [r["row"] for r in read_out(out)] == list(range(12))


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda(tiny_model, data_dir, tmp_path):
    line = one_line_cli_error(cli("run", data_dir / "rows.jsonl", "--model", tiny_model, "--device", "cuda",
                              "-o", tmp_path / "o.parquet"), EXIT_USAGE)
    assert "--device cuda" in line and "--device cpu" in line


# ---------------------------------------------------------------- other row forms


def test_messages_and_openai_batch_rows(tiny_model, tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    rows = [
        {"id": "chat-1", "messages": messages},
        {"custom_id": "req-7", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "whatever", "messages": messages, "max_tokens": 3}},
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


# ---------------------------------------------------------------- recipes / inspect


def test_recipes_lists_vanilla():
    r = ok("recipes")
    assert re.search(r"\bvanilla\b", r.stdout)


def test_recipes_prints_yaml():
    r = ok("recipes", "vanilla")
    data = yaml.safe_load(r.stdout)
    assert data == load_recipe("vanilla").to_dict()
    assert data["name"] == "vanilla" and data["algorithm"] == "vanilla"
    shipped = Path(__file__).resolve().parents[2] / "specbatch" / "recipes" / "vanilla.yaml"
    assert data == yaml.safe_load(shipped.read_text())


def test_recipes_unknown():
    line = one_line_cli_error(cli("recipes", "nope"), EXIT_USAGE)
    assert "unknown recipe 'nope'" in line


@pytest.mark.parametrize("arch, name", [("llama3", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_inspect(tiny_model_factory, arch, name):
    r = ok("inspect", "--model", tiny_model_factory(arch))
    assert name in r.stdout
    assert re.search(r"layers\s*│\s*3\b", r.stdout)


def test_inspect_bad_model(broken_models):
    line = one_line_cli_error(cli("inspect", "--model", broken_models["gpt2"]), EXIT_USAGE)
    assert "GPT2LMHeadModel" in line


# ---------------------------------------------------------------- known bugs


def test_error_message_is_not_rich_markup(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "ff.jsonl", [{"prompt": [True]}])
    line = one_line_cli_error(cli(*run_args(tiny_model, inp, tmp_path / "o.parquet", "--fail-fast")), EXIT_FAILED)
    assert line.endswith("got [true]")


def test_error_message_with_brackets_in_path(tiny_model, tmp_path):
    missing = tmp_path / "data[/].jsonl"
    line = one_line_cli_error(cli(*run_args(tiny_model, missing, tmp_path / "o.parquet")), EXIT_USAGE)
    assert str(missing) in line


def test_rerun_without_limit_completes_the_rest(tiny_model, data_dir, tmp_path):
    out = tmp_path / "lim.parquet"
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out, "--limit", 3))
    assert len(read_out(out)) == 3
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", out))
    assert [r["row"] for r in read_out(out)] == list(range(N))


def test_inspect_shows_the_resolved_draft(tiny_model):
    from specbatch.job import DEMO_DIR

    r = ok("inspect", "--recipe", "eagle3_tree")
    flat = "".join(line.strip("│ ").split("│")[-1].strip() for line in r.output.splitlines())
    assert str(DEMO_DIR / "eagle3") in flat, r.output
    one_line_cli_error(cli("inspect", "--recipe", "eagle3_topk1", "--model", str(tiny_model)), EXIT_USAGE)
    r = ok("inspect", "--recipe", "eagle3_topk1", "--model", str(tiny_model), "--draft", "/some/head")
    assert "/some/head" in r.output
