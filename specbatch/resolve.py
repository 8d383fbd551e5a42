"""From a recipe to what it runs: the model directory, the draft directory, the drafter config."""
from __future__ import annotations

from pathlib import Path

from .recipe import Recipe
from .speculative.factory import AVAILABLE, SpecConfig

DEMO_DIR = Path(__file__).parent / "assets" / "demo"


class JobError(Exception):
    """A job that must stop with a non-zero exit; the message is one actionable line."""


def resolve_model(name: str) -> Path:
    """A model directory, or `default`: the demo model shipped inside the package."""
    if name == "default":
        path = DEMO_DIR / "target"
        if not (path / "config.json").is_file():
            raise JobError(f"the embedded demo model is missing from {path} (reinstall specbatch)")
        return path
    return Path(name).expanduser()


def resolve_draft(recipe: Recipe) -> str | None:
    """The draft directory a recipe uses; `default` = the one shipped with the demo model. For
    nextn_mtp on another model, None: the MTP layer inside the target's own checkpoint."""
    if recipe.algorithm == "vanilla":
        if recipe.draft is not None:
            raise JobError(f"--draft {recipe.draft}: recipe {recipe.name!r} (vanilla) uses no draft model")
        return None
    if recipe.draft not in (None, "default"):
        return str(Path(recipe.draft).expanduser())
    if recipe.model != "default":
        if recipe.drafter == "nextn_mtp":
            return None
        raise JobError(f"recipe {recipe.name!r} with --model {recipe.model}: pass --draft DIR, a "
                       f"{recipe.drafter} draft for that model (the embedded one fits the demo model only)")
    path = DEMO_DIR / recipe.drafter
    if not (path / "config.json").is_file():
        raise JobError(f"recipe {recipe.name!r}: no embedded {recipe.drafter} draft is bundled in this "
                       f"version ({path}); pass --model DIR --draft DIR")
    return str(path)


def describe_draft(recipe: Recipe, draft: str | None) -> str | None:
    """The draft for summaries: its directory, where the MTP layer is read from, or None."""
    if draft is None and recipe.drafter == "nextn_mtp":
        return "the MTP layer inside the target checkpoint"
    return draft


def spec_config(recipe: Recipe) -> SpecConfig:
    if recipe.algorithm not in AVAILABLE:
        raise JobError(f"{recipe.source}: algorithm {recipe.algorithm!r} is not available in this "
                       f"version yet (available: {', '.join(AVAILABLE)})")
    return SpecConfig(algorithm=recipe.algorithm, num_steps=recipe.num_steps, topk=recipe.topk,
                      num_draft_tokens=recipe.num_draft_tokens, draft=resolve_draft(recipe),
                      drafter=recipe.drafter)
