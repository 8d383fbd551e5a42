"""Shared by the drafter training tests (tests/train/test_train_eagle3.py, test_train_mtp.py,
test_train_target.py): token streams written like `encode_corpus` writes them, the tiny corpus
tokenized for the 4-layer target, random (not init-shaped) weights, and the drafter-equivalence
harness: the training-time-test forward against LayerDrafter's inference path, row by row."""
from __future__ import annotations

import json
import sys
from array import array
from pathlib import Path
from typing import Callable

import pytest
import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.attention import AttnMetadata
from specbatch.models.loader import load_target
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative.drafter import PromptRows
from specbatch.speculative.layer_drafter import LayerDrafter
from specbatch.train.frozen import FrozenTarget
from specbatch.train.ttt import ttt_forward
from tiny_models import CORPUS

V = 320


def write_token_stream(path: Path, ids, vocab_size: int = V) -> None:
    """`ids` as a token stream: raw little-endian uint16 + its JSON header."""
    arr = array("H", ids)
    if sys.byteorder != "little":
        arr.byteswap()
    path.write_bytes(arr.tobytes())
    Path(str(path) + ".json").write_text(json.dumps(
        {"format": "specbatch-tokens-v1", "dtype": "uint16", "byteorder": "little",
         "count": len(arr), "vocab_size": vocab_size, "eos_id": 0}))


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
        write_token_stream(d / f"{name}.bin", ids)
    return d


def randomize(module: torch.nn.Module, g: torch.Generator) -> torch.nn.Module:
    """Random weights drawn from `g`, norms included (so a wrong norm, shift or mask anywhere
    changes the outputs); -> the module in eval mode."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:                                   # fan-in scaled: activations stay O(1)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return module.eval()


def _meta(B: int, T: int) -> AttnMetadata:
    return AttnMetadata(slots=torch.arange(B), positions=torch.arange(T).expand(B, T),
                        prefix_lens=torch.zeros(B, dtype=torch.int64), kv_len=T)


def check_ttt_matches_drafter_inference(target_dir, target, module, aux: tuple[int, ...], hidden_size: int,
                                        top1: Callable[[torch.Tensor], torch.Tensor], S: int = 4) -> None:
    """Catch-up at the last committed row (step 0) and a chain draft of depth S (steps 1..S-1)
    through LayerDrafter + its KV cache, fed by the engine's own prefill (the `aux` layers' outputs,
    or with no aux layers the final-normed hidden state, as the engine hands an MTP drafter), equal
    the training forward at (row L-1+j, step j) on the window prefix + first token + drafted tokens.
    `module` is attached to the target's embedding (what the loader does for the engine); `top1`
    maps a row's hidden state to its drafted target id."""
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
    with torch.no_grad():
        normed, captured = target(ids, _meta(B, T), kv.layers, capture=aux)
    fed = captured if aux else [normed]
    drafter = LayerDrafter(module, aux, num_steps=S, topk=1, num_draft_tokens=S + 1, num_slots=B, max_len=64)
    if not aux:
        assert drafter.reads_final_hidden
    outs: list[torch.Tensor] = []
    hook = module.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    with torch.no_grad():
        drafter.prefill(PromptRows.whole(slots, ids, torch.tensor(lens)), fed, first)
        prop = drafter.propose(slots, first, torch.tensor(lens))
    hook.remove()
    assert len(outs) == S and all(o.shape == (B, 1, hidden_size) for o in outs)

    # training: one window per sequence, 5 unrelated tokens past the draft (must not leak back).
    # Exact (1e-5) with the engine's features for the committed rows (the only feature rows these
    # outputs read); end to end with the trainer's own HF features, which differ from the
    # engine's by float32 rounding of ~30-sized activations (1e-4).
    ft = FrozenTarget(target_dir, aux, torch.device("cpu"))
    for b, L in enumerate(lens):
        window = torch.cat([seqs[b, : L + 1], prop.tokens[b, 1:S], torch.randint(1, V, (5,), generator=g)])
        with torch.no_grad():
            feats, _ = ft(window[None])
            engine_feats = feats.clone()
            engine_feats[:, :L] = torch.cat(fed, -1)[b, :L]
            for f, atol in ((engine_feats, 1e-5), (feats, 1e-4)):
                hs = ttt_forward(module, ft.embed_weight, window[None, 1:], f[:, :-1], S)
                for j in range(S):
                    row = L - 1 + j
                    torch.testing.assert_close(hs[j][0, row], outs[j][b, 0], rtol=0, atol=atol)
                    # the drafted token at depth j+1 is this row's top-1
                    assert int(top1(hs[j][0, row])) == int(prop.tokens[b, j + 1])


def frozen_and_engine_features(target_dir, aux: tuple[int, ...]):
    """The same two 12-token sequences through the engine's target (capturing `aux`) and the
    trainer's FrozenTarget: -> (target, frozen target, ids, engine normed hidden, engine capture,
    frozen features, frozen logits)."""
    target, _ = load_target(target_dir, "float32", "cpu")
    ft = FrozenTarget(target_dir, aux, torch.device("cpu"))
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2))
    kv = KVCache(target.cfg, 2, 16, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        normed, captured = target(ids, _meta(2, 12), kv.layers, capture=aux)
        feats, logits = ft(ids)
    return target, ft, ids, normed, captured, feats, logits


def check_loss_falls(out: Path, m: dict, lines: list[str]) -> list[dict]:
    """A 40-step run evaluated at 0, 20, 40: the held-out loss falls by 10 %, top-1 agreement
    rises, the train loss falls, the metrics and log lines are there; -> the eval history."""
    log = json.loads((out / "train_log.json").read_text())
    evals = log["eval_history"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    assert evals[-1]["loss"] < 0.9 * evals[0]["loss"]
    assert evals[-1]["agree"][0] > evals[0]["agree"][0]
    tr = log["train_history"]
    assert tr[-1]["loss"] < tr[0]["loss"]
    assert len(m["eval_agree"]) == 3 and all(0 <= a <= 1 for a in m["eval_agree"])
    assert m["params"] > 0 and m["bytes"] == (out / "model.safetensors").stat().st_size
    assert any(line.startswith("eval step 40") for line in lines)
    return evals


def generate(target_dir, spec) -> list[list[int]]:
    """Four random prompts, 24 tokens each (EOS ignored), through the engine with `spec`."""
    g = torch.Generator().manual_seed(3)
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=torch.randint(1, V, (n,), generator=g).tolist())
            for i, n in enumerate((5, 17, 30, 9))]
    eng = Engine(target_dir, EngineOptions(batch_size=3, device="cpu", dtype="float32", spec=spec))
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=24, ignore_eos=True)), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs)
    return [r["output_token_ids"] for r in recs]
