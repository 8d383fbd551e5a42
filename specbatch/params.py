"""SamplingParams: ONE set of sampling fields for a recipe's defaults, CLI flags, a row's own
fields and a running request (torch-free: recipes and rows use it without torch).

Five fields may be left unset (None): `temperature`, `top_p`, `top_k`, `repetition_penalty` and
`max_tokens`. An unset field takes the model's `generation_config.json` value when it has one
(`max_new_tokens` for max_tokens), else the built-in default (greedy, no filter, no penalty, 256
tokens), as vLLM applies a model's generation config: a row's value wins over the flags', the
flags' over the recipe's, the recipe's over the model's. An OpenAI batch line that sets no
max_tokens gets the API's default instead (`default_max_tokens`). `for_row` resolves them; a
running request's params are always resolved.
"""
from __future__ import annotations

import copy
import difflib
import inspect
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping

GREEDY_BELOW = 1e-5       # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
_SEED_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9)
_CHOICE_MIX = 0x94D049BB133111EB

# Fields a model's generation_config.json may set (vLLM's list of the ones it applies, less
# max_new_tokens / min_p), and what an unset one falls back to without it.
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")
FALLBACK = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
# An OpenAI batch line reads as its API does: an unset temperature is 1 (OpenAI's default, and vLLM's
# server's without a generation config), as its unset max_tokens is the API's (default_max_tokens).
API_FALLBACK = {**FALLBACK, "temperature": 1.0}
# How OpenAI batch lines read, a setting a resume must match (job.fingerprint): an output begun
# before they read as the API does would otherwise mix its greedy rows with sampled ones.
OPENAI_LINES = "as the API: unset temperature 1, unknown body keys and max_tokens past the context refused"
OPENAI_LINES_BEFORE = "unset temperature 0, unknown body keys ignored, max_tokens cut at the context"
MAX_TOKENS_FALLBACK = 256          # rows of specbatch's own forms, when nothing sets max_tokens
COMPLETIONS_MAX_TOKENS = 16        # an OpenAI /v1/completions body without max_tokens (OpenAI's, vLLM's server's)

LOGPROBS_MAX = 20         # top alternatives per token at most (vLLM's default max_logprobs, OpenAI's cap)
# What a token's logprobs hold, in vLLM's names (--logprobs-mode; engine/logprobs.py computes them):
# raw = the model's logits as they came, processed = after the bias, penalties, min_tokens,
# temperature and filters (what sampling draws from); *_logprobs their log_softmax, *_logits as is.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
DEFAULT_LOGPROBS_MODE = "raw_logprobs"     # vLLM's default


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"--logprobs-mode {mode}: expected one of {', '.join(LOGPROBS_MODES)}")
    return mode

LOGIT_BIAS_MAX = 1024     # entries of one logit_bias at most
LOGIT_BIAS_RANGE = 100.0  # |bias| at most (OpenAI's range)
PENALTY_RANGE = 2.0       # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
N_MAX = 1024              # completions per row at most


