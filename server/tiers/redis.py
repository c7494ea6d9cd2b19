"""The remote tier: chunks in a Redis >= 7 / Valkey >= 8 store (standalone or Cluster) that every node sharing
`--remote-prefix` reads and writes, through valkey-glide's sync client (zero-copy SET from a memoryview, GET
into the caller's buffer). Facts behind the choices: /work/shared/reference/remote-tier.md.

Layout (`<ns>`, `<key>`: hex of the namespace fingerprint and the chunk key):

    <prefix>:<ns>:{<key>}:h           generation (8 random bytes per put) + record.py's header (fields, XXH3-128
                                      checksum of the fields and the payload)
    <prefix>:<ns>:{<key>}:<gen>:<i>   payload part i (1 MiB; the last one shorter) of that generation
    <prefix>:<ns>:{<alias>}:a         holders of a block-prefix alias, so that a lookup ending inside a chunk
                                      finds it as FsTier's index does locally: records of chunk key + leading
                                      block count (u32), one after another, the newest last (APPENDed)

The hash tag is the chunk key: a chunk's header and parts live in one Cluster slot, and a prompt's chunks
spread over every master.

Writes (`put`, write-behind threads): skipped when the header exists (another node wrote it: `existing`);
else the parts (one non-atomic batch), then the header with SET NX, then the chunk is added as a holder to
each alias key (`_add_holder`), all with the TTL (parts a little longer, so a header never outlives its parts
by expiry). Every chunk holding a prefix is kept, as PrefixIndex's shadowed holders locally: two prompts that
share a document and differ after it both hold its leading blocks, and when one holder expires or goes, a
probe finds the others (a string, not a Redis set: the probe's one MGET still reads it; compacted to the
newest ALIAS_HOLDERS by the writer that grows it past ALIAS_COMPACT_BYTES). A put that loses the NX race
deletes its own parts: a reader only ever sees one generation's parts, whose checksum is in its header, so
two writers of different bytes never mix. A node that answers OOM (full, its policy evicts nothing) gets no
writes for FULL_PAUSE_S[0], doubled per refused retry (skipped writes counted); reads go on.
Reads (`get`, promotion threads): the parts in MGETs of up to
GROUP_PARTS (8 MiB) straight into the L1 pages (a part that crosses a page run goes through a staging
buffer), the header in the first MGET when a probe saw the chunk's generation (one round trip for a chunk
of up to 8 MiB that a lookup found; the parts are only used if the header read with them is that
generation's), else the header's GET first; sizes and checksum verified before True; a missing part or
header (`missing`) or a bad one (`corrupt`: a wrong size or checksum, never an error reply, which is a
counted miss) is a miss and the header is deleted (only if it is still the one read; GET and UNLINK, the
documented ACL's commands), never served; that generation is ignored for BAD_TTL_S, so it is counted once
even when its delete failed (counted, logged). glide copies an MGET's values into the buffers inside the
call, so the pages are not written after it returns (the caller owns them until then).
A chunk read gets its TTL back (PEXPIRE, throttled per chunk: `_touch`).

Lookups (`find_prefix`, the serving loop) never wait: they answer from a presence cache (block key ->
(record, leading blocks) or missing, with an expiry, bounded), and for a chunk it does not know they start
one probe on the probe thread (an MGET of the header and alias keys; on a Cluster glide asks every master
at once) and answer None
("pending"); the next lookup finds the answers. Known misses end the run.

Failures: no retries on the data path; glide's request timeout is `--remote-timeout-ms` or 4x a part's time
at the measured bandwidth, whichever is longer (a batch's: 4x its bytes' time; a thread's client is made
anew when that moved RESIZE_FACTOR away; a connection's setup: at least `--remote-connect-timeout-ms`).
One circuit breaker per node address (purgatory's state machine; its bookkeeping under a lock of ours, never
the call: calls run in parallel): while one is open, that node's reads are misses, its writes dropped and
its lookups misses, all counted, and the maintenance thread PINGs it after `--remote-breaker-reset-s`; an
answer closes it. The breakers of nodes that leave the Cluster's slot map go with it (health follows the
current masters).

Access (config.RemoteAccess): TLS with a private CA and a client certificate; a password file read every
PASSWORD_CHECK_S, whose new password open clients take for their next authentication (one that never
connected is replaced); reads from replicas, where a chunk a replica shows missing or damaged is read again
from the primary before anything is deleted or counted (a replica may lag).

Accounting (the tier contract's properties, cheap and non-blocking): `used_bytes` and `capacity_bytes` are
the store's INFO used_memory and maxmemory summed over its masters (every node's data, not only this one's;
refreshed every few seconds off the loop; capacity 0 = no limit), `entries` the chunks the presence cache
knows to be there, `written`/`written_bytes` what this node wrote. The store owns capacity (maxmemory with
a volatile-* or allkeys-* policy): nothing here evicts; a store that cannot evict is warned of at start.
"""

from __future__ import annotations

import binascii
import bisect
import contextlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import glide_sync as glide
from kvtier.server.config import RemoteAccess, RemoteUrl, parse_remote_url
from kvtier.server.events import Cleared as ClearedEvent
from kvtier.server.events import Removed, Stored
from kvtier.server.metrics import Metrics, RemoteMetrics
from kvtier.server.tiers.bandwidth import BandwidthMeter
from kvtier.server.tiers.base import Cleared, LowerTier
from kvtier.server.tiers.record import ChunkMeta, CorruptChunk, decode_header, encode_header, hasher
from purgatory import SyncCircuitBreakerFactory
from purgatory.domain.model import OpenedState

log = logging.getLogger("kvtier.server.remote")

T = TypeVar("T")

PART_BYTES = 1 << 20  # one value per MiB: multi-MB values move ~2.5x slower (reference/remote-tier.md)
GROUP_PARTS = 8  # parts a read asks for in one MGET: Redis 7 serves one reply of 32 MiB ~2x slower than 4 of 8
GENS_MAX = 16_384  # chunk generations remembered from probes and reads (a known one is read in one round trip)
GEN_BYTES = 8
ALIAS = struct.Struct("<16sI")  # one holder in an alias key's value: chunk key, leading blocks
ALIAS_HOLDERS = 8  # holders a probe tries per alias key (the newest) and a compaction keeps
ALIAS_COMPACT_BYTES = 2 * ALIAS_HOLDERS * ALIAS.size  # an alias value grown past this is compacted by its writer
PART_TTL_MARGIN_MS = 60_000  # parts outlive their header by this much
PRESENT_TTL_S = 30.0  # how long the presence cache trusts a chunk it saw (the store may evict it meanwhile)
MISSING_TTL_S = 2.0  # ... and a miss (another node may write the chunk): a new chunk is seen this late at most
PRESENCE_MAX = 200_000  # presence cache entries (block keys); the oldest go first
NAMESPACES_MAX = 8  # namespaces remembered for lookups that do not name theirs
PROBE_QUEUE = 64  # probe jobs waiting; a lookup that finds the queue full stays pending
PROBE_MAX_KEYS = 2048  # block keys one probe round asks about
BAD_TTL_S = 600.0  # how long a generation found corrupt or incomplete is ignored (its delete may have failed)
BAD_MAX = 10_000  # bad generations remembered; the oldest go first
PROBE_ROUNDS = 3  # chunk headers, then the aliases of the chunk where the run ends, then their chunks
TIMEOUT_FACTOR = 4  # a transfer times out at this many times its duration at the measured bandwidth
ASSUMED_BYTES_PER_S = 100e6  # until the bandwidth is measured: 1 GbE
RESIZE_FACTOR = 2.0  # a thread's client is made anew when its part timeout is this far off the sized one
FULL_PAUSE_S = (1.0, 60.0)  # writes to a node that answered OOM pause this long, doubled per OOM retry up to this
REFRESH_FRACTION = 0.25  # a chunk read gets its TTL back at most once per this fraction of the TTL
REFRESH_MAX = 100_000  # chunks whose next TTL refresh time is remembered; the oldest go first
TOUCH_MAX = 100_000  # keys waiting for their TTL refresh (sent every TICK_S); more are not refreshed
TOUCH_BATCH = 1000  # PEXPIREs per pipeline
TICK_S = 0.25  # maintenance thread: how often open breakers are looked at
INFO_REFRESH_S = 5.0  # ... and how often INFO (used_memory, maxmemory), the slot map and the RTT are refreshed
PASSWORD_CHECK_S = 1.0  # ... and how often --remote-password-file is read for a new password
SCAN_COUNT = 1000
CLUSTER_SLOTS = 16384

