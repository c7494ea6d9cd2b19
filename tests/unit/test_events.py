"""The event seam (server/events.py): the bus's order, its bounded queues and their counted drops, posts from
several threads; L1's listeners (the journal among them) and what L1 reports through the bus."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
from kvtier.server.cache import Cache
from kvtier.server.events import Bus, Cleared, Removed, Stored
from kvtier.server.l1.store import Entry

sys.path.insert(0, str(Path(__file__).resolve().parent / "l1"))
from l1_helpers import BPC, PAGE, hello, item, make_l1  # noqa: E402

pytestmark = pytest.mark.unit


def _stored(i: int) -> Stored:
    return Stored("l1", b"ns", i.to_bytes(16, "big"), 1, (), 10)


def test_one_subscriber_gets_events_in_posting_order() -> None:
    bus = Bus()
    sub = bus.subscribe(depth=100)
    events = [_stored(i) for i in range(50)] + [Removed("l2", b"ns", b"k" * 16, "capacity"), Cleared("l1", None)]
    for event in events:
        bus.post(event)
    assert sub.take(1000, timeout=0) == events
    assert sub.take(1000, timeout=0) == [] and sub.dropped == 0


def test_a_full_queue_drops_new_events_and_counts_them() -> None:
    bus = Bus()
    drops: list[int] = []
    sub = bus.subscribe(depth=3, on_drop=lambda: drops.append(1))
    roomy = bus.subscribe(depth=10)
    for i in range(5):
        bus.post(_stored(i))
    assert sub.take(10, timeout=0) == [_stored(i) for i in range(3)]  # the oldest kept, the newest refused
    assert sub.dropped == 2 and len(drops) == 2
    assert roomy.take(10, timeout=0) == [_stored(i) for i in range(5)] and roomy.dropped == 0  # its own bound
    bus.post(_stored(9))  # room again
    assert sub.take(10, timeout=0) == [_stored(9)]


def test_a_forced_offer_passes_the_bound() -> None:
    sub = Bus().subscribe(depth=1)
    sub.offer("a")
    sub.offer("b")
    sub.offer("mark", force=True)
    assert sub.take(10, timeout=0) == ["a", "mark"] and sub.dropped == 1


def test_no_subscriber_no_queue_and_unsubscribe_stops_delivery() -> None:
    bus = Bus()
    bus.post(_stored(0))  # nobody listens: nothing kept anywhere
    assert not bus.active
    sub = bus.subscribe(depth=10)
    assert bus.active
    bus.post(_stored(1))
    bus.unsubscribe(sub)
    bus.post(_stored(2))
    assert sub.take(10, timeout=0) == [_stored(1)]


def test_take_waits_for_an_event_posted_by_another_thread() -> None:
    bus = Bus()
    sub = bus.subscribe(depth=10)
    threading.Timer(0.05, bus.post, args=(_stored(7),)).start()
    assert sub.take(10, timeout=10) == [_stored(7)]


def test_posts_from_many_threads_keep_each_posters_order_and_every_subscriber_sees_one_order() -> None:
    bus = Bus()
    small, big = bus.subscribe(depth=500), bus.subscribe(depth=100_000)
    threads, per_thread = 4, 2000
    got: list[object] = []
    done = threading.Event()

    def consume() -> None:  # a listener thread draining `small` while posts go on: some are dropped
        while True:
            batch = small.take(100, 0.01)
            got.extend(batch)
            if done.is_set() and not batch:
                return

    def post(t: int) -> None:
        for i in range(per_thread):
            bus.post((t, i))

    reader = threading.Thread(target=consume)
    reader.start()
    posters = [threading.Thread(target=post, args=(t,)) for t in range(threads)]
    for th in posters:
        th.start()
    for th in posters:
        th.join()
    done.set()
    reader.join()
    everything = big.take(100_000, 0)
    assert big.dropped == 0 and len(everything) == threads * per_thread
    for t in range(threads):
        assert [i for (u, i) in everything if u == t] == list(range(per_thread))  # each poster's order
        mine = [i for (u, i) in got if u == t]
        assert mine == sorted(mine)
    assert len(got) + small.dropped == threads * per_thread  # every post either delivered or counted
    assert got == [e for e in everything if e in set(got)]  # one order for both subscribers


class Recorder:
    """An L1 listener that records what it is told, and whether the entry was indexed yet."""

    def __init__(self, store, log: list) -> None:  # type: ignore[no-untyped-def]
        self.store, self.log = store, log

    def committed(self, entry: Entry, namespace: object) -> None:
        self.log.append(("committed", entry.key, entry.key in self.store.entries))

    def removed(self, entry: Entry, reason: str) -> None:
        self.log.append(("removed", entry.key, reason, entry.key in self.store.entries))

    def pinned(self, key: bytes, pins: int) -> None:
        self.log.append(("pinned", key, pins))


def test_l1_tells_every_listener_in_order_before_each_change() -> None:
    store, holds, fp = make_l1(num_pages=2)
    log: list = []
    store.listeners += [Recorder(store, log), Recorder(store, log)]
    a = hello(holds, b"a")
    [r] = holds.reserve(a, fp, [item(1, BPC, PAGE)])
    holds.commit(a, [r[1]])
    key = store.resolve(item(1, BPC, PAGE).key).key
    store.pin_keys([key])
    store.clear()
    assert log == [("committed", key, False)] * 2 + [("pinned", key, 1)] * 2 + [("removed", key, "clear", True)] * 2


def test_l1_reports_stored_evicted_and_cleared_through_the_cache_bus() -> None:
    store, holds, fp = make_l1(num_pages=2)
    cache = Cache(store, holds, store.metrics)
    sub = cache.bus.subscribe(depth=100)
    a = hello(holds, b"a")
    for family in (1, 2, 3):  # the third evicts the first (2 pages)
        [r] = holds.reserve(a, fp, [item(family, BPC, PAGE)])
        holds.commit(a, [r[1]])
    it = [item(f, BPC, PAGE) for f in (1, 2, 3)]
    stored = [Stored("l1", fp, i.key, i.blocks, i.aliases, i.size) for i in it]
    assert sub.take(100, 0) == [stored[0], stored[1], Removed("l1", fp, it[0].key, "capacity"), stored[2]]
    assert sorted(e.key for e in cache.held()) == sorted(i.key for i in it[1:])
    asyncio.run(cache.clear(None))
    assert sub.take(100, 0) == [Cleared("l1", None)]  # not one Removed per chunk
