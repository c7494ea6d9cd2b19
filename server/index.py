"""PrefixIndex: chunk key or block-prefix alias -> (holder, leading blocks), the lookup rules every local tier
shares (L1's entries, the disk tier's chunk records).

A chunk of n blocks is found by its own key (n blocks) and by each alias, the key of its first j < n blocks
(j blocks). An alias another chunk already holds keeps pointing there; the newcomer is remembered as a
fallback holder, so when the holder goes, the shared leading blocks (a document followed by different
questions) stay findable through the next one. A stored partial chunk whose own key is an alias of a
longer chunk being added is *superseded*: the longer chunk serves the same leading blocks.

An optional observer hears of every key as it enters the index and as it leaves it (and of `clear`), exactly
once each: the tier's region of the presence filter (shm/presence.py) follows what the tier can find.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

H = TypeVar("H")


class IndexObserver(Protocol):
    """Told of each key entering (`add`) and leaving (`discard`) an index, and of `clear`."""

    def add(self, key: bytes) -> None: ...

    def discard(self, key: bytes) -> None: ...

    def clear(self) -> None: ...


class PrefixIndex(Generic[H]):
    def __init__(self, observer: IndexObserver | None = None) -> None:
        self.observer = observer
        self._map: dict[bytes, tuple[H, int]] = {}
        # Aliases another holder also has, per key: the fallbacks when the holder the index points to goes.
        self._shadowed: dict[bytes, list[tuple[H, int]]] = {}
        self.get: Callable[[bytes], tuple[H, int] | None] = self._map.get  # the hot path: a bound dict.get

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def items(self) -> Iterator[tuple[bytes, tuple[H, int]]]:
        return iter(self._map.items())

    def observe(self, observer: IndexObserver | None) -> None:
        """Tell `observer` from now on (of every key indexed already, first)."""
        self.observer = observer
        if observer is not None:
            observer.clear()
            for key in self._map:
                observer.add(key)

    def add(self, holder: H, key: bytes, blocks: int, aliases: Sequence[bytes]) -> None:
        """Index `holder` under its own key (all `blocks`) and its aliases (leading blocks 1, 2, ...)."""
        observer = self.observer
        if observer is not None and key not in self._map:
            observer.add(key)
        self._map[key] = (holder, blocks)
        for j, alias in enumerate(aliases, start=1):
            if alias not in self._map:
                self._map[alias] = (holder, j)
                if observer is not None:
                    observer.add(alias)
            else:
                self._shadowed.setdefault(alias, []).append((holder, j))

    def remove(self, holder: H, key: bytes, aliases: Sequence[bytes]) -> None:
        """Forget `holder` under `key` and its aliases; an alias it held falls back to another holder."""
        observer = self.observer
        for k in (key, *aliases):
            found = self._map.get(k)
            if found is not None and found[0] is holder:
                del self._map[k]
            others = self._shadowed.get(k)
            if others is not None:
                others[:] = [o for o in others if o[0] is not holder]
                if k not in self._map and others:
                    self._map[k] = others.pop()
                if not others:
                    del self._shadowed[k]
            if observer is not None and (found is not None) != (k in self._map):
                (observer.add if found is None else observer.discard)(k)

    def superseded(self, aliases: Sequence[bytes], key_of: Callable[[H], bytes]) -> list[H]:
        """Holders stored as their own chunk under one of `aliases`: partial chunks a longer one replaces."""
        out = []
        for alias in aliases:
            found = self._map.get(alias)
            if found is not None and key_of(found[0]) == alias:
                out.append(found[0])
        return out

    def longest(self, block_keys: Sequence[bytes]) -> tuple[H, int] | None:
        """The holder of the longest leading run of `block_keys` (a chunk's block-prefix keys), and its length."""
        for j in range(len(block_keys), 0, -1):
            found = self._map.get(block_keys[j - 1])
            if found is not None:
                return found
        return None

    def run(self, chunks: Sequence[Sequence[bytes]]) -> list[tuple[H, int]]:
        """A lookup's answer (LowerTier.find_prefix): per chunk (its block keys), the holder of its longest
        leading run, up to the first chunk not held and through the first partial match."""
        out: list[tuple[H, int]] = []
        for block_keys in chunks:
            found = self.longest(block_keys)
            if found is None:
                break
            out.append(found)
            if found[1] < len(block_keys):
                break
        return out

    def clear(self) -> None:
        self._map.clear()
        self._shadowed.clear()
        if self.observer is not None:
            self.observer.clear()
