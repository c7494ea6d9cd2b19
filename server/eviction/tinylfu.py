"""W-TinyLFU (Einziger, Friedman & Manes, ACM ToS 2017; Caffeine's policy): a window LRU (1 % of the cache's
bytes) in front of a segmented-LRU main space (20 % probation, 80 % protected), guarded by a frequency sketch.

Every new key enters the window. When the cache is full, the key the window pushes out (the candidate) duels
probation's LRU key (the victim): the one with the lower estimated frequency leaves the cache (a tie: the
candidate, as in Caffeine); a winner stays in probation. A probation hit promotes to protected, whose overflow
is demoted to probation's MRU end; while the cache is not full, keys leave the window without a duel. The
sketch is count-min: 4 rows of saturating 4-bit counters indexed by 32-bit slices of blake2b(key) (replay keys
are struct-packed, not digests); each access adds one, and after 10 x (peak resident keys) additions every
counter is halved. Rows widen with the key count by doubling onto themselves, which keeps every estimate an
upper bound. No doorkeeper: Caffeine has none either; it saves memory, not hits.

Mapping onto kvtier, which decides before it inserts (per key offered while full: admit, then pick_victim until
there is room; the admitted keys are inserted at commit, a reservation's keys last-first):
- admit counts the offer (the access: insert does not count it again). The first keys offered in an eviction
  burst, up to the window's share (at least one), enter the window: the window's keys move to probation as
  candidates now, and pick_victim fights their duels and names the losers.
- In Caffeine any further key of the burst would be pushed through the window by the next one, straight into a
  duel and with no chance of a hit; admit fights that duel at the door, against main's LRU victim: the winner
  is admitted (into probation), the loser refused, as evicting it at once would do.
- The cache size is learnt as the resident bytes when a burst starts (the first admit or pick_victim since an
  insert; until the first, the resident bytes so far stand in). Candidates a burst did not need stay in
  probation as ordinary keys, as in Caffeine once the cache is within its size.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy

ROWS = 4
COUNTER_MAX = 15
HALVE = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """Count-min sketch of 4-bit counters with periodic halving; `width` counters a row (a power of two)."""

    def __init__(self, width: int = 64) -> None:
        self.width = width
        self._table = bytearray(ROWS * width)  # row r is table[r * width:(r + 1) * width]
        self.additions = 0

    def _slots(self, key: bytes) -> list[int]:
        digest = hashlib.blake2b(key, digest_size=4 * ROWS).digest()
        mask = self.width - 1
        return [row * self.width + (int.from_bytes(digest[4 * row:4 * row + 4], "little") & mask)
                for row in range(ROWS)]

    def add(self, key: bytes, period: int) -> None:
        """Count one access of `key`; halve every counter once `period` accesses were counted since."""
        table = self._table
        for slot in self._slots(key):
            if table[slot] < COUNTER_MAX:
                table[slot] += 1
        self.additions += 1
        if self.additions >= period:
            self._table = table.translate(HALVE)
            self.additions //= 2

    def estimate(self, key: bytes) -> int:
        return min(map(self._table.__getitem__, self._slots(key)))

    def widen(self, width: int) -> None:
        """Grow to at least `width` counters a row, keeping the counts (each new slot starts at its old one)."""
        while self.width < width:
            w = self.width
            self._table = bytearray().join(self._table[r * w:(r + 1) * w] * 2 for r in range(ROWS))
            self.width = 2 * w


class TinyLFUPolicy(EvictionPolicy):
    name = "tinylfu"

    def __init__(self, window: float = 0.01, protected: float = 0.8, sample: int = 10) -> None:
        if not 0.0 < window < 1.0 or not 0.0 < protected < 1.0 or sample < 1:
            raise ValueError("need 0 < window < 1, 0 < protected < 1 and sample >= 1")
        self._window_share = window
        self._protected_share = protected
        self._sample = sample
        self._window: OrderedDict[bytes, int] = OrderedDict()  # key -> size; first = least recently used
        self._probation: OrderedDict[bytes, int] = OrderedDict()
        self._protected: OrderedDict[bytes, int] = OrderedDict()
        self._candidates: dict[bytes, None] = {}  # probation keys pushed off the window this burst, oldest first
        self._offered: dict[bytes, bool] = {}  # admitted while full, counted, not yet inserted -> into probation
        self._window_bytes = 0
        self._protected_bytes = 0
        self._resident_bytes = 0
        self._incoming = 0  # bytes admitted into the window this burst
        self._peak = 0  # most resident keys seen: the sketch's width and halving period follow it
        self.sketch = FrequencySketch()
        self._capacity: int | None = None  # learnt cache size in bytes; None until the first burst
        self._evicting = False  # inside an eviction burst (admit or pick_victim calls since the last insert)

    def insert(self, key: bytes, size: int) -> None:
        if self._evicting:
            self._evicting = False
            self._candidates.clear()
        to_probation = self._offered.pop(key, None)
        if to_probation is None:
            self._record(key)
        if to_probation:
            self._probation[key] = size
        else:
            self._window[key] = size
            self._window_bytes += size
        self._resident_bytes += size
        if len(self) > self._peak:
            self._peak = len(self)
            self.sketch.widen(4 * self._peak)
        target = self._targets()[0]
        while self._window_bytes > target and len(self._window) > 1:  # not full: no duel
            self._leave_window()

    def touch(self, key: bytes) -> None:
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            size = self._probation.pop(key)
            self._candidates.pop(key, None)
            self._protected[key] = size
            self._protected_bytes += size
            self._trim_protected()
        else:
            return
        self._record(key)

    def remove(self, key: bytes) -> None:
        if (size := self._window.pop(key, None)) is not None:
            self._window_bytes -= size
        elif (size := self._protected.pop(key, None)) is not None:
            self._protected_bytes -= size
        elif (size := self._probation.pop(key, None)) is not None:
            self._candidates.pop(key, None)
        else:
            return
        self._resident_bytes -= size

    def admit(self, key: bytes, size: int, evictable: Callable[[bytes], bool]) -> bool:
        self._begin_burst()
        self._record(key)
        target = self._targets()[0]
        if self._incoming == 0 or self._incoming + size <= target:  # the window takes it
            self._incoming += size
            while self._window and self._window_bytes + self._incoming > target:
                self._candidates[self._leave_window()] = None
            to_probation = False
        else:  # straight through the window into a duel
            victim = self._victim(evictable)
            if victim is not None and self.sketch.estimate(key) <= self.sketch.estimate(victim):
                return False
            to_probation = True
        self._offered[key] = to_probation
        while len(self._offered) > max(64, len(self)):  # admitted but never inserted (a lapsed reservation)
            del self._offered[next(iter(self._offered))]
        return True

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        self._begin_burst()
        candidate = next((key for key in self._candidates if evictable(key)), None)
        if candidate is None:
            return self._victim(evictable)
        victim = self._probation_victim(evictable)
        if victim is not None and self.sketch.estimate(candidate) > self.sketch.estimate(victim):
            del self._candidates[candidate]  # admitted to main: the victim goes instead
            return victim
        return candidate

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def _begin_burst(self) -> None:
        if not self._evicting:
            self._evicting = True
            self._capacity = self._resident_bytes
            self._incoming = 0
            self._trim_protected()

    def _record(self, key: bytes) -> None:
        self.sketch.add(key, self._sample * max(self._peak, 1))

    def _targets(self) -> tuple[float, float]:
        """(window, protected) byte targets of the learnt size, or of the resident bytes before it is known."""
        capacity = self._resident_bytes if self._capacity is None else self._capacity
        window = self._window_share * capacity
        return window, self._protected_share * (capacity - window)

    def _probation_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return next((key for key in self._probation if key not in self._candidates and evictable(key)), None)

    def _victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """Main's LRU victim without a candidate: probation's, else protected's, else the window's."""
        victim = self._probation_victim(evictable)
        if victim is None:
            victim = next((key for key in self._protected if evictable(key)), None)
        if victim is None:
            victim = next((key for key in self._window if evictable(key)), None)
        return victim

    def _leave_window(self) -> bytes:
        key, size = self._window.popitem(last=False)
        self._window_bytes -= size
        self._probation[key] = size
        return key

    def _trim_protected(self) -> None:
        target = self._targets()[1]
        while self._protected_bytes > target and len(self._protected) > 1:
            key, size = self._protected.popitem(last=False)
            self._protected_bytes -= size
            self._probation[key] = size
