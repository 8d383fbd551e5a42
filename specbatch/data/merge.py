"""The output's columns, part tables, and the final merge of parts in row order.

Typed columns (`id` and the keep columns) keep the input's types where the format can: JSONL
parts hold them as JSON text, decoded again into the final JSONL (exact values, nested or
mixed); Parquet parts infer an Arrow type per part, unified across parts at the merge (values of
types that cannot unify become JSON text).
"""
from __future__ import annotations

import base64
import datetime
import json
import math
from collections.abc import Iterator, Sequence
from typing import BinaryIO, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import records
from .files import HashingFile
from .openai_out import to_openai_line

STANDARD_COLUMNS = records.NAMES
DIGEST_COLUMN = "_input_digest"      # parts only: the input row's digest (data/digests.py)
MERGE_CHUNK_BYTES = 512 << 20        # uncompressed bytes gathered per output chunk
JSONL_BATCH_ROWS = 4096


def output_schema(save_token_ids: bool = False, id_type: pa.DataType = pa.string()) -> pa.Schema:
    """Arrow schema of the standard output columns (keep columns are appended per job); columns
    typed by the input (the id) get `id_type`."""
    names = [c.name for c in records.columns({"save_token_ids": save_token_ids})]
    return pa.schema(records.arrow_fields(names, id_type))


def _struct_value(value: object, type_: pa.StructType) -> dict | None:
    """A record's struct column as its declared fields (extra keys dropped)."""
    if value is None:
        return None
    return {f.name: value.get(f.name) for f in type_}


def json_default(value: object) -> object:
    """A value JSON cannot hold (a Parquet input's kept column), as JSON readers take it: dates and
    times in ISO 8601, bytes in base64, anything else (a decimal, a duration) as its text."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def _json_text(value: object, ascii: bool = True) -> str | None:
    # Parts use ASCII escapes: a value arrow could not encode (a lone surrogate) still round-trips.
    return None if value is None else json.dumps(value, ensure_ascii=ascii, default=json_default)


def _json_strings(values: list) -> pa.Array:
    """Values of mixed types: strings as they are, anything else as JSON text."""
    return pa.array([v if v is None or isinstance(v, str) else _json_text(v, ascii=False) for v in values], pa.string())


def _has_empty_struct(t: pa.DataType) -> bool:
    """Parquet cannot write a struct without fields (a column of {} values)."""
    if pa.types.is_struct(t):
        return t.num_fields == 0 or any(_has_empty_struct(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_empty_struct(t.value_type)
    if pa.types.is_map(t):
        return _has_empty_struct(t.key_type) or _has_empty_struct(t.item_type)
    return False


def _infer_array(values: list) -> pa.Array:
    try:
        arr = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return _json_strings(values)
    return _json_strings(values) if _has_empty_struct(arr.type) else arr


def _typed_array(values: list, type_: pa.DataType | None) -> pa.Array:
    """A kept column's values as the input typed them (uint8 stays uint8, a decimal keeps its
    precision in every part), else as their values infer."""
    if type_ is not None:
        try:
            return pa.array(values, type=type_)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
    return _infer_array(values)


# Standard columns of mixed values (stop_reason: a stop string or a stop token id, as vLLM's) that a
# Parquet output holds as text, so every job's file has one schema (a token id as its decimal text);
# JSONL keeps each value's own type.
TEXT_IN_PARQUET = ("stop_reason",)


def part_table(recs: list[dict], digests: list[bytes], *, options: dict[str, bool],
               keep_columns: Sequence[str], json_typed: bool,
               keep_types: dict[str, pa.DataType] | None = None) -> pa.Table:
    """One part: the standard columns `options` turn on, the typed columns, and each row's input
    digest; `keep_types`: the input's types of kept columns (a Parquet input's schema)."""
    standard = records.columns(options)
    arrays, names = [], []
    for c in standard:
        if c.type is None:
            continue                      # typed by the input: with the kept columns below
        values = [r.get(c.name) for r in recs]
        if pa.types.is_struct(c.type):
            values = [_struct_value(v, c.type) for v in values]
        arrays.append(pa.array(values, type=c.type))
        names.append(c.name)
    typed = [c.name for c in standard if c.type is None]
    for c in (*typed, *keep_columns):
        values = [r.get(c) for r in recs]
        if json_typed:
            arrays.append(pa.array([_json_text(v) for v in values], pa.string()))
        elif c in TEXT_IN_PARQUET:
            arrays.append(pa.array([None if v is None else str(v) for v in values], pa.string()))
        else:
            arrays.append(_typed_array(values, (keep_types or {}).get(c)))
        names.append(c)
    arrays.append(pa.array(digests, pa.binary()))
    names.append(DIGEST_COLUMN)
    return pa.Table.from_arrays(arrays, names=names)


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    try:
        pa.array([], type=src).cast(dst)
        return True
    except (pa.ArrowException, TypeError, ValueError):
        return False


def _ints_fit(parts: Sequence[str], schemas: list[pa.Schema], column: str) -> bool:
    """Whether every integer of `column` in the parts that hold it as integers is exact in float64."""
    for p, s in zip(parts, schemas):
        if column in s.names and pa.types.is_integer(s.field(column).type):
            top = pc.max(pc.abs(pq.read_table(p, columns=[column]).column(column))).as_py()
            if top is not None and top > 2**53:
                return False
    return True


def merged_schema(part_schemas: list[pa.Schema], options: dict[str, bool],
                  keep_columns: Sequence[str], parts: Sequence[str] | None = None) -> tuple[pa.Schema, set[str]]:
    """The standard columns `options` turn on + unified typed columns (standard ones typed by the
    input, then the kept ones); those that cannot unify become JSON strings, as do integers and
    floats together when an integer is past float64's exact range (`parts`: the files, read for it)."""
    standard = records.columns(options)
    typed_standard = {c.name for c in standard if c.type is None}
    unified_types: dict[str, pa.DataType] = {}
    as_json: set[str] = set()
    for c in (*(n for n in records.NAMES if n in typed_standard), *keep_columns):
        if c in TEXT_IN_PARQUET and c in typed_standard:
            unified_types[c] = pa.string()
            continue
        types = [s.field(c).type for s in part_schemas if c in s.names]
        types = [t for t in types if t != pa.null()] or [pa.string() if c in typed_standard else pa.null()]
        try:
            unified = pa.unify_schemas([pa.schema([pa.field(c, t)]) for t in types],
                                       promote_options="permissive").field(c).type
            if not all(_castable(t, unified) for t in types):
                raise pa.ArrowTypeError("not castable")
            if (pa.types.is_floating(unified) and any(pa.types.is_integer(t) for t in types)
                    and parts is not None and not _ints_fit(parts, part_schemas, c)):
                raise pa.ArrowTypeError("integers past float64's exact range")
        except (pa.ArrowException, TypeError, ValueError):
            unified = pa.string()
            as_json.add(c)
        unified_types[c] = unified
    fields = [pa.field(c.name, c.type if c.type is not None else unified_types[c.name]) for c in standard]
    return pa.schema(fields + [pa.field(c, unified_types[c]) for c in keep_columns]), as_json


