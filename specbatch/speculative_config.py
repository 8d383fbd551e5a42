"""vLLM's `speculative_config` (LLM(...), Ray's engine_kwargs, run-batch's --speculative-config JSON)
read as the recipe that does the same: a script that speculates with vLLM speculates here.

    {"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}  -> eagle3_topk1, S = K, draft HEAD
    {"method": "mtp" | "deepseek_mtp" | ..._mtp, "num_speculative_tokens": K}
                                                                       -> nextn_mtp, S = K (the layer reused)

Both are chains (k = 1, N = K + 1), as vLLM's are without a speculative_token_tree. A method specbatch
has no drafter for, or a key asking for what it does not do, is a ValueError naming it and what
to use instead. Torch-free."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .recipe import Recipe, load_recipe

_METHODS = "'eagle3' (an EAGLE3 head in 'model') or 'mtp' (the target's multi-token-prediction layers)"
_RECIPES = "or choose a recipe (specbatch recipes)"

# keys that ask for nothing specbatch does not do at these values
_DEFAULTS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "draft_tensor_parallel_size": (lambda v: v in (None, 1), "the draft runs beside the target on one GPU: leave it 1"),
    "quantization": (lambda v: v is None, "no quantised drafts: leave it unset"),
    "revision": (lambda v: v is None, "the draft is a local directory: leave it unset"),
    "code_revision": (lambda v: v is None, "the draft is a local directory: leave it unset"),
    "max_model_len": (lambda v: v is None, "the draft runs at the target's context: leave it unset"),
    "enforce_eager": (lambda v: v is None or isinstance(v, bool), "expected true or false"),
    "speculative_token_tree": (lambda v: v is None, "a tree is a recipe here: --recipe eagle3_tree (num_steps, "
                                                     "topk, num_draft_tokens) with --draft HEAD"),
    "acceptance_method": (lambda v: v in (None, "rejection_sampler"), "acceptance is lossless rejection sampling "
                                                                     "here (expected 'rejection_sampler')"),
    "prompt_lookup_max": (lambda v: v is None, "n-gram drafting is not supported"),
    "prompt_lookup_min": (lambda v: v is None, "n-gram drafting is not supported"),
}
# keys specbatch decides its own way: taken, and said
_TUNED = {
    "disable_by_batch_size": "each batch's verify width is chosen as the job runs, down to plain decoding steps "
                             "where speculation does not pay",
}
_KNOWN = ("method", "model", "num_speculative_tokens", *_DEFAULTS, *_TUNED)


def _same_dir(a: str | Path, b: str | Path | None) -> bool:
    return b is not None and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def speculative_recipe(config: Any, name: str = "speculative_config", target: str | Path | None = None,
                       say: bool = True) -> tuple[str, dict[str, Any]]:
    """(builtin recipe name, its overrides: num_steps, topk, num_draft_tokens, draft) for vLLM's
    `config`; `name`: how messages name it (a flag, a keyword); `target`: the target model's
    directory (an MTP 'model' that is the target means its own layers); `say`: print what is
    taken but decided otherwise here."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{name}: expected a mapping (vLLM's speculative config), got {type(config).__name__}")
    unknown = [k for k in config if k not in _KNOWN]
    if unknown:
        raise ValueError(f"{name}: '{unknown[0]}' is not supported by specbatch (known: {', '.join(_KNOWN)}); "
                         f"remove it {_RECIPES}")
    for key, (ok, instead) in _DEFAULTS.items():
        if key in config and not ok(config[key]):
            raise ValueError(f"{name}: {key} {config[key]!r}: {instead}")
    method, model, k = config.get("method"), config.get("model"), config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{name}: num_speculative_tokens: expected an integer >= 1 (draft tokens a cycle), "
                         f"got {k!r}")
    if model is not None and not isinstance(model, (str, Path)):
        raise ValueError(f"{name}: model: expected a directory, got {model!r}")
    steps = {"num_steps": k, "topk": 1, "num_draft_tokens": k + 1}
    if method == "eagle3":
        if model is None:
            raise ValueError(f"{name}: method 'eagle3' needs 'model': the EAGLE3 head's directory")
        recipe, draft = "eagle3_topk1", str(model)
    elif isinstance(method, str) and (method == "mtp" or method.endswith("_mtp")):
        # vLLM's MTP methods name the model family; the layers sit inside the target, or in 'model'
        recipe, draft = "nextn_mtp", None if model is None or _same_dir(model, target) else str(model)
    elif method is None:
        raise ValueError(f"{name}: method: required here (vLLM guesses it from the draft's name): {_METHODS}")
    elif method == "eagle":
        raise ValueError(f"{name}: method 'eagle': EAGLE-1/2 heads are not supported; specbatch runs EAGLE3 heads "
                         "(method 'eagle3')")
    else:
        raise ValueError(f"{name}: method {method!r} is not supported; expected {_METHODS}, {_RECIPES}")
    for key, instead in _TUNED.items():
        if config.get(key) is not None and say:
            print(f"warning: {name}: {key} is vLLM's and is not used: {instead}", file=sys.stderr)
    return recipe, {**steps, "draft": draft}


def speculative_base(recipe: str | Recipe, draft: str | Path | None, speculative: tuple[str, dict[str, Any]],
                     name: str = "speculative_config") -> tuple[str | Recipe, dict[str, Any]]:
    """The recipe a speculative_config (speculative_recipe's reading) runs, with its overrides
    (draft included), where `recipe` is the caller's, left at vanilla: its name, or a vanilla Recipe
    whose own settings (context, dtype, sampling defaults) are kept, the algorithm taken from the
    chosen recipe. Another recipe beside it is an error, as is a draft that disagrees with its 'model'."""
    chosen, overrides = speculative
    algorithm = recipe if isinstance(recipe, str) else recipe.algorithm
    if algorithm != "vanilla":
        shown = recipe if isinstance(recipe, str) else recipe.name
        raise ValueError(f"{name} and recipe {shown!r} both choose the algorithm: give one")
    if draft is not None and overrides["draft"] is not None and not _same_dir(draft, overrides["draft"]):
        raise ValueError(f"{name}'s model {overrides['draft']!r} and draft {str(draft)!r} disagree: give one")
    overrides = {**overrides, "draft": overrides["draft"] if overrides["draft"] is not None else draft}
    if isinstance(recipe, str):
        return chosen, overrides
    base = load_recipe(chosen)
    steps = {k: overrides[k] for k in ("num_steps", "topk", "num_draft_tokens")}
    return recipe.with_overrides(name=base.name, description=base.description, algorithm=base.algorithm,
                                 drafter=base.drafter, **steps), overrides
