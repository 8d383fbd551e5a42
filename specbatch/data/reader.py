"""Streaming readers for JSONL (file or stdin) and Parquet inputs."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO, NamedTuple, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .digests import RowSet
from .fields import CHAT_OPTIONS, OVERRIDE_KEYS, UNSUPPORTED_FIELDS, near_field
from .rows import InputError, RowError, RowRequest, has_ray_fields, parse_row, row_id

PARQUET_BATCH_ROWS = 1024
SCAN_CHUNK_BYTES = 1 << 22
# The first block of a JSONL input, checked when it is opened: this many non-blank lines or
# bytes, whichever comes first.
BLOCK_LINES = 1000
BLOCK_BYTES = 1 << 22
_BOM = b"\xef\xbb\xbf"
# What a file that is not JSONL at all starts with.
_MAGIC = (
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"%PDF", "a PDF document"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"BZh", "bzip2-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\x04\x22\x4d\x18", "lz4-compressed data"),
    (b"PK\x03\x04", "a zip archive"),
    (b"PAR1", "a Parquet file"),
    (b"\xff\xfe", "UTF-16 text"),
    (b"\xfe\xff", "UTF-16 text"),
)
# A newline whose following line is blank (whitespace only, then newline).
_BEFORE_BLANK_LINE = re.compile(rb"\n(?=[ \t\r\f\v]*\n)")

Row = RowRequest | RowError


class Digested(NamedTuple):
    """A row as a resume's input check needs it: its number and digest (the line not parsed)."""
    row: int
    digest: bytes


class Skipped(NamedTuple):
    """A row the caller has already (a resume's committed row): its number and the id parse_row
    would give it, the row not validated nor digested."""
    row: int
    id: str | int | None


class RowSource:
    """Iterable of RowRequest | RowError in input order; `total` is the row count when cheaply known."""

    def __init__(self, path: str, total: int | None, rows: Callable[[], Iterator[Row]],
                 column_types: dict[str, pa.DataType] | None = None,
                 digests: Callable[[], Iterator[Digested | Row]] | None = None,
                 skipping: Callable[[RowSet], Iterator[Row | Skipped]] | None = None) -> None:
        """`column_types`: the input's own types of the kept columns, where it has them (Parquet);
        `digests`: the rows' numbers and digests without parsing them (JSONL, Parquet), else `rows` serve;
        `skipping`: the rows with those of a set as Skipped (JSONL, Parquet), else `rows` serve."""
        self.path = path
        self.total = total
        self._rows = rows
        self._digests = digests
        self._skipping = skipping
        self.column_types = column_types or {}

    def __iter__(self) -> Iterator[Row]:
        return self._rows()

    def digested(self) -> Iterator[Digested | Row]:
        """Every row's number and digest, as iterating gives them (a resume checks a million
        committed rows: JSONL lines are hashed, not parsed, ~20x faster)."""
        return (self._digests or self._rows)()

    def skipping(self, done: RowSet) -> Iterator[Row | Skipped]:
        """The rows as iterating gives them, those in `done` as Skipped: a resume's pass over the
        input reads a committed row's id only (parsing a million of them took ~11 s). Whether a
        row is in `done` is asked when it is reached: rows added to it later are those already given."""
        return self._skipping(done) if self._skipping is not None else self._rows()

    def __repr__(self) -> str:
        return f"RowSource(path={self.path!r}, total={self.total!r})"


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def count_nonblank_lines(f: BinaryIO, head: bytes = b"") -> int:
    """Count lines holding a non-whitespace byte, reading fixed-size chunks; `head`: bytes already
    read from `f`, counted first (a line may go on from it into `f`)."""
    n = 0
    open_line = False  # the unterminated line at the end of the previous chunk was counted
    for chunk in itertools.chain([head] if head else [], iter(lambda: f.read(SCAN_CHUNK_BYTES), b"")):
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


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _display(name: str) -> str:
    """A path as error messages (which reach the output) show it: always UTF-8 encodable."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _nonblank(lines: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the lines holding a row, the first line's BOM dropped."""
    for lineno, line in enumerate(lines, 1):
        if lineno == 1 and line.startswith(_BOM):
            line = line[len(_BOM) :]            # before the blank check: a line of only a BOM is blank
        if line.strip():
            yield lineno, line


