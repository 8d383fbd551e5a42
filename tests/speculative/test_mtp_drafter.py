"""The NextN / MTP drafter: lossless greedy output through the engine for every layout, place and
shape (mimic layers that draft well, random ones on a deeper target), the engine feeding the
target's final-normed hidden state and the first chain equal to the reference layer's greedy
chain, and the top-1 fast path equal to the softmax path."""
from __future__ import annotations

import pytest
import torch

from mtp_helpers import (H, LAYOUTS, PLACES, SHAPES, Reference, check_stats, mimic_dirs, mtp_dirs,  # noqa: F401
                         mtp_rows, mtp_spec, output_ids, run_engine, vanilla)
from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.models.attention import AttnMetadata
from specbatch.models.loader import load_target
from specbatch.recipe import SamplingDefaults
from specbatch.runtime.kv_cache import KVCache
from specbatch.speculative import layer_drafter
from specbatch.speculative.drafter import PromptRows
from specbatch.speculative.factory import SpecConfig, make_drafter

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- 1. lossless greedy through the engine ---------------------------------------------------

_stats_seen: dict = {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "S{}k{}N{}".format(*s))
@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_greedy_is_lossless(mimic_dirs, vanilla, layout, place, shape, device):
    S, k, N = shape
    target_dir, draft_dir = mimic_dirs(layout, place)
    for bs in (1, 3):
        recs = run_engine(target_dir, mtp_rows(), bs, device, mtp_spec(S, k, N, draft_dir))
        assert output_ids(recs) == vanilla(device), f"{layout} {place} {shape} batch {bs}"
        check_stats(recs, S, N)
        accepted = [r["spec"]["accepted_tokens"] for r in recs]
        steps = [r["spec"]["verify_steps"] for r in recs]
        assert sum(accepted) >= 10, accepted          # acceptance exercised, not only rejection
        assert any(s > 1 and a < (s - 1) * S for a, s in zip(accepted, steps)), (accepted, steps)
        # the same mimic layer in every layout and place: the same drafts, the same statistics
        seen = _stats_seen.setdefault((shape, device, bs), (layout, place, accepted, steps))
        assert (accepted, steps) == tuple(seen[2:]), f"{layout} {place} drafts differ from {seen[:2]}"


@pytest.mark.parametrize("device", DEVICES)
def test_random_mtp_on_a_deeper_target_is_lossless(mtp_dirs, device):
    """Random (rarely accepted) layers on a 3-layer target, every layout and place."""
    base = mtp_dirs("llama")
    want = output_ids(run_engine(base, mtp_rows(), 4, device))
    for i, (layout, place) in enumerate((lo, pl) for lo in LAYOUTS for pl in PLACES):
        S, k, N = SHAPES[i % len(SHAPES)]
        target_dir, draft_dir = mtp_dirs("llama", layout, place)
        recs = run_engine(target_dir, mtp_rows(), 3, device, mtp_spec(S, k, N, draft_dir))
        assert output_ids(recs) == want, (layout, place)
        check_stats(recs, S, N)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_feeds_final_hidden_and_drafts_like_the_reference(mtp_dirs, layout):
    """Through the engine (random layer, 3-layer target): the drafter reads the target's
    final-normed hidden state (prefill and extend), and the first chain it proposes is the
    reference layer's greedy chain, its own normed output fed back at each step."""
    import transformers as tf

    S, N = 3, 4
    target_dir, _ = mtp_dirs("llama", layout, "inside")
    eng = Engine(target_dir, EngineOptions(batch_size=2, device="cpu", dtype="float32", spec=mtp_spec(S, 1, N, None)))
    d, rec = eng.drafter, {}
    real_prefill, real_propose, real_extend = d.prefill, d.propose, d.extend

    def prefill(rows, captured, first):
        real_prefill(rows, captured, first)
        rec["prefill"] = [c.clone() for c in captured], int(first[0]), d.first_logp[rows.slots].clone()

    def propose(*args, **kw):
        return rec.setdefault("prop", real_propose(*args, **kw))

    def extend(slots, lens, acc, captured, kv_bound=None):
        rec.setdefault("extend", [c.clone() for c in captured])
        return real_extend(slots, lens, acc, captured, kv_bound)

    d.prefill, d.propose, d.extend = prefill, propose, extend
    prompt = mtp_rows()[3].prompt_token_ids
    n = len(prompt)
    list(eng.generate([RowRequest(row=0, id="0", prompt_token_ids=prompt)], SamplingDefaults(max_tokens=3)))

    hf = tf.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        final = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]    # normed
    captured, first, first_logp = rec["prefill"]
    assert len(captured) == 1 and captured[0].shape[-1] == H
    # one prefill sequence a prompt token, the prompt's positions in order
    torch.testing.assert_close(captured[0].reshape(-1, H)[None, :n], final, atol=1e-5, rtol=1e-5)

    ref = Reference(target_dir, None, layout, "inside")
    ids, hid, chain, logps = prompt[1:] + [first], final[0], [first], []
    for s in range(S):
        out, logits = ref(torch.tensor([ids]), hid[None])
        draft = int(logits[0, -1].argmax())
        chain.append(draft)
        logps.append(float(logits[0, -1].log_softmax(-1)[draft]))
        ids, hid = ids + [draft], torch.cat([hid, out[0, -1:]])
    prop = rec["prop"]
    assert prop.tokens[0].tolist() == chain
    assert first_logp[0, 0].item() == pytest.approx(logps[0], abs=1e-5) and logps[0] < -1e-3

    # the first extend reads the target's final-normed hidden over the verified tokens
    with torch.no_grad():
        full = hf(torch.tensor([prompt + chain]), output_hidden_states=True).hidden_states[-1]
    assert len(rec["extend"]) == 1
    torch.testing.assert_close(rec["extend"][0][0], full[0, n: n + N], atol=1e-5, rtol=1e-5)


