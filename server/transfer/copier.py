"""The copier process (`python -m kvtier.server.transfer.copier ...`): one per (engine, GPU), spawned by the
daemon (server/transfer/copiers.py), talking to it over an inherited socketpair end.

It maps the L1 segment and page-locks it on a background thread, opens the engines' registrations with its
DeviceBackend (cuda.py, imported only here and only for "cuda"; or the CPU stand-in fake.py), plans every copy
(plan.py) and runs it. The copies of one registration and direction run in order on one thread (its
"stream"); different registrations and directions run in parallel. A heartbeat carries pinning progress every
HEARTBEAT_S. The process ends when the daemon's end closes, and with the daemon (PR_SET_PDEATHSIG), so that no
mapping of an engine's memory outlives the daemon; on the way out it closes every registration. It ignores
SIGTERM and SIGINT: sent to the daemon's whole process group (systemd's default stop, a terminal's Ctrl-C), they
are the daemon's to act on, and the daemon stops its copiers itself (a copier that died of them first would be
restarted by the daemon on its way down).

Messages are msgpack maps, each prefixed by its length (FRAME). Daemon -> copier: register {reg, memory},
unregister {reg} (no reply), copy {reg, direction, copies, event}. Copier -> daemon: hello {ok, pid | reason,
detail} once, heartbeat {pinned, total, error}, reply {id, ok | reason, detail, hung}; `hung` says that a
stream is stuck (an event never fired) and the copier must be replaced. A copy whose copies carry a `start_by`
(the worker's deadline, the host's monotonic clock) that has passed when it reaches the head of its stream is
answered LATE without touching the engine's memory: its worker has stopped waiting and reuses its blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
from kvtier.server.protocol import COPIER_FAILED, LATE, NO_COPIER, NOT_PINNED, GpuMemory, ProtocolError
from kvtier.server.transfer.base import LOAD, STORE, Copy, DeviceBackend, GpuUnavailable
from kvtier.server.transfer.plan import plan

FRAME = struct.Struct("<I")
MAX_MESSAGE = 1 << 28
HEARTBEAT_S = 0.5
MODULE = "kvtier.server.transfer.copier"
INVALID = "invalid"  # reply reason of a request the copier cannot parse or plan (a bug on the daemon's side)
_PR_SET_PDEATHSIG = 1


def encode(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return FRAME.pack(len(body)) + body


class FrameReader:
    """Messages out of a byte stream fed in arbitrary pieces."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        messages = []
        while len(self._buf) >= FRAME.size:
            (n,) = FRAME.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise ValueError(f"copier message of {n} bytes")
            if len(self._buf) < FRAME.size + n:
                break
            messages.append(msgpack.unpackb(bytes(self._buf[FRAME.size : FRAME.size + n]), raw=False))
            del self._buf[: FRAME.size + n]
        return messages


def copy_to_wire(copy: Copy) -> list[Any]:
    return [copy.key, list(copy.block_ids), copy.first, copy.blocks, list(copy.extents), copy.size, copy.start_by]


def copy_from_wire(item: Sequence[Any]) -> Copy:
    key, block_ids, first, blocks, extents, size, start_by = item
    return Copy(key, tuple(block_ids), first, blocks, tuple(extents), size, start_by)


@dataclass(frozen=True)
class CopierArgs:
    segment: str  # the L1 segment's file
    segment_size: int
    page_size: int
    engine: str  # GpuMemory.engine
    device: str  # GpuMemory.device: the GPU's UUID, or the fake device's name
    piece_bytes: int  # page-locking piece; no copy entry crosses one
    op_timeout_s: float  # how long a copy waits for its event
    fd: int  # this process's end of the socketpair

    def argv(self) -> list[str]:
        return [sys.executable, "-m", MODULE, "--segment", self.segment, "--segment-size", str(self.segment_size), "--page-size",
                str(self.page_size), "--engine", self.engine, "--device", self.device, "--piece-bytes",
                str(self.piece_bytes), "--op-timeout-s", str(self.op_timeout_s), "--fd", str(self.fd)]

    @classmethod
    def parse(cls, argv: Sequence[str]) -> CopierArgs:
        parser = argparse.ArgumentParser(prog="kvtier-copier")
        for name, kind in [("segment", str), ("segment-size", int), ("page-size", int), ("engine", str),
                           ("device", str), ("piece-bytes", int), ("op-timeout-s", float), ("fd", int)]:
            parser.add_argument(f"--{name}", type=kind, required=True)
        return cls(**vars(parser.parse_args(argv)))


