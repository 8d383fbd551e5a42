"""Output: an exclusive lock, atomic Parquet parts under `<path>.parts/`, resume, final sorted merge.

What is at an output path P decides what a run does (under the lock `P.lock`):
  nothing                   a new job: `P.parts/` is created with the job's manifest
  `P.parts/` of ours        a resume: its committed rows are skipped (after data/digests.py has
                            proved the input still holds them)
  P finished by specbatch   complete: P carries the manifest (Parquet: in its footer; JSONL: in
                            the sidecar `P.manifest.json`, with P's size and hash); leftovers of
                            a clean-up that was cut short are removed
Anything else at P (a file specbatch did not write, a directory) is refused, and `overwrite`
removes only what specbatch wrote. Part names carry a per-writer token, so writers that share
an output never collide.

One concept, the output's life (what is at P, parts, the final merge), hence one class of ~400
lines; the pieces that stand alone live beside it: files.py (atomic writes, errors, hashes),
manifest.py (the job's record and its comparison), merge.py (columns, part tables, the merge).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import manifest
from .digests import Expected, RowSet, block_digests_arrow, block_size
from .files import file_hash, fs_error, fsync_dir, write_atomic
from ..records import ON_REQUEST
from .lock import OutputLock
from .openai_out import check_keep_columns, check_output_format, from_openai_line
from .merge import (
    DIGEST_COLUMN,
    STANDARD_COLUMNS,
    index_parts,
    merged_schema,
    output_schema,
    part_rows,
    part_table,
    typed_columns,
    unique_rows,
    write_jsonl,
    write_parquet,
)
from .rows import OutputError

__all__ = ["OutputWriter", "output_schema", "STANDARD_COLUMNS"]

_PART_RE = re.compile(r"^part-(?:[0-9a-f]{8}-)?(\d{6,})\.parquet$")
_OUR_NAMES = re.compile(r"^(part-.*\.parquet(\.tmp)?|manifest\.json(\.tmp)?|suspects\.json(\.tmp)?)$")
SUSPECTS = "suspects.json"               # inside the parts directory: rows in flight when the device failed


def _without_batch_lines(stored: dict, parts: list[str], mine: dict) -> dict:
    """Parts written before the manifest named how OpenAI lines read (`openai_lines`): when none of
    their rows was a batch line, that reading changed nothing they hold, so they resume."""
    key = "openai_lines"
    fp = stored.get("fingerprint")
    if not isinstance(fp, dict) or key in fp or key not in mine["fingerprint"]:
        return stored
    for part in parts:
        try:
            col = pq.read_table(part, columns=["batch_line"]).column("batch_line")
        except (OSError, pa.ArrowException, ValueError, KeyError):
            return stored                    # cannot tell: the refusal names the setting
        if pc.any(pc.fill_null(col, False)).as_py():
            return stored
    return {**stored, "fingerprint": {**fp, key: mine["fingerprint"][key]}}


def _manifest_bytes(m: dict) -> bytes:
    return json.dumps(m, indent=2, sort_keys=True).encode()


def _contexts(stored: dict) -> list[int]:
    """The contexts a manifest names (none before specbatch recorded them)."""
    found = stored.get("contexts")
    return sorted({int(c) for c in found if isinstance(c, int)}) if isinstance(found, list) else []


def output_file_format(path: str) -> str:
    """"parquet" or "jsonl" by the output path's ending (a ValueError naming it otherwise)."""
    low = path.lower()
    for fmt in ("parquet", "jsonl"):
        if low.endswith("." + fmt):
            return fmt
    raise ValueError(f"{path}: unsupported output; expected a path ending in .parquet or .jsonl")


# A part's schema metadata: what the final merge asks of its rows, so that it reads no part whole
# for it (a million-row output has thousands of parts).
PART_SUMMARY = "specbatch_part_summary"


