"""From a recipe's algorithm and parameters to a drafter attached to the loaded target.

What an algorithm is (its drafter kinds, verify width, one graph or three) is looked up in
`specbatch.algorithms`; `make_drafter` calls the drafter kind's build function. The two builtin
ones (an EAGLE3 head, an MTP layer; both run by `LayerDrafter`) are here.
"""
from __future__ import annotations

from ..algorithms import AlgorithmError, DrafterKind, get_drafter
from ..models.config import ModelError
from ..models.eagle3 import Eagle3Head, default_aux_layers, load_eagle3
from ..models.llama import CausalLM
from ..models.mtp import MTPLayer, load_mtp
from ..runtime.kv_cache import PageLayout
from .drafter import Drafter, NoDrafter
from .layer_drafter import LayerDrafter
from .spec_config import SpecConfig

__all__ = ["SpecConfig", "build_eagle3", "build_mtp", "load_draft_module", "make_drafter"]


def _kind(spec: SpecConfig) -> DrafterKind | None:
    """The drafter kind `spec` runs (its own, else its algorithm's default); None: no drafter."""
    kind = spec.drafter or spec.entry.default_drafter
    try:
        return None if kind is None else get_drafter(kind)
    except AlgorithmError as e:
        raise ModelError(str(e)) from None


def load_draft_module(spec: SpecConfig, target: CausalLM, target_dir: str | None = None) -> object | None:
    """The drafter kind's module with its weights loaded (its `load` hook), for make_drafter's
    head=; None when the kind has no hook (its build loads what it needs) or there is no drafter."""
    kind = _kind(spec)
    load = None if kind is None else kind.loader()
    return None if load is None else load(spec, target, target_dir)


def load_eagle3_module(spec: SpecConfig, target: CausalLM, target_dir: str | None = None) -> Eagle3Head:
    """The EAGLE3 head of `spec.draft`, on the target's device and dtype."""
    if not spec.draft:
        raise ModelError(f"{spec.algorithm} with the eagle3 drafter needs a draft head: pass --draft DIR "
                         "(an EAGLE3 head directory)")
    dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    return load_eagle3(spec.draft, target.cfg, target.model.embed_tokens, dtype, dev)


def load_mtp_module(spec: SpecConfig, target: CausalLM, target_dir: str | None = None) -> MTPLayer:
    """The MTP layer of `spec.draft`, else the one inside `target_dir`."""
    dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    return load_mtp(target, target_dir, spec.draft, dtype, dev)


def make_drafter(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int,
                 head: Eagle3Head | MTPLayer | None = None, target_dir: str | None = None,
                 layout: PageLayout | None = None) -> Drafter:
    """`head`: an already-built draft module instead of loading `spec.draft` (bench);
    `target_dir`: the target's checkpoint, where an MTP layer may live; `layout`: the engine's
    paged pool, whose page table the draft's own cache shares (None: a static cache)."""
    kind = _kind(spec)
    build = None if kind is None else kind.builder()
    if build is None:
        return NoDrafter()
    return build(spec, target, num_slots, max_len, head=head, target_dir=target_dir, layout=layout)


def build_mtp(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int, *,
              head: MTPLayer | None = None, target_dir: str | None = None,
              layout: PageLayout | None = None) -> Drafter:
    """A NextN/MTP layer (`spec.draft`, else the one inside `target_dir`) as a LayerDrafter."""
    if head is None:
        head = load_mtp_module(spec, target, target_dir)
    if spec.topk > target.cfg.vocab_size:
        raise ModelError(f"topk {spec.topk} exceeds the vocabulary ({target.cfg.vocab_size})")
    return LayerDrafter(head, (), spec.num_steps, spec.topk, spec.num_draft_tokens, num_slots, max_len, layout)


def build_eagle3(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int, *,
                 head: Eagle3Head | None = None, target_dir: str | None = None,
                 layout: PageLayout | None = None) -> Drafter:
    """An EAGLE3 head (`spec.draft`) reading three of the target's layers, as a LayerDrafter."""
    if head is None:
        head = load_eagle3_module(spec, target, target_dir)
    L = target.cfg.num_layers
    aux = head.cfg.aux_layer_ids or default_aux_layers(L)
    bad = [i for i in aux if not 0 <= i < L]
    if len(aux) != 3 or bad:
        source = ("eagle_aux_hidden_state_layer_ids" if head.cfg.aux_layer_ids
                  else "the default (1, L//2-1, L-4), clamped into 0..L-1")
        where = spec.draft or "the random-weight EAGLE3 head (no draft directory)"
        raise ModelError(f"{where}: aux layers {list(aux)} from {source} do not fit a target "
                         f"of {L} layers (expected three ids in 0..{L - 1})")
    if spec.topk > head.cfg.draft_vocab_size:
        raise ModelError(f"topk {spec.topk} exceeds the draft vocabulary ({head.cfg.draft_vocab_size})")
    return LayerDrafter(head, tuple(aux), spec.num_steps, spec.topk, spec.num_draft_tokens,
                         num_slots, max_len, layout)
