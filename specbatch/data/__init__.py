"""Input rows (JSONL / Parquet / OpenAI batch lines) and resumable output files."""

from .digests import InputChanged, RowSet, check_input
from .merge import output_schema
from .reader import RowSource, open_rows
from .rows import InputError, OutputError, RowError, RowRequest, parse_row
from .stdout import StdoutClosed, StdoutWriter
from .writer import OutputWriter

__all__ = [
    "InputChanged",
    "InputError",
    "OutputError",
    "OutputWriter",
    "RowError",
    "RowRequest",
    "RowSet",
    "RowSource",
    "StdoutClosed",
    "StdoutWriter",
    "check_input",
    "open_rows",
    "output_schema",
    "parse_row",
]
