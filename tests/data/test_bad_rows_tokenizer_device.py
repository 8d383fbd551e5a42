"""Nothing a job is given runs or reads what it should not: a tokenizer that needs model-directory
code is refused without prompting, a model without a tokenizer is named, --device is checked."""
from __future__ import annotations

import builtins
import json
import shutil
import sys

import pytest
import torch

from specbatch.engine import resolve_device

from errors import one_line_model_error


# ---- tokenizer safety ------------------------------------------------------------------------


@pytest.fixture
def no_stdin(monkeypatch):
    read = []

    class Stdin:
        def __getattr__(self, name):
            read.append(name)
            raise AssertionError(f"stdin.{name} used")

    def no_input(*a, **kw):
        read.append("input")
        raise AssertionError("input() called")

    monkeypatch.setattr(sys, "stdin", Stdin())
    monkeypatch.setattr(builtins, "input", no_input)
    return read


def test_tokenizer_with_remote_code_is_refused(tiny_model, tmp_path, no_stdin):
    from specbatch.prompts import load_tokenizer

    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    marker = tmp_path / "MARKER"
    (d / "evil_tokenizer.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    msg = one_line_model_error(lambda: load_tokenizer(d))
    assert msg == (f"{d}: the tokenizer needs Python code from the model directory (auto_map in "
                   "tokenizer_config.json); specbatch never runs model-directory code")
    assert not marker.exists()
    assert no_stdin == []


def test_model_dir_without_tokenizer(tiny_model, tmp_path, no_stdin):
    from specbatch.prompts import load_tokenizer

    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    for f in d.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            f.unlink()
    msg = one_line_model_error(lambda: load_tokenizer(d))
    assert msg == f"{d}: no tokenizer (expected tokenizer.json, tokenizer.model or tokenizer_config.json)"


# ---- --device ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tpu", "mps", "xpu", "cuda:x", "cuda:-1", "cpu "])
def test_unknown_device(name):
    with pytest.raises(ValueError) as ei:
        resolve_device(name)
    shown = name if name.strip() == name else repr(name)
    assert str(ei.value) == f"--device {shown}: expected cpu, cuda or cuda:N"


def test_known_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^--device cuda:1: no CUDA device is available"):
            resolve_device("cuda:1")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(ValueError, match=f"^--device cuda:{n}: this machine has {n} CUDA device"):
            resolve_device(f"cuda:{n}")