_READ_FROM = {"primary": glide.ReadFrom.PRIMARY, "prefer_replica": glide.ReadFrom.PREFER_REPLICA,
              "az_affinity": glide.ReadFrom.AZ_AFFINITY}  # --remote-read-from's choices (config.READ_FROM)

_TLS_HINT = (" (TLS: a store that refuses the handshake looks like one that does not answer; check "
             "--remote-tls-ca-file, --remote-tls-cert-file and --remote-tls-key-file)")

# Failures of a node (they trip its breaker); other errors are answers (a server error, a bad value).
_NODE_FAILURES = (glide.TimeoutError, glide.ConnectionError, glide.ClosingError)


def _node_failure(exc: BaseException) -> bool:
    """Whether `exc` says the node did not answer (towards opening its breaker), not that it refused. A glide
    client that never connected raises a plain RequestError ("... connect failed") for a node that is down."""
    return isinstance(exc, _NODE_FAILURES) or (isinstance(exc, glide.RequestError) and "connect" in str(exc).lower())


def _denied(reply: object) -> bool:
    """Whether a batch's reply is the store's refusal of a command the ACL user may not run."""
    return isinstance(reply, glide.RequestError) and any(w in str(reply) for w in ("NOPERM", "PermissionDenied"))


def _full(exc: object) -> bool:
    """Whether `exc` (an exception or a batch's error value) is the store's OOM reply: maxmemory reached and
    its policy evicts nothing (noeviction, or volatile-* with no TTL'd keys left)."""
    return isinstance(exc, glide.RequestError) and str(exc).startswith("OOM")


# A "partial data" error glide raises itself when a GET's value is larger than the caller's buffer: the part
# is longer than its header says (corruption), unlike the server's error replies (the store is unavailable).
_OVERFLOW = "exceeds buffer capacity"


class _Unavailable(Exception):
    """A call not made (its node's breaker is open) or failed (timeout, lost connection): a miss."""


