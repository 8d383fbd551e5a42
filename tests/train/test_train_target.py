"""Target-training stage of the demo-model pipeline: tiny Llama on synthetic streams, CPU, fast."""
from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import pytest
import torch
import transformers as tf

from specbatch.train.corpus import load_tokens
from specbatch.train.corpus import token_tensor as _stream
from specbatch.train.schedule import warmup_cosine
from specbatch.train.target import DEMO_SHAPE, heldout_loss, train_target
from tiny_models import hf_greedy, make_tokenizer
from train_helpers import write_token_stream

VOCAB = 320                       # tiny_models' tokenizer; EOS (and pad) id 0
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=True)
RUN = dict(shape=SHAPE, seq_len=32, batch_size=8, steps=40, lr=1e-2, warmup=5, eval_every=10,
           device="cpu", log=lambda s: None)
SEQ_LEN, BATCH = RUN["seq_len"], RUN["batch_size"]


def _cycle(seed: int) -> list[int]:
    ids = list(range(4, 68))                      # 64 ordinary ids; after each comes a fixed one
    random.Random(seed).shuffle(ids)
    return ids


def _write_stream(path: Path, cycles: list[list[int]], n_tokens: int, seed: int) -> None:
    """Documents walking one of `cycles` from a random point, each followed by EOS, written like
    `encode_corpus` does (raw little-endian uint16 + JSON header)."""
    rng = random.Random(seed)
    toks = array("H")
    while len(toks) < n_tokens:
        cyc = rng.choice(cycles)
        k = rng.randrange(len(cyc))
        toks.extend(cyc[(k + i) % len(cyc)] for i in range(rng.randint(20, 120)))
        toks.append(0)
    write_token_stream(path, toks, VOCAB)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d, VOCAB)
    return d


def _run(tmp_path_factory, tok_dir, heldout_cycles: list[list[int]]):
    d = tmp_path_factory.mktemp("run")
    (d / "tokens").mkdir()
    _write_stream(d / "tokens" / "train.bin", [_cycle(1)], 20_000, seed=0)
    _write_stream(d / "tokens" / "heldout.bin", heldout_cycles, 1_000, seed=1)
    metrics = train_target(d / "tokens", tok_dir, d / "model", **RUN)
    return d, metrics


@pytest.fixture(scope="module")
def learnable(tmp_path_factory, tok_dir):
    """Held-out text follows the training pattern: both losses fall."""
    return _run(tmp_path_factory, tok_dir, [_cycle(1)])


@pytest.fixture(scope="module")
def shifted(tmp_path_factory, tok_dir):
    """Held-out text follows another pattern over the same ids: the held-out loss first falls
    (which ids occur) and then rises (the training bigrams are wrong there): early stopping."""
    return _run(tmp_path_factory, tok_dir, [_cycle(2)])


def _log(d: Path) -> dict:
    return json.loads((d / "model" / "train_log.json").read_text())


def test_loss_falls(learnable):
    d, m = learnable
    hist = _log(d)["history"]
    assert [h["step"] for h in hist] == [10, 20, 30, 40]
    assert m["steps"] == 40 and m["tokens_seen"] == 40 * BATCH * SEQ_LEN
    assert hist[0]["train_loss"] > 4.0 and m["train_loss"] < 1.0      # ln(320) = 5.77 at the start
    assert m["best_heldout_loss"] < 1.0 and m["best_step"] == 40
    assert m["best_heldout_ppl"] == pytest.approx(2.718281828 ** m["best_heldout_loss"], rel=1e-3)
    assert m["params"] == sum(p.numel() for p in tf.AutoModelForCausalLM.from_pretrained(
        str(d / "model")).parameters())


def test_best_heldout_state_is_saved(shifted):
    d, m = shifted
    hist = _log(d)["history"]
    held = [h["heldout_loss"] for h in hist]
    assert m["best_step"] < 40 and held[-1] > min(held) + 0.1          # it did overfit
    assert m["best_heldout_loss"] == pytest.approx(min(held), abs=1e-5)
    assert hist[[h["step"] for h in hist].index(m["best_step"])]["heldout_loss"] == min(held)
    model = tf.AutoModelForCausalLM.from_pretrained(str(d / "model"), dtype=torch.float32)
    got = heldout_loss(model, _stream(d / "tokens" / "heldout.bin"), SEQ_LEN, BATCH)
    assert got == pytest.approx(m["best_heldout_loss"], abs=1e-3)
    assert got == pytest.approx(m["heldout_loss"], abs=1e-5)           # the bf16 weights as saved


