"""Fixed-size page allocator over the L1 segment.

Every chunk takes ceil(size / page_size) pages anywhere in the segment, so an allocation succeeds
whenever enough pages are free: there is no fragmentation failure, and the byte budget is exact in
pages. Freed pages go back on a stack and are handed out together again, which keeps most chunks in
one or two contiguous extents (the wire form of a page list).

Every page that leaves or rejoins the free list is told to the pool's `log` first (the L1 journal,
l1/journal.py), whoever asks: reservations, promotions, removed entries, quarantine.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

Extents = tuple[int, ...]
"""Flat (first_page, page_count, first_page, page_count, ...) runs of contiguous pages."""


class PageLog(Protocol):
    def allocated(self, extents: Extents) -> None: ...

    def released(self, extents: Extents) -> None: ...


class PagePool:
    def __init__(self, num_pages: int, page_size: int, in_use: Extents = ()) -> None:
        """`in_use`: pages that start allocated (those of an adopted L1)."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("page pool needs a positive page count and page size")
        self.page_size = page_size
        self.segment_pages = num_pages  # pages the segment holds: the most the budget can grow to
        self.num_pages = num_pages  # the page budget (L1 capacity); set_budget() moves it
        self.log: PageLog | None = None
        # Stack of free page ids; popping from the top hands out ascending runs first.
        free = np.ones(num_pages, dtype=bool)
        free[from_extents(in_use)] = False
        self._free = np.zeros(num_pages, dtype=np.int32)
        self._top = int(free.sum())
        self._free[: self._top] = np.flatnonzero(free)[::-1]

    @property
    def free_pages(self) -> int:
        """Pages that may still be allocated under the budget (negative while a shrink is draining)."""
        return self.num_pages - self.used_pages

    @property
    def used_pages(self) -> int:
        return self.segment_pages - self._top

    def set_budget(self, num_pages: int) -> None:
        """Change the page budget. Pages in use above a smaller budget stay until released."""
        if not 0 < num_pages <= self.segment_pages:
            raise ValueError(f"page budget must be in 1..{self.segment_pages}")
        self.num_pages = num_pages

    def free_extents(self) -> Extents:
        """Every page not in use, as extents (e.g. to return their memory to the OS)."""
        return to_extents(np.sort(self._free[: self._top]))

    def pages_for(self, size: int) -> int:
        return max(1, -(-size // self.page_size))

    def allocate(self, npages: int) -> Extents | None:
        """Take `npages` pages, or None if fewer are free (the caller evicts and retries)."""
        if npages <= 0:
            raise ValueError("allocation must take at least one page")
        if npages > self._top or npages > self.free_pages:
            return None
        pages = self._free[self._top - npages : self._top][::-1].copy()
        extents = to_extents(pages)
        if self.log is not None:
            self.log.allocated(extents)
        self._top -= npages
        return extents

    def release(self, extents: Extents) -> None:
        pages = from_extents(extents)
        n = len(pages)
        if self._top + n > self.segment_pages:
            raise RuntimeError("page pool over-release: accounting is broken")
        if self.log is not None:
            self.log.released(extents)
        self._free[self._top : self._top + n] = pages[::-1]
        self._top += n


def to_extents(pages: np.ndarray) -> Extents:
    if len(pages) == 0:
        return ()
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    out: list[int] = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        out += (int(pages[s]), e - s)
    return tuple(out)


def from_extents(extents: Extents) -> np.ndarray:
    parts = [np.arange(extents[i], extents[i] + extents[i + 1], dtype=np.int32) for i in range(0, len(extents), 2)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


def extent_pages(extents: Extents) -> int:
    return sum(extents[1::2])
