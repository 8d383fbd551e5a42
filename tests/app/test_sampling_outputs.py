"""What the new sampling fields write: n choices (native `choices` column and OpenAI choices[]),
logprobs (native column and the OpenAI chat / completions shapes, read by a consumer built from
the published field names), independent choices, resume and exactly-once per input row with n,
and the columns appearing only when some row asked."""
from __future__ import annotations

import json
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from chi_square import chi2, chi2_threshold
from processors_helpers import hf_logits, law, prompts, rows, run, vanilla_job, write_jsonl
from specbatch.data.openai_out import from_openai_line, to_openai_line
from specbatch.job import JobOptions, run_job
from specbatch.params import SamplingParams
from specbatch.recipe import load_recipe

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- an OpenAI client's view of logprobs ----------------------------------------------------

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: Optional[list[TokenLogprob]]


class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


_write = write_jsonl


def _job(model, inp, out, **sampling):
    return vanilla_job(model, inp, out, 6, **sampling)


def _lines(path):
    return [json.loads(x) for x in open(path)]


def test_n_choices_and_logprobs_native(tiny_model, tmp_path):
    ps = prompts(4)
    inp = _write(tmp_path / "in.jsonl", [
        {"prompt_token_ids": ps[0], "n": 3, "temperature": 1.0, "logprobs": 2},
        {"prompt_token_ids": ps[1]},
        {"prompt_token_ids": ps[2], "n": 3},                                  # greedy: one run, 3 copies
        {"prompt_token_ids": ps[3], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 4},
        {"prompt_token_ids": ps[0], "logprobs": 0, "max_tokens": 5},            # greedy: every token ranks 1
    ])
    _job(tiny_model, inp, tmp_path / "out.jsonl")
    recs = _lines(tmp_path / "out.jsonl")
    a, b, c, d, e = recs
    assert [x["rank"] for x in e["logprobs"]] == [1] * 5 and all(x["top_logprobs"] == [] for x in e["logprobs"])
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    assert len({tuple(ch["output_token_ids"]) for ch in a["choices"]}) > 1            # independent draws
    assert a["completion"] == a["choices"][0]["completion"]
    assert a["completion_tokens"] == sum(ch["completion_tokens"] for ch in a["choices"])
    assert a["logprobs"] == a["choices"][0]["logprobs"]
    for ch in a["choices"]:
        assert len(ch["logprobs"]) == ch["completion_tokens"]
        for x, tok in zip(ch["logprobs"], ch["output_token_ids"]):
            assert x["token_id"] == tok and len(x["top_logprobs"]) == 2 and x["logprob"] <= 0
            tops = x["top_logprobs"]
            assert tops[0]["logprob"] >= tops[1]["logprob"]
            # the sampled token's rank, as vLLM reports it: its place among the top ones, else past them
            at = [t["token_id"] for t in tops].index(tok) + 1 if tok in [t["token_id"] for t in tops] else None
            assert x["rank"] == at if at else (x["rank"] > 2 and tops[1]["logprob"] >= x["logprob"])
    assert b["choices"] is None and b["logprobs"] is None
    assert len({ch["completion"] for ch in c["choices"]}) == 1 and c["spec"]["verify_steps"] == c["choices"][0]["completion_tokens"]
    # choice 0 is the row itself: a run with n = 1 and the same seed draws the same tokens
    _job(tiny_model, _write(tmp_path / "one.jsonl", [{"prompt_token_ids": ps[3], "temperature": 1.0, "seed": 5,
                                                       "max_tokens": 4}]), tmp_path / "one.out.jsonl")
    (one,) = _lines(tmp_path / "one.out.jsonl")
    assert one["completion"] == d["choices"][0]["completion"] and "choices" not in one


def test_columns_only_when_asked(tiny_model, tmp_path):
    inp = _write(tmp_path / "in.jsonl", [{"prompt_token_ids": p} for p in prompts(2)])
    _job(tiny_model, inp, tmp_path / "plain.parquet")
    names = pq.read_table(tmp_path / "plain.parquet").column_names
    assert "logprobs" not in names and "choices" not in names
    _job(tiny_model, inp, tmp_path / "lp.parquet", logprobs=1, n=2)
    t = pq.read_table(tmp_path / "lp.parquet").to_pylist()
    assert all(len(r["choices"]) == 2 and len(r["logprobs"]) == r["choices"][0]["completion_tokens"] for r in t)


