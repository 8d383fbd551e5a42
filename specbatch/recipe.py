"""Recipes: YAML presets for a draft algorithm plus run defaults (schema: recipes/schema.md)."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from .algorithms import ALGORITHMS, SPEC_PARAMS, ParamError, describe    # the algorithm table (torch-free)
from .models.config import DTYPE_NAMES
from .params import LOGIT_BIAS_MAX, LOGIT_BIAS_RANGE, LOGPROBS_MAX, N_MAX, PENALTY_RANGE, SamplingParams

DTYPES = ("auto", *DTYPE_NAMES)
DTYPE_ALIASES = {"half": "float16", "float": "float32"}       # vLLM's --dtype spellings
BUILTIN_PREFIX = "<builtin>"


class RecipeError(Exception):
    """A recipe cannot be found, parsed or validated; the message is one line naming file and key.
    `key` / `detail`: the offending key and what was wrong with it, where there is one."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key, self.detail = key, detail or message


# The recipe's `sampling` defaults are the one SamplingParams (params.py); this name stays for
# code that reads it as "the defaults".
SamplingDefaults = SamplingParams


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    algorithm: str
    num_steps: int | None
    topk: int | None
    num_draft_tokens: int | None
    model: str
    drafter: str | None                  # the draft module: the algorithm's own, or naive_2token's pick
    draft: str | None
    dtype: str
    batch_size: int | None               # slots; None: as many as memory holds (up to 512 on a GPU)
    max_model_len: int | None
    # share of the GPU's whole memory the engine may take (weights, activations, KV), as vLLM's;
    # None: the KV pool takes 90% of what is free once the model is loaded
    gpu_memory_utilization: float | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    source: str = "<memory>"

    def with_overrides(self, **kw: Any) -> Recipe:
        """Return a copy with top-level or sampling fields replaced; None values are ignored.

        Overriding `algorithm` with a different value drops the old algorithm's
        num_steps/topk/num_draft_tokens unless they are overridden too.
        """
        data = self.to_dict()
        sampling = dict(data["sampling"])
        label = f"{self.source} (overrides)"
        kw = {k: v for k, v in kw.items() if v is not None}
        if "algorithm" in kw and kw["algorithm"] != self.algorithm:
            for key in SPEC_PARAMS + ("drafter",):
                data[key] = None
        for key, value in kw.items():
            if key == "sampling":
                if not isinstance(value, (dict, SamplingDefaults)):
                    _fail(label, key, f"expected a mapping, got {describe(value)}")
                items = _sampling_to_dict(value) if isinstance(value, SamplingDefaults) else value
                sampling.update(items)
            elif key in _TOP_KEYS:
                data[key] = value
            elif key in _SAMPLING_KEYS:
                sampling[key] = value
            else:
                _unknown_key(label, key, _TOP_KEYS + _SAMPLING_KEYS)
        data["sampling"] = sampling
        return replace(parse_recipe(data, label), source=self.source)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the schema's shape (lists, not tuples), without `source`."""
        return {
            "name": self.name,
            "description": self.description,
            "algorithm": self.algorithm,
            "num_steps": self.num_steps,
            "topk": self.topk,
            "num_draft_tokens": self.num_draft_tokens,
            "drafter": self.drafter,
            "model": self.model,
            "draft": self.draft,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "sampling": _sampling_to_dict(self.sampling),
        }


_TOP_KEYS = tuple(f.name for f in fields(Recipe) if f.name != "source")
_SAMPLING_KEYS = tuple(f.name for f in fields(SamplingDefaults))


def _sampling_to_dict(s: SamplingParams) -> dict[str, Any]:
    return s.to_dict()


# ---------------------------------------------------------------------------
# errors and type checks


def _fail(source: str, key: str, message: str) -> None:
    raise RecipeError(f"{source}: {key}: {message}", key=key, detail=message)


# vLLM engine arguments users bring to LLM(...) / engine_kwargs, and what specbatch has instead.
VLLM_ENGINE_ARGS = {
    "max_num_seqs": "batch_size (sequences decoded together)",
    "max_num_batched_tokens": "nothing to set: prefill packs up to 8,192 prompt tokens a forward",
    "tensor_parallel_size": "nothing: one engine per GPU (--gpus, or Ray's concurrency), no tensor parallelism",
    "pipeline_parallel_size": "nothing: one engine per GPU (--gpus, or Ray's concurrency)",
    "trust_remote_code": "nothing to set: Llama-family and the listed drafters' code ships with specbatch",
    "enforce_eager": "eager=True (LLM) or --eager",
    "speculative_config": "the recipe (algorithm, num_steps, topk, num_draft_tokens) and draft",
}


