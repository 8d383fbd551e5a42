"""prompt_logprobs (vLLM's SamplingParams.prompt_logprobs): each prompt token's logprob under the
model's raw distribution at the position before it, its rank, and the top k; null for the first
token. Equal to transformers' float64 log-softmax, the same under speculation, in the native
column (only when some row asked), in vLLM's OpenAI extension (chat body / completions choice),
read back exactly from a finished OpenAI output, and settable by row, recipe and flag."""
from __future__ import annotations

import json
from typing import Optional

import pyarrow.parquet as pq
import pytest
import torch
from pydantic import BaseModel

from processors_helpers import all_logits, prompts, rows, run, vanilla_job, write_jsonl
from specbatch.data.openai_out import from_openai_line, to_openai_line
from specbatch.speculative.factory import SpecConfig

pytestmark = pytest.mark.usefixtures("one_thread")


class Logprob(BaseModel):             # vLLM's Logprob as its OpenAI server writes it
    logprob: float
    rank: Optional[int]
    decoded_token: Optional[str]


class ChatBody(BaseModel):
    prompt_logprobs: Optional[list[Optional[dict[str, Logprob]]]] = None


def _check_against_reference(model_dir, prompt, entries, k):
    ref = torch.log_softmax(all_logits(model_dir, prompt), dim=-1)           # [n, V] float64
    assert entries[0] is None and len(entries) == len(prompt)
    for j, e in enumerate(entries[1:], start=1):
        row = ref[j - 1]
        assert e["token_id"] == prompt[j]
        assert e["logprob"] == pytest.approx(float(row[prompt[j]]), abs=1e-4)
        assert e["rank"] == int((row > row[prompt[j]] + 1e-9).sum()) + 1
        assert [t["token_id"] for t in e["top_logprobs"]] == row.topk(k).indices.tolist()
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


def test_equal_the_reference_and_the_same_under_speculation(target_dir, eagle3_dir):
    ps = prompts(3)
    per_row = [{"prompt_logprobs": 3}, {}, {"prompt_logprobs": 0, "temperature": 0.9, "seed": 2}]
    vanilla = run(target_dir, rows(ps, per_row), max_tokens=4)
    spec = run(target_dir, rows(ps, per_row), spec=SpecConfig("eagle3", 3, 1, 4, str(eagle3_dir)), max_tokens=4)
    a, b, c = vanilla
    _check_against_reference(target_dir, ps[0], a["prompt_logprobs"], 3)
    assert b["prompt_logprobs"] is None
    assert all(e["top_logprobs"] == [] for e in c["prompt_logprobs"][1:])   # k = 0: the token and its rank only
    for x, y in zip(vanilla, spec):
        assert (x["prompt_logprobs"] is None) == (y["prompt_logprobs"] is None)
        for e, f in zip(x["prompt_logprobs"] or [], y["prompt_logprobs"] or []):
            assert (e is None and f is None) or (e["rank"] == f["rank"] and e["logprob"] == pytest.approx(f["logprob"], abs=1e-5))


_write = write_jsonl


def _job(model, inp, out, **sampling):
    return vanilla_job(model, inp, out, 3, **sampling)


def test_native_column_only_when_asked(tiny_model, tmp_path):
    ps = prompts(2)
    inp = _write(tmp_path / "in.jsonl", [{"prompt_token_ids": p} for p in ps])
    _job(tiny_model, inp, tmp_path / "plain.parquet")
    assert "prompt_logprobs" not in pq.read_table(tmp_path / "plain.parquet").column_names
    _job(tiny_model, inp, tmp_path / "flag.parquet", prompt_logprobs=2)     # the recipe key / --prompt-logprobs
    for r, p in zip(pq.read_table(tmp_path / "flag.parquet").to_pylist(), ps):
        assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == len(p)
        assert all(len(e["top_logprobs"]) == 2 and e["rank"] >= 1 for e in r["prompt_logprobs"][1:])
    inp = _write(tmp_path / "one.jsonl", [{"prompt_token_ids": ps[0], "prompt_logprobs": 1}, {"prompt_token_ids": ps[1]}])
    _job(tiny_model, inp, tmp_path / "one.jsonl.out.jsonl")
    first, second = [json.loads(x) for x in open(tmp_path / "one.jsonl.out.jsonl")]
    assert len(first["prompt_logprobs"]) == len(ps[0]) and second["prompt_logprobs"] is None


def test_openai_shapes_and_read_back(tiny_model, tmp_path):
    ps = prompts(2)
    inp = _write(tmp_path / "batch.jsonl", [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "def f(x):"}], "prompt_logprobs": 2, "max_tokens": 3}},
        {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": ps[1], "prompt_logprobs": 1, "n": 2, "temperature": 1.0, "max_tokens": 3}},
        {"custom_id": "none", "method": "POST", "url": "/v1/completions", "body": {"prompt": ps[0], "max_tokens": 2}},
    ])
    _job(tiny_model, inp, tmp_path / "out.jsonl")
    chat, comp, none = [json.loads(x) for x in open(tmp_path / "out.jsonl")]
    body = ChatBody.model_validate(chat["response"]["body"])
    n_prompt = chat["response"]["body"]["usage"]["prompt_tokens"]
    assert body.prompt_logprobs[0] is None and len(body.prompt_logprobs) == n_prompt
    for d in body.prompt_logprobs[1:]:
        ranks = sorted(v.rank for v in d.values())
        assert 2 <= len(d) <= 3 and ranks[:2] == [1, 2]          # the top 2, and the prompt's token if not among them
        assert all(v.logprob <= 0 for v in d.values())
    choices = comp["response"]["body"]["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    assert len(choices[0]["prompt_logprobs"]) == len(ps[1])
    assert "prompt_logprobs" not in none["response"]["body"] and "prompt_logprobs" not in none["response"]["body"]["choices"][0]

    def content(response):          # the ids take the input row's digest, which the reopen passes (not here)
        return {**response, "request_id": None, "body": {**response["body"], "id": None}}

    for line in (chat, comp, none):                                  # a finished output reopened writes the same
        assert content(to_openai_line(from_openai_line(line), "m")["response"]) == content(line["response"])
