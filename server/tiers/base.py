"""The `LowerTier` contract: a chunk store below L1 (the filesystem tier, fs.py; the remote tier, remote/),
keyed by chunk key, whose values are records (record.py: `ChunkMeta` and the payload bytes).

Threads. Each method is called from one kind of thread, and several at once:

* the serving loop (one thread, the asyncio loop): `find_prefix`, `contains`, `remove`, and the accounting
  properties (`used_bytes`, `capacity_bytes`, `entries`) and `health` for status and metrics;
* the write-behind threads (server/tiers/writer.py: one prepare stage, several I/O threads): `prepare`,
  `put`, `sync`;
* the promotion threads (several): `get`;
* a worker thread (`asyncio.to_thread`, an admin cache clear): `clear`;
* before serving, on the starting thread: `scan`.

So every implementation must be thread-safe accordingly: its index may change under a lookup (puts land,
promotions drop corrupt chunks, a clear runs), and the loop's calls must never block on I/O: `find_prefix`
and `contains` answer from memory; an asynchronous tier answers "not known yet" (`None`) rather than wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.server.events import Event, Stored
from kvtier.server.index import IndexObserver
from kvtier.server.keys import Namespace
from kvtier.server.metrics import TierMetrics
from kvtier.server.tiers.record import ChunkMeta


@dataclass(frozen=True)
class Cleared:
    """What a clear did: the chunks and file bytes it removed, and `failed`, the files it could not remove
    (a directory in a chunk file's place). The index forgot those too, and a start-up scan never indexes
    what is not a regular file, so none of them is served again."""

    entries: int
    nbytes: int
    failed: int = 0


class LowerTier(ABC):
    """A chunk store below L1, keyed by chunk key; values are (metadata, payload bytes)."""

    name: str  # the tier's label in lookups' replies, status and metrics ("l2")
    m: TierMetrics  # its metrics (kvtier_<name>_*), set by the factory that makes it (registry.py)

    def prepare(self, meta: ChunkMeta, sources: Sequence):  # noqa: ANN201 - whatever `put` takes
        """Writer thread: do the CPU work of a put of a chunk held in `sources` (its buffers, in order; they
        stay valid until the put returns) that can overlap earlier puts' I/O; the result is passed to `put`.
        Default: the bytes joined."""
        del meta
        return b"".join(sources)

    @abstractmethod
    def put(self, meta: ChunkMeta, payload, keep: Callable[[], bool] | None = None) -> bool:
        """Writer thread: store a chunk (False when it exists or cannot fit). May evict older chunks. `keep`,
        when given, is asked once the chunk is stored and before any lookup can find it: False drops it
        again."""

    @abstractmethod
    def get(self, meta: ChunkMeta, bufs: Sequence[memoryview]) -> bool:
        """Promotion thread: read a chunk's verified payload into `bufs`; False (and the chunk dropped) if
        missing or corrupt."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Serving loop, non-blocking: whether the tier holds chunk `key` (as far as it knows now)."""

    @abstractmethod
    def find_prefix(self, chunks: Sequence[Sequence[bytes]],
                    ns: bytes | None = None) -> list[tuple[ChunkMeta, int]] | None:
        """Serving loop, non-blocking (from memory, no I/O): the longest run of consecutive `chunks` (each
        the list of its block-prefix keys, as in a lookup) this tier holds, from the first one, each as (the
        stored chunk holding the longest leading run of its keys, that run's length). The run stops at the
        first chunk not held and after the first partial match (a length under len(chunk)). Records of
        any namespace are returned: the caller checks `meta.ns`.

        `ns`: the lookup's namespace fingerprint (a tier whose stored names carry it needs it to ask).

        None means "not known yet" (an asynchronous tier still asking its server): the caller treats it as
        no hit now."""

    @abstractmethod
    def remove(self, key: bytes, reason: str = "removed") -> bool:
        """Serving loop: forget chunk `key` and delete its copy; whether it was held."""

    @abstractmethod
    def clear(self, ns: bytes | None = None) -> Cleared:
        """Worker thread: remove every chunk, or those of namespace fingerprint `ns`, going on past what
        cannot be removed; none of them is found again, removed or not."""

    @abstractmethod
    def scan(self) -> int:
        """Before serving: rebuild the index from what the tier holds; returns the chunks found."""

    def report(self, event: Event) -> None:  # noqa: B027 - the cache replaces it with its bus's `post`
        """Any thread, non-blocking: tell what the tier stored (`Stored`), removed (`Removed`, with the reason)
        or cleared (`Cleared`) (server/events.py), after it took effect."""

    def held(self) -> list[Stored]:
        """Any thread: every chunk the tier holds now, for a snapshot of the event feed. Default: none listed
        (a tier shared by nodes does not list the store)."""
        return []

    def stats(self) -> dict:
        """Serving loop: the tier's own facts for the `stats` op and /status, beyond what AttachedTier reports
        for every tier; keys prefixed with its name ("remote_url"). Default: none."""
        return {}

    def know_namespaces(self, lookup: Callable[[bytes], Namespace | None]) -> None:  # noqa: B027 - optional hook
        """Before the scan: how the tier finds a registered namespace by its fingerprint (any thread; None:
        not registered), e.g. to count a chunk to its tenant. Default: not needed."""

    def observe_index(self, observer: IndexObserver | None) -> bool:
        """Before the scan: tell `observer` (the tier's region of the presence filter, shm/presence.py) of every
        block key as `find_prefix` starts and stops finding it (None: stop). True only for a tier whose
        `find_prefix` answers from that local index alone; the default, False, makes the filter not
        authoritative (a remote tier finds what other nodes wrote): clients then ask the server every time."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """At shutdown, after the writer stopped: stop the tier's own threads, close its connections."""

    def sync(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Writer thread: make completed puts durable (no-op where puts are durable already)."""

    # Whether a tier that cannot take writes makes the server unready (/healthz 503). A shared network tier
    # does not: an outage of it leaves the node serving from L1 and L2, and is reported as degraded.
    required_for_readiness = True
    rtt_s = 0.0  # a network tier's measured round trip, seconds (sent in lookup replies); 0.0: none or unknown

    def health(self) -> tuple[bool, str]:
        """(ok, why not): whether the tier can take writes now. Default: always."""
        return True, ""

    # What the tier holds and may hold, in bytes: kept current by the tier in `_used` and `_capacity`.
    _used = 0
    _capacity = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    @abstractmethod
    def entries(self) -> int: ...
