"""A Completion read as vLLM's RequestOutput is read: `outputs[i]` with text, token_ids,
finish_reason, stop_reason, cumulative_logprob and logprobs as vLLM's (one {token id: Logprob}
per generated token), and prompt_logprobs as vLLM's, so a migrated `o.outputs[0].text` or an
lm-eval loglikelihood over `o.prompt_logprobs` runs unchanged."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .records import choice_stop_reason


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: the token's logprob, its rank in the distribution (1 = the most likely; None
    only for a token outside the top alternatives of an output written before ranks were) and its
    text."""
    logprob: float
    rank: int | None
    decoded_token: str | None


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's CompletionOutput: one of a prompt's n completions."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None          # the sampled tokens' logprobs summed; None: not asked
    logprobs: list[dict[int, Logprob]] | None  # per generated token: it and its top alternatives
    finish_reason: str | None
    stop_reason: int | str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


def _position(e: Mapping[str, Any]) -> dict[int, Logprob]:
    """One position's column entry as vLLM's {token_id: Logprob}: the token with its rank, then the
    top ones with their places over it (vLLM builds the dict so: on a tie the token's place in the
    top list wins); an output written before ranks were has none for the token."""
    top = {t["token_id"]: Logprob(t["logprob"], rank, t["token"])
           for rank, t in enumerate(e.get("top_logprobs") or (), start=1)}
    return {e["token_id"]: Logprob(e["logprob"], e.get("rank"), e["token"]), **top}


def _vllm_logprobs(entries: Sequence[Mapping[str, Any]] | None) -> list[dict[int, Logprob]] | None:
    return None if entries is None else [_position(e) for e in entries]


def _output(index: int, text: str | None, token_ids: Sequence[int] | None, logprobs: Any,
            finish_reason: str | None, stop_reason: int | str | None) -> CompletionOutput:
    entries = _vllm_logprobs(logprobs)
    total = None if logprobs is None else float(sum(e["logprob"] for e in logprobs))
    return CompletionOutput(index, text or "", list(token_ids or ()), total, entries, finish_reason, stop_reason)


def prompt_logprobs(record: Mapping[str, Any]) -> list[dict[int, Logprob] | None] | None:
    """A record's prompt_logprobs column as vLLM's RequestOutput.prompt_logprobs: per prompt token
    (None for the first) the token's Logprob with its rank, and its top alternatives'."""
    column = record.get("prompt_logprobs")
    if column is None:
        return None
    return [None if e is None else _position(e) for e in column]


def outputs(record: Mapping[str, Any]) -> list[CompletionOutput]:
    """A record's completions as vLLM's `RequestOutput.outputs` (none for a row that failed)."""
    if record.get("error") is not None:
        return []
    choices = record.get("choices")
    if not choices:
        return [_output(0, record.get("completion"), record.get("output_token_ids"), record.get("logprobs"),
                        record.get("finish_reason"), record.get("stop_reason"))]
    return [_output(c["index"], c["completion"], c.get("output_token_ids"), c.get("logprobs"), c["finish_reason"],
                    choice_stop_reason(c)) for c in choices]
