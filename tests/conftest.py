"""Shared fixtures: tiny random checkpoints built once per test session."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

# Without a GPU, Triton kernels run in the interpreter (small-size kernel tests in CI). Set
# before anything imports triton: the mode is fixed when a kernel is decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_checkpoint  # noqa: E402

ARCHS = ("llama3", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster and immune to other processes competing for the cores
    (a second thread only adds OpenMP waits on a busy 2-core box). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """tiny_model_factory(arch, tag=None, **kw) -> directory of a random HF checkpoint, cached per
    arguments; a distinct `tag` gives a private copy a test may edit."""
    cache: dict = {}

    def make(arch: str = "llama3", tag: str | None = None, **kw):
        key = (arch, tag, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}")
            cache[key] = make_checkpoint(arch, d, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory):
    """The default tiny model: Llama with llama3 RoPE scaling, float32, EOS id 0."""
    return tiny_model_factory("llama3")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
