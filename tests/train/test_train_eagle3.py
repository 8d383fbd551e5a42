"""EAGLE3 head training: the training-time-test forward reproduces the drafter's inference path
row by row (catch-up and chain draft steps, through the real LayerDrafter and KV cache), the
features are what the engine captures, the loss falls, the saved head loads and drafts losslessly,
and the draft vocabulary is the deterministic most-frequent set."""
from __future__ import annotations

import json
import sys
from array import array
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.attention import AttnMetadata
from specbatch.models.config import load_config
from specbatch.models.eagle3 import load_eagle3
from specbatch.models.loader import load_target
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.layer_drafter import LayerDrafter
from specbatch.speculative.factory import SpecConfig
from specbatch.train.eagle3 import FrozenTarget, build_head, head_config, select_draft_vocab, train_eagle3
from specbatch.train.ttt import ttt_forward
from tiny_models import CORPUS

V = 320
AUX = (1, 2, 3)          # layer 3 is the tiny target's last layer: its pre-norm output is the feature


@pytest.fixture(scope="module")
def target_dir(tiny_model_factory):
    return tiny_model_factory("llama3", num_hidden_layers=4)


def _write_stream(path: Path, ids: list[int]) -> None:
    arr = array("H", ids)
    if sys.byteorder != "little":
        arr.byteswap()
    path.write_bytes(arr.tobytes())
    Path(str(path) + ".json").write_text(json.dumps(
        {"format": "specbatch-tokens-v1", "dtype": "uint16", "byteorder": "little",
         "count": len(ids), "vocab_size": V, "eos_id": 0}))


