"""Shared by the sampling-parameter tests (logits processors, logprobs, n): engine runs with
per-row parameters, an independent float64 reference of the distribution a token is drawn from
(transformers logits, vLLM's order of processing), and a test drafter that proposes a fixed
number of the target's likeliest tokens (so drafts are accepted often and rejected sometimes)."""
from __future__ import annotations

import functools
import json
from collections import Counter

import torch

from specbatch.data import RowRequest
from specbatch.engine import Engine, EngineOptions
from specbatch.params import SamplingParams
from specbatch.recipe import SamplingDefaults
from specbatch.speculative.accept import Acceptance
from specbatch.speculative.drafter import Drafter, Proposal
from specbatch.speculative.factory import SpecConfig
from specbatch.speculative.tree import ancestor_mask

EOS = 0
VOCAB = 320
LENS = (4, 19, 9, 27, 6, 13)


def prompts(n: int = len(LENS), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (LENS[i % len(LENS)],), generator=g).tolist() for i in range(n)]


def write_jsonl(path, objs) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def vanilla_job(model, inp: str, out, max_tokens: int, **sampling) -> dict:
    """`specbatch run` (the job) with the vanilla recipe on `model`, CPU, batch 4."""
    from specbatch.job import JobOptions, run_job
    from specbatch.recipe import load_recipe

    recipe = load_recipe("vanilla").with_overrides(model=str(model), batch_size=4, max_tokens=max_tokens, **sampling)
    return run_job(inp, recipe, JobOptions(output=str(out), device="cpu"))


def rows(prompt_ids: list[list[int]], per_row: list[dict] | dict) -> list[RowRequest]:
    if isinstance(per_row, dict):
        per_row = [per_row] * len(prompt_ids)
    return [RowRequest(row=i, id=str(i), prompt_token_ids=p, overrides=dict(o))
            for i, (p, o) in enumerate(zip(prompt_ids, per_row))]


def run(model, rows_, bs=4, spec=SpecConfig(), drafter=None, logprobs_mode="processed_logprobs",
        **defaults) -> list[dict]:
    eng = Engine(model, EngineOptions(batch_size=bs, device="cpu", dtype="float32", spec=spec,
                                      logprobs_mode=logprobs_mode), drafter=drafter)
    recs = sorted(eng.generate(rows_, SamplingDefaults(**{"max_tokens": 20, **defaults})), key=lambda r: r["row"])
    assert all(r["error"] is None for r in recs), [r["error"] for r in recs]
    return recs


def ids(recs) -> list[list[int]]:
    return [r["output_token_ids"] for r in recs]


# ------------------------------------------------------------------------ the reference law


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()


def hf_logits(model_dir, seqs: list[list[int]]) -> torch.Tensor:
    """The last position's logits [len(seqs), V] in float64 (one forward per distinct length)."""
    m = hf_model(str(model_dir))
    out = torch.empty(len(seqs), m.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for n in sorted({len(s) for s in seqs}):
            idx = [i for i, s in enumerate(seqs) if len(s) == n]
            out[idx] = m(torch.tensor([seqs[i] for i in idx])).logits[:, -1]
    return out


def all_logits(model_dir, seq: list[int]) -> torch.Tensor:
    """Logits at every position of seq [len(seq), V] in float64."""
    m = hf_model(str(model_dir))
    with torch.no_grad():
        return m(torch.tensor([seq])).logits[0]


def processed(raw: torch.Tensor, p: SamplingParams, generated: list[int], prompt: list[int],
              eos_ids=(EOS,)) -> torch.Tensor:
    """vLLM's order in float64: min_tokens, logit_bias, repetition, frequency, presence."""
    x = raw.double().clone()
    if len(generated) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)):
            if t < len(x):
                x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    counts = Counter(generated)
    r = p.repetition_penalty or 1.0
    for v in set(prompt) | set(counts):
        x[v] = x[v] / r if x[v] > 0 else x[v] * r
    for v, c in counts.items():
        x[v] -= p.frequency_penalty * c + p.presence_penalty
    return x


def law(raw: torch.Tensor, p: SamplingParams, generated: list[int], prompt: list[int]) -> torch.Tensor:
    """The distribution the next token is drawn from (float64): processing, then temperature,
    min-p, top-k, top-p; greedy rows: the softmax of the processed logits (what logprobs use)."""
    x = processed(raw, p, generated, prompt)
    t = p.temperature or 0.0
    if t == 0.0:
        return x.softmax(-1)
    q = (x / t).softmax(-1)
    keep = q >= (p.min_p or 0.0) * q.max()
    order = [int(v) for v in q.argsort(descending=True) if keep[v]]
    if p.top_k:
        order = order[: p.top_k]
    total, mass, chosen = float(q[order].sum()), 0.0, []
    for v in order:
        if chosen and mass >= (p.top_p if p.top_p is not None else 1.0):
            break
        chosen.append(v)
        mass += float(q[v]) / total
    out = torch.zeros_like(q)
    out[chosen] = q[chosen]
    return out / out.sum()


# ------------------------------------------------------------------------ a test drafter


class LikelyTree(Drafter):
    """Proposes, below the root, the `width` likeliest tokens of a given law at depth 1 and, under
    each, the `width` likeliest at depth 2 (N = 1 + w + w^2): a deterministic function of the
    sequence so far, as lossless acceptance requires. `guess(history) -> [V] law` (None: a fixed
    set). Drafts that miss the sampled token exercise the residual draws."""

    graphable = False

    def __init__(self, guess, width: int = 2):
        self.guess, self.w = guess, width
        self.num_draft_tokens = 1 + width + width * width
        self.max_depth = 2
        self.seq: dict[int, list[int]] = {}
        self._memo: dict[tuple[int, ...], list[int]] = {}
        par = [-1] + [0] * width + [1 + i for i in range(width) for _ in range(width)]
        dep = [0] + [1] * width + [2] * (width * width)
        self.parents = torch.tensor([par])
        self.depths = torch.tensor([dep])
        self.mask = ancestor_mask(self.parents, 2)

    def prefill(self, rows, captured, first_tokens):
        for b, s in enumerate(rows.slots.tolist()):
            self.seq[s] = [int(first_tokens[b])]

    def _top(self, history):
        key = tuple(history)
        if key not in self._memo:
            self._memo[key] = self.guess(history).topk(self.w).indices.tolist()
        return self._memo[key]

    def propose(self, slots, last_tokens, lens, kv_bound=None, width=None):
        B, N = slots.shape[0], self.num_draft_tokens
        out = []
        for s in slots.tolist():
            h = self.seq[s]
            first = self._top(h)
            second = [t for a in first for t in self._top(h + [a])]
            out.append(first + second)
        tokens = torch.cat([last_tokens[:, None], torch.tensor(out, dtype=torch.int64)], dim=1)
        return Proposal(tokens, self.parents.expand(B, N), self.depths.expand(B, N), self.mask.expand(B, N, N))

    def extend(self, slots, lens, acc: Acceptance, captured, kv_bound=None):
        for b, s in enumerate(slots.tolist()):
            self.seq[s] += acc.tokens[b, : int(acc.num[b])].tolist()