def _jsonl_rows(lines: Iterable[bytes], name: str, opts: dict, first_row: int = 0,
                skip: RowSet | None = None) -> Iterator[Row | Skipped]:
    """`skip`: rows given as Skipped once their line is read as JSON (RowSource.skipping)."""
    row = first_row
    for lineno, line in _nonblank(lines):
        where = f"{name}:{lineno}"
        try:
            text = line.rstrip(b"\r\n").decode("utf-8")
        except UnicodeDecodeError as e:
            out: Row = _line_error(row, f"{where}: invalid UTF-8 at byte {e.start} of the line", opts)
        else:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                if not line.endswith(b"\n"):
                    # The last line, unterminated and not JSON: a file still being written (cut anywhere,
                    # inside a literal too). As an error row it would be committed, and the finished line
                    # refused as an edit.
                    print(f"warning: {where}: the last line has no newline and is not valid JSON (a file still "
                          "being written?); it is not run: rerun once it is complete and the row is added",
                          file=sys.stderr)
                    return
                # json's messages for these end in "at", before the position it appends itself.
                msg = e.msg.removesuffix(" at").removesuffix(" starting")
                out = _line_error(row, f"{where}: malformed JSON at column {e.colno}: {msg}", opts)
            except (ValueError, RecursionError) as e:
                out = _line_error(row, f"{where}: malformed JSON: {_one_line(e)}", opts)
            else:
                if skip is not None and row in skip:
                    yield Skipped(row, row_id(obj, row, opts["id_column"]))
                    row += 1
                    continue
                out = parse_row(obj, row=row, where=where, **opts)
        out.digest = _digest(line.strip())  # the raw bytes: invalid UTF-8 lines get one too
        yield out
        row += 1


def _jsonl_digests(lines: Iterable[bytes], first_row: int = 0) -> Iterator[Digested]:
    """What _jsonl_rows yields, numbered and digested alike, without parsing: blank lines skipped,
    a first BOM dropped, an unterminated last line that is valid UTF-8 but not JSON (a file still
    being written) not a row."""
    for row, (_, line) in enumerate(_nonblank(lines), first_row):
        if not line.endswith(b"\n"):
            try:
                json.loads(line.rstrip(b"\r\n").decode("utf-8"))
            except json.JSONDecodeError:
                return
            except (ValueError, RecursionError):    # invalid UTF-8 or too deep: an error row, as there
                pass
        yield Digested(row, _digest(line.strip()))


def _line_error(row: int, error: str, opts: dict) -> RowError:
    return RowError(row, None, error, {c: None for c in opts["keep_columns"]})      # no id read: none made up


def _read_block(f: BinaryIO) -> tuple[list[bytes], bool]:
    """The first block of lines; and whether its last line was cut at the byte budget."""
    lines: list[bytes] = []
    used = nonblank = 0
    while nonblank < BLOCK_LINES and used < BLOCK_BYTES:
        budget = BLOCK_BYTES - used
        line = f.readline(budget)
        if not line:
            break
        lines.append(line)
        used += len(line)
        nonblank += bool(line.strip())
        if len(line) == budget and not line.endswith(b"\n"):
            return lines, True
    return lines, False


def _field_list(keys: Iterable[object]) -> str:
    names = []
    for k in keys:
        text = str(k)
        names.append(text if text.isprintable() and text.isascii() else json.dumps(text, ensure_ascii=True))
    if not names:
        return "none"
    shown = ", ".join(names[:40])
    return shown + (f", ... ({len(names)} in all)" if len(names) > 40 else "")


