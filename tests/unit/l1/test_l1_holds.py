"""Holds: targeted cases of write reservations (one writer per key, EXISTS for stored keys and their
leading-block aliases, expiry, a refused item breaking the rest of the prefix). The state machine driving
holds and store together is in test_l1_store.py."""

from __future__ import annotations

import pytest
from kvtier.server import protocol as p
from kvtier.server.eviction import make_policy
from l1_helpers import BPC, PAGE, RefuseAll, block_key, full_l1, hello, item, make_l1

pytestmark = pytest.mark.unit


def test_concurrent_reserve_of_one_key_is_deduplicated():
    store, holds, fp = make_l1()
    a, b = hello(holds, b"a"), hello(holds, b"b")
    it = item(1, BPC, 3 * PAGE)
    [first] = holds.reserve(a, fp, [it])
    assert first[0] == p.RESERVED
    used = store.pool.used_pages
    assert holds.reserve(b, fp, [it]) == [[p.BUSY]]
    assert holds.reserve(a, fp, [it]) == [[p.BUSY]]
    assert store.pool.used_pages == used  # the duplicate took no pages
    # The writer aborts: the key can be reserved again.
    assert holds.abort(a, [first[1]]) == 1
    [again] = holds.reserve(b, fp, [it])
    assert again[0] == p.RESERVED
    assert holds.commit(b, [again[1]]) == 1
    assert holds.reserve(a, fp, [it]) == [[p.EXISTS]]
    # Within one batch, the same key twice: one writer.
    it2 = item(2, BPC, PAGE)
    results = holds.reserve(a, fp, [it2, it2])
    assert results[0][0] == p.RESERVED and results[1] == [p.BUSY]


def test_exists_on_stored_key_and_on_leading_block_alias():
    store, holds, fp = make_l1()
    a = hello(holds, b"a")
    [r] = holds.reserve(a, fp, [item(3, BPC, 2 * PAGE)])
    holds.commit(a, [r[1]])
    used = store.pool.used_pages
    for blocks in range(1, BPC + 1):  # a shorter prompt's partial chunk is already covered
        assert holds.reserve(a, fp, [item(3, blocks, PAGE)]) == [[p.EXISTS]]
    assert store.pool.used_pages == used
    # A different family is not covered.
    assert holds.reserve(a, fp, [item(4, 1, PAGE)])[0][0] == p.RESERVED


def test_same_key_with_more_blocks_does_not_leak_pages():
    """A client that reuses a stored key with a larger block count must not orphan the old entry."""
    store, holds, fp = make_l1(num_pages=8)
    a = hello(holds, b"a")
    key = block_key(9, 1)
    [r] = holds.reserve(a, fp, [p.StoreItem(key, 2 * PAGE, 1, ())])
    holds.commit(a, [r[1]])
    [r] = holds.reserve(a, fp, [p.StoreItem(key, 2 * PAGE, 2, (block_key(9, 7),))])
    if r[0] == p.RESERVED:
        holds.commit(a, [r[1]])
    store.clear()
    assert store.pool.used_pages == 0, "pages of an overwritten entry leaked"
    assert store.evictable_pages == 0


def test_expired_reservation_cannot_be_committed():
    store, holds, fp = make_l1()
    a = hello(holds, b"a")
    [r] = holds.reserve(a, fp, [item(1, BPC, PAGE)])
    holds.clock.now += holds.reservation_ttl_s + 1
    holds.client(a.ident)  # still alive
    holds.sweep()
    assert store.pool.used_pages == 1, "a lapsed reservation's pages are held back until its client settles"
    assert holds.commit(a, [r[1]]) == 0
    assert block_key(1, BPC) not in store.entries
    assert store.pool.used_pages == 0


def test_items_after_a_refused_one_are_unreachable_and_not_stored():
    store, holds, fp, a = full_l1(RefuseAll())
    # [3, 1, 4]: 3 is refused, so 1 (present) and 4 could never be found behind it
    results = holds.reserve(a, fp, [item(3, BPC, PAGE), item(1, BPC, PAGE), item(4, BPC, PAGE)])
    assert results == [[p.REFUSED, p.NOT_ADMITTED], [p.EXISTS], [p.REFUSED, p.PREFIX_REFUSED]]
    assert holds.metrics.refused.labels(p.PREFIX_REFUSED)._value.get() == 1
    assert store.policy.touched == []  # 1 is not re-used behind the refused chunk: it keeps aging
    assert holds.reserve(a, fp, [item(1, BPC, PAGE)]) == [[p.EXISTS]]
    assert store.policy.touched == [block_key(1, BPC)]


def test_a_too_large_item_also_breaks_the_chain():
    store, holds, fp, a = full_l1(make_policy("lru"))
    results = holds.reserve(a, fp, [item(3, BPC, 3 * PAGE), item(4, BPC, PAGE)])
    assert results == [[p.REFUSED, p.TOO_LARGE], [p.REFUSED, p.PREFIX_REFUSED]]
    assert len(store.entries) == 2
