"""Byte-level BPE tokenizer for the specbatch demo model, trained on the stdlib corpus.

Special tokens (ids 0..3, in this order): ``<|endoftext|>`` (EOS and pad; there is no
BOS), ``<|user|>``, ``<|assistant|>``, ``<|system|>``. Plain text is encoded without
any special token, so ``tokenizer(prompt)["input_ids"]`` are exactly the BPE ids.
The saved directory loads offline with ``AutoTokenizer.from_pretrained(dir)``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from .corpus import EOS_TOKEN, corpus_files, corpus_stats, encode_corpus, stdlib_root

__all__ = [
    "EOS_TOKEN",
    "USER_TOKEN",
    "ASSISTANT_TOKEN",
    "SYSTEM_TOKEN",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "train_tokenizer",
    "build_tokenizer_and_corpus",
]

USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SYSTEM_TOKEN = "<|system|>"
SPECIAL_TOKENS = [EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN]

# Each message: "<|{role}|>\n{content}\n"; generation prompt "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _training_texts(
    split: str,
    max_files: int | None,
    max_bytes: int | None,
    root: str | os.PathLike | None,
) -> Iterator[str]:
    """Corpus texts in sorted order; ``max_files`` keeps the first N files, ``max_bytes``
    stops once that many bytes have been yielded (the last file is cut at a line start)."""
    rootp = Path(root if root is not None else stdlib_root())
    files = corpus_files(split, rootp)
    if max_files is not None:
        files = files[:max_files]
    budget = max_bytes
    for rel in files:
        text = (rootp / rel).read_bytes().decode("utf-8")
        if budget is not None:
            if budget <= 0:
                return
            data = text.encode("utf-8")
            if len(data) > budget:
                cut = data.rfind(b"\n", 0, budget)
                text = data[: cut + 1].decode("utf-8") if cut >= 0 else ""
                budget = 0
            else:
                budget -= len(data)
            if not text:
                return
        yield text


def train_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int = 8192,
    split: str = "train",
    max_files: int | None = None,
    max_bytes: int | None = None,
    min_frequency: int = 2,
    root: str | os.PathLike | None = None,
):
    """Train a byte-level BPE on the corpus ``split`` and save it in HF format to ``out_dir``.

    ``max_files`` / ``max_bytes`` subsample deterministically (first files in sorted
    order / a byte budget) — meant for tests; the full stdlib train split takes a few
    seconds. Returns the ``PreTrainedTokenizerFast`` (as reloaded from ``out_dir``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size > 65536:
        raise ValueError("vocab_size must fit in uint16 (<= 65536) for the token streams")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError("vocab_size must cover the 256 byte symbols plus the special tokens")

    tok = Tokenizer(models.BPE())  # no unk: the byte alphabet covers every input
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # offsets only; adds no tokens (so no BOS/EOS on plain text)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = _training_texts(split, max_files, max_bytes, root)
    tok.train_from_iterator(texts, trainer=trainer)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN],
        clean_up_tokenization_spaces=False,  # would corrupt code (" ." -> ".")
        add_bos_token=False,
        add_eos_token=False,
        model_input_names=["input_ids", "attention_mask"],
        padding_side="left",  # batch generation pads on the left
        chat_template=CHAT_TEMPLATE,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    _portable_config(out_dir / "tokenizer_config.json")

    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir))


def _portable_config(cfg_path: Path) -> None:
    """Make tokenizer_config.json loadable by transformers 4.x as well as 5.x.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` (unknown to 4.x; 5.x
    maps ``PreTrainedTokenizerFast`` to the same class), the extra special tokens as an
    ``extra_special_tokens`` list (4.x expects a dict there; both read
    ``additional_special_tokens``) and the chat template only to chat_template.jinja
    (4.x before ~4.50 reads it from tokenizer_config.json). Same content either way.
    """
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    elif extra:  # a dict of named tokens: leave as written
        cfg["extra_special_tokens"] = extra
    cfg.setdefault("additional_special_tokens", [USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN])
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def build_tokenizer_and_corpus(
    work_dir: str | os.PathLike,
    vocab_size: int = 8192,
    root: str | os.PathLike | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train the tokenizer into ``work_dir/tokenizer`` and encode both splits into
    ``work_dir/tokens/{train,heldout}.bin`` (+ ``.bin.json`` headers).

    Returns a summary dict (corpus stats, token counts, file sizes, timings), also
    written to ``work_dir/tokens/summary.json``.
    """
    work_dir = Path(work_dir)
    tok_dir = work_dir / "tokenizer"
    tokens_dir = work_dir / "tokens"
    summary: dict[str, Any] = {"corpus": corpus_stats(root), "vocab_size": vocab_size}

    t0 = time.perf_counter()
    tokenizer = train_tokenizer(tok_dir, vocab_size=vocab_size, split="train", root=root)
    summary["tokenizer_s"] = round(time.perf_counter() - t0, 2)
    summary["tokenizer_dir"] = str(tok_dir)
    summary["tokenizer_vocab"] = len(tokenizer)
    if verbose:
        print(f"tokenizer: vocab {len(tokenizer)} -> {tok_dir} ({summary['tokenizer_s']} s)")

    summary["splits"] = {}
    for split in ("train", "heldout"):
        t0 = time.perf_counter()
        out = tokens_dir / f"{split}.bin"
        header = encode_corpus(tok_dir, split, out, root=root)
        secs = round(time.perf_counter() - t0, 2)
        n_bytes = summary["corpus"][split]["bytes"]
        info = {
            "path": str(out),
            "tokens": header["count"],
            "docs": header["n_docs"],
            "file_bytes": out.stat().st_size,
            "text_bytes": n_bytes,
            "bytes_per_token": round(n_bytes / max(1, header["count"] - header["n_docs"]), 3),
            "encode_s": secs,
        }
        summary["splits"][split] = info
        if verbose:
            print(
                f"{split}: {info['docs']} files, {n_bytes / 1e6:.2f} MB text -> "
                f"{info['tokens']:,} tokens ({info['file_bytes'] / 1e6:.2f} MB uint16, "
                f"{info['bytes_per_token']} B/token) in {secs} s -> {out}"
            )
    summary["tokens_total_bytes"] = sum(s["file_bytes"] for s in summary["splits"].values())
    (tokens_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
