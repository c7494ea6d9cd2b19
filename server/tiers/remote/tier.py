"""The remote tier itself (`RemoteTier`): its state, accounting, health, clear, start-up and close; the
rest of it is one mixin per job (nodes.py, writes.py, reads.py, lookups.py, maintenance.py), and
`make_tier` builds it from its options (the registry's factory, server/tiers/registry.py)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import glide_sync as glide
from kvtier.server.events import Cleared as ClearedEvent
from kvtier.server.keys import Namespace
from kvtier.server.metrics import Metrics
from kvtier.server.tiers.bandwidth import BandwidthMeter
from kvtier.server.tiers.base import Cleared, LowerTier
from kvtier.server.tiers.networked.breaker import Breaker, Breakers
from kvtier.server.tiers.networked.presence import Presence
from kvtier.server.tiers.networked.prober import Prober
from kvtier.server.tiers.remote.layout import PART_BYTES, key_name, part_key_name
from kvtier.server.tiers.remote.lookups import Lookups
from kvtier.server.tiers.remote.maintenance import Maintenance
from kvtier.server.tiers.remote.metrics import RemoteMetrics
from kvtier.server.tiers.remote.nodes import TLS_HINT, Nodes, Unavailable, denied, full, node_failure
from kvtier.server.tiers.remote.options import RemoteAccess, RemoteOptions, RemoteUrl, parse_remote_url
from kvtier.server.tiers.remote.reads import Reads
from kvtier.server.tiers.remote.tenancy import Tenancy
from kvtier.server.tiers.remote.writes import Writes

log = logging.getLogger("kvtier.server.remote")

SCAN_COUNT = 1000


def make_tier(options: RemoteOptions, metrics: Metrics) -> RemoteTier:
    """The registry's factory: the tier `options` describe, counting into `metrics` (kvtier_remote_*)."""
    return RemoteTier(options.url, options.prefix, options.ttl_s, options.timeout_ms, options.breaker_threshold,
                      options.breaker_reset_s, RemoteMetrics(metrics), connect_timeout_ms=options.connect_timeout_ms,
                      access=options.access, tenancy=Tenancy(options.prefix, options.tenants))


