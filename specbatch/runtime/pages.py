"""Host bookkeeping of the paged KV pool: free pages, each slot's pages, the device page table.

A request holds pages for the rows it has written and the next cycles' rows (`grow` adds them as
it runs), not for everything its max_tokens could write: a generous max_tokens costs nothing
until it is used. When a running request needs a page and none is free, the engine preempts
the request admitted last (its pages back here; it resumes later by recompute: engine.py), so no
request is ever lost to memory. Page 0 is a trash page: table entries past a slot's pages point
at it (never read unmasked).

Prefix caching (prefix_index.py): a request's leading prompt pages may be pages another request
wrote, counted by reference; nothing writes a shared page again (its positions come before the
prompt's last token, and a request writes only from there on). A finished request's indexed pages
stay readable, idle, until a new page is needed and none is free: then the least recently idle
one is taken. A draft layer's page is shared only where the token after it matches too; where
only that token differs, the request takes a copy of the page (`Grant.copy`, made by the caller
before anything of its wave runs) and computes the page's last row, not the whole page.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..host import to_device
from .kv_cache import PageLayout
from .prefix_index import PrefixIndex


@dataclass
class Grant:
    """Pages given to one request: its table row, and how many leading rows it found written
    (in shared pages, and in a page to copy first: (source, its own page)). The caller queues
    the copy before granting anything else: a later grant may take the source page, and its wave's
    forwards write it only after the copy."""
    pages: list[int]
    cached_rows: int = 0
    copy: tuple[int, int] | None = None


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int,
                 device: torch.device, dummy_rows: int):
        if num_pages < 2:
            raise ValueError("a paged pool needs at least 2 pages (one is the trash page)")
        self.page_size = page_size
        self.pages_per_slot = pages_per_slot
        self.layout = PageLayout(num_pages, page_size,
                                 torch.zeros(num_slots + 1, pages_per_slot, dtype=torch.int32, device=device))
        self._free = list(range(num_pages - 1, 0, -1))          # pop() hands out low pages first
        self._refs = [0] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict()     # indexed pages no request holds, oldest first
        self.index = PrefixIndex(page_size)
        self._owned: dict[int, list[int]] = {}
        self._wave: set[int] = set()                            # pages granted since new_wave(): unwritten
        self._grown: list[tuple[int, int, int]] = []            # (slot, column, page) not yet in the device table
        self.copies = False                                     # grants may copy a near page (Grant.copy)
        self.dummy_slot = num_slots
        self.reserve([(self.dummy_slot, dummy_rows)])           # pad rows write there every cycle
        self.usable = len(self._free)                           # pages requests may ever take

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

    @property
    def free_pages(self) -> int:
        """Pages a request may take now: free ones and idle indexed ones."""
        return len(self._free) + len(self._idle)

    def new_wave(self) -> None:
        """Grants from here on belong to a new admission wave: the pages granted before it are
        written by forwards already queued, so a copy queued now reads them written."""
        self._wave.clear()

    def grant(self, rows: int, prompt: list[int] | None = None, *, reuse: bool = True,
              spare: int = 0) -> Grant | None:
        """Pages for `rows` cache rows, or None when they do not fit now with `spare` pages left
        free. `prompt`: index this
        request's prompt pages for later requests and, with `reuse`, start with the pages already
        holding its leading tokens, and with a copy of the next page where only its last row
        differs (not one granted in this wave: its rows are not written yet)."""
        n = self.pages_for(rows)
        if n > self.pages_per_slot:
            raise RuntimeError(f"{rows} rows need {n} pages ({self.pages_per_slot} per slot at most)")
        hits = self.index.match(prompt)[:n] if prompt is not None and reuse else []
        near = None
        if self.copies and prompt is not None and reuse and len(hits) < n:
            near = next((p for p in self.index.near(prompt, hits) if p not in self._wave), None)
        revived = sum(1 for p in hits if self._refs[p] == 0)
        if n - len(hits) + revived + spare > self.free_pages:
            return None
        for p in hits:
            if self._refs[p] == 0:
                del self._idle[p]
            self._refs[p] += 1
        pages = hits + [self._take() for _ in range(n - len(hits))]
        self._wave.update(pages[len(hits):])
        if prompt is not None:
            self.index.register(prompt, pages)
        cached = len(hits) * self.page_size
        if near is None:
            return Grant(pages, cached)
        # near may have just been taken as one of these pages: unwritten until this wave runs
        return Grant(pages, cached + self.page_size - 1, (near, pages[len(hits)]))

    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._idle.popitem(last=False)
            self.index.forget(page)
        self._refs[page] = 1
        return page

    def assign(self, grants: list[tuple[int, Grant]]) -> None:
        """Write each (slot, grant)'s table row (one host -> device copy for the lot)."""
        if not grants:
            return
        table = torch.zeros(len(grants), self.pages_per_slot, dtype=torch.int32)
        for i, (slot, g) in enumerate(grants):
            if slot in self._owned:
                raise RuntimeError(f"slot {slot} already holds pages")
            self._owned[slot] = g.pages
            table[i, : len(g.pages)] = torch.tensor(g.pages, dtype=torch.int32)
        slots = torch.tensor([s for s, _ in grants], dtype=torch.int64)
        dev = self.layout.page_table.device
        self.layout.page_table[slots.to(dev)] = table.to(dev, non_blocking=True)

    def rows_held(self, slot: int) -> int:
        """Cache rows the slot's pages hold."""
        return len(self._owned.get(slot, ())) * self.page_size

    def grow(self, slot: int, rows: int) -> bool:
        """More pages for a running slot, up to `rows` cache rows; False (nothing taken) when
        they are not free. The table entries reach the device at the next write_grown()."""
        owned = self._owned[slot]
        n = min(self.pages_for(rows), self.pages_per_slot) - len(owned)
        if n <= 0:
            return True
        if n > self.free_pages:
            return False
        for _ in range(n):
            page = self._take()
            self._grown.append((slot, len(owned), page))
            owned.append(page)
        return True

    def write_grown(self) -> None:
        """The table entries of the pages grow() gave since the last call (one host -> device
        copy for the lot, stream-ordered before the next forward reads the table)."""
        if not self._grown:
            return
        table = self.layout.page_table
        grown = to_device(self._grown, torch.int64, table.device)
        self._grown.clear()
        table[grown[:, 0], grown[:, 1]] = grown[:, 2].to(table.dtype)

    def reserve(self, wants: list[tuple[int, int]]) -> None:
        """Give each (slot, rows) fresh pages for `rows` cache rows (no prefix sharing)."""
        grants = []
        for slot, rows in wants:
            g = self.grant(rows)
            if g is None:
                raise RuntimeError(f"slot {slot}: {rows} rows need {self.pages_for(rows)} pages "
                                   f"({self.free_pages} free)")
            grants.append((slot, g))
        self.assign(grants)

    def reset(self) -> None:
        """Every request's pages back and the index emptied (a job stopped midway, or a step that
        failed: pages it was granted may never have been written, or granted and never assigned)."""
        for slot in [s for s in self._owned if s != self.dummy_slot]:
            self.release(slot)
        self.drop_idle()
        kept = set(self._owned.get(self.dummy_slot, [])) | set(self._free)
        for page in range(1, len(self._refs)):
            if page not in kept:                 # granted, never assigned to a slot
                self._refs[page] = 0
                if self.index.holds(page):
                    self.index.forget(page)
                self._free.append(page)
        self._wave.clear()
        self._grown.clear()

    def drop_idle(self) -> None:
        """Idle indexed pages back to the free list, their entries forgotten."""
        while self._idle:
            page, _ = self._idle.popitem(last=False)
            self.index.forget(page)
            self._free.append(page)

    def release(self, slot: int) -> None:
        """Return a finished (or preempted) slot's pages (its table row is rewritten at its next reservation):
        a page no request holds goes back to the free list, or, indexed, stays readable (idle)."""
        self._grown = [g for g in self._grown if g[0] != slot]     # never written over a later owner's row
        for page in reversed(self._owned.pop(slot, [])):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self.index.holds(page):
                    self._idle[page] = None
                else:
                    self._free.append(page)
