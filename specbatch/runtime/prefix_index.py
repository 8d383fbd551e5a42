"""Prompt pages by content, so requests whose prompts begin alike share those pages' K/V.

Page k of a prompt (positions [kP, (k+1)P)) is indexed by its parent page's entry and the tokens
it holds, plus the `lookahead` tokens after it where the page's rows depend on them: a draft
layer's row i reads the token at i + 1 (layer_drafter.py), so with one the page is only the same
page when that token matches too; the target's rows (vanilla) read none. Only pages whose
positions all come before the prompt's last token are indexed: the last token's row (its logits,
the drafter's row with the first generated token) is always computed. With a lookahead, a page
whose own tokens match but whose lookahead does not is `near`: every row of it but the last holds
what this prompt would write, so a request may copy it and compute only that last row
(pages.py). Keys hold the tokens themselves, so a hit is exact equality, never a hash collision. Entries are numbered, never reused: when a page is
evicted its children can no longer be reached (they wait, idle, for their own eviction).
"""
from __future__ import annotations

ROOT = 0


class PrefixIndex:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.lookahead = 1                       # set_lookahead: the drafter's, before any page is indexed
        self._page: dict[tuple[int, tuple[int, ...]], int] = {}    # (parent entry, tokens) -> page
        self._entry: dict[int, tuple[int, tuple[int, tuple[int, ...]]]] = {}     # page -> (entry, its key)
        self._near: dict[tuple[int, tuple[int, ...]], set[int]] = {}     # (parent, the page's own tokens) -> pages
        self._next = ROOT + 1

    def set_lookahead(self, tokens: int) -> None:
        """Tokens past a page its key holds; only before anything is indexed (keys would mix)."""
        if self._entry:
            raise RuntimeError("the prefix index's lookahead changes only while nothing is indexed")
        self.lookahead = tokens

    def shareable(self, length: int) -> int:
        """Pages of a prompt of `length` tokens that may be indexed: those ending before its last token."""
        return max(0, (length - 1) // self.page_size)

    def _key(self, tokens: list[int], k: int, parent: int) -> tuple[int, tuple[int, ...]]:
        P = self.page_size
        return parent, tuple(tokens[k * P: (k + 1) * P + self.lookahead])

    def match(self, tokens: list[int]) -> list[int]:
        """The pages holding this prompt's leading pages, in order (stops at the first miss)."""
        pages: list[int] = []
        parent = ROOT
        for k in range(self.shareable(len(tokens))):
            page = self._page.get(self._key(tokens, k, parent))
            if page is None:
                break
            pages.append(page)
            parent = self._entry[page][0]
        return pages

    def near(self, tokens: list[int], pages: list[int]) -> list[int]:
        """After `match` gave `pages`: the indexed pages holding the next page's own tokens under
        the same parent but another lookahead (a lookahead index only; the page wholly in the
        prompt), lowest first."""
        k, P = len(pages), self.page_size
        if not self.lookahead or (k + 1) * P > len(tokens):
            return []
        parent = self._entry[pages[-1]][0] if pages else ROOT
        return sorted(self._near.get((parent, tuple(tokens[k * P: (k + 1) * P])), ()))

    def register(self, tokens: list[int], pages: list[int]) -> None:
        """Index the prompt's shareable pages as `pages` (the request's own, in order), keeping an
        entry already there for the same content."""
        parent = ROOT
        for k in range(min(self.shareable(len(tokens)), len(pages))):
            key = self._key(tokens, k, parent)
            page = self._page.get(key)
            if page is None:
                page = pages[k]
                if page in self._entry:          # already indexed under other content: stop here
                    return
                self._page[key] = page
                self._entry[page] = (self._next, key)
                self._next += 1
                if self.lookahead:
                    self._near.setdefault((parent, key[1][: self.page_size]), set()).add(page)
            parent = self._entry[page][0]

    def holds(self, page: int) -> bool:
        return page in self._entry

    def forget(self, page: int) -> None:
        """The page is about to be rewritten: drop its entry (its children become unreachable)."""
        _, key = self._entry.pop(page)
        del self._page[key]
        near = (key[0], key[1][: self.page_size])
        if page in self._near.get(near, ()):
            self._near[near].discard(page)
            if not self._near[near]:
                del self._near[near]

    def __len__(self) -> int:
        return len(self._entry)
