"""Field-level validation of input rows: numbers in range, valid Unicode, prompt forms, stop
strings, the per-row sampling overrides, and the one table of sampling fields specbatch does not
implement yet. Every failure is a one-line `BadField` naming the field; rows.py turns it into the
row's error."""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from collections.abc import Callable, Sequence


from ..params import (FIELD_ALIASES, LOGIT_BIAS_MAX, LOGIT_BIAS_RANGE, LOGPROBS_MAX, N_MAX, PENALTY_RANGE,
                      VLLM_FIELDS)

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
    "min_tokens",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _num(default: float):
    """Null, or a number equal to `default` (not a bool)."""
    return lambda v: v is None or (
        not isinstance(v, bool) and isinstance(v, (int, float)) and v == default
    )


def _false(v: object) -> bool:
    return v is None or v is False


def _set_keys(v: object) -> object:
    return {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else v


def _empty(v: object) -> bool:
    return v is None or (isinstance(v, (str, list, tuple, dict)) and not v)


# Sampling and generation fields specbatch does not implement, per row (top level of plain
# rows, inside `body` for OpenAI batch lines): name -> (its default as the error shows it,
# whether a value is that default). A row that sets one to anything else is an error row rather
# than silently running without it. Implementing a field deletes its line here. (`best_of`
# above n is refused by parse_overrides: best_of = n is n.)
UNSUPPORTED_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "length_penalty": ("1.0", _num(1.0)),
    # (a Parquet struct column fills the keys a row lacks with null)
    "response_format": ("null", lambda v: _empty(v) or _set_keys(v) == {"type": "text"}),
    "guided_json": ("null", _empty),
    "guided_regex": ("null", _empty),
    "guided_choice": ("null", _empty),
    "guided_grammar": ("null", _empty),
    "use_beam_search": ("false", _false),
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
    "chat_template": ("null", _empty),
    "documents": ("null", _empty),
    "multi_modal_data": ("null", _empty),       # vLLM's prompt dict: images, audio (a text model takes none)
    "mm_processor_kwargs": ("null", _empty),
    "return_tokens_as_token_ids": ("false", _false),
    "structural_tag": ("null", _empty),
    "prompt_embeds": ("null", _empty),
    # vLLM request extras: token ids in the response, ending a repetitive output early, custom
    # logits-processor arguments (each changes what comes back)
    "return_token_ids": ("false", _false),
    "repetition_detection": ("null", _empty),
    "vllm_xargs": ("null", _empty),
    "verbosity": ("null", _empty),              # OpenAI's newer chat parameters
    "web_search_options": ("null", _empty),
    # vLLM's SamplingParams fields of these names (params.py holds their defaults for SamplingParams too)
    **{k: VLLM_FIELDS[k] for k in ("detokenize", "spaces_between_special_tokens", "logits_processors",
                                   "truncate_prompt_tokens", "bad_words", "allowed_token_ids", "structured_outputs")},
}

# vLLM SamplingParams fields with no row field of the same name here (UNSUPPORTED_FIELDS has the
# others): named as unsupported where sampling params are taken (Ray rows, LLM.generate), not as a typo
VLLM_ONLY_SAMPLING = {k: VLLM_FIELDS[k][1] for k in VLLM_FIELDS if k not in UNSUPPORTED_FIELDS}

# The fields parse_overrides and parse_chat_options read (a test holds the two to this list).
REQUEST_FIELDS = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs", "n", "best_of", "include_stop_str_in_output",
    "skip_special_tokens", "add_special_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs"})
# Keys of an OpenAI body that change nothing about the completion here: the prompt forms, the model
# (echoed), who asked, storage and caching hints, vLLM's scheduling and transfer extras, and the
# guided-decoding options that only qualify a guided field (which is refused on its own).
INERT_BODY_FIELDS = frozenset({
    "messages", "prompt", "model", "user", "metadata", "store", "service_tier", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "request_id", "priority", "cache_salt", "kv_transfer_params",
    "guided_decoding_backend", "guided_whitespace_pattern", "include_reasoning", "media_io_kwargs"})

# Chat-template options of a messages row (vLLM's chat completion extras), passed to the
# tokenizer's apply_chat_template: name -> its default.
CHAT_OPTIONS = {"add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": None}
# (and add_special_tokens, which must be the endpoint's default: true for a prompt, false for a chat)
# apply_chat_template's own arguments a chat_template_kwargs may not set (add_generation_prompt and
# continue_final_message it may: they win over the fields, as vLLM's server merges them)
_CHAT_RESERVED = ("conversation", "messages", "tokenize", "return_dict", "chat_template", "tools", "documents")


