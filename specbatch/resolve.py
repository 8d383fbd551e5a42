"""From a recipe to what it runs: the model directory, the draft directory, the drafter config."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .algorithms import AlgorithmError, DrafterKind, get_algorithm, get_drafter
from .recipe import Recipe
from .speculative.spec_config import SpecConfig

DEMO_DIR = Path(__file__).parent / "assets" / "demo"


class JobError(Exception):
    """A job that must stop with a non-zero exit; the message is one actionable line."""


class RowStopped(JobError):
    """--fail-fast stopped the job at a bad row (exit 1; a problem with the job itself is exit 2)."""


class DeviceLost(JobError):
    """The device failed and this process cannot go on (a CUDA error: leave by os._exit, its
    context's teardown may abort the exit). `restartable`: the same command in a fresh process
    resumes past it (an output file, an input file, no --fail-fast)."""

    def __init__(self, line: str, hard_exit: bool, restartable: bool):
        super().__init__(line)
        self.hard_exit, self.restartable = hard_exit, restartable


def resolve_model(name: str) -> Path:
    """A model directory, or `default`: the demo model shipped inside the package."""
    if name == "default":
        path = DEMO_DIR / "target"
        if not (path / "config.json").is_file():
            raise JobError(f"the embedded demo model is missing from {path} (reinstall specbatch)")
        return path
    return Path(name).expanduser()


def _drafter(recipe: Recipe) -> DrafterKind | None:
    """The recipe's drafter kind from the table (None: it drafts nothing)."""
    try:
        name = recipe.drafter or get_algorithm(recipe.algorithm).default_drafter
        return None if name is None else get_drafter(name)
    except AlgorithmError as e:
        raise JobError(f"{recipe.source}: {e}") from None


def resolve_draft(recipe: Recipe) -> str | None:
    """The draft directory a recipe uses; `default` = the one shipped with the demo model. On
    another model, None for a drafter that reads its layer inside the target's own checkpoint
    (nextn_mtp); None for a recipe whose drafter reads no directory (vanilla)."""
    kind = _drafter(recipe)
    if kind is None or kind.directory is None:
        if recipe.draft not in (None, "default"):
            raise JobError(f"--draft {recipe.draft}: recipe {recipe.name!r} ({recipe.algorithm}) uses no draft model")
        return None
    if recipe.draft not in (None, "default"):
        return str(Path(recipe.draft).expanduser())
    if recipe.model != "default":
        if kind.in_target:
            return None
        raise JobError(f"recipe {recipe.name!r} with --model {recipe.model}: pass --draft DIR, the "
                       f"{kind.name} draft for that model (the embedded one fits the demo model only)")
    path = DEMO_DIR / (kind.demo or kind.name)
    if kind.demo is None or not (path / "config.json").is_file():
        raise JobError(f"recipe {recipe.name!r}: no embedded {kind.name} draft is bundled in this "
                       f"version ({path}); pass --model DIR --draft DIR")
    return str(path)


def drafter_check(recipe: Recipe) -> Callable[..., Any] | None:
    """The recipe's drafter's check of a draft directory (or of the target holding its layer),
    short of reading tensors; None for a recipe that drafts nothing or a drafter without one."""
    kind = _drafter(recipe)
    return None if kind is None else kind.checker()


def describe_draft(recipe: Recipe, draft: str | None) -> str | None:
    """The draft for summaries: its directory, where the layer is read from, or None."""
    kind = _drafter(recipe)
    if draft is None and kind is not None and kind.in_target:
        return kind.in_target
    return draft


def spec_config(recipe: Recipe, *, resolve: bool = True) -> SpecConfig:
    """What the engine runs; `resolve=False`: no draft directory (bench's random-weight modules)."""
    _drafter(recipe)
    draft = resolve_draft(recipe) if resolve else None
    return SpecConfig(algorithm=recipe.algorithm, num_steps=recipe.num_steps, topk=recipe.topk,
                      num_draft_tokens=recipe.num_draft_tokens, draft=draft, drafter=recipe.drafter)