def _check_block(name: str, lines: list[bytes], cut: bool, opts: dict) -> None:
    """An input that is not JSONL at all, or names columns that no row of the first block has,
    is an InputError rather than one error row per line."""
    head = lines[0] if lines else b""
    if head.startswith(_BOM):
        head = head[len(_BOM) :]
    for magic, what in _MAGIC:
        if head.startswith(magic):
            named = "" if name == "<stdin>" else next(   # (a file of them is read by its name)
                (f" (compressed JSONL is read when named {suffix})" for suffix, codec in JSONL_CODECS.items()
                 if codec and codec in what.replace("bzip2", "bz2")), "")
            raise InputError(f"{name}: looks like {what}, not JSONL{named}")
    keys: dict = {}
    objects = nonblank = 0
    partial = False  # the cut last line may be an object whose keys we did not see
    for i, line in enumerate(lines):
        if i == 0 and line.startswith(_BOM):
            line = line[len(_BOM) :]
        text = line.strip()
        if not text:
            continue
        nonblank += 1
        if cut and i == len(lines) - 1:
            partial = text.startswith(b"{")
            continue
        try:
            obj = json.loads(text.decode("utf-8"))
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            objects += 1
            keys.update(dict.fromkeys(obj))
    if not nonblank or partial:
        return
    if not objects:
        lines_word = "line is" if nonblank == 1 else f"{nonblank} non-blank lines is"
        raise InputError(f"{name}: does not look like JSONL: not one of its first {lines_word} a JSON object")
    rows = f"{objects} row" + ("s" if objects > 1 else "")
    seen = _field_list(keys)
    if not any(f in keys for f in _forms(opts)):
        raise InputError(
            f"{name}: no '{opts['prompt_column']}', 'messages', 'prompt_token_ids' (or 'tokenized_prompt') "
            "or 'body' field "
            f"in the first {rows} (fields: {seen})"
        )
    if opts["id_column"] is not None and opts["id_column"] not in keys:
        raise InputError(f"{name}: id column '{opts['id_column']}' is not in the first {rows} (fields: {seen})")
    for c in opts["keep_columns"]:
        if c not in keys:
            raise InputError(f"{name}: keep column '{c}' is not in the first {rows} (fields: {seen})")


# JSONL as datasets are often shipped, compressed: read through pyarrow's codecs, one stream, never
# whole. A row's digest is over its decompressed line, so a resume may switch between the forms.
JSONL_CODECS = {".jsonl": None, ".jsonl.gz": "gzip", ".jsonl.zst": "zstd", ".jsonl.bz2": "bz2", ".jsonl.lz4": "lz4"}


def jsonl_suffix(path: str) -> str | None:
    """The JSONL suffix `path` ends with (.jsonl, .jsonl.gz, ...), else None."""
    low = path.lower()
    return next((s for s in JSONL_CODECS if low.endswith(s)), None)


def _open_binary(path: str) -> BinaryIO:
    codec = JSONL_CODECS.get(jsonl_suffix(path) or ".jsonl")
    if codec is None:
        return open(path, "rb")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return io.BufferedReader(pa.input_stream(path, compression=codec), buffer_size=1 << 20)


def _file_lines(path: str, shown: str) -> Iterator[bytes]:
    """The lines of a JSONL file (decompressed); a file that cannot be opened, or a read that
    fails midway (a compressed file cut short or corrupt), is the input's error naming it."""
    try:
        f = _open_binary(path)
    except OSError as e:
        raise InputError(f"{shown}: cannot read JSONL: {e.strerror or _one_line(e)}") from None
    with f:
        try:
            yield from f
        except OSError as e:
            raise InputError(f"{shown}: cannot read JSONL: {e.strerror or _one_line(e)}") from None


def _open_jsonl_file(path: str, opts: dict, display: str | None = None, first_row: int = 0) -> RowSource:
    """`first_row`: the job's number of the file's first row (a directory's later files)."""
    shown = display or path          # what messages call it (stdin spooled to a file: "<stdin>")
    try:
        with _open_binary(path) as f:     # one stream: a compressed file is decompressed once here
            lines, cut = _read_block(f)
            _check_block(shown, lines, cut, opts)
            total = count_nonblank_lines(f, b"".join(lines))
            if lines and lines[0].startswith(_BOM) and not lines[0][len(_BOM):].strip():
                total -= 1                      # a first line of only a BOM is blank
    except FileNotFoundError:
        raise InputError(f"{shown}: cannot read JSONL: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{shown}: cannot read JSONL: is a directory") from None
    except OSError as e:
        codec = JSONL_CODECS.get(jsonl_suffix(path) or ".jsonl")
        named = f" (its name says {codec}-compressed JSONL)" if codec and not e.strerror else ""
        raise InputError(f"{shown}: cannot read JSONL: {e.strerror or _one_line(e)}{named}") from None
    name = display or _display(path)

    return RowSource(path, total, lambda: _jsonl_rows(_file_lines(path, shown), name, opts, first_row),
                     digests=lambda: _jsonl_digests(_file_lines(path, shown), first_row),
                     skipping=lambda done: _jsonl_rows(_file_lines(path, shown), name, opts, first_row, done))


