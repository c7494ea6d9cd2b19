"""The filesystem tier's file I/O: one chunk record (record.py: layout, header, checksum) per file, its
crash-safe write and its verified read, buffered or O_DIRECT.

The split between this module and record.py follows one question, "would a Redis tier need it?": file names
and their patterns, temp files, fsync, the regular-file check, the O_DIRECT probe and the page-aligned
buffers a file is written from (`encode`/`Encoded`) or read through, no (here); the record's fields, header
bytes and checksum, yes (record.py).

A file is named `<key hex>.kv` and holds exactly one record: header, zero padding up to the next ALIGN
boundary, payload, zero padding (the layout: record.py), so its size is `meta.file_bytes`. The header alone
(read at start-up, `read_meta`) says whether a file is plausibly whole: its size must equal `file_bytes`
and its name its key; only the checksum, verified when the payload is loaded (`read_payload`), makes a file
trusted. Writes go to `.<key hex>.tmp-<pid>`, are fsynced and renamed into place; the directory fsync that
makes renames durable is batched by the caller (`fsync_dir`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from kvtier.server.keys import KEY_BYTES
from kvtier.server.tiers.record import (
    ALIGN,
    MAX_HEADER,
    ChunkMeta,
    CorruptChunk,
    align_up,
    decode_header,
    encode_header,
    hasher,
)

log = logging.getLogger("kvtier.server.l2")

SUFFIX = ".kv"
READ_PIECE = 1 << 20  # buffered reads: bytes per request, hashed while still in the CPU cache (measured best)

_HEX = 2 * KEY_BYTES
NAME_RE = re.compile(rf"^([0-9a-f]{{{_HEX}}})\.kv$")
TEMP_RE = re.compile(rf"^\.([0-9a-f]{{{_HEX}}})\.tmp-[0-9]+$")


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def temp_name(key: bytes) -> str:
    return f".{key.hex()}.tmp-{os.getpid()}"


def _is_aligned(buf) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGN == 0


def _direct_ok(views: Sequence[memoryview]) -> bool:
    """Whether O_DIRECT can move `views` in place: each page-aligned, each length but the last a multiple
    of ALIGN (L1 pages are)."""
    return all(_is_aligned(v) for v in views) and all(len(v) % ALIGN == 0 for v in views[:-1])


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
    odirect = odirect and _direct_ok(srcs)
    head = encode_header(meta, srcs)
    start = meta.data_offset
    last = srcs[-1]
    keep = len(last) - len(last) % ALIGN if odirect else len(last)
    edge = memoryview(mmap.mmap(-1, start + ALIGN))  # zeros: the padding
    edge[: len(head)] = head
    rest = len(last) - keep
    edge[start : start + rest] = last[keep:]
    tail = edge[start : start + align_up(meta.size) - meta.size + rest]
    return Encoded(meta, [edge[:start], *srcs[:-1], last[:keep], tail], odirect)


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
    fd, st, direct = _open_payload(path, odirect and _direct_ok(bufs))
    start = meta.data_offset
    bounce = _bounce(start + ALIGN)
    whole = [len(b) - len(b) % ALIGN for b in bufs] if direct else [len(b) for b in bufs]
    payload = [b[:n] for b, n in zip(bufs, whole, strict=True)]  # what lands in `bufs` straight
    tail = bounce[start : meta.file_bytes - sum(whole)]
    try:
        if st.st_size != meta.file_bytes:
            raise CorruptChunk("file size changed since the scan")
        h, digest = _read_header(fd, meta, bounce, [*payload, tail] if direct else [])
        if direct:
            for view in payload:
                h.update(view)
        else:
            _transfer_exact(os.preadv, fd, [tail], _read_hashed(fd, h, payload, start))
    finally:
        os.close(fd)
    _verify_tail(bufs[-1], whole[-1], tail, h, digest)


def _open_payload(path: str, direct: bool) -> tuple[int, os.stat_result, bool]:
    """`open_regular(path)`, with O_DIRECT if `direct` and the filesystem takes it: (fd, stat, direct)."""
    if direct:
        try:
            return (*open_regular(path, os.O_DIRECT), True)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return (*open_regular(path), False)


def _read_header(fd: int, meta: ChunkMeta, bounce: memoryview, rest: list[memoryview]
                 ) -> tuple[xxhash.xxh3_128, bytes]:
    """Read the header block into `bounce` (and `rest`, the views after it, in the same request: O_DIRECT's
    one read of the file), check it is still `meta`'s with zero padding; (the checksum fed the header's
    fields, the checksum the header holds)."""
    start = meta.data_offset
    head = bounce[:start]
    _transfer_exact(os.preadv, fd, [head, *rest], 0)
    disk_meta, fields, digest = decode_header(head)
    if disk_meta != meta:
        raise CorruptChunk("header changed since the scan")
    _zeros(bounce[meta.header_len : start])
    return hasher(fields), digest


def _read_hashed(fd: int, h: xxhash.xxh3_128, payload: list[memoryview], offset: int) -> int:
    """Buffered: read `payload` from file `offset` in READ_PIECE requests, each hashed right after it lands
    (from the page cache, while it is in the CPU cache); returns the offset after it."""
    for view in payload:
        for off in range(0, len(view), READ_PIECE):
            piece = view[off : off + READ_PIECE]
            _transfer_exact(os.preadv, fd, [piece], offset)
            h.update(piece)
            offset += len(piece)
    return offset


def _verify_tail(last: memoryview, whole: int, tail: memoryview, h: xxhash.xxh3_128, digest: bytes) -> None:
    """Copy the payload's end from the tail block into the last buffer past its `whole` bytes already read,
    check the padding after it is zero, and compare the finished checksum with `digest`."""
    rest = len(last) - whole
    last[whole:] = tail[:rest]
    _zeros(tail[rest:])
    h.update(last[whole:])
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
