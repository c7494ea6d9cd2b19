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
import queue
import re
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent import futures
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
HASH_PIECE = 1 << 20  # writes copy into the staging buffer, then hash, this much at a time (in cache)
FREE_STAGING = 4  # staging buffers kept for reuse (the writer pipeline holds at most three)
READ_PIECE = 1 << 20  # payload bytes per read request: a 2 MiB chunk is read as two, hashed as each lands
READ_THREADS = 8  # loads reading at once (one thread each)

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
    """Single-threaded BLAKE3 (it releases the GIL). Pieces are hashed while a reader thread or the I/O stage
    works; BLAKE3's own threads would take the cores those need (measured slower on reads on two cores)."""
    return blake3.blake3(data)


def _is_aligned(buf) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGN == 0


def _header_fields(meta: ChunkMeta) -> bytes:
    if len(meta.key) != KEY_BYTES or len(meta.ns) != KEY_BYTES or len(meta.aliases) > MAX_ALIASES:
        raise ValueError("bad chunk metadata for an L2 file")
    fixed = _FIXED.pack(MAGIC, VERSION, meta.header_len, 0, meta.size, meta.blocks, len(meta.aliases))
    body = fixed + meta.key + meta.ns + b"".join(meta.aliases)
    return body + _CRC.pack(zlib.crc32(body))


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
    """A chunk file's bytes ready to write (`encode`): one page-aligned staging buffer laid out as the file,
    written with O_DIRECT when `odirect`."""

    meta: ChunkMeta
    staged: mmap.mmap | None
    odirect: bool

    def view(self) -> memoryview:
        return memoryview(self.staged)[: self.meta.file_bytes]

    def release(self) -> None:
        """Give the staging buffer back for reuse (once written or abandoned)."""
        buf, self.staged = self.staged, None
        if buf is not None:
            with _free_lock:
                if len(_free) < FREE_STAGING:
                    _free.append(buf)


def encode(meta: ChunkMeta, sources: Sequence, odirect: bool = False) -> Encoded:
    """Copy a chunk's bytes (`sources`, buffers in order) into a staging buffer laid out as its file and
    checksum them (BLAKE3 of the header fields, then the payload), each HASH_PIECE hashed from the copy
    while it is in cache. The result owns its bytes: the sources may be released once this returns."""
    srcs = [np.frombuffer(s, dtype=np.uint8) for s in sources]
    if sum(len(s) for s in srcs) != meta.size:
        raise ValueError("payload size does not match the chunk metadata")
    fields = _header_fields(meta)
    h = hasher(fields)
    buf = _staging(meta.file_bytes)
    dst = np.frombuffer(buf, dtype=np.uint8, count=meta.file_bytes)
    pos = start = meta.data_offset
    for src in srcs:
        for off in range(0, len(src), HASH_PIECE):
            part = src[off : off + HASH_PIECE]
            piece = dst[pos : pos + len(part)]
            np.copyto(piece, part)  # releases the GIL, so the I/O stage runs meanwhile
            h.update(piece)
            pos += len(part)
    head = np.frombuffer(fields + h.digest(), dtype=np.uint8)
    dst[: len(head)] = head
    dst[len(head) : start] = 0
    dst[pos:] = 0
    return Encoded(meta, buf, odirect)


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

    `payload` is the chunk's bytes or an `Encoded` of them (whose `odirect` then decides). The caller fsyncs
    the directory (batched) to make the rename durable.
    """
    enc = payload if isinstance(payload, Encoded) else encode(meta, [payload], odirect)
    try:
        direct = os.O_DIRECT if enc.odirect else 0
        tmp = os.path.join(directory, temp_name(meta.key))
        final = os.path.join(directory, file_name(meta.key))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | direct, 0o600)
        try:
            _write_all(fd, enc.view())
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


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


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
    size is off, the padding is not zero or the checksum mismatches; `bufs` then hold junk to drop.

    A `kvtier-l2-read` thread reads the file in order as requests of up to READ_PIECE bytes (the header, the
    payload straight into `bufs`, the tail) while the caller hashes each payload piece as it lands, so the
    hash overlaps the disk. With `odirect` the reads use O_DIRECT when `bufs` allow it (page-aligned,
    every length but the last a multiple of ALIGN: L1 pages do); the last partial block goes through a small
    aligned bounce buffer. Other buffers, or a refused open, get buffered reads.
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
        start = meta.data_offset
        bounce = memoryview(mmap.mmap(-1, start + ALIGN) if direct else bytearray(start + ALIGN))
        whole = [len(b) - len(b) % ALIGN for b in bufs] if direct else [len(b) for b in bufs]
        tail_len = meta.file_bytes - start - sum(whole)
        tail = bounce[start : start + tail_len]
        payload = _pieces([b[:n] for b, n in zip(bufs, whole, strict=True)])
        # the header rides with the first piece, the tail with the last: every request carries payload
        requests = [list(p) for p in payload] or [[]]
        requests[0].insert(0, bounce[:start])
        if tail_len:
            requests[-1].append(tail)
        landed: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        reader = _read_pool().submit(_read_in_order, fd, requests, landed)
        try:
            h = None
            for piece in payload or [[]]:
                _wait_landed(landed)
                if h is None:
                    disk_meta, fields, digest = decode_header(bounce[:start])
                    if disk_meta != meta:
                        raise CorruptChunk("header changed since the scan")
                    _zeros(bounce[meta.header_len : start])
                    h = hasher(fields)
                for view in piece:
                    h.update(view)
        finally:
            futures.wait([reader])  # no read may outlive the descriptor
        last = bufs[-1]
        rest = len(last) - whole[-1]
        last[whole[-1] :] = tail[:rest]
        _zeros(tail[rest:])
        h.update(last[whole[-1] :])
    finally:
        os.close(fd)
    if h.digest() != digest:
        raise CorruptChunk("checksum mismatch")


_pool: futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> futures.ThreadPoolExecutor:
    """The read threads, started on first use (a server without L2 never has them)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvtier-l2-read")
        return _pool


def _read_in_order(fd: int, requests: list[list[memoryview]], landed: queue.SimpleQueue) -> None:
    """Read thread: fill each request in file order from offset 0, reporting each one's index as it lands
    (or the error that stopped the reads)."""
    offset = 0
    try:
        for i, views in enumerate(requests):
            _read_exact(fd, views, offset)
            offset += sum(len(v) for v in views)
            landed.put(i)
    except BaseException as exc:  # handed to the caller, which raises it
        landed.put(exc)


def _wait_landed(landed: queue.SimpleQueue) -> None:
    item = landed.get()
    if isinstance(item, BaseException):
        raise item


def _pieces(views: list[memoryview]) -> list[list[memoryview]]:
    """`views` regrouped, in order, into requests of at most READ_PIECE bytes (small views share one)."""
    out: list[list[memoryview]] = []
    room = 0
    for view in views:
        while len(view):
            if room == 0:
                out.append([])
                room = READ_PIECE
            part, view = view[:room], view[room:]
            out[-1].append(part)
            room -= len(part)
    return out


def _zeros(view: memoryview) -> None:
    if bytes(view).count(0) != len(view):
        raise CorruptChunk("nonzero padding")


def _read_exact(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill `views` in order from file `offset` (O_DIRECT: aligned views read whole blocks)."""
    views = [v for v in views if len(v)]
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
