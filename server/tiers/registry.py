"""The registry of lower tiers: kind -> "module:factory", imported only when a tier of that kind is made
(the remote tier's module imports glide: 0.3 s, 17 MiB, only with --remote-url).

A factory is `factory(options, metrics) -> LowerTier`: `options` is what the tier is made with (its own
options dataclass for the built-in ones, which server/config.py fills; for a plug-in, the text after `=` in
its --extra-tiers item), `metrics` the server's Metrics, for the tier's TierMetrics (set as `tier.m`).

A tier outside kvtier is named by its import path instead of a kind: `--extra-tiers pkg.mod:factory=ARG`
(server/tier_setup.py), no change to kvtier needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvtier.server.metrics import Metrics
from kvtier.server.tiers.base import LowerTier

TierFactory = Callable[[Any, Metrics], LowerTier]

TIERS: dict[str, str] = {
    "l2": "kvtier.server.tiers.fs:make_tier",
    "remote": "kvtier.server.tiers.remote.tier:make_tier",
}


def tier_factory(kind: str) -> TierFactory:
    """The factory of a registered kind, or of "module:factory"; ValueError for anything else."""
    target = TIERS.get(kind, kind)
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"unknown tier {kind!r}: one of {', '.join(sorted(TIERS))}, or module:factory")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tier {kind!r}: cannot import {target}: {exc}") from None
    if not callable(factory):
        raise ValueError(f"tier {kind!r}: {target} is not callable")
    return factory
