"""Turn a validated input row into prompt token ids with the model's tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .models.config import ModelError


class PromptError(Exception):
    """A row whose prompt cannot be tokenized for this model; the message names the row."""


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # transformers raises many types for a broken tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{model_dir}: cannot load the tokenizer ({first})") from None


def encode_row(tokenizer: Any, row: Any, vocab_size: int) -> list[int]:
    """`prompt` as tokenizer(prompt) does (default special tokens), `messages` through the chat
    template with the generation prompt, `prompt_token_ids` as given."""
    where = row.where or f"row {row.row}"
    if row.prompt_token_ids is not None:
        ids = list(row.prompt_token_ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise PromptError(f"{where}: field 'prompt_token_ids': id {bad[0]} is outside the "
                              f"model's vocabulary (size {vocab_size})")
        return ids
    if row.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(f"{where}: field 'messages': the model's tokenizer has no chat "
                              "template; give a 'prompt' instead")
        try:
            text = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as e:
            raise PromptError(f"{where}: field 'messages': chat template failed ({e})") from None
        # The template writes any BOS itself.
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(row.prompt)["input_ids"]
    if not ids:
        raise PromptError(f"{where}: the prompt tokenizes to no tokens")
    return list(ids)
