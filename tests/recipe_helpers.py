"""Shared by the recipe tests (tests/recipe/test_recipe_*.py): a recipe parsed from a mapping, the
one-line RecipeError it must give (naming its source), and a recipe file written to a folder."""
from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.recipe import RecipeError, parse_recipe


SRC = "recipes/x.yaml"


def _parse(**data):
    return parse_recipe(data, SRC)


def _error(data, source: str = SRC) -> str:
    with pytest.raises(RecipeError) as exc:
        parse_recipe(data, source)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(source + ": ")
    return msg


def _write(tmp_path: Path, text: str, name: str = "mine.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p