def test_checkpoint_format(learnable, tok_dir):
    from safetensors import safe_open

    d, m = learnable
    out = d / "model"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["vocab_size"] == VOCAB and cfg["eos_token_id"] == 0 and cfg["bos_token_id"] is None
    assert cfg["tie_word_embeddings"] is True and cfg["num_key_value_heads"] == 2
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in f.keys()
    assert m["checkpoint_bytes"] == (out / "model.safetensors").stat().st_size
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [0]}
    for f in tok_dir.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes()
    log = _log(d)
    assert log["metrics"] == m and log["args"]["shape"] == SHAPE and log["args"]["steps"] == 40
    assert tf.AutoTokenizer.from_pretrained(str(out)).eos_token_id == 0


def test_specbatch_loads_and_matches_transformers(learnable):
    from specbatch.data import RowRequest
    from specbatch.engine import Engine, EngineOptions
    from specbatch.models.loader import load_target
    from specbatch.recipe import SamplingDefaults

    d, _ = learnable
    out = d / "model"
    ours, raw = load_target(out, "float32", "cpu")
    assert ours.lm_head.weight.dtype == torch.float32 and raw["model_type"] == "llama"
    cyc = _cycle(1)
    g = torch.Generator().manual_seed(0)
    prompts = [cyc[5:6], cyc[10:40], torch.randint(4, VOCAB, (9,), generator=g).tolist(), [0] + cyc[:3]]
    ref = hf_greedy(out, prompts, 16, eos_token_id=0)
    assert ref[1][:8] == (cyc * 2)[40:48]                               # it learnt the pattern
    eng = Engine(out, EngineOptions(batch_size=2, device="cpu", dtype="float32"))
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    recs = sorted(eng.generate(rows, SamplingDefaults(max_tokens=16)), key=lambda r: r["row"])
    assert [r["error"] for r in recs] == [None] * len(prompts)
    assert [r["output_token_ids"] for r in recs] == ref


def test_heldout_loss_covers_whole_stream(learnable):
    """Each token after the first is predicted exactly once, the tail window included."""
    d, _ = learnable
    model = tf.AutoModelForCausalLM.from_pretrained(str(d / "model"), dtype=torch.float32).eval()
    toks = _stream(d / "tokens" / "heldout.bin")[:203]                  # 202 targets: 6 x 32 + 10
    assert toks.tolist() == list(load_tokens(d / "tokens" / "heldout.bin")[:203])
    total = 0.0                                                         # contexts restart every SEQ_LEN
    for s in range(0, 202, SEQ_LEN):
        x, y = toks[s:min(s + SEQ_LEN, 202)], toks[s + 1:min(s + SEQ_LEN, 202) + 1]
        with torch.no_grad():
            lg = model(input_ids=x[None]).logits[0]
        total += torch.nn.functional.cross_entropy(lg, y, reduction="sum").item()
    for bs in (1, 4, 64):
        assert heldout_loss(model, toks, SEQ_LEN, bs) == pytest.approx(total / 202, rel=1e-5)


def test_lr_schedule_and_demo_shape():
    lrs = [warmup_cosine(s, 100, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    cfg = tf.LlamaConfig(**DEMO_SHAPE, vocab_size=8192, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    with torch.device("meta"):
        n = sum(p.numel() for p in tf.LlamaForCausalLM(cfg).parameters())
    assert 6.5e6 < n < 7.0e6 and 2 * n < 14e6                           # bf16 bytes: the bundle budget


def test_deterministic_given_seed(tmp_path, tok_dir):
    (tmp_path / "tokens").mkdir()
    _write_stream(tmp_path / "tokens" / "train.bin", [_cycle(1)], 3_000, seed=0)
    _write_stream(tmp_path / "tokens" / "heldout.bin", [_cycle(1)], 300, seed=1)
    run = dict(RUN, steps=4, eval_every=2)
    a = train_target(tmp_path / "tokens", tok_dir, tmp_path / "a", **run)
    b = train_target(tmp_path / "tokens", tok_dir, tmp_path / "b", **run)
    c = train_target(tmp_path / "tokens", tok_dir, tmp_path / "c", **dict(run, seed=1))
    weights = [(tmp_path / r / "model.safetensors").read_bytes() for r in "abc"]
    assert weights[0] == weights[1] != weights[2]
    assert a["train_loss"] == b["train_loss"] and a["train_loss"] != c["train_loss"]
