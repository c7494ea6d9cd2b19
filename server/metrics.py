"""Prometheus metrics of one server instance (its own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvtier.server.protocol import (
    HINT_IGNORED_REASONS,
    RETAINED,
    SKIP_REASONS,
    TENANT_GUARANTEE,
    TENANT_MAX,
    UNDELIVERED_REASONS,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

L1 = "l1"  # the memory tier's label; lower tiers label their metrics with their `name`
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BYTES_BUCKETS = tuple(float(2**p) for p in range(12, 32, 2))
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests(self.registry)
        self._traffic(self.registry)
        self._state(self.registry)
        self._timings_and_info(self.registry)
        self._precreate()

    def _requests(self, r: CollectorRegistry) -> None:
        self.requests = Counter("kvtier_requests", "Protocol requests handled, by operation", ["op"], registry=r)
        self.request_errors = Counter(
            "kvtier_request_errors", "Requests answered with an error, by error code", ["code"], registry=r
        )
        self.malformed = Counter("kvtier_malformed_requests", "Frames that could not be parsed as a request", registry=r)
        self.lookups = Counter("kvtier_lookups", "Lookup requests", registry=r)
        self.requested_blocks = Counter(
            "kvtier_lookup_requested_blocks", "Engine blocks asked for by lookups", registry=r
        )
        self.requested_tokens = Counter("kvtier_requested_tokens", "Prompt tokens asked for by lookups", registry=r)
        self.hit_tokens = Counter("kvtier_hit_tokens", "Prompt tokens found by lookups, by tier", ["tier"], registry=r)
        # reported by connectors (the `report` op)
        self.identity_skips = Counter(
            "kvtier_identity_skips", "Requests a connector neither looked up nor stored because a fact of their "
            "identity could not be established, by reason", ["reason"], registry=r,
        )
        self.undelivered_tokens = Counter(
            "kvtier_undelivered_tokens", "Prompt tokens a lookup promised that the load did not deliver (the engine "
            "recomputed them), by reason", ["reason"], registry=r,
        )
        self.hints_ignored = Counter(
            "kvtier_hints_ignored", "Request hints a connector ignored (a bad or unknown field), by field",
            ["reason"], registry=r,
        )
        self.verify_checks = Counter(
            "kvtier_verify_checks", "Sampled hits recomputed by the engine and compared with what kvtier holds, by "
            "namespace fingerprint", ["namespace"], registry=r,
        )
        self.verify_mismatches = Counter(
            "kvtier_verify_mismatches", "Sampled hits whose recomputed KV differed from what kvtier holds (an "
            "identity mistake: kvtier would have served wrong KV), by namespace fingerprint", ["namespace"],
            registry=r,
        )

    def _traffic(self, r: CollectorRegistry) -> None:
        self.stores = Counter("kvtier_stores", "Chunks committed", registry=r)
        self.store_bytes = Counter("kvtier_store_bytes", "Bytes committed to L1", registry=r)
        self.store_skipped = Counter(
            "kvtier_store_skipped", "Store items not reserved because the chunk exists or is being written",
            ["reason"], registry=r,
        )
        self.refused = Counter("kvtier_refused_stores", "Store items refused, by reason", ["reason"], registry=r)
        self.retrieves = Counter("kvtier_retrieves", "Chunks acquired for reading", registry=r)
        self.retrieve_bytes = Counter("kvtier_retrieve_bytes", "Bytes of chunks acquired for reading", registry=r)
        self.evictions = Counter("kvtier_evictions", "Chunks evicted, by tier and reason", ["tier", "reason"], registry=r)

    def _state(self, r: CollectorRegistry) -> None:
        self.leases_expired = Counter("kvtier_leases_expired", "Read leases lapsed by TTL or client loss (reads reported lost)", registry=r)
        self.reservations_expired = Counter(
            "kvtier_reservations_expired", "Write reservations lapsed by TTL or client loss (never committed)", registry=r
        )
        self.clients_lost = Counter(
            "kvtier_clients_lost", "Clients unregistered: silent past the client timeout, or their lock file dead",
            registry=r,
        )
        self.held_back_bytes = Gauge(
            "kvtier_held_back_bytes", "L1 bytes of lapsed reservations and leases, kept from reuse until their "
            "client settles them or is known dead", registry=r,
        )
        self.l1_capacity = Gauge("kvtier_l1_capacity_bytes", "L1 pool capacity", registry=r)
        self.l1_used = Gauge("kvtier_l1_used_bytes", "L1 bytes in use (committed, reserved and doomed pages)", registry=r)
        self.entries = Gauge("kvtier_entries", "Chunks stored, by tier", ["tier"], registry=r)
        self.pinned_bytes = Gauge("kvtier_pinned_bytes", "L1 bytes of pinned chunks", registry=r)
        self.kept_bytes = Gauge("kvtier_kept_bytes", "L1 bytes of chunks kept by request hints (retain_s, live "
                                "sessions; docs/hints.md)", registry=r)
        self.hint_sessions = Gauge("kvtier_hint_sessions", "Live sessions named by request hints", registry=r)
        self.hint_sessions_refused = Counter(
            "kvtier_hint_sessions_refused", "Stores naming a new session beyond --hint-max-sessions (stored, not "
            "kept)", registry=r)
        self.clients = Gauge("kvtier_clients_connected", "Registered clients", registry=r)
        self.l1_adopted = Gauge("kvtier_l1_adopted_chunks", "Chunks adopted at start from the L1 the previous "
                                "server left (warm restart)", registry=r)
        self.l1_quarantined = Gauge(
            "kvtier_l1_quarantined_bytes", "L1 bytes of an adopted L1 that the previous server's writers may "
            "still touch, kept from reuse until the client writing them settles or exits (--reservation-ttl-s after the "
            "start for pages no client writes)", registry=r,
        )
        self.l1_journal_bytes = Gauge("kvtier_l1_journal_bytes", "Bytes of the L1 journal's log (snapshot and "
                                      "records since)", registry=r)
        self.l1_journal_compactions = Counter("kvtier_l1_journal_compactions", "Times the L1 journal's log was "
                                              "replaced by a snapshot of the live state", registry=r)

    def _timings_and_info(self, r: CollectorRegistry) -> None:
        self.request_latency = Histogram(
            "kvtier_request_seconds", "Server-side handling time, by operation", ["op"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.item_bytes = Histogram(
            "kvtier_chunk_bytes", "Size of stored chunks", buckets=_BYTES_BUCKETS, registry=r
        )
        self.store_seconds = Histogram(
            "kvtier_store_seconds", "Per stored chunk: time from reservation to commit (includes the client's copy)",
            buckets=_STAGE_BUCKETS, registry=r,
        )
        self.retrieve_seconds = Histogram(
            "kvtier_retrieve_seconds", "Per read lease: time from acquire to release (includes the client's copy)",
            buckets=_STAGE_BUCKETS, registry=r,
        )
        self.l1_segment = Gauge(
            "kvtier_l1_segment_bytes", "Size of the shared-memory segment: the most L1 can be resized to", registry=r
        )
        self.admin_requests = Counter(
            "kvtier_admin_requests", "Admin HTTP requests, by route and status code", ["route", "code"], registry=r
        )
        self.admin_lookups_refused = Counter(
            "kvtier_admin_lookups_refused", "Admin /cache/lookup requests refused, by reason (too_many_tokens, "
            "not_registered)", ["reason"], registry=r,
        )
        self.tier_read_bw = Gauge(
            "kvtier_tier_read_bandwidth_bytes_per_second",
            "Measured read bandwidth of a lower tier (decayed average of its transfers; 0 = not measured yet)",
            ["tier"], registry=r,
        )
        self.tier_write_bw = Gauge(
            "kvtier_tier_write_bandwidth_bytes_per_second",
            "Measured write bandwidth of a lower tier (decayed average of its transfers; 0 = not measured yet)",
            ["tier"], registry=r,
        )
        self.info = Gauge("kvtier_build_info", "Always 1; the version label is the kvtier version", ["version"],
                          registry=r)

    def _precreate(self) -> None:
        """Create the children a dashboard divides by, so they read 0 before the first event."""
        self.hit_tokens.labels(L1)
        for reason in ("no_space", "too_large", "not_admitted", "prefix_refused"):
            self.refused.labels(reason)
        for reason in ("capacity", "clear", "resize", "superseded"):
            self.evictions.labels(L1, reason)
        self.entries.labels(L1)
        for reason in SKIP_REASONS:
            self.identity_skips.labels(reason)
        for reason in UNDELIVERED_REASONS:
            self.undelivered_tokens.labels(reason)
        for reason in HINT_IGNORED_REASONS:
            self.hints_ignored.labels(reason)
        for reason in ("too_many_tokens", "not_registered"):
            self.admin_lookups_refused.labels(reason)

    def watch_tenants(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        """Export the per-tenant L1 series (kvtier_tenant_*) from `rows` (TenantBook.rows) at each scrape."""
        self.registry.register(TenantCollector(rows))


# Reasons every tenant's series carry from the start (0 until the first), so a dashboard can divide by them.
TENANT_EVICTIONS = ("capacity", "quota", "clear")
TENANT_REFUSALS = (TENANT_MAX, TENANT_GUARANTEE, RETAINED)
_TENANT_GAUGES = {"used_bytes": "L1 bytes a tenant's chunks hold", "guaranteed_bytes": "A tenant's guaranteed L1 "
                  "bytes (the quota table's share of the current L1 budget)", "max_bytes": "The most L1 bytes a "
                  "tenant may hold", "entries": "Chunks of a tenant in L1"}
_TENANT_COUNTERS = {"stored_tokens": "Tokens of a tenant's chunks committed to L1", "requested_tokens": "Prompt "
                    "tokens a tenant's lookups asked for", "hit_tokens": "Prompt tokens a tenant's lookups found "
                    "(any tier)"}


class TenantCollector:
    """The kvtier_tenant_* series, read from L1's TenantBook rows when /metrics is scraped (the book keeps plain
    numbers; nothing is updated per store). Labels are bounded: the quota table's names and `*`."""

    def __init__(self, rows: Callable[[], list[dict[str, Any]]]) -> None:
        self.rows = rows

    def describe(self) -> list[Metric]:
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        return self._families(self.rows())

    @staticmethod
    def _families(rows: list[dict[str, Any]]) -> Iterator[Metric]:
        for field, text in _TENANT_GAUGES.items():
            family = GaugeMetricFamily(f"kvtier_tenant_{field}", text, labels=["tenant"])
            for row in rows:
                family.add_metric([row["tenant"]], row[field])
            yield family
        for field, text in _TENANT_COUNTERS.items():
            family = CounterMetricFamily(f"kvtier_tenant_{field}", text, labels=["tenant"])
            for row in rows:
                family.add_metric([row["tenant"]], row[field])
            yield family
        for field, name, known, text in (
            ("evictions", "evictions", TENANT_EVICTIONS, "Chunks of a tenant removed from L1, by reason"),
            ("refused", "refused_stores", TENANT_REFUSALS, "Store items of a tenant refused, by reason"),
        ):
            family = CounterMetricFamily(f"kvtier_tenant_{name}", text, labels=["tenant", "reason"])
            for row in rows:
                counts = {**dict.fromkeys(known, 0), **row[field]}
                for reason, n in sorted(counts.items()):
                    family.add_metric([row["tenant"], reason], n)
            yield family


