"""Drafters propose tokens for the target to verify. Vanilla decoding is the drafter that proposes none."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.attention import AttnMetadata
from ..sampling import BatchSampling
from .accept import Acceptance
from .tree import chain


@dataclass
class PromptRows:
    """Prompt tokens as a prefill forward of the target saw them: R sequences of T new tokens,
    each a run of one prompt's positions (prefix_lens = its first position; a prompt may span
    forwards). The engine's packed prefill has T = 1, one sequence a prompt token, grouped into
    query tiles by the metadata; `whole` has one prompt a row. The prompts whose last token is in
    this forward are the B `finished` ones."""
    meta: AttnMetadata            # slots [R], positions [R, T], prefix_lens [R]
    next_ids: torch.Tensor        # [R, T] the token after each position (0 past a prompt's end and
                                  # at a finished prompt's last position: its first generated token)
    last: torch.Tensor            # [B] each finished prompt's last token: an index into the R * T
                                  # new tokens (row-major), the one output a drafter keeps
    slots: torch.Tensor           # [B] the finished prompts' slots
    prompts: list[list[int]]      # [B] the finished prompts' token ids (host)

    def next_tokens(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """[R, T] next tokens with the finished prompts' first generated tokens in place."""
        tokens = self.next_ids.clone()
        tokens.view(-1)[self.last] = first_tokens
        return tokens

    @classmethod
    def whole(cls, slots: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor,
              page_table: torch.Tensor | None = None) -> "PromptRows":
        """One row per prompt: input_ids [B, T] right-padded, lengths [B], every prompt finished."""
        B, T = input_ids.shape
        dev = input_ids.device
        meta = AttnMetadata(slots=slots, positions=torch.arange(T, device=dev).expand(B, T),
                            prefix_lens=torch.zeros_like(slots), kv_len=T, page_table=page_table)
        nxt = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        nxt = nxt * (torch.arange(T, device=dev)[None, :] < (lengths - 1)[:, None])
        last = torch.arange(B, device=dev) * T + lengths - 1
        return cls(meta=meta, next_ids=nxt, last=last, slots=slots,
                   prompts=[p[:n] for p, n in zip(input_ids.tolist(), lengths.tolist())])


@dataclass
class Proposal:
    """The tree the target verifies this cycle, N nodes per sequence, node 0 the root."""
    tokens: torch.Tensor             # [B, N] node tokens: the last emitted token, then drafts
    parents: torch.Tensor            # [B, N] parent node, -1 for the root
    depths: torch.Tensor             # [B, N] distance from the root (RoPE position offset)
    tree_mask: torch.Tensor | None   # [B, N, N] ancestor mask, None for a chain (causal)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def prefix(self, w: int) -> "Proposal":
        """The first w nodes (parents precede children, so a tree; two nodes are a chain)."""
        if w >= self.width:
            return self
        mask = None if self.tree_mask is None or w <= 2 else self.tree_mask[:, :w, :w].contiguous()
        return Proposal(tokens=self.tokens[:, :w].contiguous(), parents=self.parents[:, :w].contiguous(),
                        depths=self.depths[:, :w].contiguous(), tree_mask=mask)


def takes_width(propose: Callable) -> bool:
    """Whether a drafter's `propose` takes `width` (one written before it was added need not)."""
    try:
        params = inspect.signature(propose).parameters
    except (TypeError, ValueError):
        return False
    return "width" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Drafter:
    """The interface every drafter implements; this base proposes nothing (N = 1)."""

    num_draft_tokens: int = 1                 # N, the root included
    max_depth: int = 0                        # longest root-to-leaf path (drafts a cycle can accept)
    capture_layers: tuple[int, ...] = ()      # target layers whose outputs the drafter reads
    reads_final_hidden: bool = False          # ... or the target's final-normed hidden state (MTP)
    graphable: bool = True                    # propose/extend are pure tensor work (CUDA graphs)
    scratch_rows: int = 0                     # cache rows past a slot's committed length it writes
    # whatever prefill gives it of a prompt's positions lives in the engine's pages (or nowhere),
    # so a request may skip the rows of a prompt prefix another request wrote (prefix caching)
    shares_prompt_pages: bool = False
    # tokens past a page its rows of that page read (a draft layer's row i reads token i + 1): a
    # page is shared only where those match too
    prompt_page_lookahead: int = 1
    # its rows of a prompt page can be copied to another page (copy_page): a request may then take
    # a copy of a page where only the lookahead differs and compute the page's last row only
    copies_prompt_pages: bool = False

    def copy_page(self, src: int, dst: int) -> None:
        """A request takes a copy of prompt page src as its page dst (prefix caching, where only
        the page's last row differs): copy this drafter's rows of it (copies_prompt_pages)."""
        raise NotImplementedError(f"{type(self).__name__} does not copy prompt pages")

    def prefill(self, rows: PromptRows, captured: list[torch.Tensor], first_tokens: torch.Tensor) -> None:
        """Catch up on the prompt tokens the target just prefilled (captured: its states, [R, T, H]),
        and on the first tokens [B] of the prompts that finished."""

    def sample_as(self, slots: torch.Tensor, sp: BatchSampling) -> None:
        """The sampling of the requests now in `slots` (called at their prefill, before `prefill`):
        a drafter may draft what the target's seeded draw is likely to pick (the emitted tokens do
        not depend on the drafts, only how many are accepted). This base ignores it."""

    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor, lens: torch.Tensor,
                kv_bound: int | None = None, width: int | None = None) -> Proposal:
        """Draft from each slot's state; lens [B] are committed lengths (the root sits at lens);
        kv_bound >= max(lens), a host int (None: read from lens, a host sync). width: the nodes
        this cycle verifies (a prefix of the proposal; None: all N): a drafter may stop once it
        has min(width, N) nodes, the first nodes of its full proposal."""
        parents, depths = chain(last_tokens.shape[0], 1, last_tokens.device)
        return Proposal(tokens=last_tokens[:, None], parents=parents, depths=depths, tree_mask=None)

    def extend(self, slots: torch.Tensor, lens: torch.Tensor, acc: Acceptance,
               captured: list[torch.Tensor], kv_bound: int | None = None) -> None:
        """Catch up on the tokens accepted this cycle (captured: target states at every node)."""


class NoDrafter(Drafter):
    """Vanilla decoding: one target forward per emitted token."""

    shares_prompt_pages = True
    prompt_page_lookahead = 0                 # the target's K/V of a position reads no later token
