"""Evaluation prompts cut from the held-out split of the corpus: whole-line prefixes of about a
given token length, deterministic for a seed (the demo's quality benchmark and `bench`)."""
from __future__ import annotations

import bisect
import os
import random
from typing import Any

from .corpus import as_backend_tokenizer, iter_corpus


def heldout_prefixes(
    tokenizer: Any,
    n: int,
    prefix_tokens: int,
    seed: int = 0,
    root: str | os.PathLike | None = None,
) -> list[dict[str, str]]:
    """``n`` evaluation prompts cut from held-out files, deterministic given ``seed``.

    Each prompt is a run of whole lines starting at a non-blank line ``L`` (1-based)
    of a held-out file, ending with ``"\\n"`` at a line boundary, and about
    ``prefix_tokens`` tokens long: (about) the longest such run with at most
    ``prefix_tokens`` tokens -- exactly at most, measured by encoding the prompt --
    kept only if it has at least ``prefix_tokens // 2`` tokens and the file continues
    after it with non-blank text (there is something to complete).
    Returns ``[{"id": f"{relpath}:{L}", "prompt": text}, ...]``.

    Files are visited in a seeded shuffled order, round-robin, one new cut point per
    file per round, so prompts spread over all held-out files before any file is reused.
    Raises ``ValueError`` if the held-out split cannot supply ``n`` distinct prompts.
    """
    if n <= 0:
        return []
    if prefix_tokens <= 0:
        raise ValueError("prefix_tokens must be positive")
    backend = as_backend_tokenizer(tokenizer)
    rng = random.Random(seed)
    docs = list(iter_corpus("heldout", root))
    rng.shuffle(docs)

    def ntok(text: str) -> int:
        return len(backend.encode(text, add_special_tokens=False).ids)

    # per file: line starts (char offsets), start offsets of the file's tokens (for a
    # cheap estimate of a prefix's length) and the candidate start lines, seeded order
    state = []
    for rel, text in docs:
        lines = _split_lines(text)
        starts = [0]
        for ln in lines:
            starts.append(starts[-1] + len(ln))
        cands = [i for i, ln in enumerate(lines) if ln.strip()]
        if len(cands) < 2:
            continue
        last = cands[-1]  # something non-blank must follow the cut
        cands = cands[:-1]
        rng.shuffle(cands)
        enc = backend.encode(text, add_special_tokens=False)
        tok_starts = [o[0] for o in enc.offsets]
        state.append(
            {
                "rel": rel,
                "text": text,
                "starts": starts,
                "cands": cands,
                "last": last,
                "tok_starts": tok_starts,
            }
        )

    out: list[dict[str, str]] = []
    min_tokens = max(1, prefix_tokens // 2)
    while len(out) < n and state:
        for st in list(state):
            if len(out) >= n:
                break
            found = None
            while st["cands"] and found is None:
                i = st["cands"].pop()
                found = _cut_at(st, i, prefix_tokens, min_tokens, ntok)
            if not st["cands"]:
                state.remove(st)
            if found is not None:
                out.append({"id": f"{st['rel']}:{i + 1}", "prompt": found})
    if len(out) < n:
        raise ValueError(
            f"held-out split yields only {len(out)} prompts of ~{prefix_tokens} tokens, "
            f"{n} requested"
        )
    return out


def _split_lines(text: str) -> list[str]:
    """Split on ``"\\n"`` only (unlike str.splitlines, which also breaks at form feeds),
    keeping the newline, so line numbers match editors and tracebacks."""
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


# Token counts of a substring and of the same span inside the whole-file encoding differ
# only at the two boundaries (a pre-token cut in two); this bounds that difference for
# the cheap rejection below. The kept prompt's length is always measured exactly.
_BOUNDARY_SLACK = 16


def _cut_at(st: dict, i: int, prefix_tokens: int, min_tokens: int, ntok) -> str | None:
    """Longest whole-line prefix starting at line ``i`` with <= prefix_tokens tokens and
    at least one non-blank line after it; None if it would be under ``min_tokens``."""
    text, starts, tok_starts = st["text"], st["starts"], st["tok_starts"]
    last = st["last"]  # end line j (exclusive) may be at most `last`
    if last <= i:
        return None
    s = starts[i]
    k0 = bisect.bisect_left(tok_starts, s)
    # estimate: end at the last line start before the (prefix_tokens+1)-th token
    if k0 + prefix_tokens < len(tok_starts):
        pos = tok_starts[k0 + prefix_tokens]
        j = bisect.bisect_right(starts, pos) - 1
    else:
        j = last
    j = min(j, last)
    est = bisect.bisect_left(tok_starts, starts[j]) - k0
    if j <= i or est + _BOUNDARY_SLACK < min_tokens:
        return None
    # exact length of the estimated cut (encoding costs ~1 us/char, so no search for a
    # possibly longer fit: the estimate is within a few tokens); shrink while too long
    t = ntok(text[s : starts[j]])
    while t > prefix_tokens and j > i + 1:
        j -= 1
        t = ntok(text[s : starts[j]])
    if t > prefix_tokens or t < min_tokens:
        return None
    return text[s : starts[j]]
