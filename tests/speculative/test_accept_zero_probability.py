"""Tree acceptance and plain sampling never emit a zero-probability token: regressions around the
race's uniform that once rounded to exactly 1.0 (a pinned witness), rejected drafts, masked tokens,
and a filtering row beside an unfiltered one."""
from __future__ import annotations

import pytest
import torch

from specbatch.sampling import SamplingParams, sample
from specbatch.speculative.accept import accept

from accept_helpers import _sp, _t


# ------------------------------------------------------------------------------------ known bugs
#
# The race -log(u) with u == 1.0: `uniforms` computes ((x >> 8).float() + 0.5) * 2**-24, and for
# x >> 8 == 2**24 - 1 the float32 sum 16777215.5 rounds to 16777216, so u == 1.0 exactly (once in
# 2**24 entries). Then -log(u) == -0.0 and p / -0.0 is NaN where p == 0, which argmax picks:
# a zero-probability token is emitted. Per draw this happens with probability about
# (number of zero-probability entries) / 2**24: ~0.2 % at V = 32k, ~0.8 % at V = 128k.
# Witness: seed 0, position 1329, vocabulary entry 3303 (found by search; pinned below).

_WITNESS_SEED, _WITNESS_POS, _WITNESS_TOKEN = 0, 1329, 3303
_WV = 4096
# Regression: uniforms once returned exactly 1.0 here (float32 rounding of (2**24-1)+0.5); -log(1.0)
# = -0.0 and 0/-0.0 = NaN won the argmax, so a zero-probability token was emitted.


def test_witness_hash_has_its_top_24_bits_set():
    # the precondition of the regression tests below: the raw 32-bit hash at (seed 0, pos 1329,
    # entry 3303) has all of its top 24 bits set. Fails only if the hash itself changes (then re-search).
    from specbatch.sampling import mix32, row_keys, split_seed
    lo, hi = split_seed(_WITNESS_SEED)
    key = row_keys(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([_WITNESS_POS]))
    v = mix32(torch.tensor([_WITNESS_TOKEN]) ^ 0x9E3779B9)
    x = mix32(key ^ v)
    assert int(x[0]) >> 8 == 2**24 - 1
    from specbatch.sampling import uniforms
    assert float(uniforms(key, _WV)[0, _WITNESS_TOKEN]) < 1.0


def _witness_logits():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(_WV, generator=g)
    x[17] = 8.0                                  # the argmax; the witness token is far below
    return x


def test_greedy_row_in_a_mixed_batch_emits_the_argmax_after_a_rejection():
    x = _witness_logits()
    nt, par = _t([[5, 99], [5, 99]]), _t([[-1, 0], [-1, 0]])      # draft 99 is not the argmax
    lg = x[None, None].expand(2, 2, _WV).contiguous()
    start = torch.full((2,), _WITNESS_POS - 1, dtype=torch.int64)
    alone = accept(nt[:1], par[:1], lg[:1], _sp([SamplingParams(seed=_WITNESS_SEED)]), start[:1], 1)
    assert alone.tokens[0, 0].item() == 17
    mixed = accept(nt, par, lg, _sp([SamplingParams(seed=_WITNESS_SEED),
                                     SamplingParams(temperature=1.0, seed=3)]), start, 1)
    assert int(mixed.num[0]) == 1
    assert mixed.tokens[0, 0].item() == 17                       # got 3303


@pytest.mark.parametrize("how", ["neg_inf_logit", "top_k"])
def test_vanilla_sampling_never_emits_a_zero_probability_token(how):
    x = _witness_logits()
    kw = dict(temperature=1.0, seed=_WITNESS_SEED)
    if how == "neg_inf_logit":
        x[_WITNESS_TOKEN] = float("-inf")                         # a masked token
    else:
        kw["top_k"] = 5
        assert _WITNESS_TOKEN not in x.topk(5).indices.tolist()
    acc = accept(_t([[0]]), _t([[-1]]), x[None, None], _sp([SamplingParams(**kw)]),
                 _t([_WITNESS_POS - 1]), 0)
    assert acc.tokens[0, 0].item() != _WITNESS_TOKEN             # got 3303


def test_plain_sample_never_emits_a_masked_token():
    x = _witness_logits()
    x[_WITNESS_TOKEN] = float("-inf")
    tok = sample(x[None], _sp([SamplingParams(temperature=1.0, seed=_WITNESS_SEED)]), _t([_WITNESS_POS]))
    assert tok.item() != _WITNESS_TOKEN


def test_rejected_draft_never_comes_back_as_the_correction():
    # At the witness the race's uniform for 3303 is its largest, so plain sampling draws 3303 there
    # (p ~ 2e-4): a draft of 3303 is accepted, any other draft is rejected and 3303 emitted instead.
    x = _witness_logits()
    g = torch.Generator().manual_seed(1)
    lg = torch.stack([x, torch.randn(_WV, generator=g)])[None]
    sp = _sp([SamplingParams(temperature=1.0, seed=_WITNESS_SEED)])
    assert int(sample(x[None], sp, _t([_WITNESS_POS]))[0]) == _WITNESS_TOKEN
    acc = accept(_t([[5, _WITNESS_TOKEN]]), _t([[-1, 0]]), lg, sp, _t([_WITNESS_POS - 1]), 1)
    assert int(acc.num[0]) == 2 and int(acc.tokens[0, 0]) == _WITNESS_TOKEN
    for draft in (17, 5, 3302):
        acc = accept(_t([[5, draft]]), _t([[-1, 0]]), lg, sp, _t([_WITNESS_POS - 1]), 1)
        assert int(acc.num[0]) == 1 and int(acc.tokens[0, 0]) == _WITNESS_TOKEN, draft


def test_unfiltered_row_keeps_its_distribution_next_to_a_filtering_row():
    # rows' distributions are built with sp.repeat_rows(N).target_probs (the CPU draw): check that p directly
    V = 32000
    x = torch.full((1, V), -17.0)
    x[0, 0] = 0.0                               # p0 ~ 0.9988, 31999 tokens of ~4e-8 each
    alone = _sp([SamplingParams(temperature=1.0, seed=1)]).target_probs(x)
    batch = _sp([SamplingParams(temperature=1.0, seed=1),
                 SamplingParams(temperature=1.0, top_k=5, seed=2)]).target_probs(x.expand(2, V))
    lost = (alone[0] > 0) & (batch[0] == 0)
    assert not lost.any(), f"{int(lost.sum())} tokens, mass {float(alone[0][lost].sum()):.2e}"
