"""Row dataclasses and per-row validation shared by the JSONL and Parquet readers."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from .fields import (
    INT64_MAX,
    MESSAGES_EXPECTED,
    BadField,
    bad,
    check_batch_line_keys,
    check_body_keys,
    check_messages,
    check_prompt,
    check_token_ids,
    check_unicode,
    check_unsupported,
    nested_surrogate,
    parse_chat_options,
    parse_overrides,
    sampling_params_fields,
    show,
    unread_fields,
)


class InputError(Exception):
    """Fatal problem with an input file (unreadable, wrong format, bad schema)."""


class OutputError(Exception):
    """Fatal problem with the output location (e.g. parts from a different job)."""


@dataclass
class RowRequest:
    row: int
    id: str | int  # as given in the input (string or integer); the row number when there is none
    prompt: str | None = None
    messages: list[dict] | None = None  # [{"role": str, "content": str}, ...]
    prompt_token_ids: list[int] | None = None
    overrides: dict = field(default_factory=dict)
    chat: dict = field(default_factory=dict)  # chat-template options set off their defaults (fields.CHAT_OPTIONS)
    keep: dict = field(default_factory=dict)
    endpoint: str | None = None  # the OpenAI response it takes: "chat" (messages) or "completion"
    request_model: str | None = None  # OpenAI batch lines: the body's `model`, echoed in the response
    batch_line: bool = False  # an OpenAI batch line (custom_id / url / body)
    unread: tuple[tuple[str, str], ...] = ()  # keys that look like request fields and are not: (key, field)
    ray_fields: bool = False  # has Ray Data LLM's sampling_params or a lone tokenized_prompt (read or refused)
    where: str = ""
    digest: bytes = b""  # 16 bytes over the row's raw input (set by the readers; resume checks)

    @property
    def place(self) -> str:
        """Where the row is, for its messages: `where` (file:line), else its row number."""
        return self.where or f"row {self.row}"


@dataclass
class RowError:
    row: int
    id: str | int | None               # None: its id could not be read (none is made up)
    error: str
    keep: dict = field(default_factory=dict)
    digest: bytes = b""
    batch_line: bool | None = None  # an OpenAI batch line (it has a body); None: unknown or not
    ray_fields: bool = False  # has Ray Data LLM's sampling_params or a lone tokenized_prompt (as RowRequest's)


OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


def _check_id(v: object, key: str) -> str | int:
    if isinstance(v, float) and v.is_integer() and abs(v) <= 2**53:
        v = int(v)          # a pandas integer column with nulls is stored as float (1.0)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, str)):
        raise bad(key, "a string or integer id", v)
    if isinstance(v, int):
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise bad(key, "a string id or an integer id within int64", v)
        return v
    return check_unicode(v, key)


def _row_id(obj: dict, row: int, id_column: str | None) -> str | int:
    if id_column is not None:
        return _check_id(obj.get(id_column), id_column)
    # An OpenAI batch line's key is custom_id (the response echoes it; clients match on it); a
    # plain row's is id.
    batch_line = obj.get("body") is not None
    for key in ("custom_id", "id") if batch_line else ("id", "custom_id"):
        v = obj.get(key)
        if v is not None:
            return _check_id(v, key)
    if batch_line:      # its result would carry a made-up custom_id, which may be another request's
        raise BadField("field 'custom_id': required on an OpenAI batch line (its result line echoes it, and "
                       "results are matched to requests by it), got none")
    return row


def _present(src: dict, names: Sequence[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if src.get(n) is not None]


_FORM_EXPECTED = {"messages": MESSAGES_EXPECTED, "prompt_token_ids": "a non-empty list of integers >= 0",
                  "tokenized_prompt": "a non-empty list of integers >= 0"}


def _null_form(src: dict, names: Sequence[str], prefix: str) -> None:
    """A prompt key present with null (and no other form given) is named as such."""
    for n in dict.fromkeys(names):
        if n in src:
            raise bad(prefix + n, _FORM_EXPECTED.get(n, "a non-empty string"), None)


def _parse_body(obj: dict, req: RowRequest) -> None:
    body = obj["body"]
    if not isinstance(body, dict):
        raise bad("body", "an object with 'messages' or 'prompt'", body)
    method = obj.get("method")
    if method is not None and method != "POST":
        raise bad("method", "'POST'", method)
    url = obj.get("url")
    if url is not None and url not in OPENAI_URLS:
        raise bad("url", " or ".join(f"'{u}'" for u in OPENAI_URLS), url)
    forms = _present(body, ("messages", "prompt"))
    if len(forms) > 1:
        raise BadField("body has both 'prompt' and 'messages'; give one")
    if not forms:
        _null_form(body, ("messages", "prompt"), "body.")
        raise BadField("field 'body': expected 'messages' or 'prompt', got neither")
    if url is None:
        req.endpoint = "chat" if forms[0] == "messages" else "completion"
    else:
        req.endpoint = "chat" if url == OPENAI_URLS[0] else "completion"
    if (req.endpoint == "chat") != (forms[0] == "messages"):
        raise BadField(f"field 'body.{forms[0]}': {url} takes "
                       f"'{'messages' if req.endpoint == 'chat' else 'prompt'}'")
    req.batch_line = True
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad("body.model", "a string", model)
        req.request_model = check_unicode(model, "body.model")
    if forms[0] == "messages":
        req.messages = check_messages(body["messages"], "body.messages")
    else:
        p = body["prompt"]
        # The completions API also takes [text] and [token ids].
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            req.prompt_token_ids = check_token_ids(p, "body.prompt", non_empty=True)
        elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
            # OpenAI answers a list of prompts with one response of their choices: one line a prompt here
            raise BadField(f"field 'body.prompt': a list of {len(p)} prompts in one request is not supported; "
                           "give each prompt its own line (its own custom_id)")
        else:
            req.prompt = check_prompt(p, "body.prompt")
    req.overrides = parse_overrides(body, "body.", endpoint=req.endpoint)
    req.chat = parse_chat_options(body, "body.", req.messages is not None)
    check_unsupported(body, "body.")
    check_body_keys(body, "body.")


def _conversation(value: object) -> bool:
    """A list of objects: messages (check_messages names what is wrong with one), never a prompt."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _parse_plain(obj: dict, req: RowRequest, prompt_column: str, exempt: Sequence[str],
                 kept: Sequence[str]) -> None:
    # tokenized_prompt and sampling_params: a dataset prepared for Ray Data LLM reads as it does
    # there. Its tokenize stage adds tokenized_prompt beside the prompt it came from: the prompt
    # form given wins (as specbatch.ray reads such a row), tokenized_prompt is one only alone.
    if obj.get("url") in OPENAI_URLS:     # its fields at the top level would run as a plain row's defaults
        raise BadField(f"field 'body': an OpenAI batch line (url '{obj['url']}') holds its request in 'body', "
                       "got none")
    prompts = (prompt_column, "messages", "prompt_token_ids")
    forms = _present(obj, prompts) or _present(obj, ("tokenized_prompt",))
    if len(forms) > 1:
        raise BadField(f"row has both '{forms[0]}' and '{forms[1]}'; give one")
    if not forms:
        _null_form(obj, (*prompts, "tokenized_prompt"), "")
        raise BadField(
            f"no '{prompt_column}' or 'messages' field (expected one of '{prompt_column}', "
            "'messages', 'prompt_token_ids' (or 'tokenized_prompt'), or an OpenAI batch 'body')"
        )
    form = forms[0]
    value = obj[form]
    if form == "messages" or (form == prompt_column and _conversation(value)):
        # (a prompt column of conversations, as TRL's conversational datasets hold them, is a chat)
        req.messages = check_messages(value, form)
    elif form == prompt_column:
        req.prompt = check_prompt(value, form)
    else:
        req.prompt_token_ids = check_token_ids(value, form, non_empty=True)
    req.endpoint = "chat" if req.messages is not None else "completion"
    fields, params = obj, {}
    if obj.get("sampling_params") is not None:
        params = sampling_params_fields(obj["sampling_params"])
        both = next((k for k in params if obj.get(k) is not None), None)
        if both is not None:
            raise BadField(f"field 'sampling_params.{both}': the row sets '{both}' too; give one")
        fields = {**obj, **params}
    try:
        req.overrides = parse_overrides(fields, "", exempt=exempt)
        req.chat = parse_chat_options(fields, "", req.messages is not None, exempt)
        # A kept column named like a field specbatch does not implement is the user's data, not a
        # request for it; a kept field specbatch implements still applies (keeping only copies it).
        check_unsupported(obj, "", (*exempt, *kept))
        check_unsupported(params, "")
    except BadField as e:          # a field of sampling_params is named as there
        named = re.match(r"fields? '([^']+)'", str(e))
        if named and named.group(1) in params:
            raise BadField(str(e).replace(f"'{named.group(1)}'", f"'sampling_params.{named.group(1)}'", 1)) from None
        raise
    req.unread = unread_fields(obj, (*exempt, *kept, *prompts, "tokenized_prompt", "sampling_params", "id",
                                     "custom_id"))


