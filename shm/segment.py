"""POSIX shared-memory segments in a tmpfs directory (/dev/shm by default), created by the server and
mapped by local clients.

Plain `os.open` + `mmap` instead of multiprocessing.shared_memory: the latter registers every attach
with Python's resource tracker, which unlinks the segment when a *client* exits (Python < 3.13).
The owner holds an exclusive flock on the segment for its lifetime, so a segment whose owner was
killed is recognisable (the lock is free) and removed at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"
PREFAULT_STEP = 64 << 20
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SegmentInUse(RuntimeError):
    """Another live process owns a segment of that name."""


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

    def array(self) -> np.ndarray:
        """A uint8 view of the whole mapping (no copy)."""
        return np.frombuffer(self.buf, dtype=np.uint8)

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment and drops its lock."""
        # Views still exported (BufferError): leave the mapping to process exit rather than fail shutdown.
        with contextlib.suppress(BufferError):
            self.buf.close()
        if self.owner:
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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SegmentInUse(f"shared-memory segment {path} is owned by a running server") from exc
            raise
        os.unlink(path)
        return True
    finally:
        os.close(fd)
