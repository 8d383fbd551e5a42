"""Turn a validated input row into prompt token ids with the model's tokenizer."""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from .chat_template import template_messages, texts
from .models.config import ModelError


class PromptError(Exception):
    """A row whose prompt cannot be tokenized for this model; the message names the row."""


# Any one of these in a model directory is a tokenizer AutoTokenizer can load (the error names
# the usual three).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tiktoken.model")


def exception_line(e: BaseException) -> str:
    """`Type: first line of the message`, UTF-8 encodable."""
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    line = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def load_tokenizer(model_dir: str | Path) -> Any:
    d = Path(model_dir)
    if d.is_dir() and not any((d / f).is_file() for f in _TOKENIZER_FILES) \
            and not any(d.glob("*.tiktoken")):
        raise ModelError(f"{model_dir}: no tokenizer (expected tokenizer.json, tokenizer.model or "
                         "tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        # Never run code from the model directory, and never ask about it on stdin (which may be
        # the user's data with `specbatch run -`).
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a broken tokenizer
        if "trust_remote_code" in str(e):
            raise ModelError(f"{model_dir}: the tokenizer needs Python code from the model directory "
                             "(auto_map in tokenizer_config.json); specbatch never runs "
                             "model-directory code") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{model_dir}: cannot load the tokenizer ({first})") from None


_BYTES_PER_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_bytes_per_token(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token covers: 4 bytes per character of the
    longest vocabulary entry, at least 16. Computed once per tokenizer."""
    try:
        return _BYTES_PER_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - no vocabulary to read: no byte bound
        longest = 1 << 40
    bound = max(16, 4 * longest)
    try:
        _BYTES_PER_TOKEN[tokenizer] = bound
    except TypeError:
        pass
    return bound


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def too_long(where: str, limit: int, what: str) -> PromptError:
    """The one message for a prompt beyond the context (what: "N tokens", "more than N tokens"...)."""
    return PromptError(f"{where}: prompt has {what} but the context is {limit} tokens "
                       "(the model's limit, --max-model-len, or what the KV pool holds)")


def _encode(tokenizer: Any, text: str, where: str, limit: int | None, **kw: Any) -> list[int]:
    """tokenizer(text, **kw) input ids; with `limit`, a text far longer than `limit` tokens can
    be is tokenized by a prefix first, so a huge prompt costs about `limit` tokens of work."""
    if limit is not None and _utf8_len(text) > limit * 8:
        head = tokenizer(text[: limit * 8], **kw)["input_ids"]
        if len(head) > limit + 2:
            raise too_long(where, limit, f"more than {limit} tokens")
    return list(tokenizer(text, **kw)["input_ids"])


def load_chat_template(value: str | Path, name: str = "chat_template") -> str:
    """A chat template given as vLLM's --chat-template takes it: a file's path (its text), or the
    template's own text (anything holding '{', '}' or a newline); a ValueError naming `name` else."""
    text = str(value)
    path = Path(text).expanduser() if text.startswith("~/") else Path(text)
    try:
        if path.is_file():
            read = path.read_text(encoding="utf-8")
            if not read.strip():
                raise ValueError(f"{name} {text}: the file is empty (expected a chat template)")
            return read
    except (OSError, UnicodeDecodeError) as e:    # (unreadable, not UTF-8, a name too long to be a path)
        if not any(c in text for c in "{}\n"):
            raise ValueError(f"{name} {text}: cannot read it ({e})") from None
    if any(c in text for c in "{}\n"):
        return text
    raise ValueError(f"{name} {text}: no such file (a chat template is a file's path or the template's own text)")


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template text (its default one where it holds several), or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.get_chat_template() if hasattr(tokenizer, "get_chat_template") else tokenizer.chat_template


def render_chat(tokenizer: Any, row: Any) -> str:
    """A `messages` row's prompt text: the model's chat template with the row's chat options (the
    generation prompt unless it says otherwise)."""
    template = chat_template_of(tokenizer)
    if template is None:
        raise PromptError(f"{row.place}: field 'messages': the model's tokenizer has no chat "
                          "template; give a 'prompt' instead")
    try:
        opts = dict(getattr(row, "chat", None) or {})
        kwargs = opts.pop("chat_template_kwargs", None) or {}
        opts = {"add_generation_prompt": True, **opts, **kwargs}        # (vLLM's order: the kwargs win)
        return tokenizer.apply_chat_template(template_messages(row.messages, template), tokenize=False, **opts)
    except Exception as e:
        raise PromptError(f"{row.place}: field 'messages': chat template failed ({exception_line(e)})") from None


def encode_row(tokenizer: Any, row: Any, vocab_size: int, max_tokens_allowed: int | None = None,
               rendered: str | None = None) -> list[int]:
    """`prompt` as tokenizer(prompt) does (default special tokens), `messages` through the chat
    template with the generation prompt, `prompt_token_ids` as given.

    `max_tokens_allowed` (the context): a text prompt with more UTF-8 bytes than that
    many tokens can cover is rejected without tokenizing it, and a long one is tokenized by a
    prefix first; whether the ids fit is still the caller's check."""
    where = row.place
    if row.prompt_token_ids is not None:
        ids = list(row.prompt_token_ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise PromptError(f"{where}: field 'prompt_token_ids': id {bad[0]} is outside the "
                              f"model's vocabulary (size {vocab_size})")
        return ids
    limit = max_tokens_allowed
    if limit is not None:
        parts = [t for m in row.messages for t in texts(m["content"])] if row.messages is not None else [row.prompt]
        nbytes = sum(_utf8_len(t) for t in parts)
        if nbytes > limit * max_bytes_per_token(tokenizer):
            raise PromptError(f"{where}: prompt has {nbytes} bytes, more than a context of {limit} tokens can "
                              "hold (the model's limit, --max-model-len, or what the KV pool holds)")
    try:
        if row.messages is not None:
            # The template writes any BOS itself.
            text = rendered if rendered is not None else render_chat(tokenizer, row)
            ids = _encode(tokenizer, text, where, limit, add_special_tokens=False)
        else:
            ids = _encode(tokenizer, row.prompt, where, limit)
    except PromptError:
        raise
    except Exception as e:  # the tokenizer failed on this text: this row's error, not the job's
        raise PromptError(f"{where}: cannot tokenize the prompt ({exception_line(e)})") from None
    if not ids:
        raise PromptError(f"{where}: the prompt tokenizes to no tokens")
    return ids
