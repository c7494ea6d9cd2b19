"""Least-recently-used: the baseline. Falls off a cliff (0 % hits) on a loop slightly larger than the cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # first = least recently used

    def insert(self, key: bytes, size: int) -> None:
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return next((key for key in self._order if evictable(key)), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
