"""From a recipe's algorithm and parameters to a drafter attached to the loaded target.

What an algorithm is (its drafter kinds, verify width, one graph or three) is looked up in
`specbatch.algorithms`; `make_drafter` calls the drafter kind's build function. The two builtin
ones (an EAGLE3 head, an MTP layer; both run by `LayerDrafter`) are here.
"""
from __future__ import annotations

from ..algorithms import AlgorithmError, get_drafter
from ..models.config import ModelError
from ..models.eagle3 import Eagle3Head, default_aux_layers, load_eagle3
from ..models.llama import CausalLM
from ..models.mtp import MTPLayer, load_mtp
from ..runtime.kv_cache import PageLayout
from .drafter import Drafter, NoDrafter
from .layer_drafter import LayerDrafter
from .spec_config import SpecConfig

__all__ = ["SpecConfig", "build_eagle3", "build_mtp", "make_drafter"]


def make_drafter(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int,
                 head: Eagle3Head | MTPLayer | None = None, target_dir: str | None = None,
                 layout: PageLayout | None = None) -> Drafter:
    """`head`: an already-built draft module instead of loading `spec.draft` (bench);
    `target_dir`: the target's checkpoint, where an MTP layer may live; `layout`: the engine's
    paged pool, whose page table the draft's own cache shares (None: a static cache)."""
    kind = spec.drafter or spec.entry.default_drafter
    try:
        build = None if kind is None else get_drafter(kind).builder()
    except AlgorithmError as e:
        raise ModelError(str(e)) from None
    if build is None:
        return NoDrafter()
    return build(spec, target, num_slots, max_len, head=head, target_dir=target_dir, layout=layout)


def build_mtp(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int, *,
              head: MTPLayer | None = None, target_dir: str | None = None,
              layout: PageLayout | None = None) -> Drafter:
    """A NextN/MTP layer (`spec.draft`, else the one inside `target_dir`) as a LayerDrafter."""
    if head is None:
        dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
        head = load_mtp(target, target_dir, spec.draft, dtype, dev)
    if spec.topk > target.cfg.vocab_size:
        raise ModelError(f"topk {spec.topk} exceeds the vocabulary ({target.cfg.vocab_size})")
    return LayerDrafter(head, (), spec.num_steps, spec.topk, spec.num_draft_tokens, num_slots, max_len, layout)


def build_eagle3(spec: SpecConfig, target: CausalLM, num_slots: int, max_len: int, *,
                 head: Eagle3Head | None = None, target_dir: str | None = None,
                 layout: PageLayout | None = None) -> Drafter:
    """An EAGLE3 head (`spec.draft`) reading three of the target's layers, as a LayerDrafter."""
    if head is None and not spec.draft:
        raise ModelError(f"{spec.algorithm} with the eagle3 drafter needs a draft head: pass --draft DIR "
                         "(an EAGLE3 head directory)")
    dev, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    if head is None:
        head = load_eagle3(spec.draft, target.cfg, target.model.embed_tokens, dtype, dev)
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
