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
import ctypes
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
POPULATE_STEP = 16 << 20
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+; Python 3.11's mmap module does not name it
_madvise = ctypes.CDLL(None, use_errno=True).madvise  # through ctypes: the GIL is released while it runs
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SegmentInUse(RuntimeError):
    """Another live process owns a segment of that name."""


class SegmentMismatch(RuntimeError):
    """A segment left by a dead owner that cannot be adopted as it is (its size, file type or owner), or a
    directory in a segment's place that cannot be removed."""


class NoSpace(RuntimeError):
    """The tmpfs cannot hold what a server needs in it (docs/operations.md, "Sizing the shared-memory
    directory")."""


def _path(name: str, directory: str = SHM_DIR) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return os.path.join(directory, name)


def create_mapped(path: str, size: int, mode: int, lock: bool = False) -> tuple[int, mmap.mmap]:
    """A new file of `size` bytes at `path` (never an existing one), of exactly `mode` (os.open's mode is
    filtered by the umask), mapped shared read-write; with `lock`, under an exclusive flock. Removed again
    when a step fails. Returns its descriptor and mapping."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, mode)
    try:
        if lock:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, mode)
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise


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
        remove_stale(name, directory)
        fd, buf = create_mapped(_path(name, directory), size, mode, lock=True)
        return cls(name, size, fd, buf, owner=True, directory=directory)

    @classmethod
    def adopt(cls, name: str, size: int, mode: int = 0o600, directory: str = SHM_DIR) -> Segment:
        """Take over, bytes and all, a segment whose owner is gone: its lock is taken as `create` would.

        FileNotFoundError when there is none; SegmentInUse when a live owner holds it; SegmentMismatch (the
        file left as it is) when it is not a regular file of this user of exactly `size` bytes (a symbolic
        link is never followed).
        """
        try:
            fd = os.open(_path(name, directory), os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR):
                raise SegmentMismatch(f"{name} is a {_kind(exc)}, not a segment") from None
            raise
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
        def back(offset: int, length: int) -> None:
            os.posix_fallocate(self.fd, offset, length)
            progress(offset + length)

        return self._in_steps(PREFAULT_STEP, stop, back)

    def populate(self, stop: threading.Event, step: int = POPULATE_STEP) -> bool:
        """Enter every page of this mapping into this process's page tables, writable, without writing to it
        (madvise MADV_POPULATE_WRITE, Linux 5.14+; `step` bytes a call, the GIL released, so that `stop` is
        honoured): afterwards a copy into or out of the segment takes no page fault, which costs about ten times
        the copy of a page that is mapped already. Only for a segment whose owner backs all of it (the server's
        prefault), as on a hole it would allocate memory. The caller keeps the mapping open until it returns.
        Returns whether it finished; OSError when the kernel refuses (EINVAL before Linux 5.14)."""
        anchor = ctypes.c_char.from_buffer(self.buf)  # an export of the mapping, for its address only
        base = ctypes.addressof(anchor)
        del anchor

        def map_ahead(offset: int, length: int) -> None:
            if _madvise(base + offset, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {self.name}: {os.strerror(err)}")

        return self._in_steps(step, stop, map_ahead)

    def _in_steps(self, step: int, stop: threading.Event, each: Callable[[int, int], None]) -> bool:
        """`each(offset, length)` over the whole segment, `step` bytes a call, until `stop` is set; returns
        whether it went through all of it."""
        done = 0
        while done < self.size:
            if stop.is_set():
                return False
            n = min(step, self.size - done)
            each(done, n)
            done += n
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
    """Remove a segment whose owner is gone; raise SegmentInUse if a live owner holds it. A symbolic link in
    its place is removed, never followed; an empty directory is removed, any other one is SegmentMismatch."""
    path = _path(name, directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR):
            raise
        try:
            (os.unlink if exc.errno == errno.ELOOP else os.rmdir)(path)
        except OSError as why:
            raise SegmentMismatch(f"{path} is a {_kind(exc)} in a segment's place and cannot be removed "
                                  f"({why.strerror}): remove it, or choose another --shm-name") from None
        return True
    try:
        _lock(fd, path)
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _kind(exc: OSError) -> str:
    return "symbolic link" if exc.errno == errno.ELOOP else "directory"


def _lock(fd: int, path: str) -> None:
    """Take the owner lock of an open segment, or raise SegmentInUse while a live owner holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise SegmentInUse(f"shared-memory segment {path} is owned by a running server") from exc
        raise


LOCK_SUFFIX = ".lock"


class PairLock:
    """`<segment>.lock`, held by a server from before it touches its segment or journal until after it is
    done with them: two servers started on one name (a second unit, a stray --l1-discard) never interleave
    (the second gets SegmentInUse having changed nothing). The file is removed only by a holder, and a taker
    checks after locking that the name still points at the file it locked, so a removal never lets two in."""

    def __init__(self, name: str, directory: str = SHM_DIR) -> None:
        self.path = _path(name + LOCK_SUFFIX, directory)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EISDIR):
                    raise SegmentMismatch(f"{self.path} is a {_kind(exc)}, not a lock file: remove it") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SegmentInUse(f"shared-memory segment {_path(name, directory)} is owned by a running server "
                                   f"(or one starting: {self.path} is locked)") from None
            try:
                current = os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                current = -1
            if current == os.fstat(fd).st_ino:
                self.fd = fd
                return
            os.close(fd)  # removed (and perhaps re-created) by its last holder meanwhile: take the new one

    def release(self, remove: bool = False) -> None:
        """Drop the lock; with `remove`, the file first (its holder may)."""
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)


