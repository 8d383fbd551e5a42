"""Shared by the CLI tests (tests/app/test_cli_*.py): the prompts and output columns, JSONL / Parquet
in and out, `run` arguments for a tiny model, and module fixtures: the input rows in both formats, the
tiny model's tokenizer, model directories broken in each way the CLI names. Test modules import the
fixtures they use."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


BASE_COLUMNS = ["row", "id", "completion", "prompt_tokens", "completion_tokens", "finish_reason", "stop_reason", "error",
                "spec"]
SPEC_FIELDS = ["verify_steps", "draft_tokens", "accepted_tokens", "accept_length", "accept_histogram"]
PROMPTS = [
    "def add(a, b):", "for i in range(10):", "class Point:", "import os", "The quick brown fox",
    "while True:", "print(i * i)", "Hello world!", "return a + b", "self.x = x", "if not line:",
    "import sys",
]
N = len(PROMPTS)


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
    bin_only = copy("bin_only", lambda n: n.endswith(".safetensors"))
    (bin_only / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a pickled state dict")
    cut = copy("cut", lambda n: False)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])            # a download cut short
    lfs = copy("lfs", lambda n: False)
    (lfs / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 99\n")
    two_copies = copy("two_copies", lambda n: n == "model.safetensors")     # weights under names of one's own
    shutil.copy(src / "model.safetensors", two_copies / "a.safetensors")
    shutil.copy(src / "model.safetensors", two_copies / "b.safetensors")
    stale = copy("stale", lambda n: False)                       # a stale single file beside the shards
    shutil.copy(stale / "model.safetensors", stale / "model-00001-of-00001.safetensors")
    from safetensors import safe_open
    with safe_open(str(stale / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (stale / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    return {"no_config": no_config, "gpt2": gpt2, "no_weights": no_weights, "missing": root / "missing",
            "bin_only": bin_only, "cut": cut, "lfs": lfs, "a_file": gpt2 / "config.json", "two_copies": two_copies,
            "stale": stale}
