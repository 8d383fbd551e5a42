"""specbatch: offline batch generation with speculative decoding.

Library use (what the CLI wraps):

    from specbatch import load_recipe, run_job
    summary = run_job("data.jsonl", load_recipe("vanilla"), output="out.parquet")

or, record by record:

    from specbatch import Engine, EngineOptions, open_rows
    engine = Engine(model_dir, EngineOptions(batch_size=8))
    for record in engine.generate(open_rows("data.jsonl")):
        ...
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Engine": ".engine", "EngineOptions": ".engine",
    "load_recipe": ".recipe", "Recipe": ".recipe", "RecipeError": ".recipe",
    "open_rows": ".data", "OutputWriter": ".data",
    "run_job": ".job", "JobOptions": ".job",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'specbatch' has no attribute {name!r}")
