"""One copier process as the daemon sees it (server/transfer/copier.py is the process itself): spawned, spoken
to over a non-blocking socket pair, supervised and replaced in place when it fails; copiers.py keeps one per
(engine, GPU).

Everything here runs on the serving loop and never blocks it: a process is spawned on a worker thread, its
exit is watched through a pidfd and its socket is non-blocking, both read with loop.add_reader. A copier
whose heartbeats stop for `watchdog_s`, that exits, whose operation outlives `op_timeout_s` or which says a
stream hung is SIGKILLed at once (its exit unmaps every engine's memory it had open); only once the process
has exited do its in-flight operations fail with COPIER_FAILED (so that no reservation, lease or engine
block is handed on while a DMA of it may still run), then a new one is spawned and the registrations it held
are opened there again under the same ids.
This module never imports the backends (cupy stays out of the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.server.protocol import COPIER_FAILED, NO_COPIER, GpuMemory
from kvtier.server.transfer.base import GpuUnavailable
from kvtier.server.transfer.copier import CopierArgs, FrameReader, encode

log = logging.getLogger("kvtier.server.transfer")

STOP_TIMEOUT_S = 5.0  # how long a closing copier may take to close its registrations before it is killed

Observer = Callable[[dict[str, Any]], None]  # gets a copier's status entry when its pinning or restarts change


@dataclass(frozen=True)
class CopiersConfig:
    segment_path: str
    segment_size: int
    page_size: int
    piece_bytes: int
    watchdog_s: float
    op_timeout_s: float
    max_copiers: int = 8  # copier processes running or starting at once
    start_timeout_s: float = 30.0  # a copier's import of cupy and CUDA context creation


@dataclass
class Registration:
    id: int
    memory: GpuMemory
    failure: GpuUnavailable | None = None  # why its copier could not open it again after a restart

    @property
    def key(self) -> tuple[str, str]:
        return self.memory.engine, self.memory.device


def _spawn(argv: list[str], theirs: socket.socket) -> tuple[subprocess.Popen[bytes], int]:
    """Start a copier process (on a worker thread) that inherits `theirs` (closed here then); with a pidfd that
    turns readable when it exits."""
    with theirs:
        proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    try:
        return proc, os.pidfd_open(proc.pid)
    except OSError:
        proc.kill()
        proc.wait()
        raise


class Copier:
    """One (engine, device)'s copier process, replaced in place by its supervisor when it fails."""

    def __init__(self, key: tuple[str, str], config: CopiersConfig, registrations: dict[int, Registration],
                 observer: Observer | None) -> None:
        self.key = key
        self.config = config
        self.registrations = registrations  # the daemon-wide table (this copier's are those with its key)
        self.observer = observer
        self.loop = asyncio.get_running_loop()
        self.state = "starting"  # starting -> serving -> restarting -> starting ...; failed; closed
        self.restarts = 0
        self.failed_at = 0.0  # time.monotonic() it gave up
        self.pinned = 0
        self.pin_error = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.exited: asyncio.Future[None] = self.loop.create_future()  # done once the current process is gone
        self.exited.set_result(None)
        self.failure: asyncio.Event = asyncio.Event()
        self.failure_why = ""
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._reader = FrameReader()
        self._out = bytearray()
        self._last_beat = 0.0
        self.task = self.loop.create_task(self._supervise())

    # --- status --------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"engine": self.key[0], "device": self.key[1], "pid": self.proc.pid if self.proc else None,
                "pinned_bytes": self.pinned, "total_bytes": self.config.segment_size, "pin_error": self.pin_error,
                "state": self.state, "restarts": self.restarts,
                "registrations": sorted(r.id for r in self.registrations.values() if r.key == self.key)}

    def _observe(self) -> None:
        if self.observer is not None:
            self.observer(self.status())

    # --- requests ------------------------------------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Until the copier serves (after a restart: once it reopened its registrations)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.ready), self.config.start_timeout_s)
        except GpuUnavailable as exc:
            raise GpuUnavailable(exc.reason, exc.detail) from exc
        except TimeoutError as exc:
            raise GpuUnavailable(COPIER_FAILED, "the copier did not come back in time") from exc

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send and await the reply. An operation outliving op_timeout_s, or whose reply says a stream hung,
        kills the copier; it answers only once that process has exited."""
        if self.sock is None or self.failure.is_set():
            raise GpuUnavailable(COPIER_FAILED, f"the copier is {self.state}")
        op_id = next(self._ids)
        reply = self.pending[op_id] = self.loop.create_future()
        exited = self.exited
        self.send({**message, "id": op_id})
        try:
            answer = await asyncio.wait_for(asyncio.shield(reply), self.config.op_timeout_s)
        except TimeoutError as exc:
            self.pending.pop(op_id, None)
            self.fail(f"{message['op']} took longer than {self.config.op_timeout_s} s")
            await asyncio.shield(exited)
            raise GpuUnavailable(COPIER_FAILED, f"{message['op']} timed out; the copier was killed") from exc
        if answer.get("hung"):
            self.fail(f"a {message.get('direction')} stream hung: {answer['detail']}")
            await asyncio.shield(exited)
        return answer

    def send(self, message: dict[str, Any]) -> None:
        if self.sock is None:
            return
        data = encode(message)
        if not self._out:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self.fail(f"socket: {exc}")
                return
            data = data[sent:]
            if data:
                self.loop.add_writer(self.sock.fileno(), self._flush)
        self._out += data

    def _flush(self) -> None:
        assert self.sock is not None
        try:
            sent = self.sock.send(self._out)
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(f"socket: {exc}")
            return
        del self._out[:sent]
        if not self._out:
            self.loop.remove_writer(self.sock.fileno())

    def _readable(self) -> None:
        assert self.sock is not None
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.fail("the copier exited")
            return
        try:
            messages = self._reader.feed(data)
        except ValueError as exc:
            self.fail(f"bad message: {exc}")
            return
        for m in messages:
            op = m.get("op")
            if op == "reply" or op == "hello":
                reply = self.pending.pop(m.get("id", 0), None)
                if reply is not None and not reply.done():
                    reply.set_result(m)
            elif op == "heartbeat":
                self._last_beat = self.loop.time()
                if (m["pinned"], m["error"]) != (self.pinned, self.pin_error):
                    self.pinned, self.pin_error = m["pinned"], m["error"]
                    self._observe()

    # --- failure and supervision ---------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        """Kill the process now; its in-flight operations fail once it has exited (_exit), and the supervisor
        replaces it."""
        if self.failure.is_set() or self.state in ("closed", "failed"):
            return
        self.failure_why = why
        self.failure.set()
        if self.ready.done():
            self.ready = self.loop.create_future()
        self.state = "restarting"
        self._signal_kill()

    def _signal_kill(self) -> None:
        self._detach()  # no reply of this process is believed any more
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def _exit(self, proc: subprocess.Popen[bytes], pidfd: int) -> None:
        """Once `proc` has exited (nothing of it can touch memory any more), reap it and fail what it held."""
        gone = self.loop.create_future()
        self.loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            self.loop.remove_reader(pidfd)
            os.close(pidfd)
        proc.wait()  # it has exited: this only reaps it
        self.fail(f"the copier exited with status {proc.returncode}")
        self._fail_pending(self.failure_why or "the copy engine is closing")

    def _fail_pending(self, why: str) -> None:
        pending, self.pending = self.pending, {}
        for reply in pending.values():
            if not reply.done():
                reply.set_exception(GpuUnavailable(COPIER_FAILED, why))

    async def _supervise(self) -> None:
        quick_failures = 0
        while True:
            started = self.loop.time()
            try:
                await self._start()
            except GpuUnavailable as exc:
                await self._kill()
                self._give_up(exc)
                return
            await self._replay()
            if not self.failure.is_set():
                self.state = "serving"
                self.ready.set_result(None)
                await self._watch()
            log.warning("copier of %s %s (pid %s) failed: %s; restarting", *self.key, self.proc and self.proc.pid,
                        self.failure_why)
            await self._kill()
            self.restarts += 1
            self._observe()
            quick_failures = quick_failures + 1 if self.loop.time() - started < self.config.watchdog_s else 0
            await asyncio.sleep(min(self.config.watchdog_s, 0.1 * (2 ** quick_failures - 1)))

    async def _start(self) -> None:
        self.state = "starting"
        self.failure.clear()
        self.failure_why = ""
        self.pinned, self.pin_error = 0, ""
        self._reader = FrameReader()
        self._out = bytearray()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        c = self.config
        args = CopierArgs(c.segment_path, c.segment_size, c.page_size, self.key[0], self.key[1], c.piece_bytes,
                          c.op_timeout_s, theirs.fileno())
        try:  # off the loop: a fork of a large daemon takes a while
            self.proc, pidfd = await asyncio.to_thread(_spawn, args.argv(), theirs)
        except OSError as exc:
            ours.close()
            raise GpuUnavailable(NO_COPIER, f"cannot start a copier: {exc}") from exc
        except asyncio.CancelledError:
            ours.close()  # a copier that starts all the same (the engine is closing) reads EOF and exits
            raise
        self.exited = self.loop.create_task(self._exit(self.proc, pidfd))
        ours.setblocking(False)
        self.sock = ours
        self._last_beat = self.loop.time()
        hello = self.pending[0] = self.loop.create_future()
        self.loop.add_reader(ours.fileno(), self._readable)
        try:
            reply = await asyncio.wait_for(hello, c.start_timeout_s)
        except (TimeoutError, GpuUnavailable) as exc:
            raise GpuUnavailable(NO_COPIER, f"the copier did not start: {exc or 'timed out'}") from exc
        if not reply["ok"]:
            raise GpuUnavailable(reply["reason"], reply["detail"])

    async def _replay(self) -> None:
        for registration in [r for r in self.registrations.values() if r.key == self.key]:
            try:
                reply = await self.request({"op": "register", "reg": registration.id,
                                            "memory": registration.memory.to_wire()})
            except GpuUnavailable:
                return  # the new copier failed as well
            registration.failure = None if reply["ok"] else GpuUnavailable(reply["reason"], reply["detail"])
            if registration.id not in self.registrations:  # unregistered meanwhile
                self.send({"op": "unregister", "reg": registration.id})

    async def _watch(self) -> None:
        while not self.failure.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.failure.wait(), self.config.watchdog_s / 4)
            silent = self.loop.time() - self._last_beat
            if silent > self.config.watchdog_s:
                self.fail(f"no heartbeat for {silent:.1f} s")

    def _give_up(self, exc: GpuUnavailable) -> None:
        log.warning("copier of %s %s cannot run: %s", *self.key, exc)
        self.state = "failed"
        self.failed_at = time.monotonic()
        for registration in self.registrations.values():
            if registration.key == self.key:
                registration.failure = exc
        if self.ready.done():
            self.ready = self.loop.create_future()
        self.ready.set_exception(exc)
        self.ready.exception()  # retrieved: waiters see it, nobody else is told it was ignored

    def _detach(self) -> None:
        if self.sock is not None:
            self.loop.remove_reader(self.sock.fileno())
            self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
            self.sock = None

    async def _kill(self) -> None:
        """SIGKILL the process and wait until it has exited and its operations failed."""
        self._signal_kill()
        await asyncio.shield(self.exited)

    async def stop(self) -> None:
        """Close the daemon's end (the copier closes its registrations and exits); kill it if it lingers."""
        self.state = "closed"
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self._detach()
        if not self.ready.done():
            self.ready.set_exception(GpuUnavailable(COPIER_FAILED, "the copy engine is closing"))
            self.ready.exception()
        try:
            await asyncio.wait_for(asyncio.shield(self.exited), STOP_TIMEOUT_S)
        except TimeoutError:
            await self._kill()