def check_space(directory: str, needs: dict[str, int]) -> None:
    """NoSpace unless the tmpfs holding `directory` has room for files of `needs` (name -> bytes) at full
    size: its free space plus what files of those names hold now (they are adopted or replaced)."""
    info = os.statvfs(directory)
    if not info.f_blocks:  # a tmpfs mounted with size=0 has no limit
        return
    held = 0
    for name in needs:
        with contextlib.suppress(FileNotFoundError):
            found = os.lstat(_path(name, directory))
            if stat.S_ISREG(found.st_mode):
                held += found.st_blocks * 512
    room = info.f_bavail * info.f_frsize + held
    if sum(needs.values()) > room:
        wanted = " + ".join(f"{name} {_mib(size)}" for name, size in needs.items())
        raise NoSpace(f"{directory} has room for {_mib(room)}, not the {_mib(sum(needs.values()))} this server "
                      f"needs ({wanted}): enlarge the tmpfs, or lower --l1-size-gb (docs/operations.md, "
                      "\"Sizing the shared-memory directory\")")


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


@dataclass
class SegmentFiles:
    """A kvtier segment in a shared-memory directory, as `kvtier segments` lists it."""

    name: str
    size: int  # the segment's file size (0: only its journal or lock file is left)
    journal: int  # its journal's file size (0: none)
    held: int  # memory the segment and journal hold (their allocated blocks)
    live: bool  # a live server holds it (its owner lock or its pair lock)


JOURNAL_NAME_SUFFIX = ".journal"  # server/l1/adopt.py's JOURNAL_SUFFIX: a segment's journal beside it
TENANTS_NAME_SUFFIX = ".tenants"  # server/tenant_tables.py: the tenant quota tables a warm restart keeps
PRESENCE_NAME_SUFFIX = ".presence"  # shm/presence.py: the presence filter, made anew at every start
SIDECARS = (JOURNAL_NAME_SUFFIX, TENANTS_NAME_SUFFIX, PRESENCE_NAME_SUFFIX)


def list_segments(directory: str = SHM_DIR) -> list[SegmentFiles]:
    """The kvtier segments in `directory`: files named kvtier* or with a journal or pair lock beside them
    (and journals or lock files whose segment is gone), by name. Whether a server holds one is read from
    /proc/locks: nothing is opened or locked, so listing never gets in a starting server's way."""
    found: dict[str, os.stat_result] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False) and _NAME_RE.match(entry.name):
                found[entry.name] = entry.stat(follow_symlinks=False)
    bases = {name.removesuffix(JOURNAL_NAME_SUFFIX).removesuffix(TENANTS_NAME_SUFFIX)
             .removesuffix(PRESENCE_NAME_SUFFIX).removesuffix(LOCK_SUFFIX)
             for name in found if name.endswith((*SIDECARS, LOCK_SUFFIX))}
    bases |= {name for name in found if name.startswith("kvtier") and ".client-" not in name
              and not name.endswith((*SIDECARS, LOCK_SUFFIX))}
    locked = _locked_files()
    out = []
    for base in sorted(bases):
        files = [found.get(base), found.get(base + JOURNAL_NAME_SUFFIX)]
        lock = found.get(base + LOCK_SUFFIX)
        live = any(info is not None and (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino) in locked
                   for info in (*files, lock))
        out.append(SegmentFiles(base, files[0].st_size if files[0] else 0, files[1].st_size if files[1] else 0,
                                sum(info.st_blocks * 512 for info in files if info is not None), live))
    return out


def remove_unused(directory: str = SHM_DIR) -> list[SegmentFiles]:
    """Remove the segments (journal first, then segment, then lock file) that no live server holds; returns
    them. One a server takes meanwhile is left to it: each is removed under its pair lock and owner locks."""
    removed = []
    for found in list_segments(directory):
        if found.live:
            continue
        try:
            pair = PairLock(found.name, directory)
        except SegmentInUse:
            continue
        try:
            remove_stale(found.name + JOURNAL_NAME_SUFFIX, directory)
            remove_stale(found.name, directory)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, found.name + TENANTS_NAME_SUFFIX))
            from kvtier.shm.presence import mark_closed  # it imports this module

            mark_closed(found.name + PRESENCE_NAME_SUFFIX, directory)  # a client mapping it stops trusting it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, found.name + PRESENCE_NAME_SUFFIX))
        except SegmentInUse:  # an older server, which takes no pair lock
            pair.release()
            continue
        pair.release(remove=True)
        removed.append(found)
    return removed


def _locked_files() -> set[tuple[int, int, int]]:
    """(device major, minor, inode) of every file some process holds a lock on."""
    held = set()
    with open("/proc/locks") as locks:
        for line in locks:
            fields = line.split()
            if "->" in fields:  # a waiter, not a holder
                continue
            major, minor, inode = fields[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
    return held
