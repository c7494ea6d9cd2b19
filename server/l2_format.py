"""On-disk format of one L2 chunk file, and its crash-safe write (buffered or O_DIRECT).

A file is named `<key hex>.kv` and holds a header, zero padding up to the next 4096-byte boundary (`ALIGN`),
the chunk's payload, and zero padding up to the next boundary again:

    magic "KVL2" | version u16 | header length u16 | flags u32 | payload length u64 | blocks u32 |
    alias count u32 | key (16) | namespace fingerprint (16) | aliases (16 each) | header crc32 u32 |
    checksum (32: BLAKE3 of every header byte before it, then the payload) | zeros | payload | zeros

The payload length field is the true length; the payload starts at `data_offset` and the file holds
`file_bytes` (both multiples of ALIGN). One layout serves both modes: O_DIRECT reads and writes whole aligned
blocks of any file, a buffered reader reads the same files, whichever mode wrote them. The padding must be
zero: a reader checks it (it is not under the checksum).

The header alone (read at start-up) says whether a file is plausibly whole (its size must equal
`file_bytes`, the crc32 guards the fields); only the checksum, verified when the payload is loaded, makes a
file trusted. Writes go to `.<key hex>.tmp-<pid>`, are fsynced and renamed into place; the directory fsync
that makes renames durable is batched by the caller (`fsync_dir`).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np
from kvtier.server.keys import KEY_BYTES

MAGIC = b"KVL2"
VERSION = 2  # 1 had no padding
SUFFIX = ".kv"
ALIGN = 4096  # O_DIRECT alignment of buffer addresses, file offsets and lengths
_FIXED = struct.Struct("<4sHHIQII")
_CRC = struct.Struct("<I")
CHECKSUM_BYTES = 32
MAX_ALIASES = 4096
MAX_HEADER = _FIXED.size + 2 * KEY_BYTES + MAX_ALIASES * KEY_BYTES + _CRC.size + CHECKSUM_BYTES
HASH_PIECE = 1 << 20  # staged O_DIRECT writes copy then hash this much at a time, while it is in cache
FREE_STAGING = 4  # staging buffers kept for reuse (the writer pipeline holds at most three)

_HEX = 2 * KEY_BYTES
NAME_RE = re.compile(rf"^([0-9a-f]{{{_HEX}}})\.kv$")
TEMP_RE = re.compile(rf"^\.([0-9a-f]{{{_HEX}}})\.tmp-[0-9]+$")


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


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
    def data_offset(self) -> int:
        return align_up(self.header_len)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + align_up(self.size)


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def temp_name(key: bytes) -> str:
    return f".{key.hex()}.tmp-{os.getpid()}"


def hasher(data=b"") -> blake3.blake3:
    """BLAKE3 on every core (it releases the GIL): a 2 MiB chunk hashes ~1.8x faster on two cores."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO)


def _is_aligned(buf) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGN == 0


def _header_fields(meta: ChunkMeta) -> bytes:
    if len(meta.key) != KEY_BYTES or len(meta.ns) != KEY_BYTES or len(meta.aliases) > MAX_ALIASES:
        raise ValueError("bad chunk metadata for an L2 file")
    fixed = _FIXED.pack(MAGIC, VERSION, meta.header_len, 0, meta.size, meta.blocks, len(meta.aliases))
    body = fixed + meta.key + meta.ns + b"".join(meta.aliases)
    return body + _CRC.pack(zlib.crc32(body))


def checksum(header_fields: bytes, *pieces) -> bytes:
    h = hasher(header_fields)
    for piece in pieces:
        h.update(piece)
    return h.digest()


# -- staging buffers (page-aligned anonymous memory, reused across writes) ---------------------------

_free: list[mmap.mmap] = []
_free_lock = threading.Lock()


def _staging(nbytes: int) -> mmap.mmap:
    with _free_lock:
        for i, buf in enumerate(_free):
            if len(buf) >= nbytes:
                return _free.pop(i)
    return mmap.mmap(-1, nbytes)


@dataclass(slots=True)
class Encoded:
    """A chunk file's bytes ready to write (`FsTier.prepare`): `parts` in order, either header + padding,
    payload and tail padding (buffered), or one staged, page-aligned buffer of the whole file (O_DIRECT)."""

    meta: ChunkMeta
    parts: list
    staged: mmap.mmap | None = None

    def release(self) -> None:
        """Give the staging buffer back for reuse (once written or abandoned)."""
        buf, self.staged, self.parts = self.staged, None, []
        if buf is not None:
            with _free_lock:
                if len(_free) < FREE_STAGING:
                    _free.append(buf)


