"""Wire protocol: msgpack maps over ZeroMQ DEALER (client) -> ROUTER (server). See docs/protocol.md.

Every request is one frame holding a map with `op` and an integer `id`; the reply carries the same `id`
and either `ok: true` plus results, or `ok: false` with a typed `code` and a human `error`.
Validation lives here so that the server and the client agree on the contract in one place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

import msgpack
import zmq
from kvtier.server.keys import KEY_BYTES, chains

PROTOCOL_VERSION = 3
# Bounds on what one frame may make the server build, checked while msgpack decodes (docs/protocol.md):
# the largest frame of the worst shape costs the serving loop a small fraction of a client timeout.
MAX_FRAME_BYTES = 4 * 1024 * 1024  # a lookup of a 3.6M-token prompt at 16-token blocks
MAX_ITEMS = 65536  # items of any list (chunks of a lookup, keys, ids)
MAX_STORE_ITEMS = 8192  # items of one reserve: 2M tokens of 256-token chunks (each item costs ~10 us)
MAX_MAP_FIELDS = 32  # fields of any map (a request, a namespace)
MAX_STR_BYTES = 1024  # any string (instance names, tokens, namespace fields)
MAX_BIN_BYTES = 64 << 10  # any byte string: keys and fingerprints are 16, a store item's tokens 4 per token
MAX_BLOCKS = 4096  # engine blocks of one chunk
MIN_BLOCK_BYTES = 1024  # L1 bytes a chunk's pages must hold per block: ties index size to L1 size

MAX_LAYERS = 1024  # layers of one registered GPU memory
MAX_EVENTS = 256  # interprocess events of one GPU registration

OPS = ("hello", "register", "lookup", "reserve", "commit", "abort", "acquire", "release", "heartbeat", "stats", "bye",
       "report", "gpu_register", "gpu_unregister", "gpu_store", "gpu_load", "end_session")

# What a `report` counts (docs/protocol.md): the connector's side of "the right answer or a recompute".
# Requests not looked up or stored because a fact of their identity could not be established:
SKIP_MODEL = "model_unknown"  # the model's weights cannot be fingerprinted (set kvtier.model_id)
SKIP_LORA = "lora_unknown"  # a LoRA adapter whose files cannot be read
SKIP_MM = "mm_unknown"  # a multimodal item without a hash or position
SKIP_EMBEDS = "prompt_embeds_unknown"  # prompt embeddings that cannot be read
SKIP_REASONS = (SKIP_MODEL, SKIP_LORA, SKIP_MM, SKIP_EMBEDS)
# Tokens a lookup promised to the engine that its load did not deliver (the engine recomputes them):
UNDELIVERED_UNREACHABLE = "unreachable"  # the server went away between the lookup and the load
UNDELIVERED_MISSING = "missing"  # the chunk was gone at load time (evicted, failed promotion, corrupt)
UNDELIVERED_LEASE_LOST = "lease_lost"  # the read outlived its lease: the bytes were not vouched for
UNDELIVERED_FAILED = "failed"  # the copy itself failed (an error in the connector or the copier)
UNDELIVERED_REASONS = (UNDELIVERED_UNREACHABLE, UNDELIVERED_MISSING, UNDELIVERED_LEASE_LOST, UNDELIVERED_FAILED)
MAX_REPORT_COUNT = 1 << 40

# Error codes (the `code` of a failed reply).
BAD_REQUEST = "bad_request"
UNKNOWN_OP = "unknown_op"
VERSION_MISMATCH = "version_mismatch"
NOT_REGISTERED = "not_registered"
UNKNOWN_NAMESPACE = "unknown_namespace"
UNAUTHORIZED = "unauthorized"
GPU_UNAVAILABLE = "gpu_unavailable"  # with a `reason` field: one of GPU_REASONS
UNKNOWN_REGISTRATION = "unknown_registration"  # a GPU registration id this server does not hold (restart)
INTERNAL = "internal"

# Reasons of a `gpu_unavailable` reply (docs/vllm.md): a GPU operation answered so is a miss, never wrong bytes.
NO_COPIER = "no_copier"  # the copy engine cannot run on this server (cupy absent, or the copier will not start)
NO_DEVICE = "no_device"  # the server sees no GPU with the registered UUID (CUDA_VISIBLE_DEVICES, containers)
IPC_REFUSED = "ipc_refused"  # the driver refused to open the memory or event handles (PID namespaces, MIG)
NOT_PINNED = "not_pinned"  # L1 is still being page-locked (progress in /status)
COPIER_FAILED = "copier_failed"  # the copier died or hung during this operation; it is being restarted
LATE = "late"  # a gpu_store/gpu_load whose copy could not start by its `start_by`: nothing was copied
GPU_REASONS = (NO_COPIER, NO_DEVICE, IPC_REFUSED, NOT_PINNED, COPIER_FAILED, LATE)

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
TENANT_MAX = "tenant_max"  # the tenant is at its maximum and none of its own chunks can make room (docs/tenants.md)
TENANT_GUARANTEE = "tenant_guarantee"  # the room is held by other tenants within their guaranteed shares
RETAINED = "retained"  # only chunks kept by request hints (retain_s, a live session) could make the room

# Request hints (docs/hints.md): a store's eviction class, how long to keep it, the session that keeps it.
PRIORITIES = ("low", "normal", "high")
MAX_SESSION_ID = 128
# Request hints a connector ignored (bad or unknown fields), counted by field in a `report`'s `hints_ignored`:
HINT_IGNORED_REASONS = ("not_a_map", "unknown_key", "store", "max_store_tokens", "retain_s", "priority", "session")
MAX_LOOKUP_RANKS = 1024  # other workers (TP ranks) one lookup may name: the frame limit bounds their keys


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields  # extra reply fields (the `reason` of gpu_unavailable)


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


def error(rid: int, code: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "ok": False, "code": code, "error": message, **fields}


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
    tokens: bytes = b""  # the chunk's token ids (uint32 LE) and its parent's key, for the event feed (keys.py)
    parent: bytes = b""

    def to_wire(self) -> list[Any]:
        wire = [self.key, self.size, self.blocks, list(self.aliases)]
        # a chunk of more than 16,384 tokens goes without them (its events then name no tokens)
        return wire + [self.tokens, self.parent] if 0 < len(self.tokens) <= MAX_BIN_BYTES else wire

    @classmethod
    def from_wire(cls, value: Any) -> StoreItem:
        """A checked item: the aliases (one per leading block, at most blocks - 1) are distinct and none is
        the item's own key (which would leave an index entry behind when the chunk goes)."""
        if not isinstance(value, list) or len(value) not in (4, 6):
            raise ProtocolError(BAD_REQUEST, "a store item is [key, size, blocks, aliases(, tokens, parent)]")
        key, size, blocks, aliases = value[:4]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ProtocolError(BAD_REQUEST, "store item size must be a positive integer")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= MAX_BLOCKS:
            raise ProtocolError(BAD_REQUEST, f"store item blocks must be in [1, {MAX_BLOCKS}]")
        if not isinstance(aliases, list) or len(aliases) >= blocks:
            raise ProtocolError(BAD_REQUEST, "store item aliases must be a list shorter than blocks")
        item = cls(key_field(key), size, blocks, tuple(key_field(a, "alias") for a in aliases))
        if len(value) == 6:
            tokens, parent = value[4:]
            if not isinstance(tokens, bytes) or not tokens or len(tokens) % 4:
                raise ProtocolError(BAD_REQUEST, "store item tokens must be uint32 token ids as bytes")
            item = replace(item, tokens=tokens, parent=key_field(parent, "parent") if parent else b"")
        if len(set(item.aliases) | {item.key}) != len(item.aliases) + 1:
            raise ProtocolError(BAD_REQUEST, "store item aliases must be distinct and differ from its key")
        return item

    def check_tokens(self, fingerprint: bytes, block_size: int) -> None:
        """BAD_REQUEST unless the item's tokens (when it has any) are its blocks' and give its key."""
        if self.tokens and (len(self.tokens) != 4 * block_size * self.blocks
                            or not chains(fingerprint, self.parent, self.tokens, self.key)):
            raise ProtocolError(BAD_REQUEST, "store item tokens do not give its key")

    def check_fits(self, blocks_per_chunk: int, page_bytes: int, min_block_bytes: int) -> None:
        """BAD_REQUEST unless the item fits its namespace's chunks and its `page_bytes` of L1 pages hold
        `min_block_bytes` per block (one block always fits): every index key costs L1 bytes."""
        if self.blocks > blocks_per_chunk:
            raise ProtocolError(BAD_REQUEST, f"store item of {self.blocks} blocks is longer than the "
                                f"namespace's {blocks_per_chunk}-block chunks")
        if self.blocks > max(1, page_bytes // min_block_bytes):
            raise ProtocolError(BAD_REQUEST, f"store item of {self.size} bytes claims {self.blocks} blocks: at "
                                f"most one per {min_block_bytes} bytes of its L1 pages")


@dataclass(frozen=True)
class Hint:
    """What a request asked of its stored chunks (docs/hints.md): kept at least `retain_s` seconds (within the
    server's bound), evicted in the order of `priority` (an index into PRIORITIES), kept while `session` lives.
    Sent as the `hint` map of a reserve; the connector leaves it out when the request gave none."""

    retain_s: float = 0.0
    priority: int = 1
    session: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"retain_s": self.retain_s, "priority": PRIORITIES[self.priority], "session": self.session}

    @classmethod
    def from_wire(cls, value: Any) -> Hint:
        if not isinstance(value, dict):
            raise ProtocolError(BAD_REQUEST, "hint must be a map of retain_s, priority, session")
        retain = value.get("retain_s", 0.0)
        priority = value.get("priority", "normal")
        session = value.get("session", "")
        if isinstance(retain, bool) or not isinstance(retain, int | float) or not 0 <= retain < float("inf"):
            raise ProtocolError(BAD_REQUEST, "hint retain_s must be a non-negative number of seconds")
        if priority not in PRIORITIES:
            raise ProtocolError(BAD_REQUEST, f"hint priority must be one of {', '.join(PRIORITIES)}")
        if not isinstance(session, str) or len(session) > MAX_SESSION_ID:
            raise ProtocolError(BAD_REQUEST, f"hint session must be a string of at most {MAX_SESSION_ID} characters")
        return cls(float(retain), PRIORITIES.index(priority), session)


