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
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_ITEMS = 65536

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


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    """Decode one frame into a map, or raise ProtocolError(BAD_REQUEST)."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(BAD_REQUEST, f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ProtocolError(BAD_REQUEST, f"undecodable msgpack: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError(BAD_REQUEST, "a request must be a msgpack map")
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
    carries hundreds of keys and per-key calls would cost more than the lookup itself. `join` rejects any
    non-bytes key; the total length catches wrong-sized ones (a wrong-sized key could never match anyway:
    every stored key is exactly KEY_BYTES)."""
    lists = list_field(message, name)
    if not lists:
        return lists
    lengths = set(map(len, lists)) if set(map(type, lists)) == {list} else {0}
    if min(lengths) < 1 or max(lengths) > max_keys:
        raise ProtocolError(BAD_REQUEST, f"each item of {name!r} is a list of 1 to {max_keys} keys")
    try:
        joined = b"".join(chain.from_iterable(lists))
    except TypeError:
        joined = b""
    if len(joined) != KEY_BYTES * sum(map(len, lists)):
        raise ProtocolError(BAD_REQUEST, f"every key in {name!r} must be {KEY_BYTES} bytes")
    return lists


def list_field(message: dict[str, Any], name: str) -> list[Any]:
    value = field(message, name, list)
    if len(value) > MAX_ITEMS:
        raise ProtocolError(BAD_REQUEST, f"field {name!r} has more than {MAX_ITEMS} items")
    return value


def int_field(message: dict[str, Any], name: str, lo: int, hi: int, default: Any = ...) -> int:
    value = field(message, name, int, default)
    if not lo <= value <= hi:
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be in [{lo}, {hi}]")
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
        if not isinstance(value, list) or len(value) != 4:
            raise ProtocolError(BAD_REQUEST, "a store item is [key, size, blocks, aliases]")
        key, size, blocks, aliases = value
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ProtocolError(BAD_REQUEST, "store item size must be a positive integer")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= 4096:
            raise ProtocolError(BAD_REQUEST, "store item blocks must be in [1, 4096]")
        if not isinstance(aliases, list) or len(aliases) >= blocks:
            raise ProtocolError(BAD_REQUEST, "store item aliases must be a list shorter than blocks")
        return cls(key_field(key), size, blocks, tuple(key_field(a, "alias") for a in aliases))
