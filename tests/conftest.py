"""Shared fixtures: tiny random checkpoints built once per test session."""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Under pytest-xdist (the README's `-n auto`) the worker processes share the cores: torch's
# default of a thread per core would put workers x cores threads, spin-waiting in OpenMP, on them
# (measured on CI's 2-core box with 2 workers: the suite barely faster than one process, some
# tests 15x slower). One thread a worker (tiny matmuls gain nothing from more; a CPU quota the
# core count does not show cannot oversubscribe it), unless OMP_NUM_THREADS says otherwise. Set
# before torch is imported; the processes tests start inherit it.
XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if XDIST_WORKER and os.environ["OMP_NUM_THREADS"].isdigit():      # torch already imported by a plugin, say
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))

# Without a GPU, Triton kernels run in the interpreter (small-size kernel tests in CI). Set
# before anything imports triton: the mode is fixed when a kernel is decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_checkpoint, make_eagle3_head, make_mtp_layer  # noqa: E402

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


@pytest.fixture(scope="session")
def target_dir(tiny_model_factory):
    """The target the drafter tests draft for: the default tiny Llama with 4 layers (a DeepSeek MTP
    layer then sits at model.layers.4)."""
    return tiny_model_factory("llama3", num_hidden_layers=4)


@pytest.fixture(scope="session")
def eagle3_dir(target_dir, tmp_path_factory):
    """A random EAGLE3 head for `target_dir` (published layout, 200 draft ids); never edited."""
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3"), target_dir)


@pytest.fixture(scope="session")
def mtp_target_dir(tiny_model_factory):
    """A copy of `target_dir` carrying a random DeepSeek-layout MTP layer at model.layers.4."""
    d = tiny_model_factory("llama3", tag="mtp", num_hidden_layers=4)
    make_mtp_layer(d, "deepseek")
    return d


@pytest.fixture(scope="session")
def bigram(tiny_model_factory):
    """A target whose next token depends on the current token only (its layers add nothing),
    carrying an MTP layer that computes exactly the target's next-token logits: every greedy
    draft is right."""
    from safetensors.torch import load_file, save_file

    d = tiny_model_factory("llama3", tag="n2-bigram", num_hidden_layers=4)
    make_mtp_layer(d, "deepseek")
    path = d / "model.safetensors"
    w = load_file(str(path))
    L, H = 4, json.loads((d / "config.json").read_text())["hidden_size"]
    for i in range(L):                          # every layer adds zero: hidden = embedding
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w[f"model.layers.{i}.{name}"].zero_()
    # MTP: eh_proj keeps the normed embedding of the token (the one the target just predicted),
    # the layer adds zero, the final norm is the target's: logits = the target's at that token.
    m = f"model.layers.{L}."
    w[m + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1).contiguous()
    w[m + "enorm.weight"] = torch.ones(H)
    w[m + "self_attn.o_proj.weight"].zero_()
    w[m + "mlp.down_proj.weight"].zero_()
    w[m + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, str(path), metadata={"format": "pt"})
    return d


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int | None:
    """`-n auto`: one worker where CUDA is (the GPU tests share one device and read its free
    memory), else one per usable core up to 4 (the Ray tests start a 4-CPU local cluster, and
    the subprocess tests several processes each); PYTEST_XDIST_AUTO_NUM_WORKERS overrides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None                              # xdist's own hook reads it
    if torch.cuda.is_available():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def pytest_configure(config) -> None:
    # A test file stays in one worker (`-n` alone distributes single tests): module fixtures (the
    # Ray cluster, the resume runs) would run once a worker, and test_ray finds its actors among
    # the machine's processes. Runs before xdist's (trylast) configure reads the mode.
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"


def pytest_collection_modifyitems(config, items):
    """Without CUDA the `gpu` tests are skipped; with it the `interpreter` ones (TRITON_INTERPRET
    is set only without CUDA, and a compiled kernel refuses CPU tensors), whose kernels the `gpu`
    tests run compiled: the README's test command passes on a GPU machine too."""
    if torch.cuda.is_available():
        marker, skip = "interpreter", pytest.mark.skip(reason="Triton interpreter on CPU tensors: runs without CUDA")
    else:
        marker, skip = "gpu", pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