def parse_row(
    obj: object,
    *,
    row: int,
    where: str,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    keep_columns: Sequence[str] = (),
) -> RowRequest | RowError:
    """Validate one input row (a JSON object or a Parquet row as a dict)."""
    out = _parse_row(obj, row=row, where=where, prompt_column=prompt_column, id_column=id_column,
                     keep_columns=keep_columns)
    out.ray_fields = has_ray_fields(obj, prompt_column)
    return out


def has_ray_fields(obj: object, prompt_column: str = "prompt") -> bool:
    """Whether the row has what an older specbatch took as its data (job.py checks a resume by it),
    whether or not it parses now: Ray Data LLM's sampling_params, or a tokenized_prompt alone."""
    return isinstance(obj, dict) and (obj.get("sampling_params") is not None or (
        obj.get("tokenized_prompt") is not None
        and not _present(obj, (prompt_column, "messages", "prompt_token_ids", "body"))))


def row_id(obj: object, row: int, id_column: str | None = None) -> str | int | None:
    """The id parse_row gives the row, without validating anything else (a resume's committed rows:
    their ids are counted for the repeated-ids warning, nothing else of them is read): None for a
    row that is not an object or whose id cannot be read."""
    if not isinstance(obj, dict):
        return None
    try:
        return _row_id(obj, row, id_column)
    except BadField:
        return None


