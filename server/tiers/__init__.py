"""Lower tiers: the chunk stores below L1, in lookup order.

* base.py: the `LowerTier` contract every tier implements (and which thread calls what), `Cleared`;
* record.py: what every tier shares about a stored chunk: `ChunkMeta`, the header, the XXH3-128 checksum,
  `CorruptChunk` (no I/O);
* fs.py + fs_io.py: the filesystem tier (`FsTier`: index, budget, eviction, start-up scan) and its file I/O
  (one file per chunk: crash-safe write, verified read, buffered or O_DIRECT);
* writer.py: the bounded write-behind queue from L1 to a tier and its two-stage pipeline;
* bandwidth.py: `BandwidthMeter`, a tier direction's measured transfer rate;
* redis.py: the remote tier (`RemoteTier`: chunks in a Redis/Valkey store shared by nodes, a presence cache
  for lookups, circuit breakers per node);
* promotion.py: a tier's chunk read into L1 pages and committed there (only L1's public calls);
* attached.py: a tier as the cache runs it (write-behind, promotions, clears, meters, health).

`make_tiers` is the registry: the tiers a configuration asks for, in lookup order.
"""

from __future__ import annotations

import numpy as np
from kvtier.server.config import ServerConfig
from kvtier.server.eviction import make_policy
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import L2Metrics, Metrics, RemoteMetrics
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.fs import FsTier


def make_tiers(config: ServerConfig, store: L1Store, segment: np.ndarray, metrics: Metrics) -> list[AttachedTier]:
    """The lower tiers of `config`, in lookup order, not opened yet (`AttachedTier.open` scans)."""
    tiers: list[AttachedTier] = []
    if config.l2_path:
        m = L2Metrics(metrics)
        disk = FsTier(config.l2_path, config.l2_bytes, config.l2_odirect,
                      on_evict=lambda reason: metrics.evictions.labels(FsTier.name, reason).inc(),
                      on_corrupt=m.corrupt.inc, policy=make_policy(config.l2_eviction_policy))
        tiers.append(AttachedTier(store, segment, disk, config.l2_queue_depth, metrics, m))
    if config.remote_url:
        # imported here: glide loads only with a remote tier (0.3 s, 17 MiB)
        from kvtier.server.tiers.redis import RemoteTier

        rm = RemoteMetrics(metrics)
        remote = RemoteTier(config.remote_url, config.remote_prefix, config.remote_ttl_s, config.remote_timeout_ms,
                            config.remote_breaker_threshold, config.remote_breaker_reset_s, rm,
                            connect_timeout_ms=config.remote_connect_timeout_ms, access=config.remote_access)
        tiers.append(AttachedTier(store, segment, remote, config.remote_queue_depth, metrics, rm))
    return tiers
