"""The CLI in process, through typer's CliRunner: an uncaught exception fails the test with its
message (instead of reading as an exit code); `ok` also wants exit 0."""
from __future__ import annotations

from typer.testing import CliRunner

from specbatch.cli import app


def cli(*args, input=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}\n{result.output}")
    return result


def ok(*args, input=None):
    r = cli(*args, input=input)
    assert r.exit_code == 0, r.output
    return r
