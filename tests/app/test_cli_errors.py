"""The `specbatch run` CLI's errors, in process, on tiny random models: bad rows reported on their
rows, --fail-fast committing what finished, and usage errors as one line with exit 2 (recipes,
model directories, architectures, input and output files, another job's output, --device)."""
from __future__ import annotations

import json

import pytest
import torch

from specbatch.cli import EXIT_FAILED, EXIT_USAGE
from specbatch.models.config import SUPPORTED_ARCHITECTURES

from cli_helpers import N, PROMPTS, read_out, run_args, write_jsonl
from cli_helpers import broken_models, data_dir, tokenizer  # noqa: F401
from cli_runner import cli, ok
from errors import one_line_cli_error

pytestmark = pytest.mark.usefixtures("one_thread")


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
    assert f"--fail-fast: stopped there; {len(committed)} finished rows are in {out}" in line

    r = ok(*args[:-1])          # not -q: the resume says what it kept
    assert f"resuming: {len(committed)} rows already committed" in r.stderr
    final = read_out(out)
    assert [x["row"] for x in final] == list(range(14))
    assert [x["id"] for x in final] == [x["id"] for x in rows]
    assert [x["row"] for x in final if x["error"]] == [10]
    assert all(isinstance(x["completion"], str) for x in final if x["row"] != 10)


# ---------------------------------------------------------------- run: usage errors


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
    ("bin_only", "holds PyTorch weights (pytorch_model.bin), which specbatch does not load"),
    ("cut", "model.safetensors: cannot read safetensors (") ,
    ("lfs", "model.safetensors: a git-lfs pointer, not the weights"),
    ("a_file", "config.json: is a file, not a model directory"),
    ("two_copies", "a.safetensors and b.safetensors both hold tensor "),
    ("stale", "model-00001-of-00001.safetensors and model.safetensors both hold tensor "),   # (with the index's word)
])
def test_unusable_model_dir(broken_models, data_dir, tmp_path, which, expect):
    """run and inspect (which checks what loading will need, short of reading the tensors: a file
    cut short shows when they are read) say the same one line."""
    model = broken_models[which]
    line = one_line_cli_error(cli(*run_args(model, data_dir / "rows.jsonl", tmp_path / "o.parquet")), EXIT_USAGE)
    assert str(model) in line and expect in line
    if which != "cut":
        assert one_line_cli_error(cli("inspect", "--model", model), EXIT_USAGE) == line


def test_tensors_the_config_has_no_place_for_are_said(tiny_model, data_dir, tmp_path):
    """A checkpoint holding tensors its config.json does not describe (biases under
    attention_bias: false) runs as transformers runs it, without them, and says so."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "biased"
    shutil.copytree(tiny_model, model)
    weights = load_file(str(model / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(q.shape[0])
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    r = ok(*run_args(model, data_dir / "rows.jsonl", tmp_path / "o.parquet"))
    assert "1 tensor in the weights (model.layers.0.self_attn.q_proj.bias) fit no part of the model config.json " \
           "describes; left out, as transformers leaves them" in r.output
    # model.safetensors is what loads (transformers' rule): an old copy or an adapter beside it is not read
    shutil.copy(model / "model.safetensors", model / "model_old.safetensors")
    (model / "consolidated.safetensors").write_bytes(b"not read")
    ok(*run_args(model, data_dir / "rows.jsonl", tmp_path / "q.parquet"))
    assert read_out(tmp_path / "q.parquet") == read_out(tmp_path / "o.parquet")
    ok(*run_args(tiny_model, data_dir / "rows.jsonl", tmp_path / "plain.parquet"))
    assert read_out(tmp_path / "o.parquet") == read_out(tmp_path / "plain.parquet")


def test_a_hub_id_says_nothing_is_downloaded(data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = run_args("meta-llama/Llama-3.1-8B", data_dir / "rows.jsonl", tmp_path / "o.parquet")
    line = one_line_cli_error(cli(*args), EXIT_USAGE)
    assert "meta-llama/Llama-3.1-8B: model directory not found (specbatch loads local directories" in line
    assert "huggingface-cli download meta-llama/Llama-3.1-8B --local-dir DIR" in line


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda(tiny_model, data_dir, tmp_path):
    line = one_line_cli_error(cli("run", data_dir / "rows.jsonl", "--model", tiny_model, "--device", "cuda",
                              "-o", tmp_path / "o.parquet"), EXIT_USAGE)
    assert "--device cuda" in line and "--device cpu" in line


# ---------------------------------------------------------------- error messages


def test_error_message_is_not_rich_markup(tiny_model, tmp_path):
    inp = write_jsonl(tmp_path / "ff.jsonl", [{"prompt": [True]}])
    line = one_line_cli_error(cli(*run_args(tiny_model, inp, tmp_path / "o.parquet", "--fail-fast")), EXIT_FAILED)
    assert "got [true] (--fail-fast: stopped there; 0 finished rows" in line


def test_error_message_with_brackets_in_path(tiny_model, tmp_path):
    missing = tmp_path / "data[/].jsonl"
    line = one_line_cli_error(cli(*run_args(tiny_model, missing, tmp_path / "o.parquet")), EXIT_USAGE)
    assert str(missing) in line