class SamplingError(ValueError):
    """A combination of sampling values that cannot run: `field` and what is wrong with it."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"field '{field}': {detail}")
        self.field, self.detail = field, detail


@dataclass(frozen=True, kw_only=True)    # keywords only: vLLM's first positional field is n, not max_tokens
class SamplingParams:
    """Sampling fields in vLLM's names. Mutable as vLLM's (`sp.seed = i`: `_setattr` below; frozen
    only so that construction, once per row and choice, sets fields without it), a field set
    after construction normalised as at it; vLLM's other fields are taken at their defaults
    (VLLM_KEYWORDS), anything else is an error. Internally copies are made with `replace`."""
    max_tokens: int | None = None     # None: the model's max_new_tokens, else default_max_tokens
    temperature: float | None = None  # 0 = greedy; None: the model's generation_config, else 0
    top_p: float | None = None        # None: the model's, else 1.0 (off)
    top_k: int | None = None          # 0 = disabled; None: the model's, else 0
    seed: int | None = None           # None: derived from the run seed and the row (for_row)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0               # EOS and stop_token_ids masked until this many were generated
    min_p: float = 0.0                # drop tokens with p < min_p * p_max (after temperature)
    repetition_penalty: float | None = None   # over prompt and generated tokens; None: the model's, else 1.0
    presence_penalty: float = 0.0     # over generated tokens: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0    # over generated tokens: logit -= frequency * count
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs, ids ascending
    logprobs: int | None = None       # None: none; k: the token's logprob and its top k alternatives
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob (the model's raw
                                        # distribution, as vLLM's default) and its top k alternatives
    n: int = 1                        # completions per row
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        for name, form in _NORMALISED.items():
            value = getattr(self, name)
            if not (value.__class__ is tuple and (name != "logit_bias" or not value)):     # (the usual case, fast)
                object.__setattr__(self, name, form(value))

    def clone(self) -> "SamplingParams":
        """A copy (vLLM's clone): changing one leaves the other; vLLM-only fields given go along."""
        return copy.copy(self)

    @property
    def greedy(self) -> bool:
        return (self.temperature or 0.0) == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalty: the per-slot token counts are needed."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or (self.repetition_penalty or 1.0) != 1.0)

    @property
    def uses_processors(self) -> bool:
        """Anything that changes the logits before temperature: min_tokens, logit_bias, penalties."""
        return self.min_tokens > 0 or bool(self.logit_bias) or self.uses_penalties

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists and mappings, not tuples), as a recipe's `sampling` mapping spells them."""
        d = asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        d["logit_bias"] = {int(t): float(b) for t, b in self.logit_bias}
        return d

    def resolved(self, model: Mapping[str, Any] | None = None,
                 fallback: Mapping[str, Any] = FALLBACK) -> "SamplingParams":
        """Unset fields from `model` (generation_config.json's sampling values), else `fallback`."""
        model = model or {}
        fill = {k: model.get(k, fallback[k]) for k in MODEL_DEFAULT_KEYS if getattr(self, k) is None}
        return replace(self, **fill) if fill else self

    def for_row(self, overrides: Mapping[str, Any], row: int, model: Mapping[str, Any] | None = None,
                unset_max_tokens: "UnsetMaxTokens | None" = None, *, batch_line: bool = False) -> "SamplingParams":
        """These defaults with a row's own (validated) fields applied, resolved to run: unset
        fields from the model's generation config (`model`), else FALLBACK (API_FALLBACK for an
        OpenAI `batch_line`), max_tokens, if still unset, from `unset_max_tokens`
        (default_max_tokens: what the row's form defaults to; None: a plain row's), a seed for every
        row (from the run seed, which these defaults carry, and the row number: reruns and resumes
        draw the same tokens) and tiny temperatures made greedy. Every temperature (row, recipe,
        CLI) passes here: dividing logits by 1e-40 overflows."""
        p = replace(self, **{k: _field_value(k, v) for k, v in overrides.items()})
        p = p.resolved(model, API_FALLBACK if batch_line else FALLBACK)
        unset = unset_max_tokens or default_max_tokens(model or {}, 0, batch_line=False, endpoint=None)
        if p.max_tokens is None:
            p = replace(p, max_tokens=unset.value)
        seed = p.seed
        if overrides.get("seed") is None:
            seed = (((self.seed or 0) * _SEED_MIX[0]) ^ (row * _SEED_MIX[1])) % (1 << 64)
        temperature = float(p.temperature)
        p = replace(p, seed=int(seed), temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                    top_p=float(p.top_p), top_k=min(int(p.top_k), 2**31 - 1),   # >= vocab: no filter
                    repetition_penalty=float(p.repetition_penalty))
        if p.min_tokens > p.max_tokens:
            defaulted = self.max_tokens is None and overrides.get("max_tokens") is None
            whence = f": {unset.source}" if defaulted else ""
            if "min_tokens" in overrides:
                raise SamplingError("min_tokens", f"{p.min_tokens} is more than max_tokens ({p.max_tokens}{whence})")
            # the run's min_tokens (--min-tokens or the recipe's) over the row's max_tokens, or over the
            # default of a row that sets none: name the row's max_tokens field (the row has no min_tokens)
            given = f"unset, so {p.max_tokens} ({unset.source})," if defaulted else f"{p.max_tokens}"
            raise SamplingError("max_tokens", f"{given} is less than the run's min_tokens ({p.min_tokens}, "
                                f"--min-tokens or the recipe's sampling.min_tokens)")
        return p

    def unsampled(self, overrides: Mapping[str, Any], model: Mapping[str, Any] | None = None,
                  seeded: bool = False) -> list[str]:
        """What a plain row asks of sampling (top_p, top_k, min_p, n > 1: these defaults with its
        `overrides`; a seed of its own, in `overrides` or `seeded`: LLM.generate's params) that
        changes nothing because it runs greedy for want of a temperature: none in the row, these
        defaults or the model's generation config. vLLM's SamplingParams default to temperature 1.0,
        so a vLLM user's {top_p, n, seed} would sample there. (These defaults' own seed is the run
        seed, which also seeds rows that set a temperature: not a sign.)"""
        if overrides.get("temperature") is not None or self.temperature is not None or \
                "temperature" in (model or {}):
            return []
        p = replace(self, **{k: _field_value(k, v) for k, v in overrides.items() if k != "seed"})
        asked = [k for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
                 if getattr(p, k) is not None and getattr(p, k) not in (off, -1)]
        asked += ["n"] if p.n > 1 else []
        return asked + (["seed"] if seeded or overrides.get("seed") is not None else [])

    def for_choice(self, index: int) -> "SamplingParams":
        """Choice `index` of n: choice 0 is the row itself; the others draw from their own seed
        stream (a hash of the row's seed and the index), so they are independent samples."""
        if index == 0:
            return self
        s = (int(self.seed or 0) ^ ((index * _CHOICE_MIX) % (1 << 64))) % (1 << 64)
        s = (s * _SEED_MIX[1]) % (1 << 64)
        return replace(self, seed=s ^ (s >> 31))