def _summary(recs: list[dict]) -> dict:
    """The on-request columns (logprobs, choices...) some record holds, and the first row whose
    form is known with whether it is an OpenAI batch line ([row, bool] or None)."""
    known = [(r["row"], bool(r["batch_line"])) for r in recs if r.get("batch_line") is not None]
    return {"set": [name for name in ON_REQUEST if any(r.get(name) is not None for r in recs)],
            "first_form": min(known) if known else None}


def _read_summary(path: str, schema: pa.Schema) -> dict:
    """_summary of a part written before parts held one, from its columns (null counts and the
    rows with a known form: no values of the on-request columns are read into Python)."""
    cols = [c for c in ("row", "batch_line", *ON_REQUEST) if c in schema.names]
    t = pq.read_table(path, columns=cols)
    first = None
    if "batch_line" in cols:
        known = t.filter(pc.is_valid(t.column("batch_line")))
        if known.num_rows:
            i = pc.index(known.column("row"), pc.min(known.column("row"))).as_py()
            first = [known.column("row")[i].as_py(), bool(known.column("batch_line")[i].as_py())]
    return {"set": [name for name in ON_REQUEST if name in cols and t.column(name).null_count < t.num_rows],
            "first_form": first}


class OutputWriter:
    """Buffers result records and commits them as atomic Parquet parts; finalize() merges them.
    Holds the output's lock from construction to close() (or the end of a `with` block)."""

    def __init__(
        self,
        path: str,
        *,
        fingerprint: dict,
        save_token_ids: bool = False,
        keep_columns: Sequence[str] = (),
        commit_rows: int = 256,
        commit_seconds: float = 30.0,
        commit_interval: float = 0.0,
        overwrite: bool = False,
        output_format: str = "native",
        model_name: str = "specbatch",
        keep_types: dict[str, pa.DataType] | None = None,
    ) -> None:
        """`output_format`: native rows, "openai" (OpenAI Batch output lines, JSONL only), or "auto"
        (openai when the job's first row is an OpenAI batch line and the output is JSONL);
        `model_name`: the response's model when a line names none; `keep_types`: the input's
        types of kept columns (RowSource.column_types), which a Parquet output keeps. A part is
        committed once `commit_rows` are buffered and `commit_interval` seconds passed since the
        last (rows finishing thousands a second make parts of a second's rows, not thousands of
        256-row parts, each a file and two fsyncs in the job's loop), or after `commit_seconds`."""
        self.format = output_file_format(path)
        check_output_format(output_format)
        if output_format == "openai" and self.format != "jsonl":
            raise ValueError(f"--output-format openai writes OpenAI batch lines (JSONL): give a .jsonl output, not {path}")
        self.output_format = output_format if self.format == "jsonl" else "native"
        self.model_name = model_name
        keep_columns = tuple(dict.fromkeys(keep_columns))         # --keep-columns t,t: once
        check_keep_columns(keep_columns, self.output_format, reserved=(DIGEST_COLUMN,))
        self.path = path
        self.parts_dir = path + ".parts"
        self.sidecar = path + ".manifest.json"          # JSONL outputs only
        self.fingerprint = dict(fingerprint)
        self.save_token_ids = save_token_ids
        self.keep_columns = keep_columns
        self.keep_types = dict(keep_types or {})
        self.commit_rows = max(1, commit_rows)
        self.commit_seconds = commit_seconds
        self.commit_interval = commit_interval
        self.done_rows = RowSet()
        self.complete = False
        self.job = os.urandom(8).hex()
        self.deferred: set[str] = set()      # settings the stored manifest predates (manifest.DEFERRED)
        self._token = os.urandom(4).hex()
        self._buffer: list[tuple[dict, bytes]] = []
        self._last_commit = time.monotonic()
        self._next_part = 0
        self._final_rows: int | None = None
        self.error_rows: int | None = None    # rows of the finished output that hold an error (finalize)
        self._final_manifest: dict | None = None
        self.context: int | None = None        # tokens a row may hold in the engine writing (set_context)
        self._contexts: list[int] = []         # the contexts of the engines that wrote the committed rows

        if os.path.isdir(path):
            raise OutputError(f"{path} is a directory; choose an output file path (.parquet or .jsonl)")
        parent = os.path.dirname(os.path.abspath(path))
        try:
            if os.path.lexists(parent) and not os.path.isdir(parent):
                raise OSError(errno.ENOTDIR, "not a directory")
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise fs_error(parent, e) from None
        self._lock = OutputLock(path).acquire()
        try:
            self._open(overwrite)
        except BaseException:
            self._lock.release()
            raise

    # ---- lock ----------------------------------------------------------

    def close(self) -> None:
        """Release the output lock (buffered rows are NOT committed: call commit() first)."""
        self._lock.release()

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- open / resume -------------------------------------------------

    def _open(self, overwrite: bool) -> None:
        for leftover in (self.path + ".tmp", self.parts_dir + ".tmp", self.parts_dir + ".done", self.sidecar + ".tmp"):
            self._remove_ours(leftover)
        final = self._read_final() if os.path.lexists(self.path) else None
        parts = self._read_parts_manifest() if os.path.isdir(self.parts_dir) else None
        if overwrite:
            if os.path.lexists(self.path) and final is None and not self._stale_ours(parts):
                raise OutputError(f"--overwrite: {self.path} {self._not_ours()}; "
                                  "remove it yourself or choose another --output")
            if os.path.isdir(self.parts_dir):
                self._remove_ours(self.parts_dir)
            for p in (self.path, self.sidecar):
                self._remove_ours(p)
            final = parts = None
        if final is not None and parts is not None and final.get("job") == parts.get("job"):
            self._remove_ours(self.parts_dir)       # a finished job whose clean-up was cut short
            parts = None
        if parts is not None:
            if os.path.lexists(self.path) and final is None and not self._stale_ours(parts):
                raise OutputError(f"{self.path} exists but {self._not_ours()}, "
                                  f"beside this job's parts in {self.parts_dir}; move it away and rerun")
            self._resume(parts)
        elif final is not None:
            self._check_manifest(final, self.path, "pass --overwrite to replace it, or choose another --output")
            self.complete = True
            self._final_manifest = final
            self._contexts = _contexts(final)
            self.done_rows = RowSet(self._final_file_rows())
            self._final_rows = len(self.done_rows)
        elif os.path.lexists(self.path):
            raise OutputError(f"{self.path} exists and {self._not_ours()}; "
                              "choose another --output or remove it yourself")
        else:
            self._create_parts_dir()

    def _remove_ours(self, path: str) -> None:
        """Remove a file or a parts directory this writer's naming says is ours; never anything else."""
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                names = os.listdir(path)
                if not all(_OUR_NAMES.match(n) for n in names):
                    raise OutputError(f"{path} holds files specbatch did not write ({', '.join(sorted(names)[:3])}...); "
                                      "remove it yourself or choose another --output")
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        except OSError as e:
            raise fs_error(path, e) from None

    def _not_ours(self) -> str:
        """Why the file at P is not taken for a specbatch output: a JSONL output edited after it
        was written still has its manifest beside it, which says so."""
        side = manifest.read_json(self.sidecar) if self.format == "jsonl" else None
        if isinstance(side, dict) and isinstance(side.get("output"), dict):
            return (f"is not the file specbatch wrote there (its size or hash differs from what "
                    f"{self.sidecar} records: edited since?)")
        return "was not written by specbatch (no manifest)"

    def _stale_ours(self, parts: dict | None) -> bool:
        """P is the JSONL output whose sidecar this job's finalize overwrote before it was cut short."""
        if parts is None or self.format != "jsonl":
            return False
        side = manifest.read_json(self.sidecar)
        return isinstance(side, dict) and side.get("job") == parts.get("job")

    def _manifest(self) -> dict:
        return {
            "version": manifest.MANIFEST_VERSION,
            "job": self.job,
            "fingerprint": manifest.jsonable(self.fingerprint),
            "save_token_ids": self.save_token_ids,
            "output_format": self.output_format,
            "keep_columns": list(self.keep_columns),
            **({"contexts": self._contexts} if self._contexts else {}),
        }

    def set_context(self, tokens: int) -> str | None:
        """The context (prompt + completion tokens a row may hold) of the engine writing this run's
        rows; the manifest names it once its first rows are committed. -> a one-line warning where
        the rows committed before came from engines with another: unset, --max-model-len follows the
        model and the memory the KV pool gets, which a resume on another GPU may change (not a
        setting the fingerprint can hold: it is known once the engine is built)."""
        self.context = int(tokens)
        if not self._contexts or self.context in self._contexts:
            return None
        before = " and ".join(map(str, self._contexts))
        return (f"warning: {self.path}: its rows so far were written with a context of {before} tokens and this "
                f"engine's is {self.context} (--max-model-len unset: the model's limit or what the KV pool holds); "
                f"rows reaching past {min(self.context, *self._contexts)} tokens end differently: resume on a GPU "
                "that holds the earlier context, or pass --overwrite to redo every row")

    def _create_parts_dir(self, first: pa.Table | None = None) -> None:
        """The parts directory with the job's manifest and, when given, a `first` part: both are
        in it before it takes its name (a reopen stopped midway must not leave a parts directory
        without the finished rows, which would redo them all)."""
        tmp_dir = self.parts_dir + ".tmp"
        try:
            os.mkdir(tmp_dir)
            write_atomic(os.path.join(tmp_dir, manifest.MANIFEST), lambda f: f.write(self._dump_manifest()))
            if first is not None:
                write_atomic(os.path.join(tmp_dir, self._part_name()), lambda f: pq.write_table(first, f))
            os.rename(tmp_dir, self.parts_dir)
        except OSError as e:
            raise fs_error(self.parts_dir, e) from None
        fsync_dir(os.path.dirname(os.path.abspath(self.parts_dir)))

    def _dump_manifest(self, extra: dict | None = None) -> bytes:
        return _manifest_bytes({**self._manifest(), **(extra or {})})

    def _part_paths(self) -> list[str]:
        return sorted(os.path.join(self.parts_dir, n) for n in os.listdir(self.parts_dir) if _PART_RE.match(n))

    def _mismatch(self, stored: dict) -> str | None:
        return manifest.mismatch(stored, self._manifest())

    def _check_manifest(self, stored: dict, where: str, how: str) -> None:
        manifest.check(stored, self._manifest(), where, how)
        self.deferred = manifest.deferred(stored)

    def settle_deferred(self) -> None:
        """The committed rows passed the job's check of the settings the manifest predates
        (manifest.DEFERRED): record them, so rows committed from here on are not held against it."""
        if not self.deferred or not os.path.isdir(self.parts_dir):
            return
        path = os.path.join(self.parts_dir, manifest.MANIFEST)
        stored = manifest.read_json(path)
        if isinstance(stored, dict) and isinstance(stored.get("fingerprint"), dict):
            mine = self._manifest()["fingerprint"]
            stored = {**stored, "fingerprint": {**stored["fingerprint"], **{k: mine[k] for k in self.deferred}}}
            write_atomic(path, lambda f: f.write(_manifest_bytes(stored)))
        self.deferred = set()

    def _read_parts_manifest(self) -> dict | None:
        """The parts dir's manifest; None for an empty dir without one (it is recreated)."""
        stored = manifest.read_json(os.path.join(self.parts_dir, manifest.MANIFEST))
        if isinstance(stored, dict):
            return stored
        try:
            names = [n for n in os.listdir(self.parts_dir) if not n.endswith(".tmp")]
        except OSError as e:
            raise fs_error(self.parts_dir, e) from None
        if not names:
            self._remove_ours(self.parts_dir)
            return None
        raise OutputError(f"{self.parts_dir}: cannot read {manifest.MANIFEST}; pass --overwrite to start over")

    def _resume(self, stored: dict) -> None:
        for name in os.listdir(self.parts_dir):
            if name.endswith(".tmp"):
                self._remove_ours(os.path.join(self.parts_dir, name))
        parts = self._part_paths()
        if self._mismatch(stored) is not None and not parts:
            # Nothing was committed: adopt the new job instead of refusing.
            write_atomic(os.path.join(self.parts_dir, manifest.MANIFEST), lambda f: f.write(self._dump_manifest()))
            return
        adopted = _without_batch_lines(stored, parts, self._manifest())
        self._check_manifest(adopted, self.parts_dir, "rerun the same command to resume, or pass --overwrite")
        if adopted is not stored:            # recorded (once the resume is taken), so later resumes compare it
            stored = adopted
            write_atomic(os.path.join(self.parts_dir, manifest.MANIFEST), lambda f: f.write(_manifest_bytes(stored)))
        self.job = stored["job"]
        self._contexts = _contexts(stored)
        for part in parts:
            try:
                rows = pq.read_table(part, columns=["row"]).column("row").to_numpy()
            except (OSError, pa.ArrowException, ValueError, KeyError) as e:
                print(f"warning: {part}: unreadable part deleted, its rows will be redone "
                      f"({' '.join(str(e).split())})", file=sys.stderr)
                self._remove_ours(part)
                continue
            self.done_rows.update(rows)
            self._next_part = max(self._next_part, int(_PART_RE.match(os.path.basename(part)).group(1)) + 1)

    def _read_final(self) -> dict | None:
        """The manifest of a finished output at P, or None when P is not one of ours."""
        if self.format == "parquet":
            try:
                meta = pq.read_schema(self.path).metadata or {}
            except (OSError, pa.ArrowException, ValueError):
                return None
            raw = meta.get(manifest.MANIFEST_KEY)
            try:
                stored = json.loads(raw) if raw is not None else None
            except ValueError:
                return None
            return stored if isinstance(stored, dict) else None
        side = manifest.read_json(self.sidecar)
        if not isinstance(side, dict) or not isinstance(side.get("output"), dict):
            return None
        try:
            size, digest = file_hash(self.path)
        except OSError:
            return None
        if [size, digest] != [side["output"].get("bytes"), side["output"].get("blake2b")]:
            return None
        return side

    def _final_file_rows(self) -> list[int]:
        try:
            if self.format == "parquet":
                return pq.read_table(self.path, columns=["row"]).column("row").to_pylist()
            with open(self.path, "rb") as f:
                return [self._native(json.loads(line))["row"] for line in f if line.strip()]
        except (OSError, pa.ArrowException, ValueError, KeyError, TypeError) as e:
            raise OutputError(f"{self.path} exists but cannot be read ({' '.join(str(e).split())}); "
                              "pass --overwrite to replace it") from None

    # ---- what a resume must find in the input --------------------------

    def expected(self) -> Expected:
        """The done rows and their input digests: per row from the parts, per block when finished."""
        if self.complete:
            info = (self._final_manifest or {}).get("input", {})
            return Expected(done=self.done_rows, block=int(info.get("block", 0) or 0), blocks=info.get("blocks"))
        rows, digests, _ = part_rows(self._part_paths()) if self.done_rows else (pa.array([], pa.int64()), [], None)
        return Expected(done=self.done_rows, rows=rows.to_numpy(), digests=digests)

    def reopen(self, digests: dict[int, bytes]) -> None:
        """Turn a finished output back into one committed part, so a run can add the rows it lacks.
        `digests`: the input digest of each of its rows (from data.digests.check_input)."""
        if not self.complete:
            return
        try:
            if self.format == "parquet":
                records = pq.read_table(self.path).replace_schema_metadata(None).to_pylist()
            else:
                with open(self.path, "rb") as f:
                    records = [self._native(json.loads(line)) for line in f if line.strip()]
        except (OSError, pa.ArrowException, ValueError) as e:
            raise OutputError(f"{self.path}: cannot read it back ({' '.join(str(e).split())})") from None
        self._create_parts_dir(self._part_table([(r, digests.get(r["row"], b"")) for r in records]))
        self.complete = False

    # ---- writing parts -------------------------------------------------

    def add(self, record: dict, digest: bytes = b"") -> None:
        """Buffer one record (with its input row's digest); commits a part when commit_rows or
        commit_seconds is reached."""
        if self.complete:
            raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
        row = record.get("row")
        if isinstance(row, bool) or not isinstance(row, int):
            raise ValueError(f"record 'row' must be an int, got {row!r}")
        if self.output_format == "auto" and record.get("batch_line"):
            check_keep_columns(self.keep_columns, "openai")     # the final file will be OpenAI lines
        self._buffer.append((record, digest))
        since = time.monotonic() - self._last_commit
        if since >= self.commit_seconds or (len(self._buffer) >= self.commit_rows and since >= self.commit_interval):
            self.commit()

    def _native(self, line: dict) -> dict:
        """A line of a finished JSONL output as a native record (OpenAI lines converted back, their
        kept columns with them)."""
        if "custom_id" in line and "specbatch" in line:
            return {**from_openai_line(line), **{c: line.get(c) for c in self.keep_columns}}
        return line

    def _part_table(self, items: list[tuple[dict, bytes]]) -> pa.Table:
        # Parts hold every column a final format may need (the OpenAI ones, logprobs and choices too),
        # and a summary of what the merge asks of their rows.
        recs = [r for r, _ in items]
        table = part_table(recs, [d for _, d in items],
                           options={"save_token_ids": self.save_token_ids, "openai": True,
                                    **{name: True for name in ON_REQUEST}},
                           keep_columns=self.keep_columns, json_typed=self.format == "jsonl",
                           keep_types=self.keep_types)
        return table.replace_schema_metadata({PART_SUMMARY: json.dumps(_summary(recs))})

    def _part_name(self) -> str:
        name = f"part-{self._token}-{self._next_part:06d}.parquet"
        self._next_part += 1
        return name

    def commit(self) -> None:
        """Write the buffered records as one new part, atomically."""
        self._last_commit = time.monotonic()
        if not self._buffer:
            return
        if self.complete:
            raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
        if self.context is not None and self.context not in self._contexts:
            # named before its first rows land: a crash between the two leaves a context no row has
            # (at worst a warning too many), never rows whose context the manifest does not name
            before, self._contexts = self._contexts, sorted([*self._contexts, self.context])
            try:
                write_atomic(os.path.join(self.parts_dir, manifest.MANIFEST), lambda f: f.write(self._dump_manifest()))
            except BaseException:
                self._contexts = before
                raise
        # Taken off the buffer first: an interrupt after the rename must not commit them twice.
        items, self._buffer = self._buffer, []
        part = os.path.join(self.parts_dir, self._part_name())
        try:
            table = self._part_table(items)
            write_atomic(part, lambda f: pq.write_table(table, f))
        except BaseException:
            if not os.path.exists(part):
                self._buffer = items + self._buffer         # not committed: kept for the next try
            raise
        self.done_rows.update([r["row"] for r, _ in items])

    def suspects(self) -> dict[int, str]:
        """Rows that were in flight when the device failed in an earlier run (row -> the failure),
        not yet finished: the job runs them one at a time before the rest."""
        stored = manifest.read_json(os.path.join(self.parts_dir, SUSPECTS))
        rows = stored.get("rows", {}) if isinstance(stored, dict) else {}
        return {int(r): str(e) for r, e in rows.items() if str(r).isdigit() and int(r) not in self.done_rows}

    def set_suspects(self, rows: dict[int, str]) -> None:
        path = os.path.join(self.parts_dir, SUSPECTS)
        try:
            if rows:
                body = json.dumps({"rows": {str(r): e for r, e in sorted(rows.items())}}, indent=1).encode()
                write_atomic(path, lambda f: f.write(body))
            elif os.path.lexists(path):
                os.remove(path)
        except OSError as e:
            raise fs_error(path, e) from None

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # ---- final merge ---------------------------------------------------

    def _openai_output(self, summaries: list[dict]) -> bool:
        """Whether the final file is OpenAI batch lines: asked for, or "auto" and the first row
        whose form is known is an OpenAI batch line (a malformed line's is not), as `-o -` decides."""
        if self.output_format != "auto":
            return self.output_format == "openai"
        known = [tuple(s["first_form"]) for s in summaries if s["first_form"] is not None]
        return bool(known and min(known)[1])

    def _summaries(self, parts: list[str], schemas: list[pa.Schema]) -> list[dict]:
        """What the merge asks of each part's rows (_summary): from the part's own metadata (in
        its schema), read from its rows for a part written before parts held it."""
        summaries = []
        for p, schema in zip(parts, schemas):
            held = (schema.metadata or {}).get(PART_SUMMARY.encode())
            summaries.append(json.loads(held) if held is not None else _read_summary(p, schema))
        return summaries

    def finalize(self) -> int:
        """Commit, merge all parts into the final file (sorted by row, deduplicated); return the row count."""
        if self.complete:
            if self._buffer:
                raise OutputError(f"{self.path} is already complete; pass --overwrite to regenerate it")
            return self._final_rows or 0
        self.commit()
        try:
            parts = self._part_paths()
            index = index_parts(parts, count_errors=True)   # each part's footer and rows: one opening
            summaries = self._summaries(parts, index.schemas)
            openai = self._openai_output(summaries)
            options = {"save_token_ids": self.save_token_ids, "openai": openai,
                       **{name: any(name in s["set"] for s in summaries) for name in ON_REQUEST}}
            schema, as_json = merged_schema(index.schemas, options, self.keep_columns, parts)
            rows, digests, self.error_rows = unique_rows(index.tables, count_errors=True)
        except OSError as e:
            raise fs_error(self.parts_dir, e) from None
        index = index._replace(tables=[t.select(["row"]) for t in index.tables])   # (digests: not held twice)
        block = block_size(len(rows))
        final = {"input": {"rows": len(rows), "block": block, "blocks": block_digests_arrow(rows, digests, block)}}
        json_columns = (*typed_columns(options), *self.keep_columns) if self.format == "jsonl" else ()
        count = 0

        def parquet(f: BinaryIO) -> None:
            nonlocal count
            count = write_parquet(f, parts, schema, as_json, {manifest.MANIFEST_KEY: self._dump_manifest(final)},
                                  index)

        def jsonl(f: BinaryIO) -> None:
            nonlocal count
            count, size, digest = write_jsonl(f, parts, schema, as_json, json_columns,
                                              self.model_name if openai else None, self.keep_columns, index)
            final["output"] = {"bytes": size, "blake2b": digest}

        if self.format == "parquet":
            write_atomic(self.path, parquet)
        else:
            # The sidecar names the merged file's hash before the file takes P's place: until both
            # are there, P does not check out as finished and the parts stay authoritative.
            tmp = self.path + ".tmp"
            try:
                with open(tmp, "wb") as f:
                    jsonl(f)
                    f.flush()
                    os.fsync(f.fileno())
                write_atomic(self.sidecar, lambda f: f.write(self._dump_manifest(final)))
                os.replace(tmp, self.path)
            except OSError as e:
                if os.path.lexists(tmp):
                    os.remove(tmp)
                raise fs_error(self.path, e) from None
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        try:
            os.rename(self.parts_dir, self.parts_dir + ".done")
            self._remove_ours(self.parts_dir + ".done")
        except OSError as e:
            raise fs_error(self.parts_dir, e) from None
        fsync_dir(os.path.dirname(os.path.abspath(self.parts_dir)))
        self.complete = True
        self._final_rows = count
        return count