def encode(meta: ChunkMeta, payload, odirect: bool = False) -> Encoded:
    """Checksum a chunk (BLAKE3 of the header fields and the payload). With `odirect` the payload is copied
    into a page-aligned staging buffer piece by piece, each piece hashed from the copy while in cache."""
    src = memoryview(payload).cast("B")
    if len(src) != meta.size:
        raise ValueError("payload size does not match the chunk metadata")
    fields = _header_fields(meta)
    h = hasher(fields)
    start, end = meta.data_offset, meta.data_offset + meta.size
    if not odirect:
        h.update(src)
        head = fields + h.digest()
        return Encoded(meta, [head + bytes(start - len(head)), src, bytes(meta.file_bytes - end)])
    buf = _staging(meta.file_bytes)
    dst = memoryview(buf)
    for off in range(0, meta.size, HASH_PIECE):
        piece = dst[start + off : min(start + off + HASH_PIECE, end)]
        piece[:] = src[off : off + len(piece)]
        h.update(piece)
    head = fields + h.digest()
    dst[:start] = head + bytes(start - len(head))
    dst[end : meta.file_bytes] = bytes(meta.file_bytes - end)
    return Encoded(meta, [dst[: meta.file_bytes]], buf)


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

    `payload` is the chunk's bytes or an `Encoded` of them; a staged `Encoded` (or `odirect` with bytes) is
    written with O_DIRECT. The caller fsyncs the directory (batched) to make the rename durable.
    """
    enc = payload if isinstance(payload, Encoded) else encode(meta, payload, odirect)
    try:
        direct = os.O_DIRECT if enc.staged is not None else 0
        tmp = os.path.join(directory, temp_name(meta.key))
        final = os.path.join(directory, file_name(meta.key))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | direct, 0o600)
        try:
            _write_all(fd, [memoryview(p).cast("B") for p in enc.parts])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            unlink_quiet(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
    finally:
        if enc is not payload:
            enc.release()
    return final


def _write_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def probe_odirect(directory: str) -> bool:
    """Whether `directory` takes an O_DIRECT write (tmpfs on older kernels answers EINVAL at open)."""
    probe = os.path.join(directory, temp_name(bytes(KEY_BYTES)))  # a temp name: a start-up scan removes it
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_DIRECT, 0o600)
        try:
            os.write(fd, mmap.mmap(-1, ALIGN))
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        unlink_quiet(probe)
    return True


def read_payload(path: str, meta: ChunkMeta, bufs: Sequence[memoryview], odirect: bool = False) -> None:
    """Read a file's payload into the writable byte buffers `bufs` (meta.size bytes in all, in order) and
    verify its checksum, hashed from `bufs` themselves (no copy). CorruptChunk when the header changed, the
    size is off, the padding is not zero or the checksum mismatches.

    With `odirect` the payload is read with O_DIRECT straight into `bufs` when they allow it (page-aligned,
    every length but the last a multiple of ALIGN: L1 pages do); the last partial block goes through a small
    aligned bounce buffer. Other buffers, or a refused open, get a buffered read.
    """
    bufs = [memoryview(b).cast("B") for b in bufs]
    if sum(len(b) for b in bufs) != meta.size:
        raise ValueError("buffers do not add up to the payload size")
    direct = odirect and all(_is_aligned(b) for b in bufs) and all(len(b) % ALIGN == 0 for b in bufs[:-1])
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct = False
    if not direct:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size != meta.file_bytes:
            raise CorruptChunk("file size changed since the scan")
        # One vectored read of the whole file (one disk request under O_DIRECT): header, the payload straight
        # into `bufs` (whole blocks of them under O_DIRECT), then the last block or the tail padding via
        # `bounce`. A file that does not verify leaves junk in `bufs`; the caller drops them.
        start = meta.data_offset
        bounce = memoryview(mmap.mmap(-1, start + ALIGN) if direct else bytearray(start + ALIGN))
        whole = [len(b) - len(b) % ALIGN for b in bufs] if direct else [len(b) for b in bufs]
        tail_len = meta.file_bytes - start - sum(whole)
        tail = bounce[start : start + tail_len]
        _read_exact(fd, [bounce[:start], *(b[:n] for b, n in zip(bufs, whole, strict=True)), tail])
        disk_meta, fields, digest = decode_header(bounce[:start])
        if disk_meta != meta:
            raise CorruptChunk("header changed since the scan")
        _zeros(bounce[meta.header_len : start])
        last = bufs[-1]
        rest = len(last) - whole[-1]
        last[whole[-1] :] = tail[:rest]
        _zeros(tail[rest:])
    finally:
        os.close(fd)
    h = hasher(fields)
    for buf in bufs:
        h.update(buf)
    if h.digest() != digest:
        raise CorruptChunk("checksum mismatch")


def _zeros(view: memoryview) -> None:
    if bytes(view).count(0) != len(view):
        raise CorruptChunk("nonzero padding")


def _read_exact(fd: int, views: list[memoryview]) -> None:
    """Fill `views` in order from the start of the file (O_DIRECT: aligned views read whole blocks)."""
    views, offset = [v for v in views if len(v)], 0
    while views:
        n = os.preadv(fd, views[:1024], offset)  # IOV_MAX
        if n <= 0:
            raise CorruptChunk("short file")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
