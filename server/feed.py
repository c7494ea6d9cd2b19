"""The daemon's event feed for node-level consumers (docs/events.md): the bus's events (server/events.py) in
batches on a ZeroMQ PUB socket, with sequence numbers, an epoch per daemon start, and a ROUTER socket that
replays buffered batches and answers snapshots.

The framing is vLLM's ZmqEventPublisher's: PUB messages are (topic, sequence as 8 bytes big-endian, payload);
on the replay socket a consumer (REQ or DEALER) sends a start sequence (8 bytes big-endian) and gets
(sequence, payload) for every buffered batch from it, then (-1 as 8 signed bytes, b""). kvtier adds the
request b"snapshot": (S, payload) per batch of every chunk L1 and the local tiers hold, then the same end
marker; S is the sequence the snapshot is consistent with (apply the batches after S on top of it). A payload
is a msgpack map: {"epoch", "ts", "events": [...]}, plus "lost" (events dropped before this batch) and
"snapshot" (true in a snapshot's batches).

Every socket call runs on the feed's thread; the serving loop only posts events and, for a snapshot, lists
what is held (one call on the loop). PUB never blocks: a subscriber past its high-water mark loses messages.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
from kvtier.server import protocol as p
from kvtier.server.events import Bus, Stored, Subscription
from kvtier.server.metrics import FeedMetrics

log = logging.getLogger("kvtier.server.feed")

BATCH_MAX = 256  # events per published batch
SNAPSHOT_BATCH = 1024  # events per snapshot batch
POLL_S = 0.05  # the longest a replay request waits while no event comes
GATHER_S = 0.005  # after a batch, how long the next one gathers events before it is published
SNAPSHOT_WAIT_S = 10.0  # the longest the feed waits for the loop to list what is held
SNAPSHOT_GAP_S = 0.5  # the least time between two listings on the loop: requests meanwhile share the next one
REQUESTS_PER_STEP = 16  # replay-socket requests served between two takes from the bus
SNAPSHOT_WAITERS_MAX = 1024  # snapshot requests waiting for a listing; more are answered with the end marker
PUB_HWM = 100_000  # messages queued per PUB subscriber before ZeroMQ drops for it
TOPIC = b""  # as vLLM's publisher's default
SNAPSHOT, END_SEQ, request = p.FEED_SNAPSHOT, p.FEED_END, p.feed_request  # the consumer's side (protocol.py)


class FeedUnavailable(Exception):
    """An address of the feed could not be bound (in use, not permitted, malformed)."""


@dataclass(frozen=True)
class FeedConfig:
    endpoint: str
    replay_endpoint: str = ""
    buffer_batches: int = 10_000
    queue_depth: int = 100_000


@dataclass(eq=False)
class _Mark:
    """A snapshot request's place in the event stream: events before it are in the listing (`held`, taken on
    the loop right after the mark was queued); events after it may be too (applying them again is harmless)."""

    idents: list[bytes]  # the requesters it answers
    held: list[Stored] | None = None
    ready: threading.Event = field(default_factory=threading.Event)


def encode(event: object) -> dict[str, Any]:
    """An event as a map: its type's name and its fields (events are slotted dataclasses; not `asdict`,
    which costs ten times as much); a Stored's `tokens` and `parent` only when it has tokens."""
    out = {"type": type(event).__name__, **{f: getattr(event, f) for f in event.__slots__}}  # type: ignore[attr-defined]
    if out.get("tokens") == b"":
        del out["tokens"], out["parent"]
    return out


