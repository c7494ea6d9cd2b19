"""Wire protocol: msgpack maps over ZeroMQ DEALER (client) -> ROUTER (server). See docs/protocol.md.

Every request is one frame holding a map with `op` and an integer `id`; the reply carries the same `id`
and either `ok: true` plus results, or `ok: false` with a typed `code` and a human `error`.
Validation lives here so that the server and the client agree on the contract in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
from kvtier.server.keys import KEY_BYTES

PROTOCOL_VERSION = 2
# Bounds on what one frame may make the server build, checked while msgpack decodes (docs/protocol.md):
# the largest frame of the worst shape costs the serving loop a small fraction of a client timeout.
MAX_FRAME_BYTES = 4 * 1024 * 1024  # a lookup of a 3.6M-token prompt at 16-token blocks
MAX_ITEMS = 65536  # items of any list (chunks of a lookup, keys, ids)
MAX_STORE_ITEMS = 8192  # items of one reserve: 2M tokens of 256-token chunks (each item costs ~10 us)
MAX_MAP_FIELDS = 32  # fields of any map (a request, a namespace)
MAX_STR_BYTES = 1024  # any string (instance names, tokens, namespace fields)
MAX_BIN_BYTES = 64  # any byte string (keys and fingerprints are 16)
MAX_BLOCKS = 4096  # engine blocks of one chunk
MIN_BLOCK_BYTES = 1024  # L1 bytes a chunk's pages must hold per block: ties index size to L1 size

OPS = ("hello", "register", "lookup", "reserve", "commit", "abort", "acquire", "release", "heartbeat", "stats", "bye")

# Error codes (the `code` of a failed reply).
BAD_REQUEST = "bad_request"
UNKNOWN_OP = "unknown_op"
VERSION_MISMATCH = "version_mismatch"
NOT_REGISTERED = "not_registered"
UNKNOWN_NAMESPACE = "unknown_namespace"
UNAUTHORIZED = "unauthorized"
INTERNAL = "internal"

# Per-item statuses of `reserve`.
RESERVED = "ok"
EXISTS = "exists"
BUSY = "busy"
REFUSED = "refused"

# Refusal reasons (counted by the server, visible to the client).
NO_SPACE = "no_space"
TOO_LARGE = "too_large"
NOT_ADMITTED = "not_admitted"  # L1 is full and the policy keeps what it holds (docs/performance.md, eviction)
PREFIX_REFUSED = "prefix_refused"  # an earlier item of the same reserve was refused: this one is unreachable


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


_REQUEST_LIMITS = {"max_str_len": MAX_STR_BYTES, "max_bin_len": MAX_BIN_BYTES, "max_array_len": MAX_ITEMS,
                   "max_map_len": MAX_MAP_FIELDS, "max_ext_len": 0}


def unpack(frame: bytes) -> dict[str, Any]:
    """Decode one request frame into a map, or raise ProtocolError(BAD_REQUEST). The size limits apply
    while msgpack decodes, before any oversized object is built."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(BAD_REQUEST, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return _decode(frame, "request", _REQUEST_LIMITS)


def unpack_reply(frame: bytes) -> dict[str, Any]:
    """Decode a reply from the server (a client trusts its server's sizes, never its page numbers)."""
    return _decode(frame, "reply", {})


