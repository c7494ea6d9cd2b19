"""L1's listener that reports its chunks on the event bus (server/events.py): a commit (or promotion) is a
`Stored`, a removal a `Removed` with its reason. A clear's removals are not reported one by one: the cache posts
one `Cleared` for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.server.events import Bus, Removed, Stored
from kvtier.server.keys import Namespace
from kvtier.server.metrics import L1

if TYPE_CHECKING:
    from kvtier.server.l1.store import Entry


class L1Reporter:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    def committed(self, entry: Entry, namespace: Namespace | None) -> None:
        del namespace
        if self.bus.active:
            self.bus.post(Stored(L1, entry.ns, entry.key, entry.blocks, entry.aliases, entry.size, entry.tokens,
                                 entry.parent))

    def removed(self, entry: Entry, reason: str) -> None:
        if reason != "clear" and self.bus.active:
            self.bus.post(Removed(L1, entry.ns, entry.key, reason))

    def pinned(self, key: bytes, pins: int) -> None:
        """Pins are not reported."""
