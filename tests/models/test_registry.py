"""The model registry: a new family is one model class + one registry line (registered here, from
the test), config facts come from the registry, `inspect`'s parameter count is the real one."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from conftest import ARCHS
from specbatch.cli import app
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models import registry
from specbatch.models.config import DecoderConfig, ModelError, load_config
from specbatch.models.llama import MLP, Attention, CausalLM, fuse_projections
from specbatch.models.loader import load_target
from specbatch.models.registry import Family, model_class
from specbatch.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 42, 9], [3], [100, 7, 7, 250, 31, 12, 64, 2, 88]]
MAX_NEW = 10


# ---------------------------------------------------------------- a toy family, defined here


class ToyMoE(MLP):
    """A dense mixture of two expert MLPs under a softmax router: an MLP block with no
    gate_proj / up_proj of its own (fuse_projections must leave it alone and fuse the experts)."""

    def __init__(self, cfg: DecoderConfig):
        nn.Module.__init__(self)
        self.gate = nn.Linear(cfg.hidden_size, 2, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(2))
        self.gate_up = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(x).float(), dim=-1).to(x.dtype)
        return sum(w[..., e, None] * expert(x) for e, expert in enumerate(self.experts))


class ToyMoECausalLM(CausalLM):
    """The whole model file of the toy family: Llama with ToyMoE blocks."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        for layer in self.model.layers:
            layer.mlp = ToyMoE(cfg)


def _relabel(src, dst, arch: str):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def _moe_checkpoint(llama_dir, dst, arch: str):
    """The Llama checkpoint with each MLP as two identical experts under a zero router: weights
    exactly 1/2 each, so the toy's output is the Llama model's, bit for bit."""
    _relabel(llama_dir, dst, arch)
    tensors = load_file(str(dst / "model.safetensors"))
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.(\w+_proj\.weight)", name)
        if m is None:
            out[name] = t
            continue
        for e in range(2):
            out[f"{m[1]}.experts.{e}.{m[2]}"] = t.clone()
        out[f"{m[1]}.gate.weight"] = torch.zeros(2, hidden)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _generate(model_dir) -> list[list[int]]:
    eng = Engine(model_dir, EngineOptions(batch_size=2, device="cpu", dtype="float32"))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(PROMPTS)]
    recs = sorted(eng.generate(rows, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)),
                  key=lambda r: r["row"])
    assert [r["error"] for r in recs] == [None] * len(PROMPTS)
    return [r["output_token_ids"] for r in recs]


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())       # shared (tied) tensors once


# ---------------------------------------------------------------- new families


def test_new_family_is_one_class_and_one_registry_line(tiny_model_factory, tmp_path):
    base = tiny_model_factory("llama")
    d = _moe_checkpoint(base, tmp_path / "toy_moe", "ToyMoEForCausalLM")
    with pytest.raises(ModelError, match="unsupported architecture 'ToyMoEForCausalLM'"):
        load_config(d)
    registry.register("ToyMoEForCausalLM", Family(__name__, "ToyMoECausalLM"))
    try:
        cfg, _ = load_config(d)
        model, _ = load_target(d, "float32", "cpu")
        assert type(model) is ToyMoECausalLM
        assert all(isinstance(layer.mlp, ToyMoE) for layer in model.model.layers)
        expert = model.model.layers[0].mlp.experts[1]
        assert torch.equal(expert.up_proj.weight, load_file(str(d / "model.safetensors"))[
            "model.layers.0.mlp.experts.1.up_proj.weight"])

        fuse_projections(model)         # the MoE block is skipped, its experts and attention fused
        layer = model.model.layers[0]
        assert layer.mlp.gate_up is None and layer.mlp.experts[0].gate_up is not None
        assert layer.self_attn.qkv is not None

        n = _numel(model)
        assert model_class(cfg.architecture).num_parameters(cfg) == n
        assert n > _numel(load_target(base, "float32", "cpu")[0])     # the dense formula would miss it
        r = CliRunner().invoke(app, ["inspect", "--model", str(d)])
        assert r.exit_code == 0, r.output
        assert "ToyMoEForCausalLM" in r.stdout and f"{n / 1e6:.1f} M" in r.stdout

        assert _generate(d) == _generate(base)          # through the engine: the Llama output exactly
    finally:
        registry.unregister("ToyMoEForCausalLM")
    assert "ToyMoEForCausalLM" not in registry.supported()
    with pytest.raises(ModelError, match="unsupported architecture 'ToyMoEForCausalLM'"):
        load_config(d)


