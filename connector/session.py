"""The client's session with one server: hello (identity, token, liveness lock), the mapped segment, the
namespaces registered, and saying hello again when the server restarted or comes back after a backoff.

An unreachable server is a miss, never an exception (unless `strict`), and a restarted server is detected
and re-registered with transparently. Requests go out through the transport (transport.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.populate import Populator
from kvtier.connector.transport import KVTierError, KVTierUnavailable, Link, Request, State, Transport
from kvtier.server import protocol as p
from kvtier.server.keys import Namespace
from kvtier.shm.client_lock import ClientLock
from kvtier.shm.presence import PresenceReader
from kvtier.shm.segment import Segment

log = logging.getLogger("kvtier.client")

DEFAULT_URL = "tcp://127.0.0.1:5555"
_FORGOTTEN = (p.NOT_REGISTERED, p.UNKNOWN_NAMESPACE)  # the server restarted: say hello (and register) again


@dataclass
class ClientConfig:
    url: str = DEFAULT_URL
    connect_timeout_s: float = 1.0
    request_timeout_s: float = 5.0
    retry_backoff_s: float = 1.0
    strict: bool = False
    instance: str = field(default_factory=lambda: f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    token: str = ""


class Pending:
    """A request on the wire (`Session.submit`): `done()` never blocks, `result()` waits for the reply."""

    def __init__(self, session: Session, request: Request) -> None:
        self._session = session
        self.request = request
        self.forgotten = False  # the server answered that it does not know this client (it restarted)
        self.patient = False  # a deadline the caller chose: no reply by then does not make the server unreachable
        self._outcome: tuple[dict[str, Any] | None, BaseException | None] | None = None

    @property
    def link(self) -> Link:
        return self.request.link

    def done(self) -> bool:
        """Whether `result()` would return without waiting (reads replies that arrived; never blocks)."""
        return self._session._transport.poll(self.request)

    def result(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The reply; None when the server is unreachable, restarted meanwhile, or did not answer within the
        client's request timeout (or within `timeout` seconds, after which this request is given up: a late
        reply is dropped). Raises KVTierError for an error reply; in strict mode raises instead of None."""
        if self._outcome is None:
            self._outcome = self._session._outcome(self, timeout)
        reply, exc = self._outcome
        if exc is not None:
            raise exc
        return reply