def _empty(v: object) -> bool:
    return v is None or (isinstance(v, (str, list, tuple, dict)) and not v)


def _a_bool(v: object) -> bool:
    return v is None or isinstance(v, bool)


def _final(v: object) -> bool:
    """vLLM's output_kind: cumulative or final-only (0, 2) are one final output offline; not deltas."""
    return v is None or (not isinstance(v, bool) and v in (0, 2)) or getattr(v, "name", None) in ("CUMULATIVE",
                                                                                                  "FINAL_ONLY")


# vLLM SamplingParams fields specbatch has nothing for, taken at their defaults only (a vLLM
# script's SamplingParams(..., detokenize=True) builds; the row fields of the same names read
# them alike, data/fields.py): name -> (the default as errors show it, whether a value asks for
# nothing more). best_of (null or n) is checked apart, as it depends on n.
VLLM_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "detokenize": ("true", _a_bool),                      # false: the text is made anyway (cheap here)
    "spaces_between_special_tokens": ("true", lambda v: v is None or v is True),
    "logits_processors": ("null", _empty),
    "truncate_prompt_tokens": ("null", _empty),
    "bad_words": ("null", _empty),
    "allowed_token_ids": ("null", _empty),
    "structured_outputs": ("null", _empty),
    "guided_decoding": ("null", _empty),
    "output_kind": ("null", _final),
    "extra_args": ("null", _empty),
    "flat_logprobs": ("false", lambda v: v is None or v is False),
    "skip_clone": ("false", _a_bool),                     # vLLM's copying and prefix-cache hints
    "skip_reading_prefix_cache": ("null", _a_bool),
}
VLLM_KEYWORDS = frozenset(("best_of", *VLLM_FIELDS))

# Other APIs' names for request fields (transformers' generate, Anthropic's and Gemini's APIs, TGI,
# Mistral's): named with the field they mean where one is given (a row's key, an attribute).
FIELD_ALIASES = {
    "max_new_tokens": "max_tokens", "max_output_tokens": "max_tokens", "stop_sequences": "stop",
    "stop_strings": "stop", "num_return_sequences": "n", "do_sample": "temperature", "random_seed": "seed",
    "eos_token_id": "stop_token_ids", "candidate_count": "n", "repeat_penalty": "repetition_penalty",
}


def _vllm_keywords(given: Mapping[str, Any], n: int) -> None:
    """Refuse a VLLM_KEYWORDS value other than its default (best_of: null or n)."""
    for key, value in given.items():
        if key == "best_of":
            ok, default = value is None or value == n, f"n ({n})"
        else:
            shown, is_default = VLLM_FIELDS[key]
            default = f"its default {shown}"
            try:
                ok = is_default(value)
            except Exception:  # noqa: BLE001 - an odd value is not the default
                ok = False
        if not ok:
            raise ValueError(f"SamplingParams: '{key}': not supported by specbatch yet (got {value!r}); "
                             f"remove it or set it to {default}")


def _tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else tuple(value or ())


def _stop(value: Any) -> tuple:
    return (value,) if isinstance(value, str) else _tuple(value)    # one stop string, as vLLM's


def _bias(value: Any) -> tuple:
    if isinstance(value, tuple) and all(isinstance(e, tuple) for e in value):
        return value
    return logit_bias_pairs(value)                                 # {id: bias} given


# Fields held in one form however they are given (a list or a string for stop, {id: bias}).
_NORMALISED = {"stop": _stop, "stop_token_ids": _tuple, "logit_bias": _bias}
_FIELDS = frozenset(SamplingParams.__dataclass_fields__)
_dataclass_init = SamplingParams.__init__


def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    given = {}
    if not VLLM_KEYWORDS.isdisjoint(kwargs):
        given = {k: kwargs.pop(k) for k in VLLM_KEYWORDS & kwargs.keys()}
        _vllm_keywords(given, kwargs.get("n", 1))
    _dataclass_init(self, *args, **kwargs)
    for k, v in given.items():            # readable as given (not fields: eq, asdict and replace leave them)
        object.__setattr__(self, k, v)


_AS_SHOWN = {"true": True, "false": False, "null": None}


