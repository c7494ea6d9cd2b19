"""LIRS (Jiang & Zhang, SIGMETRICS 2002) with an adaptive HIR share: the scan- and loop-resistant default.

Keys re-used within a short distance are LIR and are not victims while a resident HIR key is evictable; new
keys enter as HIR once the LIR set is full and pass through the HIR queue. A loop larger than the cache thus
keeps a stable LIR set that hits on every pass (LRU, FIFO, CLOCK and ARC all thrash there).

The HIR queue's share of the cache adapts, ARC-style, between two ghost signals: a re-inserted key that still
had an entry in the recency stack would have hit with a longer queue (grow the share); an evicted key that had
been demoted from LIR would have hit with a larger LIR set (shrink it). Loops produce neither and keep the share
at its minimum (plain LIRS); recency-friendly traffic (multi-round chat) drives it up, towards LRU (almost all
keys HIR, the queue in recency order).

The policy is not told the cache size: it learns it as the resident bytes at the start of each eviction burst
(pick_victim is only called when the cache is full), so the LIR share follows L1 resizes. Ghost entries (keys
no longer resident) are bounded by `history` x the resident key count.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy


class LIRSPolicy(EvictionPolicy):
    name = "lirs"

    def __init__(self, min_hir: float = 0.01, max_hir: float = 0.99, history: float = 2.0) -> None:
        if not 0.0 < min_hir <= max_hir < 1.0:
            raise ValueError("need 0 < min_hir <= max_hir < 1")
        self._min_hir = min_hir
        self._max_hir = max_hir
        self._history = history
        self._hir_share = min_hir
        self._demoted: set[bytes] = set()  # resident HIR keys that were LIR
        self._lir_ghosts: OrderedDict[bytes, None] = OrderedDict()  # evicted ex-LIR keys, oldest first
        self._stack: OrderedDict[bytes, None] = OrderedDict()  # recency stack S; first = bottom, kept LIR
        self._lir: dict[bytes, int] = {}  # key -> size
        self._hir: OrderedDict[bytes, int] = OrderedDict()  # resident HIR queue Q; first = next victim
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()  # non-resident keys still in S, oldest first
        self._lir_bytes = 0
        self._capacity: int | None = None  # learnt cache size in bytes; None until the first eviction
        self._resident_bytes = 0
        self._evicting = False  # inside an eviction burst (pick_victim calls since the last insert)

    # --- interface -------------------------------------------------------------------------------------------

    def insert(self, key: bytes, size: int) -> None:
        self._evicting = False
        self._resident_bytes += size
        if key in self._lir_ghosts:  # a larger LIR set would have kept it
            del self._lir_ghosts[key]
            self._adapt(-size * max(1.0, len(self._ghosts) / max(1, len(self._lir_ghosts))))
        if key in self._ghosts:  # re-used within the stack's reach: a short reuse distance
            del self._ghosts[key]
            self._adapt(size * max(1.0, len(self._lir_ghosts) / max(1, len(self._ghosts))))
            self._stack.move_to_end(key)
            self._add_lir(key, size)
            self._rebalance()
        else:
            self._stack[key] = None
            if self._capacity is None or self._lir_bytes + size <= self._lir_target():
                self._add_lir(key, size)
            else:
                self._hir[key] = size
        self._bound_ghosts()

    def touch(self, key: bytes) -> None:
        if key in self._lir:
            self._stack.move_to_end(key)
            self._prune()
        elif key in self._hir:
            if key in self._stack:  # a resident HIR key re-used while in S becomes LIR
                self._stack.move_to_end(key)
                self._add_lir(key, self._hir.pop(key))
                self._rebalance()
            else:
                self._stack[key] = None
                self._hir.move_to_end(key)

    def remove(self, key: bytes) -> None:
        if key in self._lir:
            size = self._lir.pop(key)
            self._lir_bytes -= size
        elif key in self._hir:
            size = self._hir.pop(key)
            if key in self._demoted:
                self._demoted.discard(key)
                self._lir_ghosts[key] = None
        else:
            return
        self._resident_bytes -= size
        if key in self._stack:  # keep its recency as a ghost, so a quick re-insert is recognised
            self._ghosts[key] = None
            self._prune()
        self._bound_ghosts()

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        if not self._evicting:
            self._evicting = True
            self._capacity = self._resident_bytes
            self._rebalance()
        victim = next((key for key in self._hir if evictable(key)), None)
        if victim is None:  # every HIR key is pinned: fall back to the least recent LIR key
            victim = next((key for key in self._stack if key in self._lir and evictable(key)), None)
        return victim

    def __len__(self) -> int:
        return len(self._lir) + len(self._hir)

    def __contains__(self, key: object) -> bool:
        return key in self._lir or key in self._hir

    @property
    def ghost_count(self) -> int:
        return len(self._ghosts)

    @property
    def hir_share(self) -> float:
        return self._hir_share

    # --- internals -------------------------------------------------------------------------------------------

    def _lir_target(self) -> float:
        assert self._capacity is not None
        return (1.0 - self._hir_share) * self._capacity

    def _adapt(self, delta_bytes: float) -> None:
        if self._capacity:
            share = self._hir_share + delta_bytes / self._capacity
            self._hir_share = min(self._max_hir, max(self._min_hir, share))

    def _add_lir(self, key: bytes, size: int) -> None:
        self._demoted.discard(key)
        self._lir[key] = size
        self._lir_bytes += size

    def _rebalance(self) -> None:
        """Demote the least recent LIR keys to the HIR queue while the LIR set is over its share."""
        if self._capacity is None:
            return
        target = self._lir_target()
        while self._lir_bytes > target and self._lir:
            self._prune()  # S may hold HIR entries below a key just promoted while the LIR set was empty
            key, _ = self._stack.popitem(last=False)
            size = self._lir.pop(key)
            self._lir_bytes -= size
            self._hir[key] = size
            self._demoted.add(key)
        self._prune()

    def _prune(self) -> None:
        """Drop HIR and ghost entries from the bottom of S until a LIR key is there (LIRS stack pruning)."""
        stack = self._stack
        while stack:
            key = next(iter(stack))
            if key in self._lir:
                return
            del stack[key]
            self._ghosts.pop(key, None)

    def _bound_ghosts(self) -> None:
        limit = int(self._history * len(self)) + 1
        while len(self._ghosts) > limit:
            key, _ = self._ghosts.popitem(last=False)
            del self._stack[key]
        while len(self._lir_ghosts) > limit:
            self._lir_ghosts.popitem(last=False)
