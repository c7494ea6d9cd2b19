"""On-disk format of one L2 chunk file, and its crash-safe write.

A file is named `<key hex>.kv` and holds a header then the chunk's payload bytes:

    magic "KVL2" | version u16 | header length u16 | flags u32 | payload length u64 | blocks u32 |
    alias count u32 | key (16) | namespace fingerprint (16) | aliases (16 each) | header crc32 u32 |
    checksum (32: BLAKE3 of every header byte before it, then the payload)

The header alone (read at start-up) says whether a file is plausibly whole (its size must equal header
length + payload length, the crc32 guards the fields); only the checksum, verified when the payload is
loaded, makes a file trusted. Writes go to `.<key hex>.tmp-<pid>`, are fsynced and renamed into place;
the directory fsync that makes renames durable is batched by the caller (`fsync_dir`).
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import zlib
from dataclasses import dataclass

import blake3
from kvtier.server.keys import KEY_BYTES

MAGIC = b"KVL2"
VERSION = 1
SUFFIX = ".kv"
_FIXED = struct.Struct("<4sHHIQII")
_CRC = struct.Struct("<I")
CHECKSUM_BYTES = 32
MAX_ALIASES = 4096
MAX_HEADER = _FIXED.size + 2 * KEY_BYTES + MAX_ALIASES * KEY_BYTES + _CRC.size + CHECKSUM_BYTES

_HEX = 2 * KEY_BYTES
NAME_RE = re.compile(rf"^([0-9a-f]{{{_HEX}}})\.kv$")
TEMP_RE = re.compile(rf"^\.([0-9a-f]{{{_HEX}}})\.tmp-[0-9]+$")


class CorruptChunk(Exception):
    """A file with kvtier's name whose header or checksum does not verify."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    key: bytes
    ns: bytes
    blocks: int
    aliases: tuple[bytes, ...]
    size: int  # payload bytes

    @property
    def header_len(self) -> int:
        return _FIXED.size + (2 + len(self.aliases)) * KEY_BYTES + _CRC.size + CHECKSUM_BYTES

    @property
    def file_bytes(self) -> int:
        return self.header_len + self.size


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def temp_name(key: bytes) -> str:
    return f".{key.hex()}.tmp-{os.getpid()}"


def _header_fields(meta: ChunkMeta) -> bytes:
    if len(meta.key) != KEY_BYTES or len(meta.ns) != KEY_BYTES or len(meta.aliases) > MAX_ALIASES:
        raise ValueError("bad chunk metadata for an L2 file")
    fixed = _FIXED.pack(MAGIC, VERSION, meta.header_len, 0, meta.size, meta.blocks, len(meta.aliases))
    body = fixed + meta.key + meta.ns + b"".join(meta.aliases)
    return body + _CRC.pack(zlib.crc32(body))


def checksum(header_fields: bytes, *pieces) -> bytes:
    h = blake3.blake3(header_fields)
    for piece in pieces:
        h.update(piece)
    return h.digest()


def encode_header(meta: ChunkMeta, payload) -> bytes:
    fields = _header_fields(meta)
    return fields + checksum(fields, payload)


def decode_header(buf: bytes) -> tuple[ChunkMeta, bytes, bytes]:
    """(meta, header fields before the checksum, checksum) from a file's first bytes; CorruptChunk if bad."""
    if len(buf) < _FIXED.size:
        raise CorruptChunk("short header")
    magic, version, header_len, _flags, size, blocks, n_aliases = _FIXED.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptChunk("bad magic")
    if version != VERSION:
        raise CorruptChunk(f"unknown format version {version}")
    if n_aliases > MAX_ALIASES or header_len != _FIXED.size + (2 + n_aliases) * KEY_BYTES + _CRC.size + CHECKSUM_BYTES:
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


def read_meta(path: str) -> ChunkMeta:
    """The header of a chunk file, checked against the file's size and name (no payload read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st_size = os.fstat(fd).st_size
        meta, _, _ = decode_header(os.pread(fd, MAX_HEADER, 0))
    finally:
        os.close(fd)
    if st_size != meta.file_bytes:
        raise CorruptChunk(f"file has {st_size} bytes, header says {meta.file_bytes}")
    if os.path.basename(path) != file_name(meta.key):
        raise CorruptChunk("file name does not match the key in its header")
    return meta


def write_file(directory: str, meta: ChunkMeta, payload, odirect: bool = False) -> str:
    """Write a chunk file crash-safely (temp name, fsync, rename); returns its final path.

    The caller fsyncs the directory (batched) to make the rename durable. `odirect` is accepted but not
    yet implemented: the write is buffered (see docs: L2 O_DIRECT).
    """
    del odirect
    tmp = os.path.join(directory, temp_name(meta.key))
    final = os.path.join(directory, file_name(meta.key))
    header = encode_header(meta, payload)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        _write_all(fd, memoryview(header))
        _write_all(fd, memoryview(payload).cast("B"))
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quiet(tmp)
        raise
    os.close(fd)
    os.rename(tmp, final)
    return final


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_payload(path: str, meta: ChunkMeta, bufs: list[memoryview]) -> None:
    """Read a file's payload into the writable byte buffers `bufs` (meta.size bytes in all, in order) and
    verify its checksum. CorruptChunk when the header changed, the size is off or the checksum mismatches."""
    if sum(len(b) for b in bufs) != meta.size:
        raise ValueError("buffers do not add up to the payload size")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        head = os.pread(fd, meta.header_len, 0)
        disk_meta, fields, digest = decode_header(head)
        if disk_meta != meta:
            raise CorruptChunk("header changed since the scan")
        if os.fstat(fd).st_size != meta.file_bytes:
            raise CorruptChunk("file size changed since the scan")
        offset = meta.header_len
        for buf in bufs:
            view = buf
            while view:
                n = os.preadv(fd, [view], offset)
                if n <= 0:
                    raise CorruptChunk("short payload")
                offset += n
                view = view[n:]
    finally:
        os.close(fd)
    if checksum(fields, *bufs) != digest:
        raise CorruptChunk("checksum mismatch")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
