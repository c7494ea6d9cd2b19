"""L1: the shared-memory tier: pages (pool.py), chunks and eviction (store.py), clients' holdings (holds.py)."""