def _getattr(self: SamplingParams, name: str) -> Any:
    """A vLLM-only field never given reads as its default (`sp.best_of`, `sp.detokenize`)."""
    if name == "best_of":
        return None
    if name in VLLM_FIELDS:
        return _AS_SHOWN[VLLM_FIELDS[name][0]]
    raise AttributeError(f"'SamplingParams' object has no attribute {name!r}")


def _setattr(self: SamplingParams, name: str, value: Any) -> None:
    """`sp.field = value` after construction, as vLLM's SamplingParams takes it."""
    if name == "n" and self.__dict__.get("best_of") is not None:
        _vllm_keywords({"best_of": self.__dict__["best_of"]}, value)     # best_of given must stay n
    if name in _NORMALISED:
        value = _NORMALISED[name](value)
    elif name not in _FIELDS:
        if name not in VLLM_KEYWORDS:
            near = FIELD_ALIASES.get(name) or next(iter(difflib.get_close_matches(name, _FIELDS, 1)), None)
            raise AttributeError(f"SamplingParams has no field {name!r}"
                                 + (f" (did you mean {near!r}?)" if near in _FIELDS else ""))
        _vllm_keywords({name: value}, self.n)       # a vLLM field at its default asks for nothing
    object.__setattr__(self, name, value)


_init.__signature__ = inspect.signature(_dataclass_init)        # help() shows the fields
_init.__doc__ = _dataclass_init.__doc__
SamplingParams.__init__ = _init
SamplingParams.__setattr__ = _setattr
SamplingParams.__getattr__ = _getattr      # (only for names an instance does not hold)
SamplingParams.__hash__ = None          # mutable: no hash by value


@dataclass(frozen=True)
class UnsetMaxTokens:
    """max_tokens for a row that nothing else sets it for, and where it comes from (for errors)."""
    value: int
    source: str


def default_max_tokens(model: Mapping[str, Any], room: int, *, batch_line: bool,
                       endpoint: str | None) -> UnsetMaxTokens:
    """max_tokens for a row that sets none when neither the flags nor the recipe do: as the API the
    row's form imitates. An OpenAI /v1/completions body: 16, OpenAI's default (vLLM's server's
    too, whatever the model's generation config says); a /v1/chat/completions body: the model's
    `max_new_tokens`, else up to the context (`room`: what the context leaves after the prompt),
    as `vllm run-batch`; any other row (and LLM.generate, Ray rows): the model's max_new_tokens,
    else 256."""
    if batch_line and endpoint == "completion":
        return UnsetMaxTokens(COMPLETIONS_MAX_TOKENS, "the /v1/completions default")
    if "max_tokens" in model:
        return UnsetMaxTokens(int(model["max_tokens"]), "the model's generation_config.json max_new_tokens")
    if batch_line:
        return UnsetMaxTokens(max(room, 1), "up to the context, the /v1/chat/completions default")
    return UnsetMaxTokens(MAX_TOKENS_FALLBACK, "the default")


def _field_value(key: str, value: Any) -> Any:
    """A row's / a mapping's value as the dataclass holds it."""
    if key in ("stop", "stop_token_ids"):
        return tuple(value)
    if key == "logit_bias":
        return logit_bias_pairs(value)
    return value


def logit_bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """{id: bias} (or (id, bias) pairs), already validated -> sorted (id, bias) pairs."""
    if not value:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((int(t), float(b)) for t, b in items))


def describe_defaults(sampling: SamplingParams, model: Mapping[str, Any]) -> str:
    """The fields generation_config.json can set, as a run resolves them for rows that set none,
    with where each comes from (for `specbatch inspect`)."""
    parts = []
    if sampling.max_tokens is not None:
        parts.append(f"max_tokens {sampling.max_tokens} (recipe)")
    elif "max_tokens" in model:
        parts.append(f"max_tokens {model['max_tokens']} (generation_config.json max_new_tokens; OpenAI "
                     f"/v1/completions lines {COMPLETIONS_MAX_TOKENS})")
    else:
        parts.append(f"max_tokens {MAX_TOKENS_FALLBACK} (default; OpenAI batch lines: up to the context for "
                     f"/v1/chat/completions, {COMPLETIONS_MAX_TOKENS} for /v1/completions)")
    for k in MODEL_DEFAULT_KEYS:
        v = getattr(sampling, k)
        if v is not None:
            parts.append(f"{k} {v} (recipe)")
        elif k in model:
            parts.append(f"{k} {model[k]} (generation_config.json)")
        elif FALLBACK[k] != API_FALLBACK[k]:
            parts.append(f"{k} {FALLBACK[k]} (default; OpenAI batch lines {API_FALLBACK[k]}, the API's)")
        else:
            parts.append(f"{k} {FALLBACK[k]} (default)")
    return ", ".join(parts)