def _parse_row(obj: object, *, row: int, where: str, prompt_column: str, id_column: str | None,
               keep_columns: Sequence[str]) -> RowRequest | RowError:
    if not isinstance(obj, dict):
        kind = "an array" if isinstance(obj, list) else show(obj)
        return RowError(row, None, f"{where}: expected a JSON object, got {kind}", {c: None for c in keep_columns})
    keep = {}
    keep_error = None
    for c in keep_columns:
        v = obj.get(c)
        bad = nested_surrogate(v, c)
        if bad is not None:
            v = None  # the output cannot hold it
            keep_error = keep_error or bad
        keep[c] = v
    # A batch line with a bad field is still answered as a batch line (an OpenAI error line).
    batch_line = True if obj.get("body") is not None else None
    try:
        rid = _row_id(obj, row, id_column)
    except BadField as e:       # no id read: none made up (the row number may be another row's id)
        return RowError(row, None, f"{where}: {e}", keep, batch_line=batch_line)
    if keep_error is not None:
        return RowError(row, rid, f"{where}: {keep_error}", keep, batch_line=batch_line)
    req = RowRequest(row=row, id=rid, keep=keep, where=where)
    try:
        if batch_line:
            _parse_body(obj, req)
            check_batch_line_keys(obj, (*keep_columns, *((id_column,) if id_column is not None else ())))
        else:
            # The prompt and id columns are the user's data, not sampling fields.
            exempt = (prompt_column, *((id_column,) if id_column is not None else ()))
            _parse_plain(obj, req, prompt_column, exempt, keep_columns)
    except BadField as e:
        return RowError(row, rid, f"{where}: {e}", keep, batch_line=batch_line)
    return req