@pytest.fixture(scope="module")
def tokens_dir(target_dir, tmp_path_factory):
    """The tiny corpus, tokenized, documents shuffled and EOS-separated: ~12k train tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    docs = [tok.encode(t, add_special_tokens=False) for t in CORPUS]
    g = torch.Generator().manual_seed(0)
    d = tmp_path_factory.mktemp("tokens")
    for name, n in (("train", 240), ("heldout", 24)):
        ids: list[int] = []
        for i in torch.randint(0, len(docs), (n,), generator=g).tolist():
            ids += docs[i] + [0]
        _write_stream(d / f"{name}.bin", ids)
    return d


@pytest.fixture(scope="module")
def trained(target_dir, tokens_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head")
    lines: list[str] = []
    m = train_eagle3(target_dir, tokens_dir, out, draft_vocab=96, aux_layers=AUX, ttt_steps=3,
                     seq_len=64, batch_size=8, steps=40, lr=3e-3, warmup=5, eval_every=20,
                     device="cpu", log=lines.append, eval_windows=16)
    return out, m, lines


def _random_head(target_dir, Vd=100, seed=0):
    """A head with random (not init-shaped) weights, norms included, so a wrong norm, shift or
    mask anywhere changes the outputs."""
    tcfg, _ = load_config(target_dir)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(V, generator=g)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    head = build_head(head_config(tcfg, Vd, AUX), ids - torch.arange(Vd), t2d)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:                                   # fan-in scaled: activations stay O(1)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return head.eval()


# ---- (1) training forward == inference path ---------------------------------------------------

def test_ttt_forward_matches_drafter_inference(target_dir):
    """Catch-up at the last committed row (step 0) and a chain draft of depth S (steps 1..S-1)
    through LayerDrafter + its KV cache, fed by the engine's own target capture, equal the
    training forward at (row L-1+j, step j) on the window prefix + first token + drafted tokens."""
    S = 4
    target, _ = load_target(target_dir, "float32", "cpu")
    head = _random_head(target_dir)
    head.embed_tokens = target.model.embed_tokens          # what load_eagle3 does for the engine
    lens = [9, 17]
    B, T = len(lens), max(lens)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(1, V, (B, T + 1), generator=g)
    ids = seqs[:, :T].clone()
    for b, n in enumerate(lens):
        ids[b, n:] = 0
    first = seqs[torch.arange(B), torch.tensor(lens)]       # x_L: the token the target emitted

    # inference: the engine's prefill capture, the drafter's catch-up and chain proposal
    slots = torch.arange(B)
    kv = KVCache(target.cfg, B, 64, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slots=slots, positions=torch.arange(T).expand(B, T),
                        prefix_lens=torch.zeros(B, dtype=torch.int64), kv_len=T)
    with torch.no_grad():
        _, captured = target(ids, meta, kv.layers, capture=AUX)
    drafter = LayerDrafter(head, AUX, num_steps=S, topk=1, num_draft_tokens=S + 1, num_slots=B,
                            max_len=64)
    outs: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    with torch.no_grad():
        drafter.prefill(slots, ids, torch.tensor(lens), captured, first)
        prop = drafter.propose(slots, first, torch.tensor(lens))
    hook.remove()
    assert len(outs) == S and all(o.shape == (B, 1, head.cfg.layer.hidden_size) for o in outs)

    # training: one window per sequence, 5 unrelated tokens past the draft (must not leak back).
    # Exact (1e-5) with the engine's features for the committed rows (the only feature rows these
    # outputs read); end to end with the trainer's own HF features, which differ from the
    # engine's by float32 rounding of ~30-sized activations (1e-4).
    ft = FrozenTarget(target_dir, AUX, torch.device("cpu"))
    for b, L in enumerate(lens):
        window = torch.cat([seqs[b, : L + 1], prop.tokens[b, 1:S], torch.randint(1, V, (5,), generator=g)])
        with torch.no_grad():
            aux, _ = ft(window[None])
            engine_aux = aux.clone()
            engine_aux[:, :L] = torch.cat(captured, -1)[b, :L]
            for feats, atol in ((engine_aux, 1e-5), (aux, 1e-4)):
                hs = ttt_forward(head, ft.embed_weight, window[None, 1:], feats[:, :-1], S)
                for j in range(S):
                    row = L - 1 + j
                    torch.testing.assert_close(hs[j][0, row], outs[j][b, 0], rtol=0, atol=atol)
                    # the drafted token at depth j+1 is this row's top-1
                    top = head.to_target(head.logits(hs[j][0, row]).argmax())
                    assert int(top) == int(prop.tokens[b, j + 1])


def test_features_are_the_engines_capture(target_dir):
    """The HF hooks give the residual stream after each aux layer, the last layer pre-norm (bit
    for bit at equal shapes on the CPU)."""
    target, _ = load_target(target_dir, "float32", "cpu")
    ft = FrozenTarget(target_dir, AUX, torch.device("cpu"))
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    kv = KVCache(target.cfg, 2, 16, torch.float32, torch.device("cpu"))
    meta = AttnMetadata(slots=torch.arange(2), positions=torch.arange(12).expand(2, 12),
                        prefix_lens=torch.zeros(2, dtype=torch.int64), kv_len=12)
    with torch.no_grad():
        normed, captured = target(ids, meta, kv.layers, capture=AUX)
        aux, logits = ft(ids)
    torch.testing.assert_close(aux, torch.cat(captured, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, target.logits(normed), rtol=0, atol=1e-4)


# ---- (2) training ---------------------------------------------------------------------------

def test_loss_falls_and_log(trained):
    out, m, lines = trained
    log = json.loads((out / "train_log.json").read_text())
    evals = log["eval_history"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["loss"] < 0.9 * evals[0]["loss"]
    assert evals[-1]["agree"][0] > evals[0]["agree"][0]
    tr = log["train_history"]
    assert tr[-1]["loss"] < tr[0]["loss"]
    assert m["steps"] == 40 and m["best_step"] == 40 and m["best_eval_loss"] == evals[-1]["loss"]
    assert len(m["eval_agree"]) == 3 and all(0 <= a <= 1 for a in m["eval_agree"])
    assert m["params"] > 0 and m["bytes"] == (out / "model.safetensors").stat().st_size
    assert any(line.startswith("eval step 40") for line in lines)


def test_saved_layout(trained, target_dir):
    out, m, _ = trained
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    assert "embed_tokens.weight" not in w
    assert set(w) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for n, t in w.items() if n not in ("d2t", "t2d"))
    H = tcfg["hidden_size"]
    assert w["fc.weight"].shape == (H, 3 * H) and w["lm_head.weight"].shape == (96, H)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (H, 2 * H)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(AUX), "use_aux_hidden_state": True}
    assert cfg["draft_vocab_size"] == 96 and cfg["vocab_size"] == V and cfg["torch_dtype"] == "bfloat16"
    assert cfg["num_key_value_heads"] == tcfg["num_key_value_heads"]
    assert cfg["intermediate_size"] == tcfg["intermediate_size"]
    assert cfg["rope_scaling"]["rope_type"] == "llama3"


# ---- (3) the saved head drafts losslessly -----------------------------------------------------

def test_trained_head_loads_and_is_lossless(trained, target_dir):
    out, _, _ = trained
    target, _ = load_target(target_dir, "float32", "cpu")
    head = load_eagle3(out, target.cfg, target.model.embed_tokens, torch.float32, torch.device("cpu"))
    assert head.cfg.aux_layer_ids == AUX and head.cfg.draft_vocab_size == 96
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
    spec = run(SpecConfig("eagle3", 3, 1, 4, str(out)))
    assert [r["output_token_ids"] for r in spec] == vanilla
    assert all(len(v) == 24 for v in vanilla)


# ---- (4) draft vocabulary ---------------------------------------------------------------------

def test_draft_vocab_most_frequent_ties_by_id():
    # counts: 7 -> 5, 3 -> 3, 9 -> 3, 1 -> 3, 4 -> 2, 2 -> 1; ties among 1/3/9 broken by id
    toks = torch.tensor([7] * 5 + [9] * 3 + [3] * 3 + [1] * 3 + [4] * 2 + [2])
    ids, d2t, t2d = select_draft_vocab(toks[torch.randperm(len(toks))], 12, 3)
    assert ids.tolist() == [1, 3, 7]
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 2, 5]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [1, 3, 7]
    ids4, _, _ = select_draft_vocab(toks, 12, 4)
    assert ids4.tolist() == [1, 3, 7, 9]
    # more than the distinct ids: zero-count ids fill in by id
    ids8, _, _ = select_draft_vocab(toks, 12, 8)
    assert ids8.tolist() == [0, 1, 2, 3, 4, 5, 7, 9]


def test_draft_vocab_consistent_and_deterministic(trained, tokens_dir):
    out, m, _ = trained
    w = load_file(str(out / "model.safetensors"))
    d2t, t2d = w["d2t"], w["t2d"]
    mapped = torch.arange(len(d2t)) + d2t
    assert (mapped.diff() > 0).all() and int(t2d.sum()) == len(d2t) and bool(t2d[mapped].all())
    from specbatch.train.corpus import token_tensor as _stream

    train = _stream(tokens_dir / "train.bin")
    counts = torch.bincount(train, minlength=V)
    chosen = counts[mapped]
    assert int(chosen.min()) >= int(counts[~t2d].max())      # the most frequent ones
    again = select_draft_vocab(train, V, 96)
    assert torch.equal(again[0], mapped) and torch.equal(again[1], d2t) and torch.equal(again[2], t2d)
    assert 0 < m["draft_vocab_coverage"] <= 1
