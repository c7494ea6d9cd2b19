"""What every lower tier shares about a stored chunk: its record (`ChunkMeta`), the record's header (layout,
encode, decode), its checksum (XXH3-128) and `CorruptChunk`. No file I/O: that is fs_io.py's.

The split between this module and fs_io.py follows one question, "would a Redis tier need it?": the record's
fields, the bytes of its header and the checksum that makes a stored copy trusted, yes (here); file names,
temp files, fsync, O_DIRECT and the aligned buffers that serve it, no (fs_io.py).

A record's bytes are a header, zero padding up to the next `ALIGN` (4096-byte) boundary, the chunk's payload,
and zero padding up to the next boundary again:

    magic "KVL2" | version u16 | header length u16 | flags u32 | payload length u64 | blocks u32 |
    alias count u32 | key (16) | namespace fingerprint (16) | aliases (16 each) | header crc32 u32 |
    checksum (16: XXH3-128 of every header byte before it, then the payload) | zeros | payload | zeros

The payload length field is the true length; the payload starts at `data_offset` and the record holds
`file_bytes` (both multiples of ALIGN). One layout serves every way of moving it: O_DIRECT reads and writes
whole aligned blocks of any file, a buffered reader reads the same bytes, whichever mode wrote them. The
padding must be zero: a reader checks it (it is not under the checksum).

The header alone says whether a record is plausibly whole (the crc32 guards the fields; the filesystem tier
also checks the file's size against `file_bytes`); only the checksum, verified when the payload is loaded,
makes a record trusted.

Why XXH3-128: the checksum guards against torn writes, bit rot and stray edits, not against a forger (anyone
who can write the store could recompute any unkeyed hash), so a non-cryptographic hash serves; at 20-40 GB/s
on one core (and releasing the GIL) it costs a load a twentieth of what BLAKE3 (3-5 GB/s, format version 2)
did, which was the bound on page-cache-warm reads.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash
from kvtier.server.keys import KEY_BYTES

MAGIC = b"KVL2"
VERSION = 3  # 1 had no padding, 2 a BLAKE3 checksum
ALIGN = 4096  # the record's block: where the payload starts and what its length is padded to (O_DIRECT's unit)
_FIXED = struct.Struct("<4sHHIQII")
_CRC = struct.Struct("<I")
CHECKSUM_BYTES = 16
MAX_ALIASES = 4096
MAX_HEADER = _FIXED.size + 2 * KEY_BYTES + MAX_ALIASES * KEY_BYTES + _CRC.size + CHECKSUM_BYTES


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class CorruptChunk(Exception):
    """A stored chunk (a file with kvtier's name) whose header or checksum does not verify."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    key: bytes
    ns: bytes
    blocks: int
    aliases: tuple[bytes, ...]
    size: int  # payload bytes

    @property
    def header_len(self) -> int:
        return _header_len(len(self.aliases))

    @property
    def data_offset(self) -> int:
        return align_up(self.header_len)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + align_up(self.size)


def _header_len(n_aliases: int) -> int:
    return _FIXED.size + (2 + n_aliases) * KEY_BYTES + _CRC.size + CHECKSUM_BYTES


def hasher(data=b"") -> xxhash.xxh3_128:
    """The record checksum: XXH3-128 (it releases the GIL; why this hash: the module docstring)."""
    return xxhash.xxh3_128(data)


def header_fields(meta: ChunkMeta) -> bytes:
    """The header's bytes before the checksum: the fixed fields, key, namespace, aliases and their crc32."""
    if len(meta.key) != KEY_BYTES or len(meta.ns) != KEY_BYTES or len(meta.aliases) > MAX_ALIASES:
        raise ValueError("bad chunk metadata for an L2 file")
    fixed = _FIXED.pack(MAGIC, VERSION, meta.header_len, 0, meta.size, meta.blocks, len(meta.aliases))
    body = fixed + meta.key + meta.ns + b"".join(meta.aliases)
    return body + _CRC.pack(zlib.crc32(body))


def encode_header(meta: ChunkMeta, payload: Iterable) -> bytes:
    """The whole header of a record (`meta.header_len` bytes): its fields, then the checksum of the fields and
    the payload (`payload`: byte buffers in order, read in place)."""
    fields = header_fields(meta)
    h = hasher(fields)
    for src in payload:
        h.update(src)
    return fields + h.digest()


def decode_header(buf: bytes) -> tuple[ChunkMeta, bytes, bytes]:
    """(meta, header fields before the checksum, checksum) from a record's first bytes; CorruptChunk if bad."""
    if len(buf) < _FIXED.size:
        raise CorruptChunk("short header")
    magic, version, header_len, _flags, size, blocks, n_aliases = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    if version != VERSION:
        raise CorruptChunk(f"unknown format version {version}")
    if n_aliases > MAX_ALIASES or header_len != _header_len(n_aliases):
        raise CorruptChunk("bad header length")
    if len(buf) < header_len:
        raise CorruptChunk("short header")
    body_end = header_len - CHECKSUM_BYTES - _CRC.size
    (crc,) = _CRC.unpack_from(buf, body_end)
    if zlib.crc32(buf[:body_end]) != crc:
        raise CorruptChunk("header crc mismatch")
    off = _FIXED.size
    key = bytes(buf[off : off + KEY_BYTES])
    ns = bytes(buf[off + KEY_BYTES : off + 2 * KEY_BYTES])
    off += 2 * KEY_BYTES
    aliases = tuple(bytes(buf[off + i * KEY_BYTES : off + (i + 1) * KEY_BYTES]) for i in range(n_aliases))
    if size <= 0 or not 1 <= blocks <= 4096 or n_aliases >= blocks:
        raise CorruptChunk("implausible header fields")
    fields_end = header_len - CHECKSUM_BYTES
    return ChunkMeta(key, ns, blocks, aliases, size), bytes(buf[:fields_end]), bytes(buf[fields_end:header_len])
