"""What L1's holds are made of (the rules that create, lapse and end them are holds.py's): a registered client,
a write reservation, a read lease, and where a leased chunk's bytes are."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.server import protocol as p
from kvtier.server.l1.entry import Entry
from kvtier.server.l1.pool import Extents

MAX_CLIENT_NAMESPACES = 64
CLIENT_ID_DIGITS = 32  # a lock file's name ends in its client's id, 32 hex digits (shm/client_lock.py)


@dataclass(slots=True, eq=False)
class ClientState:
    ident: bytes
    instance: str
    pid: int
    last_seen: float
    lock: str = ""  # the client's liveness lock file beside the segment ("" = none: it may not hold pages)
    reservations: set[int] = field(default_factory=set)  # live and lapsed
    leases: set[int] = field(default_factory=set)
    namespaces: set[bytes] = field(default_factory=set)  # fingerprints it registered


@dataclass(slots=True, eq=False)
class Reservation:
    rid: int
    owner: ClientState
    ns: bytes
    item: p.StoreItem
    extents: Extents
    deadline: float
    lapsed: bool = False  # expired or its client retired: not committable, pages held back
    copying: bool = False  # a copier writes its pages (GPU engines): never freed before the copy ended
    hint: p.Hint = p.NO_HINT  # its request's hint (l1/retention.py)


@dataclass(slots=True)
class Lease:
    lid: int
    owner: ClientState
    entries: list[Entry]
    deadline: float
    lapsed: bool = False  # expired or its client retired: the read is lost, its entries stay put
    copying: bool = False  # a copier reads its pages (GPU engines): never ended before the copy ended


@dataclass(frozen=True, slots=True)
class AcquiredChunk:
    """Where a leased chunk's bytes are: `match` leading blocks of its `blocks` are wanted."""

    blocks: int
    match: int
    size: int
    extents: Extents

    def to_wire(self) -> list:
        return [self.blocks, self.match, self.size, list(self.extents)]