class RemoteTier(Nodes, Writes, Reads, Lookups, Maintenance, LowerTier):
    """See the package docstring. `url` is a --remote-url; `timeout_ms` the floor of every call's timeout."""

    name = "remote"
    required_for_readiness = False  # an outage of the shared store leaves this node serving L1 and L2

    def __init__(self, url: str, prefix: str = "kvtier", ttl_s: float = 86400.0, timeout_ms: int = 200,
                 breaker_threshold: int = 5, breaker_reset_s: float = 5.0,
                 metrics: RemoteMetrics | None = None, connect_timeout_ms: int = 1000,
                 access: RemoteAccess | None = None, tenancy: Tenancy | None = None) -> None:
        self.url: RemoteUrl = parse_remote_url(url)
        self.access = access if access is not None else RemoteAccess()
        self.access.validate(self.url)
        self._ca = Path(self.access.tls_ca_file).read_bytes() if self.access.tls_ca_file else None
        self._password = self._read_password() if self.access.password_file else self.url.password
        self._stale: set[int] = set()  # ids of clients to replace (a new password they could not take)
        self._password_error = ""  # the last reason the password file could not be read (logged once)
        self.path = self.url.redacted()  # where the tier is, for logs and status (no password)
        self.prefix = prefix
        self.tenancy = tenancy if tenancy is not None else Tenancy(prefix)  # which base a namespace's keys have
        self.ttl_ms = round(ttl_s * 1000)
        self.timeout_ms = timeout_ms
        self.connect_timeout_ms = connect_timeout_ms  # floor of a connection's setup (a cold TLS one: several RTTs)
        self.m = metrics if metrics is not None else RemoteMetrics(Metrics())
        glide.Logger.init(glide.LogLevel.ERROR)  # not glide's per-timeout warnings (counted here instead)
        self._breakers = Breakers(breaker_threshold, breaker_reset_s, node_failure, on_new=self._gauge_breaker,
                                  on_drop=self.m.breaker_open.remove)
        self._lock = threading.Lock()
        self._local = threading.local()  # one client per thread: its own connections, calls in parallel
        self._clients: list[Any] = []
        self._presence = Presence()
        self._namespaces: OrderedDict[bytes, None] = OrderedDict()  # for lookups that do not name theirs
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
        self._prober = Prober(self.name)
        self._threads = [threading.Thread(target=self._run_maintenance, name="kvtier-remote-maint", daemon=True)]
        self._threads[0].start()
        self._threads.append(self._prober.thread)

    def know_namespaces(self, lookup: Callable[[bytes], Namespace | None]) -> None:
        """A namespace's tenant, hence its keys' base, comes from its cache salt (tenancy.py)."""
        self.tenancy.lookup = lookup

    def _gauge_breaker(self, node: str, brk: Breaker) -> None:
        self.m.breaker_open.labels(node).set_function(lambda: float(brk.open))

    def _key(self, ns: bytes, key: bytes, suffix: str) -> str:
        return key_name(self.tenancy.base(ns), ns, key, suffix)

    def _part_key(self, ns: bytes, key: bytes, gen: bytes, i: int) -> str:
        return part_key_name(self.tenancy.base(ns), ns, key, gen, i)

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
        return [node for node in self._masters() if self._breakers.is_open(node)]

    def clear(self, ns: bytes | None = None) -> Cleared:
        """SCAN MATCH this prefix's keys (of `ns`; each tenant's base: tenancy.py) on every master and UNLINK
        them. `entries` counts chunk headers removed; `nbytes` is 0 (sizes are not read); `failed` counts
        headers not removed (e.g. another tenant's that this user may not touch), plus one per scan that
        stopped early (then more may be left: they expire)."""
        self._presence.forget(ns)
        client = self._client()
        removed = failed = 0
        for pattern in self.tenancy.clear_patterns(ns):
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
        data, back = os.urandom(PART_BYTES), memoryview(bytearray(PART_BYTES))
        for base in self.tenancy.bases():  # the first base this user may write (an ACL limited to a tenant's)
            probe_key = f"{base}:probe:{{{tag.hex()}}}"
            try:
                t0 = time.perf_counter()
                self._call(node, "put", lambda k=probe_key: client.set(k, data, expiry=glide.ExpirySet(
                    glide.ExpiryType.MILLSEC, 60_000)))
                t1 = time.perf_counter()
                self._call(node, "get", lambda k=probe_key: client.get(k, buffer=back))
                t2 = time.perf_counter()
                self._call(node, "put", lambda k=probe_key: client.unlink([k]))
                break
            except (Unavailable, glide.RequestError) as exc:
                if denied(exc) and base != self.tenancy.prefix:
                    continue  # not this tenant's user: the next base
                if full(exc):  # it answered: full (logged), writes pause
                    self._filled(node)
                    return 0
                log.warning("remote store %s did not answer at start-up (%s): lookups miss and writes drop until "
                            "it does%s", self.path, str(exc).strip() or "unavailable", TLS_HINT if self.url.tls else "")
                return 0
        self._bw.add(PART_BYTES, t0, t1)
        self._bw.add(PART_BYTES, t1, t2)
        log.info("remote store %s: RTT %.2f ms, 1 MiB SET %.0f MB/s, GET %.0f MB/s", self.path, self._rtt * 1e3,
                 PART_BYTES / (t1 - t0) / 1e6, PART_BYTES / (t2 - t1) / 1e6)
        return 0

    def close(self) -> None:
        """Stop the probe and maintenance threads and close every client."""
        self._stop.set()
        self._prober.close()
        self._threads[0].join(2.0)
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            with contextlib.suppress(glide.GlideError):
                client.close()

