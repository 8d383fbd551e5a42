"""How big the paged pool is: slots, context and pages, from the model's shape and free memory."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.config import DecoderConfig, ModelError
from ..runtime.kv_cache import GiB, bytes_per_row, memory_budget

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
              kv_rows: int | None, prefill_tokens: int) -> PoolPlan:
    """The pool takes what memory allows (on GPU 90% of what is free, minus room for
    activations, graphs and logits), but never more than every slot holding a request of the
    full context. Slots: `batch_size`, else as many as the pool holds at 256 rows each (up to
    512) on a GPU, 32 on a CPU. `headroom`: rows a request writes past its
    committed length (verify and draft scratch); `drafting`: the draft layer takes its own pages."""
    limit = cfg.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ModelError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"max_position_embeddings ({limit})")
    P = page_size or (64 if device.type == "cuda" else 16)
    row_bytes = bytes_per_row(cfg, dtype)
    if drafting:
        row_bytes += row_bytes // cfg.num_layers           # the draft layer's own pages
    reserve = 0
    if device.type == "cuda":
        elem = torch.empty((), dtype=dtype).element_size()
        act = prefill_tokens * (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * elem
        most = batch_size or MAX_DEFAULT_SLOTS                 # slots at most
        logits = most * headroom * cfg.vocab_size * 6
        # penalty state (cycle.SlotState.penalty_state), allocated when a row first asks for a
        # penalty: int32 counts + a bool prompt mask per slot and vocabulary entry
        penalties = (most + 1) * cfg.vocab_size * 5
        reserve = 2 * GiB + act + logits + penalties
    budget_pages = memory_budget(device, reserve) // (row_bytes * P)
    dummy = math.ceil(headroom / P)
    if kv_rows is not None:
        budget_pages = min(budget_pages, math.ceil(kv_rows / P) + 1 + dummy)
    max_len = max_model_len or limit
    pool_rows = (budget_pages - 1 - dummy) * P
    if max_len + headroom > pool_rows:
        if max_model_len is not None or pool_rows - headroom < 16:
            raise ModelError(f"not enough {device.type} memory for a KV pool holding one request of "
                             f"{max_len} tokens ({pool_rows} rows fit); set a smaller --max-model-len")
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
        slots = max(16, min(MAX_DEFAULT_SLOTS, pool_rows // ROWS_PER_DEFAULT_SLOT))
    else:
        slots = 32
    return PoolPlan(num_slots=slots, max_len=max_len, page_size=P,
                    num_pages=int(min(budget_pages, slots * per_slot + dummy + 1)))