# ---- 2. the top-1 fast path equals the softmax path ------------------------------------------

def _softmax_topk(logits, k):
    vals, idx = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return idx, vals


def _recording(fn, log):
    def wrapped(logits, k):
        idx, logp = fn(logits, k)
        log.append((idx.clone(), logp.clone()))
        return idx, logp
    return wrapped


def _draft_once(target_dir, device, S=3):
    """Prefill + one proposal of a k=1 MTP drafter on two prompts; -> proposal tokens."""
    dev = torch.device(device)
    target, _ = load_target(target_dir, "float32", dev)
    drafter = make_drafter(SpecConfig("nextn_mtp", S, 1, S + 1), target, 3, 48, target_dir=str(target_dir))
    prompts = [[11, 47, 203, 5, 88], [3, 9, 150, 151, 77, 31, 260, 14]]
    B, T = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, T, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    ids = ids.to(dev)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    slots = torch.tensor([2, 0], device=dev)
    cache = KVCache(target.cfg, 3, 48, torch.float32, dev)
    meta = AttnMetadata(slots=slots, positions=torch.arange(T, device=dev).expand(B, T),
                        prefix_lens=torch.zeros_like(slots), kv_len=T)
    with torch.inference_mode():
        hidden, captured = target(ids, meta, cache.layers, drafter.capture_layers)
        assert captured == []
        first = target.logits(hidden[torch.arange(B, device=dev), lengths - 1]).argmax(-1)
        drafter.prefill(PromptRows.whole(slots, ids, lengths), [hidden], first)
        prop = drafter.propose(slots, first, lengths)
    return prop.tokens.cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_top1_fast_path_equals_softmax_path(mimic_dirs, vanilla, monkeypatch, device):
    target_dir, _ = mimic_dirs("deepseek", "inside")
    real = layer_drafter.topk_logprobs
    logs = {}
    tokens = {}
    for name, fn in (("fast", real), ("softmax", _softmax_topk)):
        logs[name] = []
        monkeypatch.setattr(layer_drafter, "topk_logprobs", _recording(fn, logs[name]))
        tokens[name] = _draft_once(target_dir, device)
    assert torch.equal(tokens["fast"], tokens["softmax"])
    assert len(logs["fast"]) == len(logs["softmax"]) == 3       # prefill + S - 1 draft steps
    for (fi, fl), (si, sl) in zip(logs["fast"], logs["softmax"]):
        assert torch.equal(fi, si)
        assert fl.dtype == torch.float32
        torch.testing.assert_close(fl, sl, atol=1e-5, rtol=0)
        # real probabilities, not the constant 1.0 of a shortcut
        p = fl.exp()
        assert bool((p > 0).all() and (p <= 1).all()) and bool((fl < -1e-3).any()), fl

    # and the engine's output stays lossless with either
    for fn in (real, _softmax_topk):
        monkeypatch.setattr(layer_drafter, "topk_logprobs", fn)
        recs = run_engine(target_dir, mtp_rows(), 3, device, mtp_spec(3, 1, 4, None))
        assert output_ids(recs) == vanilla(device)
        check_stats(recs, 3, 4)
        assert sum(r["spec"]["accepted_tokens"] for r in recs) >= 10
