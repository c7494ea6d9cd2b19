"""The client's transport: one ZeroMQ DEALER socket to the server, msgpack frames, many requests in flight.

Several threads share one socket: every request goes out at once (`send` returns a `Request`), and each reply
is handed to its request by id, whatever order replies come back in. There is no I/O thread: a thread waiting
for a reply reads the socket for everyone while no other thread does (the socket "token", under `_cv`),
polling it outside the lock; a thread that sends meanwhile queues its frame and wakes the reader through a pipe.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
import os
import threading
import time
import weakref
from typing import Any

import numpy as np
import zmq
from kvtier.server import protocol as p

log = logging.getLogger("kvtier.client")


class KVTierUnavailable(RuntimeError):
    """The server could not be reached (raised only in strict mode; otherwise it is a miss)."""


class KVTierError(RuntimeError):
    """The server answered with an error (`reason`: the reply's reason field, e.g. of gpu_unavailable)."""

    def __init__(self, code: str, message: str, reason: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" ({reason})" if reason else ""))
        self.code = code
        self.reason = reason


class State(enum.Enum):
    WAITING = "waiting"
    REPLIED = "replied"
    ABANDONED = "abandoned"  # the caller stopped waiting before the request's deadline
    LOST = "lost"  # not sent, its connection was dropped (server restart, reconnect) or no reply by the deadline


class Link:
    """One connection's socket and the segment mapped through it; `array` is None once the link is dropped, so
    a reply read after a reset never hands out spans of a segment this client no longer holds."""

    def __init__(self, sock: zmq.Socket | None = None, poller: zmq.Poller | None = None) -> None:
        self.sock, self.poller = sock, poller
        self.array: np.ndarray | None = None
        self.page_size = 0


class Request:
    """One request on the wire: its link, id and deadline; `reply` once answered."""

    def __init__(self, link: Link, rid: int, deadline: float) -> None:
        self.link, self.id, self.deadline = link, rid, deadline
        self.state = State.WAITING
        self.reply: dict[str, Any] | None = None

    @classmethod
    def unsent(cls) -> Request:
        """A request that never went out (no link, or backing off): lost from the start."""
        request = cls(Link(), 0, 0.0)
        request.state = State.LOST
        return request


class Transport:
    """Thread-safe multiplexing of requests over the current link; `open` replaces it, `drop` loses it."""

    def __init__(self) -> None:
        self._ctx = zmq.Context.instance()
        self._link = Link()
        self._cv = threading.Condition()  # the socket token, the pending map and the outbox
        self._pending: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self._outbox: list[bytes] = []
        self._reading = False  # a thread polls the socket outside _cv: only it may touch the socket
        self._wanted = 0  # threads waiting for the reader to hand the socket back (to replace it)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._ids = itertools.count(1)

    @property
    def link(self) -> Link:
        return self._link

    def open(self, url: str) -> Link:
        """Connect a new socket to `url` and make it the link requests go out on (after `drop`)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(url)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        with self._cv:
            self._link = link = Link(sock, poller)
        return link

    def drop(self) -> None:
        """Close the link once the reader hands the socket back: every request pending on it is lost."""
        with self._cv:
            self._wanted += 1
            try:
                self._wake()
                while self._reading:
                    self._cv.wait()
            finally:
                self._wanted -= 1
            for request in list(self._pending.values()):
                request.state = State.LOST
            self._pending.clear()
            self._outbox.clear()
            link, self._link = self._link, Link()
            link.array = None
            if link.sock is not None:
                link.sock.close(linger=0)
            self._cv.notify_all()

    def send(self, message: dict[str, Any], timeout: float) -> Request:
        """Put `message` on the wire with a fresh id; never waits (lost at once when there is no link)."""
        rid = next(self._ids)
        message["id"] = rid
        frame = p.pack(message)
        with self._cv:
            link = self._link
            request = Request(link, rid, time.monotonic() + timeout)
            if link.sock is None:
                request.state = State.LOST
                return request
            self._pending[rid] = request
            if self._reading:  # the reader owns the socket: it sends the frame when the pipe wakes it
                self._outbox.append(frame)
                self._wake()
                return request
            try:
                link.sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("kvtier send failed: %s", exc)
                del self._pending[rid]
                request.state = State.LOST
        return request

    def poll(self, request: Request) -> bool:
        """Whether waiting for `request` would return at once (reads replies that arrived; never blocks)."""
        with self._cv:
            if request.state is State.WAITING and not self._reading and not self._wanted:
                self._read(0.0)
            return request.state is not State.WAITING or time.monotonic() >= request.deadline

    def settle(self, request: Request, until: float) -> dict[str, Any] | None:
        """Wait for `request`; its reply (None when lost or not answered by `until`). Raises KVTierError."""
        self._wait(request, until)
        with self._cv:
            if request.state is State.WAITING:  # given up: a late reply is dropped
                self._pending.pop(request.id, None)
                lost = time.monotonic() >= request.deadline
                request.state = State.LOST if lost else State.ABANDONED
        reply = request.reply
        if reply is None:
            return None
        if not reply.get("ok"):
            raise KVTierError(str(reply.get("code")), str(reply.get("error")), str(reply.get("reason") or ""))
        return reply

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the reader all the same
            os.write(self._wake_w, b"\0")

    def _wait(self, request: Request, until: float) -> None:
        """Block until `request` is answered or lost, or `until` passes; read the socket while nobody does."""
        with self._cv:
            while request.state is State.WAITING:
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return
                if self._reading or self._wanted:
                    self._cv.wait(remaining)
                else:
                    self._read(remaining)

    def _read(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for replies and hand them out (caller holds `_cv`; nobody else reads)."""
        sock, poller = self._link.sock, self._link.poller
        if sock is None or poller is None:
            return
        self._reading = True
        try:
            self._cv.release()
            try:
                events = dict(poller.poll(math.ceil(max(timeout_s, 0.0) * 1000)))
            finally:
                self._cv.acquire()
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            for frame in self._outbox:
                sock.send(frame, flags=zmq.NOBLOCK)
            self._outbox.clear()
            if sock in events:
                self._dispatch(sock)
        except zmq.ZMQError as exc:  # requests whose frames are lost time out
            log.debug("kvtier socket error: %s", exc)
            self._outbox.clear()
        finally:
            self._reading = False
            self._cv.notify_all()

    def _dispatch(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = p.unpack_reply(frame)
            except p.ProtocolError as exc:
                log.warning("kvtier: dropping an unreadable reply: %s", exc)
                continue
            rid = reply.get("id")
            request = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if request is not None:  # else: a reply nobody waits for any more
                request.reply, request.state = reply, State.REPLIED


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
