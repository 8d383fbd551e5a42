"""NextN/MTP layer training: the training-time-test forward reproduces LayerDrafter's inference
path row by row (catch-up and chain draft steps through the real KV cache, fed the engine's
final-normed hidden state), the frozen target's MTP features are the engine's, the init copies the
target's last layer, the loss falls, and the saved layer loads with load_mtp and drafts losslessly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import test_train_eagle3 as e3
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.attention import AttnMetadata
from specbatch.models.config import load_config
from specbatch.models.loader import load_target
from specbatch.models.mtp import load_mtp
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.factory import SpecConfig
from specbatch.speculative.layer_drafter import LayerDrafter
from specbatch.train.frozen import FrozenTarget
from specbatch.train.mtp import build_mtp, train_mtp
from specbatch.train.ttt import ttt_forward

V = e3.V
target_dir = e3.target_dir          # the tiny 4-layer llama3 target (module fixture)
tokens_dir = e3.tokens_dir          # its tokenized corpus: ~12k train tokens (module fixture)


@pytest.fixture(scope="module")
def trained(target_dir, tokens_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp")
    lines: list[str] = []
    m = train_mtp(target_dir, tokens_dir, out, ttt_steps=3, seq_len=64, batch_size=8, steps=40,
                  lr=3e-3, warmup=5, eval_every=20, device="cpu", log=lines.append, eval_windows=16)
    return out, m, lines


def _random_mtp(target_dir, seed=0):
    """An MTP layer with random (not init-shaped) weights, norms included, so a wrong norm, shift
    or mask anywhere changes the outputs."""
    tcfg, _ = load_config(target_dir)
    layer = build_mtp(tcfg, init="default")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:                                   # fan-in scaled: activations stay O(1)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer.eval()


# ---- (1) training forward == inference path ---------------------------------------------------

def test_ttt_forward_matches_drafter_inference(target_dir):
    """Catch-up at the last committed row (step 0) and a chain draft of depth S (steps 1..S-1)
    through LayerDrafter + its KV cache, fed the engine's final-normed hidden state, equal the
    training forward at (row L-1+j, step j) on the window prefix + first token + drafted tokens."""
    S = 4
    target, _ = load_target(target_dir, "float32", "cpu")
    layer = _random_mtp(target_dir).attach(target)          # what load_mtp does for the engine
    lens = [9, 17]
    B, T = len(lens), max(lens)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(1, V, (B, T + 1), generator=g)
    ids = seqs[:, :T].clone()
    for b, n in enumerate(lens):
        ids[b, n:] = 0
    first = seqs[torch.arange(B), torch.tensor(lens)]       # x_L: the token the target emitted

    # inference: the engine's prefill (hidden, as it hands an MTP drafter), catch-up and proposal
    slots = torch.arange(B)
    kv = KVCache(target.cfg, B, 64, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slots=slots, positions=torch.arange(T).expand(B, T),
                        prefix_lens=torch.zeros(B, dtype=torch.int64), kv_len=T)
    with torch.no_grad():
        normed, _ = target(ids, meta, kv.layers)
    drafter = LayerDrafter(layer, (), num_steps=S, topk=1, num_draft_tokens=S + 1, num_slots=B, max_len=64)
    assert drafter.reads_final_hidden
    outs: list[torch.Tensor] = []
    hook = layer.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    with torch.no_grad():
        drafter.prefill(slots, ids, torch.tensor(lens), [normed], first)
        prop = drafter.propose(slots, first, torch.tensor(lens))
    hook.remove()
    assert len(outs) == S and all(o.shape == (B, 1, target.cfg.hidden_size) for o in outs)

    # training: one window per sequence, 5 unrelated tokens past the draft (must not leak back);
    # exact with the engine's hidden states for the committed rows, close with the trainer's own
    ft = FrozenTarget(target_dir, (), torch.device("cpu"))
    for b, L in enumerate(lens):
        window = torch.cat([seqs[b, : L + 1], prop.tokens[b, 1:S], torch.randint(1, V, (5,), generator=g)])
        with torch.no_grad():
            hidden, _ = ft(window[None])
            engine_hidden = hidden.clone()
            engine_hidden[:, :L] = normed[b, :L]
            for feats, atol in ((engine_hidden, 1e-5), (hidden, 1e-4)):
                hs = ttt_forward(layer, ft.embed_weight, window[None, 1:], feats[:, :-1], S)
                for j in range(S):
                    row = L - 1 + j
                    torch.testing.assert_close(hs[j][0, row], outs[j][b, 0], rtol=0, atol=atol)
                    # the drafted token at depth j+1 is this row's top-1 (full vocabulary)
                    assert int(layer.logits(hs[j][0, row]).argmax()) == int(prop.tokens[b, j + 1])


def test_features_are_the_engines_hidden(target_dir):
    """With no aux layers the frozen target gives the final-normed hidden state (the lm_head's
    input) and lm_head of it: the engine's `hidden` and logits."""
    target, _ = load_target(target_dir, "float32", "cpu")
    ft = FrozenTarget(target_dir, (), torch.device("cpu"))
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    kv = KVCache(target.cfg, 2, 16, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slots=torch.arange(2), positions=torch.arange(12).expand(2, 12),
                        prefix_lens=torch.zeros(2, dtype=torch.int64), kv_len=12)
    with torch.no_grad():
        normed, _ = target(ids, meta, kv.layers)
        hidden, logits = ft(ids)
        full = ft.model(input_ids=ids).logits
    torch.testing.assert_close(hidden, normed, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, target.logits(normed), rtol=0, atol=1e-4)
    torch.testing.assert_close(logits, full, rtol=0, atol=0)


