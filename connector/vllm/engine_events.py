"""kvtier's holdings in the engine's own KV-event stream (docs/events.md, "Through each engine's stream").

With `"engine_events": true` the scheduler-side connector subscribes to its server's daemon feed (the address
comes in the hello reply) on a thread of its own, and turns the feed's events of this engine's namespace into
vLLM's `BlockStored` / `BlockRemoved`, named by the engine's own block hashes: vLLM's scheduler takes them each
step (`take_events`) and publishes them with the engine's GPU events (`--kv-events-config`). So a router that
indexes vLLM events sees, under each engine, the blocks it can load from kvtier: its own stores, and those of
every other engine of the same namespace (model, dtype, layout, rank, ...) on the same server.

A feed `Stored` names a chunk by its kvtier key, its token ids and its parent chunk's key; the engine's hashes
chain from the parent's last block hash, so a chunk whose parent was never seen waits for it (bounded) and is
then skipped and counted. Chunks without token ids (a request with a LoRA adapter, images or embeddings, whose
engine hashes take extra keys a feed does not carry; chunks adopted by a warm restart) are skipped and counted.
Medium: L1 is `CPU`, lower tiers `STORAGE` (vLLM's names). A block is announced once per medium while any held
chunk names it (a partial chunk and the full chunk that supersedes it share blocks) and removed when none does.
A kvtier `Cleared`, and a daemon restart (a new epoch), are `BlockRemoved` for what was announced in that
medium, never `AllBlocksCleared`: routers drop the engine's GPU blocks on that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack
import numpy as np
import zmq
from kvtier.server import protocol as p
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

log = logging.getLogger("kvtier.connector")

L1 = "l1"
OWNER = "kvtier"  # BlockStored.ownership: the offloading tier that reports the block
MAX_CHUNKS = 1 << 16  # chunks whose engine hashes are remembered (about 2 KiB each at 256-token chunks)
MAX_ORPHANS = 4096  # chunks waiting for their parent's Stored
MAX_READY = 10_000  # converted batches waiting for the scheduler's next step
POLL_MS = 100
SNAPSHOT_TIMEOUT_MS = 10_000
RESYNC_WAIT_S = 1.0  # after a failed snapshot

Hasher = Callable[[BlockHash | None, Sequence[int]], BlockHash]


def engine_hasher(algo: str) -> Hasher:
    """The engine's block hash (`--prefix-caching-hash-algo`), chained from NONE_HASH for a first block: vLLM's
    own function, so the hashes equal the engine's GPU events' (the same PYTHONHASHSEED given, docs/events.md)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    fn = get_hash_fn_by_name(algo)
    return lambda parent, tokens: hash_block_tokens(fn, parent, tokens)


def medium(tier: str) -> str:
    return MEDIUM_CPU if tier == L1 else MEDIUM_STORAGE


def locality(tier: str) -> str:
    """Relative to the engine: the remote tier is shared by nodes."""
    return "REMOTE" if tier == "remote" else "LOCAL"


@dataclass(frozen=True, slots=True)
class _Chunk:
    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None  # the engine hash of the block before its first
    tokens: bytes  # uint32 little-endian


