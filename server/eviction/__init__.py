"""Eviction policies behind one interface (`--eviction-policy`)."""

from __future__ import annotations

from .base import EvictionPolicy
from .lirs import LIRSPolicy
from .lru import LRUPolicy
from .reuse import ReusePolicy
from .s3fifo import S3FIFOPolicy
from .tinylfu import TinyLFUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy, LIRSPolicy.name: LIRSPolicy, ReusePolicy.name: ReusePolicy,
    S3FIFOPolicy.name: S3FIFOPolicy, TinyLFUPolicy.name: TinyLFUPolicy,
}
DEFAULT_POLICY: str = ReusePolicy.name


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name; ValueError listing the valid names for an unknown one."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(sorted(POLICIES))}") from None


__all__ = [
    "DEFAULT_POLICY", "POLICIES", "EvictionPolicy", "LIRSPolicy", "LRUPolicy", "ReusePolicy", "S3FIFOPolicy",
    "TinyLFUPolicy", "make_policy",
]