class Session:
    """Thread-safe; `_conn` serialises the connection's lifecycle (hello, reset, namespace registration) while
    requests themselves go out concurrently through the transport."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._transport = Transport()
        self._conn = threading.RLock()  # the connection's lifecycle: hello, reset, namespace registration
        self._segment: Segment | None = None
        self._presence: PresenceReader | None = None  # the server's presence filter, when it sends one
        self.server_id = ""
        self.hellos = 0  # successful hellos: a server that forgot this client forgot its GPU registrations too
        self.heartbeat_s = 0.0  # how often the server wants a silent client to heartbeat (its hello reply)
        self.events_endpoint = ""  # the server's event feed and its replay socket (its hello reply; "" if none)
        self.events_replay = ""
        self._namespaces: dict[Namespace, bytes] = {}
        self._next_attempt = 0.0
        self._alive: ClientLock | None = None  # liveness lock beside the server's segment (docs/protocol.md)
        self._populate = False  # this client copies into and out of L1: map all of it ahead (populate_l1)
        self._l1_backed = False  # the server backs all of L1 with memory (its hello reply)
        self._populator: Populator | None = None

    # -- connection ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Said hello to a server that still runs, as far as this client can tell: a presence filter marked closed
        means that server stopped or a new one replaced it, so the next request says hello again on a new
        connection (answered at once by a restarted server) instead of waiting for a reply on the old one."""
        presence = self._presence
        return self._transport.link.sock is not None and bool(self.server_id) and (presence is None or presence.open)

    def connect(self) -> bool:
        """Say hello and map the segment. False (or KVTierUnavailable in strict mode) when unreachable."""
        with self._conn:
            try:
                self._hello()
                return True
            except KVTierUnavailable:
                if self.config.strict:
                    raise
                return False

    def close(self) -> None:
        with self._conn:
            if self.connected:
                with contextlib.suppress(KVTierUnavailable, KVTierError):
                    self._call({"op": "bye"}, timeout=0.2)
            self._reset()
            if self._alive is not None:
                self._alive.close()
                self._alive = None

    def _reset(self) -> None:
        """Drop the connection (caller holds `_conn`): every request pending on it resolves to a miss."""
        self._transport.drop()
        self.server_id = ""
        if self._populator is not None:  # before the mapping it populates goes
            self._populator.stop()
            self._populator = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        presence, self._presence = self._presence, None
        if presence is not None:
            presence.close()

    def _hello(self) -> None:
        self._reset()
        link = self._transport.open(self.config.url)
        hello = {"op": "hello", "version": p.PROTOCOL_VERSION, "instance": self.config.instance,
                 "pid": os.getpid(), "token": self.config.token}
        alive = self._alive
        try:
            reply = self._call({**hello, "lock": alive.name if alive else ""}, timeout=self.config.connect_timeout_s)
        except KVTierError as exc:
            if alive is None or exc.code != p.BAD_REQUEST:
                raise
            # the server cannot see our lock file (removed from under us): hold a new one, as at first contact
            log.warning("kvtier server refused this client's lock file (%s): creating a new one", exc)
            alive.close()
            self._alive = alive = None
            reply = self._call(dict(hello), timeout=self.config.connect_timeout_s)
        if alive is None or (alive.directory, alive.segment_name) != (reply["shm_dir"], reply["shm_name"]):
            # first contact (or a server with another segment): hold a lock file beside its segment, so
            # the server can tell this process is alive while it copies; then register with it
            if alive is not None:
                alive.close()
            try:
                self._alive = alive = ClientLock(reply["shm_dir"], reply["shm_name"])
            except OSError as exc:  # e.g. the segment's directory is not this process's: a miss, not a crash
                raise KVTierUnavailable(f"cannot create a lock file in {reply['shm_dir']}: {exc}") from None
            reply = self._call({**hello, "lock": alive.name}, timeout=self.config.connect_timeout_s)
        segment = Segment.attach(reply["shm_name"], reply["shm_size"], reply["shm_dir"])
        self._segment = segment
        link.array, link.page_size = segment.array(), reply["page_size"]
        self._presence = _map_presence(reply)
        self._l1_backed = bool(reply.get("l1_backed"))
        self._start_populating()
        self.server_id = reply["server_id"]
        self.heartbeat_s = float(reply.get("heartbeat_s") or 0.0)
        self.events_endpoint = str(reply.get("events") or "")  # the server's event feed: stores name their tokens
        self.events_replay = str(reply.get("events_replay") or "")
        self.hellos += 1
        self._namespaces = {ns: b"" for ns in self._namespaces}
        log.info("connected to kvtier server %s at %s", self.server_id[:8], self.config.url)

    def populate_l1(self) -> None:
        """This client copies into and out of L1 (a CPU engine's worker): map all of it into this process's page
        tables ahead, in the background (populate.py), now and after every hello, where the server backs all of
        L1 with memory (`l1_backed`, its prefault; on a sparse segment it would commit memory the server leaves
        unused)."""
        with self._conn:
            self._populate = True
            self._start_populating()

    @property
    def l1_populated(self) -> bool:
        """Whether all of the current server's L1 is mapped into this process ahead (populate_l1)."""
        populator = self._populator
        return populator is not None and populator.done

    def _start_populating(self) -> None:
        if self._populate and self._l1_backed and self._segment is not None and self._populator is None:
            self._populator = Populator(self._segment)

    def _unreachable(self, link: Link) -> None:
        """The server did not answer on connection `link`: drop it and back off."""
        with self._conn:
            if link is not self._transport.link:
                return  # dropped already (another thread reconnected or reset)
            if link.sock is not None:
                log.warning("kvtier server at %s unreachable: treating as misses", self.config.url)
            self._reset()
            self._next_attempt = time.monotonic() + self.config.retry_backoff_s

    def _forget(self, link: Link) -> None:
        """The server behind `link` does not know this client (it restarted): the next request says hello."""
        with self._conn:
            if link is self._transport.link and self.server_id:
                log.info("kvtier server forgot this client (restart?): registering again")
                self.server_id = ""

    def _call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request/reply without reconnecting (caller holds `_conn`); raises KVTierUnavailable/KVTierError."""
        request = self._transport.send(message, timeout if timeout is not None else self.config.request_timeout_s)
        reply = self._transport.settle(request, request.deadline)
        if reply is None:
            raise KVTierUnavailable(f"no reply from {self.config.url} within the timeout")
        return reply

    # -- requests with reconnect -----------------------------------------------------------------

    def submit(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None) -> Pending:
        """Send one request now (saying hello and registering `ns` first if needed); never waits for its reply.

        `timeout_s` replaces the request timeout for an operation the server may legitimately take longer to
        answer (a GPU copy, a registration that starts a copier): no reply by then is that request's failure
        only, never a reason to treat the server as unreachable.

        While the server is unreachable the request is not sent and resolves to None at once, until the
        backoff passes (so an engine is not slowed down by a dead server). A request whose server restarted
        resolves to None too, and the next request says hello again. Raises KVTierError when the server
        refuses the hello or the registration of `ns`.
        """
        for attempt in range(2):
            with self._conn:
                link = self._transport.link
                if not self.connected and time.monotonic() < self._next_attempt:
                    if self.config.strict:
                        raise KVTierUnavailable("server unreachable; backing off")
                    break
                try:
                    if not self.connected:
                        self._hello()
                        link = self._transport.link
                    wire = dict(message)
                    if ns is not None:
                        wire["ns"] = self._ns_id(ns)
                    if "ranks" in wire:  # a lookup's other namespaces: (Namespace, chunks) pairs
                        wire["ranks"] = [(self._ns_id(other), keys) for other, keys in wire["ranks"]]
                except KVTierError as exc:
                    if exc.code in _FORGOTTEN and attempt == 0:
                        self._forget(link)
                        continue
                    raise
                except KVTierUnavailable:
                    self._unreachable(self._transport.link)
                    if self.config.strict:
                        raise
                    break
                timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
                pending = Pending(self, self._transport.send(wire, timeout))
                pending.patient = timeout_s is not None
                return pending
        return Pending(self, Request.unsent())

    def _outcome(self, pending: Pending, timeout: float | None
                 ) -> tuple[dict[str, Any] | None, BaseException | None]:
        """What `pending.result(timeout)` returns or raises (computed once)."""
        request = pending.request
        until = request.deadline if timeout is None else min(request.deadline, time.monotonic() + timeout)
        try:
            reply = self._transport.settle(request, until)
        except KVTierError as exc:
            if exc.code not in _FORGOTTEN:
                return None, exc
            pending.forgotten = True
            self._forget(request.link)
            return None, exc if self.config.strict else None
        if reply is None and request.state is State.LOST:
            if request.id and not pending.patient:  # sent, but no reply by its deadline (or its link dropped)
                self._unreachable(request.link)
            if self.config.strict:
                return None, KVTierUnavailable(f"no reply from {self.config.url} within the timeout")
        return reply, None

    def _exchange(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None
                  ) -> tuple[dict[str, Any], Link] | None:
        """`request`, with the link that answered (its segment holds the reply's extents)."""
        for attempt in range(2):
            pending = self.submit(message, ns, timeout_s)
            try:
                reply = pending.result()
            except KVTierError:
                if not (pending.forgotten and attempt == 0):
                    raise
                continue
            if reply is not None:
                return reply, pending.link
            if not pending.forgotten:
                return None
        return None

    def request(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None
                ) -> dict[str, Any] | None:
        """One request with reconnect: re-hello and re-register once if the server restarted (`timeout_s`: as
        in `submit`).

        Returns None when the server is unreachable (non-strict), after which further attempts are
        skipped until the backoff passes, so an engine is not slowed down by a dead server.
        """
        got = self._exchange(message, ns, timeout_s)
        return got[0] if got is not None else None

    _request = request

    # -- namespaces and liveness -----------------------------------------------------------------

    def _ns_id(self, ns: Namespace) -> bytes:
        with self._conn:
            fp = self._namespaces.get(ns)
            if not fp:
                fp = self._call({"op": "register", "namespace": ns.to_dict()})["ns"]
                self._namespaces[ns] = fp
            return fp

    def register(self, ns: Namespace) -> bool:
        """Announce a namespace (also done lazily by every call that names one)."""
        with self._conn:
            self._namespaces.setdefault(ns, b"")
        return self._request({"op": "heartbeat"}, ns) is not None

    def heartbeat(self) -> bool:
        return self._request({"op": "heartbeat"}) is not None

    def stats(self) -> dict[str, Any] | None:
        return self._request({"op": "stats"})


def _map_presence(reply: dict[str, Any]) -> PresenceReader | None:
    """The presence filter a hello reply names (only a server whose filter is authoritative names one), mapped
    read-only; None when there is none or it cannot be mapped (then every lookup goes to the server)."""
    name = reply.get("presence")
    if not name:
        return None
    try:
        return PresenceReader(str(name), str(reply["shm_dir"]))
    except (OSError, ValueError) as exc:
        log.warning("cannot map the kvtier server's presence filter %s (%s): asking the server every time",
                    name, exc)
        return None