def test_openai_output_with_n_and_logprobs(tiny_model, tmp_path):
    ps = prompts(3)
    inp = _write(tmp_path / "batch.jsonl", [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "def f(x):"}], "n": 2, "temperature": 0.8,
                  "logprobs": True, "top_logprobs": 3, "max_tokens": 5}},
        {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ps[1], "logprobs": 2, "max_tokens": 5}},
        {"custom_id": "none", "method": "POST", "url": "/v1/completions", "body": {"prompt": ps[2], "max_tokens": 3}},
    ])
    _job(tiny_model, inp, tmp_path / "out.jsonl")
    chat, comp, none = _lines(tmp_path / "out.jsonl")
    body = chat["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in body["choices"])
    for c in body["choices"]:
        lp = ChatLogprobs.model_validate(c["logprobs"])
        assert all(len(t.top_logprobs) == 3 for t in lp.content)
        assert all(t.bytes == list(t.token.encode("utf-8", "replace")) for t in lp.content)
    lp = CompletionLogprobs.model_validate(comp["response"]["body"]["choices"][0]["logprobs"])
    text = comp["response"]["body"]["choices"][0]["text"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the top 2 and the sampled token (keyed by text: ids decoding alike share a key, as in vLLM)
        assert tok in top and 1 <= len(top) <= 3 and max(top.values()) >= val
    assert "".join(lp.tokens).startswith(text[:1])
    assert none["response"]["body"]["choices"][0]["logprobs"] is None
    # a finished OpenAI output read back (to add rows) writes the same lines again
    for line in (chat, comp, none):
        again = to_openai_line(from_openai_line(line), "m")
        assert again["response"]["body"]["choices"] == line["response"]["body"]["choices"]


def test_resume_with_n_is_exactly_once(tiny_model, tmp_path):
    inp = _write(tmp_path / "in.jsonl", [{"prompt_token_ids": p, "n": 3, "temperature": 1.0, "max_tokens": 3 + i % 3}
                                         for i, p in enumerate(prompts(12))])
    _job(tiny_model, inp, tmp_path / "clean.jsonl")
    seen = []

    def stop_after_5(event, info):
        if event == "record":
            seen.append(info["record"]["row"])
            if len(seen) == 5:
                raise KeyboardInterrupt

    recipe = load_recipe("vanilla").with_overrides(model=str(tiny_model), batch_size=4, max_tokens=6)
    with pytest.raises(KeyboardInterrupt):
        run_job(inp, recipe, JobOptions(output=str(tmp_path / "cut.jsonl"), device="cpu"), progress=stop_after_5)
    summary = run_job(inp, recipe, JobOptions(output=str(tmp_path / "cut.jsonl"), device="cpu"))
    assert summary["resumed"] == 5 and summary["requests"] == 7
    clean, cut = _lines(tmp_path / "clean.jsonl"), _lines(tmp_path / "cut.jsonl")
    assert [r["row"] for r in cut] == list(range(12))
    assert [r["choices"] for r in cut] == [r["choices"] for r in clean]
    assert all(len(r["choices"]) == 3 for r in cut)


def test_n_choices_are_independent_samples_of_the_law(target_dir):
    """One row, n = 600 choices of one token: the first tokens follow the row's law (a repeated
    seed or correlated streams would not)."""
    prompt = prompts()[2]
    params = {"temperature": 1.0, "top_k": 6, "repetition_penalty": 1.5, "n": 600, "seed": 3}
    (rec,) = run(target_dir, rows([prompt], params), 32, max_tokens=1)
    first = torch.tensor([c["output_token_ids"][0] for c in rec["choices"]])
    q = law(hf_logits(target_dir, [prompt])[0], SamplingParams(**params).resolved(), [], prompt)
    support = q.nonzero()[:, 0]
    assert torch.isin(first, support).all()
    counts = torch.bincount(first, minlength=q.shape[0])[support].float()
    stat, dof = chi2(counts, q[support].float() * len(first))
    assert stat < chi2_threshold(dof), (stat, dof)


def test_library_completion_carries_choices_and_logprobs(tiny_model):
    from specbatch import LLM

    llm = LLM(model=str(tiny_model), device="cpu", batch_size=2)
    a, b = llm.generate([{"prompt_token_ids": prompts(1)[0], "n": 2, "temperature": 1.0, "logprobs": 1},
                         prompts(2)[1]], {"max_tokens": 3})
    assert len(a.choices) == 2 and len(a.logprobs) == len(a.choices[0]["logprobs"]) == 3
    assert b.choices is None and b.logprobs is None
    (c,) = llm.generate([prompts(1)[0]], {"max_tokens": 3, "logprobs": 2})
    assert [len(e["top_logprobs"]) for e in c.logprobs] == [2, 2, 2]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "openai"])
def test_each_choice_keeps_what_stopped_it(tiny_model, tmp_path, fmt):
    """n > 1: every choice says which stop token id or stop string ended it (vLLM's per-output
    stop_reason), in the choices column and in OpenAI choices[], and a reopened output keeps them."""
    ps = prompts(4)
    stop_ids = list(range(3, 200, 2))                      # choices stop early, on different ids
    body = {"n": 4, "temperature": 1.0, "seed": 11, "stop_token_ids": stop_ids, "max_tokens": 6}
    if fmt == "openai":
        inp = _write(tmp_path / "in.jsonl", [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                              "body": {"prompt": p, **body}} for i, p in enumerate(ps)])
    else:
        inp = _write(tmp_path / "in.jsonl", [{"prompt_token_ids": p, **body} for p in ps])
    out = tmp_path / ("out.parquet" if fmt == "parquet" else "out.jsonl")
    _job(tiny_model, inp, out)
    if fmt == "openai":
        later = []
        for line in _lines(out):
            choices = line["response"]["body"]["choices"]
            for c in choices:
                s = c["stop_reason"]
                assert s is None or (c["finish_reason"] == "stop" and isinstance(s, int) and s in stop_ids)
                later += [s] if c["index"] > 0 and s is not None else []
            again = to_openai_line(from_openai_line(line), "m")
            assert again["response"]["body"]["choices"] == choices
        assert len(set(later)) > 2                         # choices 1..n-1 carry their own
        return
    recs = pq.read_table(out).to_pylist() if fmt == "parquet" else _lines(out)
    stopped = 0
    for r in recs:
        for c in r["choices"]:
            last = c["output_token_ids"][-1]
            assert c["stop_string"] is None
            if c["finish_reason"] == "stop" and last in stop_ids:
                assert c["stop_token_id"] == last
                stopped += c["index"] > 0
            else:
                assert c["stop_token_id"] is None              # EOS or length
        first = r["choices"][0]["stop_token_id"]
        # a Parquet file holds stop_reason as text (one schema whatever stopped its rows); JSONL the id
        assert r["stop_reason"] == (str(first) if fmt == "parquet" and first is not None else first)
    assert stopped > 2
    if fmt == "parquet":
        assert pq.read_schema(out).field("stop_reason").type == pa.string()
