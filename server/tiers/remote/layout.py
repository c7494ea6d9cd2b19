"""The remote tier's layout in the store: key names (a named tenant's under its own base), part sizing, the
alias record format, the Cluster slot (the package docstring, __init__.py, draws the keys). No I/O, nothing of
glide."""

from __future__ import annotations

import binascii
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.server.tenants import DEFAULT_TENANT
from kvtier.server.tiers.record import hasher

PART_BYTES = 1 << 20  # one value per MiB: multi-MB values move ~2.5x slower (reference/remote-tier.md)
GROUP_PARTS = 8  # parts a read asks for in one MGET: Redis 7 serves one reply of 32 MiB ~2x slower than 4 of 8
GEN_BYTES = 8
ALIAS = struct.Struct("<16sI")  # one holder in an alias key's value: chunk key, leading blocks
ALIAS_HOLDERS = 8  # holders a probe tries per alias key (the newest) and a compaction keeps
ALIAS_COMPACT_BYTES = 2 * ALIAS_HOLDERS * ALIAS.size  # an alias value grown past this is compacted by its writer
PART_TTL_MARGIN_MS = 60_000  # parts outlive their header by this much
CLUSTER_SLOTS = 16384
TENANT_TAG = "t"  # <prefix>:t:<tenant>:... holds a named tenant's keys (a namespace's hex is never "t")
# A tenant name that can be a key base: tenants.py's names less ":" (the ACL pattern `~<prefix>:t:a:*` would
# also match tenant "a:b"'s keys), none of them special in a SCAN or ACL glob.
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.@/+-]{1,128}$")


def tenant_base(prefix: str, tenant: str) -> str:
    """Where `tenant`'s keys start: the prefix itself for the default tenant (the layout from before
    tenants), `<prefix>:t:<tenant>` for a named one; ValueError for a name that cannot be one."""
    if tenant == DEFAULT_TENANT:
        return prefix
    if not _TENANT_NAME.match(tenant):
        raise ValueError(f"tenant {tenant!r} cannot name remote keys: use 1-128 of A-Z a-z 0-9 _ . @ / + - "
                         "(no ':', which would let one tenant's ACL key pattern match another's keys)")
    return f"{prefix}:{TENANT_TAG}:{tenant}"


def acl_key_pattern(prefix: str, tenant: str) -> str:
    """The ACL key pattern (`~...`) that grants `tenant`'s keys and no other tenant's (the default tenant's:
    every key under the prefix)."""
    return f"~{tenant_base(prefix, tenant)}:*"


def key_name(base: str, ns: bytes, key: bytes, suffix: str) -> str:
    """`<base>:<ns>:{<key>}:<suffix>` (`base`: `tenant_base`): "h" (header), "a" (alias holders), "<gen>:<i>"
    (part i)."""
    return f"{base}:{ns.hex()}:{{{key.hex()}}}:{suffix}"


def part_key_name(base: str, ns: bytes, key: bytes, gen: bytes, i: int) -> str:
    return key_name(base, ns, key, f"{gen.hex()}:{i}")


def parts_of(size: int) -> int:
    """How many parts a `size`-byte payload is stored in."""
    return -(-size // PART_BYTES)


@dataclass(slots=True)
class Prepared:
    """A put's CPU work, done by `prepare` on the writer's first stage: the header value and the parts."""

    header: bytes  # generation + record header
    parts: list  # buffers, PART_BYTES each but the last (views of the sources where a part lies in one)


def pieces(bufs: Sequence, size: int) -> list[list[memoryview]]:
    """Per part of a `size`-byte payload held in `bufs` (in order), the views of `bufs` it covers: one,
    unless the part crosses the end of a buffer."""
    parts: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled, left = 0, size
    for buf in bufs:
        view = memoryview(buf).cast("B")
        off = 0
        while off < len(view) and left:
            take = min(PART_BYTES - filled, len(view) - off, left)
            current.append(view[off : off + take])
            filled += take
            off += take
            left -= take
            if filled == PART_BYTES or not left:
                parts.append(current)
                current, filled = [], 0
    if left:
        raise ValueError(f"buffers hold {size - left} of the chunk's {size} bytes")
    return parts


def verified(bufs: Sequence, size: int, fields: bytes, checksum: bytes) -> bool:
    """Whether the first `size` bytes of `bufs` (in order) and the header `fields` have `checksum`."""
    h = hasher(fields)
    for part in pieces(bufs, size):
        for piece in part:
            h.update(piece)
    return h.digest() == checksum


def holders(value: bytes) -> list[bytes]:
    """An alias key's holder records (ALIAS each, appended: the newest last), newest first, each once, at
    most ALIAS_HOLDERS. Bytes before the first whole record are not kvtier's and are ignored (a record is
    verified against its chunk's header before it is used). A value an earlier kvtier wrote (one record,
    SET NX) reads as its one holder."""
    out: list[bytes] = []
    for end in range(len(value), len(value) % ALIAS.size, -ALIAS.size):
        record = value[end - ALIAS.size : end]
        if record not in out:
            out.append(record)
            if len(out) == ALIAS_HOLDERS:
                break
    return out


def slot(tag: bytes) -> int:
    """The Cluster slot of keys whose hash tag is `tag` (CRC16/XMODEM mod 16384)."""
    return binascii.crc_hqx(tag, 0) % CLUSTER_SLOTS

