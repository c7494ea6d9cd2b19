"""The daemon event feed (--events-endpoint, server/feed.py, docs/events.md) with a real server and real ZeroMQ
consumers: stores are Stored batches with increasing sequence numbers, an eviction a Removed, an admin clear a
Cleared; a late consumer replays what it missed and asks for a snapshot that matches the server's index; a
restarted daemon has another epoch; an L2 write is a Stored of tier l2."""

from __future__ import annotations

import dataclasses
import itertools
import signal
import socket

import httpx
import msgpack
import numpy as np
import pytest
import zmq
from _support import free_port, prompt, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient, KVTierError
from kvtier.server.feed import request as ask
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-events", dtype="bfloat16", num_layers=1, kv_heads=2, head_size=64,
               block_size=128, layout="cpu", chunk_size=256)
BLOCK_BYTES = 8192  # a chunk of 2 blocks is 16 KiB: one 64 KiB page
L1_GB = 16 * 65536 / (1 << 30)  # 16 pages


def store(c: KVTierClient, tokens: np.ndarray) -> list[bytes]:
    """Store a prompt's chunks; their keys."""
    c.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES,
            lambda ch, span: span.write(0, np.zeros(len(ch.block_keys) * BLOCK_BYTES, np.uint8)))
    return [ck.key for ck in chunk_keys(NS, tokens)]


class Consumer:
    """A SUB on the feed: batches as (sequence, payload map), in arrival order."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.batches: list[tuple[int, dict]] = []

    def pump(self, timeout_ms: int = 100) -> None:
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b"" and len(seq) == 8
            self.batches.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
            timeout_ms = 20

    def events(self, **match: object) -> list[dict]:
        return [e for _, b in self.batches for e in b["events"] if all(e.get(k) == v for k, v in match.items())]

    def wait(self, what: str, **match: object) -> None:
        def seen() -> bool:
            self.pump()
            return bool(self.events(**match))
        wait_for(seen, timeout=20, what=what)


def joined(c: KVTierClient, consumer: Consumer, seeds: itertools.count) -> list[bytes]:
    """Store new prompts until `consumer` gets a batch (a SUB joins asynchronously); the last prompt's keys."""
    keys: list[bytes] = []

    def got() -> bool:
        keys[:] = store(c, prompt(next(seeds), 2 * NS.chunk_size))
        consumer.pump()
        return bool(consumer.batches)

    wait_for(got, timeout=20, what="a first batch")
    return keys


def apply(view: dict[str, set[bytes]], events: list[dict]) -> None:
    """A consumer's index: tier -> chunk keys it holds."""
    for e in events:
        if e["type"] == "Stored":
            view.setdefault(e["tier"], set()).add(e["key"])
        elif e["type"] == "Removed":
            view.setdefault(e["tier"], set()).discard(e["key"])
        else:
            assert e["ns"] is None  # these tests clear everything
            view[e["tier"]] = set()


