"""`-o -`: JSONL records on stdout, in input order, each as soon as every row before it is out.
No parts, no lock, no resume: a stream cannot be resumed."""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, BinaryIO

import pyarrow as pa

from .. import records
from .digests import Expected, RowSet
from .rows import OutputError
from .merge import _struct_value, json_default
from .openai_out import check_keep_columns, check_output_format, to_openai_line


class StdoutClosed(OutputError):
    """The reader of `-o -` closed the pipe (`| head`): the stream ends here, as a piped tool's."""

    def __init__(self, written: int):
        super().__init__(f"stdout was closed by its reader after {written:,} rows")
        self.written = written


class StdoutWriter:
    format = "jsonl"
    path = "-"
    complete = False

    def __init__(self, *, save_token_ids: bool = False, keep_columns: Sequence[str] = (),
                 stream: BinaryIO | None = None, output_format: str = "native", model_name: str = "specbatch") -> None:
        """`output_format` "auto": OpenAI batch lines when the first row whose form is known (a
        malformed line's is not) is an OpenAI line; rows wait in order until one shows it."""
        self.output_format, self.model_name = check_output_format(output_format), model_name
        self.standard = records.columns({"save_token_ids": save_token_ids})
        self.keep_columns = list(dict.fromkeys(keep_columns))
        check_keep_columns(self.keep_columns, self.output_format)
        self.stream = stream or sys.stdout.buffer
        self.done_rows = RowSet()
        self._pending: dict[int, dict] = {}
        self._digests: dict[int, bytes] = {}
        self._next = 0
        self.count = 0

    def expected(self) -> Expected:
        return Expected(done=self.done_rows)

    def suspects(self) -> dict[int, str]:
        return {}                                     # no parts to resume: nothing to remember

    def set_suspects(self, rows: dict[int, str]) -> None:
        pass

    def set_context(self, tokens: int) -> str | None:
        return None                                   # nothing written before this run

    def add(self, record: dict, digest: bytes = b"") -> None:
        self._pending[record["row"]] = record
        self._digests[record["row"]] = digest          # in an OpenAI line's ids, as the file writer's
        if self.output_format == "auto":
            row = self._next
            while row in self._pending and self._pending[row].get("batch_line") is None:
                row += 1                              # malformed lines: their form is unknown
            if row not in self._pending:
                return                                # the first row of known form is not here yet
            self.output_format = "openai" if self._pending[row]["batch_line"] else "native"
            check_keep_columns(self.keep_columns, self.output_format)
        while self._next in self._pending:
            self._emit(self._pending.pop(self._next))
            self._next += 1
        if not self._pending:
            self._flush()

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.output_format == "auto":                # finalize: no row of known form came
            self.output_format = "native"
        out = {c.name: _struct_value(rec.get(c.name), c.type) if c.type is not None and pa.types.is_struct(c.type)
               else rec.get(c.name) for c in self.standard}
        for name in records.ON_REQUEST:             # on the rows that asked for them
            if rec.get(name) is not None:
                out[name] = rec[name]
        if self.output_format == "openai":
            out = to_openai_line({**rec, **out}, self.model_name, self._digests.get(rec["row"]))
        out.update((c, rec.get(c)) for c in self.keep_columns)
        try:
            self.stream.write((json.dumps(out, ensure_ascii=False, default=json_default) + "\n").encode("utf-8"))
        except BrokenPipeError:
            raise StdoutClosed(self.count) from None
        self._digests.pop(rec["row"], None)
        self.count += 1

    @property
    def buffered(self) -> int:
        return len(self._pending)

    def _flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise StdoutClosed(self.count) from None

    def commit(self) -> None:
        self._flush()

    def finalize(self) -> int:
        for row in sorted(self._pending):       # rows after a gap (a stopped run): still in order
            self._emit(self._pending.pop(row))
        self._flush()
        return self.count

    def reopen(self, digests: dict[int, bytes]) -> None:
        pass

    deferred: frozenset[str] = frozenset()                # (nothing was written before this run)

    def settle_deferred(self) -> None:
        pass

    def close(self) -> None:
        pass
