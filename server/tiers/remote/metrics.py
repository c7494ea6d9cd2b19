"""The remote tier's metrics: the common ones of every tier (TierMetrics, names kvtier_remote_*) and its own
(timeouts, breakers, ...), registered with --remote-url."""

from __future__ import annotations

from kvtier.server.metrics import Metrics, TierMetrics
from prometheus_client import Counter, Gauge

HELP = {
    "used": "Bytes the remote store reports in use (INFO used_memory summed over its masters; refreshed every few s)",
    "capacity": "The remote store's maxmemory summed over its masters (0: no limit set)",
    "written": "Chunks this node wrote to the remote store, since the server started",
    "corrupt": "Remote chunks whose header, part sizes or checksum did not verify (never served; header deleted)",
}


class RemoteMetrics(TierMetrics):
    def __init__(self, metrics: Metrics) -> None:
        super().__init__(metrics, "remote", "Remote", HELP)
        r = metrics.registry
        self.missing = Counter(
            "kvtier_remote_missing_chunks", "Remote chunks read with a part or the header missing (evicted or "
            "expired; never served; header deleted)", registry=r,
        )
        self.pending = Counter(
            "kvtier_remote_pending_lookups", "Lookups that reached a chunk the remote tier did not know yet (a "
            "probe runs; the reply says pending)", registry=r,
        )
        self.existing = Counter(
            "kvtier_remote_existing_writes", "Remote writes skipped because the chunk was there (another node "
            "wrote it)", registry=r,
        )
        self.timeouts = Counter("kvtier_remote_timeouts", "Remote calls that timed out, by operation", ["op"],
                                registry=r)
        self.errors = Counter("kvtier_remote_errors", "Remote calls that failed otherwise (connection, server "
                              "error), by operation", ["op"], registry=r)
        self.rejected = Counter(
            "kvtier_remote_rejected_calls", "Remote calls not made because the node's circuit breaker was open "
            "(reads: misses, writes: dropped), by operation", ["op"], registry=r,
        )
        self.delete_failures = Counter(
            "kvtier_remote_delete_failures", "Deletes of a corrupt or incomplete remote chunk that failed (no "
            "permission, server error, unavailable): it stays in the store until its TTL, ignored by this node "
            "meanwhile", registry=r,
        )
        self.skipped_writes = Counter(
            "kvtier_remote_skipped_writes", "Remote writes not sent, by reason (full: the chunk's node answered OOM "
            "less than its back-off ago; writes to it resume after it; namespace: the chunk's namespace was "
            "forgotten before the write, so its tenant's keys cannot be named)", ["reason"], registry=r,
        )
        self.skipped_writes.labels("full")
        self.skipped_writes.labels("namespace")
        self.breaker_open = Gauge("kvtier_remote_breaker_open", "1 while the circuit breaker of a remote node is "
                                  "open (its calls are misses and dropped writes), else 0", ["node"], registry=r)
        for op in ("get", "put", "probe"):
            for counter in (self.timeouts, self.errors, self.rejected):
                counter.labels(op)