def _conform(table: pa.Table, schema: pa.Schema, as_json: set[str]) -> pa.Table:
    arrays = []
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if f.name in as_json and col.type != pa.string():
            arrays.append(_json_strings(col.to_pylist()))
        elif col.type != f.type:
            try:
                arrays.append(col.cast(f.type))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
                # a struct an older part wrote without a field since added (logprobs' rank): an
                # older pyarrow casts no struct to one with more fields
                arrays.append(pa.array(col.to_pylist(), type=f.type))
        else:
            arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=schema)


class PartIndex(NamedTuple):
    """What the merge reads of every part before its rows, in one opening of each: its schema, its
    rows' numbers, input digests (and errors), and the parts' uncompressed bytes."""
    schemas: list[pa.Schema]
    tables: list[pa.Table]             # "row", DIGEST_COLUMN (and "error") of each part
    size: int


def index_parts(parts: Sequence[str], count_errors: bool = False) -> PartIndex:
    """Each part's footer and its row, digest (and error) columns, the file opened once."""
    columns = ["row", DIGEST_COLUMN, *(["error"] if count_errors else [])]
    schemas, tables, size = [], [], 0
    for p in parts:
        with pq.ParquetFile(p) as pf:
            schemas.append(pf.schema_arrow)
            md = pf.metadata
            size += sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
            tables.append(pf.read(columns=columns))
    return PartIndex(schemas, tables, size)


def unique_rows(tables: Sequence[pa.Table], count_errors: bool = False) -> tuple[pa.Array, pa.Array, int | None]:
    """(sorted unique row numbers, their input digests, and with `count_errors` how many of those
    rows the tables hold as errors: a resumed output's count, earlier runs' included); a row held
    twice takes the first table's (the merge keeps that one)."""
    if not tables:
        return pa.array([], pa.int64()), pa.array([], pa.binary()), 0 if count_errors else None
    t = pa.concat_tables(tables)
    errors = len(pc.unique(t.filter(pc.is_valid(t.column("error"))).column("row"))) if count_errors else None
    t = t.take(pc.sort_indices(t, sort_keys=[("row", "ascending")]))
    rows = t.column("row").combine_chunks()
    if len(rows) > 1:
        first = pc.not_equal(rows.slice(1), rows.slice(0, len(rows) - 1))
        t = t.filter(pa.concat_arrays([pa.array([True]), first]))
    return t.column("row").combine_chunks(), t.column(DIGEST_COLUMN).combine_chunks(), errors