def test_feed_stores_evictions_clear_replay_snapshot_and_epoch(kvtier_server):
    pub, replay, http = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    srv = kvtier_server(l1_gb=L1_GB, extra=["--events-endpoint", pub, "--events-replay-endpoint", replay,
                                            "--http-port", str(http)])
    ctx = zmq.Context()
    early = Consumer(ctx, pub)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    try:
        joined(c, early, itertools.count(100))  # the chunks stored before it joined are the oldest: evicted below
        keys = {k for i in range(1, 6) for k in store(c, prompt(i, 2 * NS.chunk_size))}  # 10 chunks, no eviction
        wait_for(lambda: early.pump() or keys <= {e["key"] for e in early.events(type="Stored", tier="l1")},
                 timeout=20, what="every chunk stored")
        seqs = [s for s, _ in early.batches]
        assert seqs == sorted(set(seqs)) and seqs[0] >= 1  # increasing, none twice
        epoch = early.batches[0][1]["epoch"]
        assert {b["epoch"] for _, b in early.batches} == {epoch} and len(epoch) == 32
        e = early.events(type="Stored", key=sorted(keys)[0])[0]
        assert e["tier"] == "l1" and e["ns"] == NS.fingerprint() and e["blocks"] == 2 and e["size"] == 2 * BLOCK_BYTES
        assert len(e["aliases"]) == 1  # the key of its first block

        # a consumer that missed batches asks the replay socket from a sequence: the batches from there
        missed = ask(ctx, replay, (1).to_bytes(8, "big"))
        assert [s for s, _ in missed] == seqs[: len(missed)] and len(missed) >= len(seqs)
        assert [b for _, b in missed[: len(seqs)]] == [b for _, b in early.batches]
        from_third = ask(ctx, replay, (3).to_bytes(8, "big"))
        assert from_third[0][0] == 3 and [s for s, _ in from_third] == [s for s, _ in missed][2:]

        # eviction: 16 pages hold 16 chunks; 8 more prompts of 2 chunks evict the oldest
        for i in range(6, 14):
            store(c, prompt(i, 2 * NS.chunk_size))
        early.wait("an eviction", type="Removed", tier="l1", reason="capacity")

        # a snapshot is the server's index; the view built from every event since the start equals it
        snap = ask(ctx, replay, b"snapshot")
        assert snap and all(b["snapshot"] and b["epoch"] == epoch for _, b in snap)
        at = snap[0][0]
        assert {s for s, _ in snap} == {at}
        held = {e["key"] for _, b in snap for e in b["events"]}
        assert all(e["type"] == "Stored" and e["tier"] == "l1" for _, b in snap for e in b["events"])
        assert len(held) == c.stats()["entries"] == 16
        assert set(store(c, prompt(13, 2 * NS.chunk_size))) <= held  # the newest prompt (stored already)
        early.pump()
        view: dict[str, set[bytes]] = {}
        apply(view, [e for _, b in early.batches for e in b["events"]])
        assert view["l1"] == held

        # a consumer that starts from that snapshot, then more stores (evicting) and the replay after `at`,
        # has exactly the index a later snapshot lists
        for i in range(20, 24):
            store(c, prompt(i, 2 * NS.chunk_size))
        early.wait("the last prompt's chunks", type="Stored", key=store(c, prompt(23, 2 * NS.chunk_size))[1])
        again = ask(ctx, replay, b"snapshot")
        late = {"l1": set(held)}
        replayed = ask(ctx, replay, (at + 1).to_bytes(8, "big"))
        assert replayed[0][0] == at + 1 and replayed[-1][0] >= again[0][0] > at
        apply(late, [e for s, b in replayed if s <= again[0][0] for e in b["events"]])
        assert late["l1"] == {e["key"] for _, b in again for e in b["events"]} and late["l1"] != held
        assert len(late["l1"]) == c.stats()["entries"]

        # an admin clear is one Cleared event, after which the view is empty
        r = httpx.post(f"http://127.0.0.1:{http}/cache/clear", json={"scope": "all"}, timeout=10)
        assert r.status_code == 200, r.text
        early.wait("the clear", type="Cleared", tier="l1")
        assert not early.events(type="Removed", reason="clear")
        assert ask(ctx, replay, b"snapshot")[0][1]["events"] == []  # an empty snapshot is one empty batch

        # a restarted daemon: another epoch, sequences from 1 again
        c.close()
        srv.signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
        srv.start()
        c = KVTierClient(ClientConfig(url=srv.url, strict=True))
        again = Consumer(ctx, pub)
        joined(c, again, itertools.count(200))
        assert again.batches[0][1]["epoch"] != epoch
        assert ask(ctx, replay, (1).to_bytes(8, "big"))[0][0] == 1
    finally:
        c.close()
        ctx.destroy(linger=0)


