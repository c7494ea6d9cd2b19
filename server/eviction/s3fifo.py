"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues that demote one-hit wonders quickly.

New keys enter a small FIFO S (10 % of the cache's bytes). When S evicts, a key hit at least twice while in S
moves to the main FIFO M; any other leaves the cache and is remembered in a ghost FIFO G (keys and sizes only,
up to 90 % of the cache's bytes, oldest forgotten first). A key inserted while in G goes straight to M. M is a
CLOCK with a 2-bit counter: a hit raises a key's count (at most 3); at M's tail a key with a count goes back to
M's head with one count less, one without is the victim. The cache evicts from M while M is over its 90 %
(or S is empty), else from S. As in the authors' libCacheSim reference, a key moved from S to M starts at count
0, and while the cache first fills only the first 10 % of its bytes go to S, the rest to M (otherwise S would
be the whole cache at the first eviction and every key of the fill would have to pass through it).

The policy is not told the cache size: it learns it as the resident bytes at the first pick_victim of each
eviction burst (pick_victim is only called when the cache is full), as LIRS does; the first fill is split
between S and M then. pick_victim makes S's and M's moves and counter decrements itself and names the victim
without removing it; pinned keys keep their place and are passed over. Every key removed while in S goes to
G: the caller removes what pick_victim named, and a key cleared from S is as recent a miss as an evicted one.
Admission is the default (everything): S3-FIFO filters through S, not at the door.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy

PROMOTE = 2  # hits while in S that move a key to M (libCacheSim's move-to-main threshold; the paper's freq > 1)
MAX_COUNT = 3  # M's counter: 2 bits


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, small: float = 0.1, ghost: float = 0.9) -> None:
        if not 0.0 < small < 1.0 or ghost < 0.0:
            raise ValueError("need 0 < small < 1 and ghost >= 0")
        self._small_share = small
        self._ghost_share = ghost
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> size; first = oldest
        self._main: OrderedDict[bytes, int] = OrderedDict()  # key -> size; first = CLOCK's tail
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # evicted from S: key -> size; first = oldest
        self._count: dict[bytes, int] = {}  # resident key -> hits (capped at MAX_COUNT)
        self._small_bytes = 0
        self._main_bytes = 0
        self._ghost_bytes = 0
        self._capacity: int | None = None  # learnt cache size in bytes; None until the first eviction
        self._evicting = False  # inside an eviction burst (pick_victim calls since the last insert)

    def insert(self, key: bytes, size: int) -> None:
        self._evicting = False
        self._count[key] = 0
        ghost_size = self._ghost.pop(key, None)
        if ghost_size is not None:
            self._ghost_bytes -= ghost_size
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size

    def touch(self, key: bytes) -> None:
        count = self._count.get(key)
        if count is not None and count < MAX_COUNT:
            self._count[key] = count + 1

    def remove(self, key: bytes) -> None:
        if self._count.pop(key, None) is None:
            return
        size = self._small.pop(key, None)
        if size is None:
            self._main_bytes -= self._main.pop(key)
            return
        self._small_bytes -= size
        self._ghost[key] = size
        self._ghost_bytes += size
        limit = self._ghost_share * (self._capacity or self._small_bytes + self._main_bytes)
        while self._ghost_bytes > limit and self._ghost:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        if not self._evicting:
            self._evicting = True
            first = self._capacity is None
            self._capacity = self._small_bytes + self._main_bytes
            if first:
                self._split_fill()
        if self._main_bytes > (1.0 - self._small_share) * self._capacity or not self._small:
            victim = self._main_victim(evictable)
            return victim if victim is not None else self._small_victim(evictable)
        victim = self._small_victim(evictable)
        return victim if victim is not None else self._main_victim(evictable)

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count

    @property
    def ghost_bytes(self) -> int:
        return self._ghost_bytes

    @property
    def capacity(self) -> int | None:
        return self._capacity

    def _split_fill(self) -> None:
        """Move the keys of the first fill beyond S's share to M, in their order (libCacheSim inserts them
        there directly once S is full)."""
        assert self._capacity is not None
        target = self._small_share * self._capacity
        kept = 0
        for key, size in list(self._small.items()):
            if kept < target:
                kept += size
                continue
            del self._small[key]
            self._small_bytes -= size
            self._main[key] = size
            self._main_bytes += size

    def _small_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """S's oldest evictable key not hit twice; the hit ones met on the way move to M."""
        promoted: list[bytes] = []
        victim = None
        for key in self._small:
            if not evictable(key):
                continue
            if self._count[key] < PROMOTE:
                victim = key
                break
            promoted.append(key)
        for key in promoted:
            size = self._small.pop(key)
            self._small_bytes -= size
            self._main[key] = size
            self._main_bytes += size
            self._count[key] = 0
        return victim

    def _main_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """CLOCK over M: keys with a count passed on the way go to M's head with one count less.

        Each round either finds a victim or lowers every evictable key's count, so at most MAX_COUNT + 1
        rounds run; a round that passes no evictable key means there is none.
        """
        main, count = self._main, self._count
        while True:
            passed: list[bytes] = []
            victim = None
            for key in main:
                if not evictable(key):
                    continue
                if count[key] == 0:
                    victim = key
                    break
                passed.append(key)
            for key in passed:
                count[key] -= 1
                main.move_to_end(key)
            if victim is not None or not passed:
                return victim
