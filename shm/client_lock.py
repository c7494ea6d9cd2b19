"""Client liveness across PID namespaces: a lock file per client beside the segment.

A client creates `<segment>.client-<random hex>` in the segment's tmpfs directory and holds an exclusive
flock on it for its lifetime; the kernel drops the lock when the process dies, however it dies. The server
tests the lock (it never blocks) to tell a client that is only slow or stopped from one that is gone, which
decides when pages that client may still be touching can be handed to anyone else (docs/security.md).
Pids cannot do this: a containerised engine's pid means nothing in the server's PID namespace.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import uuid
import weakref

LOCK_INFIX = ".client-"
_HEX_RE = re.compile(r"^[0-9a-f]{32}$")


class ClientLock:
    """The client's side: create the file, lock it, keep it until close() (or the interpreter exits)."""

    def __init__(self, directory: str, segment_name: str) -> None:
        self.directory = directory
        self.segment_name = segment_name
        self.name = f"{segment_name}{LOCK_INFIX}{uuid.uuid4().hex}"
        path = os.path.join(directory, self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        # a client that is never closed still removes its file at exit; a killed one is swept by the server
        self._close = weakref.finalize(self, _remove_and_close, path, fd)

    def close(self) -> None:
        self._close()


def _remove_and_close(path: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


class LockDirectory:
    """The server's side: which lock files are valid names, and whether their holders are alive."""

    def __init__(self, directory: str, segment_name: str) -> None:
        self.directory = directory
        self.segment_name = segment_name

    def valid(self, name: str) -> bool:
        """True for `<segment>.client-<32 hex digits>`: nothing else in the directory is ever opened."""
        prefix = self.segment_name + LOCK_INFIX
        return name.startswith(prefix) and bool(_HEX_RE.match(name[len(prefix):]))

    def alive(self, name: str) -> bool:
        """Whether some live process holds the lock on `name` (never blocks: the file is opened non-blocking,
        must be a regular file, and the lock is only tried). A missing or foreign file counts as dead."""
        if not self.valid(name):
            return False
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        """Remove the lock file of a client found dead (`alive` False: killed before it could remove its
        own). Its name is never reused, so nobody can have locked it since."""
        if self.valid(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, name))

    def sweep(self) -> int:
        """Remove every dead client lock file of the segment (at server start and stop); returns how many."""
        dead = []
        with contextlib.suppress(OSError), os.scandir(self.directory) as it:
            dead = [item.name for item in it if self.valid(item.name) and not self.alive(item.name)]
        for name in dead:
            self.remove(name)
        return len(dead)
