"""Input rows (JSONL / Parquet / OpenAI batch lines) and resumable output files."""

from .reader import RowSource, open_rows
from .rows import InputError, OutputError, RowError, RowRequest, parse_row
from .writer import OutputWriter, output_schema

__all__ = [
    "InputError",
    "OutputError",
    "OutputWriter",
    "RowError",
    "RowRequest",
    "RowSource",
    "open_rows",
    "output_schema",
    "parse_row",
]
