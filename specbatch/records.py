"""The output record: every standard column of an output row, declared once.

Each column names its Arrow type, how a finished request fills it, what an error row holds, and
the option that adds it (None: always). The engine builds records from this list, the writer its
schema, `-o -` its lines and `specbatch.LLM` its Completion fields: adding a column is one line
here. Torch-free (the data layer imports it).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

SPEC_TYPE = pa.struct(
    [
        ("verify_steps", pa.int64()),
        ("draft_tokens", pa.int64()),
        ("accepted_tokens", pa.int64()),
        ("accept_length", pa.float64()),
        ("accept_histogram", pa.list_(pa.int64())),
    ]
)

_TOP = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64()),
                                    ("rank", pa.int64()), ("top_logprobs", pa.list_(_TOP))]))
PROMPT_LOGPROBS_TYPE = pa.list_(pa.struct([("token_id", pa.int64()), ("token", pa.string()),
                                           ("logprob", pa.float64()), ("rank", pa.int64()),
                                           ("top_logprobs", pa.list_(_TOP))]))
CHOICES_TYPE = pa.list_(pa.struct([("index", pa.int64()), ("completion", pa.string()),
                                   ("completion_tokens", pa.int64()), ("finish_reason", pa.string()),
                                   ("stop_string", pa.string()), ("stop_token_id", pa.int64()),
                                   ("logprobs", LOGPROBS_TYPE), ("output_token_ids", pa.list_(pa.int64()))]))
LOGPROB_FLOOR = -9999.0      # what a -inf logprob (a token the filters removed) is written as, as vLLM does


def emitted_tokens(spec: Mapping[str, Any]) -> int:
    """Tokens a row's requests emitted, from its spec column: accept_length x verify_steps (a
    greedy row's n choices ran once, so its completion_tokens counts n copies)."""
    return round(spec["accept_length"] * spec["verify_steps"])


def stop_fields(stop_reason: int | str | None) -> dict[str, Any]:
    """A choice's stop_reason as the choices struct holds it (one Arrow type a field): the stop
    string, or the stop token id."""
    text = isinstance(stop_reason, str)
    return {"stop_string": stop_reason if text else None, "stop_token_id": None if text else stop_reason}


def choice_stop_reason(choice: Mapping[str, Any]) -> int | str | None:
    """vLLM's stop_reason of a choice written with stop_fields."""
    tid = choice.get("stop_token_id")
    return choice.get("stop_string") if tid is None else tid