def test_init_from_target_last_layer(target_dir):
    tcfg, _ = load_config(target_dir)
    ft = FrozenTarget(target_dir, (), torch.device("cpu"))
    layer = build_mtp(tcfg, ft, init="target")
    dec = ft.model.get_decoder()
    last = dec.layers[-1].state_dict()
    own = layer.state_dict()
    assert all(torch.equal(own[k], v) for k, v in last.items())
    assert torch.equal(layer.shared_head.norm.weight, dec.norm.weight)
    H = tcfg.hidden_size
    assert torch.equal(layer.enorm.weight, torch.ones(H)) and torch.equal(layer.hnorm.weight, torch.ones(H))
    with pytest.raises(ValueError, match="init 'nope'"):
        build_mtp(tcfg, ft, init="nope")


# ---- (2) training, saving, loading, drafting --------------------------------------------------

def test_loss_falls_and_log(trained):
    out, m, lines = trained
    log = json.loads((out / "train_log.json").read_text())
    evals = log["eval_history"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["loss"] < 0.9 * evals[0]["loss"]
    assert evals[-1]["agree"][0] > evals[0]["agree"][0]
    assert log["train_history"][-1]["loss"] < log["train_history"][0]["loss"]
    assert m["best_eval_loss"] == min(e["loss"] for e in evals)
    assert len(m["eval_agree"]) == 3 and all(0 <= a <= 1 for a in m["eval_agree"])
    assert m["eval_in_vocab"] == 1 and m["eval_agree_in_vocab"] == m["eval_agree"]    # full vocab
    assert m["init"] == "target" and m["config"]["ttt_steps"] == 3
    assert m["params"] > 0 and m["bytes"] == (out / "model.safetensors").stat().st_size
    assert any(line.startswith("eval step 40") for line in lines)


def test_saved_layout(trained, target_dir):
    out, _, _ = trained
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    names = {"enorm", "hnorm", "eh_proj", "input_layernorm", "post_attention_layernorm",
             "shared_head.norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(w) == {f"model.layers.0.{n}.weight" for n in names}
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    H = tcfg["hidden_size"]
    assert w["model.layers.0.eh_proj.weight"].shape == (H, 2 * H)
    assert cfg["num_hidden_layers"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert cfg["vocab_size"] == V and cfg["torch_dtype"] == "bfloat16"
    assert {k: v for k, v in cfg.items() if k not in ("num_hidden_layers", "num_nextn_predict_layers",
                                                     "torch_dtype", "dtype")} == \
        {k: v for k, v in tcfg.items() if k not in ("num_hidden_layers", "torch_dtype", "dtype")}


def test_training_runs_with_the_kernels_off(target_dir, tokens_dir, tmp_path, monkeypatch):
    """On CUDA RMSNorm dispatches to a Triton kernel that has no backward; the loop must switch
    the kernels off (here `active` is made to follow only that switch, as on a GPU)."""
    from specbatch import kernels

    monkeypatch.setattr(kernels, "active", lambda t: kernels._enabled)
    m = train_mtp(target_dir, tokens_dir, tmp_path, ttt_steps=2, seq_len=32, batch_size=2, steps=2,
                  lr=3e-3, warmup=1, eval_every=2, device="cpu", log=lambda _: None, eval_windows=2)
    assert m["best_eval_loss"] > 0 and kernels._enabled


def test_trained_layer_loads_and_is_lossless(trained, target_dir):
    out, _, _ = trained
    target, _ = load_target(target_dir, "float32", "cpu")
    layer = load_mtp(target, None, out, torch.float32, torch.device("cpu"))
    assert layer.cfg.layout == "deepseek" and layer.lm_head is target.lm_head
    g = torch.Generator().manual_seed(3)
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, V, (n,), generator=g).tolist())
            for i, n in enumerate((5, 17, 30, 9))]

    def run(spec):
        eng = Engine(target_dir, EngineOptions(batch_size=3, device="cpu", dtype="float32", spec=spec))
        recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=24, ignore_eos=True)),
                      key=lambda r: r["row"])
        assert all(r["error"] is None for r in recs)
        return recs

    vanilla = [r["output_token_ids"] for r in run(SpecConfig())]
    assert all(len(v) == 24 for v in vanilla)
    for spec in (SpecConfig("nextn_mtp", 3, 1, 4, str(out)), SpecConfig("nextn_mtp", 3, 2, 5, str(out))):
        assert [r["output_token_ids"] for r in run(spec)] == vanilla, spec
