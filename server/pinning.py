"""Who holds L1 page-locked, and what that forbids (issue 27, defects 5 and 6).

Every copier process page-locks all of L1 (cudaHostRegister in pieces; server/transfer/copier.py), at its
GPU's first registration and again after each restart. Until it has, its loads answer `not_pinned`; so a
lookup of a namespace that a GPU worker of that copier uses answers misses meanwhile (`unpinned`), instead of
promising hits that the load cannot serve. Once it has, the pages under L1 must stay the ones the GPU
locked: punching holes in them would leave the GPU copying to the old pages (`lockers`, which /reconfigure
asks before giving free pages' memory back).
"""

from __future__ import annotations

from kvtier.server.gpu_ops import GpuOps

# Copier states (server/transfer/copiers.py) in which no process of it runs, so nothing of L1 is locked by it.
_STOPPED = ("failed", "closed")
_SELF_LOADING = ("host",)  # engines whose workers load by themselves (the copier only stores: transfer/host.py)


def lockers(gpu: GpuOps) -> list[str]:
    """The GPUs whose copier process runs (starting, serving or restarting): each has page-locked L1, or is
    locking it, or will again once restarted."""
    return [c["device"] for c in gpu.engine.status()["copiers"] if c["state"] not in _STOPPED]


def unpinned(gpu: GpuOps, fp: bytes) -> bool:
    """Whether a GPU worker that registered namespace `fp` has a copier that cannot load yet: not serving, or
    L1 not wholly page-locked (a lookup of `fp` then answers misses). A namespace is a worker's once its
    client registered it (the connector does so before its first gpu_store or gpu_load of it). A CPU worker
    whose stores the server copies (a "host" registration) loads by itself: its copier never gates lookups."""
    if not gpu.registrations:
        return False
    clients = gpu.holds.clients
    devices = {(r.memory.engine, r.memory.device) for r in gpu.registrations.values()
               if r.memory.engine not in _SELF_LOADING
               and (c := clients.get(r.owner)) is not None and fp in c.namespaces}
    if not devices:
        return False
    ready = {(c["engine"], c["device"]) for c in gpu.engine.status()["copiers"]
             if c["state"] == "serving" and not c["pin_error"] and c["pinned_bytes"] == c["total_bytes"]}
    return not devices <= ready