class Converter:
    """Feed batches (maps as the daemon publishes them) of namespace `ns` to vLLM KV events. One thread."""

    def __init__(self, ns: bytes, block_size: int, hasher: Hasher, max_chunks: int = MAX_CHUNKS,
                 max_orphans: int = MAX_ORPHANS) -> None:
        self.ns = ns
        self.block_size = block_size
        self.hasher = hasher
        self.max_chunks = max_chunks
        self.max_orphans = max_orphans
        self.skipped: Counter[str] = Counter()  # why chunks or events were not published
        self.epoch: str | None = None
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()  # chunk key -> its engine hashes (LRU)
        self._orphans: OrderedDict[bytes, dict[str, Any]] = OrderedDict()  # key -> its Stored, parent unseen
        self._children: dict[bytes, set[bytes]] = {}  # parent key -> orphans waiting for it
        self._held: dict[str, dict[tuple[str, bytes], _Chunk]] = {}  # medium -> (tier, key) -> chunk announced
        self._count: dict[str, Counter[BlockHash]] = {}  # medium -> held chunks naming each block

    def batch(self, payload: dict[str, Any]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        epoch = payload.get("epoch")
        if self.epoch is not None and epoch != self.epoch:  # the daemon restarted: what it held is unknown
            self.skipped["restart"] += 1
            out += self._drop(lambda tier, key: True)
        self.epoch = epoch if isinstance(epoch, str) else None
        if payload.get("lost"):
            self.skipped["lost"] += int(payload["lost"])
        for event in payload.get("events") or ():
            try:
                out += self.convert(event)
            except (KeyError, TypeError, ValueError, AttributeError):
                self.skipped["malformed"] += 1
        return out

    def resync(self, epoch: str, held: list[dict[str, Any]]) -> list[KVCacheEvent]:
        """Take a snapshot's view (its `Stored` events: what L1 and L2 hold) in place of the one built so far:
        what it no longer lists is removed. The remote tier's chunks stay: snapshots do not list them."""
        self.epoch = epoch
        listed = {(str(e.get("tier")), bytes(e.get("key") or b"")) for e in held if e.get("ns") == self.ns}
        out = self._drop(lambda tier, key: tier != "remote" and (tier, key) not in listed)
        return out + self.batch({"epoch": epoch, "events": held})

    def convert(self, e: dict[str, Any]) -> list[KVCacheEvent]:
        kind = e["type"]
        if kind == "Cleared":
            if e.get("ns") in (None, self.ns):
                return self._drop(lambda tier, key: tier == e["tier"])
            return []
        if e.get("ns") != self.ns:  # another model's, another rank's, a request cache_salt's
            self.skipped["other_namespace"] += 1
            return []
        if kind == "Stored":
            return self._stored(e)
        if kind == "Removed":
            return self._removed(e["tier"], e["key"])
        return []

    # -- Stored ------------------------------------------------------------------------------------

    def _stored(self, e: dict[str, Any]) -> list[KVCacheEvent]:
        key, tier = bytes(e["key"]), str(e["tier"])
        chunk = self._chunks.get(key)
        if chunk is not None:
            self._chunks.move_to_end(key)
            return self._hold(tier, key, chunk)
        tokens, parent = bytes(e.get("tokens") or b""), bytes(e.get("parent") or b"")
        if not tokens:
            self.skipped["no_tokens"] += 1
            return []
        if len(tokens) != 4 * self.block_size * int(e["blocks"]):
            raise ValueError("tokens are not the chunk's blocks")
        parent_hash = None
        if parent:
            before = self._chunks.get(parent)
            if before is None:
                self._wait_for(parent, key, e)
                return []
            parent_hash = before.hashes[-1]
        ids = np.frombuffer(tokens, "<u4").tolist()
        hashes: list[BlockHash] = []
        for start in range(0, len(ids), self.block_size):
            hashes.append(self.hasher(hashes[-1] if hashes else parent_hash, ids[start:start + self.block_size]))
        chunk = self._chunks[key] = _Chunk(tuple(hashes), parent_hash, tokens)
        if len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)
        out = self._hold(tier, key, chunk)
        for child in self._children.pop(key, ()):
            waiting = self._orphans.pop(child, None)
            if waiting is not None:
                out += self._stored(waiting)
        return out

    def _wait_for(self, parent: bytes, key: bytes, e: dict[str, Any]) -> None:
        """Commits come child-first (l1/holds.py): a chunk waits a while for its parent's Stored."""
        self._orphans[key] = e
        self._children.setdefault(parent, set()).add(key)
        if len(self._orphans) > self.max_orphans:
            old, oldest = self._orphans.popitem(last=False)
            self._forget_orphan(old, oldest)
            self.skipped["unknown_parent"] += 1

    def _forget_orphan(self, key: bytes, e: dict[str, Any]) -> None:
        waiting = self._children.get(bytes(e.get("parent") or b""))
        if waiting is not None:
            waiting.discard(key)
            if not waiting:
                del self._children[bytes(e["parent"])]

    def _hold(self, tier: str, key: bytes, chunk: _Chunk) -> list[KVCacheEvent]:
        """Announce the chunk in its tier's medium: the blocks no held chunk of that medium names yet."""
        m = medium(tier)
        held = self._held.setdefault(m, {})
        if (tier, key) in held:
            return []
        held[tier, key] = chunk
        count = self._count.setdefault(m, Counter())
        fresh = [count[h] == 0 for h in chunk.hashes]
        count.update(chunk.hashes)
        out: list[KVCacheEvent] = []
        bs, i, n = self.block_size, 0, len(chunk.hashes)
        while i < n:  # one BlockStored per run of fresh blocks, each self-describing
            if not fresh[i]:
                i += 1
                continue
            j = i
            while j < n and fresh[j]:
                j += 1
            parent = chunk.hashes[i - 1] if i else chunk.parent
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in chunk.hashes[i:j]],
                parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
                token_ids=np.frombuffer(chunk.tokens, "<u4")[i * bs:j * bs].tolist(), block_size=bs,
                lora_id=None, medium=m, lora_name=None, group_idx=0, locality=locality(tier), ownership=OWNER))
            i = j
        return out

    # -- Removed, Cleared --------------------------------------------------------------------------

    def _removed(self, tier: str, key: bytes) -> list[KVCacheEvent]:
        orphan = self._orphans.pop(key, None)
        if orphan is not None:
            self._forget_orphan(key, orphan)
        chunk = self._held.get(medium(tier), {}).pop((tier, key), None)
        if chunk is None:
            return []
        return self._released(tier, [chunk])

    def _drop(self, which: Callable[[str, bytes], bool]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for held in self._held.values():
            by_tier: dict[str, list[_Chunk]] = {}
            for tier, key in [h for h in held if which(*h)]:
                by_tier.setdefault(tier, []).append(held.pop((tier, key)))
            for tier, chunks in by_tier.items():
                out += self._released(tier, chunks)
        return out

    def _released(self, tier: str, chunks: list[_Chunk]) -> list[KVCacheEvent]:
        m = medium(tier)
        count = self._count[m]
        gone = []
        for chunk in chunks:
            for h in chunk.hashes:
                count[h] -= 1
                if count[h] <= 0:
                    del count[h]
                    gone.append(maybe_convert_block_hash(h))
        if not gone:
            return []
        return [BlockRemoved(block_hashes=gone, medium=m, group_idx=0, locality=locality(tier), ownership=OWNER)]


def connect_address(endpoint: str, server_url: str) -> str:
    """The feed's address as a subscriber connects to it: a wildcard host is the server's host."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(server_url).hostname or '127.0.0.1'}:{port}"
    return endpoint


class EngineEvents:
    """The scheduler's subscriber: the feed read and converted on its own thread, handed over by `take`.

    `start` once the client said hello (before the engine serves: a subscriber misses what is published before
    it joined); else the first `take` after a hello that named the feed starts it. A server without
    `--events-endpoint` is logged once as an error. The thread converts nothing before the first `take`: the
    engine sets up its hash seed (NONE_HASH) after the connector is built. With the feed's replay socket
    (`--events-replay-endpoint`) it starts from a snapshot (what the server held before this engine came) and
    takes another one after a gap in the sequence, lost events or a daemon restart."""

    def __init__(self, endpoints: Callable[[], tuple[str, str]], connected: Callable[[], bool], server_url: str,
                 converter: Converter) -> None:
        self._endpoints = endpoints  # the feed's PUB and replay addresses, as the last hello told them
        self._connected = connected
        self._url = server_url
        self.converter = converter
        self._ready: deque[list[KVCacheEvent]] = deque()
        self._stop = threading.Event()
        self._taking = threading.Event()
        self._thread: threading.Thread | None = None
        self._told = False
        self.undelivered = 0  # converted batches dropped while the engine took none (MAX_READY)
        self.snapshots = 0  # snapshots applied

    def take(self) -> list[KVCacheEvent]:
        if self._thread is None:
            self.start()
        self._taking.set()
        out: list[KVCacheEvent] = []
        while self._ready:
            out += self._ready.popleft()
        return out

    def start(self) -> None:
        endpoint, replay = self._endpoints()
        if not endpoint:
            if self._connected() and not self._told:
                self._told = True
                log.error("kvtier connector: engine_events is on but the kvtier server at %s runs without "
                          "--events-endpoint: no kvtier blocks in this engine's KV events", self._url)
            return
        address, replay = connect_address(endpoint, self._url), connect_address(replay, self._url)
        self._thread = threading.Thread(target=self._run, args=(address, replay), name="kvtier-engine-events",
                                        daemon=True)
        self._thread.start()
        log.info("kvtier connector: engine events from the kvtier feed at %s (snapshots %s)", address,
                 replay or "off")

    def _run(self, address: str, replay: str) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # as the daemon's PUB
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(address)
        last: int | None = None  # the sequence of the last batch applied (or of the snapshot)
        resync, retry_at = bool(replay), 0.0  # a snapshot is due; while it fails, live batches still apply
        try:
            while not self._stop.is_set():
                if not self._taking.is_set():  # ZeroMQ queues meanwhile
                    self._taking.wait(POLL_MS / 1000)
                    continue
                if resync and time.monotonic() >= retry_at:
                    at = self._snapshot(ctx, replay)
                    if at is None:
                        retry_at = time.monotonic() + RESYNC_WAIT_S
                    else:
                        last, resync = at, False
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                try:
                    seq, payload = int.from_bytes(frames[1], "big"), msgpack.unpackb(frames[-1])
                    epoch = payload["epoch"]
                    if replay and not resync and (epoch != self.converter.epoch or payload.get("lost")
                                                  or (last is not None and seq > last + 1)):
                        resync = True  # a snapshot rebuilds the view (it holds this batch's effect too)
                        continue
                    if not resync and last is not None and seq <= last:
                        continue  # in the snapshot already
                    last = seq
                    events = self.converter.batch(payload)
                except Exception:  # a bad message is a counted skip, never the end of the thread
                    self.converter.skipped["malformed"] += 1
                    continue
                self._hand(events)
        finally:
            sub.close(0)
            ctx.term()

    def _snapshot(self, ctx: zmq.Context, replay: str) -> int | None:
        """Apply a snapshot of the server's index; its sequence, or None when it failed (counted)."""
        try:
            answer = p.feed_request(ctx, replay, p.FEED_SNAPSHOT, SNAPSHOT_TIMEOUT_MS)
            if not answer:
                raise TimeoutError("the server could not list what it holds")
            at, first = answer[0]
            self._hand(self.converter.resync(first["epoch"], [e for _, b in answer for e in b["events"]]))
        except (TimeoutError, zmq.ZMQError, KeyError, TypeError, ValueError) as exc:
            self.converter.skipped["snapshot_failed"] += 1
            log.debug("kvtier connector: event feed snapshot failed (%s)", exc)
            return None
        self.snapshots += 1
        return at

    def _hand(self, events: list[KVCacheEvent]) -> None:
        if events:
            if len(self._ready) >= MAX_READY:
                self._ready.popleft()
                self.undelivered += 1
            self._ready.append(events)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            skipped = dict(self.converter.skipped)
            if skipped or self.undelivered:
                log.info("kvtier connector: engine events skipped %s, %d batches undelivered", skipped,
                         self.undelivered)
