"""Every speculative algorithm and every drafter kind, in one torch-free table.

Whatever the rest of the code asks about an algorithm is answered here, never by comparing its
name: the recipe's parameter rules and `drafter:` choices (recipe.py), the drafter to build, the
verify width, whether the cycle is one graph and the cache rows the draft writes
(speculative/factory.py, engine/engine.py), where its draft directory comes from (resolve.py),
the random-weight draft module of `bench --random-weights` (bench/sweep.py), the CLI help and
the schema's algorithm table (recipes/schema.md, kept equal to `markdown_table()` by a test).

    ALGORITHMS  name -> Algorithm   parameters (a rule), drafter kinds (the first the default),
                                    fused cycle graph, one-line description
    DRAFTERS    name -> DrafterKind how to build the drafter ("module:function", imported on
                                    first use) and load its weights before the KV pool is
                                    planned, its draft directory (what it holds, the demo
                                    model's folder, or the layer inside the target), scratch rows

A new algorithm is one `register_algorithm(...)` call (or one row in `_builtin()`), its drafter
module and a recipe YAML. The build function is called as
`build(spec, target, num_slots, max_len, head=..., target_dir=..., layout=...)` and returns a
`speculative.drafter.Drafter`; `tests/speculative/test_algorithms.py` registers a prompt-lookup
drafter this way from the test itself.

One concept (the table: its rows, their rules, lookups, registration, and the text derived from
it), hence one file of ~370 lines.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

SPEC_PARAMS = ("num_steps", "topk", "num_draft_tokens")


class ParamError(ValueError):
    """A recipe value an algorithm does not take: `key` and a one-line `message` (recipe.py adds
    the file name)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


class AlgorithmError(KeyError):
    """An algorithm or drafter kind that is not in the table (one line; callers add the context)."""

    def __str__(self) -> str:
        return str(self.args[0])


def describe(value: Any) -> str:
    """A value for an error message: its type and a short repr (`str 'medusa'`, `null`)."""
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(key: str, v: Any, minimum: int) -> int:
    if not _is_int(v):
        raise ParamError(key, f"expected an integer, got {describe(v)}")
    if v < minimum:
        raise ParamError(key, f"expected an integer >= {minimum}, got {v}")
    return v


Params = tuple[int | None, int | None, int | None]        # (S, k, N): num_steps, topk, num_draft_tokens


# ---- parameter rules: check(name, s, k, n) -> the values to keep; width(s, k, n) -> N verified

@dataclass(frozen=True)
class NoParams:
    """No draft at all (vanilla): S, k, N all null or absent; one token verified per cycle."""
    doc: str = "none: all three null or absent"

    def check(self, name: str, s: Any, k: Any, n: Any) -> Params:
        given = [key for key, v in zip(SPEC_PARAMS, (s, k, n)) if v is not None]
        if given:
            raise ParamError(given[0], f"algorithm {name} takes none of {', '.join(SPEC_PARAMS)}; "
                                       "set them to null or drop them")
        return None, None, None

    def width(self, s: int | None, k: int | None, n: int | None) -> int:
        return 1


@dataclass(frozen=True)
class FixedParams:
    """One shape only; absent values default to it, any other value is an error."""
    num_steps: int
    topk: int
    num_draft_tokens: int

    @property
    def values(self) -> tuple[int, int, int]:
        return self.num_steps, self.topk, self.num_draft_tokens

    @property
    def doc(self) -> str:
        s, k, n = self.values
        return f"fixed at S = {s}, k = {k}, N = {n} (absent values default to these)"

    def check(self, name: str, s: Any, k: Any, n: Any) -> Params:
        shape = ", ".join(f"{key} {v}" for key, v in zip(SPEC_PARAMS, self.values))
        for key, v, want in zip(SPEC_PARAMS, (s, k, n), self.values):
            if v is not None and (not _is_int(v) or v != want):
                raise ParamError(key, f"{name} is fixed at {shape}; got {describe(v)}")
        return self.values

    def width(self, s: int | None, k: int | None, n: int | None) -> int:
        return self.num_draft_tokens