class TierMetrics:
    """A lower tier's own metrics, names kvtier_<name>_* (kvtier_l2_*, kvtier_remote_*), registered when the
    tier is configured: what AttachedTier and Promotions count for any tier. `help` overrides the help text
    of `used`, `capacity`, `written` and `corrupt` (what they measure depends on the tier); a tier with more
    metrics of its own subclasses this (the remote tier: tiers/remote/metrics.py). The tier's series under
    common names (kvtier_entries, kvtier_hit_tokens, kvtier_evictions, the bandwidth gauges) carry
    tier="<name>"."""

    def __init__(self, metrics: Metrics, name: str, title: str = "", help: Mapping[str, str] | None = None) -> None:
        r, p, t = metrics.registry, f"kvtier_{name}", title or name
        texts = {"used": f"{t} bytes in use", "capacity": f"{t} capacity",
                 "written": f"Chunks written to {t}, since the server started",
                 "corrupt": f"{t} chunks found corrupt and removed", **(help or {})}
        self.name = name
        self.used = Gauge(f"{p}_used_bytes", texts["used"], registry=r)
        self.capacity = Gauge(f"{p}_capacity_bytes", texts["capacity"], registry=r)
        self.queue_depth = Gauge(f"{p}_queue_depth", f"Chunks waiting in the {t} write-behind queue", registry=r)
        self.dropped = Counter(f"{p}_dropped_writes", f"{t} copies dropped because the queue was full", registry=r)
        self.corrupt = Counter(f"{p}_corrupt_chunks", texts["corrupt"], registry=r)
        self.written = Gauge(f"{p}_written_chunks", texts["written"], registry=r)
        self.promoted = Counter(f"{p}_promotions", f"{t} chunks promoted to L1 by lookups", registry=r)
        self.promotion_failures = Counter(
            f"{p}_promotion_failures", f"{t} promotions whose copy was missing or corrupt (served as misses)",
            registry=r,
        )
        self.promoting_bytes = Gauge(
            f"{p}_promoting_bytes", f"L1 bytes held by promotions from {t} still in flight", registry=r
        )
        self.promotions_capped = Counter(
            f"{p}_promotions_capped", f"{t} hits not promoted (nor reported) because of the in-flight cap",
            registry=r,
        )
        self.promotion_waits = Counter(
            f"{p}_promotion_waits", "Acquires that had to wait for an in-flight promotion", registry=r
        )
        self.promotions_expired = Counter(
            f"{p}_promotions_expired", f"{t} promotions abandoned at their deadline (served as misses)",
            registry=r,
        )
        self.clear_failures = Counter(
            f"{p}_clear_failures", f"{t} chunks a cache clear could not remove (forgotten, never served)",
            registry=r,
        )


