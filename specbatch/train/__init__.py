"""Build pipeline for the specbatch demo model: corpus -> tokenizer -> target -> draft -> bundle.

This package holds the first two stages (CPU only, deterministic for a given Python):

* :mod:`specbatch.train.corpus` -- the running interpreter's stdlib source as corpus,
  a ~5% held-out split by file, evaluation prompts and uint16 token streams.
* :mod:`specbatch.train.tokenizer` -- byte-level BPE (HF format, chat template) and
  :func:`build_tokenizer_and_corpus`.

transformers / tokenizers are imported lazily, so importing this package is cheap.
"""

from .corpus import (
    corpus_files,
    corpus_stats,
    encode_corpus,
    heldout_prefixes,
    iter_corpus,
    load_tokens,
    load_tokens_header,
    split_of,
)
from .tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    build_tokenizer_and_corpus,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "SPECIAL_TOKENS",
    "build_tokenizer_and_corpus",
    "corpus_files",
    "corpus_stats",
    "encode_corpus",
    "heldout_prefixes",
    "iter_corpus",
    "load_tokens",
    "load_tokens_header",
    "split_of",
    "train_tokenizer",
]