@dataclass(frozen=True)
class DraftShape:
    """S >= 1 draft steps of k >= 1 candidates, N >= 2 tokens verified (the root included): a chain
    (k = 1) proposes exactly S tokens, so N = S + 1; a tree (k > 1) at most k + (S - 1) k^2.
    `trees=False`: chains only (k must be 1)."""
    trees: bool = True

    @property
    def doc(self) -> str:
        if not self.trees:
            return "S >= 1, k = 1, N = S + 1 (chains only)"
        return "S >= 1, k >= 1, N >= 2; a chain (k = 1): N = S + 1; a tree (k > 1): N − 1 <= k + (S − 1)·k²"

    def check(self, name: str, s: Any, k: Any, n: Any) -> Params:
        for key, v in zip(SPEC_PARAMS, (s, k, n)):
            if v is None:
                raise ParamError(key, f"algorithm {name} needs num_steps, topk and num_draft_tokens; "
                                      f"{key} is missing")
        s, k, n = _int("num_steps", s, 1), _int("topk", k, 1), _int("num_draft_tokens", n, 2)
        if k > 1 and not self.trees:
            raise ParamError("topk", f"algorithm {name} drafts chains only (topk 1), got {k}")
        if k == 1 and n != s + 1:
            raise ParamError("num_draft_tokens",
                             f"topk 1 (a chain) needs num_draft_tokens = num_steps + 1 = {s + 1}, got {n}")
        most = 1 + k + (s - 1) * k * k
        if k > 1 and n > most:
            raise ParamError("num_draft_tokens",
                             f"topk {k} over num_steps {s} yields at most {most - 1} draft tokens, "
                             f"so num_draft_tokens (incl. the root) must be <= {most}, got {n}")
        return s, k, n

    def width(self, s: int | None, k: int | None, n: int | None) -> int:
        return int(n)


# ---- the table rows


def one_layer_scratch(s: int, k: int, n: int) -> int:
    """LayerDrafter's rows past the committed length: (S-1)k tree rows, S+1 catch-up rows."""
    return (s - 1) * k + s + 1


def no_scratch(s: int, k: int, n: int) -> int:
    return 0


@dataclass(frozen=True)
class DrafterKind:
    """A draft module: how to build its drafter and where its draft directory comes from."""
    name: str
    build: str | Callable[..., Any]      # "module:function" (imported on first use) or the function
    directory: str | None = None         # what a --draft directory holds, for help ("an EAGLE3 head");
                                         # None: the drafter reads no draft directory
    demo: str | None = None              # folder under assets/demo with the demo model's draft
    in_target: str | None = None         # without a directory the layer is read from the target's
                                         # checkpoint, described so; None: a non-demo model needs --draft
    scratch_rows: Callable[[int, int, int], int] = no_scratch   # (S, k, N) -> cache rows it writes
    random: str | Callable[..., Any] | None = None   # bench --random-weights: builds a random-weight
    # module, called (target, head_cfg, dtype, device, seed); None: the drafter needs no module
    load: str | Callable[..., Any] | None = None     # loads the draft module's weights before the KV
    # pool is planned (so the pool leaves them room), called (spec, target, target_dir) and handed
    # to `build` as head=; None: `build` loads what it needs itself
    check: str | Callable[..., Any] | None = None    # `inspect`: what loading would refuse, short of
    # reading the tensors, called (draft_dir or None, target_dir, target config); raises ModelError

    def builder(self) -> Callable[..., Any]:
        return load_function(self.build)

    def loader(self) -> Callable[..., Any] | None:
        return None if self.load is None else load_function(self.load)

    def checker(self) -> Callable[..., Any] | None:
        return None if self.check is None else load_function(self.check)

    def random_builder(self) -> Callable[..., Any] | None:
        return None if self.random is None else load_function(self.random)


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str                     # one line: CLI help, the schema's table
    params: Any = field(default_factory=DraftShape)   # NoParams | FixedParams | DraftShape | any
    # object with check(name, s, k, n) -> (s, k, n) raising ParamError, width(s, k, n), doc
    drafters: tuple[str, ...] = ()       # drafter kinds it may use, the default first; (): none
    fused: bool = False                  # verify + draft extend captured as ONE graph

    @property
    def default_drafter(self) -> str | None:
        return self.drafters[0] if self.drafters else None

    def check_params(self, s: Any, k: Any, n: Any) -> Params:
        return self.params.check(self.name, s, k, n)

    def check_drafter(self, value: Any) -> str | None:
        """The recipe's `drafter:` value -> the drafter kind it runs (None: it drafts nothing)."""
        if not self.drafters:
            if value is not None:
                raise ParamError("drafter", f"algorithm {self.name} uses no draft module; set it to null or drop it")
            return None
        if value is None:
            return self.default_drafter
        if not isinstance(value, str) or value not in DRAFTERS:
            raise ParamError("drafter", f"expected one of {', '.join(DRAFTERS)}, got {describe(value)}")
        if value not in self.drafters:
            either = [a.name for a in ALGORITHMS.values() if len(a.drafters) > 1]
            note = f" (only {', '.join(either)} takes either)" if either else ""
            raise ParamError("drafter", f"algorithm {self.name} drafts with {' or '.join(self.drafters)}, "
                                        f"got {value!r}{note}")
        return value

    def width(self, s: int | None, k: int | None, n: int | None) -> int:
        """Tokens verified per sequence per cycle."""
        return self.params.width(s, k, n)

    def scratch_rows(self, drafter: str | None, s: int | None, k: int | None, n: int | None) -> int:
        """Cache rows past a slot's committed length its drafter writes."""
        kind = drafter or self.default_drafter
        return 0 if kind is None else get_drafter(kind).scratch_rows(s, k, n)