def _decode(frame: bytes, what: str, limits: dict[str, int]) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, **limits)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt or oversized input
        raise ProtocolError(BAD_REQUEST, f"undecodable or oversized msgpack: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_REQUEST, f"a {what} must be a msgpack map")
    return message


def request_id(message: dict[str, Any]) -> int:
    rid = message.get("id", 0)
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0


def ok(rid: int, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **fields}


def error(rid: int, code: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "code": code, "error": message}


def field(message: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """A typed field of a request; missing or mistyped fields are BAD_REQUEST."""
    if name not in message:
        if default is ...:
            raise ProtocolError(BAD_REQUEST, f"missing field {name!r}")
        return default
    value = message[name]
    if isinstance(value, bool) and kind is not bool:
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be {_kind_name(kind)}")
    if not isinstance(value, kind):
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


def key_field(value: Any, what: str = "key") -> bytes:
    if not isinstance(value, bytes) or len(value) != KEY_BYTES:
        raise ProtocolError(BAD_REQUEST, f"{what} must be {KEY_BYTES} bytes")
    return value


def key_lists_field(message: dict[str, Any], name: str, max_keys: int = 4096) -> list[list[bytes]]:
    """A list of non-empty lists (at most `max_keys` each) of keys, checked in whole-list passes: a lookup
    carries hundreds of keys and per-key calls would cost more than the lookup itself: one C-level pass,
    `bytes.__len__` over every key, checks both type and length."""
    lists = list_field(message, name)
    if not lists:
        return lists
    try:
        lengths = set(map(list.__len__, lists))  # TypeError for anything but lists
    except TypeError:
        lengths = {0}
    if min(lengths) < 1 or max(lengths) > max_keys:
        raise ProtocolError(BAD_REQUEST, f"each item of {name!r} is a list of 1 to {max_keys} keys")
    try:
        sizes = set(map(bytes.__len__, chain.from_iterable(lists)))  # TypeError for anything but bytes
    except TypeError:
        sizes = set()
    if sizes != {KEY_BYTES}:
        raise ProtocolError(BAD_REQUEST, f"every key in {name!r} must be {KEY_BYTES} bytes")
    return lists


def list_field(message: dict[str, Any], name: str, max_items: int = MAX_ITEMS) -> list[Any]:
    value = field(message, name, list)
    if len(value) > max_items:
        raise ProtocolError(BAD_REQUEST, f"field {name!r} has more than {max_items} items")
    return value


@dataclass(frozen=True)
class StoreItem:
    """One chunk to store: its key, byte size, the engine blocks it holds and its leading-block aliases."""

    key: bytes
    size: int
    blocks: int
    aliases: tuple[bytes, ...]

    def to_wire(self) -> list[Any]:
        return [self.key, self.size, self.blocks, list(self.aliases)]

    @classmethod
    def from_wire(cls, value: Any) -> StoreItem:
        """A checked item: the aliases (one per leading block, at most blocks - 1) are distinct and none is
        the item's own key (which would leave an index entry behind when the chunk goes)."""
        if not isinstance(value, list) or len(value) != 4:
            raise ProtocolError(BAD_REQUEST, "a store item is [key, size, blocks, aliases]")
        key, size, blocks, aliases = value
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ProtocolError(BAD_REQUEST, "store item size must be a positive integer")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= MAX_BLOCKS:
            raise ProtocolError(BAD_REQUEST, f"store item blocks must be in [1, {MAX_BLOCKS}]")
        if not isinstance(aliases, list) or len(aliases) >= blocks:
            raise ProtocolError(BAD_REQUEST, "store item aliases must be a list shorter than blocks")
        item = cls(key_field(key), size, blocks, tuple(key_field(a, "alias") for a in aliases))
        if len(set(item.aliases) | {item.key}) != len(item.aliases) + 1:
            raise ProtocolError(BAD_REQUEST, "store item aliases must be distinct and differ from its key")
        return item

    def check_fits(self, blocks_per_chunk: int, page_bytes: int, min_block_bytes: int) -> None:
        """BAD_REQUEST unless the item fits its namespace's chunks and its `page_bytes` of L1 pages hold
        `min_block_bytes` per block (one block always fits): every index key costs L1 bytes."""
        if self.blocks > blocks_per_chunk:
            raise ProtocolError(BAD_REQUEST, f"store item of {self.blocks} blocks is longer than the "
                                f"namespace's {blocks_per_chunk}-block chunks")
        if self.blocks > max(1, page_bytes // min_block_bytes):
            raise ProtocolError(BAD_REQUEST, f"store item of {self.size} bytes claims {self.blocks} blocks: at "
                                f"most one per {min_block_bytes} bytes of its L1 pages")