def _stdin_lines(stream: BinaryIO, opts: dict) -> Iterator[bytes]:
    """Read the first block into memory, check it, then give it out followed by the rest of the
    stream: stdin is read once. The check runs on the first iteration, not at open, so a caller
    may still copy stdin elsewhere instead of iterating this source."""
    lines, cut = _read_block(stream)
    _check_block("<stdin>", lines, cut, opts)
    if cut:
        yield from lines[:-1]
        yield lines[-1] + stream.readline()
    else:
        yield from lines
    yield from stream


def _open_stdin(opts: dict) -> RowSource:
    stream = sys.stdin.buffer
    return RowSource("-", None, lambda: _jsonl_rows(_stdin_lines(stream, opts), "<stdin>", opts))


# Columns read since an older specbatch took them as the row's data: a row's null in one (or a
# tokenized_prompt beside the prompt that reads) is left out of its digest, so an output begun then
# still resumes (a row they change is refused by name: job.py).
_READ_SINCE = ("sampling_params", "tokenized_prompt")


def _forms(opts: dict) -> tuple[str, ...]:
    """The fields a row's prompt can come in (Ray Data LLM's tokenized_prompt among them)."""
    return (opts["prompt_column"], "messages", "prompt_token_ids", "tokenized_prompt", "body")


def _parquet_columns(names: list[str], opts: dict) -> tuple[list[str], list[str]]:
    """The columns a row is read from, and those read only to say they look like a request field
    and are not one (left out of the row's digest: they change nothing about the row)."""
    wanted = [*_forms(opts), "method", "url", "sampling_params", *OVERRIDE_KEYS]
    wanted += [*UNSUPPORTED_FIELDS, *CHAT_OPTIONS, "add_special_tokens"]
    wanted += [opts["id_column"]] if opts["id_column"] is not None else ["id", "custom_id"]
    wanted += list(opts["keep_columns"])
    present = set(names)
    read = [c for c in dict.fromkeys(wanted) if c in present]
    return read, [c for c in names if c not in read and near_field(c) is not None]


def _open_parquet(path: str, opts: dict, first_row: int = 0) -> RowSource:
    if not os.path.exists(path):
        raise InputError(f"{path}: cannot read Parquet: no such file")
    try:       # closed until read (a directory's thousand shards must not hold a thousand descriptors)
        with pq.ParquetFile(path) as pf:
            schema, total = pf.schema_arrow, pf.metadata.num_rows
        names = schema.names
    except (OSError, pa.ArrowException, ValueError) as e:
        raise InputError(f"{path}: cannot read Parquet: {_one_line(e)}") from None
    cols = ", ".join(names)
    for c in opts["keep_columns"]:
        if c not in names:
            raise InputError(f"{path}: keep column '{c}' is not in the Parquet schema (columns: {cols})")
    if opts["id_column"] is not None and opts["id_column"] not in names:
        raise InputError(f"{path}: id column '{opts['id_column']}' is not in the Parquet schema (columns: {cols})")
    if not any(f in names for f in _forms(opts)):
        raise InputError(
            f"{path}: no '{opts['prompt_column']}', 'messages', 'prompt_token_ids' (or 'tokenized_prompt') "
            "or 'body' column "
            f"(columns: {cols})"
        )
    columns, noted = _parquet_columns(names, opts)
    name = _display(path)

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            # pre_buffer off: with it, every row group read stays allocated until the file's end
            # (a 10M-row input's prompts held in memory; apache/arrow#39808)
            pf = pq.ParquetFile(path, pre_buffer=False)
            read = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns + noted)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise InputError(f"{path}: cannot read Parquet: {_one_line(e)}") from None
        with pf:
            yield from read

    def rows(skip: RowSet | None = None) -> Iterator[Row | Skipped]:
        return _parquet_rows(path, name, batches(), noted, first_row, opts, skip)

    def digests() -> Iterator[Digested]:
        return _parquet_digests(path, batches(), noted, first_row, opts)

    return RowSource(path, total, rows, {c: schema.field(c).type for c in opts["keep_columns"]}, digests=digests,
                     skipping=rows)


T = TypeVar("T")


def _parquet_read(path: str, read: Callable[[], T]) -> T:
    """`read()`; a read that fails midway is the input's error naming the file."""
    try:
        return read()
    except (OSError, pa.ArrowException, ValueError) as e:
        raise InputError(f"{path}: cannot read Parquet: {_one_line(e)}") from None


