"""Host bookkeeping of the paged KV pool: free pages, each slot's pages, the device page table.

Admission reserves, per request, the pages for everything it can write (prompt, max_tokens and
the drafts' scratch rows), so a running request never waits for memory and none is ever lost to
it; a request that does not fit waits until finished ones give their pages back. Page 0 is a
trash page: table entries past a slot's reservation point at it (never read unmasked; the
padding of a prompt's last prefill row may write there).
"""
from __future__ import annotations

import torch

from .kv_cache import PageLayout


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
        self._owned: dict[int, list[int]] = {}
        self.dummy_slot = num_slots
        self.reserve([(self.dummy_slot, dummy_rows)])           # pad rows write there every cycle
        self.usable = len(self._free)                           # pages requests may ever take

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def fits(self, rows: int) -> bool:
        return self.pages_for(rows) <= len(self._free)

    def reserve(self, wants: list[tuple[int, int]]) -> None:
        """Give each (slot, rows) the pages for `rows` cache rows and write their table rows
        (one host -> device copy for the lot)."""
        if not wants:
            return
        table = torch.zeros(len(wants), self.pages_per_slot, dtype=torch.int32)
        for i, (slot, rows) in enumerate(wants):
            n = self.pages_for(rows)
            if n > self.pages_per_slot or n > len(self._free):
                raise RuntimeError(f"slot {slot}: {rows} rows need {n} pages "
                                   f"({len(self._free)} free, {self.pages_per_slot} per slot at most)")
            if slot in self._owned:
                raise RuntimeError(f"slot {slot} already holds pages")
            pages = [self._free.pop() for _ in range(n)]
            self._owned[slot] = pages
            table[i, :n] = torch.tensor(pages, dtype=torch.int32)
        slots = torch.tensor([s for s, _ in wants], dtype=torch.int64)
        dev = self.layout.page_table.device
        self.layout.page_table[slots.to(dev)] = table.to(dev, non_blocking=True)

    def release(self, slot: int) -> None:
        """Return a finished slot's pages (its table row is rewritten at its next reservation)."""
        self._free.extend(reversed(self._owned.pop(slot, [])))
