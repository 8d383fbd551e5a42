"""Training corpus for the specbatch demo model: the running interpreter's stdlib.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, minus
test suites, ``site-packages``, files that are not valid UTF-8 and files over 1 MB.
It therefore depends on the exact Python version that builds it (3.11.x and 3.12.x
give different corpora); within one interpreter everything here is deterministic:
file order (sorted POSIX relative paths), the train/held-out split (a hash of the
relative path), the evaluation prompts (seeded ``random.Random``) and the encoded
token streams.

Encoded token streams are stored without numpy: ``<name>.bin`` holds the raw
little-endian uint16 ids, ``<name>.bin.json`` a small header (dtype, count,
vocab_size, eos_id, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

EOS_TOKEN = "<|endoftext|>"     # the documents' separator (the tokenizer stage adds it to the vocabulary)

__all__ = [
    "HELDOUT_FRACTION",
    "MAX_FILE_BYTES",
    "stdlib_root",
    "is_excluded",
    "corpus_files",
    "split_of",
    "iter_corpus",
    "corpus_stats",
    "as_backend_tokenizer",
    "encode_corpus",
    "load_tokens",
    "load_tokens_header",
]

HELDOUT_FRACTION = 0.05
MAX_FILE_BYTES = 1_000_000
SPLITS = ("train", "heldout")

# Directory components that mark a test suite anywhere in the path.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_root() -> Path:
    """The stdlib directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_excluded(relpath: str) -> bool:
    """True for paths (POSIX, relative to the stdlib root) that are not part of the corpus.

    Excludes test suites (a component named ``test``/``tests``/``idle_test``, which
    covers ``test/``, ``idlelib/idle_test/`` and ``lib2to3/tests/``, or a file name
    starting with ``test_``), ``site-packages`` / ``dist-packages`` and ``__pycache__``.
    Size and encoding checks need the file and happen in :func:`corpus_files`.
    """
    parts = relpath.split("/")
    if any(p in _TEST_DIRS for p in parts[:-1]):
        return True
    if any(p in ("site-packages", "dist-packages", "__pycache__") for p in parts):
        return True
    name = parts[-1]
    return name.startswith("test_") or not name.endswith(".py")


def _walk_py(root: Path) -> list[str]:
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        # prune excluded directories early (big win: test/ is >half the stdlib)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _TEST_DIRS and d not in ("site-packages", "dist-packages", "__pycache__")
        ]
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            rel = fn if rel_dir == "." else f"{rel_dir}/{fn}"
            if not is_excluded(rel):
                out.append(rel)
    return out


@lru_cache(maxsize=4)
def _corpus_index(root: str) -> tuple[tuple[str, int], ...]:
    """(relpath, n_bytes) of every corpus file under ``root``, sorted by relpath."""
    rootp = Path(root)
    kept: list[tuple[str, int]] = []
    for rel in sorted(_walk_py(rootp)):
        p = rootp / rel
        try:
            if not p.is_file():
                continue
            size = p.stat().st_size
            if size > MAX_FILE_BYTES:
                continue
            data = p.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        kept.append((rel, len(data)))
    return tuple(kept)


def corpus_files(split: str | None = None, root: str | os.PathLike | None = None) -> list[str]:
    """Sorted POSIX relative paths of the corpus (optionally of one split)."""
    _check_split(split)
    idx = _corpus_index(str(root if root is not None else stdlib_root()))
    return [rel for rel, _ in idx if split is None or split_of(rel) == split]


def split_of(relpath: str) -> str:
    """``"heldout"`` for ~5% of files, chosen by a stable hash (sha1) of the POSIX
    relative path, else ``"train"``. Independent of file order and content."""
    h = int.from_bytes(hashlib.sha1(relpath.encode("utf-8")).digest()[:4], "big")
    return "heldout" if h < HELDOUT_FRACTION * 2**32 else "train"


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or None, got {split!r}")


def iter_corpus(
    split: str | None = None, root: str | os.PathLike | None = None
) -> Iterator[tuple[str, str]]:
    """Yield ``(relpath, text)`` for each corpus file, in sorted relpath order."""
    rootp = Path(root if root is not None else stdlib_root())
    for rel in corpus_files(split, rootp):
        yield rel, (rootp / rel).read_bytes().decode("utf-8")