class _Breaker:
    """One node's circuit breaker: purgatory's state machine. purgatory keeps no lock, and its bookkeeping
    is not safe across threads, so it runs under ours; the call itself runs outside it, in parallel."""

    def __init__(self, factory: SyncCircuitBreakerFactory, node: str) -> None:
        self._brk = factory.get_breaker(node)
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """Opened, or half-opened by a probe in flight: data calls are not made."""
        return self._brk.context.state != "closed"

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` through the breaker: purgatory.OpenedState while open and its reset time not passed; a node
        failure counts towards opening it, any other outcome (a server error included) closes the count."""
        with self._lock:
            self._brk.__enter__()
        try:
            out = fn()
        except BaseException as exc:
            failed = _node_failure(exc)
            with self._lock:
                self._brk.__exit__(*((type(exc), exc, exc.__traceback__) if failed else (None, None, None)))
            raise
        with self._lock:
            self._brk.__exit__(None, None, None)
        return out


_UNKNOWN = object()  # the presence cache's answer for a key it has no live entry for
_UNREAD = object()  # a read's header value before it is read
_AGAIN = "again"  # a read with the header to do again without it (see _read_parts)
Found = tuple[ChunkMeta, int]  # a chunk and the leading blocks a key matches


class _Presence:
    """What this node knows of the store: block key -> (record, leading blocks), or None (missing), with an
    expiry; bounded (the oldest entries go first). Thread-safe; `chunks` counts live entries under a
    chunk's own key."""

    def __init__(self, max_entries: int = PRESENCE_MAX) -> None:
        self._lock = threading.Lock()
        self._map: OrderedDict[bytes, tuple[float, Found | None]] = OrderedDict()
        self._max = max_entries
        self.chunks = 0

    def get(self, key: bytes, now: float) -> Found | None | object:
        with self._lock:
            item = self._map.get(key)
            if item is None:
                return _UNKNOWN
            if item[0] < now:
                self._pop(key)
                return _UNKNOWN
            return item[1]

    def add(self, meta: ChunkMeta, now: float) -> None:
        """`meta` is in the store: found under its key and each alias (a live hit under an alias stays)."""
        expiry = now + PRESENT_TTL_S
        with self._lock:
            self._set(meta.key, (expiry, (meta, meta.blocks)))
            for j, alias in enumerate(meta.aliases, start=1):
                item = self._map.get(alias)
                if item is None or item[1] is None or item[0] < now:
                    self._set(alias, (expiry, (meta, j)))

    def found(self, key: bytes, hit: Found, now: float) -> None:
        with self._lock:
            self._set(key, (now + PRESENT_TTL_S, hit))

    def missing(self, keys: Iterable[bytes], now: float) -> None:
        expiry = now + MISSING_TTL_S
        with self._lock:
            for key in keys:
                self._set(key, (expiry, None))

    def drop(self, meta: ChunkMeta, now: float) -> None:
        """`meta` is gone from the store: a miss under its key, forgotten under the aliases that point to it."""
        with self._lock:
            for alias in meta.aliases:
                item = self._map.get(alias)
                if item is not None and item[1] is not None and item[1][0] == meta:
                    self._pop(alias)
            self._set(meta.key, (now + MISSING_TTL_S, None))

    def forget(self, ns: bytes | None) -> None:
        """Forget every chunk (of namespace `ns`), and every miss (a clear makes them stale too)."""
        with self._lock:
            for key in [k for k, (_, hit) in self._map.items() if ns is None or hit is None or hit[0].ns == ns]:
                self._pop(key)

    def _set(self, key: bytes, item: tuple[float, Found | None]) -> None:
        self._pop(key)
        self._map[key] = item
        if item[1] is not None and item[1][0].key == key:
            self.chunks += 1
        while len(self._map) > self._max:
            self._pop(next(iter(self._map)))

    def _pop(self, key: bytes) -> None:
        item = self._map.pop(key, None)
        if item is not None and item[1] is not None and item[1][0].key == key:
            self.chunks -= 1


@dataclass(slots=True)
class Prepared:
    """A put's CPU work, done by `prepare` on the writer's first stage: the header value and the parts."""

    header: bytes  # generation + record header
    parts: list  # buffers, PART_BYTES each but the last (views of the sources where a part lies in one)


def _pieces(bufs: Sequence, size: int) -> list[list[memoryview]]:
    """Per part of a `size`-byte payload held in `bufs` (in order), the views of `bufs` it covers: one,
    unless the part crosses the end of a buffer."""
    parts: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled, left = 0, size
    for buf in bufs:
        view = memoryview(buf).cast("B")
        off = 0
        while off < len(view) and left:
            take = min(PART_BYTES - filled, len(view) - off, left)
            current.append(view[off : off + take])
            filled += take
            off += take
            left -= take
            if filled == PART_BYTES or not left:
                parts.append(current)
                current, filled = [], 0
    if left:
        raise ValueError(f"buffers hold {size - left} of the chunk's {size} bytes")
    return parts


def _verified(bufs: Sequence, size: int, fields: bytes, checksum: bytes) -> bool:
    """Whether the first `size` bytes of `bufs` (in order) and the header `fields` have `checksum`."""
    h = hasher(fields)
    for part in _pieces(bufs, size):
        for piece in part:
            h.update(piece)
    return h.digest() == checksum


def _holders(value: bytes) -> list[bytes]:
    """An alias key's holder records (ALIAS each, appended: the newest last), newest first, each once, at
    most ALIAS_HOLDERS. Bytes before the first whole record are not kvtier's and are ignored (a record is
    verified against its chunk's header before it is used). A value an earlier kvtier wrote (one record,
    SET NX) reads as its one holder."""
    out: list[bytes] = []
    for end in range(len(value), len(value) % ALIAS.size, -ALIAS.size):
        record = value[end - ALIAS.size : end]
        if record not in out:
            out.append(record)
            if len(out) == ALIAS_HOLDERS:
                break
    return out


def _slot(tag: bytes) -> int:
    """The Cluster slot of keys whose hash tag is `tag` (CRC16/XMODEM mod 16384)."""
    return binascii.crc_hqx(tag, 0) % CLUSTER_SLOTS


class RemoteTier(LowerTier):
    """See the module docstring. `url` is a --remote-url; `timeout_ms` the floor of every call's timeout."""

    name = "remote"
    required_for_readiness = False  # an outage of the shared store leaves this node serving L1 and L2

    def __init__(self, url: str, prefix: str = "kvtier", ttl_s: float = 86400.0, timeout_ms: int = 200,
                 breaker_threshold: int = 5, breaker_reset_s: float = 5.0,
                 metrics: RemoteMetrics | None = None, connect_timeout_ms: int = 1000,
                 access: RemoteAccess | None = None) -> None:
        self.url: RemoteUrl = parse_remote_url(url)
        self.access = access if access is not None else RemoteAccess()
        self.access.validate(self.url)
        self._ca = Path(self.access.tls_ca_file).read_bytes() if self.access.tls_ca_file else None
        self._password = self._read_password() if self.access.password_file else self.url.password
        self._stale: set[int] = set()  # ids of clients to replace (a new password they could not take)
        self._password_error = ""  # the last reason the password file could not be read (logged once)
        self.path = self.url.redacted()  # where the tier is, for logs and status (no password)
        self.prefix = prefix
        self.ttl_ms = round(ttl_s * 1000)
        self.timeout_ms = timeout_ms
        self.connect_timeout_ms = connect_timeout_ms  # floor of a connection's setup (a cold TLS one: several RTTs)
        self.m = metrics if metrics is not None else RemoteMetrics(Metrics())
        glide.Logger.init(glide.LogLevel.ERROR)  # not glide's per-timeout warnings (counted here instead)
        self._breakers: dict[str, _Breaker] = {}
        self._factory = SyncCircuitBreakerFactory(default_threshold=breaker_threshold, default_ttl=breaker_reset_s)
        self._lock = threading.Lock()
        self._local = threading.local()  # one client per thread: its own connections, calls in parallel
        self._clients: list[Any] = []
        self._presence = _Presence()
        self._namespaces: OrderedDict[bytes, None] = OrderedDict()  # for lookups that do not name theirs
        self._probing: set[bytes] = set()  # first keys of the probes queued or running
        self._bw = BandwidthMeter()  # every transfer's rate: what timeouts are sized from
        self._bad: OrderedDict[bytes, float] = OrderedDict()  # chunk key + generation -> until when it is ignored
        self._gens: OrderedDict[bytes, bytes] = OrderedDict()  # chunk key -> the generation last seen (bounded)
        seed = self.url.nodes[0]
        self._slot_starts: list[int] = [0]  # Cluster slot ranges' first slots, and their masters
        self._slot_nodes: list[str] = [self._node_name(*seed)]
        self._rtt = 0.0
        self._used = self._capacity = 0
        self._limits: dict[str, tuple[int, str]] = {}  # master -> (maxmemory, maxmemory_policy), from INFO
        self._full: dict[str, tuple[float, float]] = {}  # master that answered OOM -> (writes pause until, pause)
        self._refreshed: OrderedDict[bytes, float] = OrderedDict()  # chunk key -> its next TTL refresh, not before
        self._touches: dict[str, list[tuple[str, int]]] = {}  # node -> (key, TTL ms) to PEXPIRE at the next tick
        self._no_expire = False  # the store refused PEXPIRE (an ACL without it): TTLs are not refreshed
        self._no_append = False  # ... and APPEND: an alias key keeps its first holder (SET NX), as before holders
        self.written = self.written_bytes = 0
        self.existing = self.corrupt = self.missing = self.pending = 0
        self.rejected = self.timeouts = self.errors = self.skipped = 0
        self._stop = threading.Event()
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(PROBE_QUEUE)
        self._threads = [threading.Thread(target=self._run_jobs, name="kvtier-remote-probe", daemon=True),
                         threading.Thread(target=self._run_maintenance, name="kvtier-remote-maint", daemon=True)]
        for t in self._threads:
            t.start()

    # -- accounting ------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return self._presence.chunks

    @property
    def rtt_s(self) -> float:
        """The measured round trip (PING) to the store, seconds; 0.0 until measured."""
        return self._rtt

    def stats(self) -> dict:
        """The remote tier's own part of the `stats` op (AttachedTier adds the common ones)."""
        return {
            "remote_url": self.path,
            "remote_rtt_s": self._rtt,
            "remote_written_bytes": self.written_bytes,
            "remote_existing_writes": self.existing,
            "remote_missing_chunks": self.missing,
            "remote_pending_lookups": self.pending,
            "remote_rejected_calls": self.rejected,
            "remote_timeouts": self.timeouts,
            "remote_errors": self.errors,
            "remote_breakers_open": self._down(),
            "remote_skipped_writes": self.skipped,
            "remote_writes_paused": sorted(n for n in list(self._full) if self._write_paused(n)),
        }

    def health(self) -> tuple[bool, str]:
        down = self._down()
        if down:
            return False, f"remote breaker open for {', '.join(down)}: reads miss and writes drop until it answers"
        return True, ""

    def _down(self) -> list[str]:
        """The current masters whose breaker is open."""
        return [node for node in self._masters() if (b := self._breakers.get(node)) is not None and b.open]

    # -- keys, nodes, clients, calls ---------------------------------------------------------------

    def _key(self, ns: bytes, key: bytes, suffix: str) -> str:
        return f"{self.prefix}:{ns.hex()}:{{{key.hex()}}}:{suffix}"

    def _part_key(self, ns: bytes, key: bytes, gen: bytes, i: int) -> str:
        return self._key(ns, key, f"{gen.hex()}:{i}")

    @staticmethod
    def _node_name(host: str, port: int) -> str:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _node_of(self, key: bytes) -> str:
        """The master holding the keys tagged with chunk key `key` (as of the last slot map)."""
        if not self.url.cluster:
            return self._slot_nodes[0]
        slot = _slot(key.hex().encode())
        return self._slot_nodes[bisect.bisect_right(self._slot_starts, slot) - 1]

    def _breaker(self, node: str) -> _Breaker:
        brk = self._breakers.get(node)
        if brk is None:
            with self._lock:
                brk = self._breakers.get(node)
                if brk is None:
                    brk = self._breakers[node] = _Breaker(self._factory, node)
                    self.m.breaker_open.labels(node).set_function(lambda: float(brk.open))
        return brk

    def _available(self, node: str) -> bool:
        return not self._breaker(node).open

    def _client(self, primary: bool = False, resize: bool = False) -> Any:
        """This thread's client; `primary`: one whose reads go to the primary (the same client unless
        --remote-read-from sends reads to replicas). Closed and replaced: a client marked stale (a new password
        it could not take), and with `resize` (only where no caller up the stack holds it: put, get) one whose
        request timeout is RESIZE_FACTOR off the one the measured bandwidth now sizes for a part."""
        attr = "primary" if primary and self.access.read_from != "primary" else "client"
        client = getattr(self._local, attr, None)
        if client is not None:
            made, sized = getattr(self._local, f"{attr}_timeout_ms"), self._timeout_ms(PART_BYTES)
            off = resize and not made / RESIZE_FACTOR <= sized <= made * RESIZE_FACTOR
            if off or id(client) in self._stale:
                with self._lock:
                    self._stale.discard(id(client))
                    self._clients.remove(client)
                with contextlib.suppress(glide.GlideError):
                    client.close()
                client = None
        if client is None:
            password = self._password
            setattr(self._local, f"{attr}_timeout_ms", self._timeout_ms(PART_BYTES))
            client = self._connect(password, primary=attr == "primary")
            setattr(self._local, attr, client)
            with self._lock:
                self._clients.append(client)
                if password != self._password:  # a new password came meanwhile, after the clients were told
                    self._stale.add(id(client))
        return client

    def _connect(self, password: str, primary: bool = False) -> Any:
        """A client (lazy: it connects at its first call) whose request timeout is sized from the bandwidth
        measured so far; `primary`: its reads go to the primary whatever --remote-read-from says."""
        u, a = self.url, self.access
        addresses = [glide.NodeAddress(h, p) for h, p in u.nodes]
        creds = glide.ServerCredentials(password, u.username or None) if password else None
        timeout = self._timeout_ms(PART_BYTES)
        connect = max(timeout, self.connect_timeout_ms)
        tls = glide.TlsAdvancedConfiguration(root_pem_cacerts=self._ca, client_cert_path=a.tls_cert_file or None,
                                             client_key_path=a.tls_key_file or None) if u.tls else None
        common = dict(use_tls=u.tls, credentials=creds, request_timeout=timeout, lazy_connect=True,
                      read_from=_READ_FROM["primary" if primary else a.read_from], client_az=a.az or None)
        if u.cluster:
            return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
                addresses, advanced_config=glide.AdvancedGlideClusterClientConfiguration(
                    connection_timeout=connect, tls_config=tls), **common))
        return glide.GlideClient.create(glide.GlideClientConfiguration(
            addresses, database_id=u.db or None, advanced_config=glide.AdvancedGlideClientConfiguration(
                connection_timeout=connect, tls_config=tls), **common))

    def _read_password(self) -> str:
        """--remote-password-file's content less its trailing newline; ValueError when unreadable or empty."""
        try:
            password = Path(self.access.password_file).read_text().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--remote-password-file: {exc}") from None
        if not password:
            raise ValueError(f"--remote-password-file: {self.access.password_file} is empty")
        return password

    def _reload_password(self) -> None:
        """Maintenance thread: when --remote-password-file holds a new password, new clients use it and every
        open client takes it for its next authentication (its connections stay authenticated); a client that
        never connected cannot take it and is replaced at its thread's next call. One log line says whether
        the store accepts it (a fresh connection's PING)."""
        try:
            password = self._read_password()
        except ValueError as exc:
            if str(exc) != self._password_error:  # logged once per error, not every second
                log.warning("remote password not reloaded: %s", exc)
            self._password_error = str(exc)
            return
        self._password_error = ""
        if password == self._password:
            return
        with self._lock:
            self._password = password
            clients = list(self._clients)
        replaced = 0
        for client in clients:
            try:
                client.update_connection_password(password, immediate_auth=False)
            except glide.GlideError:  # never connected: it would connect with the old password
                replaced += 1
                with self._lock:
                    if client in self._clients:  # not closed by its thread meanwhile
                        self._stale.add(id(client))
        probe = self._connect(password, primary=True)
        level, verdict = logging.INFO, "the store accepts it"
        try:
            probe.custom_command(["PING"])
        except glide.GlideError as exc:
            level = logging.WARNING
            verdict = f"the store did not accept it ({str(exc).strip()}): reconnections fail until it does"
        finally:
            with contextlib.suppress(glide.GlideError):
                probe.close()
        log.log(level, "remote password changed in %s: %d open clients take it, %d are replaced; %s",
                self.access.password_file, len(clients) - replaced, replaced, verdict)

    def _timeout_ms(self, nbytes: int) -> int:
        bw = self._bw.bytes_per_s or ASSUMED_BYTES_PER_S
        return max(self.timeout_ms, round(TIMEOUT_FACTOR * nbytes / bw * 1000))

    def _call(self, node: str, op: str, fn: Callable[[], T]) -> T:
        """`fn()` on `node` under its breaker; _Unavailable (counted) when the breaker is open or the node
        failed. Other errors (the server's answers) pass through."""
        brk = self._breaker(node)
        if brk.open:
            self.rejected += 1
            self.m.rejected.labels(op).inc()
            raise _Unavailable(f"{node}: its breaker is open")
        try:
            return brk.call(fn)
        except glide.TimeoutError:
            self.timeouts += 1
            self.m.timeouts.labels(op).inc()
            raise _Unavailable(node) from None
        except glide.GlideError as exc:
            if not _node_failure(exc):
                raise  # the server's answer (out of memory, no permission, ...)
            self._error(op, node, exc)
            raise _Unavailable(f"{node}: {str(exc).strip()}") from None  # why, for the logs (a refused handshake)
        except OpenedState:  # opened by another thread since `brk.open` was read
            self.rejected += 1
            self.m.rejected.labels(op).inc()
            raise _Unavailable(node) from None

    def _error(self, op: str, node: str, exc: BaseException) -> None:
        self.errors += 1
        self.m.errors.labels(op).inc()
        log.debug("remote %s on %s failed: %s", op, node, exc)

    def _batch(self, client: Any, fill: Callable[[Any], None], nbytes: int) -> list:
        """A non-atomic batch (pipeline) of the commands `fill(batch)` adds, its timeout sized for `nbytes`;
        per-command errors come back as RequestError values."""
        cluster = self.url.cluster
        batch = glide.ClusterBatch(is_atomic=False) if cluster else glide.Batch(is_atomic=False)
        fill(batch)
        timeout = self._timeout_ms(nbytes)
        options = glide.ClusterBatchOptions(timeout=timeout) if cluster else glide.BatchOptions(timeout=timeout)
        return client.exec(batch, raise_on_error=False, options=options) or []

    def _expiry(self, extra_ms: int = 0) -> glide.ExpirySet | None:
        if not self.ttl_ms:
            return None
        return glide.ExpirySet(glide.ExpiryType.MILLSEC, self.ttl_ms + extra_ms)

    def _learn(self, ns: bytes) -> None:
        with self._lock:
            self._namespaces[ns] = None
            self._namespaces.move_to_end(ns)
            while len(self._namespaces) > NAMESPACES_MAX:
                self._namespaces.popitem(last=False)

    # -- writes ----------------------------------------------------------------------------------

    def prepare(self, meta: ChunkMeta, sources: Sequence) -> Prepared:
        pieces = _pieces(sources, meta.size)
        gen = os.urandom(GEN_BYTES)
        header = gen + encode_header(meta, (piece for part in pieces for piece in part))
        return Prepared(header, [p[0] if len(p) == 1 else b"".join(p) for p in pieces])

    def put(self, meta: ChunkMeta, payload: Any, keep: Callable[[], bool] | None = None) -> bool:
        """Write a chunk (its bytes, or `prepare`'s result) unless the store has it; False when it was there,
        or the write was dropped (breaker open, timeout, server error: counted) or not sent (its node answered
        OOM less than its back-off ago: counted as skipped, "full")."""
        self._learn(meta.ns)
        if self.contains(meta.key):
            return False
        node = self._node_of(meta.key)
        if self._write_paused(node):
            self.skipped += 1
            self.m.skipped_writes.labels("full").inc()
            return False
        prepared = payload if isinstance(payload, Prepared) else self.prepare(meta, [payload])
        client = self._client(resize=True)
        hkey = self._key(meta.ns, meta.key, "h")
        gen = prepared.header[:GEN_BYTES]
        parts = [self._part_key(meta.ns, meta.key, gen, i) for i in range(len(prepared.parts))]
        start = time.perf_counter()
        try:
            if self._call(node, "put", lambda: client.exists([hkey])):
                self._existing(meta)
                return False
            part_expiry = self._expiry(PART_TTL_MARGIN_MS)

            def fill(batch: Any) -> None:
                for k, v in zip(parts, prepared.parts, strict=True):
                    batch.set(k, v, expiry=part_expiry)

            results = self._call(node, "put", lambda: self._batch(client, fill, meta.size))
            if len(results) != len(parts) or any(isinstance(r, Exception) for r in results):
                self._refused(node, next((r for r in results if isinstance(r, Exception)), "short batch"), parts)
                return False
            won = self._put_header(node, client, meta, hkey, prepared.header)
        except _Unavailable:
            return False
        except glide.RequestError as exc:  # the server refused (out of memory, no permission): dropped
            self._refused(node, exc, parts)
            return False
        self._writable(node)
        if not won:  # another node's header went in first: its parts are the chunk's, ours go
            self._unlink(node, parts)
            self._existing(meta)
            return False
        self._bw.add(meta.size, start, time.perf_counter())
        if keep is not None and not keep():  # a clear came meanwhile: take it back
            self._presence.drop(meta, time.monotonic())
            self._delete(meta.ns, meta.key, prepared.header, meta.size)
            return False
        self._presence.add(meta, time.monotonic())
        self.report(Stored(self.name, meta.ns, meta.key, meta.blocks, meta.aliases, meta.size))
        self.written += 1
        self.written_bytes += meta.size
        return True

    def _refused(self, node: str, exc: object, parts: list[str]) -> None:
        """A write the store refused (an error reply; OOM pauses writes to `node`): counted, parts deleted."""
        self._error("put", node, exc)  # type: ignore[arg-type]
        if _full(exc):
            self._filled(node)
        self._unlink(node, parts)

    def _write_paused(self, node: str) -> bool:
        """Whether writes to `node` wait: it answered OOM less than its back-off ago."""
        item = self._full.get(node)
        return item is not None and item[0] > time.monotonic()

    def _filled(self, node: str) -> None:
        """`node` answered OOM: writes to it pause FULL_PAUSE_S[0], doubled (up to FULL_PAUSE_S[1]) each
        time the write after a pause is refused again; reads go on. Logged when a full spell starts."""
        now = time.monotonic()
        with self._lock:
            until, last = self._full.get(node, (0.0, 0.0))
            if until > now:  # another thread's write of the same pause
                return
            pause = min(last * 2, FULL_PAUSE_S[1]) if last else FULL_PAUSE_S[0]
            self._full[node] = (now + pause, pause)
        if not last:
            log.warning("remote node %s is full (OOM: maxmemory reached and its policy evicts nothing): writes to "
                        "it pause %.0f s, then retry with a back-off growing to %.0f s; reads go on", node,
                        FULL_PAUSE_S[0], FULL_PAUSE_S[1])

    def _writable(self, node: str) -> None:
        """A write to `node` went in: if it was full, its writes resume (logged)."""
        if node in self._full:
            with self._lock:
                was = self._full.pop(node, None)
            if was is not None:
                log.info("remote node %s takes writes again", node)

    def _existing(self, meta: ChunkMeta) -> None:
        self.existing += 1
        self.m.existing.inc()
        self._presence.add(meta, time.monotonic())

    def _put_header(self, node: str, client: Any, meta: ChunkMeta, hkey: str, header: bytes) -> bool:
        """SET NX the header and add the chunk as a holder to its alias keys (`_add_holder`), those on the
        chunk's node in its pipeline (a holder names the chunk, whichever writer wins), the others after it
        (best effort: a missing holder only loses that partial match). Whether this header went in; a
        failure of the chunk's node raises."""
        nx, expiry = glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST, self._expiry()
        by_node: dict[str, list[tuple[str, bytes]]] = {node: []}
        for where, items in self._aliases_by_node(meta).items():
            by_node.setdefault(where, []).extend(items)
        append = not self._no_append
        span, at = (3, 1) if append and self.ttl_ms else (1, 0)  # commands per holder added, its APPEND's place
        won = False
        for where, items in by_node.items():
            first = where == node

            def fill(batch: Any, items: list[tuple[str, bytes]] = items, first: bool = first) -> None:
                if first:
                    batch.set(hkey, header, conditional_set=nx, expiry=expiry)
                for k, v in items:
                    self._add_holder(batch, k, v, append)

            try:
                results = self._call(where, "put", lambda fill=fill: self._batch(client, fill, 0))
            except (_Unavailable, glide.RequestError):
                if first:
                    raise
                continue
            if first:
                if results and isinstance(results[0], glide.RequestError):
                    raise results[0]  # the server refused the header (out of memory, no permission)
                won = bool(results) and results[0] is not None
                results = results[1:]
            if not append:
                continue
            lengths = results[at::span]  # each APPEND's reply: the value's new length
            if any(_denied(n) for n in lengths):
                self._append_denied(next(n for n in lengths if _denied(n)))
            grown = [k for (k, _), n in zip(items, lengths, strict=False)
                     if type(n) is int and n > ALIAS_COMPACT_BYTES]
            if grown:
                self._compact(where, client, grown)
        return won

    def _append_denied(self, denied: object) -> None:
        """The store refused APPEND (an ACL without it): aliases are written as before holders, SET NX of the
        first holder (that prefix is lost with it); logged once."""
        if not self._no_append:
            self._no_append = True
            log.warning("remote store %s refused APPEND (%s): a block-prefix alias keeps only its first holder "
                        "(the ACL of docs/remote.md grants it)", self.path, denied)

    def _add_holder(self, batch: Any, key: str, holder: bytes, append: bool) -> None:
        """Queue the commands that add `holder` (ALIAS) at the end of alias key `key`'s value: with a TTL, the
        key made empty with it if missing (so it expires even for a user that may not PEXPIRE), the APPEND,
        the TTL renewed (every holder's write keeps the prefix findable that long); else the APPEND alone.
        Without `append` (the store refused it): SET NX of the holder, the first one kept."""
        if not append:
            batch.set(key, holder, conditional_set=glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                      expiry=self._expiry())
            return
        if self.ttl_ms:
            batch.set(key, b"", conditional_set=glide.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
                      expiry=self._expiry())
        batch.append(key, holder)
        if self.ttl_ms:
            batch.pexpire(key, self.ttl_ms)

    def _compact(self, node: str, client: Any, keys: list[str]) -> None:
        """Rewrite alias keys of `node` grown past ALIAS_COMPACT_BYTES with their newest ALIAS_HOLDERS
        distinct holders (GET, then SET with the TTL: a holder another writer appends in between is lost, a
        partial match less, never a wrong one). Best effort."""
        for key in keys:
            with contextlib.suppress(_Unavailable, glide.RequestError):
                value = self._call(node, "put", lambda key=key: client.get(key))
                if isinstance(value, bytes):
                    kept = b"".join(reversed(_holders(value)))
                    self._call(node, "put", lambda key=key, kept=kept: client.set(key, kept, expiry=self._expiry()))

    def _aliases_by_node(self, meta: ChunkMeta) -> dict[str, list[tuple[str, bytes]]]:
        """The alias keys of `meta` and its holder record in each (the chunk key, the leading blocks), by node."""
        by_node: dict[str, list[tuple[str, bytes]]] = {}
        for j, alias in enumerate(meta.aliases, start=1):
            by_node.setdefault(self._node_of(alias), []).append(
                (self._key(meta.ns, alias, "a"), ALIAS.pack(meta.key, j)))
        return by_node

    def _unlink(self, node: str, keys: list[str]) -> None:
        """Delete keys of one slot, best effort (they expire anyway)."""
        client = self._client()
        with contextlib.suppress(_Unavailable, glide.RequestError):
            self._call(node, "put", lambda: client.unlink(keys))

    def _delete(self, ns: bytes, key: bytes, header: bytes, size: int) -> str | None:
        """Remove a chunk from the store whose header value was `header`: with GET and UNLINK only (the
        commands docs/remote.md's ACL grants; no script), the header if it is still that one (a new writer's
        stays; one written between the GET and the UNLINK, after another delete, goes too: a miss, never
        wrong bytes), and that generation's parts (`size` bytes of them; 0: not known, they expire). None
        when done, else why not (counted in kvtier_remote_delete_failures)."""
        node, client = self._node_of(key), self._client(primary=True)  # a replica's header may be an old one
        hkey = self._key(ns, key, "h")
        keys = [self._part_key(ns, key, header[:GEN_BYTES], i) for i in range(-(-size // PART_BYTES))]
        try:
            if self._call(node, "put", lambda: client.get(hkey)) == header:
                keys.append(hkey)
            if keys:
                self._call(node, "put", lambda: client.unlink(keys))
        except (_Unavailable, glide.RequestError) as exc:
            self.m.delete_failures.inc()
            return str(exc) or "unavailable"
        return None

    # -- reads -----------------------------------------------------------------------------------

    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview], primary: bool = False) -> bool:
        """Read and verify chunk `meta` into `bufs`. With --remote-read-from on replicas, a chunk a replica
        shows missing or damaged is read again from the primary (`primary`), whose verdict is final: a replica
        may lag behind, so nothing is deleted or counted on its word."""
        primary = primary or self.access.read_from == "primary"
        node, client = self._node_of(meta.key), self._client(primary, resize=True)
        hkey = self._key(meta.ns, meta.key, "h")
        start = time.perf_counter()
        known = self._known_gen(meta.key)
        try:
            header: bytes | None | object = _UNREAD
            why: str | None = None
            if known is not None:  # a probe saw the generation: the header comes with the first parts
                header, why = self._read_parts(node, client, meta, known, bufs, hkey)
                if why == _AGAIN or (isinstance(header, bytes) and header[:GEN_BYTES] != known):
                    header, why = _UNREAD, None  # rewritten since, or an overflow that names no value: again
            if header is _UNREAD:
                header = self._call(node, "get", lambda: client.get(hkey))
            if header is None:
                return self._lost(meta, None, "missing") if primary else self.get(meta, bufs, primary=True)
            assert isinstance(header, bytes)
            try:
                stored, fields, checksum = decode_header(header[GEN_BYTES:])
            except CorruptChunk:
                return self._lost(meta, header, "corrupt") if primary else self.get(meta, bufs, primary=True)
            if stored != meta or self._is_bad(meta.key, header):  # not this chunk (a stale lookup), or known bad
                self._presence.drop(meta, time.monotonic())
                return False
            if header[:GEN_BYTES] != known:  # the parts are not read yet
                why = self._read_parts(node, client, meta, header[:GEN_BYTES], bufs, None)[1]
            if why is None and not _verified(bufs, meta.size, fields, checksum):
                why = "corrupt"
        except _Unavailable:
            return False
        except glide.RequestError as exc:  # the server's error reply (LOADING, CLUSTERDOWN, NOPERM, BUSY, ...)
            self._error("get", node, exc)  # the store is unavailable, the chunk not known bad: nothing deleted
            return False
        if why is not None:
            return self._lost(meta, header, why) if primary else self.get(meta, bufs, primary=True)  # type: ignore[arg-type]
        self._remember_gen(meta.key, header)
        self._bw.add(meta.size, start, time.perf_counter())
        self._touch(node, meta, header[:GEN_BYTES])
        return True

    def _touch(self, node: str, meta: ChunkMeta, gen: bytes) -> None:
        """Queue a chunk just read for its TTL back (parts, header, aliases), at most once per REFRESH_FRACTION
        of the TTL: so a chunk read now and then stays and an unread one expires. The maintenance thread
        sends them (`_send_touches`), off the read's path."""
        if not self.ttl_ms or self._no_expire:
            return
        now = time.monotonic()
        ttl, parts = self.ttl_ms, -(-meta.size // PART_BYTES)
        by_node = {node: [*((self._part_key(meta.ns, meta.key, gen, i), ttl + PART_TTL_MARGIN_MS)
                            for i in range(parts)), (self._key(meta.ns, meta.key, "h"), ttl)]}
        for where, items in self._aliases_by_node(meta).items():
            by_node.setdefault(where, []).extend((k, ttl) for k, _ in items)
        with self._lock:
            if self._refreshed.get(meta.key, 0.0) > now:
                return
            if sum(map(len, self._touches.values())) + parts + 1 + len(meta.aliases) > TOUCH_MAX:
                return  # the store is not keeping up: this one waits for a later read
            self._refreshed.pop(meta.key, None)
            self._refreshed[meta.key] = now + ttl / 1000 * REFRESH_FRACTION
            while len(self._refreshed) > REFRESH_MAX:
                self._refreshed.popitem(last=False)
            for where, items in by_node.items():
                self._touches.setdefault(where, []).extend(items)

    def _send_touches(self) -> None:
        """Maintenance thread: PEXPIRE the keys `_touch` queued, a non-atomic batch per node; best effort (a
        node that fails loses its batch). A store that refuses PEXPIRE (an ACL without it) is not asked
        again (logged once)."""
        with self._lock:
            touches, self._touches = self._touches, {}
        client = self._client()
        batches = [(where, items[i : i + TOUCH_BATCH]) for where, items in touches.items()
                   for i in range(0, len(items), TOUCH_BATCH)]
        for where, items in batches:
            def fill(batch: Any, items: list[tuple[str, int]] = items) -> None:
                for k, ms in items:
                    batch.pexpire(k, ms)

            try:
                results = self._call(where, "put", lambda fill=fill: self._batch(client, fill, 0))
            except (_Unavailable, glide.RequestError):
                continue
            denied = next((r for r in results if _denied(r)), None)
            if denied is not None:
                self._no_expire = True
                log.warning("remote store %s refused PEXPIRE (%s): chunks read keep the TTL they were written with "
                            "(the ACL of docs/remote.md grants it)", self.path, denied)
                return

    def _read_parts(self, node: str, client: Any, meta: ChunkMeta, gen: bytes, bufs: Sequence[memoryview],
                    hkey: str | None) -> tuple[bytes | None | object, str | None]:
        """MGET generation `gen`'s parts into `bufs`, `_group_parts()` a command (through a staging buffer
        where a part crosses two buffers), the header `hkey` first in the first one when given (then the parts
        after a missing header or one of another generation are not read). Returns (the header's value, None
        when missing; _UNREAD without `hkey`) and None when every part is there at its size, else why not:
        "missing" (a part), "corrupt" (a wrong size), _AGAIN (a value too large for its buffer in the
        command with the header: which one is not known). The caller verifies the checksum."""
        pieces = _pieces(bufs, meta.size)
        crossing = sum(len(p) > 1 for p in pieces)
        staging = memoryview(bytearray(crossing * PART_BYTES)) if crossing else None
        targets: list[memoryview] = []
        used = 0
        for p in pieces:
            if len(p) == 1:
                targets.append(p[0])
            else:
                n = sum(len(x) for x in p)
                targets.append(staging[used : used + n])  # type: ignore[index]
                used += n
        keys = [self._part_key(meta.ns, meta.key, gen, i) for i in range(len(pieces))]
        header: bytes | None | object = _UNREAD
        group = self._group_parts()
        for g in range(0, len(keys), group):
            names, outs = keys[g : g + group], targets[g : g + group]
            with_header = hkey is not None and g == 0
            if with_header:
                hbuf = memoryview(bytearray(GEN_BYTES + meta.header_len))  # a longer one is not this chunk's
                names, outs = [hkey, *names], [hbuf, *outs]
            try:
                got = self._call(node, "get", lambda names=names, outs=outs: client.mget(names, buffers=outs))
            except glide.RequestError as exc:  # a value larger than its buffer (glide refuses to overflow)
                if _OVERFLOW in str(exc):
                    return header, _AGAIN if with_header else "corrupt"
                raise  # the server's error reply: not the chunk's fault
            if len(got) != len(names):
                raise glide.RequestError(f"MGET of {len(names)} keys answered {len(got)} values")
            if with_header:
                header = None if got[0] is None else bytes(hbuf[: int(got[0])])
                if header is None or header[:GEN_BYTES] != gen:  # type: ignore[index]
                    return header, None
                got, outs = got[1:], outs[1:]
            for n, out in zip(got, outs, strict=True):
                if n is None:
                    return header, "missing"
                if int(n) != len(out):
                    return header, "corrupt"
        for p, target in zip(pieces, targets, strict=True):
            if len(p) > 1:
                off = 0
                for piece in p:
                    piece[:] = target[off : off + len(piece)]
                    off += len(piece)
        return header, None

    def _group_parts(self) -> int:
        """Parts per MGET: GROUP_PARTS, fewer where so many would not fit in the floor of the clients' request
        timeout (`timeout_ms`) with TIMEOUT_FACTOR to spare at the measured bandwidth (an MGET takes no timeout
        of its own, unlike a batch)."""
        part_ms = PART_BYTES / (self._bw.bytes_per_s or ASSUMED_BYTES_PER_S) * 1000
        return max(1, min(GROUP_PARTS, int(self.timeout_ms / (TIMEOUT_FACTOR * part_ms))))

    def _known_gen(self, key: bytes) -> bytes | None:
        """The generation of chunk `key` a probe or a read saw last, if remembered."""
        with self._lock:
            return self._gens.get(key)

    def _remember_gen(self, key: bytes, header: bytes) -> None:
        with self._lock:
            self._gens[key] = header[:GEN_BYTES]
            self._gens.move_to_end(key)
            while len(self._gens) > GENS_MAX:
                self._gens.popitem(last=False)

    def _lost(self, meta: ChunkMeta, header: bytes | None, why: str) -> bool:
        """A chunk that cannot be served: forgotten and, unless that generation was already found bad,
        counted and deleted (its header if still `header`); a generation that stays (its delete failed) is
        ignored for BAD_TTL_S, so it is counted and reported once, not at every probe."""
        self._presence.drop(meta, time.monotonic())
        if header is not None and not self._mark_bad(meta.key, header):
            return False
        self.report(Removed(self.name, meta.ns, meta.key, why))
        if why == "corrupt":
            self.corrupt += 1
            self.m.corrupt.inc()
        else:
            self.missing += 1
            self.m.missing.inc()
        failed = self._delete(meta.ns, meta.key, header, meta.size) if header is not None else None
        if failed is not None:
            log.warning("remote chunk %s is %s: its delete failed (%s); it stays in the store until it expires, "
                        "ignored here for %.0f s", meta.key.hex(), why, failed, BAD_TTL_S)
        elif why == "corrupt":
            log.warning("remote chunk %s is corrupt: removed", meta.key.hex())
        return False

    def _mark_bad(self, key: bytes, header: bytes) -> bool:
        """Remember chunk `key`'s generation in `header` as bad; False if it already was."""
        name, now = key + header[:GEN_BYTES], time.monotonic()
        with self._lock:
            if self._bad.get(name, 0.0) > now:
                return False
            self._bad.pop(name, None)
            self._bad[name] = now + BAD_TTL_S
            while len(self._bad) > BAD_MAX:
                self._bad.popitem(last=False)
        return True

    def _is_bad(self, key: bytes, header: bytes) -> bool:
        with self._lock:
            return self._bad.get(key + header[:GEN_BYTES], 0.0) > time.monotonic()

    # -- lookups ---------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self._presence.get(key, time.monotonic()) not in (_UNKNOWN, None)

    def find_prefix(self, chunks: Sequence[Sequence[bytes]],
                    ns: bytes | None = None) -> list[tuple[ChunkMeta, int]] | None:
        """From the presence cache: the run of `chunks` the store holds, as FsTier.find_prefix; None (pending)
        when the run reaches a chunk it does not know, after starting a probe for the rest of the run.
        `ns`: the lookup's namespace (its keys' names need it); without it, the namespaces this tier saw."""
        now = time.monotonic()
        if ns is not None:
            self._learn(ns)
        with self._lock:
            namespaces = [ns] if ns is not None else list(self._namespaces)
        out: list[tuple[ChunkMeta, int]] = []
        for i, keys in enumerate(chunks):
            found = self._longest(keys, now)
            if found is _UNKNOWN:
                if not namespaces:  # no name for its keys: a miss
                    break
                self._start_probe(namespaces, chunks[i:])
                self.pending += 1
                self.m.pending.inc()
                return None
            if found is None:
                break
            out.append(found)  # type: ignore[arg-type]
            if found[1] < len(keys):  # type: ignore[index]
                break
        return out

    def _longest(self, keys: Sequence[bytes], now: float) -> Found | None | object:
        """The presence cache's longest leading run of a chunk's block keys: a hit, None (known missing, or
        on a node whose breaker is open) or _UNKNOWN (a key before any hit is not known)."""
        for key in reversed(keys):
            found = self._presence.get(key, now)
            if found is _UNKNOWN and self._available(self._node_of(key)):
                return _UNKNOWN
            if found is not _UNKNOWN and found is not None:
                return found
        return None

    def _start_probe(self, namespaces: list[bytes], chunks: Sequence[Sequence[bytes]]) -> None:
        first = chunks[0][-1]
        with self._lock:
            if first in self._probing:
                return
            self._probing.add(first)
        snapshot = [list(keys) for keys in chunks]
        try:
            self._jobs.put_nowait(lambda: self._probe(namespaces, snapshot))
        except queue.Full:
            with self._lock:
                self._probing.discard(first)

    def _probe(self, namespaces: list[bytes], chunks: list[list[bytes]]) -> None:
        """Probe thread: ask the store about the keys that decide the run, a round at a time."""
        try:
            for _ in range(PROBE_ROUNDS):
                keys = self._undecided(chunks)
                if not keys:
                    return
                self._fetch(namespaces, keys)
        finally:
            with self._lock:
                self._probing.discard(chunks[0][-1])

    def _undecided(self, chunks: list[list[bytes]]) -> list[bytes]:
        """The keys whose answers decide the run next: at the first chunk not known, every unknown last key
        from there on (its header, or its own alias); if its last key is known missing, its unknown aliases."""
        now = time.monotonic()
        for i, keys in enumerate(chunks):
            found = self._longest(keys, now)
            if found is _UNKNOWN:
                if self._presence.get(keys[-1], now) is _UNKNOWN:
                    rest = (k[-1] for k in chunks[i:])
                    return [k for k in rest if self._presence.get(k, now) is _UNKNOWN][:PROBE_MAX_KEYS]
                return [k for k in keys if self._presence.get(k, now) is _UNKNOWN][:PROBE_MAX_KEYS]
            if found is None or found[1] < len(keys):  # type: ignore[index]
                return []
        return []

    def _fetch(self, namespaces: list[bytes], keys: list[bytes]) -> None:
        """GET the header and alias keys of `keys` (each namespace's), one pipeline per node; record what
        was found, then the chunks that aliases point to; anything unanswered counts as missing."""
        now = time.monotonic()
        headers, pointers = self._get_many([(ns, k, suffix) for ns in namespaces for k in keys for suffix in "ha"])
        found: dict[bytes, Found] = {}
        for (ns, key, _), value in headers.items():
            meta = self._decode(ns, key, value)
            if meta is not None:
                self._remember_gen(key, value)
                self._presence.add(meta, now)
                found[key] = (meta, meta.blocks)
        wanted: dict[bytes, list[tuple[bytes, bytes, int]]] = {}  # alias -> its holders, newest first
        for (ns, key, _), value in pointers.items():
            if key not in found:
                wanted.setdefault(key, []).extend((ns, *ALIAS.unpack(record)) for record in _holders(value))
        if wanted:
            chunks = dict.fromkeys((ns, chunk) for holders in wanted.values() for ns, chunk, _ in holders)
            targets, _ = self._get_many([(ns, chunk, "h") for ns, chunk in chunks])
            metas: dict[tuple[bytes, bytes], ChunkMeta] = {}
            for ns, chunk in chunks:
                value = targets.get((ns, chunk, "h"))
                meta = self._decode(ns, chunk, value) if value is not None else None
                if meta is not None:
                    self._remember_gen(chunk, value)  # type: ignore[arg-type]
                    self._presence.add(meta, now)
                    metas[ns, chunk] = meta
            for key, holders in wanted.items():  # the newest holder still there that holds this prefix
                for ns, chunk, lead in holders:
                    meta = metas.get((ns, chunk))
                    if meta is not None and 0 < lead <= len(meta.aliases) and meta.aliases[lead - 1] == key:
                        found[key] = (meta, lead)
                        break
        for key, hit in found.items():
            self._presence.found(key, hit, now)
        self._presence.missing([k for k in keys if k not in found and self._presence.get(k, now) is _UNKNOWN], now)

    def _get_many(self, items: list[tuple[bytes, bytes, str]]) -> tuple[dict, dict]:
        """GET (namespace, key, "h" or "a") items with MGET: (the header values, the alias values) found, by
        item. On a Cluster, one MGET covers every node whose breaker is closed (glide splits it by slot and
        asks the masters at once); if it fails, one per node, each under that node's breaker. A node that
        fails or is unavailable answers nothing. MGET, not a batch: after a batch to a stalled master timed
        out, glide-sync 2.6 timed out later batches to healthy masters too, plain commands not
        (docs/performance.md)."""
        by_node: dict[str, list[tuple[bytes, bytes, str]]] = {}
        for item in items:
            by_node.setdefault(self._node_of(item[1]), []).append(item)
        values: dict = {}
        client = self._client()
        live = [node for node in by_node if self._available(node)]
        if len(live) > 1:
            together = [item for node in live for item in by_node[node]]
            with contextlib.suppress(glide.GlideError):  # then node by node: each failure to its own breaker
                values.update(zip(together, client.mget([self._key(*item) for item in together]), strict=True))
                by_node = {node: its for node, its in by_node.items() if node not in live}
        for node, node_items in by_node.items():
            names = [self._key(*item) for item in node_items]
            try:
                values.update(zip(node_items, self._call(node, "probe", lambda names=names: client.mget(names)),
                                  strict=True))
            except (_Unavailable, glide.RequestError) as exc:
                if isinstance(exc, glide.RequestError):
                    self._error("probe", node, exc)
        headers: dict = {}
        aliases: dict = {}
        for item, value in values.items():
            if isinstance(value, bytes):
                (headers if item[2] == "h" else aliases)[item] = value
        return headers, aliases

    def _decode(self, ns: bytes, key: bytes, value: bytes) -> ChunkMeta | None:
        """The record of a header value read by a probe; None if it is a generation found bad before, or
        corrupt or not that chunk's (then counted once and deleted)."""
        if self._is_bad(key, value):
            return None
        try:
            meta = decode_header(value[GEN_BYTES:])[0]
        except CorruptChunk:
            meta = None
        if meta is None or meta.key != key or meta.ns != ns:
            self._mark_bad(key, value)
            self.report(Removed(self.name, ns, key, "corrupt"))
            self.corrupt += 1
            self.m.corrupt.inc()
            failed = self._delete(ns, key, value, meta.size if meta is not None else 0)
            log.warning("remote chunk %s has a corrupt header: %s", key.hex(),
                        "removed" if failed is None else f"its delete failed ({failed}); ignored here for "
                        f"{BAD_TTL_S:.0f} s")
            return None
        return meta

    def remove(self, key: bytes, reason: str = "removed") -> bool:
        """Forget chunk `key` and delete it from the store on the probe thread (if its record is known)."""
        found = self._presence.get(key, time.monotonic())
        if found is _UNKNOWN or found is None or found[0].key != key:  # type: ignore[index]
            return False
        meta = found[0]  # type: ignore[index]
        self._presence.drop(meta, time.monotonic())
        self.report(Removed(self.name, meta.ns, key, reason))

        def delete() -> None:
            node, client = self._node_of(key), self._client(primary=True)
            try:
                header = self._call(node, "put", lambda: client.get(self._key(meta.ns, key, "h")))
            except (_Unavailable, glide.RequestError):
                return
            if header is not None:
                self._delete(meta.ns, key, header, meta.size)

        with contextlib.suppress(queue.Full):  # else it expires
            self._jobs.put_nowait(delete)
        return True

    # -- clear, scan, lifecycle --------------------------------------------------------------------

    def clear(self, ns: bytes | None = None) -> Cleared:
        """SCAN MATCH this prefix's keys (of `ns`) on every master and UNLINK them. `entries` counts chunk
        headers removed; `nbytes` is 0 (sizes are not read); `failed` counts headers not removed, plus one
        when the scan itself stopped early (then more may be left: they expire)."""
        self._presence.forget(ns)
        pattern = f"{self.prefix}:{ns.hex()}:*" if ns is not None else f"{self.prefix}:*"
        client = self._client()
        removed = failed = 0
        try:
            for keys in self._scan(client, pattern):
                headers = sum(k.endswith(b":h") for k in keys)
                try:
                    client.unlink(keys)
                    removed += headers
                except glide.GlideError as exc:
                    failed += headers
                    log.warning("remote clear: UNLINK of %d keys failed: %s", len(keys), exc)
        except glide.GlideError as exc:
            failed += 1
            log.warning("remote clear of %s stopped early: %s", pattern, exc)
        self._presence.forget(ns)  # what probes recorded while the keys went
        self.report(ClearedEvent(self.name, ns))
        return Cleared(removed, 0, failed)

    def _scan(self, client: Any, pattern: str) -> Iterable[list[bytes]]:
        if self.url.cluster:
            cursor = glide.ClusterScanCursor()
            while not cursor.is_finished():
                cursor, keys = client.scan(cursor, match=pattern, count=SCAN_COUNT)
                if keys:
                    yield keys
            return
        cursor = b"0"
        while True:
            cursor, keys = client.scan(cursor, match=pattern, count=SCAN_COUNT)
            if keys:
                yield keys
            if cursor in (b"0", "0"):
                return

    def scan(self) -> int:
        """Nothing to rebuild (the store is remote): map the Cluster's slots, measure the RTT and seed the
        bandwidth with one part's SET and GET of a probe key, read INFO (warn of a store that cannot evict).
        Returns 0."""
        self._refresh()
        self._warn_unbounded()
        tag = os.urandom(16)
        node, client = self._node_of(tag), self._client(primary=True)  # its GET follows its SET at once
        probe_key = f"{self.prefix}:probe:{{{tag.hex()}}}"
        data, back = os.urandom(PART_BYTES), memoryview(bytearray(PART_BYTES))
        try:
            t0 = time.perf_counter()
            self._call(node, "put", lambda: client.set(probe_key, data, expiry=glide.ExpirySet(
                glide.ExpiryType.MILLSEC, 60_000)))
            t1 = time.perf_counter()
            self._call(node, "get", lambda: client.get(probe_key, buffer=back))
            t2 = time.perf_counter()
            self._call(node, "put", lambda: client.unlink([probe_key]))
        except (_Unavailable, glide.RequestError) as exc:
            if _full(exc):  # it answered: full (logged), writes pause
                self._filled(node)
                return 0
            log.warning("remote store %s did not answer at start-up (%s): lookups miss and writes drop until "
                        "it does%s", self.path, str(exc).strip() or "unavailable", _TLS_HINT if self.url.tls else "")
            return 0
        self._bw.add(PART_BYTES, t0, t1)
        self._bw.add(PART_BYTES, t1, t2)
        log.info("remote store %s: RTT %.2f ms, 1 MiB SET %.0f MB/s, GET %.0f MB/s", self.path, self._rtt * 1e3,
                 PART_BYTES / (t1 - t0) / 1e6, PART_BYTES / (t2 - t1) / 1e6)
        return 0

    def _warn_unbounded(self) -> None:
        """One WARNING line when a master's INFO memory shows a store that does not evict: no maxmemory (it
        grows until its host runs out), noeviction (full, it refuses writes), or volatile-* with no TTL."""
        unbounded = [n for n, (mem, _) in sorted(self._limits.items()) if not mem]
        stuck = [n for n, (mem, policy) in sorted(self._limits.items()) if mem and (
            policy == "noeviction" or (policy.startswith("volatile") and not self.ttl_ms))]
        why = ([f"no maxmemory on {', '.join(unbounded)}: it grows until the host runs out of memory "
                "(chunks go only by --remote-ttl-s)"] if unbounded else []) + (
               [f"maxmemory-policy evicts no kvtier chunk on {', '.join(stuck)}: once full it refuses writes "
                "(they pause with a back-off) until chunks expire"] if stuck else [])
        if why:
            log.warning("remote store %s: %s; set maxmemory and allkeys-lru (docs/remote.md)", self.path,
                        "; ".join(why))

    def _masters(self) -> list[str]:
        return sorted(set(self._slot_nodes))

    def _on_node(self, client: Any, node: str, args: list[str]) -> Any:
        """A command run on one node (a Cluster's master by address)."""
        if not self.url.cluster:
            return client.custom_command(args)
        host, _, port = node.rpartition(":")
        return client.custom_command(args, route=glide.ByAddressRoute(host.strip("[]"), int(port)))

    def _refresh(self) -> None:
        """The Cluster slot map, the RTT (PING) and INFO memory of every master whose breaker is closed."""
        client = self._client()
        if self.url.cluster:
            try:
                self._map_slots(client.custom_command(["CLUSTER", "SLOTS"], route=glide.RandomNode()))
            except glide.GlideError as exc:
                log.debug("remote CLUSTER SLOTS failed: %s", exc)
        used = capacity = 0
        rtts = []
        for node in self._masters():
            if not self._available(node):
                continue
            try:  # an untimed PING first: the first call on a connection includes its setup
                self._call(node, "probe", lambda node=node: self._on_node(client, node, ["PING"]))
                t0 = time.perf_counter()
                self._call(node, "probe", lambda node=node: self._on_node(client, node, ["PING"]))
                rtts.append(time.perf_counter() - t0)
                info = self._call(node, "probe", lambda node=node: self._on_node(client, node, ["INFO", "memory"]))
            except (_Unavailable, glide.RequestError):
                continue
            fields = dict(line.split(":", 1) for line in _text(info).splitlines() if ":" in line)
            used += int(fields.get("used_memory", 0))
            capacity += int(fields.get("maxmemory", 0))
            self._limits[node] = (int(fields.get("maxmemory", 0)), fields.get("maxmemory_policy", ""))
        if rtts:
            self._rtt = sorted(rtts)[len(rtts) // 2]
            self._used, self._capacity = used, capacity

    def _map_slots(self, reply: Any) -> None:
        ranges = []
        for item in reply or []:
            start, _end, master = item[0], item[1], item[2]
            host = _text(master[0]) or self.url.nodes[0][0]
            ranges.append((int(start), self._node_name(host, int(master[1]))))
        if ranges:
            ranges.sort()
            self._slot_starts = [s for s, _ in ranges]
            self._slot_nodes = [n for _, n in ranges]
            self._drop_departed()

    def _drop_departed(self) -> None:
        """Forget the breakers (and their gauges) of nodes no longer in the slot map (failed over, moved to
        a new address): they are never pinged again and no longer make the tier degraded."""
        masters = set(self._slot_nodes)
        with self._lock:
            gone = [node for node in self._breakers if node not in masters]
            for node in gone:
                del self._breakers[node]
                self.m.breaker_open.remove(node)
        for node in gone:
            log.info("remote node %s left the slot map: its breaker is dropped", node)

    def _run_jobs(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=TICK_S)
            except queue.Empty:
                continue
            if job is None:
                return
            try:
                job()
            except Exception:  # the thread must survive any one job
                log.exception("remote probe failed")

    def _run_maintenance(self) -> None:
        """PING the nodes of open breakers once their reset time passed (an answer closes them); every
        INFO_REFRESH_S, refresh the slot map, the RTT and INFO; every PASSWORD_CHECK_S, read the password file."""
        last = checked = time.monotonic()
        while not self._stop.wait(TICK_S):
            if self._touches:
                try:
                    self._send_touches()
                except Exception:
                    log.exception("remote TTL refresh failed")
            if self.access.password_file and time.monotonic() - checked >= PASSWORD_CHECK_S:
                checked = time.monotonic()
                try:
                    self._reload_password()
                except Exception:  # the thread must survive it
                    log.exception("remote password reload failed")
            for node, brk in list(self._breakers.items()):
                if brk.open:
                    self._ping(node, brk)
            if time.monotonic() - last >= INFO_REFRESH_S:
                last = time.monotonic()
                try:
                    self._refresh()
                except Exception:
                    log.exception("remote refresh failed")

    def _ping(self, node: str, brk: _Breaker) -> None:
        client = self._client()
        try:
            brk.call(lambda: self._on_node(client, node, ["PING"]))
        except Exception:  # still open (OpenedState until its reset time), or failed again
            return
        log.info("remote node %s answers again: its breaker closed", node)

    def close(self) -> None:
        """Stop the probe and maintenance threads and close every client."""
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._jobs.put_nowait(None)
        for t in self._threads:
            t.join(2.0)
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(glide.GlideError):
                client.close()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
