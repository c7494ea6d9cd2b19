"""Lower tiers: the chunk stores below L1, in lookup order.

* base.py: the `LowerTier` contract every tier implements (and which thread calls what; `stats`, `close`,
  the `report` seam of events, its `TierMetrics`), `Cleared`;
* registry.py: the lazy registry, kind -> "module:factory" (a module is imported only when its tier is
  configured), and plug-in tiers by import path;
* record.py: what every tier shares about a stored chunk: `ChunkMeta`, the header, the XXH3-128 checksum,
  `CorruptChunk` (no I/O);
* fs.py + fs_io.py: the filesystem tier (`FsTier`, `FsOptions`: index, budget, eviction, start-up scan) and
  its file I/O (one file per chunk: crash-safe write, verified read, buffered or O_DIRECT);
* networked/: what any networked tier needs: the presence cache, the prober, per-node breakers;
* remote/: the Redis/Valkey tier (`RemoteTier`), split along its seams (layout, options, nodes, reads,
  writes, lookups, maintenance, metrics);
* writer.py: the bounded write-behind queue from L1 to a tier and its two-stage pipeline;
* bandwidth.py: `BandwidthMeter`, a tier direction's measured transfer rate;
* promotion.py: a tier's chunk read into L1 pages and committed there (only L1's public calls);
* attached.py: a tier as the cache runs it (write-behind, promotions, clears, meters, health).

Which tiers a configuration asks for is decided outside this package (server/tier_setup.py): nothing here
imports the server's config, cache, rpc, daemon or feed.
"""
