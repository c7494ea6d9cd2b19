"""LRU victims with reuse-interval admission: the loop-resistant default.

Victims are taken in LRU order. What protects a working set larger than the cache is admission: a chunk
offered again after it was evicted (the connector stores every chunk a lookup missed) displaces the LRU
victim only if it is expected back sooner than the victim is. Each key remembers when it was last used
(a lookup hit, a store of it, an offer) and the interval before that; time is counted in policy events.
For the offered key X, coming back after `reuse` events, and the victim V, idle for `idle` events:

- X never seen (new content: a new document, a chat's new turn): admitted, as LRU would.
- V seen once (no interval yet): X is admitted if `reuse < idle`; V has been idle longer than X's period.
- V overdue (idle > `overdue` x its last interval): admitted; V's pattern has stopped (a finished chat).
- otherwise X is admitted if it is due before V: `reuse < interval(V) - idle`.

On a loop larger than the cache every re-offered chunk comes back after a whole loop while the victim is
due sooner, so the resident part of the loop stays and hits on every pass (LRU gets nothing). Refusals are
checked against what they bought: a victim a refusal kept that is hit before it goes raises `trust`, one
that goes unhit lowers it; below 0.5 only every `explore`-th refusal the rule asks for is made, so on
recency-friendly traffic (chats whose old sessions are dead) the policy behaves as LRU and still notices
when refusing starts to pay again. Keys evicted or refused are remembered (last use and interval, one int)
up to `history` x the resident key count, oldest forgotten first; a forgotten key is new content again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import EvictionPolicy

UNKNOWN = -1  # no interval yet: the key was used once
_BITS = 48  # a key's state is one int: last use << _BITS | (interval + 1); intervals cap at 2**48 - 2 events
_MASK = (1 << _BITS) - 1


def _state(last: int, interval: int) -> int:
    return last << _BITS | min(interval + 1, _MASK)


def _last(state: int) -> int:
    return state >> _BITS


def _interval(state: int) -> int:
    return (state & _MASK) - 1


class ReusePolicy(EvictionPolicy):
    name = "reuse"

    def __init__(self, history: float = 2.0, overdue: float = 2.0, step: float = 1 / 16, explore: int = 8) -> None:
        if history <= 0 or overdue < 1 or not 0 < step < 1 or explore < 1:
            raise ValueError("need history > 0, overdue >= 1, 0 < step < 1 and explore >= 1")
        self._history = history
        self._overdue = overdue
        self._step = step
        self._explore = explore
        self._clock = 0
        self._resident: OrderedDict[bytes, int] = OrderedDict()  # key -> state; least recently used first
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # evicted or refused keys, oldest first
        self._trust = 0.5  # how often a victim kept by a refusal was hit before it went
        self._kept: set[bytes] = set()  # residents kept by a refusal, not yet hit or gone
        self._doubted = 0  # refusals the rule wanted while trust was low

    def _used(self, state: int | None) -> int:
        """The state after a use now (a key never seen has no interval yet)."""
        self._clock += 1
        return _state(self._clock, UNKNOWN if state is None else self._clock - _last(state))

    def insert(self, key: bytes, size: int) -> None:
        self._resident[key] = self._used(self._ghosts.pop(key, None))

    def touch(self, key: bytes) -> None:
        state = self._resident.get(key)
        if state is None:
            return
        self._resident[key] = self._used(state)
        self._resident.move_to_end(key)
        if key in self._kept:
            self._kept.discard(key)
            self._trust += (1.0 - self._trust) * self._step

    def remove(self, key: bytes) -> None:
        state = self._resident.pop(key, None)
        if key in self._kept:
            self._kept.discard(key)
            self._trust -= self._trust * self._step
        if state is not None:
            self._ghosts[key] = state
            limit = int(self._history * len(self._resident)) + 1
            while len(self._ghosts) > limit:
                self._ghosts.popitem(last=False)

    def pick_victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        return next((key for key in self._resident if evictable(key)), None)

    def admit(self, key: bytes, size: int, evictable: Callable[[bytes], bool]) -> bool:
        state = self._ghosts.get(key)
        if state is None:
            return True  # new content
        victim = self.pick_victim(evictable)
        if victim is None:
            return True  # nothing to displace: the cache refuses the store for want of room instead
        now = self._clock + 1
        reuse = now - _last(state)
        victim_state = self._resident[victim]
        idle, interval = now - _last(victim_state), _interval(victim_state)
        if interval == UNKNOWN:
            keep = reuse >= idle
        else:
            keep = idle <= self._overdue * interval and reuse >= interval - idle
        if keep and self._trust < 0.5:  # kept victims went unused lately: refuse only to keep learning
            self._doubted += 1
            keep = self._doubted % self._explore == 0
        if not keep:
            return True
        self._kept.add(victim)
        self._ghosts[key] = self._used(state)  # the offer is a use: the next offer is judged by this interval
        self._ghosts.move_to_end(key)
        return False

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    @property
    def ghost_count(self) -> int:
        return len(self._ghosts)
