"""The lower tiers a configuration asks for, in lookup order: config -> each tier's options -> the tier
(through the lazy registry, server/tiers/registry.py) -> the tier as the cache runs it (AttachedTier).

Built-in tiers: L2 with --l2-path, the remote tier with --remote-url. Then each item of --extra-tiers
(comma-separated `module:factory` or `module:factory=ARG`, or a registered kind), after them: a tier kvtier
does not ship, registered without changing kvtier (tests/integration/fake_tier.py is one).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from kvtier.server.config import ServerConfig
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import L1, Metrics
from kvtier.server.tiers.attached import AttachedTier
from kvtier.server.tiers.registry import tier_factory

EXTRA_QUEUE_DEPTH = 256  # write-behind queue of a plug-in tier whose options name none


def tier_options(config: ServerConfig) -> list[tuple[str, Any]]:
    """(kind or import path, options) of every lower tier `config` asks for, in lookup order."""
    out: list[tuple[str, Any]] = []
    if config.l2_path:
        out.append(("l2", config.l2_options()))
    if config.remote_url:
        out.append(("remote", config.remote_options()))
    for item in filter(None, (i.strip() for i in config.extra_tiers.split(","))):
        target, _, arg = item.partition("=")
        out.append((target, arg))
    return out


def make_tiers(config: ServerConfig, store: L1Store, segment: np.ndarray, metrics: Metrics) -> list[AttachedTier]:
    """The lower tiers of `config`, in lookup order, not opened yet (`AttachedTier.open` scans)."""
    tiers: list[AttachedTier] = []
    for kind, options in tier_options(config):
        tier = tier_factory(kind)(options, metrics)
        if tier.name == L1 or any(t.name == tier.name for t in tiers):
            raise ValueError(f"a lower tier is named {tier.name!r}, the name of another tier")
        tier.know_namespaces(store.namespaces.get)
        depth = getattr(options, "queue_depth", EXTRA_QUEUE_DEPTH)
        tiers.append(AttachedTier(store, segment, tier, depth, metrics, tier.m))
    return tiers
