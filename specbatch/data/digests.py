"""Proof that a resume reads the same input rows its output was made from.

Every input row carries a 16-byte digest of its raw content (the reader computes it). Committed
parts store each row's digest beside it; a finished output's manifest stores, per block of
`block` row numbers, one 8-byte digest over the (row, digest) pairs it holds. Before a rerun
computes anything, `check_input` reads the input again and compares: an edited, inserted or
deleted row, or another stdin, is refused with the first row (or block) that differs.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

MAX_BLOCKS = 16384       # a finished manifest holds at most this many block digests
MIN_BLOCK = 64


class InputChanged(Exception):
    """The input no longer holds the rows a committed output was made from (one line)."""


class RowSet:
    """A set of row numbers as a growable boolean array (1 byte a row: millions of rows are cheap)."""

    def __init__(self, rows: Iterable[int] = ()):
        self._has = np.zeros(0, dtype=bool)
        self._n = 0
        self.update(rows)

    def update(self, rows: Iterable[int] | np.ndarray) -> None:
        arr = np.unique(np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64))
        if arr.size == 0:
            return
        top = int(arr[-1]) + 1
        if top > self._has.size:
            grown = np.zeros(max(top, 2 * self._has.size), dtype=bool)
            grown[: self._has.size] = self._has
            self._has = grown
        self._n += int((~self._has[arr]).sum())
        self._has[arr] = True

    def add(self, row: int) -> None:
        if not self.__contains__(row):
            self.update([row])

    def __contains__(self, row: object) -> bool:
        return isinstance(row, (int, np.integer)) and 0 <= row < self._has.size and bool(self._has[row])

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._has).tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowSet):
            return set(self) == set(other)
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"RowSet({len(self)} rows)"

    def holds(self, lo: int, hi: int) -> bool:
        """Whether every row in [lo, hi) is in the set."""
        return hi <= self._has.size and bool(self._has[lo:hi].all())

    def count_below(self, n: int) -> int:
        return int(self._has[: max(n, 0)].sum())

    def max(self) -> int:
        nz = np.flatnonzero(self._has)
        return int(nz[-1]) if nz.size else -1


def block_size(rows: int) -> int:
    return max(MIN_BLOCK, math.ceil(max(rows, 1) / MAX_BLOCKS))


def _pair(row: int, digest: bytes) -> bytes:
    return int(row).to_bytes(8, "little") + digest


def block_digests(pairs: Iterable[tuple[int, bytes]], block: int) -> list[str | None]:
    """(row, digest) pairs in increasing row order -> hex digest per block (None: no rows there)."""
    out: list[str | None] = []
    h, current = None, -1
    for row, digest in pairs:
        b = row // block
        if b != current:
            if h is not None:
                out.append(h.hexdigest())
            out.extend([None] * (b - len(out)))
            h, current = hashlib.blake2b(digest_size=8), b
        h.update(_pair(row, digest))
    if h is not None:
        out.append(h.hexdigest())
    return out


def block_digests_arrow(rows: pa.Array, digests: pa.Array, block: int) -> list[str | None]:
    """block_digests of Arrow arrays (rows in increasing order, binary digests). Digests of one
    length (the readers' 16 bytes) are hashed a block at a time, its pairs' bytes laid end to end:
    the same hash as pair by pair (a hash reads a stream, not its pieces), without a million
    Python objects; any other mix goes pair by pair."""
    n = len(rows)
    digests = pa.concat_arrays([digests.cast(pa.binary())]) if n else digests   # (its own buffers, offset 0)
    offsets = np.frombuffer(digests.buffers()[1], dtype=np.int32, count=n + 1) if n else None
    width = int(offsets[1] - offsets[0]) if n else 0
    if n == 0 or digests.null_count or rows.null_count or not (np.diff(offsets) == width).all():
        return block_digests(zip(rows.to_pylist(), digests.to_pylist()), block)
    row_np = rows.to_numpy().astype("<i8")
    pairs = np.empty((n, 8 + width), dtype=np.uint8)
    pairs[:, :8] = row_np.view(np.uint8).reshape(n, 8)
    if width:
        data = np.frombuffer(digests.buffers()[2], dtype=np.uint8)
        pairs[:, 8:] = data[offsets[0]:offsets[-1]].reshape(n, width)
    b = row_np // block
    cuts = [0, *(np.flatnonzero(b[1:] != b[:-1]) + 1).tolist(), n]
    out: list[str | None] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        out.extend([None] * (int(b[lo]) - len(out)))
        out.append(hashlib.blake2b(pairs[lo:hi].tobytes(), digest_size=8).hexdigest())
    return out


@dataclass
class Expected:
    """What a resume must find in the input: per-row digests (committed parts) and/or block
    digests of a finished output over the rows in `done`."""
    done: RowSet
    rows: np.ndarray | None = None          # sorted row numbers with per-row digests
    digests: list[bytes] | None = None
    block: int = 0
    blocks: list[str | None] | None = None

    @property
    def last(self) -> int:
        return self.done.max()


def check_input(items: Iterable, expected: Expected, *, input_name: str, output: str,
                limit: int | None = None,
                refuse: Callable[[Any], str | None] | None = None) -> tuple[dict[int, bytes], bool]:
    """Read `items` (rows with .row and .digest, in input order) far enough to prove that every row
    of `expected.done` is unchanged. Returns (digest of every done row, whether the input holds a
    row within `limit` that is not done: past the last done one, or a gap below it, as --fail-fast
    leaves when rows finish out of order). Raises InputChanged naming the first difference, or
    `refuse`'s reason for a done row (its check comes first)."""
    how = "rerun with the input the output was made from, or pass --overwrite to start over"
    per_row = {}
    if expected.rows is not None:
        per_row = dict(zip(expected.rows.tolist(), expected.digests or []))
    seen: dict[int, bytes] = {}
    last = expected.last
    block_h, block_i = None, -1
    more = False

    def close_block() -> None:
        if block_h is None or expected.blocks is None:
            return
        want = expected.blocks[block_i] if block_i < len(expected.blocks) else None
        if want != block_h.hexdigest():
            lo, hi = block_i * expected.block, (block_i + 1) * expected.block - 1
            raise InputChanged(f"{input_name}: rows {lo}-{min(hi, last)} differ from the rows {output} "
                               f"was made from (a row edited, inserted or deleted); {how}")

    read = 0                                 # rows the input has, as far as it was read
    for item in items:
        r = item.row
        read = r + 1
        if r > last:
            more = limit is None or r < limit
            break
        if r not in expected.done:
            more = more or limit is None or r < limit
            continue
        reason = refuse(item) if refuse is not None else None
        if reason is not None:
            raise InputChanged(reason)
        digest = getattr(item, "digest", b"") or b""
        want = per_row.get(r)
        if want is not None and want != digest:
            raise InputChanged(f"{input_name}: row {r} differs from the row {output} was made from "
                               f"(edited, or rows inserted or deleted before it); {how}")
        if expected.blocks is not None:
            b = r // expected.block
            if b != block_i:
                close_block()
                block_h, block_i = hashlib.blake2b(digest_size=8), b
            block_h.update(_pair(r, digest))
        seen[r] = digest
    if len(seen) < len(expected.done):       # before the block check: a short input is named as such
        missing = next(r for r in expected.done if r not in seen)
        if missing >= read:
            raise InputChanged(f"{input_name}: the input ends after {read} rows, but {output} holds row {missing} "
                               f"(rows deleted?); {how}")
        raise InputChanged(f"{input_name}: the input has no row {missing}, which {output} holds "
                           f"(rows deleted?); {how}")
    close_block()
    return seen, more
