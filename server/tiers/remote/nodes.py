"""The remote tier's nodes and calls: which master holds a key (the Cluster slot map, refreshed), one glide
client per thread (sized timeouts, TLS, credentials), calls under each node's breaker, batches, commands
routed to one node. glide's exception types are read here (and in the data paths), nowhere in networked/."""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import glide_sync as glide
from kvtier.server.tiers.networked.breaker import OpenedState
from kvtier.server.tiers.remote.layout import PART_BYTES, slot

log = logging.getLogger("kvtier.server.remote")

T = TypeVar("T")

TIMEOUT_FACTOR = 4  # a transfer times out at this many times its duration at the measured bandwidth
ASSUMED_BYTES_PER_S = 100e6  # until the bandwidth is measured: 1 GbE
RESIZE_FACTOR = 2.0  # a thread's client is made anew when its part timeout is this far off the sized one

READ_FROM = {"primary": glide.ReadFrom.PRIMARY, "prefer_replica": glide.ReadFrom.PREFER_REPLICA,
             "az_affinity": glide.ReadFrom.AZ_AFFINITY}  # --remote-read-from's choices (options.READ_FROM)

# Failures of a node (they trip its breaker); other errors are answers (a server error, a bad value).
_NODE_FAILURES = (glide.TimeoutError, glide.ConnectionError, glide.ClosingError)


def node_failure(exc: BaseException) -> bool:
    """The breakers' failure classifier: whether `exc` says the node did not answer (towards opening its
    breaker), not that it refused. A glide client that never connected raises a plain RequestError ("...
    connect failed") for a node that is down."""
    return isinstance(exc, _NODE_FAILURES) or (isinstance(exc, glide.RequestError) and "connect" in str(exc).lower())


def denied(reply: object) -> bool:
    """Whether a batch's reply is the store's refusal of a command the ACL user may not run."""
    return isinstance(reply, glide.RequestError) and any(w in str(reply) for w in ("NOPERM", "PermissionDenied"))


def full(exc: object) -> bool:
    """Whether `exc` (an exception or a batch's error value) is the store's OOM reply: maxmemory reached and
    its policy evicts nothing (noeviction, or volatile-* with no TTL'd keys left)."""
    return isinstance(exc, glide.RequestError) and str(exc).startswith("OOM")


# A "partial data" error glide raises itself when a GET's value is larger than the caller's buffer: the part
# is longer than its header says (corruption), unlike the server's error replies (the store is unavailable).
OVERFLOW = "exceeds buffer capacity"

TLS_HINT = (" (TLS: a store that refuses the handshake looks like one that does not answer; check "
            "--remote-tls-ca-file, --remote-tls-cert-file and --remote-tls-key-file)")


