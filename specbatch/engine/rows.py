"""The engine's edges: rows in, requests out (tokenised, sampling resolved, or the row's error
record); finished requests in, records out (the output columns, records.py), n choices included."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..data import RowError, RowRequest
from ..models.config import DecoderConfig
from ..params import SamplingError, SamplingParams, default_max_tokens
from ..prompts import PromptError, encode_row, too_long
from ..records import (Finished, choice_stop_reason, completion_record, error_record, logprob_entries,
                       prompt_logprob_entries, stop_fields)
from ..request import Request, StopChecker
from ..stats import combined_spec_stats, spec_stats


@dataclass
class Choices:
    """The n completions of one row: one record when the last of them finishes. Greedy rows run
    one request and repeat it (the n choices of a greedy row are identical)."""
    n: int
    reqs: list[Request] = field(default_factory=list)
    done: int = 0



class RowConverter:
    def __init__(self, tokenizer: Any, cfg: DecoderConfig, max_len: int, stops: StopChecker,
                 model_defaults: dict[str, Any]):
        self.tokenizer, self.cfg, self.max_len, self.stops = tokenizer, cfg, max_len, stops
        self.model_defaults = model_defaults      # generation_config.json's sampling values
        self._token_text: dict[int, str] = {}     # token id -> its text, for logprobs

    def request(self, item: RowRequest | RowError, defaults: SamplingParams) -> Request | dict:
        """A Request ready to schedule, or an error record for a row that cannot run."""
        out = self._request(item, defaults)
        if isinstance(out, dict):
            out["batch_line"] = item.batch_line     # what "auto" output formats answer it as
        return out

    def _request(self, item: RowRequest | RowError, defaults: SamplingParams) -> Request | dict:
        if isinstance(item, RowError):
            return error_record(item.row, item.id, item.error, item.keep)
        # Whatever goes wrong with one row is that row's error record, never the job's end.
        where = item.place
        try:
            ids = encode_row(self.tokenizer, item, self.cfg.vocab_size, max_tokens_allowed=self.max_len)
        except PromptError as e:
            return error_record(item.row, item.id, str(e), item.keep)
        except Exception as e:
            from ..prompts import exception_line

            return error_record(item.row, item.id, f"{where}: cannot tokenize the prompt ({exception_line(e)})",
                                item.keep)
        if len(ids) >= self.max_len:
            what = f"{len(ids)} tokens" if len(ids) > self.max_len else f"{len(ids)} tokens, no room for a completion,"
            return error_record(item.row, item.id, str(too_long(where, self.max_len, what)),
                                item.keep, prompt_tokens=len(ids))
        try:
            unset = default_max_tokens(self.model_defaults, self.max_len - len(ids), batch_line=item.batch_line,
                                       endpoint=item.endpoint)
            params = defaults.for_row(item.overrides, item.row, self.model_defaults, unset,
                                      batch_line=bool(item.batch_line))
        except SamplingError as e:
            prefix = "body." if item.batch_line else ""
            return error_record(item.row, item.id, f"{where}: field '{prefix}{e.field}': {e.detail}",
                                item.keep, prompt_tokens=len(ids))
        except Exception as e:
            from ..prompts import exception_line

            return error_record(item.row, item.id, f"{where}: invalid sampling parameters ({exception_line(e)})",
                                item.keep, prompt_tokens=len(ids))
        outside = [t for t, _ in params.logit_bias if t >= self.cfg.vocab_size]
        if outside:
            name = ("body.logit_bias" if item.batch_line else "logit_bias") if "logit_bias" in item.overrides \
                else "logit_bias (--logit-bias or the recipe's sampling.logit_bias)"
            return error_record(item.row, item.id, f"{where}: field '{name}': token id {outside[0]} is outside "
                                f"the model's vocabulary (size {self.cfg.vocab_size})", item.keep, prompt_tokens=len(ids))
        asked = item.overrides.get("max_tokens")
        if item.batch_line and asked is not None and len(ids) + asked > self.max_len:
            # as OpenAI and vLLM's server (so `vllm run-batch`) answer it; a plain row ends at the context
            return error_record(item.row, item.id, f"{where}: field 'body.max_tokens' (or max_completion_tokens): "
                                f"{asked} tokens after a prompt of {len(ids)} pass this engine's context of "
                                f"{self.max_len} tokens (--max-model-len, else what the model and the KV pool "
                                f"hold); ask for at most {self.max_len - len(ids)}", item.keep,
                                prompt_tokens=len(ids))
        return Request(row=item.row, id=item.id, prompt_ids=ids, params=params,
                       max_new=min(params.max_tokens, self.max_len - len(ids)), keep=item.keep,
                       endpoint=item.endpoint, request_model=item.request_model, batch_line=item.batch_line,
                       logprobs=None if params.logprobs is None else [])

    def choices(self, req: Request) -> list[Request]:
        """The requests that run for a row: itself, or its n choices (choice i on its own seed
        stream; a greedy row runs once, its choices being identical)."""
        n = req.params.n
        if n == 1:
            return [req]
        group = Choices(n=n)
        runs = 1 if req.params.greedy else n
        group.reqs = [req] + [replace(req, params=req.params.for_choice(i), choice=i, output_ids=[], histogram=[],
                                      logprobs=None if req.logprobs is None else [])
                              for i in range(1, runs)]
        for r in group.reqs:
            r.group = group
        return group.reqs

    def _token(self, tok: int) -> str:
        text = self._token_text.get(tok)
        if text is None:
            text = self._token_text[tok] = self.tokenizer.decode([tok], skip_special_tokens=False)
        return text

    def _logprobs(self, req: Request) -> list[dict[str, Any]] | None:
        if req.logprobs is None:
            return None
        return logprob_entries(req.output_ids, req.logprobs, self._token)

    def _prompt_logprobs(self, req: Request) -> list[dict[str, Any] | None] | None:
        if req.prompt_logprobs is None:
            return None
        return prompt_logprob_entries(req.prompt_ids, req.prompt_logprobs, self._token)

    def record(self, req: Request) -> dict[str, Any]:
        text, stop_reason = self.stops.completion(req)
        return completion_record(Finished(
            row=req.row, id=req.id, text=text, prompt_tokens=len(req.prompt_ids), stop_reason=stop_reason,
            output_ids=req.output_ids, finish_reason=req.finish_reason, spec=spec_stats(req),
            endpoint=req.endpoint, request_model=req.request_model, batch_line=req.batch_line,
            logprobs=self._logprobs(req), prompt_logprobs=self._prompt_logprobs(req)), req.keep)

    def group_record(self, group: Choices) -> dict[str, Any]:
        """One record for a row's n choices: choice 0 in the top-level columns, every choice in
        `choices`; completion_tokens and spec count every request that ran."""
        ran = sorted(group.reqs, key=lambda r: r.choice)
        choices = []
        for i in range(group.n):
            r = ran[i] if i < len(ran) else ran[0]
            text, stop_reason = self.stops.completion(r)
            choices.append({"index": i, "completion": text, **stop_fields(stop_reason),
                            "completion_tokens": len(r.output_ids), "finish_reason": r.finish_reason,
                            "logprobs": self._logprobs(r), "output_token_ids": list(r.output_ids)})
        first = ran[0]
        return completion_record(Finished(
            row=first.row, id=first.id, text=choices[0]["completion"], prompt_tokens=len(first.prompt_ids),
            stop_reason=choice_stop_reason(choices[0]),
            output_ids=first.output_ids, finish_reason=first.finish_reason, spec=combined_spec_stats(ran),
            endpoint=first.endpoint, request_model=first.request_model, batch_line=first.batch_line,
            logprobs=choices[0]["logprobs"], prompt_logprobs=self._prompt_logprobs(first), choices=choices),
            first.keep)
