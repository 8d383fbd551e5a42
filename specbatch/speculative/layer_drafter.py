"""The drafter of one-layer draft modules: an EAGLE3 head (reading three target layers' outputs)
or a NextN/MTP layer (reading the target's final-normed hidden state). Only the module differs;
the catch-up, the S-step beam draft loop and the tree choice are shared.

Draft row i of a slot holds (token at position i+1, feature at position i): the target's states
for committed positions, the module's own output for drafted ones (EAGLE3: pre-norm; MTP: normed,
as engines feed it back). After each catch-up the slot keeps the output at its last committed
row and that row's top-k, the first level of the next tree.

For a sampled row the drafts include what the target's seeded draw will likely pick: the race of
`sampling.draw_target` over the draft's own distribution (the row's temperature, top-k and top-p), with
the uniforms of the very position and seed the target draws with, indexed by target token id. The
target's token is its own race winner whatever was drafted (acceptance keeps the tokens plain
sampling's), so this changes only how often a draft is accepted: with shared uniforms two close
distributions pick the same token about 1 - TV(p, q) of the time (a Gumbel-max coupling), where
the draft's argmax is the target's draw with probability p(argmax q). A chain (k = 1) drafts the
winner; a tree puts the winner first among the first level's k candidates and among the children
of the first beam node at every step (in place of the last, or moved up if among them), with
log-probability 0: the beam keeps it first, so the chain of winners is always in the tree, one
race a row a step (racing every beam node's children too cost k times more and did not raise the
demo bundle's acceptance). Greedy rows draft the argmax / top-k.
"""
from __future__ import annotations

import dataclasses

import torch

from ..algorithms import one_layer_scratch
from ..models.attention import AttnMetadata
from ..models.eagle3 import Eagle3Head
from ..models.mtp import MTPLayer
from ..models.llama import fuse_projections
from ..runtime.kv_cache import KVCache, PagedKVCache, PageLayout
from ..sampling import BatchSampling, draw_target, target_wide
from .accept import Acceptance
from .drafter import Drafter, PromptRows, Proposal
from .topk import topk_logprobs
from .tree import chain, child_scores, choose_tree


