"""A request in flight: its tokens, stop conditions and per-request speculation counters."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .sampling import SamplingParams


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class Request:
    row: int
    id: str | int
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int                        # max_tokens capped by the slot's context
    keep: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None         # the OpenAI response it takes: "chat" or "completion"
    request_model: str | None = None    # OpenAI batch lines: the body's model
    batch_line: bool = False            # an OpenAI batch line
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None    # "stop" | "length"
    stop_hit: bool = False              # finished on a stop string: text is cut at it
    verify_steps: int = 0               # target forwards that emitted tokens (the prefill counts)
    draft_tokens: int = 0               # draft tokens proposed
    accepted_tokens: int = 0            # draft tokens accepted
    histogram: list[int] = field(default_factory=list)   # histogram[i]: steps that accepted i drafts

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Decides, token by token, whether a request is finished."""

    def __init__(self, tokenizer: Detokenizer, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def append(self, req: Request, tokens: list[int]) -> int:
        """Append tokens in order until the request finishes; returns how many were kept."""
        for n, tok in enumerate(tokens, start=1):
            req.output_ids.append(tok)
            if self._stops(req, tok):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= req.max_new:
                req.finish_reason = "length"
            if req.finished:
                return n
        return len(tokens)

    def _stops(self, req: Request, tok: int) -> bool:
        p = req.params
        if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
            return True
        if p.stop:
            longest = max(len(s) for s in p.stop)
            # A stop string of L chars spans at most 4L byte-level tokens (4 bytes per char).
            tail = self.tokenizer.decode(req.output_ids[-(4 * longest + 4):], skip_special_tokens=True)
            if any(s in tail for s in p.stop):
                req.stop_hit = True
                return True
        return False

    def completion_text(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True)
        if req.stop_hit:
            cuts = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
            if cuts:
                text = text[: min(cuts)]
        return text
