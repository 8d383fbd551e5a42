"""How big the paged pool is: slots, context and pages, from the model's shape and free memory."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..models.config import DecoderConfig, ModelError
from ..runtime.kv_cache import GiB, bytes_per_row, gpu_memory, memory_budget

MAX_DEFAULT_SLOTS = 512
# Slots only bound how many requests run at once: a request holds its own pages (what it wrote and
# the next cycles', grown as it runs: engine.py) and waits, or is preempted, when they are short.
# So the default asks only that the pool could hold every slot at a short request's size, never at
# the model's whole context (at Llama-3.1's 131,072 tokens that rule left 16 slots on an 80 GB GPU).
ROWS_PER_DEFAULT_SLOT = 256


@dataclass(frozen=True)
class PoolPlan:
    num_slots: int
    max_len: int            # context per request (prompt + completion)
    page_size: int
    num_pages: int


def plan_pool(cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, *, headroom: int, drafting: bool,
              batch_size: int | None, max_model_len: int | None, page_size: int | None,
              kv_rows: int | None, prefill_tokens: int, verify_nodes: int | None = None,
              utilization: float | None = None, held: int = 0) -> PoolPlan:
    """The pool takes what memory allows (on GPU 90% of what is free, minus room for
    activations, graphs and logits), but never more than every slot holding a request of the
    full context. Slots: `batch_size`, else as many as the pool holds at 256 rows each (up to
    512) on a GPU, 32 on a CPU. `headroom`: rows a request writes past its
    committed length (verify and draft scratch); `drafting`: the draft layer takes its own pages;
    `verify_nodes`: tokens a row verifies at most in one cycle (default: `headroom`);
    `utilization`: the share of the GPU's whole memory the engine may take, of which it holds
    `held` bytes already (its weights; memory_budget)."""
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ModelError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    P = page_size or (64 if device.type == "cuda" else 16)
    row_bytes = bytes_per_row(cfg, dtype)
    if drafting:
        row_bytes += row_bytes // cfg.num_layers           # the draft layer's own pages
    dummy = math.ceil(headroom / P)
    nodes = verify_nodes or headroom
    share = total = None
    if utilization is not None and device.type == "cuda":
        # as vLLM: the share must have been free when the engine started (before its weights), so
        # a share near 1 needs the whole card (the CUDA context alone takes some)
        free, total = gpu_memory(device)
        share = int(total * utilization)
        if free + held < share:
            raise ModelError(f"gpu_memory_utilization {utilization} asks for {share / GiB:.1f} GiB of the GPU's "
                             f"{total / GiB:.1f} GiB, but {(free + held) / GiB:.1f} GiB were free for this engine "
                             "(other processes hold the rest): lower it")

    @functools.cache
    def pages_for(slots: int) -> int:
        """Pool pages with the reserve of `slots` slots kept out (read once a slot count: the plan
        takes the pages its search saw)."""
        reserve = _reserve(cfg, dtype, device, nodes, prefill_tokens, slots, drafting)
        pages = memory_budget(device, reserve, utilization, held)
        pages //= row_bytes * P
        return pages if kv_rows is None else min(pages, math.ceil(kv_rows / P) + 1 + dummy)

    def holds(slots: int) -> bool:
        return (pages_for(slots) - 1 - dummy) * P // ROWS_PER_DEFAULT_SLOT >= slots

    most = batch_size or MAX_DEFAULT_SLOTS                     # slots, and the reserve planned for them
    if batch_size is None and device.type == "cuda" and not holds(most):
        # The reserve grows with the slots (a verify's logits, the penalty state): on a small GPU
        # the room kept for 512 slots' logits may be all the pool would have had. The default is
        # the most slots whose own reserve leaves a pool that holds them (at least 16).
        lo, hi = 16, most                                      # holds(hi) is false
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if holds(mid) else (lo, mid)
        most = lo
    budget_pages = pages_for(most)
    pool_rows = (budget_pages - 1 - dummy) * P
    max_len = max_model_len or limit
    if max_len + headroom > pool_rows:
        if share is not None and kv_rows is None and pool_rows - headroom < 16:
            reserve = _reserve(cfg, dtype, device, nodes, prefill_tokens, most, drafting)
            raise ModelError(f"gpu_memory_utilization {utilization} gives this engine {share / GiB:.1f} GiB of the "
                             f"GPU's {total / GiB:.1f} GiB; its weights hold {held / GiB:.1f} GiB and activations "
                             f"and logits need {reserve / GiB:.1f} GiB, which leaves no room for a KV pool: raise it")
        if max_model_len is not None or pool_rows - headroom < 16:
            share_note = "" if utilization is None else f" within gpu_memory_utilization {utilization}"
            raise ModelError(f"not enough {device.type} memory{share_note} for a KV pool holding one request of "
                             f"{max_len} tokens ({max(pool_rows, 0)} rows fit); set a smaller --max-model-len"
                             + ("" if utilization is None else " or a larger gpu_memory_utilization"))
        max_len = pool_rows - headroom
    per_slot = math.ceil((max_len + headroom) / P)
    usable = budget_pages - 1 - dummy
    if batch_size is not None and batch_size > usable:
        # every sequence in flight holds a page at least: more slots than pages are never used,
        # and their per-slot state (page table rows, lengths) would be allocated for nothing
        raise ModelError(f"--batch-size (or the recipe's batch_size) {batch_size}: the {device.type} KV pool "
                         f"holds {usable} pages of {P} rows and every sequence in flight needs one at least; "
                         f"use at most {usable}")
    if batch_size is not None:
        slots = batch_size
    elif device.type == "cuda":
        slots = most                                           # what the reserve was planned for
    else:
        slots = 32
    return PoolPlan(num_slots=slots, max_len=max_len, page_size=P,
                    num_pages=int(min(budget_pages, slots * per_slot + dummy + 1)))


# Kept out of the pool beside what _reserve counts: cuBLAS and Triton workspaces, small graphs'
# buffers and the allocator's fragmentation. The budget's 10% of free memory (memory_budget) is
# the margin for what this misjudges; a gpu_memory_utilization share keeps none beyond what the
# user leaves outside it (as vLLM's: near 1 nothing is left).
WORKSPACE_BYTES = GiB // 2
# Bytes a verify node keeps per vocabulary entry at once, at most: the raw logits (model dtype),
# the processed ones and the filters' fp32 copies (min_p's scaled logits, softmax and mask), and
# with logprobs their fp32 gather and log-softmax, the processed modes filtering once more
# (engine/logprobs.py): ~23 bytes at bf16, measured op by op on the CPU path.
LOGIT_BYTES = 24


def module_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes the modules' parameters and buffers hold, a storage shared between them counted once."""
    seen: dict[tuple[int, int], int] = {}
    for m in modules:
        for t in [] if m is None else [*m.parameters(), *m.buffers()]:
            s = t.untyped_storage()
            seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def _reserve(cfg: DecoderConfig, dtype: torch.dtype, device: torch.device, nodes: int, prefill_tokens: int,
             slots: int, drafting: bool = False) -> int:
    """GPU bytes kept out of the pool: workspaces, the prefill's activations, the verify logits
    of `slots` rows of `nodes` tokens and the penalty state; none on a CPU."""
    if device.type != "cuda":
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    # a prefill forward's widest moment: residual, normed input, q/k/v, attention output, the MLP's
    # gate, up and their product; an EAGLE3 draft's prefill also keeps three layers' hidden states
    widest = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + (3 * cfg.hidden_size if drafting else 0)
    # ... and a verify forward's at the largest captured batch (its graph keeps them in its pool)
    act = (prefill_tokens + slots * nodes) * widest * elem
    logits = slots * nodes * cfg.vocab_size * LOGIT_BYTES
    # penalty state (cycle.SlotState.penalty_state), allocated when a row first asks for a
    # penalty: int32 counts + a bool prompt mask per slot and vocabulary entry
    penalties = (slots + 1) * cfg.vocab_size * 5
    return WORKSPACE_BYTES + act + logits + penalties