class LayerDrafter(Drafter):
    """`head(tokens, hidden, meta, kv, features, out_tokens)` -> its output states, `head.logits`,
    `head.to_target` (draft -> target ids) and `head.cfg.layer` (the KV cache's shape).
    `aux_layers`: the target layers whose outputs are the features (EAGLE3); empty: the target's
    final-normed hidden state (MTP)."""

    def __init__(self, head: Eagle3Head | MTPLayer, aux_layers: tuple[int, ...], num_steps: int, topk: int,
                 num_draft_tokens: int, num_slots: int, max_len: int, layout: PageLayout | None = None):
        """`layout`: the engine's paged pool (the draft layer's own pages share its page table);
        None: a static cache of `max_len` rows (plus scratch) per slot."""
        self.head = head
        fuse_projections(head)
        self.S, self.k, self.num_draft_tokens = num_steps, topk, num_draft_tokens
        self.max_depth = num_steps
        self.capture_layers = aux_layers
        self.reads_final_hidden = not aux_layers
        dev = head.lm_head.weight.device
        dtype = head.lm_head.weight.dtype
        H = head.cfg.layer.hidden_size
        # Rows past a slot's committed length: (S-1)*k tree scratch rows, S+1 catch-up rows.
        self.scratch_rows = one_layer_scratch(num_steps, topk, num_draft_tokens)
        if layout is None:
            self.cache = KVCache(head.cfg.layer, num_slots, max_len + self.scratch_rows, dtype, dev)
        else:
            self.cache = PagedKVCache(head.cfg.layer, layout, dtype, dev)
        self.page_table = None if layout is None else layout.page_table
        self.shares_prompt_pages = layout is not None       # its rows of a prompt sit in the shared pages
        self.copies_prompt_pages = layout is not None
        self.hidden = torch.zeros(num_slots + 1, H, dtype=dtype, device=dev)
        self.first_tokens = torch.zeros(num_slots + 1, topk, dtype=torch.int64, device=dev)
        self.first_logp = torch.zeros(num_slots + 1, topk, dtype=torch.float32, device=dev)
        # per slot: the sampling drafts race with (sample_as); temperature 0: the argmax / top-k
        self.draw = BatchSampling(temperature=torch.zeros(num_slots + 1, device=dev),
                                  top_k=torch.zeros(num_slots + 1, dtype=torch.int64, device=dev),
                                  top_p=torch.ones(num_slots + 1, device=dev),
                                  seed_lo=torch.zeros(num_slots + 1, dtype=torch.int64, device=dev),
                                  seed_hi=torch.zeros(num_slots + 1, dtype=torch.int64, device=dev),
                                  all_greedy=False, any_filter=True)
        self.coupled = False              # some slot has sampled: drafts run the race (host flag)
        self.any_top_k = False            # some such slot used top-k: the race finds k-th logits (host flag)
        ids = head.to_target(torch.arange(head.lm_head.weight.shape[0], device=dev))
        # draft id -> target id, None where they are the same (the race's uniforms go by target id)
        self.target_ids = None if torch.equal(ids, torch.arange(ids.numel(), device=dev)) else ids
        self.target_vocab = head.t2d.numel() if isinstance(head, Eagle3Head) else ids.numel()
        # draft ids in target-id order (as EAGLE3's d2t lays them out): the race reads the draft's own
        # columns (sampling.draw_target's ids), not a target-wide row of -inf around them
        self.increasing_ids = self.target_ids is not None and bool((ids[1:] > ids[:-1]).all())
        k = topk
        self.cand_depths = torch.tensor([1] * k + [d for d in range(2, num_steps + 1) for _ in range(k * k)],
                                        dtype=torch.int64, device=dev)

    # ---- catch-up: prefill and extend ---------------------------------------------------------

    def copy_page(self, src: int, dst: int) -> None:
        self.cache.copy_page(src, dst)

    def sample_as(self, slots: torch.Tensor, sp: BatchSampling) -> None:
        if sp.all_greedy:
            self.draw.temperature[slots] = 0.0
            return
        for name in BatchSampling.ROWS:
            getattr(self.draw, name)[slots] = getattr(sp, name)
        self.coupled = True
        self.any_top_k |= sp.any_top_k

    def prefill(self, rows: PromptRows, captured, first_tokens):
        meta = dataclasses.replace(rows.meta, page_table=self.page_table)    # the draft layer's pages
        h = self.head(rows.next_tokens(first_tokens), torch.cat(captured, dim=-1), meta, self.cache.layers[0],
                      features=True, out_tokens=rows.last)
        if rows.slots.numel():
            # the first draft is the token after the first generated one: position L + 1, the
            # prompt's (or a resumed request's) last token sitting at L - 1
            self._keep(rows.slots, h[:, 0], rows.meta.positions.reshape(-1)[rows.last] + 2)

    def extend(self, slots, lens, acc: Acceptance, captured, kv_bound=None):
        # Row lens+j: (emitted token j, target state at the node that emitted it). Rows past
        # num write K/V that the next cycle overwrites before anything reads it.
        W = acc.tokens.shape[1]
        feats = torch.cat(captured, dim=-1)
        feats = feats.gather(1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))
        meta = AttnMetadata(slots=slots, positions=lens[:, None] + torch.arange(W, device=lens.device),
                            prefix_lens=lens, kv_len=_bound(lens, kv_bound) + W, page_table=self.page_table)
        last = torch.arange(slots.shape[0], device=slots.device) * W + acc.num - 1
        h = self.head(acc.tokens, feats, meta, self.cache.layers[0], features=True, out_tokens=last)
        self._keep(slots, h[:, 0], lens + acc.num + 1)         # the next root sits at lens + num

    def _keep(self, slots: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> None:
        """h [B, H]: each slot's output at its last committed row; pos [B]: the position of the
        token it drafts (the next cycle's first draft)."""
        logits = self.head.logits(h)
        tok, logp = topk_logprobs(logits, self.k)
        self.hidden[slots] = h
        tok, logp = self._drafts(slots, logits, self.head.to_target(tok), logp, pos)
        self.first_tokens[slots], self.first_logp[slots] = tok, logp

    def _drafts(self, slots: torch.Tensor, logits: torch.Tensor, top: torch.Tensor, logp: torch.Tensor | None,
                pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """top [B, k] candidates (target ids, best first) with their logp [B, k] (k = 1: may be None), from draft
        logits [B, Vd] (or [B, 1, Vd]) for position pos [B]. A sampled slot's race winner over its
        logits at its sampling, on the target's uniforms, goes first with logp 0 (k > 1: the
        others follow in order, the winner's old place or the last one dropped); other slots keep
        top and logp."""
        if not self.coupled:
            return top, logp
        B, k = top.shape
        x = logits.reshape(B, -1)
        sp = BatchSampling(*(getattr(self.draw, n)[slots] for n in BatchSampling.ROWS), all_greedy=False,
                           any_filter=True, any_top_k=self.any_top_k)
        sampled = sp.temperature[:, None] > 0
        ids = self.target_ids
        if ids is not None and not self.increasing_ids:     # the draw keys columns in order: lay them out by target id
            x, ids = target_wide(x, ids, self.target_vocab), None
        # greedy rows' draws are moot: top stays theirs
        drawn = draw_target(x, sp, pos, ids=ids, vocab=self.target_vocab)[:, None]
        if k > 1:
            # the candidates other than the winner, in order (key k moves the winner's old place last)
            rank = torch.arange(k, device=top.device).expand(B, k)
            rest = torch.where(top == drawn, k, rank).argsort(dim=1, stable=True)[:, : k - 1]
            drawn = torch.cat([drawn, top.gather(1, rest)], dim=1)
            # the others strictly below the winner's 0: one whose log p rounds to 0 (a draft sure of it) would
            # tie, and topk may then rank it first, losing the winners' chain (the beam's node 0, the tree's best)
            rest_logp = logp.gather(1, rest).clamp(max=_BELOW_ZERO)
            logp = torch.where(sampled, torch.cat([torch.zeros_like(logp[:, :1]), rest_logp], dim=1), logp)
        return torch.where(sampled, drawn, top), logp

    # ---- the draft loop ------------------------------------------------------------------------

    def propose(self, slots, last_tokens, lens, kv_bound=None, width=None) -> Proposal:
        if self.k == 1 or (width is not None and width <= 2):
            # A tree verified to two nodes verifies its root and the first-level candidate that
            # scores best (every other candidate scores below it, and it comes first): that is
            # the extend's first draft, so no draft step runs.
            return self._propose_chain(slots, last_tokens, lens, kv_bound, width)
        B, k, S = slots.shape[0], self.k, self.S      # a tree drafts every step: all steps give candidates
        dev = slots.device
        H = self.hidden.shape[1]
        beam_tok, beam_score = self.first_tokens[slots], self.first_logp[slots]        # [B, k]
        beam_h = self.hidden[slots][:, None].expand(B, k, H)
        beam_idx = torch.arange(k, device=dev).expand(B, k)
        toks, scores, parents = [beam_tok], [beam_score], [torch.full((B, k), -1, device=dev)]
        # anc[b, j, r]: beam node j sees scratch row r (its ancestors' and its own draft K/V)
        anc = torch.zeros(B, k, (S - 1) * k, dtype=torch.bool, device=dev)
        kv_base = _bound(lens, kv_bound)
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        for s in range(1, S):
            off = (s - 1) * k
            anc[:, :, off: off + k] |= eye
            meta = AttnMetadata(slots=slots, positions=(lens + s - 1)[:, None].expand(B, k),
                                prefix_lens=lens, kv_len=kv_base + s * k,
                                tree_mask=anc[:, :, : s * k], write_offset=off, page_table=self.page_table)
            h = self.head(beam_tok, beam_h, meta, self.cache.layers[0], features=False)  # [B, k, H]
            logits = self.head.logits(h)
            tok, logp = topk_logprobs(logits, k)                                       # [B, k, k]
            tok = self.head.to_target(tok)
            # the first beam node's children, at depth s + 1 (for a sampled row: the winners' chain)
            t0, l0 = self._drafts(slots, logits[:, 0], tok[:, 0], logp[:, 0], lens + s + 1)
            tok = torch.cat([t0[:, None], tok[:, 1:]], dim=1).flatten(1)
            logp = torch.cat([l0[:, None], logp[:, 1:]], dim=1)
            score = child_scores(beam_score[:, :, None], logp).flatten(1)              # [B, k*k]
            toks.append(tok)
            scores.append(score)
            parents.append(beam_idx[:, :, None].expand(B, k, k).flatten(1))
            if s < S - 1:
                beam_score, best = score.topk(k, dim=1)
                from_slot = best // k
                beam_tok = tok.gather(1, best)
                beam_h = h.gather(1, from_slot[:, :, None].expand(B, k, H))
                beam_idx = k + (s - 1) * k * k + best
                anc = anc.gather(1, from_slot[:, :, None].expand(-1, -1, anc.shape[2]))
        tokens, p, d, mask = choose_tree(torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                                         self.cand_depths, last_tokens, self.num_draft_tokens, S)
        return Proposal(tokens=tokens, parents=p, depths=d, tree_mask=mask)

    def _propose_chain(self, slots, last_tokens, lens, kv_bound, width) -> Proposal:
        """k = 1: each step extends the one path, and its draft sees the committed rows and the
        drafts before it (causal over the scratch rows), so no beam, scores or ancestor mask: a
        tree's bookkeeping would be a dozen small kernels a step. A chain verified to `width`
        nodes needs width - 1 drafts, the first made by extend (a tree's best first-level one)."""
        B = slots.shape[0]
        steps = self.S if width is None else max(1, min(self.S, width - 1))
        tok = self.first_tokens[slots][:, :1]                                          # [B, 1]
        h = self.hidden[slots][:, None]                                                # [B, 1, H]
        toks = [tok]
        kv_base = _bound(lens, kv_bound)
        for s in range(1, steps):
            meta = AttnMetadata(slots=slots, positions=(lens + s - 1)[:, None], prefix_lens=lens,
                                kv_len=kv_base + s, write_offset=s - 1, page_table=self.page_table)
            h = self.head(tok, h, meta, self.cache.layers[0], features=False)          # [B, 1, H]
            logits = self.head.logits(h)
            tok = self.head.to_target(topk_logprobs(logits, 1)[0][..., 0])             # [B, 1]: top-1
            tok = self._drafts(slots, logits, tok, None, lens + s + 1)[0]              # depth s + 1
            toks.append(tok)
        p, d = chain(B, steps + 1, slots.device)
        return Proposal(tokens=torch.cat([last_tokens[:, None], *toks], dim=1), parents=p, depths=d, tree_mask=None)


# a sampled row's non-winner candidates' largest log-probability: below the winners' chain scores
# (0 and the subnormals child_scores steps down by), above any real log p < 0 (float32: <= -6e-8)
_BELOW_ZERO = -1e-30


def _bound(lens: torch.Tensor, kv_bound: int | None) -> int:
    return int(lens.max()) if kv_bound is None else kv_bound
