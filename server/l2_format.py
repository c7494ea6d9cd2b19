"""On-disk format of one L2 chunk file, and its crash-safe write (buffered or O_DIRECT).

A file is named `<key hex>.kv` and holds a header, zero padding up to the next 4096-byte boundary (`ALIGN`),
the chunk's payload, and zero padding up to the next boundary again:

    magic "KVL2" | version u16 | header length u16 | flags u32 | payload length u64 | blocks u32 |
    alias count u32 | key (16) | namespace fingerprint (16) | aliases (16 each) | header crc32 u32 |
    checksum (16: XXH3-128 of every header byte before it, then the payload) | zeros | payload | zeros

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

import errno
import logging
import mmap
import os
import re
import stat
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from kvtier.server.keys import KEY_BYTES

log = logging.getLogger("kvtier.server.l2")

MAGIC = b"KVL2"
VERSION = 3  # 1 had no padding, 2 a BLAKE3 checksum
SUFFIX = ".kv"
ALIGN = 4096  # O_DIRECT alignment of buffer addresses, file offsets and lengths
_FIXED = struct.Struct("<4sHHIQII")
_CRC = struct.Struct("<I")
CHECKSUM_BYTES = 16
MAX_ALIASES = 4096
MAX_HEADER = _FIXED.size + 2 * KEY_BYTES + MAX_ALIASES * KEY_BYTES + _CRC.size + CHECKSUM_BYTES

READ_PIECE = 1 << 20  # buffered reads: bytes per request, hashed while still in the CPU cache (measured best)

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


def hasher(data=b"") -> xxhash.xxh3_128:
    """The file checksum: XXH3-128 (it releases the GIL). It guards against torn writes, bit rot and stray
    edits, not against a forger (anyone who can write the directory could recompute any unkeyed hash), so a
    non-cryptographic hash serves; at 20-40 GB/s on one core it costs a load a twentieth of what BLAKE3
    (3-5 GB/s) did, which was the bound on page-cache-warm reads."""
    return xxhash.xxh3_128(data)


def _is_aligned(buf) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGN == 0


def _header_fields(meta: ChunkMeta) -> bytes:
    if len(meta.key) != KEY_BYTES or len(meta.ns) != KEY_BYTES or len(meta.aliases) > MAX_ALIASES:
        raise ValueError("bad chunk metadata for an L2 file")
    fixed = _FIXED.pack(MAGIC, VERSION, meta.header_len, 0, meta.size, meta.blocks, len(meta.aliases))
    body = fixed + meta.key + meta.ns + b"".join(meta.aliases)
    return body + _CRC.pack(zlib.crc32(body))


@dataclass(slots=True)
class Encoded:
    """A chunk file ready to write (`encode`): `parts` are its bytes in order, the header block and the
    tail block in a small page-aligned buffer of their own, the payload the caller's buffers themselves (no
    copy: they must stay valid and unchanged until the file is written). Written with O_DIRECT when
    `odirect`."""

    meta: ChunkMeta
    parts: list[memoryview]
    odirect: bool


def encode(meta: ChunkMeta, sources: Sequence, odirect: bool = False) -> Encoded:
    """Lay a chunk's bytes (`sources`, buffers in order) out as its file and checksum them (the header
    fields, then the payload), reading them in place. O_DIRECT needs every source page-aligned and every
    length but the last a multiple of ALIGN (L1 pages are); the last source's partial block is copied into
    the tail block. Sources that do not allow it make a buffered write of this file."""
    srcs = [memoryview(s).cast("B") for s in sources]
    if sum(len(s) for s in srcs) != meta.size:
        raise ValueError("payload size does not match the chunk metadata")
    odirect = odirect and all(_is_aligned(s) for s in srcs) and all(len(s) % ALIGN == 0 for s in srcs[:-1])
    fields = _header_fields(meta)
    h = hasher(fields)
    for src in srcs:
        h.update(src)
    start = meta.data_offset
    last = srcs[-1]
    keep = len(last) - len(last) % ALIGN if odirect else len(last)
    edge = memoryview(mmap.mmap(-1, start + ALIGN))  # zeros: the padding
    head = fields + h.digest()
    edge[: len(head)] = head
    rest = len(last) - keep
    edge[start : start + rest] = last[keep:]
    tail = edge[start : start + align_up(meta.size) - meta.size + rest]
    return Encoded(meta, [edge[:start], *srcs[:-1], last[:keep], tail], odirect)


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


def open_regular(path: str, flags: int = 0) -> tuple[int, os.stat_result]:
    """Open `path` for reading if it is a regular file: (fd, its stat). Never blocks and never follows a
    symlink: a FIFO's open would wait for a writer for ever, so the open is non-blocking, and anything but
    a regular file (FIFO, directory, device) is CorruptChunk. The returned fd is blocking again."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptChunk("not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_meta(path: str) -> ChunkMeta:
    """The header of a chunk file, checked against the file's size and name (no payload read)."""
    fd, st = open_regular(path)
    try:
        meta, _, _ = decode_header(os.pread(fd, MAX_HEADER, 0))
    finally:
        os.close(fd)
    if st.st_size != meta.file_bytes:
        raise CorruptChunk("file size does not match its header")
    if os.path.basename(path) != file_name(meta.key):
        raise CorruptChunk("file name does not match the key in its header")
    return meta


