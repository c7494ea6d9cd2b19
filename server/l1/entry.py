"""An L1 entry (one stored chunk: its key, namespace, pages and holds) and the listener protocol L1 tells of every
change to its entries (store.py; the journal and the event reporter are listeners)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvtier.server.keys import Namespace
from kvtier.server.l1.pool import Extents, extent_pages


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    ns: bytes
    size: int
    blocks: int
    extents: Extents
    aliases: tuple[bytes, ...]
    readers: int = 0
    pins: int = 0
    doomed: bool = False  # removed while held: its pages return when the last hold goes
    tokens: bytes = b""  # its token ids and parent key, when its client sent them (events.Stored)
    parent: bytes = b""
    tenant: str = "*"  # whose quota it counts against (l1/tenants.py)
    priority: int = 1  # its request's eviction class: an index into protocol.PRIORITIES
    kept: bool = False  # kept by a request hint (l1/retention.py): out of the eviction order meanwhile
    until: float = 0.0  # kept by `retain_s` until then (the holds' clock)
    session: str = ""  # kept while this session lives

    @property
    def pages(self) -> int:
        return extent_pages(self.extents)

    @property
    def evictable(self) -> bool:
        return not (self.readers or self.pins or self.doomed or self.kept)


def key_of(entry: Entry) -> bytes:
    return entry.key


class L1Listener(Protocol):
    """Told of each change on the serving loop, before it takes effect."""

    def committed(self, entry: Entry, namespace: Namespace | None) -> None: ...

    def removed(self, entry: Entry, reason: str) -> None: ...

    def pinned(self, key: bytes, pins: int) -> None: ...
