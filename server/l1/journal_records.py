"""L1's journal records: their types, their encoding, and the bounds a journal half is sized by
(docs/warm-restart.md). The framing and its crash safety are shm/journal.py's; this is what the records say;
journal.py writes them, replay.py reads them back.

Records (msgpack payloads):

    NAMESPACE  fingerprint, Namespace fields          before the first COMMIT of that namespace
    COMMIT     key, ns, size, blocks, aliases, extents  before the entry is indexed (a commit or a promotion)
    REMOVE     key                                      before any page of the removed entry can be reused
    ALLOC      extents, client, rid                     before the pages leave the pool (to a reservation, a
                                                        promotion): nobody can write a page unlogged; `client`
                                                        names the lock file (shm/client_lock.py) of the client
                                                        that writes them (its 32 hex digits) and `rid` its
                                                        reservation ("", 0: no client writes them: a promotion,
                                                        a GPU copy)
    FREE       extents                                  before the pages rejoin the pool
    PIN        key, pins                                before an entry's pin count changes (to `pins`); a
                                                        REMOVE or a new COMMIT of the key ends its pins

Every record is appended before its effect, so a daemon killed between the two leaves a journal that is
behind on nothing that matters: a page it names as allocated may be free (it stays quarantined a while),
never the reverse. Pages are logged at the pool (PagePool.log), so every path that takes or returns pages
(reservations, promotions, removed entries still being read, the quarantine) is covered by two hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
from kvtier.server.keys import KEY_BYTES, MAX_NS_STR, Namespace
from kvtier.server.l1.pool import Extents
from kvtier.shm.journal import RECORD_OVERHEAD, frame

VERSION = 3  # the records' format; a journal of another version is never adopted (1: ALLOC without its writer,
# 2: without PIN)
NAMESPACE, COMMIT, REMOVE, ALLOC, FREE, PIN = 1, 2, 3, 4, 5, 6
SLACK = 1 << 20
MAX_NAMESPACES = 4096  # store.MAX_NAMESPACES (not imported: store imports the journal)
# Upper bounds of encoded sizes, for half_bytes: a record's fixed part, each extent pair, each alias, and a
# namespace (five strings of MAX_NS_STR characters of up to 4 UTF-8 bytes, seven integers, twelve names).
_ENTRY_MAX = RECORD_OVERHEAD + 96
_PIN_MAX = RECORD_OVERHEAD + KEY_BYTES + 2 + 9 + 1
_EXTENT_MAX = 10
_WRITER_MAX = 2 + 34 + 9  # an ALLOC's writer: its client's lock id (32 hex digits) and its reservation id
_ALIAS_MAX = KEY_BYTES + 2
_NAMESPACE_MAX = RECORD_OVERHEAD + 64 + 5 * (4 * MAX_NS_STR + 3) + 7 * 9 + 12 * 16

_pack = msgpack.Packer(use_bin_type=True).pack


def half_bytes(num_pages: int, page_size: int, min_block_bytes: int) -> int:
    """Bytes of each journal half: twice the largest snapshot `num_pages` pages can need, plus SLACK.

    Every page belongs to at most one snapshot record (a COMMIT or an ALLOC), every extent pair holds a page,
    every alias a block of at least `min_block_bytes`, every entry has at most one PIN, and only namespaces
    with an entry are written. The
    file is sparse: memory is used by what is written, about twice the live records at most.
    """
    aliases = num_pages * page_size // min_block_bytes
    snapshot = (num_pages * (_ENTRY_MAX + _EXTENT_MAX + _WRITER_MAX + _PIN_MAX) + aliases * _ALIAS_MAX
                + min(num_pages, MAX_NAMESPACES) * _NAMESPACE_MAX)
    return -(-(2 * snapshot + SLACK) // 4096) * 4096


@dataclass(frozen=True, slots=True)
class Unheld:
    """Allocated pages no entry holds, and who may still write them: the client whose lock file's id (the 32
    hex digits that end its name, shm/client_lock.py) is `client`, for its reservation `rid` ("", 0: no client:
    a promotion, a GPU copy, a removed entry still being read)."""

    extents: Extents
    client: str
    rid: int

    def record(self) -> bytes:
        return frame(ALLOC, _pack((self.extents, self.client, self.rid)))


NO_WRITER = Unheld((), "", 0)


def pin_record(key: bytes, pins: int) -> bytes:
    return frame(PIN, _pack((key, pins)))


def namespace_record(fp: bytes, namespace: Namespace) -> bytes:
    return frame(NAMESPACE, _pack((fp, namespace.to_dict())))


def commit_record(key: bytes, ns: bytes, size: int, blocks: int, aliases: tuple[bytes, ...],
                  extents: Extents) -> bytes:
    return frame(COMMIT, _pack((key, ns, size, blocks, aliases, extents)))


def remove_record(key: bytes) -> bytes:
    return frame(REMOVE, _pack(key))


def free_record(extents: Extents) -> bytes:
    return frame(FREE, _pack(extents))