_algorithms: dict[str, Algorithm] = {}
_drafters: dict[str, DrafterKind] = {}
ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType(_algorithms)    # live, read-only views
DRAFTERS: Mapping[str, DrafterKind] = MappingProxyType(_drafters)
_BUILTIN_ALGORITHMS: set[str] = set()
_BUILTIN_DRAFTERS: set[str] = set()


def _lookup(table: Mapping[str, Any], what: str, name: str) -> Any:
    try:
        return table[name]
    except (KeyError, TypeError):
        raise AlgorithmError(f"{what} {name!r} is not available in this version "
                             f"(available: {', '.join(table)})") from None


def get_algorithm(name: str) -> Algorithm:
    return _lookup(_algorithms, "algorithm", name)


def get_drafter(name: str) -> DrafterKind:
    return _lookup(_drafters, "drafter", name)


def load_function(path: str | Callable[..., Any]) -> Callable[..., Any]:
    """"package.module:function" -> the function (imported now); a callable is returned as is."""
    if callable(path):
        return path
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def register_drafter(kind: DrafterKind, *, replace: bool = False) -> DrafterKind:
    """Add a drafter kind; one already registered is an error unless `replace`."""
    if not kind.name or not kind.name.isidentifier():
        raise ValueError(f"drafter name {kind.name!r}: expected an identifier")
    if kind.name in _drafters and not replace:
        raise ValueError(f"drafter {kind.name!r} is already registered")
    _drafters[kind.name] = kind
    return kind


def register_algorithm(name: str, description: str, params: Any = None, *,
                       drafters: Iterable[str | DrafterKind] = (), fused: bool = False,
                       replace: bool = False) -> Algorithm:
    """Add an algorithm: the one call a new one needs. `drafters`: drafter kinds by name, or
    `DrafterKind`s registered along with it (the first is the default); `params`: its rule
    (default `DraftShape()`, S/k/N as a chain or a tree)."""
    if not name or not name.isidentifier():
        raise ValueError(f"algorithm name {name!r}: expected an identifier")
    if name in _algorithms and not replace:
        raise ValueError(f"algorithm {name!r} is already registered")
    drafters = list(drafters)
    new = [d for d in drafters if isinstance(d, DrafterKind)]
    names = tuple(d.name if isinstance(d, DrafterKind) else d for d in drafters)
    for d in names:                                  # check everything before changing anything
        if d not in {k.name for k in new}:
            get_drafter(d)
    for kind in new:
        if kind.name in _drafters and not replace:
            raise ValueError(f"drafter {kind.name!r} is already registered")
    for kind in new:
        register_drafter(kind, replace=replace)
    algo = Algorithm(name, description, DraftShape() if params is None else params, names, fused)
    _algorithms[name] = algo
    return algo


