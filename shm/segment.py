"""POSIX shared-memory segments in a tmpfs directory (/dev/shm by default), created by the server and
mapped by local clients.

Plain `os.open` + `mmap` instead of multiprocessing.shared_memory: the latter registers every attach
with Python's resource tracker, which unlinks the segment when a *client* exits (Python < 3.13).
The owner holds an exclusive flock on the segment for its lifetime, so a segment whose owner was
killed or stopped is recognisable (the lock is free): the next owner either removes it (`create`) or takes
it over with its bytes (`adopt`, a warm restart: docs/warm-restart.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
PREFAULT_STEP = 64 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SegmentInUse(RuntimeError):
    """Another live process owns a segment of that name."""


class SegmentMismatch(RuntimeError):
    """A segment left by a dead owner that cannot be adopted as it is (its size, file type or owner)."""


def _path(name: str, directory: str = SHM_DIR) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return os.path.join(directory, name)


def tmpfs_options(directory: str) -> dict[str, str]:
    """The mount options of the tmpfs holding `directory` (e.g. {"huge": "within_size"}); ValueError if it is
    not on a tmpfs: a segment on a disk filesystem would be written back to the disk."""
    real = os.path.realpath(directory)
    if not os.path.isdir(real):
        raise ValueError(f"shared-memory directory {directory} does not exist")
    best: tuple[str, str, str] = ("", "", "")
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, options, *_ = line.split()
            point = point.replace("\\040", " ")
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best[0]):
                best = (point, fstype, options)
    if best[1] != "tmpfs":
        raise ValueError(f"shared-memory directory {directory} is on {best[1] or 'an unknown filesystem'}, "
                         "not tmpfs")
    return dict(opt.partition("=")[::2] for opt in best[2].split(","))


@dataclass
class Segment:
    name: str
    size: int
    fd: int
    buf: mmap.mmap
    owner: bool
    directory: str = SHM_DIR

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600, directory: str = SHM_DIR) -> Segment:
        """Create (or take over a stale) segment. Pages are not touched: memory is used only once written."""
        if size <= 0:
            raise ValueError("segment size must be positive")
        path = _path(name, directory)
        remove_stale(name, directory)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, mode)  # exactly --shm-mode: os.open's mode is filtered by the umask
            os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        return cls(name, size, fd, buf, owner=True, directory=directory)

    @classmethod
    def adopt(cls, name: str, size: int, mode: int = 0o600, directory: str = SHM_DIR) -> Segment:
        """Take over, bytes and all, a segment whose owner is gone: its lock is taken as `create` would.

        FileNotFoundError when there is none; SegmentInUse when a live owner holds it; SegmentMismatch (the
        file left as it is) when it is not a regular file of this user of exactly `size` bytes.
        """
        fd = os.open(_path(name, directory), os.O_RDWR | os.O_NOFOLLOW)
        try:
            _lock(fd, _path(name, directory))
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise SegmentMismatch(f"{name} is not a regular file of this user")
            if info.st_size != size:
                raise SegmentMismatch(f"{name} has {info.st_size} bytes, not {size}")
            os.fchmod(fd, mode)
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, size, fd, buf, owner=True, directory=directory)

    @property
    def inode(self) -> int:
        """The file's inode number: tells this segment from another of the same name created later."""
        return os.fstat(self.fd).st_ino

    @classmethod
    def attach(cls, name: str, size: int, directory: str = SHM_DIR) -> Segment:
        """Map an existing segment read-write; `size` must match what the owner announced."""
        fd = os.open(_path(name, directory), os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"segment {name} has {actual} bytes, server announced {size}")
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, size, -1, buf, owner=False, directory=directory)

    def prefault(self, stop: threading.Event, progress: Callable[[int], None]) -> bool:
        """Back the whole segment with memory (the owner's `posix_fallocate`, in steps so that `stop` is
        honoured); `progress` gets the bytes backed so far. Afterwards no write to the segment allocates
        and zeroes a page on first touch. Returns whether it finished."""
        done = 0
        while done < self.size:
            if stop.is_set():
                return False
            n = min(PREFAULT_STEP, self.size - done)
            os.posix_fallocate(self.fd, done, n)
            done += n
            progress(done)
        return True

    def give_back(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Return the memory of the whole OS pages inside each (start, end) byte range to the OS (a hole in
        the tmpfs file: they read as zeros and are backed again when written); returns the bytes given."""
        os_page = mmap.PAGESIZE
        given = 0
        for run_start, run_end in ranges:
            start, end = -(-run_start // os_page) * os_page, run_end // os_page * os_page
            if end > start:
                self.buf.madvise(mmap.MADV_REMOVE, start, end - start)
                given += end - start
        return given

    def array(self) -> np.ndarray:
        """A uint8 view of the whole mapping (no copy)."""
        return np.frombuffer(self.buf, dtype=np.uint8)

    def close(self, keep: bool = False) -> None:
        """Unmap; the owner also drops its lock and, unless `keep` (left for the next owner to adopt),
        unlinks the segment."""
        # Views still exported (BufferError): leave the mapping to process exit rather than fail shutdown.
        with contextlib.suppress(BufferError):
            self.buf.close()
        if self.owner and self.fd >= 0:
            if not keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_path(self.name, self.directory))
            os.close(self.fd)
            self.fd = -1


def remove_stale(name: str, directory: str = SHM_DIR) -> bool:
    """Remove a segment whose owner is gone; raise SegmentInUse if a live owner holds it."""
    path = _path(name, directory)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        _lock(fd, path)
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _lock(fd: int, path: str) -> None:
    """Take the owner lock of an open segment, or raise SegmentInUse while a live owner holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SegmentInUse(f"shared-memory segment {path} is owned by a running server") from exc
        raise
