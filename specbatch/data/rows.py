"""Row dataclasses and per-row validation shared by the JSONL and Parquet readers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


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
    keep: dict = field(default_factory=dict)
    where: str = ""
    digest: bytes = b""  # 16 bytes over the row's raw input (set by the readers; resume checks)


@dataclass
class RowError:
    row: int
    id: str | int
    error: str
    keep: dict = field(default_factory=dict)
    digest: bytes = b""


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
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _num(default: float):
    """Null, or a number equal to `default` (not a bool)."""
    return lambda v: v is None or (
        not isinstance(v, bool) and isinstance(v, (int, float)) and v == default
    )


def _false(v: object) -> bool:
    return v is None or v is False


def _true(v: object) -> bool:
    return v is None or v is True


def _empty(v: object) -> bool:
    return v is None or (isinstance(v, (str, list, tuple, dict)) and not v)


# Sampling and generation fields specbatch does not implement yet, per row (top level of plain
# rows, inside `body` for OpenAI batch lines): name -> (its default as the error shows it,
# whether a value is that default). A row that sets one to anything else is an error row rather
# than silently running without it. Implementing a field deletes its line here.
UNSUPPORTED_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "n": ("1", _num(1)),
    "best_of": ("1", _num(1)),
    "logprobs": ("false", lambda v: _false(v) or _num(0)(v)),  # chat: bool; completions: int
    "top_logprobs": ("0", _num(0)),
    "prompt_logprobs": ("null", _empty),
    "presence_penalty": ("0.0", _num(0.0)),
    "frequency_penalty": ("0.0", _num(0.0)),
    "repetition_penalty": ("1.0", _num(1.0)),
    "length_penalty": ("1.0", _num(1.0)),
    "min_p": ("0.0", _num(0.0)),
    "min_tokens": ("0", _num(0)),
    "logit_bias": ("null", _empty),
    "response_format": ("null", lambda v: _empty(v) or v == {"type": "text"}),
    "guided_json": ("null", _empty),
    "guided_regex": ("null", _empty),
    "guided_choice": ("null", _empty),
    "guided_grammar": ("null", _empty),
    "structured_outputs": ("null", _empty),
    "use_beam_search": ("false", _false),
    "bad_words": ("null", _empty),
    "allowed_token_ids": ("null", _empty),
    "truncate_prompt_tokens": ("null", _empty),
    "include_stop_str_in_output": ("false", _false),
    "skip_special_tokens": ("true", _true),
    "spaces_between_special_tokens": ("true", _true),
    "tools": ("null", _empty),
    "tool_choice": ("null", lambda v: v is None or v in ("none", "auto")),
    "functions": ("null", _empty),
    "function_call": ("null", lambda v: v is None or v in ("none", "auto")),
    "parallel_tool_calls": ("null", lambda v: v is None or isinstance(v, bool)),  # no tools: no effect
    "echo": ("false", _false),
    "suffix": ("null", _empty),
    "stream": ("false", _false),
    "stream_options": ("null", _empty),
    "prediction": ("null", _empty),
    "audio": ("null", _empty),
    "modalities": ("null", lambda v: _empty(v) or v == ["text"]),
    "reasoning_effort": ("null", _empty),
}


class _Bad(Exception):
    """One-line reason a row is invalid, without the file/row prefix."""


def _show(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    # One line, and always UTF-8 encodable (a lone surrogate is shown as \udXXX).
    text = text.replace("\n", "\\n").encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(name: str, expected: str, value: object) -> _Bad:
    return _Bad(f"field '{name}': expected {expected}, got {_show(value)}")


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text` (JSON allows "\ud800"; UTF-8 cannot hold it)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_unicode(text: str, name: str) -> str:
    pos = lone_surrogate(text)
    if pos is not None:
        raise _Bad(f"field '{name}': invalid Unicode (lone surrogate at character {pos})")
    return text


def _key_path(path: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier() and key.isascii():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key if isinstance(key, str) else repr(key), ensure_ascii=True)}]"


def _nested_surrogate(value: object, name: str) -> str | None:
    """The error for the first string (or dict key) inside `value` holding a lone surrogate."""
    stack = [(value, name)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            pos = lone_surrogate(v)
            if pos is not None:
                return f"field '{path}': invalid Unicode (lone surrogate at character {pos})"
        elif isinstance(v, dict):
            items = []
            for k, x in v.items():
                if isinstance(k, str) and (pos := lone_surrogate(k)) is not None:
                    return f"field '{path}': invalid Unicode in a key (lone surrogate at character {pos})"
                items.append((x, _key_path(path, k)))
            stack.extend(reversed(items))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _as_int(value: object, name: str, expected: str) -> int:
    if isinstance(value, bool):
        raise _bad(name, expected, value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise _bad(name, expected, value)


def _int_in(value: object, name: str, lo: int, hi: int, expected: str) -> int:
    n = _as_int(value, name, expected)
    if not lo <= n <= hi:
        raise _bad(name, expected, value)
    return n


def _as_number(value: object, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, expected, value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise _bad(name, expected, value) from None
    if not math.isfinite(number):
        raise _bad(name, expected, value)
    return number


def _check_prompt(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _bad(name, "a non-empty string", value)
    return _check_unicode(value, name)


MESSAGES_EXPECTED = "a non-empty list of {role, content} objects"


def _check_messages(value: object, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _bad(name, MESSAGES_EXPECTED, value)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _bad(f"{name}[{i}]", "an object with string 'role' and 'content'", msg)
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise _bad(f"{name}[{i}].role", "a non-empty string", role)
        if not isinstance(content, str):
            raise _bad(f"{name}[{i}].content", "a string", content)
        _check_unicode(role, f"{name}[{i}].role")
        _check_unicode(content, f"{name}[{i}].content")
        out.append({"role": role, "content": content})
    return out


TOKEN_ID_EXPECTED = f"an integer in [0, {INT64_MAX}]"


def _check_token_ids(value: object, name: str, *, non_empty: bool) -> list[int]:
    if not isinstance(value, list) or (non_empty and not value):
        what = "a non-empty list" if non_empty else "a list"
        raise _bad(name, f"{what} of integers >= 0", value)
    return [_int_in(tok, f"{name}[{i}]", 0, INT64_MAX, TOKEN_ID_EXPECTED) for i, tok in enumerate(value)]


def _check_stop(value: object, name: str) -> list[str]:
    expected = "a non-empty string or a list of non-empty strings"
    if isinstance(value, str):
        if not value:
            raise _bad(name, expected, value)
        return [_check_unicode(value, name)]
    if not isinstance(value, list):
        raise _bad(name, expected, value)
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise _bad(f"{name}[{i}]", "a non-empty string", s)
        _check_unicode(s, f"{name}[{i}]")
    return list(value)


MAX_TOKENS_EXPECTED = f"an integer in [1, {INT32_MAX}]"
TOP_K_EXPECTED = f"an integer in [1, {INT32_MAX}] (0 or -1 to disable)"


def _parse_overrides(src: dict, prefix: str) -> dict:
    out: dict = {}
    get = src.get
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        v = get(key)
        if v is None:
            continue
        n = _int_in(v, prefix + key, 1, INT32_MAX, MAX_TOKENS_EXPECTED)
        if max_tokens is not None and n != max_tokens:
            raise _Bad(
                f"fields '{prefix}max_tokens' and '{prefix}max_completion_tokens' disagree "
                f"({max_tokens} vs {n}); give one"
            )
        max_tokens = n
    if max_tokens is not None:
        out["max_tokens"] = max_tokens

    if (v := get("temperature")) is not None:
        # Any finite value >= 0; the engine treats values below 1e-5 as greedy.
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
        out["top_k"] = max(_int_in(v, prefix + "top_k", -1, INT32_MAX, TOP_K_EXPECTED), 0)

    if (v := get("seed")) is not None:
        # Any integer: the engine uses it mod 2**64.
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


def _check_unsupported(src: dict, prefix: str, exempt: Sequence[str] = ()) -> None:
    for name, (default, is_default) in UNSUPPORTED_FIELDS.items():
        if name not in src or name in exempt:
            continue
        v = src[name]
        try:
            ok = is_default(v)
        except Exception:  # noqa: BLE001 - an odd value (e.g. a Parquet type) is not the default
            ok = False
        if not ok:
            raise _Bad(
                f"field '{prefix}{name}': not supported by specbatch yet (got {_show(v)}); "
                f"remove it or set it to its default {default}"
            )


def _check_id(v: object, key: str) -> str | int:
    if v is None or isinstance(v, bool) or not isinstance(v, (int, str)):
        raise _bad(key, "a string or integer id", v)
    if isinstance(v, int):
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise _bad(key, "a string id or an integer id within int64", v)
        return v
    return _check_unicode(v, key)


def _row_id(obj: dict, row: int, id_column: str | None) -> str | int:
    if id_column is not None:
        return _check_id(obj.get(id_column), id_column)
    for key in ("id", "custom_id"):
        v = obj.get(key)
        if v is not None:
            return _check_id(v, key)
    return row


def _present(src: dict, names: Sequence[str]) -> list[str]:
    return [n for n in dict.fromkeys(names) if src.get(n) is not None]


_FORM_EXPECTED = {"messages": MESSAGES_EXPECTED, "prompt_token_ids": "a non-empty list of integers >= 0"}


def _null_form(src: dict, names: Sequence[str], prefix: str) -> None:
    """A prompt key present with null (and no other form given) is named as such."""
    for n in dict.fromkeys(names):
        if n in src:
            raise _bad(prefix + n, _FORM_EXPECTED.get(n, "a non-empty string"), None)


def _parse_body(obj: dict, req: RowRequest) -> None:
    body = obj["body"]
    if not isinstance(body, dict):
        raise _bad("body", "an object with 'messages' or 'prompt'", body)
    method = obj.get("method")
    if method is not None and method != "POST":
        raise _bad("method", "'POST'", method)
    url = obj.get("url")
    if url is not None and url not in OPENAI_URLS:
        raise _bad("url", " or ".join(f"'{u}'" for u in OPENAI_URLS), url)
    forms = _present(body, ("messages", "prompt"))
    if len(forms) > 1:
        raise _Bad("body has both 'prompt' and 'messages'; give one")
    if not forms:
        _null_form(body, ("messages", "prompt"), "body.")
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
    _check_unsupported(body, "body.")


def _parse_plain(obj: dict, req: RowRequest, prompt_column: str, exempt: Sequence[str]) -> None:
    forms = _present(obj, (prompt_column, "messages", "prompt_token_ids"))
    if len(forms) > 1:
        raise _Bad(f"row has both '{forms[0]}' and '{forms[1]}'; give one")
    if not forms:
        _null_form(obj, (prompt_column, "messages", "prompt_token_ids"), "")
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
    _check_unsupported(obj, "", exempt)


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
        return RowError(row, row, f"{where}: expected a JSON object, got {kind}", {c: None for c in keep_columns})
    keep = {}
    keep_error = None
    for c in keep_columns:
        v = obj.get(c)
        bad = _nested_surrogate(v, c)
        if bad is not None:
            v = None  # the output cannot hold it
            keep_error = keep_error or bad
        keep[c] = v
    try:
        rid = _row_id(obj, row, id_column)
    except _Bad as e:
        return RowError(row, row, f"{where}: {e}", keep)
    if keep_error is not None:
        return RowError(row, rid, f"{where}: {keep_error}", keep)
    req = RowRequest(row=row, id=rid, keep=keep, where=where)
    try:
        if obj.get("body") is not None:
            _parse_body(obj, req)
        else:
            # Columns the user named are their data, not sampling fields.
            exempt = (prompt_column, *keep_columns, *((id_column,) if id_column is not None else ()))
            _parse_plain(obj, req, prompt_column, exempt)
    except _Bad as e:
        return RowError(row, rid, f"{where}: {e}", keep)
    return req
