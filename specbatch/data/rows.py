"""Row dataclasses and per-row validation shared by the JSONL and Parquet readers."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class InputError(Exception):
    """Fatal problem with an input file (unreadable, wrong format, bad schema)."""


class OutputError(Exception):
    """Fatal problem with the output location (e.g. parts from a different job)."""


@dataclass
class RowRequest:
    row: int
    id: str
    prompt: str | None = None
    messages: list[dict] | None = None  # [{"role": str, "content": str}, ...]
    prompt_token_ids: list[int] | None = None
    overrides: dict = field(default_factory=dict)
    keep: dict = field(default_factory=dict)
    where: str = ""


@dataclass
class RowError:
    row: int
    id: str
    error: str
    keep: dict = field(default_factory=dict)


OVERRIDE_KEYS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


class _Bad(Exception):
    """One-line reason a row is invalid, without the file/row prefix."""


def _show(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(name: str, expected: str, value: object) -> _Bad:
    return _Bad(f"field '{name}': expected {expected}, got {_show(value)}")


def _as_int(value: object, name: str, expected: str) -> int:
    if isinstance(value, bool):
        raise _bad(name, expected, value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _bad(name, expected, value)


def _as_number(value: object, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, expected, value)
    if not math.isfinite(value):
        raise _bad(name, expected, value)
    return float(value)


def _check_prompt(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(name, "a non-empty string", value)
    return value


def _check_messages(value: object, name: str) -> list[dict]:
    expected = "a non-empty list of {role, content} objects"
    if not isinstance(value, list) or not value:
        raise _bad(name, expected, value)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"{name}[{i}]", "an object with string 'role' and 'content'", msg)
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"{name}[{i}].role", "a non-empty string", role)
        if not isinstance(content, str):
            raise _bad(f"{name}[{i}].content", "a string", content)
        out.append({"role": role, "content": content})
    return out


def _check_token_ids(value: object, name: str, *, non_empty: bool) -> list[int]:
    if not isinstance(value, list) or (non_empty and not value):
        what = "a non-empty list" if non_empty else "a list"
        raise _bad(name, f"{what} of integers >= 0", value)
    out = []
    for i, tok in enumerate(value):
        t = _as_int(tok, f"{name}[{i}]", "an integer >= 0")
        if t < 0:
            raise _bad(f"{name}[{i}]", "an integer >= 0", tok)
        out.append(t)
    return out


def _check_stop(value: object, name: str) -> list[str]:
    expected = "a non-empty string or a list of non-empty strings"
    if isinstance(value, str):
        if not value:
            raise _bad(name, expected, value)
        return [value]
    if not isinstance(value, list):
        raise _bad(name, expected, value)
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise _bad(f"{name}[{i}]", "a non-empty string", s)
    return list(value)


def _parse_overrides(src: dict, prefix: str) -> dict:
    out: dict = {}
    get = src.get
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        v = get(key)
        if v is None:
            continue
        n = _as_int(v, prefix + key, "an integer >= 1")
        if n < 1:
            raise _bad(prefix + key, "an integer >= 1", v)
        if max_tokens is not None and n != max_tokens:
            raise _Bad(
                f"fields '{prefix}max_tokens' and '{prefix}max_completion_tokens' disagree "
                f"({max_tokens} vs {n}); give one"
            )
        max_tokens = n
    if max_tokens is not None:
        out["max_tokens"] = max_tokens

    if (v := get("temperature")) is not None:
        t = _as_number(v, prefix + "temperature", "a number >= 0")
        if t < 0:
            raise _bad(prefix + "temperature", "a number >= 0", v)
        out["temperature"] = t

    if (v := get("top_p")) is not None:
        p = _as_number(v, prefix + "top_p", "a number in (0, 1]")
        if not 0 < p <= 1:
            raise _bad(prefix + "top_p", "a number in (0, 1]", v)
        out["top_p"] = p

    if (v := get("top_k")) is not None:
        expected = "an integer >= 1 (0 or -1 to disable)"
        k = _as_int(v, prefix + "top_k", expected)
        if k < -1:
            raise _bad(prefix + "top_k", expected, v)
        out["top_k"] = max(k, 0)

    if (v := get("seed")) is not None:
        out["seed"] = _as_int(v, prefix + "seed", "an integer")

    if (v := get("stop")) is not None:
        out["stop"] = _check_stop(v, prefix + "stop")

    if (v := get("stop_token_ids")) is not None:
        out["stop_token_ids"] = _check_token_ids(v, prefix + "stop_token_ids", non_empty=False)

    if (v := get("ignore_eos")) is not None:
        if not isinstance(v, bool):
            raise _bad(prefix + "ignore_eos", "true or false", v)
        out["ignore_eos"] = v
    return out


def _row_id(obj: dict, row: int, id_column: str | None) -> str:
    if id_column is not None:
        v = obj.get(id_column)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, str)):
            raise _bad(id_column, "a string or integer id", v)
        return str(v)
    for key in ("id", "custom_id"):
        v = obj.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise _bad(key, "a string or integer id", v)
        return str(v)
    return str(row)


def _present(src: dict, names: Sequence[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if src.get(n) is not None]


def _parse_body(obj: dict, req: RowRequest) -> None:
    body = obj["body"]
    if not isinstance(body, dict):
        raise _bad("body", "an object with 'messages' or 'prompt'", body)
    url = obj.get("url")
    if url is not None and url not in OPENAI_URLS:
        raise _bad("url", " or ".join(f"'{u}'" for u in OPENAI_URLS), url)
    n = body.get("n")
    if n is not None:
        k = _as_int(n, "body.n", "1")
        if k > 1:
            raise _Bad(f"field 'body.n': n>1 is not supported (got {k}); repeat the row instead")
        if k < 1:
            raise _bad("body.n", "1", n)
    forms = _present(body, ("messages", "prompt"))
    if len(forms) > 1:
        raise _Bad("body has both 'prompt' and 'messages'; give one")
    if not forms:
        raise _Bad("field 'body': expected 'messages' or 'prompt', got neither")
    if forms[0] == "messages":
        req.messages = _check_messages(body["messages"], "body.messages")
    else:
        p = body["prompt"]
        # The completions API also takes [text] and [token ids].
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            req.prompt_token_ids = _check_token_ids(p, "body.prompt", non_empty=True)
        else:
            req.prompt = _check_prompt(p, "body.prompt")
    req.overrides = _parse_overrides(body, "body.")


def _parse_plain(obj: dict, req: RowRequest, prompt_column: str) -> None:
    forms = _present(obj, (prompt_column, "messages", "prompt_token_ids"))
    if len(forms) > 1:
        raise _Bad(f"row has both '{forms[0]}' and '{forms[1]}'; give one")
    if not forms:
        raise _Bad(
            f"no '{prompt_column}' or 'messages' field (expected one of '{prompt_column}', "
            "'messages', 'prompt_token_ids', or an OpenAI batch 'body')"
        )
    form = forms[0]
    if form == prompt_column:
        req.prompt = _check_prompt(obj[form], form)
    elif form == "messages":
        req.messages = _check_messages(obj[form], form)
    else:
        req.prompt_token_ids = _check_token_ids(obj[form], form, non_empty=True)
    req.overrides = _parse_overrides(obj, "")


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
    if not isinstance(obj, dict):
        kind = "an array" if isinstance(obj, list) else _show(obj)
        return RowError(
            row, str(row), f"{where}: expected a JSON object, got {kind}", {c: None for c in keep_columns}
        )
    keep = {c: obj.get(c) for c in keep_columns}
    try:
        rid = _row_id(obj, row, id_column)
    except _Bad as e:
        return RowError(row, str(row), f"{where}: {e}", keep)
    req = RowRequest(row=row, id=rid, keep=keep, where=where)
    try:
        if obj.get("body") is not None:
            _parse_body(obj, req)
        else:
            _parse_plain(obj, req, prompt_column)
    except _Bad as e:
        return RowError(row, rid, f"{where}: {e}", keep)
    return req