def _logprob(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(ids: Sequence[int], vals: Sequence[float], text: Callable[[int], str]) -> list[dict[str, Any]]:
    return [{"token_id": i, "token": text(i), "logprob": _logprob(v)} for i, v in zip(ids, vals)]


def logprob_entries(ids: Sequence[int], logprobs: Sequence[tuple[float, int, list[int], list[float]]],
                    text: Callable[[int], str]) -> list[dict[str, Any]]:
    """The `logprobs` column of one completion: per generated token {token_id, token, logprob, rank
    (1 = the likeliest), top_logprobs: [{token_id, token, logprob}, ...]}; `text(id)` gives a token's text."""
    return [{"token_id": tok, "token": text(tok), "logprob": _logprob(lp), "rank": rank,
             "top_logprobs": _top(top, vals, text)}
            for tok, (lp, rank, top, vals) in zip(ids, logprobs)]


def prompt_logprob_entries(prompt_ids: Sequence[int], logprobs: Sequence[tuple[float, int, list[int], list[float]]],
                           text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """The `prompt_logprobs` column: None for the first prompt token (nothing predicts it), then
    per token {token_id, token, logprob, rank (1 = the likeliest), top_logprobs}."""
    return [None] + [{"token_id": tok, "token": text(tok), "logprob": _logprob(lp), "rank": rank,
                      "top_logprobs": _top(top, vals, text)}
                     for tok, (lp, rank, top, vals) in zip(prompt_ids[1:], logprobs)]


@dataclass(frozen=True)
class Finished:
    """What a finished request hands to the columns (the engine fills it)."""
    row: int
    id: Any
    text: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str
    spec: dict[str, Any]
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it (vLLM's)
    endpoint: str | None = None          # the OpenAI response it takes: "chat" or "completion"
    request_model: str | None = None     # OpenAI batch lines: the body's model
    batch_line: bool = False             # the row was an OpenAI batch line
    created: int = field(default_factory=lambda: int(time.time()))
    logprobs: list[dict[str, Any]] | None = None     # per token (logprob_entries); None: not asked
    prompt_logprobs: list[dict[str, Any] | None] | None = None   # per prompt token (prompt_logprob_entries)
    choices: list[dict[str, Any]] | None = None      # n > 1: every choice (choice 0 is the top-level one)


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType | None           # None: follows the input's type (ids, like kept columns)
    value: Callable[[Finished], Any]   # a finished request's value
    doc: str
    option: str | None = None          # the job option that adds the column (None: always there)


COLUMNS: list[Column] = [
    Column("row", pa.int64(), lambda f: f.row, "0-based input row number"),
    Column("id", None, lambda f: f.id, "the row id (string or integer, as in the input)"),
    Column("completion", pa.string(), lambda f: f.text,
           "generated text, special tokens skipped, cut before a matched stop string (as vLLM writes it)"),
    Column("prompt_tokens", pa.int64(), lambda f: f.prompt_tokens, "prompt token count"),
    Column("completion_tokens", pa.int64(),
           lambda f: sum(c["completion_tokens"] for c in f.choices) if f.choices else len(f.output_ids),
           "generated token count (n > 1: of every choice)"),
    Column("finish_reason", pa.string(), lambda f: f.finish_reason, "stop (EOS, a stop token id or string) or length"),
    Column("stop_reason", None, lambda f: f.stop_reason,
           "the stop string or stop_token_ids entry that ended the completion; null for EOS and length (vLLM's)"),
    Column("error", pa.string(), lambda f: None, "null, or one line saying what was wrong with the row"),
    Column("spec", SPEC_TYPE, lambda f: {**f.spec, "accept_length": float(f.spec["accept_length"])},
           "speculation stats: verify_steps, draft_tokens, accepted_tokens, accept_length, accept_histogram"),
    Column("output_token_ids", pa.list_(pa.int64()), lambda f: list(f.output_ids),
           "the generated ids, ending with the EOS id when generation stopped on EOS", option="save_token_ids"),
    # Written when some row of the job asked for them (parts keep them always; null for other rows).
    Column("logprobs", LOGPROBS_TYPE, lambda f: f.logprobs,
           "per generated token: token_id, token, logprob, rank, top_logprobs (--logprobs-mode: by default the "
           "model's raw distribution)",
           option="logprobs"),
    Column("prompt_logprobs", PROMPT_LOGPROBS_TYPE, lambda f: f.prompt_logprobs,
           "per prompt token (null for the first): token_id, token, logprob, rank, top_logprobs (the "
           "model's raw distribution)", option="prompt_logprobs"),
    Column("choices", CHOICES_TYPE, lambda f: f.choices,
           "n > 1: every choice (index, completion, completion_tokens, finish_reason, stop_string, stop_token_id, "
           "logprobs, output_token_ids)",
           option="choices"),
    # What an OpenAI batch response needs (kept in the parts always, written with --output-format openai)
    Column("endpoint", pa.string(), lambda f: f.endpoint, "the OpenAI response it takes: chat or completion",
           option="openai"),
    Column("batch_line", pa.bool_(), lambda f: f.batch_line, "the row was an OpenAI batch line", option="openai"),
    Column("request_model", pa.string(), lambda f: f.request_model, "OpenAI batch lines: the body's model",
           option="openai"),
    Column("created", pa.int64(), lambda f: f.created, "unix time the completion finished", option="openai"),
]
NAMES: tuple[str, ...] = tuple(c.name for c in COLUMNS)
# Columns written when some row of the job asked for them: each is its own option.
ON_REQUEST: tuple[str, ...] = ("logprobs", "prompt_logprobs", "choices")


def columns(options: Mapping[str, bool] | None = None) -> list[Column]:
    """The columns a job writes: those always there, and those its options turn on."""
    on = options or {}
    return [c for c in COLUMNS if c.option is None or on.get(c.option)]


def completion_record(f: Finished, keep: Mapping[str, Any]) -> dict[str, Any]:
    """A finished request's record: every standard column (optional ones too; writers drop what
    the job did not ask for), then the kept input columns."""
    return {**{c.name: c.value(f) for c in COLUMNS}, **keep}


# What an error of the engine's own (not of the request) says after its row's place: an OpenAI
# line answers such a row with a 500 server_error, which a client may retry, not a 400.
ENGINE_FAILED = "the engine failed while generating this row"
DEVICE_FAILED = "the device failed while this row ran alone"
OUTPUT_FAILED = "its completion could not be turned into output"
_ENGINE_FAULTS = (ENGINE_FAILED, DEVICE_FAILED, OUTPUT_FAILED)


def engine_fault(error: str) -> bool:
    """Whether a row's error reports the engine failing on it rather than the request being wrong."""
    return any(f": {fault}" in error for fault in _ENGINE_FAULTS)


def error_record(row: int, id: Any, error: str, keep: Mapping[str, Any], prompt_tokens: int = 0,
                 batch_line: bool | None = None) -> dict[str, Any]:
    """A row that could not run: its error, zero counts, no text or stats. `batch_line`: whether
    the row was an OpenAI batch line (None: unknown, a malformed line), which "auto" output
    formats follow: a rejected batch line is answered with an OpenAI error line."""
    rec: dict[str, Any] = {c.name: None for c in COLUMNS}
    rec.update(row=row, id=id, error=error, prompt_tokens=prompt_tokens, completion_tokens=0, batch_line=batch_line)
    return {**rec, **keep}


def arrow_fields(names: Sequence[str] = NAMES, id_type: pa.DataType = pa.string()) -> list[pa.Field]:
    """Arrow fields of standard columns (the id's type as the parts agreed on)."""
    by = {c.name: c for c in COLUMNS}
    return [pa.field(n, by[n].type if by[n].type is not None else id_type) for n in names]