def write_file(directory: str, meta: ChunkMeta, payload, odirect: bool = False) -> str:
    """Write a chunk file crash-safely (temp name, fsync, rename); returns its final path.

    `payload` is the chunk's bytes or an `Encoded` of them (whose `odirect` then decides). The caller fsyncs
    the directory (batched) to make the rename durable.
    """
    enc = payload if isinstance(payload, Encoded) else encode(meta, [payload], odirect)
    direct = os.O_DIRECT if enc.odirect else 0
    tmp = os.path.join(directory, temp_name(meta.key))
    final = os.path.join(directory, file_name(meta.key))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | direct, 0o600)
    try:
        _transfer_exact(os.pwritev, fd, enc.parts, 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quiet(tmp)
        raise
    os.close(fd)
    os.rename(tmp, final)
    return final


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
    verify its checksum, hashed from `bufs` themselves (no copy). CorruptChunk when the path is not a
    regular file (`open_regular`), the header changed, the size is off, the padding is not zero or the
    checksum mismatches; `bufs` then hold junk to drop.

    With `odirect` the read uses O_DIRECT when `bufs` allow it (page-aligned, every length but the last a
    multiple of ALIGN: L1 pages do), as one request for the whole file (one preadv: the header into a small
    bounce buffer, the payload straight into `bufs`, the tail into the bounce buffer, whence the last
    partial block is copied): a disk without readahead pays its per-request latency once per chunk, and
    the checksum after it costs a twentieth of the read. Other buffers, or a refused open, get a buffered
    read: the header, then READ_PIECE requests each hashed as it lands (the kernel's readahead keeps the
    disk streaming; the hash reads the piece from the CPU cache, not memory).
    """
    bufs = [memoryview(b).cast("B") for b in bufs]
    if sum(len(b) for b in bufs) != meta.size:
        raise ValueError("buffers do not add up to the payload size")
    direct = odirect and all(_is_aligned(b) for b in bufs) and all(len(b) % ALIGN == 0 for b in bufs[:-1])
    opened = None
    if direct:
        try:
            opened = open_regular(path, os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct = False
    fd, st = opened or open_regular(path)
    start = meta.data_offset
    bounce = _bounce(start + ALIGN)
    head = bounce[:start]
    whole = [len(b) - len(b) % ALIGN for b in bufs] if direct else [len(b) for b in bufs]
    payload = [b[:n] for b, n in zip(bufs, whole, strict=True)]
    tail = bounce[start : meta.file_bytes - sum(whole)]
    try:
        if st.st_size != meta.file_bytes:
            raise CorruptChunk("file size changed since the scan")
        _transfer_exact(os.preadv, fd, [head, *payload, tail] if direct else [head], 0)
        disk_meta, fields, digest = decode_header(head)
        if disk_meta != meta:
            raise CorruptChunk("header changed since the scan")
        _zeros(bounce[meta.header_len : start])
        h = hasher(fields)
        if direct:
            for view in payload:
                h.update(view)
        else:  # from the page cache: each piece hashed right after it lands, while it is in the CPU cache
            offset = start
            for view in payload:
                for off in range(0, len(view), READ_PIECE):
                    piece = view[off : off + READ_PIECE]
                    _transfer_exact(os.preadv, fd, [piece], offset)
                    h.update(piece)
                    offset += len(piece)
            _transfer_exact(os.preadv, fd, [tail], offset)
    finally:
        os.close(fd)
    last = bufs[-1]
    rest = len(last) - whole[-1]
    last[whole[-1] :] = tail[:rest]
    _zeros(tail[rest:])
    h.update(last[whole[-1] :])
    if h.digest() != digest:
        raise CorruptChunk("checksum mismatch")


_local = threading.local()


def _bounce(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer for a read's header and tail blocks, grown as needed (a fresh
    mapping per read measured 2-8% slower on O_DIRECT reads)."""
    buf = getattr(_local, "bounce", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.bounce = mmap.mmap(-1, max(nbytes, 4 * ALIGN))
    return memoryview(buf)


def _zeros(view: memoryview) -> None:
    if bytes(view).count(0) != len(view):
        raise CorruptChunk("nonzero padding")


def _transfer_exact(op: Callable[[int, list, int], int], fd: int, views: list[memoryview], offset: int) -> None:
    """Move all of `views`, in order, from or to file `offset` with `op` (os.preadv or os.pwritev),
    IOV_MAX views per call; a read that ends early means a short file (O_DIRECT: aligned views move whole
    blocks)."""
    views = [v for v in views if len(v)]
    while views:
        n = op(fd, views[:1024], offset)  # IOV_MAX
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


def unlink_quiet(path: str) -> bool:
    """Remove a file (already gone counts as removed); False, logged, never raised, when what is there
    cannot be unlinked (a directory in its place, a read-only filesystem)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("L2: cannot remove %s (%s)", path, exc.strerror or exc)
        return False
    return True
