"""The daemon feed (server/feed.py) over real ZeroMQ sockets, without a server: events dropped before the feed's
thread took them are counted and told in the next batch; the replay buffer is bounded (a consumer sees the gap);
a snapshot comes in batches that all carry the sequence it is consistent with; a bad request gets the end marker
alone."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from kvtier.server import feed as feed_module
from kvtier.server.events import Bus, Stored
from kvtier.server.feed import END_SEQ, SNAPSHOT_BATCH, Feed, FeedConfig
from kvtier.server.feed import request as ask
from kvtier.server.metrics import FeedMetrics, Metrics

pytestmark = pytest.mark.unit


def stored(i: int) -> Stored:
    return Stored("l1", b"n" * 16, i.to_bytes(16, "big"), 2, (), 100)


def until(predicate, what: str):  # type: ignore[no-untyped-def]
    for _ in range(400):
        value = predicate()
        if value:
            return value
        time.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


def test_drops_are_told_replay_is_bounded_snapshots_are_batched(tmp_path) -> None:
    bus, metrics = Bus(), Metrics()
    held = [stored(i) for i in range(2 * SNAPSHOT_BATCH + 5)]
    replay = f"ipc://{tmp_path}/replay"
    feed = Feed(bus, FeedConfig(f"ipc://{tmp_path}/pub", replay, buffer_batches=2, queue_depth=3),
                FeedMetrics(metrics), lambda: held)
    ctx = zmq.Context()
    try:
        for i in range(10):  # before the thread runs: 3 queued, 7 dropped
            bus.post(stored(i))
        feed.start(lambda fn, *a: fn(*a))  # "the loop" is the caller's thread (the feed's, for a snapshot)
        [(seq, first)] = until(lambda: ask(ctx, replay, (1).to_bytes(8, "big")), "the first batch")
        assert seq == 1 and first["lost"] == 7 and [e["key"] for e in first["events"]] == [
            stored(i).key for i in range(3)]
        assert first["epoch"] == feed.epoch and first["events"][0] == {
            "type": "Stored", "tier": "l1", "ns": b"n" * 16, "key": stored(0).key, "blocks": 2, "aliases": [],
            "size": 100}
        assert metrics.registry.get_sample_value("kvtier_feed_dropped_events_total") == 7
        for n in (2, 3):
            bus.post(stored(100 + n))
            until(lambda n=n: ask(ctx, replay, (n).to_bytes(8, "big")), f"batch {n}")
        got = ask(ctx, replay, (1).to_bytes(8, "big"))
        assert [s for s, _ in got] == [2, 3] and "lost" not in got[0][1]  # batch 1 left the buffer: a gap

        snap = ask(ctx, replay, b"snapshot")
        assert [len(b["events"]) for _, b in snap] == [SNAPSHOT_BATCH, SNAPSHOT_BATCH, 5]
        assert {s for s, _ in snap} == {3} and all(b["snapshot"] for _, b in snap)
        assert [e["key"] for _, b in snap for e in b["events"]] == [e.key for e in held]

        assert ask(ctx, replay, b"bogus") == []  # neither a sequence nor "snapshot": the end marker alone
        assert metrics.registry.get_sample_value("kvtier_feed_requests_total", {"kind": "bad"}) == 1
        bus.post(stored(7))  # the feed goes on
        until(lambda: ask(ctx, replay, (4).to_bytes(8, "big")), "batch 4")
    finally:
        feed.stop()
        ctx.destroy(linger=0)
    assert not bus.active  # unsubscribed


def test_snapshot_requests_meanwhile_share_one_listing(tmp_path, monkeypatch) -> None:
    """A consumer asking in a loop cannot keep the serving loop listing: at most one listing per gap, and the
    requests that came meanwhile all get the next one."""
    monkeypatch.setattr(feed_module, "SNAPSHOT_GAP_S", 2.0)
    bus, listings = Bus(), []

    def held() -> list[Stored]:
        listings.append(1)
        return [stored(len(listings))]

    replay = f"ipc://{tmp_path}/replay"
    feed = Feed(bus, FeedConfig(f"ipc://{tmp_path}/pub", replay), FeedMetrics(Metrics()), held)
    ctx = zmq.Context()
    try:
        feed.start(lambda fn, *a: fn(*a))
        assert [e["key"] for _, b in ask(ctx, replay, b"snapshot") for e in b["events"]] == [stored(1).key]
        dealers = [ctx.socket(zmq.DEALER) for _ in range(3)]
        for d in dealers:
            d.connect(replay)
            d.send_multipart([b"", b"snapshot"])
        for d in dealers:  # each: one batch of the second listing, then the end marker
            assert d.poll(20_000)
            assert msgpack.unpackb(d.recv_multipart()[2])["events"][0]["key"] == stored(2).key
            assert d.poll(20_000) and d.recv_multipart()[1] == END_SEQ
            d.close(0)
        assert len(listings) == 2
    finally:
        feed.stop()
        ctx.destroy(linger=0)
