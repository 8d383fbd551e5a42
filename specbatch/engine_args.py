"""vLLM's engine arguments as `LLM(...)` (and Ray's `engine_kwargs`) read them, so that a migrated
script's first line runs: one with a specbatch setting of its own becomes that setting
(max_num_seqs -> batch_size, enforce_eager -> eager); one that asks for nothing specbatch does
differently at the value given is taken (tensor_parallel_size=1, trust_remote_code, a tokenizer
that is the model's); one that tunes what specbatch does its own way is taken with a warning
saying so; another value of one of these is a ValueError naming why; speculative_config is the recipe
that does what it asks (speculative_config.py). A key none of these tables
holds goes on to the recipe's keys, which refuse it naming what specbatch has instead (RecipeError).
Torch-free."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .speculative_config import speculative_recipe

# name -> the specbatch keyword it is
RENAMED = {"max_num_seqs": "batch_size", "enforce_eager": "eager"}


def _one(v: Any) -> bool:
    return v in (None, 1)


def _any_bool(v: Any) -> bool:
    return v is None or isinstance(v, bool)


_ONE_ENGINE = ("specbatch runs one engine per GPU, without tensor or pipeline parallelism: leave it 1 and use "
               "--gpus or Ray's concurrency")
# name -> (whether the value given asks for nothing specbatch does not do, what another value is told)
TAKEN: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel_size": (_one, _ONE_ENGINE),
    "pipeline_parallel_size": (_one, _ONE_ENGINE),
    "data_parallel_size": (_one, _ONE_ENGINE),
    # permission to run a model repository's own code: specbatch runs none (its model code ships with it)
    "trust_remote_code": (_any_bool, "expected true or false"),
    "disable_log_stats": (_any_bool, "expected true or false"),
    "enable_chunked_prefill": (_any_bool, "expected true or false (prompts are always prefilled in chunks here)"),
    "kv_cache_dtype": (lambda v: v in (None, "auto"), "not supported: the KV cache holds the model's dtype (expected "
                                                      "'auto')"),
    "tokenizer_mode": (lambda v: v in (None, "auto"), "not supported: the model directory's tokenizer is used "
                                                      "(expected 'auto')"),
    "load_format": (lambda v: v in (None, "auto", "safetensors"), "not supported: the model directory's safetensors "
                                                                   "are read (expected 'auto')"),
    "quantization": (lambda v: v is None, "not supported yet: no quantised weights (leave it unset)"),
    "distributed_executor_backend": (lambda v: v in (None, "mp", "uni", "ray"), "expected mp, uni or ray (one "
                                     "engine per GPU here: the backend changes nothing)"),
    "revision": (lambda v: v is None, "not supported: the model is a local directory (leave it unset)"),
    "tokenizer_revision": (lambda v: v is None, "not supported: the model is a local directory (leave it unset)"),
    "generation_config": (lambda v: v in (None, "auto"), "only 'auto': the model directory's generation_config.json "
                                                         "gives unset sampling fields (set them in rows or flags)"),
    "max_logprobs": (lambda v: v in (None, 20), "not supported: rows may ask for up to 20 logprobs a token "
                                               "(vLLM's default); expected 20"),
    "served_model_name": (lambda v: v is None or (isinstance(v, str) and v.strip() != "") or (
        isinstance(v, (list, tuple)) and bool(v) and all(isinstance(n, str) and n.strip() for n in v)),
                          "expected a non-empty name (or a list of them)"),
    # vllm run-batch's own flags
    "response_role": (lambda v: v in (None, "assistant"), "not supported: chat results' role is 'assistant'"),
    "reasoning_parser": (lambda v: v in (None, ""), "not supported: no reasoning parser: a reasoning model's "
                                                    "thinking stays in the completion (README)"),
    "enable_prompt_tokens_details": (lambda v: not v, "not supported: usage has no prompt_tokens_details"),
    "output_tmp_dir": (lambda v: True, ""),         # vLLM's too is used only for an http(s) output
    "port": (lambda v: True, ""),                   # the metrics server's (--enable-metrics, said below)
    "url": (lambda v: True, ""),
    "max_log_len": (lambda v: True, ""),            # request logging: none here
    "enable_log_requests": (_any_bool, "expected true or false"),
    "disable_log_requests": (_any_bool, "expected true or false"),
    "enable_force_include_usage": (_any_bool, "expected true or false (every result carries usage)"),
}

# name -> what specbatch does instead: taken, and said (they tune speed or memory, not results)
TUNED = {
    "max_num_batched_tokens": "prefill packs up to 8,192 prompt tokens a forward",
    "swap_space": "a preempted sequence is recomputed, not swapped to CPU memory",
    "block_size": "KV pages hold 64 tokens on a GPU, 16 on a CPU",
    "enable_metrics": "no metrics server: the progress lines and --stats-json report the run",
}


def _keyword(key: str, value: Any) -> str:
    return f"LLM({key}={value!r})"


def engine_args(given: Mapping[str, Any], eager: bool | None = None, say: bool = True,
                spell: Callable[[str, Any], str] = _keyword, model: str | Path | None = None) -> dict[str, Any]:
    """`given` (LLM's keywords) with vLLM's engine arguments read as above; a renamed one must agree
    with specbatch's own keyword if that is given too (`eager`: LLM's eager, when not in `given`).
    `say`: print the TUNED warnings (a check made before the engines start says nothing); `spell`:
    how messages name an argument and its value (the CLI's flags)."""
    own = {"batch_size": given.get("batch_size"), "eager": given.get("eager", eager) or None}
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key == "tokenizer":              # vLLM's tokenizer path: the model directory's here
            if value is not None and (model is None or Path(value).expanduser().resolve()
                                      != Path(model).expanduser().resolve()):
                raise ValueError(f"{spell(key, value)}: specbatch reads the tokenizer in the model directory; "
                                 "copy the tokenizer's files there and leave tokenizer unset")
        elif key in RENAMED:
            ours = RENAMED[key]
            if own.get(ours) is not None and value is not None and own[ours] != value:
                raise ValueError(f"{spell(key, value)} and {spell(ours, own[ours])} disagree: {key} is vLLM's "
                                 f"name for {ours}; give one")
            if value is not None:
                out[ours] = value
        elif key in TAKEN:
            ok, instead = TAKEN[key]
            if not ok(value):
                raise ValueError(f"{spell(key, value)}: {instead}")
        elif key == "speculative_config":   # the recipe doing what it asks: ("speculative", (name, overrides))
            if value is not None:
                out["speculative"] = speculative_recipe(value, spell(key, value), model, say)
        elif key in TUNED:
            if value not in (None, False) and say:
                print(f"warning: {spell(key, value)} is vLLM's and is not used: {TUNED[key]}", file=sys.stderr)
        else:
            out[key] = value
    return out
