"""Stop conditions: max_tokens, EOS, stop_token_ids, stop strings, ignore_eos."""
from __future__ import annotations

import pytest

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults
from specbatch.request import Request, StopChecker
from specbatch.sampling import SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "for i in range(10):\n    print(i"]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, EngineOptions(batch_size=2, device="cpu"))


def _gen(engine, overrides, prompts=PROMPTS, **defaults):
    rows = [RowRequest(row=i, id=str(i), prompt=p, overrides=dict(overrides)) for i, p in enumerate(prompts)]
    recs = engine.generate(rows, SamplingDefaults(**{"max_tokens": 24, **defaults}))
    return sorted(recs, key=lambda r: r["row"])


def test_max_tokens_is_exact(engine):
    for n in (1, 2, 7):
        recs = _gen(engine, {"max_tokens": n, "ignore_eos": True})
        assert [r["completion_tokens"] for r in recs] == [n] * len(PROMPTS)
        assert all(r["finish_reason"] == "length" and len(r["output_token_ids"]) == n for r in recs)


def test_stop_token_ids_end_the_completion_inclusive(engine):
    free = _gen(engine, {"ignore_eos": True})
    tok = free[0]["output_token_ids"][5]
    first = free[0]["output_token_ids"].index(tok)
    recs = _gen(engine, {"stop_token_ids": [tok], "ignore_eos": True})
    assert recs[0]["output_token_ids"] == free[0]["output_token_ids"][: first + 1]
    assert recs[0]["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def eos_engine(engine, tiny_model_factory, tmp_path_factory):
    """A tiny model edited so that EOS (id 0) wins wherever its most frequent token would."""
    from safetensors.torch import load_file, save_file

    free = _gen(engine, {"ignore_eos": True, "max_tokens": 40})
    ids = [t for r in free for t in r["output_token_ids"]]
    frequent = max(set(ids), key=ids.count)
    d = tiny_model_factory("llama3", tag="eos-edited")
    w = load_file(str(d / "model.safetensors"))
    w["lm_head.weight"][0] = 1.5 * w["lm_head.weight"][frequent]
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return Engine(d, EngineOptions(batch_size=2, device="cpu"))


def test_eos_stops_and_is_kept_in_the_ids_but_not_the_text(eos_engine):
    engine = eos_engine
    eos_id = 0
    free = _gen(engine, {"ignore_eos": True, "max_tokens": 40})
    saw_eos = [r for r in free if eos_id in r["output_token_ids"]]
    assert saw_eos, "the edited model emits EOS"
    assert any("<|endoftext|>" in engine.tokenizer.decode(r["output_token_ids"]) for r in saw_eos)
    stopped = _gen(engine, {"max_tokens": 40})
    for f, s in zip(free, stopped):
        ids = f["output_token_ids"]
        if eos_id in ids:
            cut = ids.index(eos_id) + 1
            assert s["output_token_ids"] == ids[:cut] and s["finish_reason"] == "stop"
            assert "<|endoftext|>" not in s["completion"]
        else:
            assert s["output_token_ids"] == ids


def test_stop_strings_cut_the_text_at_the_stop(engine):
    free = _gen(engine, {"ignore_eos": True})
    text = free[1]["completion"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop and stop.strip("\ufffd")
    recs = _gen(engine, {"ignore_eos": True, "stop": [stop, "never-seen-string"]})
    cut = text.find(stop)
    assert recs[1]["completion"] == text[:cut]
    assert recs[1]["finish_reason"] == "stop"
    assert recs[1]["completion_tokens"] < free[1]["completion_tokens"]
    ids = recs[1]["output_token_ids"]
    assert ids == free[1]["output_token_ids"][: len(ids)]


class _CharTokenizer:
    """One token per character; id 0 is a special token the decoder can skip."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (i == 0 and skip_special_tokens) else ("<eos>" if i == 0 else chr(i)) for i in ids)


def _req(**kw):
    return Request(row=0, id="r", prompt_ids=[1], params=SamplingParams(**kw), max_new=kw.get("max_tokens", 256))


def test_stop_string_spanning_tokens_and_multi_token_append():
    chk = StopChecker(_CharTokenizer(), eos_ids={0})
    req = _req(stop=("END",))
    kept = chk.append(req, [ord(c) for c in "abcEN"])
    assert kept == 5 and not req.finished
    kept = chk.append(req, [ord(c) for c in "Dxyz"])          # several tokens at once (speculation)
    assert kept == 1 and req.finish_reason == "stop"
    assert chk.completion(req)[0] == "abc"


def test_the_models_other_eos_ids_report_their_stop_reason_as_vllms_stop_token_ids():
    """vLLM stops on the tokenizer's EOS with no stop_reason and adds the generation config's other
    EOS ids (Llama 3's <|eom_id|>, Qwen's <|endoftext|>) to stop_token_ids: those report their id."""
    chk = StopChecker(_CharTokenizer(), eos_ids={0, 1}, primary_eos=0)
    for tok, reason in ((0, None), (1, 1)):
        req = _req()
        assert chk.append(req, [ord("a"), tok, ord("b")]) == 2 and req.finish_reason == "stop"
        assert chk.completion(req) == ("a", reason)
    req = _req(ignore_eos=True, max_tokens=3)                # ignore_eos: neither stops (vLLM adds none)
    assert chk.append(req, [1, 0, ord("c")]) == 3 and req.finish_reason == "length"
    req = _req(min_tokens=2)                                 # masked alike until min_tokens
    assert chk.append(req, [1, ord("a"), 1]) == 3 and chk.completion(req) == ("\x01a", 1)


def test_eos_ignore_eos_and_length_in_order():
    chk = StopChecker(_CharTokenizer(), eos_ids={0})
    req = _req()
    assert chk.append(req, [ord("a"), 0, ord("b")]) == 2 and req.finish_reason == "stop"
    req = _req(ignore_eos=True, max_tokens=3)
    assert chk.append(req, [ord("a"), 0, ord("b"), ord("c")]) == 3 and req.finish_reason == "length"
    assert chk.completion(req)[0] == "ab"
    req = _req(ignore_eos=True, stop_token_ids=(0,))
    assert chk.append(req, [ord("a"), 0]) == 2 and req.finish_reason == "stop"