def unregister_algorithm(name: str) -> None:
    """Remove an algorithm and the drafter kinds only it used (builtins stay)."""
    if name in _BUILTIN_ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is builtin")
    algo = _algorithms.pop(name, None)
    if algo is None:
        return
    used = {d for a in _algorithms.values() for d in a.drafters}
    for d in algo.drafters:
        if d not in used and d not in _BUILTIN_DRAFTERS:
            _drafters.pop(d, None)


# ---- docs


def markdown_table() -> str:
    """The algorithms as the schema's markdown table (recipes/schema.md holds it verbatim)."""
    rows = ["| algorithm | S, k, N | drafter (default first) | one graph | description |",
            "|---|---|---|---|---|"]
    for a in _algorithms.values():
        drafters = ", ".join(f"`{d}`" for d in a.drafters) or "none"
        rows.append(f"| `{a.name}` | {a.params.doc} | {drafters} | {'yes' if a.fused else 'no'} | {a.description} |")
    return "\n".join(rows)


def draft_help(command: str) -> str:
    """The CLI's --draft help for `run`, `inspect` or `bench`, from the drafter kinds."""
    kinds = [k for k in _drafters.values() if k.directory]
    if command == "bench":
        rules = [f"{k.name}: default {k.in_target}" if k.in_target else f"{k.name}: required with --model"
                 for k in kinds]
        rules.append("default: the demo model's")
        return "Draft directory (" + "; ".join(rules) + ")."
    if command == "inspect":
        return f"Draft directory: {' or '.join(k.directory for k in kinds)} (overrides the recipe's)."
    inside = "; ".join(f"{k.name} reads the one inside --model without it" for k in kinds if k.in_target)
    return f"Draft directory: {', or '.join(k.directory for k in kinds)}" + (f" ({inside})." if inside else ".")


def fused_help() -> str:
    """The CLI's --separate-graphs help: which algorithms run the cycle as one graph."""
    fused = " and ".join(a.name for a in _algorithms.values() if a.fused) or "fused-graph"
    return f"Also run {fused} recipes with verify and extend as separate graphs (to time the fusion)."


# ---- the builtin rows


def _builtin() -> None:
    layer = dict(scratch_rows=one_layer_scratch)
    register_drafter(DrafterKind(
        "eagle3", "specbatch.speculative.factory:build_eagle3", directory="an EAGLE3 head", demo="eagle3",
        random="specbatch.bench.configs:random_eagle3_draft", load="specbatch.speculative.factory:load_eagle3_module",
        check="specbatch.models.eagle3:check_head", **layer))
    register_drafter(DrafterKind(
        "nextn_mtp", "specbatch.speculative.factory:build_mtp", directory="an exported MTP layer",
        demo="nextn_mtp", in_target="the MTP layer inside the target checkpoint",
        random="specbatch.bench.configs:random_mtp_draft", load="specbatch.speculative.factory:load_mtp_module",
        check="specbatch.models.mtp:check_source", **layer))
    register_algorithm("vanilla", "No speculation: one target forward per token (the baseline).", NoParams())
    register_algorithm("eagle3", "An EAGLE3 head drafts S steps of k candidates; the best N - 1 are verified.",
                       DraftShape(), drafters=("eagle3",))
    register_algorithm("nextn_mtp", "The target's own NextN/MTP layer, reused for every draft step.",
                       DraftShape(), drafters=("nextn_mtp",))
    register_algorithm("naive_2token", "One draft token per cycle with either module; verify + draft "
                       "extend as ONE graph: for large batches.", FixedParams(1, 1, 2),
                       drafters=("eagle3", "nextn_mtp"), fused=True)
    _BUILTIN_ALGORITHMS.update(_algorithms)
    _BUILTIN_DRAFTERS.update(_drafters)


_builtin()