def _parquet_batches(path: str, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """`batches`, a read that fails midway the input's error naming the file."""
    while (batch := _parquet_read(path, lambda: next(batches, None))) is not None:
        yield batch


def _id_fields(batch: pa.RecordBatch, id_column: str | None) -> list[dict]:
    """Each row of a batch as far as row_id reads it: its id columns, and whether it has a body."""
    names = [id_column] if id_column is not None else ["id", "custom_id"]
    cols = {c: batch.column(c).to_pylist() for c in names if c in batch.schema.names}
    if id_column is None and "body" in batch.schema.names:
        cols["body"] = [True if valid else None for valid in pc.is_valid(batch.column("body")).to_pylist()]
    if not cols:
        return [{}] * batch.num_rows
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def _parquet_rows(path: str, name: str, batches: Iterator[pa.RecordBatch], noted: list[str], first_row: int,
                  opts: dict, skip: RowSet | None = None) -> Iterator[Row | Skipped]:
    """`skip`: rows given as Skipped (RowSource.skipping); a batch of them alone is read no further
    than its ids."""
    row = 0                              # in this file (its messages' numbering)
    for batch in _parquet_batches(path, batches):
        first = first_row + row
        if skip is not None and skip.holds(first, first + batch.num_rows):
            objs = _parquet_read(path, lambda: _id_fields(batch, opts["id_column"]))
            yield from (Skipped(first + i, row_id(obj, first + i, opts["id_column"])) for i, obj in enumerate(objs))
            row += batch.num_rows
            continue
        for obj in _parquet_read(path, batch.to_pylist):
            if skip is not None and first_row + row in skip:
                yield Skipped(first_row + row, row_id(obj, first_row + row, opts["id_column"]))
            else:
                out = parse_row(obj, row=first_row + row, where=f"{name} row {row}", **opts)
                out.digest = _parquet_row_digest(obj, noted, out.ray_fields)
                yield out
            row += 1


def _parquet_digests(path: str, batches: Iterator[pa.RecordBatch], noted: list[str], first_row: int,
                     opts: dict) -> Iterator[Digested]:
    """What _parquet_rows yields, numbered and digested alike, without validating the rows (the
    digest needs only whether a row has Ray Data LLM's fields, which parse_row reads the same way)."""
    row = first_row
    for batch in _parquet_batches(path, batches):
        for obj in _parquet_read(path, batch.to_pylist):
            yield Digested(row, _parquet_row_digest(obj, noted, has_ray_fields(obj, opts["prompt_column"])))
            row += 1


def _parquet_row_digest(obj: dict, noted: list[str], ray_fields: bool) -> bytes:
    """The digest of a row as read (`obj` is consumed): the columns read only to be noted, and the
    _READ_SINCE columns an older specbatch took as data where they change nothing, left out."""
    for c in noted:
        del obj[c]
    for c in _READ_SINCE:
        if c in obj and (obj[c] is None or (c == "tokenized_prompt" and not ray_fields)):
            del obj[c]           # (a tokenized_prompt beside a prompt changes nothing it reads)
    return _parquet_digest(obj)


def _parquet_digest(obj: dict) -> bytes:
    """Over the row's read columns, as canonical JSON (repr for what JSON cannot hold)."""
    try:
        text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=repr)
    except (TypeError, ValueError):
        text = repr(sorted(obj.items(), key=lambda kv: str(kv[0])))
    return _digest(text.encode("utf-8", "surrogatepass"))


def _input_format(name: str) -> str | None:
    """"jsonl" (compressed too), "parquet", or None for a file of neither."""
    return "jsonl" if jsonl_suffix(name) else "parquet" if name.lower().endswith(".parquet") else None


def _skipped(name: str) -> bool:
    """Names a dataset directory holds beside its data: hidden files and a writer's markers
    (_SUCCESS, _metadata, _common_metadata, .crc files)."""
    return name.startswith((".", "_"))