def test_dense_family_takes_its_config_facts_from_the_registry(tiny_model_factory, tmp_path):
    """Llama's class with Qwen3's facts (q/k norm) runs a relabelled Qwen3 checkpoint exactly as
    Qwen3; without the fact the q/k norms would be left out."""
    base = tiny_model_factory("qwen3")
    d = _relabel(base, tmp_path / "toy", "ToyForCausalLM")
    registry.register("ToyForCausalLM", Family(".llama", "CausalLM", qk_norm=True,
                                               sliding_window="unsupported"))
    try:
        with pytest.raises(ValueError, match="already registered"):
            registry.register("ToyForCausalLM", Family(".llama", "CausalLM"))
        cfg, _ = load_config(d)
        assert cfg.qk_norm and cfg.head_dim == 24 and cfg.architecture == "ToyForCausalLM"
        assert _generate(d) == _generate(base)
        line = str(_config_error({"architectures": ["Nope"]}))
        assert "ToyForCausalLM" in line and "Qwen3ForCausalLM" in line
    finally:
        registry.unregister("ToyForCausalLM")
    assert "ToyForCausalLM" not in str(_config_error({"architectures": ["Nope"]}))


@pytest.mark.parametrize("arch, kw", [*((a, {}) for a in ARCHS), ("llama", {"tie": True})],
                         ids=[*ARCHS, "llama-tied"])
def test_inspect_parameter_count_is_the_real_one(tiny_model_factory, arch, kw):
    d = tiny_model_factory(arch, **kw)
    cfg, _ = load_config(d)
    model, _ = load_target(d, "float32", "cpu")
    assert model_class(cfg.architecture).num_parameters(cfg) == _numel(model)


# ---------------------------------------------------------------- the table itself


BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, sliding_window=64)


def _config_error(d: dict) -> ModelError:
    with pytest.raises(ModelError) as e:
        DecoderConfig.from_dict({**BASE, **d})
    return e.value


@pytest.mark.parametrize("arch, bias, expect", [
    # (qkv_bias, o_bias, qk_norm, sliding_window): what config.py's per-architecture ifs gave
    ("LlamaForCausalLM", False, (False, False, False, None)),
    ("LlamaForCausalLM", True, (True, True, False, None)),
    ("MistralForCausalLM", False, (False, False, False, 64)),
    ("MistralForCausalLM", True, (True, True, False, 64)),
    ("Qwen2ForCausalLM", False, (True, False, False, None)),
    ("Qwen2ForCausalLM", True, (True, False, False, None)),
    ("Qwen3ForCausalLM", False, (False, False, True, None)),
    ("Qwen3ForCausalLM", True, (True, True, True, None)),
])
def test_builtin_family_facts(arch, bias, expect):
    c = DecoderConfig.from_dict({**BASE, "architectures": [arch], "attention_bias": bias})
    assert (c.qkv_bias, c.o_bias, c.qk_norm, c.sliding_window) == expect
    assert model_class(arch) is CausalLM


def test_unsupported_things_are_named():
    line = str(_config_error({"architectures": ["GPT2LMHeadModel"]}))
    assert "'GPT2LMHeadModel'" in line and all(a in line for a in registry.supported())
    assert "ToyForCausalLM" not in line
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert "use_sliding_window" in str(_config_error({"architectures": [arch], "use_sliding_window": True}))
    DecoderConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "use_sliding_window": True})
    line = str(_config_error({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn"}}))
    assert "'yarn'" in line and "default, linear, llama3" in line
    with pytest.raises(ValueError, match="sliding_window"):
        Family(".llama", "CausalLM", sliding_window="sometimes")


def test_fuse_projections_skips_what_it_does_not_know():
    cfg = DecoderConfig.from_dict({**BASE, "architectures": ["LlamaForCausalLM"]})
    block = nn.ModuleDict({"attn": Attention(cfg), "moe": ToyMoE(cfg), "other": nn.Linear(4, 4)})
    fuse_projections(block)
    assert block["attn"].qkv is not None and block["moe"].gate_up is None
    assert all(e.gate_up is not None for e in block["moe"].experts)
    x = torch.randn(2, 3, cfg.hidden_size)
    assert block["moe"](x).shape == x.shape
