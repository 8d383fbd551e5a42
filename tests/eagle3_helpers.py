"""Shared by the EAGLE3 head tests (tests/models/test_eagle3_loading.py, test_eagle3_load_errors.py,
tests/speculative/test_eagle3_drafter.py): the 4-layer tiny target loaded, a reduced-vocabulary head
in the published layout, small file edits, and the head written out by hand from its tensors (`Ref`).
Test modules import the fixtures they use (`target_dir` itself comes from tests/conftest.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specbatch.models.attention import AttnMetadata
from specbatch.models.eagle3 import load_eagle3
from specbatch.models.loader import load_target
from tiny_models import make_eagle3_head

CPU = torch.device("cpu")
V = 320          # tiny targets' vocabulary
H = 64           # tiny targets' hidden size


# ---- fixtures and helpers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def target(target_dir):
    model, _ = load_target(target_dir, "float32", "cpu")
    return model


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_dir):
    """A reduced-vocabulary head (200 draft ids) in the published layout; never edited."""
    return make_eagle3_head(tmp_path_factory.mktemp("head"), target_dir, draft_vocab=200, seed=1)


@pytest.fixture(scope="module")
def head(head_dir, target):
    return load_eagle3(head_dir, target.cfg, target.model.embed_tokens, torch.float32, CPU)


def load_head(d, target, dtype=torch.float32):
    return load_eagle3(d, target.cfg, target.model.embed_tokens, dtype, CPU)


def weights(d) -> dict[str, torch.Tensor]:
    return load_file(str(Path(d) / "model.safetensors"))


def save_weights(d, w):
    save_file({k: v.contiguous() for k, v in w.items()}, str(Path(d) / "model.safetensors"))


def edit_config(d, **kv):
    p = Path(d) / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(kv)
    p.write_text(json.dumps(cfg))


def copy_dir(src, tmp_path, name="edited") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def causal_meta(slots, T, prefix=None):
    B = slots.shape[0]
    prefix = torch.zeros(B, dtype=torch.int64) if prefix is None else prefix
    return AttnMetadata(slots=slots, positions=prefix[:, None] + torch.arange(T),
                        prefix_lens=prefix, kv_len=int(prefix.max()) + T)


# ---- the plain reference (tensors straight from the file) ------------------------------------

class Ref:
    """The EAGLE3 head written out by hand from the file's tensors (float32, one sequence)."""

    def __init__(self, head_dir, embed_weight: torch.Tensor):
        self.w = {k[len("model."):] if k.startswith("model.") else k: v.float()
                  for k, v in weights(head_dir).items()}
        cfg = json.loads((Path(head_dir) / "config.json").read_text())
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.H = cfg["hidden_size"]
        self.d = self.H // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg["rope_theta"]
        self.emb = self.w.get("embed_tokens.weight", embed_weight.float())
        vd = self.w["lm_head.weight"].shape[0]
        self.d2t = self.w["d2t"].long() if "d2t" in self.w else torch.zeros(vd, dtype=torch.int64)

    def rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def lin(self, x, name):
        y = x @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    def rope(self, x, pos):              # x [T, n, d], pos [T]
        d = self.d
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = pos[:, None].float() * inv
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    def layer(self, tokens, hidden, features, pos, past_k=None, past_v=None, mask=None):
        """tokens [T], hidden [T, 3H_t] or [T, H], pos [T]; attends to past rows + the new rows
        (mask [T, P+T], default causal over the new rows). -> (pre-norm h [T, H], k, v)."""
        T = tokens.shape[0]
        h = self.lin(hidden, "fc") if features else hidden
        x = torch.cat([self.rms(self.emb[tokens], "midlayer.input_layernorm.weight"),
                       self.rms(h, "midlayer.hidden_norm.weight")], -1)
        a = "midlayer.self_attn."
        q = self.rope(self.lin(x, a + "q_proj").view(T, self.heads, self.d), pos)
        k = self.rope(self.lin(x, a + "k_proj").view(T, self.kv_heads, self.d), pos)
        v = self.lin(x, a + "v_proj").view(T, self.kv_heads, self.d)
        P = 0 if past_k is None else past_k.shape[0]
        keys = k if past_k is None else torch.cat([past_k, k])
        vals = v if past_v is None else torch.cat([past_v, v])
        if mask is None:
            mask = torch.cat([torch.ones(T, P, dtype=torch.bool),
                              torch.ones(T, T, dtype=torch.bool).tril()], 1)
        g = self.heads // self.kv_heads
        kk, vv = keys.repeat_interleave(g, 1), vals.repeat_interleave(g, 1)
        s = torch.einsum("thd,shd->hts", q, kk) * self.d ** -0.5
        s = s.masked_fill(~mask[None], float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), vv).reshape(T, -1)
        h = h + self.lin(o, a + "o_proj")
        m = "midlayer.mlp."
        y = self.rms(h, "midlayer.post_attention_layernorm.weight")
        y = self.lin(torch.nn.functional.silu(self.lin(y, m + "gate_proj")) * self.lin(y, m + "up_proj"),
                     m + "down_proj")
        return h + y, k, v

    def logits(self, h):
        return self.lin(self.rms(h, "norm.weight"), "lm_head")

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]
