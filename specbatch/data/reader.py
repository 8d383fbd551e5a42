"""Streaming readers for JSONL (file or stdin) and Parquet inputs."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from .rows import OVERRIDE_KEYS, InputError, RowError, RowRequest, parse_row

PARQUET_BATCH_ROWS = 1024
SCAN_CHUNK_BYTES = 1 << 22
_BOM = b"\xef\xbb\xbf"
# A newline whose following line is blank (whitespace only, then newline).
_BEFORE_BLANK_LINE = re.compile(rb"\n(?=[ \t\r\f\v]*\n)")

Row = RowRequest | RowError


class RowSource:
    """Iterable of RowRequest | RowError in input order; `total` is the row count when cheaply known."""

    def __init__(self, path: str, total: int | None, rows: Callable[[], Iterator[Row]]) -> None:
        self.path = path
        self.total = total
        self._rows = rows

    def __iter__(self) -> Iterator[Row]:
        return self._rows()

    def __repr__(self) -> str:
        return f"RowSource(path={self.path!r}, total={self.total!r})"


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def count_nonblank_lines(f: BinaryIO) -> int:
    """Count lines holding a non-whitespace byte, reading fixed-size chunks."""
    n = 0
    open_line = False  # the unterminated line at the end of the previous chunk was counted
    while chunk := f.read(SCAN_CHUNK_BYTES):
        first = chunk.find(b"\n")
        if first < 0:
            if not open_line and chunk.strip():
                n += 1
                open_line = True
            continue
        if not open_line and chunk[:first].strip():
            n += 1
        last = chunk.rfind(b"\n")
        # complete lines after the first newline, up to and including the last one
        n += chunk.count(b"\n", first + 1, last + 1)
        n -= len(_BEFORE_BLANK_LINE.findall(chunk, first, last + 1))
        open_line = bool(chunk[last + 1 :].strip())
        n += open_line
    return n


def _jsonl_rows(f: BinaryIO, name: str, opts: dict) -> Iterator[Row]:
    row = 0
    for lineno, line in enumerate(f, 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        if lineno == 1 and line.startswith(_BOM):
            line = line[len(_BOM) :]
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield _line_error(row, f"{where}: invalid UTF-8 at byte {e.start} of the line", opts)
            row += 1
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield _line_error(row, f"{where}: malformed JSON: {e.msg} at column {e.colno}", opts)
            row += 1
            continue
        except (ValueError, RecursionError) as e:
            yield _line_error(row, f"{where}: malformed JSON: {_one_line(e)}", opts)
            row += 1
            continue
        yield parse_row(obj, row=row, where=where, **opts)
        row += 1


def _line_error(row: int, error: str, opts: dict) -> RowError:
    return RowError(row, str(row), error, {c: None for c in opts["keep_columns"]})


def _open_jsonl_file(path: str, opts: dict) -> RowSource:
    try:
        with open(path, "rb") as f:
            total = count_nonblank_lines(f)
    except FileNotFoundError:
        raise InputError(f"{path}: cannot read JSONL: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: cannot read JSONL: is a directory") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read JSONL: {e.strerror or _one_line(e)}") from None

    def rows() -> Iterator[Row]:
        try:
            f = open(path, "rb")
        except OSError as e:
            raise InputError(f"{path}: cannot read JSONL: {e.strerror or _one_line(e)}") from None
        with f:
            yield from _jsonl_rows(f, path, opts)

    return RowSource(path, total, rows)


def _open_stdin(opts: dict) -> RowSource:
    stream = sys.stdin.buffer
    return RowSource("-", None, lambda: _jsonl_rows(stream, "<stdin>", opts))


def _parquet_columns(names: list[str], opts: dict) -> list[str]:
    wanted = [opts["prompt_column"], "messages", "prompt_token_ids", "body", "url", *OVERRIDE_KEYS]
    wanted += [opts["id_column"]] if opts["id_column"] is not None else ["id", "custom_id"]
    wanted += list(opts["keep_columns"])
    present = set(names)
    return [c for c in dict.fromkeys(wanted) if c in present]


def _open_parquet(path: str, opts: dict) -> RowSource:
    if not os.path.exists(path):
        raise InputError(f"{path}: cannot read Parquet: no such file")
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        total = pf.metadata.num_rows
    except (OSError, pa.ArrowException, ValueError) as e:
        raise InputError(f"{path}: cannot read Parquet: {_one_line(e)}") from None
    cols = ", ".join(names)
    for c in opts["keep_columns"]:
        if c not in names:
            raise InputError(f"{path}: keep column '{c}' is not in the Parquet schema (columns: {cols})")
    if opts["id_column"] is not None and opts["id_column"] not in names:
        raise InputError(f"{path}: id column '{opts['id_column']}' is not in the Parquet schema (columns: {cols})")
    forms = (opts["prompt_column"], "messages", "prompt_token_ids", "body")
    if not any(f in names for f in forms):
        raise InputError(
            f"{path}: no '{opts['prompt_column']}', 'messages', 'prompt_token_ids' or 'body' column "
            f"(columns: {cols})"
        )
    columns = _parquet_columns(names, opts)

    def rows() -> Iterator[Row]:
        row = 0
        batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns)
        while True:
            try:
                batch = next(batches)
                records = batch.to_pylist()
            except StopIteration:
                return
            except (OSError, pa.ArrowException, ValueError) as e:
                raise InputError(f"{path}: cannot read Parquet: {_one_line(e)}") from None
            for obj in records:
                yield parse_row(obj, row=row, where=f"{path} row {row}", **opts)
                row += 1

    return RowSource(path, total, rows)


def open_rows(
    path: str,
    *,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    keep_columns: Sequence[str] = (),
) -> RowSource:
    """Open `path` (.jsonl, .parquet, or - for JSONL on stdin) as a streaming RowSource."""
    opts = {"prompt_column": prompt_column, "id_column": id_column, "keep_columns": tuple(keep_columns)}
    if path == "-":
        return _open_stdin(opts)
    low = path.lower()
    if low.endswith(".jsonl"):
        return _open_jsonl_file(path, opts)
    if low.endswith(".parquet"):
        return _open_parquet(path, opts)
    raise InputError(f"{path}: unsupported input; expected a .jsonl or .parquet file, or - for JSONL on stdin")