def test_an_l2_write_is_a_stored_of_tier_l2(kvtier_server, tmp_path):
    pub = f"ipc://{tmp_path}/feed.sock"
    srv = kvtier_server(l1_gb=L1_GB, extra=["--events-endpoint", pub, "--l2-path", str(tmp_path / "l2"),
                                            "--l2-size-gb", "0.01"])
    ctx = zmq.Context()
    feed = Consumer(ctx, pub)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    try:
        keys = joined(c, feed, itertools.count(1))
        for key in keys:
            feed.wait("the chunk written to L2", type="Stored", tier="l2", key=key)
        e = feed.events(type="Stored", tier="l2", key=keys[0])[0]
        assert e["ns"] == NS.fingerprint() and e["size"] == 2 * BLOCK_BYTES and e["blocks"] == 2
    finally:
        c.close()
        ctx.destroy(linger=0)


def test_a_busy_feed_address_fails_the_start_with_a_clear_error(kvtier_server):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        srv = kvtier_server(l1_gb=L1_GB, extra=["--events-endpoint", address], wait=False)
        assert srv.proc.wait(timeout=30) == 2
    log = srv.log_text()
    assert f"kvtier server: the event feed cannot bind {address}: Address already in use" in log, log
    assert "Traceback" not in log and not srv.shm_path.exists()


def test_stored_events_carry_the_chunks_tokens_and_parent_key(kvtier_server):
    """A client learns the feed from the hello reply and sends each chunk's token ids and parent key with its
    store; the server checks them against the key and the L1 Stored event (and a snapshot) carries them."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    srv = kvtier_server(l1_gb=L1_GB, extra=["--events-endpoint", pub, "--events-replay-endpoint", replay])
    ctx = zmq.Context()
    feed = Consumer(ctx, pub)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    try:
        joined(c, feed, itertools.count(300))
        assert c.events_endpoint == pub
        tokens = prompt(7, 2 * NS.chunk_size + NS.block_size)  # two full chunks and a partial one of 1 block
        first, second, third = store(c, tokens)
        feed.wait("the partial chunk", type="Stored", tier="l1", key=third)
        got = {e["key"]: e for e in feed.events(type="Stored", tier="l1")}
        cs, bs = NS.chunk_size, NS.block_size
        assert got[first]["parent"] == b"" and got[second]["parent"] == first and got[third]["parent"] == second
        assert np.frombuffer(got[first]["tokens"], "<u4").tolist() == tokens[:cs].tolist()
        assert np.frombuffer(got[second]["tokens"], "<u4").tolist() == tokens[cs:2 * cs].tolist()
        assert np.frombuffer(got[third]["tokens"], "<u4").tolist() == tokens[2 * cs:2 * cs + bs].tolist()
        snap = {e["key"]: e for _, b in ask(ctx, replay, b"snapshot") for e in b["events"]}
        assert (snap[second]["tokens"], snap[second]["parent"]) == (got[second]["tokens"], first)

        # tokens that do not give the key are refused (a buggy client), and nothing is stored
        other = prompt(8, NS.chunk_size)
        (chunk,) = chunk_keys(NS, other)
        forged = dataclasses.replace(chunk, tokens=prompt(9, NS.chunk_size).astype("<u4").tobytes())
        with pytest.raises(KVTierError, match="tokens do not give its key"):
            c.store_chunks(NS, [forged], lambda ch: 2 * BLOCK_BYTES, lambda ch, span: None)
        assert c.lookup(NS, other).matches == []
    finally:
        c.close()
        ctx.destroy(linger=0)


def test_a_server_without_a_feed_names_none_in_its_hello(kvtier_server):
    srv = kvtier_server(l1_gb=L1_GB)
    c = KVTierClient(ClientConfig(url=srv.url, strict=True))
    try:
        assert c.connect() and c.events_endpoint == ""
        assert len(store(c, prompt(1, NS.chunk_size))) == 1 and c.lookup(NS, prompt(1, NS.chunk_size)).matches == [2]
    finally:
        c.close()