def _unknown_key(source: str, key: Any, known: tuple[str, ...], prefix: str = "") -> None:
    hint = ""
    if isinstance(key, str) and not prefix and key in VLLM_ENGINE_ARGS:
        hint = f"; vLLM's {key} is, here, {VLLM_ENGINE_ARGS[key]}"
    elif isinstance(key, str):
        close = difflib.get_close_matches(key, known, n=1)
        if not close:
            lowered = {k.lower(): k for k in known}
            close = [lowered[key.lower()]] if key.lower() in lowered else []
        if close:
            hint = f"; did you mean '{prefix}{close[0]}'?"
    raise RecipeError(f"{source}: unknown key '{prefix}{key}' (known: {', '.join(known)}){hint}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(source: str, key: str, v: Any, *, minimum: int | None = None, nullable: bool = False) -> int | None:
    if v is None and nullable:
        return None
    if not _is_int(v):
        _fail(source, key, f"expected an integer{' or null' if nullable else ''}, got {describe(v)}")
    if minimum is not None and v < minimum:
        _fail(source, key, f"expected an integer >= {minimum}{' or null' if nullable else ''}, got {v}")
    return v


def _float(source: str, key: str, v: Any) -> float:
    if not (_is_int(v) or isinstance(v, float)):
        _fail(source, key, f"expected a number, got {describe(v)}")
    return float(v)


def _str(source: str, key: str, v: Any, *, nullable: bool = False) -> str | None:
    if v is None and nullable:
        return None
    if not isinstance(v, str):
        _fail(source, key, f"expected a string{' or null' if nullable else ''}, got {describe(v)}")
    return v


def _dtype_name(v: Any) -> Any:
    return DTYPE_ALIASES.get(v, v) if isinstance(v, str) else v


def _choice(source: str, key: str, v: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        _fail(source, key, f"expected one of {', '.join(choices)}, got {describe(v)}")
    return v


def _str_list(source: str, key: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        _fail(source, key, f"expected a string or a list of strings, got {describe(v)}")
    for i, item in enumerate(v):
        if not isinstance(item, str) or not item:
            _fail(source, f"{key}[{i}]", f"expected a non-empty string, got {describe(item)}")
    return tuple(v)


def _int_list(source: str, key: str, v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        _fail(source, key, f"expected a list of integers, got {describe(v)}")
    for i, item in enumerate(v):
        _int(source, f"{key}[{i}]", item, minimum=0)
    return tuple(v)


# ---------------------------------------------------------------------------
# parsing


def _number(source: str, key: str, v: Any, ok: Callable[[float], bool], expected: str,
            *, nullable: bool = False) -> float | None:
    """A number (int or float) that `ok` accepts; the error says `expected`."""
    if v is None and nullable:
        return None
    x = _float(source, key, v)
    if x != x or not ok(x):
        _fail(source, key, f"expected {expected}, got {x}")
    return x


def _bool(source: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        _fail(source, key, f"expected true or false, got {describe(v)}")
    return v


def _logit_bias(source: str, key: str, v: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (YAML ints or digit strings as keys), or a list of "ID=BIAS" strings
    (the --logit-bias flag's spelling); ids >= 0, biases in [-100, 100]."""
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        pairs = []
        for i, item in enumerate(v):
            m = re.fullmatch(r"\s*(\d+)\s*=\s*(\S+)\s*", item) if isinstance(item, str) else None
            if m is None:
                _fail(source, key, f"expected ID=BIAS (a token id and a number), got {describe(item)}")
            try:
                bias = float(m.group(2))
            except ValueError:
                _fail(source, key, f"expected ID=BIAS (a token id and a number), got {describe(item)}")
            pairs.append((m.group(1), bias))
    elif isinstance(v, dict):
        pairs = list(v.items())
    else:
        _fail(source, key, f"expected a mapping of token ids to biases, got {describe(v)}")
    if len(pairs) > LOGIT_BIAS_MAX:
        _fail(source, key, f"expected at most {LOGIT_BIAS_MAX} entries, got {len(pairs)}")
    out: dict[int, float] = {}
    for tok, bias in pairs:
        if isinstance(tok, str) and tok.strip().isdigit():
            tok = int(tok)
        if not _is_int(tok) or tok < 0:
            _fail(source, key, f"expected token ids as integers >= 0, got {describe(tok)}")
        if tok in out:
            _fail(source, key, f"token id {tok} given twice")
        x = _number(source, key, bias, lambda b: -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE,
                    f"a bias in [-100, 100] for token id {tok}")
        out[tok] = x
    return tuple(sorted(out.items()))


def _parse_sampling(data: Any, source: str) -> SamplingDefaults:
    if data is None:
        return SamplingDefaults()
    if not isinstance(data, dict):
        _fail(source, "sampling", f"expected a mapping, got {describe(data)}")
    for key in data:
        if key not in _SAMPLING_KEYS:
            _unknown_key(source, key, _SAMPLING_KEYS, prefix="sampling.")
    d = SamplingDefaults()
    get: Callable[[str], Any] = lambda k: data.get(k, getattr(d, k))  # noqa: E731
    k = "sampling."
    top_p = _number(source, k + "top_p", get("top_p"), lambda x: 0.0 < x <= 1.0, "0 < top_p <= 1", nullable=True)
    temperature = _number(source, k + "temperature", get("temperature"), lambda x: 0.0 <= x < math.inf,
                          "a number >= 0 (0 = greedy)", nullable=True)
    max_tokens = _int(source, k + "max_tokens", get("max_tokens"), minimum=1, nullable=True)
    min_tokens = _int(source, k + "min_tokens", get("min_tokens"), minimum=0)
    if max_tokens is not None and min_tokens > max_tokens:
        _fail(source, k + "min_tokens", f"expected at most max_tokens ({max_tokens}), got {min_tokens}")
    penalty = lambda x: -PENALTY_RANGE <= x <= PENALTY_RANGE  # noqa: E731
    return SamplingDefaults(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        # top_k -1 is vLLM's "off" (0 here), as rows take it; any integer seed (used mod 2**64), as rows take it
        top_k=None if get("top_k") is None else max(0, _int(source, k + "top_k", get("top_k"), minimum=-1)),
        seed=_int(source, k + "seed", get("seed"), nullable=True),
        stop=_str_list(source, k + "stop", get("stop")),
        stop_token_ids=_int_list(source, k + "stop_token_ids", get("stop_token_ids")),
        ignore_eos=_bool(source, k + "ignore_eos", get("ignore_eos")),
        min_tokens=min_tokens,
        min_p=_number(source, k + "min_p", get("min_p"), lambda x: 0.0 <= x <= 1.0, "0 <= min_p <= 1"),
        repetition_penalty=_number(source, k + "repetition_penalty", get("repetition_penalty"),
                                   lambda x: 0.0 < x < math.inf, "a number > 0 (1 = off)", nullable=True),
        presence_penalty=_number(source, k + "presence_penalty", get("presence_penalty"), penalty,
                                 "a number in [-2, 2]"),
        frequency_penalty=_number(source, k + "frequency_penalty", get("frequency_penalty"), penalty,
                                  "a number in [-2, 2]"),
        logit_bias=_logit_bias(source, k + "logit_bias", get("logit_bias")),
        logprobs=_int_range(source, k + "logprobs", get("logprobs"), 0, LOGPROBS_MAX, nullable=True),
        prompt_logprobs=_int_range(source, k + "prompt_logprobs", get("prompt_logprobs"), 0, LOGPROBS_MAX,
                                   nullable=True),
        n=_int_range(source, k + "n", get("n"), 1, N_MAX),
        include_stop_str_in_output=_bool(source, k + "include_stop_str_in_output", get("include_stop_str_in_output")),
        skip_special_tokens=_bool(source, k + "skip_special_tokens", get("skip_special_tokens")),
    )


def _int_range(source: str, key: str, v: Any, lo: int, hi: int, *, nullable: bool = False) -> int | None:
    if v is None and nullable:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        got = v if _is_int(v) else describe(v)
        _fail(source, key, f"expected an integer in [{lo}, {hi}]{' or null' if nullable else ''}, got {got}")
    return v


def _check_algorithm_params(
    source: str, algorithm: str, s: Any, k: Any, n: Any
) -> tuple[int | None, int | None, int | None]:
    """S, k, N by the algorithm's own rule (algorithms.py)."""
    try:
        return ALGORITHMS[algorithm].check_params(s, k, n)
    except ParamError as e:
        _fail(source, e.key, e.message)


def _check_drafter(source: str, algorithm: str, v: Any) -> str | None:
    """The `drafter:` key: one of the algorithm's drafter kinds (null: its default)."""
    try:
        return ALGORITHMS[algorithm].check_drafter(v)
    except ParamError as e:
        _fail(source, e.key, e.message)


def parse_recipe(data: dict, source: str) -> Recipe:
    """Validate a mapping in the schema's shape; `source` names the file in errors."""
    if not isinstance(data, dict):
        got = "an empty document" if data is None else describe(data)
        raise RecipeError(f"{source}: the top level must be a mapping of keys to values, got {got}")
    for key in data:
        if key not in _TOP_KEYS:
            _unknown_key(source, key, _TOP_KEYS)
    if data.get("algorithm") is None:
        _fail(source, "algorithm", f"missing (expected one of {', '.join(ALGORITHMS)})")
    algorithm = _choice(source, "algorithm", data["algorithm"], tuple(ALGORITHMS))
    s, k, n = _check_algorithm_params(
        source, algorithm, data.get("num_steps"), data.get("topk"), data.get("num_draft_tokens")
    )
    name = data.get("name")
    if name is None:
        name = Path(source).stem
    name = _str(source, "name", name)
    if not name:
        _fail(source, "name", "expected a non-empty string")
    description = data.get("description")
    description = "" if description is None else _str(source, "description", description)
    model = _str(source, "model", data.get("model", "default"))
    if not model:
        _fail(source, "model", 'expected a model directory or "default", got an empty string')
    return Recipe(
        name=name,
        description=description,
        algorithm=algorithm,
        num_steps=s,
        topk=k,
        num_draft_tokens=n,
        drafter=_check_drafter(source, algorithm, data.get("drafter")),
        model=model,
        draft=_str(source, "draft", data.get("draft"), nullable=True),
        dtype=_choice(source, "dtype", _dtype_name(data.get("dtype", "auto")), DTYPES),
        batch_size=_int(source, "batch_size", data.get("batch_size"), minimum=1, nullable=True),
        max_model_len=_int(source, "max_model_len", data.get("max_model_len"), minimum=1, nullable=True),
        gpu_memory_utilization=_number(source, "gpu_memory_utilization", data.get("gpu_memory_utilization"),
                                       lambda x: 0 < x <= 1, "a number in (0, 1] or null", nullable=True),
        sampling=_parse_sampling(data.get("sampling"), source),
        source=source,
    )


# ---------------------------------------------------------------------------
# loading


def _builtin_files() -> dict[str, Any]:
    """name -> Traversable (or Path) of every builtin recipe yaml."""
    try:
        from importlib.resources import files

        root: Any = files("specbatch.recipes")
    except (ImportError, TypeError):
        root = Path(__file__).resolve().parent / "recipes"
    if not root.is_dir():
        return {}
    out = {}
    for entry in root.iterdir():
        if entry.is_file() and entry.name.endswith((".yaml", ".yml")):
            out[entry.name.rsplit(".", 1)[0]] = entry
    return out


def builtin_recipes() -> list[str]:
    """Sorted names of the recipes shipped in recipes/*.yaml."""
    return sorted(_builtin_files())


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently:
    a second `sampling:` block would drop the first) and reads `1e-3` as a number, as YAML 1.2,
    JSON rows and the command line do (YAML 1.1 wants `1.0e-3` and gives `1e-3` as a string)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:             # unhashable: SafeLoader reports it
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' given twice (first at line {first.start_mark.line + 1}); "
                        "keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_RecipeLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        problem = re.sub(r"\s+", " ", str(problem)).strip()
        raise RecipeError(f"{source}: invalid YAML{where}: {problem}") from None


def load_recipe(name_or_path: str) -> Recipe:
    """Load a builtin recipe by name, or a recipe from a .yaml/.yml path."""
    text_arg = str(name_or_path)
    path = Path(text_arg).expanduser()
    looks_like_path = text_arg.endswith((".yaml", ".yml")) or "/" in text_arg or "\\" in text_arg
    in_file = looks_like_path or path.is_file()
    if in_file:
        if not path.is_file():
            raise RecipeError(f"{text_arg}: recipe file not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{text_arg}: cannot read recipe file ({exc})") from None
        source = text_arg
    else:
        builtins = _builtin_files()
        if text_arg not in builtins:
            close = difflib.get_close_matches(text_arg, list(builtins), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise RecipeError(
                f"unknown recipe '{text_arg}' (builtin: {', '.join(sorted(builtins)) or 'none'}; "
                f"or give a path to a .yaml file){hint}"
            )
        entry = builtins[text_arg]
        text = entry.read_text(encoding="utf-8")
        source = f"{BUILTIN_PREFIX}/{entry.name}"
    data = _load_yaml(text, source)
    return parse_recipe(_beside(data, path) if in_file else data, source)


def _beside(data: Any, path: Path) -> Any:
    """A recipe file's relative `model` / `draft` path is read from the working directory, as a
    flag's is, else from the recipe file's own directory, where it was likely written from."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key in ("model", "draft"):
        v = out.get(key)
        if not isinstance(v, str) or v == "default" or Path(v).expanduser().is_absolute() or Path(v).exists():
            continue
        if (path.parent / v).exists():
            out[key] = str(path.parent / v)
    return out
