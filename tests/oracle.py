"""A test-only drafter that proposes the target's own greedy continuation.

It knows each prompt's greedy continuation (a table computed with vanilla decoding) and follows
what each slot actually emitted, so its drafts are right exactly as long as the slot is on the
greedy path. `decoys` adds a wrong sibling at the first level (the true chain then sits at
nodes 2.., so accepting it needs the KV of a non-contiguous path: compaction). `corrupt(i)`
makes the i-th draft of a cycle wrong, for partial acceptance.
"""
from __future__ import annotations

from typing import Callable

import torch

from specbatch.speculative.accept import Acceptance
from specbatch.speculative.drafter import Drafter, Proposal
from specbatch.speculative.tree import ancestor_mask, chain


class OracleDrafter(Drafter):
    def __init__(self, table: dict[tuple[int, ...], list[int]], num_draft_tokens: int, vocab: int,
                 decoys: bool = False, corrupt: Callable[[int], bool] = lambda i: False):
        self.table, self.vocab, self.decoys, self.corrupt = table, vocab, decoys, corrupt
        self.num_draft_tokens = num_draft_tokens
        self.max_depth = num_draft_tokens - 2 if decoys else num_draft_tokens - 1
        self.seq: dict[int, list[int]] = {}
        self.prompt: dict[int, tuple[int, ...]] = {}

    def prefill(self, rows, captured, first_tokens):
        for b, (s, prompt) in enumerate(zip(rows.slots.tolist(), rows.prompts)):
            self.prompt[s] = tuple(prompt)
            self.seq[s] = [int(first_tokens[b])]

    def _truth(self, slot: int, count: int) -> list[int]:
        cont = self.table.get(self.prompt[slot], [])
        done = self.seq[slot]
        on_path = cont[: len(done)] == done
        nxt = cont[len(done): len(done) + count] if on_path else []
        return nxt + [1] * (count - len(nxt))

    graphable = False          # host-side lookups

    def propose(self, slots, last_tokens, lens, kv_bound=None, width=None):
        B, N = slots.shape[0], self.num_draft_tokens
        depth = self.max_depth
        rows = []
        for s in slots.tolist():
            t = self._truth(s, depth)
            t = [(x + 1) % self.vocab if self.corrupt(i) else x for i, x in enumerate(t)]
            rows.append(([(t[0] + 7) % self.vocab] if self.decoys else []) + t)
        drafts = torch.tensor(rows, dtype=torch.int64, device=slots.device)
        tokens = torch.cat([last_tokens[:, None], drafts], dim=1)
        if not self.decoys:
            parents, depths = chain(B, N, slots.device)
            return Proposal(tokens, parents, depths, None)
        # node 1: a wrong sibling of node 2; nodes 2.. the (possibly right) chain
        par = [-1, 0, 0] + list(range(2, N - 1))
        dep = [0, 1, 1] + list(range(2, N - 1))
        parents = torch.tensor(par, device=slots.device).expand(B, N)
        depths = torch.tensor(dep, device=slots.device).expand(B, N)
        return Proposal(tokens, parents, depths, ancestor_mask(parents, depth))

    def extend(self, slots, lens, acc: Acceptance, captured, kv_bound=None):
        for b, s in enumerate(slots.tolist()):
            self.seq[s] += acc.tokens[b, : int(acc.num[b])].tolist()
