"""PagePool: exact page budget, no fragmentation failure, no page handed out twice."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule
from kvtier.server.l1.pool import PagePool, extent_pages, from_extents, to_extents

pytestmark = pytest.mark.unit


class PoolMachine(RuleBasedStateMachine):
    allocations = Bundle("allocations")

    @initialize(num_pages=st.integers(1, 200), page_size=st.sampled_from([1, 4096, 65536]))
    def start(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages, page_size)
        self.held: dict[int, np.ndarray] = {}  # allocation id -> pages
        self.owner = np.full(num_pages, -1, dtype=np.int64)
        self.next_id = 0

    @rule(target=allocations, npages=st.integers(1, 80))
    def allocate(self, npages: int):
        free_before = self.pool.free_pages
        extents = self.pool.allocate(npages)
        if npages > free_before:
            assert extents is None
            assert self.pool.free_pages == free_before
            return -1
        assert extents is not None, "allocation failed although enough pages were free"
        assert extent_pages(extents) == npages
        pages = from_extents(extents)
        assert len(pages) == npages
        assert len(np.unique(pages)) == npages
        assert pages.min() >= 0 and pages.max() < self.pool.num_pages
        assert (self.owner[pages] == -1).all(), "a page was handed out twice"
        # Extents are maximal runs and round-trip exactly.
        assert to_extents(pages) == extents
        assert all(extents[i + 1] > 0 for i in range(0, len(extents), 2))
        aid = self.next_id
        self.next_id += 1
        self.owner[pages] = aid
        self.held[aid] = pages
        return aid

    @rule(aid=consumes(allocations))
    def release(self, aid: int) -> None:
        if aid < 0 or aid not in self.held:
            return
        pages = self.held.pop(aid)
        self.pool.release(to_extents(pages))
        self.owner[pages] = -1

    @rule(size=st.integers(0, 10**7))
    def pages_for(self, size: int) -> None:
        n = self.pool.pages_for(size)
        assert n >= 1
        assert n * self.pool.page_size >= size
        assert size == 0 or (n - 1) * self.pool.page_size < size

    @invariant()
    def accounting(self) -> None:
        used = sum(len(p) for p in self.held.values())
        assert self.pool.used_pages == used
        assert self.pool.free_pages + self.pool.used_pages == self.pool.num_pages
        assert int((self.owner >= 0).sum()) == used


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase


def test_whole_pool_allocates_after_fragmenting_releases():
    pool = PagePool(64, 4096)
    allocs = [pool.allocate(1) for _ in range(64)]
    assert pool.allocate(1) is None
    for a in allocs[::2]:  # free every other page: maximal fragmentation
        pool.release(a)
    big = pool.allocate(32)
    assert big is not None and extent_pages(big) == 32
    assert len(big) // 2 == 32  # 32 single-page runs
    assert pool.free_pages == 0


def test_over_release_is_detected():
    pool = PagePool(4, 4096)
    a = pool.allocate(4)
    pool.release(a)
    with pytest.raises(RuntimeError):
        pool.release(a)


@pytest.mark.parametrize("bad", [(0, 1), (-1, 4096), (1, 0)])
def test_invalid_pool_shapes(bad):
    with pytest.raises(ValueError):
        PagePool(*bad)


def test_zero_page_allocation_is_rejected():
    with pytest.raises(ValueError):
        PagePool(4, 4096).allocate(0)


@pytest.mark.parametrize("pages", [[], [3], [0, 1, 2], [5, 6, 1, 2, 9], [7, 6, 5]])
def test_extents_round_trip(pages):
    arr = np.array(pages, dtype=np.int32)
    ext = to_extents(arr)
    assert from_extents(ext).tolist() == pages
    assert extent_pages(ext) == len(pages)