def corpus_stats(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """File and byte counts per split (plus totals and the stdlib path / Python version)."""
    rootp = str(root if root is not None else stdlib_root())
    stats: dict[str, Any] = {s: {"files": 0, "bytes": 0} for s in SPLITS}
    for rel, n in _corpus_index(rootp):
        s = stats[split_of(rel)]
        s["files"] += 1
        s["bytes"] += n
    stats["total"] = {
        "files": sum(stats[s]["files"] for s in SPLITS),
        "bytes": sum(stats[s]["bytes"] for s in SPLITS),
    }
    stats["stdlib"] = rootp
    stats["python"] = sys.version.split()[0]
    return stats


# --------------------------------------------------------------------------- tokenizers


def as_backend_tokenizer(tokenizer: Any):
    """A ``tokenizers.Tokenizer`` from a directory / tokenizer.json path, an HF fast
    tokenizer (``.backend_tokenizer``) or a ``tokenizers.Tokenizer`` itself."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        p = Path(tokenizer)
        if p.is_dir():
            p = p / "tokenizer.json"
        return Tokenizer.from_file(str(p))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise TypeError(f"cannot get a tokenizers.Tokenizer from {type(tokenizer).__name__}")
    return backend


def _eos_id(backend) -> int:
    eid = backend.token_to_id(EOS_TOKEN)
    if eid is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN!r} token")
    return eid


# --------------------------------------------------------------------------- token streams


def encode_corpus(
    tokenizer: Any,
    split: str | None,
    out_path: str | os.PathLike,
    root: str | os.PathLike | None = None,
    max_files: int | None = None,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Encode every file of ``split`` into one uint16 token stream at ``out_path``.

    Each document is followed by the EOS id (``<|endoftext|>``), so documents are
    separated by EOS and the stream ends with one. Writes raw little-endian uint16 to
    ``out_path`` and a JSON header to ``out_path + ".json"``; returns the header.
    ``tokenizer`` may be a directory, an HF fast tokenizer or a ``tokenizers.Tokenizer``.
    """
    backend = as_backend_tokenizer(tokenizer)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    if vocab_size > 65536:
        raise ValueError(f"vocab_size {vocab_size} does not fit in uint16")
    eos = _eos_id(backend)
    files = corpus_files(split, root)
    if max_files is not None:
        files = files[:max_files]
    rootp = Path(root if root is not None else stdlib_root())

    toks = array("H")
    for b in range(0, len(files), batch_size):
        chunk = files[b : b + batch_size]
        texts = [(rootp / rel).read_bytes().decode("utf-8") for rel in chunk]
        for enc in backend.encode_batch(texts, add_special_tokens=False):
            toks.extend(enc.ids)
            toks.append(eos)

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    data = toks
    if sys.byteorder != "little":
        data = array("H", toks)
        data.byteswap()
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "wb") as f:
        data.tofile(f)
    os.replace(tmp, out_path)
    header = {
        "format": "specbatch-tokens-v1",
        "dtype": "uint16",
        "byteorder": "little",
        "count": len(toks),
        "vocab_size": vocab_size,
        "eos_id": eos,
        "n_docs": len(files),
        "split": split,
        "python": sys.version.split()[0],
        "bytes": len(toks) * 2,
    }
    Path(str(out_path) + ".json").write_text(json.dumps(header, indent=2) + "\n")
    return header


def load_tokens_header(out_path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(str(out_path) + ".json").read_text())


def load_tokens(out_path: str | os.PathLike) -> array:
    """Read a stream written by :func:`encode_corpus` as ``array('H')`` (native order)."""
    header = load_tokens_header(out_path)
    if header.get("dtype") != "uint16":
        raise ValueError(f"unsupported dtype {header.get('dtype')!r}")
    toks = array("H")
    with open(out_path, "rb") as f:
        raw = f.read()
    if len(raw) != 2 * header["count"]:
        raise ValueError(
            f"{out_path}: {len(raw)} bytes, header says {header['count']} uint16 tokens"
        )
    toks.frombytes(raw)
    if header.get("byteorder", "little") != sys.byteorder:
        toks.byteswap()
    return toks


def token_tensor(out_path: str | os.PathLike):
    """A token stream written by :func:`encode_corpus` as a 1-D int64 torch tensor."""
    import torch

    # no uint16 arithmetic in older torch: view as int16 and undo the sign
    return torch.frombuffer(load_tokens(out_path), dtype=torch.int16).to(torch.int64) & 0xFFFF