class Feed:
    """Bound and subscribed at construction (a bad or busy address fails the start); publishing starts with
    `start`."""

    def __init__(self, bus: Bus, config: FeedConfig, metrics: FeedMetrics, held: Callable[[], list[Stored]]) -> None:
        self.bus = bus
        self.config = config
        self.m = metrics
        self._held = held
        self.epoch = uuid.uuid4().hex  # a consumer that sees another one knows the daemon restarted
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._replay: zmq.Socket | None = None
        address = config.endpoint
        try:
            self._pub.bind(address)
            if config.replay_endpoint:
                address = config.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 bytes or "snapshot"
                self._replay.bind(address)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise FeedUnavailable(f"the event feed cannot bind {address}: {exc.strerror}") from exc
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=config.buffer_batches)
        self._seq = 0  # of the last batch published; the first is 1
        self._lost_told = 0
        self._sub: Subscription = bus.subscribe(config.queue_depth, on_drop=metrics.dropped.inc)
        self._call_soon: Callable[..., Any] = lambda fn, *a: fn(*a)
        self._waiting: list[bytes] = []  # snapshot requesters no listing was started for yet
        self._mark: _Mark | None = None  # the snapshot whose listing is in flight
        self._next_listing = 0.0  # monotonic time the next listing may start
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-feed", daemon=True)

    def start(self, call_soon: Callable[..., Any]) -> None:
        """Start publishing; `call_soon` runs a call on the serving loop (from any thread)."""
        self._call_soon = call_soon
        self._thread.start()
        log.info("event feed on %s (replay %s), epoch %s", self.config.endpoint,
                 self.config.replay_endpoint or "off", self.epoch)

    def stop(self, timeout: float = 2.0) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.bus.unsubscribe(self._sub)
        if not self._thread.is_alive():  # else the process exit closes them (never under a running thread)
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- the feed's thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                items = self._sub.take(BATCH_MAX, POLL_S)
                self._publish_items(items)
                if items:  # let the next batch gather: fewer wake-ups taking the GIL from the serving loop
                    self._stopping.wait(GATHER_S)
                for _ in range(REQUESTS_PER_STEP):
                    if self._replay is None or not self._replay.poll(0):
                        break
                    self._serve_request()
                self._start_listing()
            except Exception:  # keep publishing; a bug here must not stop the feed
                log.exception("event feed step failed")
                time.sleep(POLL_S)

    def _publish_items(self, items: list[object]) -> None:
        batch: list[object] = []
        for item in items:
            if isinstance(item, _Mark):
                self._publish(batch)
                batch = []
                self._answer_snapshot(item)
            else:
                batch.append(item)
        self._publish(batch)

    def _publish(self, events: list[object]) -> None:
        lost = self._sub.dropped - self._lost_told
        if not events and not lost:
            return
        self._lost_told += lost
        self._seq += 1
        body: dict[str, Any] = {"epoch": self.epoch, "ts": time.time(), "events": [encode(e) for e in events]}
        if lost:
            body["lost"] = lost
        seq, payload = self._seq.to_bytes(8, "big"), msgpack.packb(body, use_bin_type=True)
        self._pub.send_multipart((TOPIC, seq, payload))
        self._buffer.append((seq, payload))
        self.m.batches.inc()
        for kind, n in Counter(type(e).__name__ for e in events).items():
            self.m.events.labels(kind).inc(n)

    def _serve_request(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or (frames[2] != SNAPSHOT and len(frames[2]) != 8):
            self.m.requests.labels("bad").inc()
            if len(frames) >= 2:
                self._replay.send_multipart((frames[0], b"", END_SEQ, b""))
            return
        ident, _, body = frames
        if body == SNAPSHOT:
            self.m.requests.labels("snapshot").inc()
            if len(self._waiting) < SNAPSHOT_WAITERS_MAX:
                self._waiting.append(ident)
            else:
                self._replay.send_multipart((ident, b"", END_SEQ, b""))  # the listing-failed answer: ask again
            return
        self.m.requests.labels("replay").inc()
        start = int.from_bytes(body, "big")
        for seq, payload in list(self._buffer):
            if int.from_bytes(seq, "big") >= start:
                self._replay.send_multipart((ident, b"", seq, payload))
        self._replay.send_multipart((ident, b"", END_SEQ, b""))

    def _start_listing(self) -> None:
        """Have the loop list what is held for the waiting snapshot requests: one listing at a time, at most one
        per SNAPSHOT_GAP_S (a consumer asking in a loop cannot keep the serving loop busy)."""
        if not self._waiting or self._mark is not None or time.monotonic() < self._next_listing:
            return
        self._mark, self._waiting = _Mark(self._waiting), []
        self._next_listing = time.monotonic() + SNAPSHOT_GAP_S
        self._call_soon(self._capture, self._mark)

    def _answer_snapshot(self, mark: _Mark) -> None:
        """Send what the loop listed, as of the last batch published (before the mark); no batch (the end
        marker alone) when the listing failed."""
        assert self._replay is not None
        deadline = time.monotonic() + SNAPSHOT_WAIT_S
        while not mark.ready.wait(POLL_S) and not self._stopping.is_set() and time.monotonic() < deadline:
            pass
        batches = []
        if mark.ready.is_set() and mark.held is not None:
            held, now = mark.held, time.time()
            batches = [msgpack.packb({"epoch": self.epoch, "ts": now, "snapshot": True,
                                      "events": [encode(e) for e in held[i:i + SNAPSHOT_BATCH]]}, use_bin_type=True)
                       for i in range(0, max(len(held), 1), SNAPSHOT_BATCH)]
        seq = self._seq.to_bytes(8, "big")
        for ident in mark.idents:
            for payload in batches:
                self._replay.send_multipart((ident, b"", seq, payload))
            self._replay.send_multipart((ident, b"", END_SEQ, b""))
        self._mark = None

    # -- the serving loop --------------------------------------------------------------------------

    def _capture(self, mark: _Mark) -> None:
        """On the loop: queue the mark (past the bound: it must arrive), then list what is held."""
        self._sub.offer(mark, force=True)
        try:
            mark.held = self._held()
        except Exception:
            log.exception("event feed snapshot failed")
        finally:
            mark.ready.set()