def make_backend(args: CopierArgs) -> DeviceBackend:
    """The engine's backend; GpuUnavailable(NO_COPIER) when it cannot load (no cupy), or its own reason."""
    try:
        if args.engine == "cuda":
            from kvtier.server.transfer.cuda import CudaBackend

            return CudaBackend(args.device)
        if args.engine == "fake":
            from kvtier.server.transfer.fake import FakeBackend

            return FakeBackend(args.device, os.path.dirname(args.segment))
        if args.engine == "host":
            from kvtier.server.transfer.host import HostBackend

            return HostBackend()
    except GpuUnavailable:
        raise
    except Exception as exc:
        raise GpuUnavailable(NO_COPIER, f"{args.engine} copy engine: {type(exc).__name__}: {exc}") from exc
    raise GpuUnavailable(NO_COPIER, f"unknown engine {args.engine!r}")


@dataclass
class _Op:
    id: int
    direction: str
    copies: list[Any]
    event: int


@dataclass
class _Registration:
    memory: GpuMemory
    opened: Any
    streams: dict[str, tuple[queue.SimpleQueue[_Op | None], threading.Thread]] = field(default_factory=dict)


class Copier:
    def __init__(self, args: CopierArgs, sock: socket.socket, backend: DeviceBackend, segment: mmap.mmap) -> None:
        self.args = args
        self.sock = sock
        self.backend = backend
        self.segment = segment
        self.pinned = 0
        self.pin_error = ""
        self.registrations: dict[int, _Registration] = {}
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.sock.sendall(encode(message))

    def reply(self, op_id: int, error: GpuUnavailable | None = None, hung: bool = False) -> None:
        message: dict[str, Any] = {"op": "reply", "id": op_id, "ok": error is None}
        if error is not None:
            message.update(reason=error.reason, detail=error.detail, hung=hung)
        with contextlib.suppress(OSError):
            self.send(message)

    def serve(self) -> None:
        threading.Thread(target=self._pin, name="pin", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        reader = FrameReader()
        try:
            with contextlib.suppress(ConnectionError):
                while data := self.sock.recv(1 << 20):
                    for message in reader.feed(data):
                        self.handle(message)
        finally:
            self._stopping.set()
            for reg in list(self.registrations):
                self._unregister(reg, wait=True)

    def handle(self, m: dict[str, Any]) -> None:
        op = m.get("op")
        if op == "register":
            self._register(m["id"], m["reg"], m["memory"])
        elif op == "unregister":
            self._unregister(m["reg"], wait=False)
        elif op == "copy":
            self._copy(_Op(m["id"], m["direction"], m["copies"], m["event"]), m["reg"])

    def _register(self, op_id: int, reg: int, wire: dict[str, Any]) -> None:
        try:
            if reg in self.registrations:
                raise GpuUnavailable(INVALID, f"registration {reg} exists")
            try:
                memory = GpuMemory.from_wire(wire)
            except ProtocolError as exc:
                raise GpuUnavailable(INVALID, exc.message) from exc
            if (memory.engine, memory.device) != (self.args.engine, self.args.device):
                raise GpuUnavailable(INVALID, f"memory of {memory.engine} {memory.device!r} sent to the copier "
                                     f"of {self.args.engine} {self.args.device!r}")
            self.registrations[reg] = _Registration(memory, self.backend.open(memory))
        except GpuUnavailable as exc:
            self.reply(op_id, exc)
        else:
            self.reply(op_id)

    def _unregister(self, reg: int, wait: bool) -> None:
        """Drop the registration; its streams finish what they hold, then its memory is closed (on a thread
        unless `wait`, so that a stream waiting for an event does not stop the serving loop)."""
        registration = self.registrations.pop(reg, None)
        if registration is None:
            return
        for stream, _ in registration.streams.values():
            stream.put(None)
        closer = threading.Thread(target=self._close, args=(registration,), name=f"close-{reg}", daemon=True)
        closer.start()
        if wait:
            closer.join(self.args.op_timeout_s + 1)

    def _close(self, registration: _Registration) -> None:
        """Close once every stream of it ended; a stream still stuck may yet touch the memory, so its mapping
        is left to the process's end (the daemon replaces a copier whose stream hung)."""
        for _, thread in registration.streams.values():
            thread.join(self.args.op_timeout_s + 1)
        if not any(thread.is_alive() for _, thread in registration.streams.values()):
            self.backend.close(registration.opened)

    def _copy(self, op: _Op, reg: int) -> None:
        registration = self.registrations.get(reg)
        if registration is None or op.direction not in (STORE, LOAD):
            self.reply(op.id, GpuUnavailable(INVALID, f"copy {op.direction!r} for unknown registration {reg}"))
        elif self.pin_error:
            self.reply(op.id, GpuUnavailable(NO_COPIER, f"L1 could not be page-locked: {self.pin_error}"))
        elif self.pinned < self.args.segment_size:
            self.reply(op.id, GpuUnavailable(NOT_PINNED, f"{self.pinned} of {self.args.segment_size} bytes"))
        else:
            if op.direction not in registration.streams:
                stream: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
                thread = threading.Thread(target=self._stream, args=(registration, stream),
                                          name=f"stream-{reg}-{op.direction}", daemon=True)
                registration.streams[op.direction] = (stream, thread)
                thread.start()
            registration.streams[op.direction][0].put(op)

    def _stream(self, registration: _Registration, stream: queue.SimpleQueue[_Op | None]) -> None:
        args = self.args
        while (op := stream.get()) is not None:
            if self._stopping.is_set():
                self.reply(op.id, GpuUnavailable(COPIER_FAILED, "the copier is stopping"))
                continue
            try:
                copies = [copy_from_wire(item) for item in op.copies]
                entries = plan(registration.memory, copies, args.page_size, args.segment_size, args.piece_bytes)
            except (ValueError, TypeError) as exc:
                self.reply(op.id, GpuUnavailable(INVALID, str(exc)))
                continue
            start_by = min((c.start_by for c in copies if c.start_by), default=0.0)
            if start_by and time.monotonic() > start_by:  # its worker no longer waits: never touch its blocks
                self.reply(op.id, GpuUnavailable(LATE, f"started {time.monotonic() - start_by:.3f} s after start_by"))
                continue
            try:
                self.backend.run(registration.opened, op.direction, entries, op.event, args.op_timeout_s)
            except GpuUnavailable as exc:
                self.reply(op.id, exc)
            except Exception as exc:  # a timed-out event or a driver error: this stream cannot be trusted
                self.reply(op.id, GpuUnavailable(COPIER_FAILED, f"{type(exc).__name__}: {exc}"), hung=True)
            else:
                self.reply(op.id)

    def _pin(self) -> None:
        def progress(done: int) -> None:
            self.pinned = done

        try:
            self.backend.pin(memoryview(self.segment), self.args.piece_bytes, progress)
        except Exception as exc:
            self.pin_error = f"{type(exc).__name__}: {exc}"

    def _heartbeat(self) -> None:
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self.send({"op": "heartbeat", "pinned": self.pinned, "total": self.args.segment_size,
                           "error": self.pin_error})
            except OSError:
                return


def _map_segment(args: CopierArgs) -> mmap.mmap:
    fd = os.open(args.segment, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != args.segment_size:
            raise ValueError(f"{args.segment} is not {args.segment_size} bytes")
        return mmap.mmap(fd, args.segment_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> None:
    args = CopierArgs.parse(sys.argv[1:] if argv is None else argv)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    try:
        backend = make_backend(args)
        try:
            segment = _map_segment(args)
        except (OSError, ValueError) as exc:
            raise GpuUnavailable(NO_COPIER, f"cannot map L1: {exc}") from exc
    except GpuUnavailable as exc:
        sock.sendall(encode({"op": "hello", "ok": False, "reason": exc.reason, "detail": exc.detail}))
        return
    copier = Copier(args, sock, backend, segment)
    copier.send({"op": "hello", "ok": True, "pid": os.getpid()})
    copier.serve()


if __name__ == "__main__":
    main()
