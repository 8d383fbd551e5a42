"""Build pipeline for the specbatch demo model: corpus -> tokenizer -> target -> draft -> bundle.

Stages (`specbatch train --stages ...`, `pipeline.py`): `corpus.py` the running interpreter's
stdlib source as corpus (a ~5% held-out split by file, evaluation prompts, uint16 token
streams); `tokenizer.py` byte-level BPE (HF format, chat template); `target.py` the target LM;
`eagle3.py` and `mtp.py` the draft modules, trained by `loop.py` on `frozen.py`'s target states
with `ttt.py`'s training-time-test forward; `pipeline.py` runs them and bundles the result.

transformers / tokenizers are imported lazily, so importing this package is cheap.
"""

from .corpus import (
    corpus_files,
    corpus_stats,
    encode_corpus,
    iter_corpus,
    load_tokens,
    load_tokens_header,
    split_of,
)
from .heldout import heldout_prefixes
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
