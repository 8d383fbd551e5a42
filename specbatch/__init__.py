"""specbatch: offline batch generation with speculative decoding.

Library use (what the CLI wraps):

    from specbatch import LLM
    llm = LLM(recipe="eagle3_topk1")          # the embedded demo model and its EAGLE3 head
    for c in llm.generate(["def add(a, b):", "import os"], {"max_tokens": 16}):
        print(c.index, repr(c.text), c.finish_reason, c.spec["accept_length"])

A whole file, resumable, as `specbatch run` does it:

    from specbatch import JobOptions, load_recipe, run_job
    summary = run_job("examples/prompts.jsonl", load_recipe("eagle3_topk1"),
                      JobOptions(output="completions.jsonl"))
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": ".llm", "Completion": ".llm",
    "Engine": ".engine", "EngineOptions": ".engine",
    "load_recipe": ".recipe", "Recipe": ".recipe", "RecipeError": ".recipe", "SamplingDefaults": ".recipe",
    "SamplingParams": ".params",
    "open_rows": ".data", "OutputWriter": ".data",
    "run_job": ".job", "JobOptions": ".job", "JobError": ".job",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'specbatch' has no attribute {name!r}")
