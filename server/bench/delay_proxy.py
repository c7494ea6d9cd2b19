"""A TCP proxy that adds a round trip: each direction's bytes leave `rtt_s / 2` after they arrived, in order,
without serializing throughput (a timestamped queue per direction, flushed when its head is due; a sleep per
read would add up). It stands in for netem (not available here) between a client and a store.

asyncio on a `select()` selector: epoll's timeout has 1 ms steps (Python rounds it up), which would turn a
0.5 ms half-RTT into 1 ms; select's is in microseconds. Fine for the few connections of a bench or test
(file descriptors < 1024).

    with DelayProxy("127.0.0.1", 6379, rtt_s=0.005) as proxy:   # a thread of this process
        client = connect(proxy.host, proxy.port)
    python -m kvtier.server.bench.delay_proxy --target 127.0.0.1:6379 --rtt-ms 5   # a process: prints its port

`spawn` runs the latter and returns it with its port, for a bench whose client must not share the proxy's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

READY = "delay-proxy listening on port "  # the subprocess's first line on stdout
QUEUED_MAX = 64 << 20  # bytes queued per direction before the sending side is paused (its TCP window fills)


class _Pipe(asyncio.Protocol):
    """One direction's sink and the other's source: bytes received here go to `peer`'s transport when due."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop, self.delay = loop, delay
        self.transport: asyncio.Transport | None = None
        self.peer: _Pipe | None = None
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()  # None: EOF
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.ready = asyncio.Event()  # set once the transport is there (the outbound side connects later)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.ready.set()

    def data_received(self, data: bytes) -> None:
        self._push(data)

    def eof_received(self) -> bool:
        self._push(None)
        return True  # keep the transport open: the other direction may still carry bytes

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.queue:
            self.peer.transport.close()
        elif self.queue:
            self._push(None)

    def _push(self, data: bytes | None) -> None:
        self.queue.append((self.loop.time() + self.delay, data))
        self.queued += len(data) if data else 0
        if self.queued > QUEUED_MAX and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if self.timer is None:
            self._flush()

    def _flush(self) -> None:
        """Write out every due item, then wait for the next (or for the outbound side to connect)."""
        self.timer = None
        out = self.peer.transport if self.peer is not None else None
        if out is None:
            self.timer = self.loop.call_later(0.001, self._flush)
            return
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            if data is None:
                if out.can_write_eof():
                    out.write_eof()
                if self.transport is None or self.transport.is_closing():
                    out.close()
                continue
            self.queued -= len(data)
            out.write(data)
        if self.paused and self.queued <= QUEUED_MAX // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)


@dataclass
class DelayProxy:
    """A proxy of `target_host:target_port` on `host` (an ephemeral `port` unless given), adding `rtt_s`,
    run on a thread of its own: `start()`/`stop()` or a with block."""

    target_host: str
    target_port: int
    rtt_s: float
    host: str = "127.0.0.1"
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def start(self) -> DelayProxy:
        if self.rtt_s < 0:
            raise ValueError(f"rtt_s must be >= 0, not {self.rtt_s}")
        self._loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        server = self._loop.run_until_complete(self._loop.create_server(self._accept, self.host, self.port))
        self.port = server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtier-delay-proxy", daemon=True)
        self._thread.start()
        return self

    def _accept(self) -> _Pipe:
        """The client-side pipe of a new connection; the store-side one connects behind it."""
        assert self._loop is not None
        loop, half = self._loop, self.rtt_s / 2
        client_side = _Pipe(loop, half)
        store_side = _Pipe(loop, half)
        client_side.peer, store_side.peer = store_side, client_side

        async def connect() -> None:
            try:
                await loop.create_connection(lambda: store_side, self.target_host, self.target_port)
            except OSError:
                await client_side.ready.wait()
                if client_side.transport is not None:
                    client_side.transport.close()

        loop.create_task(connect())
        return client_side

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def spawn(target_host: str, target_port: int, rtt_s: float) -> Iterator[int]:
    """The proxy in a process of its own (no GIL shared with the caller): yields its port on 127.0.0.1."""
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.server.bench.delay_proxy", "--target",
                             f"{target_host}:{target_port}", "--rtt-ms", repr(rtt_s * 1000)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line.startswith(READY):
            raise RuntimeError(f"the delay proxy did not start: {line!r}")
        yield int(line[len(READY):])
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="host:port to forward to")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round trip added, milliseconds")
    parser.add_argument("--port", type=int, default=0, help="port to listen on, 127.0.0.1 (0: any free one)")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    proxy = DelayProxy(host.strip("[]"), int(port), args.rtt_ms / 1000, port=args.port).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"{READY}{proxy.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
