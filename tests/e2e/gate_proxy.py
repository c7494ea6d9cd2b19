"""A ZeroMQ proxy between vLLM's kvtier connector and the kvtier server that can hold chosen requests.

It stands for a slow server or network: requests of the gated ops (e.g. "acquire", the first message of a
load, or "reserve", the first of a store) wait in the proxy until the test releases them, so a test can keep
a transfer in flight for as long as it needs and look at vLLM meanwhile. Everything else passes through
untouched. Each client gets its own connection to the server (the server tells clients apart by
connection), and the shared-memory data path is not proxied: only the request/reply messages are.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import zmq
from kvtier.server import protocol as p


class GateProxy:
    def __init__(self, listen_port: int, server_url: str) -> None:
        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self._front.bind(f"tcp://127.0.0.1:{listen_port}")
        self._server_url = server_url
        self._backs: dict[bytes, zmq.Socket] = {}
        self._gated: set[str] = set()
        self._held: list[tuple[bytes, bytes]] = []
        self._release_all = False
        self.seen: Counter[str] = Counter()  # ops passed on to the server
        self.held_ops: Counter[str] = Counter()  # ops held so far (released or not)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gate-proxy", daemon=True)
        self._thread.start()

    def gate(self, *ops: str) -> None:
        """Hold every request of `ops` from now on, until `release`."""
        with self._lock:
            self._gated = set(ops)
            self._release_all = False

    def release(self) -> None:
        """Pass on every held request (in arrival order) and stop gating."""
        with self._lock:
            self._gated = set()
            self._release_all = True

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def wait_held(self, op: str, count: int = 1, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self.held_ops[op] >= count:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {op} request reached the gate in {timeout} s (seen: {dict(self.seen)})")
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in (self._front, *self._backs.values()):
            sock.close(linger=0)
        self._ctx.term()

    def _back(self, ident: bytes) -> zmq.Socket:
        sock = self._backs.get(ident)
        if sock is None:
            sock = self._backs[ident] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self._server_url)
        return sock

    def _op(self, frame: bytes) -> str:
        try:
            op = p.unpack(frame).get("op")
        except p.ProtocolError:
            return "?"
        return op if isinstance(op, str) else "?"

    def _run(self) -> None:
        while not self._stop.is_set():
            poller = zmq.Poller()
            poller.register(self._front, zmq.POLLIN)
            for sock in self._backs.values():
                poller.register(sock, zmq.POLLIN)
            events = dict(poller.poll(20))
            if self._front in events:
                while True:
                    try:
                        ident, frame = self._front.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    op = self._op(frame)
                    with self._lock:
                        hold = op in self._gated
                        if hold:
                            self._held.append((ident, frame))
                            self.held_ops[op] += 1
                        else:
                            self.seen[op] += 1
                    if not hold:
                        self._back(ident).send(frame)
            with self._lock:
                release, self._release_all = self._release_all, False
                held = self._held if release else []
                if release:
                    self._held = []
            for ident, frame in held:
                with self._lock:
                    self.seen[self._op(frame)] += 1
                self._back(ident).send(frame)
            for ident, sock in list(self._backs.items()):
                if sock in events:
                    while True:
                        try:
                            reply = sock.recv(flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._front.send_multipart([ident, reply])
