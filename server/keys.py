"""Namespace fingerprints and prefix-chained chunk keys: the contract shared by server and clients.

key_{-1} = H(namespace); key_i = H(key_{i-1} || token ids of chunk i as little-endian uint32).
Each chunk is also findable by the keys of its block-boundary prefixes: the key of the first j blocks of
chunk i is H(key_{i-1} || tokens of those j blocks), so the full-chunk key is the j = blocks-per-chunk case
and a lookup can end inside a stored chunk at engine-block granularity.

A request identity (what changes KV for the same token ids: a LoRA adapter, images at their positions,
prompt embeddings) enters the chain too: its root into key_{-1} = H(namespace || "id" || root), and a block's
extra digest right after that block's tokens, behind the word 0xFFFFFFFF that no token id may take, so the
hashed stream decodes one way only (docs/vllm.md, "What is in the key").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import blake3
import msgpack
import numpy as np

KEY_BYTES = 16
# Bounds on a namespace sent by a client (docs/protocol.md).
MAX_NS_STR = 512
MAX_NS_INT = 1 << 20
MAX_BLOCKS_PER_CHUNK = 4096
# The version of the bytes a chunk holds (engine blocks as whole pages, layer-major): part of every namespace.
PAYLOAD_FORMAT = 1
_EXTRA_MARK = b"\xff\xff\xff\xff"  # precedes a block's extra digest; token ids stay below 0xFFFFFFFF


def digest(data: bytes) -> bytes:
    """16-byte BLAKE3 digest: deterministic across processes and machines (never Python's hash())."""
    return blake3.blake3(data).digest(length=KEY_BYTES)


@dataclass(frozen=True)
class Namespace:
    """Every fact that makes KV bytes interchangeable; any difference means no sharing."""

    model: str
    dtype: str
    num_layers: int
    kv_heads: int
    head_size: int
    block_size: int
    layout: str
    chunk_size: int = 256
    tp_size: int = 1
    tp_rank: int = 0
    revision: str = ""
    cache_salt: str = ""
    pp_size: int = 1
    pp_rank: int = 0
    model_fingerprint: str = ""  # the weights and config (or an operator-set model id), see identity.py
    payload_format: int = PAYLOAD_FORMAT

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.chunk_size <= 0:
            raise ValueError("block_size and chunk_size must be positive")
        if self.chunk_size % self.block_size:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of block_size {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside pp_size {self.pp_size}")

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Namespace:
        """A namespace from a client: every field checked for type and size before anything is built."""
        if not isinstance(data, dict):
            raise ValueError("namespace must be a map")
        fields = cls.__dataclass_fields__
        if len(data) > len(fields):
            raise ValueError(f"a namespace has at most {len(fields)} fields")
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise ValueError(f"unknown namespace fields: {sorted(map(str, unknown))[:5]}")
        for name, value in data.items():
            _check_field(name, fields[name].type, value)
        ns = cls(**data)
        if ns.blocks_per_chunk > MAX_BLOCKS_PER_CHUNK:
            raise ValueError(f"a chunk may hold at most {MAX_BLOCKS_PER_CHUNK} blocks")
        return ns

    def fingerprint(self) -> bytes:
        """Canonical encoding (sorted keys) hashed: equal namespaces give equal fingerprints everywhere."""
        return _fingerprint(self)


@functools.lru_cache(maxsize=4096)
def _fingerprint(ns: Namespace) -> bytes:
    """Namespace.fingerprint, remembered: every key chain starts from it, and the scheduler computes a new
    request's keys (from one of a few namespaces) on its scheduling path."""
    canonical = msgpack.packb(_sorted(ns.to_dict()), use_bin_type=True)
    return digest(b"kvtier-ns-v1\x00" + canonical)


def _check_field(name: str, kind: object, value: object) -> None:
    if kind == "str":
        if not isinstance(value, str) or len(value) > MAX_NS_STR:
            raise ValueError(f"namespace field {name!r} must be a string of at most {MAX_NS_STR} characters")
    elif isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NS_INT:
        raise ValueError(f"namespace field {name!r} must be an integer in [0, {MAX_NS_INT}]")


def _sorted(value: object) -> object:
    if isinstance(value, dict):
        return [[k, _sorted(value[k])] for k in sorted(value)]
    return value


@dataclass(frozen=True)
class RequestIdentity:
    """What makes a request's KV differ from another's with the same token ids in one namespace.

    `root`: a digest of request-wide facts (a LoRA adapter's weights); b"" when there are none.
    `blocks`: (engine block index, digest of that block's extra facts: images overlapping it, its prompt
    embedding rows), sorted by block index.
    """

    root: bytes = b""
    blocks: tuple[tuple[int, bytes], ...] = ()

    @property
    def plain(self) -> bool:
        return not self.root and not self.blocks


PLAIN = RequestIdentity()


@dataclass(frozen=True)
class ChunkKeys:
    """Keys of one chunk: `block_keys[j-1]` is the key of its first j blocks; the last is the chunk's own key."""

    index: int
    start_token: int
    num_blocks: int
    block_keys: tuple[bytes, ...]
    # What an event consumer needs to hash the chunk its own way (docs/events.md): the key of the chunk before
    # it (b"" for the first) and its token ids as little-endian uint32; b"" for a request with an identity
    # (LoRA, multimodal, embeddings), whose key a consumer cannot recompute from token ids.
    parent: bytes = b""
    tokens: bytes = b""

    @property
    def key(self) -> bytes:
        return self.block_keys[-1]

    @property
    def full(self) -> bool:
        return len(self.block_keys) == self.num_blocks

    @property
    def aliases(self) -> tuple[bytes, ...]:
        """Keys of the leading-block prefixes shorter than the chunk itself."""
        return self.block_keys[:-1]


def chunk_keys(namespace: Namespace, token_ids: Sequence[int] | np.ndarray,
               identity: RequestIdentity = PLAIN) -> list[ChunkKeys]:
    """Keys for every chunk of `token_ids` that holds at least one whole engine block.

    The last chunk may be partial; its trailing tokens that do not fill a block are ignored. Only full
    chunks continue the chain, so a partial chunk is always the last one.
    """
    tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    if tokens.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32 (0xFFFFFFFF is reserved)")
    data = tokens.astype("<u4").tobytes()
    bs, cs = namespace.block_size, namespace.chunk_size
    usable = (len(tokens) // bs) * bs
    root = namespace.fingerprint()
    if identity.root:
        root += b"id" + identity.root
    prev = digest(root)
    extras = dict(identity.blocks)
    out: list[ChunkKeys] = []
    for index, start in enumerate(range(0, usable, cs)):
        end = min(start + cs, usable)
        hasher = blake3.blake3(prev)
        keys = []
        for b in range(start, end, bs):
            hasher.update(data[b * 4 : (b + bs) * 4])
            extra = extras.get(b // bs) if extras else None
            if extra is not None:
                hasher.update(_EXTRA_MARK + extra)
            keys.append(hasher.digest(length=KEY_BYTES))
        out.append(ChunkKeys(index, start, namespace.blocks_per_chunk, tuple(keys), out[-1].key if out else b"",
                             b"" if identity.root or extras else data[start * 4 : end * 4]))
        prev = keys[-1]
    return out


def chains(fingerprint: bytes, parent: bytes, tokens: bytes, key: bytes) -> bool:
    """Whether `key` is the key of a chunk of `tokens` (little-endian uint32) after the chunk `parent` (b"": the
    first chunk of namespace `fingerprint`, without a request identity): a client's claim checked."""
    return digest((parent or digest(fingerprint)) + tokens) == key