class Unavailable(Exception):
    """A call not made (its node's breaker is open) or failed (timeout, lost connection): a miss."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nodes:
    """RemoteTier's node and call methods (a part of the tier: the state is set by RemoteTier.__init__)."""

    @staticmethod
    def _node_name(host: str, port: int) -> str:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _node_of(self, key: bytes) -> str:
        """The master holding the keys tagged with chunk key `key` (as of the last slot map)."""
        if not self.url.cluster:
            return self._slot_nodes[0]
        return self._slot_nodes[bisect.bisect_right(self._slot_starts, slot(key.hex().encode())) - 1]

    def _available(self, node: str) -> bool:
        return self._breakers.available(node)

    def _client(self, primary: bool = False, resize: bool = False) -> Any:
        """This thread's client; `primary`: one whose reads go to the primary (the same client unless
        --remote-read-from sends reads to replicas). Closed and replaced: a client marked stale (a new password
        it could not take), and with `resize` (only where no caller up the stack holds it: put, get) one whose
        request timeout is RESIZE_FACTOR off the one the measured bandwidth now sizes for a part."""
        attr = "primary" if primary and self.access.read_from != "primary" else "client"
        client = getattr(self._local, attr, None)
        if client is not None:
            made, sized = getattr(self._local, f"{attr}_timeout_ms"), self._timeout_ms(PART_BYTES)
            off = resize and not made / RESIZE_FACTOR <= sized <= made * RESIZE_FACTOR
            if off or id(client) in self._stale:
                with self._lock:
                    self._stale.discard(id(client))
                    self._clients.remove(client)
                with contextlib.suppress(glide.GlideError):
                    client.close()
                client = None
        if client is None:
            password = self._password
            setattr(self._local, f"{attr}_timeout_ms", self._timeout_ms(PART_BYTES))
            client = self._connect(password, primary=attr == "primary")
            setattr(self._local, attr, client)
            with self._lock:
                self._clients.append(client)
                if password != self._password:  # a new password came meanwhile, after the clients were told
                    self._stale.add(id(client))
        return client

    def _connect(self, password: str, primary: bool = False) -> Any:
        """A client (lazy: it connects at its first call) whose request timeout is sized from the bandwidth
        measured so far; `primary`: its reads go to the primary whatever --remote-read-from says."""
        u, a = self.url, self.access
        addresses = [glide.NodeAddress(h, p) for h, p in u.nodes]
        creds = glide.ServerCredentials(password, u.username or None) if password else None
        timeout = self._timeout_ms(PART_BYTES)
        connect = max(timeout, self.connect_timeout_ms)
        tls = glide.TlsAdvancedConfiguration(root_pem_cacerts=self._ca, client_cert_path=a.tls_cert_file or None,
                                             client_key_path=a.tls_key_file or None) if u.tls else None
        common = dict(use_tls=u.tls, credentials=creds, request_timeout=timeout, lazy_connect=True,
                      read_from=READ_FROM["primary" if primary else a.read_from], client_az=a.az or None)
        if u.cluster:
            return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(
                addresses, advanced_config=glide.AdvancedGlideClusterClientConfiguration(
                    connection_timeout=connect, tls_config=tls), **common))
        return glide.GlideClient.create(glide.GlideClientConfiguration(
            addresses, database_id=u.db or None, advanced_config=glide.AdvancedGlideClientConfiguration(
                connection_timeout=connect, tls_config=tls), **common))
    def _timeout_ms(self, nbytes: int) -> int:
        bw = self._bw.bytes_per_s or ASSUMED_BYTES_PER_S
        return max(self.timeout_ms, round(TIMEOUT_FACTOR * nbytes / bw * 1000))

    def _call(self, node: str, op: str, fn: Callable[[], T]) -> T:
        """`fn()` on `node` under its breaker; Unavailable (counted) when the breaker is open or the node
        failed. Other errors (the server's answers) pass through."""
        brk = self._breakers.get(node)
        if brk.open:
            self.rejected += 1
            self.m.rejected.labels(op).inc()
            raise Unavailable(f"{node}: its breaker is open")
        try:
            return brk.call(fn)
        except glide.TimeoutError:
            self.timeouts += 1
            self.m.timeouts.labels(op).inc()
            raise Unavailable(node) from None
        except glide.GlideError as exc:
            if not node_failure(exc):
                raise  # the server's answer (out of memory, no permission, ...)
            self._error(op, node, exc)
            raise Unavailable(f"{node}: {str(exc).strip()}") from None  # why, for the logs (a refused handshake)
        except OpenedState:  # opened by another thread since `brk.open` was read
            self.rejected += 1
            self.m.rejected.labels(op).inc()
            raise Unavailable(node) from None

    def _error(self, op: str, node: str, exc: BaseException) -> None:
        self.errors += 1
        self.m.errors.labels(op).inc()
        log.debug("remote %s on %s failed: %s", op, node, exc)

    def _batch(self, client: Any, fill: Callable[[Any], None], nbytes: int) -> list:
        """A non-atomic batch (pipeline) of the commands `fill(batch)` adds, its timeout sized for `nbytes`;
        per-command errors come back as RequestError values."""
        cluster = self.url.cluster
        batch = glide.ClusterBatch(is_atomic=False) if cluster else glide.Batch(is_atomic=False)
        fill(batch)
        timeout = self._timeout_ms(nbytes)
        options = glide.ClusterBatchOptions(timeout=timeout) if cluster else glide.BatchOptions(timeout=timeout)
        return client.exec(batch, raise_on_error=False, options=options) or []

    def _expiry(self, extra_ms: int = 0) -> glide.ExpirySet | None:
        if not self.ttl_ms:
            return None
        return glide.ExpirySet(glide.ExpiryType.MILLSEC, self.ttl_ms + extra_ms)

    def _masters(self) -> list[str]:
        return sorted(set(self._slot_nodes))

    def _on_node(self, client: Any, node: str, args: list[str]) -> Any:
        """A command run on one node (a Cluster's master by address)."""
        if not self.url.cluster:
            return client.custom_command(args)
        host, _, port = node.rpartition(":")
        return client.custom_command(args, route=glide.ByAddressRoute(host.strip("[]"), int(port)))

    def _refresh(self) -> None:
        """The Cluster slot map, the RTT (PING) and INFO memory of every master whose breaker is closed."""
        client = self._client()
        if self.url.cluster:
            try:
                self._map_slots(client.custom_command(["CLUSTER", "SLOTS"], route=glide.RandomNode()))
            except glide.GlideError as exc:
                log.debug("remote CLUSTER SLOTS failed: %s", exc)
        used = capacity = 0
        rtts = []
        for node in self._masters():
            if not self._available(node):
                continue
            try:  # an untimed PING first: the first call on a connection includes its setup
                self._call(node, "probe", lambda node=node: self._on_node(client, node, ["PING"]))
                t0 = time.perf_counter()
                self._call(node, "probe", lambda node=node: self._on_node(client, node, ["PING"]))
                rtts.append(time.perf_counter() - t0)
                info = self._call(node, "probe", lambda node=node: self._on_node(client, node, ["INFO", "memory"]))
            except (Unavailable, glide.RequestError):
                continue
            fields = dict(line.split(":", 1) for line in text(info).splitlines() if ":" in line)
            used += int(fields.get("used_memory", 0))
            capacity += int(fields.get("maxmemory", 0))
            self._limits[node] = (int(fields.get("maxmemory", 0)), fields.get("maxmemory_policy", ""))
        if rtts:
            self._rtt = sorted(rtts)[len(rtts) // 2]
            self._used, self._capacity = used, capacity

    def _map_slots(self, reply: Any) -> None:
        ranges = []
        for item in reply or []:
            start, _end, master = item[0], item[1], item[2]
            host = text(master[0]) or self.url.nodes[0][0]
            ranges.append((int(start), self._node_name(host, int(master[1]))))
        if ranges:
            ranges.sort()
            self._slot_starts = [s for s, _ in ranges]
            self._slot_nodes = [n for _, n in ranges]
            self._drop_departed()

    def _drop_departed(self) -> None:
        """Forget the breakers (and their gauges) of nodes no longer in the slot map (failed over, moved to
        a new address): they are never pinged again and no longer make the tier degraded."""
        for node in self._breakers.keep_only(set(self._slot_nodes)):
            log.info("remote node %s left the slot map: its breaker is dropped", node)