def part_rows(parts: Sequence[str], count_errors: bool = False) -> tuple[pa.Array, list[bytes], int | None]:
    """unique_rows over every part (the digests as bytes), in one read of each."""
    rows, digests, errors = unique_rows(index_parts(parts, count_errors).tables, count_errors)
    return rows, digests.to_pylist(), errors


def merge_chunks(parts: Sequence[str], schema: pa.Schema, as_json: set[str],
                 index: PartIndex | None = None) -> Iterator[pa.Table]:
    """The merged output in row order (deduplicated), in chunks bounded by MERGE_CHUNK_BYTES;
    `index`: the parts' index_parts, when the caller has it (each part is then read once more, whole)."""
    if index is None:
        index = index_parts(parts)
    rows_of = [t.column("row").combine_chunks() for t in index.tables]
    size = index.size
    unique = pc.unique(pa.chunked_array(rows_of, pa.int64())) if parts else pa.array([], pa.int64())
    unique = unique.take(pc.array_sort_indices(unique))
    if len(unique) == 0:
        return
    n_chunks = min(len(unique), max(1, math.ceil(size / MERGE_CHUNK_BYTES)))
    bounds = [unique[i * len(unique) // n_chunks].as_py() for i in range(n_chunks)] + [None]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pieces = []
        for p, rows in zip(parts, rows_of):
            mask = None
            if n_chunks > 1:
                mask = pc.greater_equal(rows, lo)
                if hi is not None:
                    mask = pc.and_(mask, pc.less(rows, hi))
                if not pc.any(mask).as_py():
                    continue
            table = pq.read_table(p)
            if mask is not None:
                table = table.filter(mask)
            pieces.append(_conform(table, schema, as_json))
        chunk = pa.concat_tables(pieces)
        chunk = chunk.take(pc.sort_indices(chunk, sort_keys=[("row", "ascending")]))  # stable
        rows = chunk.column("row").combine_chunks()
        if len(rows) > 1:
            first = pc.not_equal(rows.slice(1), rows.slice(0, len(rows) - 1))
            chunk = chunk.filter(pa.concat_arrays([pa.array([True]), first]))
        yield chunk


def jsonl_lines(chunk: pa.Table, json_columns: Sequence[str], openai_model: str | None = None,
                keep_columns: Sequence[str] = ()) -> Iterator[bytes]:
    """A merged chunk as JSONL bytes, typed columns held as JSON text decoded to their values;
    with `openai_model`, as OpenAI batch output lines (the kept columns beside their keys, as
    `-o -` writes them)."""
    for batch in chunk.to_batches(max_chunksize=JSONL_BATCH_ROWS):
        lines = []
        for r in batch.to_pylist():
            for c in json_columns:
                if r.get(c) is not None:
                    r[c] = json.loads(r[c])
            if openai_model is not None:
                line = to_openai_line(r, openai_model, r.pop(DIGEST_COLUMN, None))
                line.update((c, r.get(c)) for c in keep_columns)
                r = line
            lines.append(json.dumps(r, ensure_ascii=False, default=json_default))
        yield ("\n".join(lines) + "\n").encode("utf-8")


def typed_columns(options: dict[str, bool]) -> tuple[str, ...]:
    """Standard columns whose type follows the input (held as JSON text in JSONL parts)."""
    return tuple(c.name for c in records.columns(options) if c.type is None)


def write_parquet(f: BinaryIO, parts: Sequence[str], schema: pa.Schema, as_json: set[str],
                  metadata: dict[bytes, bytes], index: PartIndex | None = None) -> int:
    """The merged parts as one Parquet file carrying `metadata` (the manifest); -> rows written."""
    count = 0
    with pq.ParquetWriter(f, schema.with_metadata(metadata)) as w:
        for chunk in merge_chunks(parts, schema, as_json, index):
            w.write_table(chunk.replace_schema_metadata(metadata))
            count += chunk.num_rows
        if count == 0:
            w.write_table(schema.with_metadata(metadata).empty_table())
    return count


def write_jsonl(f: BinaryIO, parts: Sequence[str], schema: pa.Schema, as_json: set[str],
                json_columns: Sequence[str], openai_model: str | None = None,
                keep_columns: Sequence[str] = (), index: PartIndex | None = None) -> tuple[int, int, str]:
    """The merged parts as JSONL (native rows, or OpenAI batch lines for `openai_model`);
    -> (rows, bytes, blake2b hex of the bytes)."""
    out = HashingFile(f)
    count = 0
    if openai_model is not None:              # the lines' ids take the input row's digest
        schema = schema.append(pa.field(DIGEST_COLUMN, pa.binary()))
    for chunk in merge_chunks(parts, schema, as_json, index):
        for data in jsonl_lines(chunk, json_columns, openai_model, keep_columns):
            out.write(data)
        count += chunk.num_rows
    return count, out.size, out.h.hexdigest()
