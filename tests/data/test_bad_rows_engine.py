"""One bad row never stops a job: in the engine, any exception while building a request is the
row's error, huge numbers and tiny temperatures behave, huge prompts are bounded by the context
without tokenizing them whole, and records keep their id's type."""
from __future__ import annotations

import time

import pytest

from specbatch.data import RowError, RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.recipe import SamplingDefaults


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, EngineOptions(batch_size=2, device="cpu", max_model_len=64))


# ---- any exception building a request is the row's error ------------------------------


def test_tokenizer_exception_is_the_rows_error(engine):
    bad = RowRequest(row=0, id="a", prompt="ab\ud800c", where="in.jsonl:1")   # built without parse_row
    rec = engine.rows.request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["id"] == "a"
    assert rec["error"].startswith("in.jsonl:1: cannot tokenize the prompt (TypeError: ")
    assert "\n" not in rec["error"]


def test_any_exception_while_encoding_is_the_rows_error(engine):
    bad = RowRequest(row=4, id=4, messages=[{"role": "user", "content": 5}])   # built without parse_row
    rec = engine.rows.request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["error"].startswith("row 4: cannot tokenize the prompt (")
    assert "Error: " in rec["error"] and "\n" not in rec["error"]


def test_sampling_parameter_exception_is_the_rows_error(engine):
    bad = RowRequest(row=1, id="b", prompt="def add(a, b):", overrides={"top_k": "lots"})
    rec = engine.rows.request(bad, SamplingDefaults())
    assert isinstance(rec, dict) and rec["error"].startswith("row 1: ") and "ValueError" in rec["error"]


def test_a_bad_row_does_not_stop_generate(engine):
    rows = [RowRequest(row=0, id=0, prompt="def add(a, b):"),
            RowRequest(row=1, id=1, prompt="x\udc00"),
            RowRequest(row=2, id=2, prompt="import os", overrides={"temperature": object()}),
            RowRequest(row=3, id=3, prompt="class Point:")]
    recs = sorted(engine.generate(rows, SamplingDefaults(max_tokens=3)), key=lambda r: r["row"])
    assert [r["row"] for r in recs] == [0, 1, 2, 3]
    assert [r["error"] is None for r in recs] == [True, False, False, True]


# ---- numbers beyond the vocabulary ------------------------------------------------------


def test_huge_top_k_runs_in_the_engine(engine):
    """top_k beyond the vocabulary means no filter; the tensor build does not overflow."""
    rows = [RowRequest(row=0, id=0, prompt="def add(a, b):",
                       overrides={"top_k": 2**31 - 1, "temperature": 1.0, "seed": 1})]
    (rec,) = engine.generate(rows, SamplingDefaults(max_tokens=3, ignore_eos=True))
    assert rec["error"] is None and rec["completion_tokens"] == 3


# ---- tiny temperatures are greedy ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 9e-6])
def test_tiny_temperature_is_greedy(engine, temperature):
    prompts = ["def add(a, b):", "import os\n", "for i in range(10):"]

    def run(overrides, **defaults):
        rows = [RowRequest(row=i, id=i, prompt=p, overrides=dict(overrides)) for i, p in enumerate(prompts)]
        d = SamplingDefaults(**{"max_tokens": 8, "ignore_eos": True, "seed": 5, **defaults})
        return [r["output_token_ids"] for r in sorted(engine.generate(rows, d), key=lambda r: r["row"])]

    greedy = run({"temperature": 0.0})
    assert run({"temperature": temperature}) == greedy                  # a row override
    assert run({}, temperature=temperature) == greedy                   # the recipe / CLI default
    assert run({"temperature": 1.0}) != greedy                          # sampling still samples


# ---- huge prompts are bounded by the context ------------------------------------------------


def test_huge_prompt_is_rejected_without_tokenizing(engine):
    text = "def add(a, b):\n    return a + b\n" * 100_000                # 3.2 MB
    # CPU time, not wall time: tokenizing it would take seconds of CPU; a worker descheduled on
    # a busy box (tests run in parallel) must not fail the bound
    t0 = time.process_time()
    rec = engine.rows.request(RowRequest(row=0, id=0, prompt=text, where="in.jsonl:1"), SamplingDefaults())
    took = time.process_time() - t0
    assert rec["error"].startswith(f"in.jsonl:1: prompt has {len(text)} bytes, more than a context of "
                                   f"{engine.max_len} tokens")
    assert took < 0.3, took
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    t0 = time.process_time()
    rec = engine.rows.request(RowRequest(row=1, id=1, messages=msgs), SamplingDefaults())
    assert f"prompt has {len(text) + 8} bytes" in rec["error"] and time.process_time() - t0 < 0.3


def test_long_prompt_is_tokenized_by_a_prefix_first(engine, monkeypatch):
    from specbatch import prompts

    monkeypatch.setitem(prompts._BYTES_PER_TOKEN, engine.tokenizer, 10**9)   # skip the byte bound
    text = "for i in range(10):\n    print(i * i)\n" * 100_000          # 3.7 MB
    calls = []
    real = type(engine.tokenizer).__call__

    def spy(self, t, *a, **kw):
        calls.append(len(t))
        return real(self, t, *a, **kw)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", spy)
    t0 = time.process_time()
    rec = engine.rows.request(RowRequest(row=0, id=0, prompt=text, where="in.jsonl:1"), SamplingDefaults())
    assert time.process_time() - t0 < 0.5
    assert rec["error"] == (f"in.jsonl:1: prompt has more than {engine.max_len} tokens but the context is "
                            f"{engine.max_len} tokens (the model's limit, --max-model-len, or what the KV pool holds)")
    assert calls == [engine.max_len * 8]


def test_prompts_near_the_context_keep_the_usual_messages(engine):
    from specbatch.prompts import max_bytes_per_token

    assert max_bytes_per_token(engine.tokenizer) >= 16
    text = "def add(a, b):\n    return a + b\n" * 6                            # > 64 tokens, < 64 * 8 bytes
    rec = engine.rows.request(RowRequest(row=0, id=0, prompt=text, where="w"), SamplingDefaults())
    assert rec["error"].startswith("w: prompt has ") and "tokens but the context is 64 tokens" in rec["error"]
    assert rec["prompt_tokens"] > 64
    req = engine.rows.request(RowRequest(row=0, id=0, prompt="def add(a, b):"), SamplingDefaults())
    assert not isinstance(req, dict)


# ---- ids keep their type ---------------------------------------------------------------------


def test_records_carry_the_id_type(engine):
    rows = [RowRequest(row=0, id=41, prompt="def add(a, b):"), RowRequest(row=1, id="41", prompt="import os"),
            RowError(row=2, id=2, error="w: bad")]
    recs = {r["row"]: r for r in engine.generate(rows, SamplingDefaults(max_tokens=2))}
    assert recs[0]["id"] == 41 and recs[1]["id"] == "41" and recs[2]["id"] == 2
