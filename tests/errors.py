"""Assertions that an error is one actionable line: a raised ModelError, or a CLI exit."""
from __future__ import annotations

import pytest

from specbatch.models.config import ModelError


def one_line_model_error(fn, *needles) -> str:
    """fn() raises a ModelError whose message is one line holding every needle; returns it."""
    with pytest.raises(ModelError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def one_line_cli_error(result, code: int) -> str:
    """The run failed with `code` and said why on exactly one stderr line; returns that line."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    return lines[0]