class GpuMetrics:
    """The GPU data path's metrics (names kvtier_gpu_*), registered with the copiers."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.ops = Counter("kvtier_gpu_ops", "GPU operations answered, by op and result (ok, or the "
                           "gpu_unavailable reason)", ["op", "result"], registry=r)
        self.copied_bytes = Counter("kvtier_gpu_copied_bytes", "Bytes copied between GPU memory and L1, by "
                                    "direction", ["direction"], registry=r)
        self.copy_seconds = Histogram("kvtier_gpu_copy_seconds", "Per GPU operation: submit to copy done (the "
                                      "engine's event wait included), by direction", ["direction"],
                                      buckets=_STAGE_BUCKETS, registry=r)
        self.registrations = Gauge("kvtier_gpu_registrations", "GPU KV allocations registered", registry=r)
        self.pinned_bytes = Gauge("kvtier_gpu_l1_page_locked_bytes", "L1 bytes page-locked for DMA, by GPU",
                                  ["device"], registry=r)
        self.copier_restarts = Counter("kvtier_gpu_copier_restarts", "Copier processes killed and restarted "
                                       "(died, hung, or an operation past --gpu-op-timeout-s)", ["device"],
                                       registry=r)
        for op in ("gpu_register", "gpu_store", "gpu_load"):
            self.ops.labels(op, "ok")
        for direction in ("store", "load"):
            self.copied_bytes.labels(direction)


class FeedMetrics:
    """The daemon event feed's metrics (names kvtier_feed_*, server/feed.py), registered when it is on."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.events = Counter("kvtier_feed_events", "Events published on the daemon feed, by type", ["type"],
                              registry=r)
        self.batches = Counter("kvtier_feed_batches", "Event batches published on the daemon feed", registry=r)
        self.dropped = Counter("kvtier_feed_dropped_events", "Events dropped before the daemon feed published "
                               "them because its queue was full (the next batch says how many)", registry=r)
        self.requests = Counter("kvtier_feed_requests", "Requests on the feed's replay socket, by kind (replay, "
                                "snapshot, bad)", ["kind"], registry=r)
        for kind in ("Stored", "Removed", "Cleared"):
            self.events.labels(kind)
        for kind in ("replay", "snapshot", "bad"):
            self.requests.labels(kind)
