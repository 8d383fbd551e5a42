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
    stop_token: bool = False            # finished on EOS or a stop token id: its text is left out
    stop_id: int | None = None          # finished on this stop_token_ids entry (not EOS)
    logprobs: list | None = None        # per kept token: (logprob, rank, top ids, top logprobs); None: not asked
    prompt_logprobs: list | None = None  # per prompt token after the first: (logprob, rank, top ids, top logprobs)
    choice: int = 0                     # which of the row's n completions
    group: Any = None                   # the row's choices (engine.rows.Choices) when n > 1
    verify_steps: int = 0               # target forwards that emitted tokens (the prefill counts)
    draft_tokens: int = 0               # draft tokens proposed
    accepted_tokens: int = 0            # draft tokens accepted
    histogram: list[int] = field(default_factory=list)   # histogram[i]: steps that accepted i drafts
    waited_for_pages: bool = False      # admission found its pages short at least once
    preempted: int = 0                  # times its pages were taken back mid-run (it then resumes by recompute)
    admitted_at: int = 0                # admission order: the latest admitted is preempted first
    cached_rows: int = 0                # leading prompt positions found in the KV pool (prefill skips them)
    text_context: tuple[list[int], str] | None = None   # StopChecker's cache: prompt tokens the text is decoded
    # after, and their text

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def context_len(self) -> int:
        """len(context_ids), without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def context_ids(self) -> list[int]:
        """The tokens a prefill computes: the prompt, and for a request resumed after preemption
        what it had generated (the next token follows them)."""
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Decides, token by token, whether a request is finished."""

    def __init__(self, tokenizer: Detokenizer, eos_ids: set[int], primary_eos: int | None = None):
        """`primary_eos`: the tokenizer's EOS, whose stop has no stop_reason; the model's other EOS
        ids (generation_config.json's) report theirs, as vLLM adds them to stop_token_ids (None: no
        EOS id reports one)."""
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.primary_eos = primary_eos

    def append(self, req: Request, tokens: list[int]) -> int:
        """Append tokens in order until the request finishes; returns how many were kept. Before
        min_tokens tokens, nothing stops a request (as vLLM: EOS and stop ids are masked then, and
        a stop string counts from the token after the min_tokens-th)."""
        min_tokens = req.params.min_tokens
        for n, tok in enumerate(tokens, start=1):
            req.output_ids.append(tok)
            if len(req.output_ids) >= min_tokens and self._stops(req, tok):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= req.max_new:
                req.finish_reason = "length"
            if req.finished:
                return n
        return len(tokens)

    def _stops(self, req: Request, tok: int) -> bool:
        p = req.params
        eos = tok in self.eos_ids and not p.ignore_eos
        if tok in p.stop_token_ids or eos:
            req.stop_token = True
            # the tokenizer's EOS is checked first, as vLLM does
            req.stop_id = None if eos and self.primary_eos in (None, tok) else tok
            return True
        if p.stop and len(req.output_ids) > p.min_tokens:
            longest = max(len(s) for s in p.stop)
            # A stop string of L chars spans at most 4L byte-level tokens (4 bytes per char).
            window = req.output_ids[-(4 * longest + 4):]
            skip = p.skip_special_tokens
            at_start = len(window) == len(req.output_ids)     # the output's start reads after the prompt

            def decode(ids: list[int]) -> str:
                return self._decode(req, ids) if at_start else self.tokenizer.decode(ids, skip_special_tokens=skip)
            tail = decode(window)
            hit = any(s in tail for s in p.stop)
            if hit and p.min_tokens > 0:
                # Only a stop string ending in this token's text: one ending in the first min_tokens
                # tokens' text does not count (vLLM's detokenizer skips their text).
                prev = _unchanged(decode(window[:-1]), tail)
                hit = any(s in tail[max(0, prev - len(s) + 1):] for s in p.stop)
            if hit:
                req.stop_hit = True
                return True
        return False

    def completion(self, req: Request) -> tuple[str, int | str | None]:
        """(The generated text, the stop reason). The text: special tokens skipped unless
        skip_special_tokens is false, cut before a matched stop string and without the stop
        token's text (EOS, a stop token id), or through them with include_stop_str_in_output, as
        vLLM writes it. The stop reason, as vLLM's: the stop string the text was cut at, or the
        stop_token_ids entry that ended it; None for EOS and length."""
        p = req.params
        reason: int | str | None = req.stop_id
        ids = req.output_ids
        if req.stop_token and not p.include_stop_str_in_output:
            ids = ids[:-1]
        text = self._decode(req, ids)
        if not req.stop_hit:
            return self._held_back(req, ids, text), reason
        start = 0          # a stop string must end in text generated after the first min_tokens tokens
        if p.min_tokens > 0:
            start = _unchanged(self._decode(req, ids[: p.min_tokens]), text)
        # Every match ends in the last token's text (an earlier one would have stopped the request);
        # of those, the first in the request's list wins, as vLLM's check_stop_strings picks it.
        cuts = [(i, s) for s in p.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if cuts:
            i, reason = cuts[0]
            text = text[: i + len(reason)] if p.include_stop_str_in_output else text[:i]
        return text, reason

    def _decode(self, req: Request, ids: list[int]) -> str:
        """The text of output ids from the output's start, decoded after the prompt's last tokens as
        vLLM's detokenizer reads them: a sentencepiece decoder strips the leading space of a text, so
        the token ' Paris' decodes alone as 'Paris', where the completion of 'The capital is' is ' Paris'."""
        skip = req.params.skip_special_tokens
        if req.text_context is None:
            context = prompt_context(self.tokenizer, req.prompt_ids)
            req.text_context = (context, self.tokenizer.decode(context, skip_special_tokens=skip))
        context, head = req.text_context
        if context:
            full = self.tokenizer.decode(context + ids, skip_special_tokens=skip)
            # (not when the prompt ends inside a character the output completes, or a byte-fallback run
            # spans both: the output's text alone then)
            if full.startswith(head):
                return full[len(head):]
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _held_back(self, req: Request, ids: list[int], text: str) -> str:
        """`text` without what vLLM's detokenizer holds back, never to write it: the text of the last
        tokens while it ends with U+FFFD (a character whose bytes have not all come, as when max_tokens
        cuts one). A character spans at most 4 byte tokens; further back the U+FFFD is the model's
        invalid bytes, and only the U+FFFD are dropped."""
        k, out = len(ids), text
        while out.endswith(REPLACEMENT) and k > 0:
            if k <= len(ids) - _HOLD_BACK_MAX:
                return text.rstrip(REPLACEMENT)
            k -= 1
            out = self._decode(req, ids[:k])
        return out


REPLACEMENT = "\ufffd"
_HOLD_BACK_MAX = 8     # tokens walked back for a character's missing bytes (4 bytes, with room)


def prompt_context(tokenizer: Detokenizer, prompt_ids: list[int]) -> list[int]:
    """The prompt tokens vLLM's detokenizer primes its stream with: the shortest suffix of at least 4
    tokens (up to 23) that decodes without U+FFFD, or the whole prompt (here its last 24 tokens: more
    changes nothing the output decodes to)."""
    if len(prompt_ids) <= 4:
        return list(prompt_ids)
    for i in range(4, min(len(prompt_ids) + 1, 24)):
        suffix = list(prompt_ids[-i:])
        if REPLACEMENT not in tokenizer.decode(suffix, skip_special_tokens=True):
            return suffix
    return list(prompt_ids[-24:])


def _unchanged(before: str, after: str) -> int:
    """How much of `after` (the text with more tokens decoded) `before` already held: their common
    prefix. Not len(before): a character split across tokens decodes as U+FFFD until its last
    byte comes, so the token completing it changes text that is already there."""
    n = min(len(before), len(after))
    return next((i for i in range(n) if before[i] != after[i]), n)