def directory_files(path: str) -> list[str]:
    """A directory input's files, in the order their rows are numbered: every .jsonl or .parquet
    file in it or below it (hive partitions, a dataset's data/ folder), by path, name by name."""
    found: list[str] = []

    def unreadable(e: OSError) -> None:
        raise InputError(f"{e.filename or path}: cannot read the input directory: {e.strerror or _one_line(e)}")

    for root, dirs, files in os.walk(path, onerror=unreadable):    # (linked folders not followed: no loops)
        dirs[:] = [d for d in dirs if not _skipped(d)]
        found += [os.path.join(root, f) for f in files if not _skipped(f) and _input_format(f)]
    found.sort(key=lambda p: os.path.relpath(p, path).split(os.sep))
    if not found:
        raise InputError(f"{path}: a directory with no .jsonl (or .jsonl.gz, .zst, .bz2, .lz4) or .parquet file in it "
                         "(hidden files and names starting with _ are left out)")
    stems: dict[str, str] = {}
    for f in found:                          # part-0.jsonl beside part-0.jsonl.gz: one file's rows twice?
        suffix = jsonl_suffix(f)
        if suffix:
            other = stems.setdefault(f[: -len(suffix)], f)
            if other != f:
                raise InputError(f"{path}: holds {other} and {f}, one file in two forms (its rows would be read "
                                 "twice); keep one")
    kinds = {_input_format(f) for f in found}
    if len(kinds) > 1:
        first = {k: next(f for f in found if _input_format(f) == k) for k in sorted(kinds)}
        raise InputError(f"{path}: holds both .jsonl and .parquet files ({first['jsonl']}, {first['parquet']}); "
                         "give a directory of one format")
    return found


def _keep_types(sources: list[RowSource]) -> dict[str, pa.DataType]:
    """One type per kept column over a directory's Parquet files (int32 in one, int64 in another:
    int64); types no value converts between are the input's error, naming both files."""
    types: dict[str, pa.DataType] = {}
    first: dict[str, str] = {}
    for src in sources:
        for c, t in src.column_types.items():
            if c not in types:
                types[c], first[c] = t, src.path
                continue
            try:
                merged = pa.unify_schemas([pa.schema([(c, types[c])]), pa.schema([(c, t)])],
                                          promote_options="permissive")
            except (pa.ArrowException, ValueError):
                raise InputError(f"{src.path}: keep column '{c}' is {t} here and {types[c]} in {first[c]}; "
                                 "kept columns need one type across the directory's files") from None
            types[c] = merged.field(c).type
    return types


def _open_directory(path: str, opts: dict) -> RowSource:
    """The files of a dataset directory as one input, rows numbered on from file to file; each
    row's messages name its file and its line or row there."""
    sources: list[RowSource] = []
    first_row = 0
    for f in directory_files(path):
        src = _open_jsonl_file(f, opts, first_row=first_row) if _input_format(f) == "jsonl" \
            else _open_parquet(f, opts, first_row)
        sources.append(src)
        first_row += src.total or 0

    def rows(digested: bool = False, skip: RowSet | None = None) -> Iterator[Any]:
        for i, src in enumerate(sources):
            # A file that grew since it was counted: the rows past its count wait for a rerun (they
            # would take the next file's numbers); the last file's extra rows are numbered on.
            items = src.digested() if digested else iter(src) if skip is None else src.skipping(skip)
            yield from items if i == len(sources) - 1 else itertools.islice(items, src.total)

    return RowSource(path, first_row, rows, _keep_types(sources), digests=lambda: rows(digested=True),
                     skipping=lambda done: rows(skip=done))


def open_rows(
    path: str,
    *,
    prompt_column: str = "prompt",
    id_column: str | None = None,
    keep_columns: Sequence[str] = (),
    display: str | None = None,
) -> RowSource:
    """Open `path` (.jsonl, .parquet, a directory of either, or - for JSONL on stdin) as a
    streaming RowSource; `display`: the name messages give a JSONL file (stdin a resume spooled to
    a file)."""
    opts = {"prompt_column": prompt_column, "id_column": id_column, "keep_columns": tuple(keep_columns)}
    if path == "-":
        return _open_stdin(opts)
    if os.path.isdir(path):
        return _open_directory(path, opts)
    fmt = _input_format(path)
    if fmt == "jsonl":
        return _open_jsonl_file(path, opts, display)
    if fmt == "parquet":
        return _open_parquet(path, opts)
    raise InputError(f"{path}: unsupported input; expected a .jsonl file (or .jsonl.gz, .zst, .bz2, .lz4), a "
                     ".parquet file, a directory of them, or - for JSONL on stdin")
