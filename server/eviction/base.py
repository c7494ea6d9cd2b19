"""The interface every eviction policy implements.

A policy only orders keys; the cache owns the bytes. It is told about every committed entry (insert), every
hit (touch) and every removal (remove), names the next victim on demand (pick_victim) and decides whether a
chunk offered while the cache is full may displace others at all (admit). Keys are opaque
16-byte chunk digests; all bookkeeping is O(1) amortised per operation.
"""

from __future__ import annotations

import abc
from collections.abc import Callable


class EvictionPolicy(abc.ABC):
    name: str

    @abc.abstractmethod
    def insert(self, key: bytes, size: int) -> None:
        """A newly committed entry; `key` is not present."""

    @abc.abstractmethod
    def touch(self, key: bytes) -> None:
        """A hit on a present entry (lookup, acquire, store of an existing key)."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None:
        """The entry is gone for any reason (evicted, cleared, corrupt); a no-op for an unknown key."""

    @abc.abstractmethod
    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The key to evict next, skipping keys for which `evictable(key)` is False (pinned, leased).

        None if no present key is evictable. The key is not removed: the caller evicts it, then calls remove.
        """

    def admit(self, key: bytes, size: int, evictable: Callable[[bytes], bool]) -> bool:
        """Whether `key` (not present), offered for storing while the cache is full, may displace present
        keys; the policy's own bookkeeping of the offer is its business. A refused store is counted
        (`not_admitted`) and is only a future miss. The default admits everything."""
        return True

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of present keys."""

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is present."""