class BadField(Exception):
    """One-line reason a row is invalid, without the file/row prefix."""


def show(value: object) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    # One line, and always UTF-8 encodable (a lone surrogate is shown as \udXXX).
    text = text.replace("\n", "\\n").encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 60 else text[:57] + "..."


def bad(name: str, expected: str, value: object) -> BadField:
    return BadField(f"field '{name}': expected {expected}, got {show(value)}")


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text` (JSON allows "\ud800"; UTF-8 cannot hold it)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def check_unicode(text: str, name: str) -> str:
    pos = lone_surrogate(text)
    if pos is not None:
        raise BadField(f"field '{name}': invalid Unicode (lone surrogate at character {pos})")
    return text


def _key_path(path: str, key: object) -> str:
    if isinstance(key, str) and key.isidentifier() and key.isascii():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key if isinstance(key, str) else repr(key), ensure_ascii=True)}]"


def nested_surrogate(value: object, name: str) -> str | None:
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
        raise bad(name, expected, value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise bad(name, expected, value)


def _int_in(value: object, name: str, lo: int, hi: int, expected: str) -> int:
    n = _as_int(value, name, expected)
    if not lo <= n <= hi:
        raise bad(name, expected, value)
    return n


def _as_number(value: object, name: str, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, expected, value)
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        raise bad(name, expected, value) from None
    if not math.isfinite(number):
        raise bad(name, expected, value)
    return number


def check_prompt(value: object, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad(name, "a non-empty string", value)
    return check_unicode(value, name)


MESSAGES_EXPECTED = "a non-empty list of {role, content} objects"


# Content parts whose text vLLM reads, and the key holding it; any other part is media.
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def _content(content: object, name: str) -> str | list[str]:
    """A message's content as the chat template is handed it (chat_template.py): a string as
    given, or OpenAI's list of content parts as their texts (text, input_text, output_text, refusal
    and thinking parts, and bare strings, as vLLM reads them; a part whose text is null is skipped,
    as vLLM skips it); null or absent content is no parts. A media part is an error: specbatch
    runs text-only models."""
    if isinstance(content, str):
        return check_unicode(content, name)
    if content is None:
        return []
    if not isinstance(content, list):
        raise bad(name, "a string or a list of text parts", content)
    texts = []
    for j, part in enumerate(content):
        where = f"{name}[{j}]"
        if isinstance(part, str):
            texts.append(check_unicode(part, where))
            continue
        if not isinstance(part, dict):
            raise bad(where, "a content part {type, text}", part)
        key = _TEXT_PARTS.get(part.get("type"))  # type: ignore[arg-type]
        if key is None:
            raise bad(f"{where}.type", "a text part, 'text' (specbatch runs text-only models)", part.get("type"))
        text = part.get(key)
        if text is None:
            continue
        if not isinstance(text, str):
            raise bad(f"{where}.{key}", "a string", text)
        texts.append(check_unicode(text, f"{where}.{key}"))
    return texts


def _tool_call(call: dict, name: str) -> dict:
    """A tool call as vLLM hands it to chat templates: its function's JSON `arguments` string
    parsed into an object ({} when empty), as transformers' tool-use templates expect."""
    fn = call.get("function")
    if not isinstance(fn, dict):
        return dict(call)
    args = fn.get("arguments")
    if isinstance(args, (dict, list)):
        return dict(call)
    if args:
        if not isinstance(args, str):
            raise bad(f"{name}.function.arguments", "a JSON string", args)
        try:
            args = json.loads(args)
        except ValueError:
            raise bad(f"{name}.function.arguments", "a JSON string", args) from None
    else:
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


def check_messages(value: object, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad(name, MESSAGES_EXPECTED, value)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise bad(f"{name}[{i}]", "an object with string 'role' and 'content'", msg)
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or not role:
            raise bad(f"{name}[{i}].role", "a non-empty string", role)
        check_unicode(role, f"{name}[{i}].role")
        m: dict = {"role": role}
        # What vLLM hands the chat template besides role and content (tool turns, named speakers,
        # an assistant turn's reasoning); a turn may have no content (one that only calls tools).
        for key in ("name", "tool_call_id"):
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):
                    raise bad(f"{name}[{i}].{key}", "a string", msg[key])
                m[key] = check_unicode(msg[key], f"{name}[{i}].{key}")
        if msg.get("tool_calls") is not None:
            if not isinstance(msg["tool_calls"], list) or not all(isinstance(c, dict) for c in msg["tool_calls"]):
                raise bad(f"{name}[{i}].tool_calls", "a list of objects", msg["tool_calls"])
            if msg["tool_calls"]:              # vLLM: an empty list is dropped (the normal assistant path)
                m["tool_calls"] = [_tool_call(c, f"{name}[{i}].tool_calls[{j}]")
                                   for j, c in enumerate(msg["tool_calls"])]
        m["content"] = _content(content, f"{name}[{i}].content")
        reasoning = msg.get("reasoning")
        if role == "assistant" and reasoning is not None:     # an earlier turn's thinking, for templates that
            if not isinstance(reasoning, str):                 # render it (vLLM hands it under both names)
                raise bad(f"{name}[{i}].reasoning", "a string", reasoning)
            m["reasoning"] = m["reasoning_content"] = check_unicode(reasoning, f"{name}[{i}].reasoning")
        out.append(m)
    return out


TOKEN_ID_EXPECTED = f"an integer in [0, {INT64_MAX}]"


def check_token_ids(value: object, name: str, *, non_empty: bool) -> list[int]:
    if not isinstance(value, list) or (non_empty and not value):
        what = "a non-empty list" if non_empty else "a list"
        raise bad(name, f"{what} of integers >= 0", value)
    return [_int_in(tok, f"{name}[{i}]", 0, INT64_MAX, TOKEN_ID_EXPECTED) for i, tok in enumerate(value)]


def _check_stop(value: object, name: str) -> list[str]:
    expected = "a non-empty string or a list of non-empty strings"
    if isinstance(value, str):
        if not value:
            raise bad(name, expected, value)
        return [check_unicode(value, name)]
    if not isinstance(value, list):
        raise bad(name, expected, value)
    for i, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise bad(f"{name}[{i}]", "a non-empty string", s)
        check_unicode(s, f"{name}[{i}]")
    return list(value)


MAX_TOKENS_EXPECTED = f"an integer in [1, {INT32_MAX}]"
TOP_K_EXPECTED = f"an integer in [1, {INT32_MAX}] (0 or -1 to disable)"


def parse_overrides(src: dict, prefix: str, *, endpoint: str | None = None, exempt: Sequence[str] = ()) -> dict:
    """A row's sampling fields, validated: the keys of SamplingParams they set. `endpoint`:
    "chat" / "completion" for an OpenAI body (the logprobs spelling is that API's), None for a
    plain row (either spelling); `exempt`: columns the user named (their data, not fields)."""
    out: dict = {}
    get = (lambda k: None if k in exempt else src.get(k)) if exempt else src.get
    max_tokens = None
    # both given: the chat API's newer name wins, as vLLM's server reads them; /v1/completions has
    # max_tokens only (vLLM's ignores the other there)
    order = ("max_completion_tokens", "max_tokens") if endpoint == "completion" else ("max_tokens",
                                                                                       "max_completion_tokens")
    for key in order:
        v = get(key)
        if v is not None:
            max_tokens = _int_in(v, prefix + key, 1, INT32_MAX, MAX_TOKENS_EXPECTED)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens

    if (v := get("temperature")) is not None:
        # Any finite value >= 0; the engine treats values below 1e-5 as greedy.
        t = _as_number(v, prefix + "temperature", "a number >= 0")
        if t < 0:
            raise bad(prefix + "temperature", "a number >= 0", v)
        out["temperature"] = t

    if (v := get("top_p")) is not None:
        p = _as_number(v, prefix + "top_p", "a number in (0, 1]")
        if not 0 < p <= 1:
            raise bad(prefix + "top_p", "a number in (0, 1]", v)
        out["top_p"] = p

    if (v := get("top_k")) is not None:
        out["top_k"] = max(_int_in(v, prefix + "top_k", -1, INT32_MAX, TOP_K_EXPECTED), 0)

    if (v := get("seed")) is not None:
        # Any integer: the engine uses it mod 2**64.
        out["seed"] = _as_int(v, prefix + "seed", "an integer")

    if (v := get("stop")) is not None:
        out["stop"] = _check_stop(v, prefix + "stop")

    if (v := get("stop_token_ids")) is not None:
        out["stop_token_ids"] = check_token_ids(v, prefix + "stop_token_ids", non_empty=False)

    if (v := get("ignore_eos")) is not None:
        if not isinstance(v, bool):
            raise bad(prefix + "ignore_eos", "true or false", v)
        out["ignore_eos"] = v
    _parse_more(get, prefix, endpoint, out)
    return out


NUMBER_01 = "a number in [0, 1]"
PENALTY_EXPECTED = "a number in [-2, 2]"
LOGPROBS_EXPECTED = f"an integer in [0, {LOGPROBS_MAX}]"


def _number_in(v: object, name: str, ok: Callable[[float], bool], expected: str) -> float:
    x = _as_number(v, name, expected)
    if not ok(x):
        raise bad(name, expected, v)
    return x


def _bool_field(v: object, name: str) -> bool:
    if not isinstance(v, bool):
        raise bad(name, "true or false", v)
    return v


def _logit_bias(value: object, name: str) -> dict[int, float]:
    """{"token id": bias} (JSON object keys are strings; Parquet may give int keys, a struct's
    absent keys as null, or a map as [key, value] pairs) -> {id: bias}."""
    expected = "an object mapping token ids to biases in [-100, 100]"
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if v is not None]
    elif isinstance(value, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise bad(name, expected, value)
    if len(items) > LOGIT_BIAS_MAX:
        raise BadField(f"field '{name}': expected at most {LOGIT_BIAS_MAX} entries, got {len(items)}")
    out: dict[int, float] = {}
    for key, bias in items:
        where = _key_path(name, key)
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
            tok = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tok = key
        else:
            raise BadField(f"field '{where}': expected a token id (an integer >= 0) as the key")
        if not 0 <= tok <= INT64_MAX:
            raise BadField(f"field '{where}': expected a token id (an integer >= 0) as the key")
        if tok in out:
            raise BadField(f"field '{name}': token id {tok} given twice")
        out[tok] = _number_in(bias, where, lambda b: -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE,
                              "a bias in [-100, 100]")
    return out


def _parse_more(get: Callable[[str], object], prefix: str, endpoint: str | None, out: dict) -> None:
    """The fields beyond the basic ones: processors, logprobs, n, output text options."""
    if (v := get("min_tokens")) is not None:
        out["min_tokens"] = _int_in(v, prefix + "min_tokens", 0, INT32_MAX, f"an integer in [0, {INT32_MAX}]")
        if out["min_tokens"] > out.get("max_tokens", INT32_MAX):
            raise BadField(f"field '{prefix}min_tokens': {out['min_tokens']} is more than "
                           f"max_tokens ({out['max_tokens']})")
    if (v := get("min_p")) is not None:
        out["min_p"] = _number_in(v, prefix + "min_p", lambda x: 0 <= x <= 1, NUMBER_01)
    if (v := get("repetition_penalty")) is not None:
        out["repetition_penalty"] = _number_in(v, prefix + "repetition_penalty", lambda x: x > 0,
                                               "a number > 0 (1 = off)")
    for key in ("presence_penalty", "frequency_penalty"):
        if (v := get(key)) is not None:
            out[key] = _number_in(v, prefix + key, lambda x: -PENALTY_RANGE <= x <= PENALTY_RANGE, PENALTY_EXPECTED)
    if (v := get("logit_bias")) is not None:
        bias = _logit_bias(v, prefix + "logit_bias")
        if bias:
            out["logit_bias"] = bias

    # logprobs: chat spells `logprobs: true` + `top_logprobs: k`; completions `logprobs: k`.
    lp, top = get("logprobs"), get("top_logprobs")
    k_top = None
    if top is not None:
        k_top = _int_in(top, prefix + "top_logprobs", 0, LOGPROBS_MAX, LOGPROBS_EXPECTED)
    if lp is None or lp is False:
        if k_top:
            raise BadField(f"field '{prefix}top_logprobs': needs '{prefix}logprobs': true")
    elif lp is True:
        if endpoint == "completion":
            raise bad(prefix + "logprobs", f"{LOGPROBS_EXPECTED} (the completions API's spelling)", lp)
        out["logprobs"] = k_top or 0
    else:
        if endpoint == "chat":
            raise bad(prefix + "logprobs", "true or false (chat completions: 'top_logprobs' sets how "
                      "many alternatives)", lp)
        out["logprobs"] = _int_in(lp, prefix + "logprobs", 0, LOGPROBS_MAX, LOGPROBS_EXPECTED)
        if k_top:
            raise BadField(f"field '{prefix}top_logprobs': goes with 'logprobs': true (with "
                           f"'logprobs': {out['logprobs']}, leave it out)")

    if (v := get("prompt_logprobs")) is not None:
        out["prompt_logprobs"] = _int_in(v, prefix + "prompt_logprobs", 0, LOGPROBS_MAX, LOGPROBS_EXPECTED)

    n = 1
    if (v := get("n")) is not None:
        n = _int_in(v, prefix + "n", 1, N_MAX, f"an integer in [1, {N_MAX}]")
        if n > 1:          # n: 1, like logprobs: false, asks for nothing: the run's defaults apply
            out["n"] = n
    if (v := get("best_of")) is not None:
        best_of = _int_in(v, prefix + "best_of", 1, INT32_MAX, f"an integer >= n ({n})")
        if best_of < n:
            raise bad(prefix + "best_of", f"an integer >= n ({n})", v)
        if best_of > n:
            raise BadField(f"field '{prefix}best_of': best_of > n is not supported by specbatch (got "
                           f"{best_of} with n {n}); remove it or set it to n")
    for key in ("include_stop_str_in_output", "skip_special_tokens"):
        if (v := get(key)) is not None:
            out[key] = _bool_field(v, prefix + key)


def parse_chat_options(src: dict, prefix: str, chat: bool, exempt: Sequence[str] = ()) -> dict:
    """A row's chat-template options, validated: those set to other than their defaults (a
    completion row may not set them)."""
    out: dict = {}
    for name, default in CHAT_OPTIONS.items():
        v = src.get(name) if name not in exempt else None
        if v is None or v == default or (default is None and _empty(v)):
            continue
        if not chat:
            raise BadField(f"field '{prefix}{name}': applies to 'messages' rows (a chat template), not to a "
                           "prompt; remove it")
        if name == "chat_template_kwargs":
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise bad(prefix + name, "an object of template variables", v)
            clash = [k for k in v if k in _CHAT_RESERVED]
            if clash:
                raise BadField(f"field '{prefix}{name}': '{clash[0]}' is not a template variable; set it as its "
                               "own field or remove it")
            for option in ("add_generation_prompt", "continue_final_message"):
                if option in v:
                    _bool_field(v[option], f"{prefix}{name}.{option}")
            out[name] = dict(v)
        else:
            out[name] = _bool_field(v, prefix + name)
    special = src.get("add_special_tokens") if "add_special_tokens" not in exempt else None
    if special is not None and special is not (not chat):
        raise BadField(f"field '{prefix}add_special_tokens': not supported by specbatch yet (got {show(special)}); "
                       f"remove it or set it to its default {'false (chat)' if chat else 'true (completions)'}")
    kwargs = out.get("chat_template_kwargs") or {}
    if kwargs.get("continue_final_message", out.get("continue_final_message")) and \
            kwargs.get("add_generation_prompt", src.get("add_generation_prompt", True)) is not False:
        raise BadField(f"field '{prefix}continue_final_message': true needs '{prefix}add_generation_prompt': "
                       "false (the final message is continued, not followed by a new turn)")
    return out


def check_vllm_only(params: dict, prefix: str) -> None:
    """A vLLM sampling field specbatch has no row field for, set: named as unsupported, not as a typo."""
    key = next((k for k, v in params.items() if k in VLLM_ONLY_SAMPLING and not VLLM_ONLY_SAMPLING[k](v)), None)
    if key is not None:
        raise BadField(f"field '{prefix}{key}': a vLLM sampling field specbatch does not support yet; remove it")


def _edits(a: str, b: str, most: int) -> int:
    """Levenshtein distance with adjacent transpositions, or most + 1 once it exceeds `most`."""
    if abs(len(a) - len(b)) > most:
        return most + 1
    prev2, prev = None, list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > most:
            return most + 1
        prev2, prev = prev, cur
    return prev[-1]


@functools.lru_cache(maxsize=4096)
def near_field(key: str) -> str | None:
    """The request field an unknown key most likely meant: its spelling in another case or style
    (`Temperature`, `maxTokens`, `max-tokens`, `topp`), a plural or singular (`seeds`, `logprob`),
    another API's name for it (`max_new_tokens`), or, past five letters, a typo (one edit, two past
    ten letters: `temprature`). None for a key like none of them: short words (`step`, `speed`,
    `top`) are too easily a column of one's own."""
    k = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower().replace("-", "_")
    if len(k) < 3:               # `N`, `p`: too short to tell a field from a column of one's own
        return None
    if k in REQUEST_FIELDS or k in FIELD_ALIASES:
        return FIELD_ALIASES.get(k, k)
    bare = k.replace("_", "")
    for f in sorted(REQUEST_FIELDS):
        if bare == f.replace("_", "") or k in (f + "s", f[:-1] if f.endswith("s") else None):
            return f
    if len(k) < 6:
        return None
    most = 1 + (len(k) > 10)
    best = min(REQUEST_FIELDS, key=lambda f: (_edits(k, f, most), f))
    return best if _edits(k, best, most) <= most else None


def unread_fields(src: dict, known: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """A plain row's keys that look like request fields but are not read as one, each with the
    field it likely meant: (key, field). Its other keys are the user's data."""
    return tuple((k, f) for k, v in src.items()
                 if v is not None and isinstance(k, str) and k not in REQUEST_FIELDS and k not in UNSUPPORTED_FIELDS
                 and k not in known and (f := near_field(k)) is not None)


# The keys a `sampling_params` object may hold (Ray Data LLM's row column; implemented or refused
# by name): another key is a typo or another engine's field, refused as vLLM's SamplingParams(**d).
SAMPLING_PARAMS_KEYS = frozenset((*OVERRIDE_KEYS, *UNSUPPORTED_FIELDS, *CHAT_OPTIONS, "add_special_tokens"))


def sampling_params_fields(params: object) -> dict:
    """A row's `sampling_params` object (as Ray Data LLM rows carry it) as row fields; a null value
    asks for nothing (a key another row of a Parquet struct column set)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad("sampling_params", "an object of sampling fields", params)
    check_vllm_only(params, "sampling_params.")
    unknown = [k for k, v in params.items() if v is not None and k not in SAMPLING_PARAMS_KEYS
               and k not in VLLM_ONLY_SAMPLING]
    if unknown:
        near = near_field(str(unknown[0]))
        hint = (f"did you mean 'sampling_params.{near}'?" if near else
                "e.g. max_tokens, temperature, top_p, seed, stop; see README, Input")
        raise BadField(f"field 'sampling_params.{unknown[0]}': not a sampling field specbatch knows ({hint})")
    return {k: v for k, v in params.items() if v is not None and k not in VLLM_ONLY_SAMPLING}


def check_body_keys(body: dict, prefix: str) -> None:
    """Every key of an OpenAI body is part of the request (OpenAI's API refuses one it does not
    know): a key specbatch neither reads, refuses nor knows to be inert is an error naming it, with
    the closest field, never a silently ignored typo."""
    for key, value in body.items():
        if key in REQUEST_FIELDS or key in UNSUPPORTED_FIELDS or key in INERT_BODY_FIELDS or _empty(value):
            continue         # (null or empty asks nothing; a Parquet struct fills every row's keys with null)
        meant = near_field(str(key))
        near = [meant] if meant else difflib.get_close_matches(
            str(key), sorted(REQUEST_FIELDS | UNSUPPORTED_FIELDS.keys()), 1, 0.7)
        hint = f" (did you mean '{prefix}{near[0]}'?)" if near else ""
        raise BadField(f"field '{prefix}{key}': not a request field specbatch knows{hint}; remove it")


def check_batch_line_keys(obj: dict, exempt: Sequence[str]) -> None:
    """A request field beside an OpenAI line's body (not in it) would be silently ignored."""
    for key in obj:
        if (key in REQUEST_FIELDS or key == "sampling_params") and key not in exempt and obj[key] is not None:
            where = "its fields as 'body.<field>'" if key == "sampling_params" else f"as 'body.{key}'"
            raise BadField(f"field '{key}': an OpenAI batch line's request fields go inside 'body' "
                           f"({where}); a column of your own by that name: name it in --keep-columns")


# What an unsupported field's user can do instead, where specbatch has it.
_INSTEAD = {"echo": "; for the prompt's logprobs (echo with logprobs), set prompt_logprobs, vLLM's field, and "
                    "max_tokens 1"}


def check_unsupported(src: dict, prefix: str, exempt: Sequence[str] = ()) -> None:
    for name, (default, is_default) in UNSUPPORTED_FIELDS.items():
        if name not in src or name in exempt:
            continue
        v = src[name]
        try:
            ok = is_default(v)
        except Exception:  # noqa: BLE001 - an odd value (e.g. a Parquet type) is not the default
            ok = False
        if not ok:
            raise BadField(
                f"field '{prefix}{name}': not supported by specbatch yet (got {show(v)}); "
                f"remove it or set it to its default {default}{_INSTEAD.get(name, '')}"
            )
