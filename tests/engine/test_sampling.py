"""Counter-based seeded sampling: exact hash arithmetic, correct distributions, batch invariance."""
from __future__ import annotations

import random

import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.sampling import (BatchSampling, SamplingParams, _mul32, apply_top_k_top_p, mix32,
                                row_keys, sample, split_seed, uniforms)


def test_mul32_is_exact_mod_2_32():
    rng = random.Random(0)
    xs = [0, 1, 2**32 - 1, 2**31] + [rng.randrange(2**32) for _ in range(1000)]
    for m in (0x7FEB352D, 0x846CA68B, 0xFFFFFFFF):
        got = _mul32(torch.tensor(xs, dtype=torch.int64), m).tolist()
        assert got == [(x * m) % 2**32 for x in xs]


def test_mix32_stays_32_bit_and_avalanches():
    x = torch.arange(100_000, dtype=torch.int64)
    h = mix32(x)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    assert h.unique().numel() == x.numel()                       # a bijection on these inputs
    flips = (mix32(x) ^ mix32(x ^ 1)).bitwise_and(0xFFFFFFFF)
    bits = sum(((flips >> b) & 1).float().mean() for b in range(32)) / 32
    assert 0.45 < float(bits) < 0.55                             # one input bit flips ~half the output


def test_uniforms_are_uniform_and_keyed():
    keys = row_keys(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([5, 5]))
    u = uniforms(keys, 200_000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u[0], bins=10, min=0, max=1)
    assert float(hist.min()) > 0.95 * 20_000 and float(hist.max()) < 1.05 * 20_000
    assert not torch.equal(u[0], u[1])
    assert split_seed(-1) == (2**32 - 1, 2**32 - 1) and split_seed(2**70 + 3) == (3, 0)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum())


def _draw(logits: torch.Tensor, n: int, **kw) -> tuple[torch.Tensor, BatchSampling]:
    params = [SamplingParams(seed=s, **kw) for s in range(n)]
    sp = BatchSampling.build(params, torch.device("cpu"))
    toks = sample(logits.expand(n, -1).contiguous(), sp, torch.full((n,), 7))
    return toks, sp


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def test_sampling_matches_the_softmax_distribution():
    n = 40_000
    toks, _ = _draw(LOGITS, n, temperature=0.7)
    counts = torch.bincount(toks, minlength=6).float()
    probs = (LOGITS[0] / 0.7).softmax(-1)
    assert _chi2(counts, probs) < 20.5             # chi-square, 5 dof, p = 0.001


def test_top_k_and_top_p_truncate_and_renormalise():
    n = 40_000
    toks, _ = _draw(LOGITS, n, temperature=1.0, top_k=3)
    counts = torch.bincount(toks, minlength=6).float()
    assert counts[3:].sum() == 0
    assert _chi2(counts[:3], LOGITS[0, :3].softmax(-1)) < 13.8          # 2 dof, p = 0.001
    p = LOGITS[0].softmax(-1)                                           # ~[.56, .21, .13, ...]
    toks, _ = _draw(LOGITS, n, temperature=1.0, top_p=0.7)
    counts = torch.bincount(toks, minlength=6).float()
    assert counts[2:].sum() == 0 and counts[1] > 0                      # .56 < .7 <= .56 + .21
    assert _chi2(counts[:2], p[:2] / p[:2].sum()) < 10.8


def test_apply_top_k_top_p_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    out = apply_top_k_top_p(logits, torch.tensor([2, 0, 1]), torch.tensor([1.0, 1.0, 1e-6]))
    assert torch.isinf(out[0]).tolist() == [True, False, True, False]
    assert not torch.isinf(out[1]).any()
    assert torch.isinf(out[2]).tolist() == [True, False, True, True]
    assert torch.equal(out[1], logits[1])


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0.0, 1.0, 0.0, 2.0])]
    toks = sample(logits, BatchSampling.build(params, torch.device("cpu")), torch.arange(4))
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()


def test_same_seed_same_position_same_token_whatever_the_batch():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(1))
    alone = sample(logits, BatchSampling.build([SamplingParams(temperature=1.0, seed=42)], torch.device("cpu")),
                   torch.tensor([9]))
    others = torch.randn(5, 300)
    batch = torch.cat([others[:2], logits, others[2:]])
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 42, 3, 4, 5)]
    mixed = sample(batch, BatchSampling.build(params, torch.device("cpu")), torch.tensor([0, 3, 9, 1, 1, 2]))
    assert mixed[2] == alone[0]


def _run(model, rows, batch_size, **defaults):
    eng = Engine(model, EngineOptions(batch_size=batch_size, device="cpu"))
    recs = eng.generate(rows, SamplingDefaults(**{"max_tokens": 10, "ignore_eos": True, **defaults}))
    return {r["id"]: r["output_token_ids"] for r in recs}


def test_seeded_sampling_is_independent_of_batch_composition(tiny_model):
    mine = [RowRequest(row=i, id=f"m{i}", prompt_token_ids=[3 + i, 7, 11],
                       overrides={"temperature": 1.0, "seed": 100 + i}) for i in range(3)]
    noise = [RowRequest(row=10 + i, id=f"n{i}", prompt_token_ids=[5] * (i + 2),
                        overrides={"temperature": 0.9, "top_k": 5}) for i in range(4)]
    alone = _run(tiny_model, mine, 1)
    mixed = _run(tiny_model, noise[:2] + mine[:1] + noise[2:] + mine[1:], 3)
    assert {k: mixed[k] for k in alone} == alone
    assert len({tuple(v) for v in alone.values()}) == 3          # different seeds, different draws


def test_run_seed_derives_row_seeds(tiny_model):
    rows = [RowRequest(row=i, id=str(i), prompt_token_ids=[9, 8, 7]) for i in range(4)]
    a = _run(tiny_model, rows, 2, temperature=1.0, seed=1)
    b = _run(tiny_model, rows, 4, temperature=1.0, seed=1)
    c = _run(tiny_model, rows, 2, temperature=1.0, seed=2)
    assert a == b and a != c
    assert len({tuple(v) for v in a.values()}) > 1                # same prompt, rows draw apart
