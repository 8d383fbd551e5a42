"""Output: atomic Parquet parts under `<path>.parts/`, resume from them, final sorted merge."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .rows import OutputError

SPEC_TYPE = pa.struct(
    [
        ("verify_steps", pa.int64()),
        ("draft_tokens", pa.int64()),
        ("accepted_tokens", pa.int64()),
        ("accept_length", pa.float64()),
        ("accept_histogram", pa.list_(pa.int64())),
    ]
)
_BASE_FIELDS = [
    pa.field("row", pa.int64()),
    pa.field("id", pa.string()),
    pa.field("completion", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("spec", SPEC_TYPE),
]
_TOKEN_IDS_FIELD = pa.field("output_token_ids", pa.list_(pa.int64()))
STANDARD_COLUMNS = tuple(f.name for f in _BASE_FIELDS) + (_TOKEN_IDS_FIELD.name,)

MANIFEST = "manifest.json"
MANIFEST_KEY = b"specbatch.manifest"   # the manifest inside a finished Parquet output
_PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
MERGE_CHUNK_BYTES = 512 << 20  # uncompressed bytes gathered per output chunk in finalize()
JSONL_BATCH_ROWS = 4096


def output_schema(save_token_ids: bool = False) -> pa.Schema:
    """Arrow schema of the standard output columns (keep columns are appended per job)."""
    return pa.schema(_BASE_FIELDS + ([_TOKEN_IDS_FIELD] if save_token_ids else []))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _write_atomic(final: str, write) -> None:
    """Call write(file) on `<final>.tmp`, fsync, then rename over `final`."""
    tmp = final + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def _jsonable(value: object) -> object:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


_UNSET = object()


def _short(value: object) -> str:
    text = "<unset>" if value is _UNSET else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _spec_value(spec: object) -> dict | None:
    if spec is None:
        return None
    out = {k: spec.get(k) for k in SPEC_TYPE.names}
    if out["accept_length"] is not None:
        out["accept_length"] = float(out["accept_length"])
    return out


def _infer_array(values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return _json_strings(values)


def _json_strings(values: list) -> pa.Array:
    """Fallback for values of mixed types: strings as they are, anything else as JSON text."""
    return pa.array(
        [None if v is None else v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
         for v in values],
        pa.string(),
    )


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    try:
        pa.array([], type=src).cast(dst)
        return True
    except (pa.ArrowException, TypeError, ValueError):
        return False


class OutputWriter:
    """Buffers result records and commits them as atomic Parquet parts; finalize() merges them."""

    def __init__(
        self,
        path: str,
        *,
        fingerprint: dict,
        save_token_ids: bool = False,
        keep_columns: Sequence[str] = (),
        commit_rows: int = 256,
        commit_seconds: float = 30.0,
        overwrite: bool = False,
    ) -> None:
        low = path.lower()
        if low.endswith(".parquet"):
            self.format = "parquet"
        elif low.endswith(".jsonl"):
            self.format = "jsonl"
        else:
            raise ValueError(f"{path}: unsupported output; expected a path ending in .parquet or .jsonl")
        keep_columns = tuple(keep_columns)
        std = set(STANDARD_COLUMNS)
        for c in keep_columns:
            if c in std:
                raise ValueError(f"keep column '{c}' clashes with the output column of the same name")
        self.path = path
        self.parts_dir = path + ".parts"
        self.fingerprint = dict(fingerprint)
        self.save_token_ids = save_token_ids
        self.keep_columns = keep_columns
        self.commit_rows = max(1, commit_rows)
        self.commit_seconds = commit_seconds
        self.schema = output_schema(save_token_ids)
        self.done_rows: set[int] = set()
        self.complete = False
        self._buffer: list[dict] = []
        self._last_commit = time.monotonic()
        self._next_part = 0
        self._final_rows: int | None = None

        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        for leftover in (path + ".tmp", self.parts_dir + ".tmp"):
            _remove(leftover)
        if overwrite:
            _remove(self.parts_dir)
            _remove(path)

        if os.path.isdir(self.parts_dir):
            self._resume()
        elif os.path.exists(path):
            self.complete = True
            self.done_rows = self._final_file_rows()
            self._final_rows = len(self.done_rows)
            self._check_final_manifest()
        else:
            self._create_parts_dir()

    # ---- open / resume -------------------------------------------------

    def _manifest(self) -> dict:
        return {
            "version": 1,
            "fingerprint": _jsonable(self.fingerprint),
            "save_token_ids": self.save_token_ids,
            "keep_columns": list(self.keep_columns),
        }

    def _create_parts_dir(self) -> None:
        tmp_dir = self.parts_dir + ".tmp"
        os.mkdir(tmp_dir)
        _write_atomic(os.path.join(tmp_dir, MANIFEST), lambda f: f.write(self._dump_manifest()))
        os.rename(tmp_dir, self.parts_dir)
        _fsync_dir(os.path.dirname(os.path.abspath(self.parts_dir)))

    def _dump_manifest(self) -> bytes:
        return json.dumps(self._manifest(), indent=2, sort_keys=True).encode()

    def _part_paths(self) -> list[tuple[int, str]]:
        found = []
        for name in os.listdir(self.parts_dir):
            m = _PART_RE.match(name)
            if m:
                found.append((int(m.group(1)), os.path.join(self.parts_dir, name)))
        return sorted(found)

    def _mismatch(self, stored: dict) -> str | None:
        """First differing key between the stored manifest and this job, as 'key: old vs new'."""
        mine = self._manifest()
        old_fp, new_fp = stored.get("fingerprint", {}), mine["fingerprint"]
        if not isinstance(old_fp, dict):
            old_fp = {}
        for key in [*new_fp, *(k for k in old_fp if k not in new_fp)]:
            old, new = old_fp.get(key, _UNSET), new_fp.get(key, _UNSET)
            if old != new:
                return f"{key}: {_short(old)} vs {_short(new)}"
        for key in ("save_token_ids", "keep_columns"):
            if stored.get(key, _UNSET) != mine[key]:
                return f"{key}: {_short(stored.get(key, _UNSET))} vs {_short(mine[key])}"
        return None

    def _resume(self) -> None:
        for name in os.listdir(self.parts_dir):
            if name.endswith(".tmp"):
                _remove(os.path.join(self.parts_dir, name))
        parts = self._part_paths()
        manifest_path = os.path.join(self.parts_dir, MANIFEST)
        try:
            with open(manifest_path, "rb") as f:
                stored = json.loads(f.read())
            if not isinstance(stored, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            if not parts:
                _remove(self.parts_dir)
                self._create_parts_dir()
                return
            raise OutputError(
                f"{self.parts_dir}: cannot read {MANIFEST} ({' '.join(str(e).split())}); "
                "pass --overwrite to start over"
            ) from None
        diff = self._mismatch(stored)
        if diff is not None:
            if not parts:
                # Nothing was committed: adopt the new job instead of refusing.
                _write_atomic(manifest_path, lambda f: f.write(self._dump_manifest()))
                return
            raise OutputError(
                f"{self.parts_dir} was written by a different job ({diff}); "
                "rerun the same command to resume, or pass --overwrite"
            )
        for index, part in parts:
            try:
                rows = pq.read_table(part, columns=["row"]).column("row").to_pylist()
            except (OSError, pa.ArrowException, ValueError, KeyError) as e:
                print(
                    f"warning: {part}: unreadable part deleted, its rows will be redone ({' '.join(str(e).split())})",
                    file=sys.stderr,
                )
                _remove(part)
                continue
            self.done_rows.update(rows)
            self._next_part = max(self._next_part, index + 1)

    def _final_file_rows(self) -> set[int]:
        try:
            if self.format == "parquet":
                return set(pq.read_table(self.path, columns=["row"]).column("row").to_pylist())
            rows = set()
            with open(self.path, "rb") as f:
                for line in f:
                    if line.strip():
                        rows.add(int(json.loads(line)["row"]))
            return rows
        except (OSError, pa.ArrowException, ValueError, KeyError, TypeError) as e:
            raise OutputError(
                f"{self.path} exists but cannot be read ({' '.join(str(e).split())}); pass --overwrite to replace it"
            ) from None

    def _check_final_manifest(self) -> None:
        """A finished Parquet output carries its job's manifest: refuse to treat another job's
        output as this one's. (JSONL has nowhere to keep it: only its rows are checked.)"""
        if self.format != "parquet":
            return
        meta = pq.read_schema(self.path).metadata or {}
        raw = meta.get(MANIFEST_KEY)
        if raw is None:
            return
        diff = self._mismatch(json.loads(raw))
        if diff is not None:
            raise OutputError(f"{self.path} was written by a different job ({diff}); "
                              "pass --overwrite to replace it, or choose another --output")

    def reopen(self) -> None:
        """Turn a finished output back into one committed part, so a run can add the rows it lacks."""
        if not self.complete:
            return
        if self.format == "parquet":
            table = pq.read_table(self.path).replace_schema_metadata(None)
        else:
            with open(self.path, "rb") as f:
                table = self._part_table([json.loads(line) for line in f if line.strip()])
        self._create_parts_dir()
        _write_atomic(os.path.join(self.parts_dir, "part-000000.parquet"), lambda f: pq.write_table(table, f))
        self._next_part = 1
        self.complete = False

    # ---- writing parts -------------------------------------------------

    def add(self, record: dict) -> None:
        """Buffer one record; commits a part when commit_rows or commit_seconds is reached."""
        if self.complete:
            raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
        row = record.get("row")
        if isinstance(row, bool) or not isinstance(row, int):
            raise ValueError(f"record 'row' must be an int, got {row!r}")
        self._buffer.append(record)
        if len(self._buffer) >= self.commit_rows or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.commit()

    def _part_table(self, records: list[dict]) -> pa.Table:
        arrays = []
        for f in self.schema:
            if f.name == "spec":
                values = [_spec_value(r.get("spec")) for r in records]
            else:
                values = [r.get(f.name) for r in records]
            arrays.append(pa.array(values, type=f.type))
        names = list(self.schema.names)
        for c in self.keep_columns:
            arrays.append(_infer_array([r.get(c) for r in records]))
            names.append(c)
        return pa.Table.from_arrays(arrays, names=names)

    def commit(self) -> None:
        """Write the buffered records as one new part, atomically."""
        self._last_commit = time.monotonic()
        if not self._buffer:
            return
        if self.complete:
            raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
        table = self._part_table(self._buffer)
        part = os.path.join(self.parts_dir, f"part-{self._next_part:06d}.parquet")
        _write_atomic(part, lambda f: pq.write_table(table, f))
        self._next_part += 1
        self._buffer = []

    # ---- final merge ---------------------------------------------------

    def _merged_schema(self, part_schemas: list[pa.Schema]) -> tuple[pa.Schema, set[str]]:
        """Standard schema + unified keep-column types; keep columns that cannot unify become JSON strings."""
        fields = list(self.schema)
        as_json: set[str] = set()
        for c in self.keep_columns:
            types = [s.field(c).type for s in part_schemas if c in s.names]
            try:
                unified = pa.unify_schemas(
                    [pa.schema([pa.field(c, t)]) for t in types] or [pa.schema([pa.field(c, pa.null())])],
                    promote_options="permissive",
                ).field(c).type
                if not all(_castable(t, unified) for t in types):
                    raise pa.ArrowTypeError("not castable")
            except (pa.ArrowException, TypeError, ValueError):
                unified = pa.string()
                as_json.add(c)
            fields.append(pa.field(c, unified))
        return pa.schema(fields), as_json

    @staticmethod
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
                arrays.append(col.cast(f.type))
            else:
                arrays.append(col)
        return pa.Table.from_arrays(arrays, schema=schema)

    def _merge_chunks(self, parts: list[str], schema: pa.Schema, as_json: set[str]) -> Iterator[pa.Table]:
        """Yield the merged output in row order, in chunks bounded by MERGE_CHUNK_BYTES."""
        part_rows = [pq.read_table(p, columns=["row"]).column("row").combine_chunks() for p in parts]
        sizes = []
        for p in parts:
            md = pq.ParquetFile(p).metadata
            sizes.append(sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups)))
        unique = pc.unique(pa.chunked_array(part_rows, pa.int64())) if parts else pa.array([], pa.int64())
        unique = unique.take(pc.array_sort_indices(unique))
        if len(unique) == 0:
            return
        n_chunks = min(len(unique), max(1, math.ceil(sum(sizes) / MERGE_CHUNK_BYTES)))
        bounds = [unique[i * len(unique) // n_chunks].as_py() for i in range(n_chunks)] + [None]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            pieces = []
            for p, rows in zip(parts, part_rows):
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
                pieces.append(self._conform(table, schema, as_json))
            chunk = pa.concat_tables(pieces)
            chunk = chunk.take(pc.sort_indices(chunk, sort_keys=[("row", "ascending")]))  # stable
            rows = chunk.column("row").combine_chunks()
            if len(rows) > 1:
                first = pc.not_equal(rows.slice(1), rows.slice(0, len(rows) - 1))
                chunk = chunk.filter(pa.concat_arrays([pa.array([True]), first]))
            yield chunk

    def finalize(self) -> int:
        """Commit, merge all parts into the final file (sorted by row, deduplicated); return the row count."""
        if self.complete and not os.path.isdir(self.parts_dir):
            if self._buffer:
                raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
            return self._final_rows or 0
        self.commit()
        parts = [p for _, p in self._part_paths()]
        schema, as_json = self._merged_schema([pq.read_schema(p) for p in parts])
        count = 0
        final_schema = schema.with_metadata({MANIFEST_KEY: self._dump_manifest()})

        def write_parquet(f) -> None:
            nonlocal count
            with pq.ParquetWriter(f, final_schema) as w:
                wrote = False
                for chunk in self._merge_chunks(parts, schema, as_json):
                    w.write_table(chunk.replace_schema_metadata(final_schema.metadata))
                    count += chunk.num_rows
                    wrote = True
                if not wrote:
                    w.write_table(final_schema.empty_table())

        def write_jsonl(f) -> None:
            nonlocal count
            for chunk in self._merge_chunks(parts, schema, as_json):
                for batch in chunk.to_batches(max_chunksize=JSONL_BATCH_ROWS):
                    lines = [json.dumps(r, ensure_ascii=False, default=str) for r in batch.to_pylist()]
                    f.write(("\n".join(lines) + "\n").encode("utf-8"))
                    count += len(lines)

        _write_atomic(self.path, write_parquet if self.format == "parquet" else write_jsonl)
        shutil.rmtree(self.parts_dir)
        _fsync_dir(os.path.dirname(os.path.abspath(self.parts_dir)))
        self.complete = True
        self._final_rows = count
        return count
