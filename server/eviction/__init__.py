"""Eviction policies behind one interface (`--eviction-policy`)."""

from __future__ import annotations

from .base import EvictionPolicy
from .lirs import LIRSPolicy
from .lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {LRUPolicy.name: LRUPolicy, LIRSPolicy.name: LIRSPolicy}
DEFAULT_POLICY: str = LIRSPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name; ValueError listing the valid names for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None


__all__ = ["DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "LIRSPolicy", "LRUPolicy", "make_policy"]