NO_HINT = Hint()


def int_field(message: dict[str, Any], name: str, low: int, high: int, default: Any = ...) -> int:
    value = field(message, name, int, default)
    if not low <= value <= high:
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be in [{low}, {high}]")
    return value


def int_list_field(message: dict[str, Any], name: str, low: int, high: int, max_items: int = MAX_ITEMS) -> list[int]:
    values = list_field(message, name, max_items)
    if not all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in values):
        raise ProtocolError(BAD_REQUEST, f"field {name!r} must be a list of integers in [{low}, {high}]")
    return values


@dataclass(frozen=True)
class GpuMemory:
    """A GPU engine's KV allocation as a worker registers it (`gpu_register`), checked here once so that the
    server can bounds-check every copy against it.

    Engine block `b` of layer `l` is a page of `page_bytes` made of `runs` contiguous pieces of
    `page_bytes // runs` bytes: piece `h` sits at byte `layer_offsets[l] + b * block_stride + h * run_stride` of
    the allocation (one piece unless the layout puts heads outside blocks, as LHBNC and BHLNC do). In L1 a
    chunk of m blocks holds its pages layer-major ((l * m + j) pages in) for layer-outer layouts and
    block-major ((j * L + l) pages in) for block-outer ones (`block_major`), so that whole blocks stay one run
    on both sides where the engine's memory allows it.
    """

    engine: str  # "cuda", "host" (a CPU worker's memory, server/transfer/host.py) or "fake" (the CPU stand-in)
    device: str  # the GPU's UUID ("GPU-..."), or the fake device's name
    handle: bytes  # cudaIpcMemHandle_t of the allocation (64 bytes), or the fake device's shm name
    alloc_size: int
    layer_offsets: tuple[int, ...]
    block_stride: int
    num_blocks: int
    page_bytes: int
    runs: int
    run_stride: int
    layout: str  # vLLM's name of the physical order: LBNHC, LBHNC, LHBNC, BLHNC, BLNHC, BHLNC
    events: tuple[bytes, ...]  # interprocess event handles (64 bytes each for cuda)
    pid: int

    ENGINES = ("cuda", "fake", "host")
    LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
    HOST = struct.Struct("<QQ16s")  # a "host" handle: base address, token address, token (transfer/host.py)

    @property
    def block_major(self) -> bool:
        return self.layout.startswith("B")

    @property
    def run_bytes(self) -> int:
        return self.page_bytes // self.runs

    @property
    def num_layers(self) -> int:
        return len(self.layer_offsets)

    def to_wire(self) -> dict[str, Any]:
        return {"engine": self.engine, "device": self.device, "handle": self.handle, "alloc_size": self.alloc_size,
                "layer_offsets": list(self.layer_offsets), "block_stride": self.block_stride,
                "num_blocks": self.num_blocks, "page_bytes": self.page_bytes, "runs": self.runs,
                "run_stride": self.run_stride, "layout": self.layout, "events": list(self.events), "pid": self.pid}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> GpuMemory:
        """A checked registration: every page of every layer lies inside the allocation, pieces of one page do
        not overlap, nor (one-piece pages) those of neighbouring blocks."""
        big = 1 << 62
        engine = field(m, "engine", str)
        layout = field(m, "layout", str)
        if engine not in cls.ENGINES or layout not in cls.LAYOUTS:
            raise ProtocolError(BAD_REQUEST, f"engine must be one of {cls.ENGINES}, layout one of {cls.LAYOUTS}")
        events = list_field(m, "events", MAX_EVENTS)
        if not events or not all(isinstance(e, bytes) and e for e in events):
            raise ProtocolError(BAD_REQUEST, f"events must be 1 to {MAX_EVENTS} byte strings")
        handle = field(m, "handle", bytes)
        if not handle:
            raise ProtocolError(BAD_REQUEST, "handle must not be empty")
        memory = cls(engine, field(m, "device", str), handle, int_field(m, "alloc_size", 1, big),
                     tuple(int_list_field(m, "layer_offsets", 0, big, MAX_LAYERS)), int_field(m, "block_stride", 1, big),
                     int_field(m, "num_blocks", 1, 1 << 40), int_field(m, "page_bytes", 1, 1 << 40),
                     int_field(m, "runs", 1, 1 << 20), int_field(m, "run_stride", 0, big), layout, tuple(events),
                     int_field(m, "pid", 0, 1 << 31))
        memory.check()
        return memory

    def check(self) -> None:
        if not self.layer_offsets:
            raise ProtocolError(BAD_REQUEST, "a GPU memory has at least one layer")
        if self.page_bytes % self.runs:
            raise ProtocolError(BAD_REQUEST, "page_bytes must be a multiple of runs")
        if self.runs > 1 and self.run_stride < self.run_bytes:
            raise ProtocolError(BAD_REQUEST, "the pieces of a page overlap (run_stride < page_bytes / runs)")
        if self.runs == 1 and self.run_stride:
            raise ProtocolError(BAD_REQUEST, "run_stride must be 0 for one-piece pages")
        page_span = (self.runs - 1) * self.run_stride + self.run_bytes
        if self.runs == 1 and self.block_stride < self.page_bytes:
            raise ProtocolError(BAD_REQUEST, "pages of neighbouring blocks overlap (block_stride < page_bytes)")
        last = max(self.layer_offsets) + (self.num_blocks - 1) * self.block_stride + page_span
        if last > self.alloc_size:
            raise ProtocolError(BAD_REQUEST, f"the registered layers reach byte {last} of a {self.alloc_size}-byte "
                                "allocation")

    def page_pieces(self, layer: int, block: int) -> list[tuple[int, int]]:
        """(allocation offset, bytes) of the pieces of one page, in L1 order."""
        base = self.layer_offsets[layer] + block * self.block_stride
        return [(base + h * self.run_stride, self.run_bytes) for h in range(self.runs)]


# -- the event feed's replay socket, consumer side (server/feed.py, docs/events.md) ---------------

FEED_SNAPSHOT = b"snapshot"  # the request for a snapshot; else a start sequence as 8 bytes big-endian
FEED_END = (-1).to_bytes(8, "big", signed=True)  # the sequence frame of the end marker


def feed_request(ctx: zmq.Context, endpoint: str, what: bytes, timeout_ms: int = 20_000) -> list[tuple[int, dict]]:
    """A consumer's request on the replay socket at `endpoint` (a start sequence as 8 bytes big-endian, or
    SNAPSHOT): the (sequence, payload) answers up to the end marker. TimeoutError if an answer takes longer."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", what])
    out = []
    try:
        while True:
            if not dealer.poll(timeout_ms):
                raise TimeoutError(f"no answer from the event feed's replay socket {endpoint}")
            _, seq, payload = dealer.recv_multipart()
            if seq == FEED_END:
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    finally:
        dealer.close()
