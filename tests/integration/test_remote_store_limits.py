"""Operating the remote tier against a real store's limits (issue 29, item 4), real Redis servers of each
test's own (tests/integration/redis_servers.py):

* a full store that evicts nothing (maxmemory + noeviction): warned of at start; writes pause with a growing
  back-off after an OOM reply (skipped writes counted), so OOM-refused SETs stay few; reads go on; writes
  resume once the store has room;
* a chunk read gets its TTL back (PEXPIRE, throttled; the documented ACL user's): read now and then it
  outlives its first TTL, unread it expires;
* a chunk promoted from the store into another node's L1 is not written back to the store;
* a thread's client follows the measured bandwidth (a slow link: a pacing proxy), and the connection's
  setup has its own, larger floor (a proxy that delays each connection's first answer).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from kvtier.server.metrics import Metrics
from kvtier.server.tiers.remote.layout import PART_BYTES, PART_TTL_MARGIN_MS
from kvtier.server.tiers.remote.maintenance import REFRESH_FRACTION
from kvtier.server.tiers.remote.metrics import RemoteMetrics
from kvtier.server.tiers.remote.writes import FULL_PAUSE_S
from test_remote_nodes import NS, client, lookup, prompt, read_blocks, start_nodes, store_and_drain
from test_remote_operations import header_of, prefix, sample, tiers  # noqa: F401 - fixtures
from test_remote_tier import answered, keys_matching, new_meta, raw_client, read

pytestmark = pytest.mark.integration
# redis_server, redis_cluster, redis_cluster_own, make_acl_user
pytest_plugins = ("redis_servers",)

SMALL = 64 << 10  # one-part chunks: an OOM-refused put is one refused SET


def command(url: str, *args: str) -> object:
    c = raw_client(url)
    try:
        return c.custom_command(list(args))
    finally:
        c.close()


def info(url: str, section: str) -> dict[str, str]:
    text = command(url, "INFO", section)
    text = text.decode() if isinstance(text, bytes) else str(text)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def cmdstat(url: str, cmd: str, field: str) -> int:
    """A field of INFO commandstats' cmdstat_<cmd> (0 before the command's first call)."""
    line = info(url, "commandstats").get(f"cmdstat_{cmd}", "")
    fields = dict(item.split("=", 1) for item in line.split(",") if "=" in item)
    return int(fields.get(field, 0))


# -- a full store that does not evict -------------------------------------------------------------------


def test_a_full_store_that_does_not_evict_pauses_writes_and_resumes(redis_server, tiers, caplog):  # noqa: F811
    srv = redis_server()
    room = int(info(srv.url, "memory")["used_memory"]) + (3 << 20)  # the start's 1 MiB probe fits, ~30 chunks more
    command(srv.url, "CONFIG", "SET", "maxmemory", str(room))
    assert info(srv.url, "memory")["maxmemory_policy"] == "noeviction"
    metrics = Metrics()
    tier = tiers(srv.url, metrics=RemoteMetrics(metrics))
    with caplog.at_level(logging.WARNING, logger="kvtier.server.remote"):
        tier.scan()
    warned = [r.getMessage() for r in caplog.records if "evicts no kvtier chunk" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]

    ns = os.urandom(16)
    written: dict = {}
    start = time.monotonic()
    for _ in range(150):  # ~10 MiB into ~2 MiB of room
        meta = new_meta(ns, SMALL, 1)
        data = os.urandom(SMALL)
        if tier.put(meta, data):
            written[meta] = data
        for m, d in list(written.items())[:3]:  # reads go on all along
            assert read(tier, m) == d
    elapsed = time.monotonic() - start
    assert 3 <= len(written) < 150
    refused = cmdstat(srv.url, "set", "rejected_calls")  # the store's own count of OOM-refused SETs
    # one refused put, then one more each time a pause (1 s, doubling) ran out within the loop
    bound = 2 + math.ceil(math.log2(elapsed / FULL_PAUSE_S[0] + 1))
    assert 1 <= refused <= bound, (refused, bound, elapsed)
    skipped = sample(metrics, "kvtier_remote_skipped_writes_total", {"reason": "full"})
    assert skipped == tier.skipped == 150 - len(written) - refused
    assert sample(metrics, "kvtier_remote_errors_total", {"op": "put"}) == refused
    assert all(read(tier, m) == d for m, d in written.items())  # what fitted still hits

    command(srv.url, "CONFIG", "SET", "maxmemory", "0")
    with caplog.at_level(logging.INFO, logger="kvtier.server.remote"):
        deadline = time.monotonic() + FULL_PAUSE_S[1] + 5
        meta = new_meta(ns, SMALL, 1)
        while not tier.put(meta, data := os.urandom(SMALL)):  # skipped until the pause runs out
            assert time.monotonic() < deadline, "writes did not resume"
            time.sleep(0.05)
    assert read(tier, meta) == data
    assert any("takes writes again" in r.getMessage() for r in caplog.records)
    skipped = tier.skipped
    for _ in range(5):
        assert tier.put(new_meta(ns, SMALL, 1), os.urandom(SMALL))
    assert tier.skipped == skipped and cmdstat(srv.url, "set", "rejected_calls") == refused


@pytest.mark.parametrize(("settings", "warning"), [
    ((), "no maxmemory"),
    (("maxmemory", "64mb", "maxmemory-policy", "volatile-lru"), "evicts no kvtier chunk"),
    (("maxmemory", "64mb", "maxmemory-policy", "allkeys-lru"), None),
])
def test_a_store_that_cannot_evict_is_warned_of_once_at_start(redis_server, tiers, caplog,  # noqa: F811
                                                             settings, warning):
    srv = redis_server()
    if settings:
        command(srv.url, "CONFIG", "SET", *settings)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.remote"):
        tiers(srv.url, ttl_s=0).scan()  # no TTL: volatile-* evicts nothing of kvtier's
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warning in messages[0], messages


def test_the_server_warns_of_a_store_without_maxmemory_once(redis_server, kvtier_server):  # noqa: F811
    srv = redis_server()  # no maxmemory set
    node = kvtier_server(extra=["--remote-url", srv.url, "--remote-connect-timeout-ms", "3000"])
    log = node.log_path.read_text(errors="replace")
    assert log.count("no maxmemory on") == 1, log[-3000:]
    c = client(node.url)
    stats = c.stats()
    assert stats["remote_skipped_writes"] == 0 and stats["remote_writes_paused"] == []


# -- TTL refreshed by reads ---------------------------------------------------------------------------------


def test_a_chunk_read_now_and_then_outlives_its_ttl_an_unread_one_expires(redis_server, tiers, prefix,  # noqa: F811
                                                                         make_acl_user):
    """As the documented ACL user (the ACL must grant the refresh), a TTL of 2 s, reads every 0.1 s for 5 s."""
    srv = redis_server()
    url = make_acl_user(srv.url, "kvtier")
    ttl_s = 2.0
    tier = tiers(url, ttl_s=ttl_s)
    ns = os.urandom(16)
    hot, cold = new_meta(ns), new_meta(ns)
    hot_data = os.urandom(hot.size)
    assert tier.put(hot, hot_data) and tier.put(cold, os.urandom(cold.size))
    before = cmdstat(srv.url, "pexpire", "calls")
    start = time.monotonic()
    reads = 0
    while time.monotonic() - start < 2.5 * ttl_s:
        assert read(tier, hot) == hot_data, f"the hot chunk vanished {time.monotonic() - start:.1f} s in"
        reads += 1
        time.sleep(0.1)
    elapsed = time.monotonic() - start
    assert keys_matching(srv.url, header_of(tier, hot))
    assert not keys_matching(srv.url, header_of(tier, cold))  # expired
    assert read(tiers(url), cold) is None
    per_refresh = -(-hot.size // PART_BYTES) + 1 + len(hot.aliases)  # parts, header, aliases
    refreshes = (cmdstat(srv.url, "pexpire", "calls") - before) / per_refresh
    assert refreshes == int(refreshes) and 2 <= refreshes <= elapsed / (ttl_s * REFRESH_FRACTION) + 1 < reads
    header_ms = command(srv.url, "PTTL", header_of(tier, hot))
    parts = keys_matching(srv.url, f"{tier.prefix}:*:{{{hot.key.hex()}}}:*:*")  # <gen>:<i>
    assert len(parts) == 3 and 0 < header_ms <= ttl_s * 1000  # type: ignore[operator]
    part_ms = [command(srv.url, "PTTL", k.decode()) for k in parts]
    assert all(ms > header_ms + PART_TTL_MARGIN_MS // 2 for ms in part_ms), part_ms  # type: ignore[operator]


def test_a_user_that_may_not_expire_reads_on_and_is_told_once(redis_server, tiers, prefix, make_acl_user,  # noqa: F811
                                                             caplog):
    srv = redis_server()
    url = make_acl_user(srv.url, f"noexp-{prefix}", drop=("+pexpire",))
    tier = tiers(url, ttl_s=60)
    meta = new_meta(os.urandom(16))
    data = os.urandom(meta.size)
    assert tier.put(meta, data)
    with caplog.at_level(logging.WARNING, logger="kvtier.server.remote"):
        for _ in range(3):
            assert read(tier, meta) == data
            tier._refreshed.clear()  # noqa: SLF001 - not throttled: each read would refresh
            time.sleep(0.5)  # sent by the maintenance thread within 0.25 s
    messages = [r.getMessage() for r in caplog.records]
    assert sum("refused PEXPIRE" in m for m in messages) == 1, messages


# -- promoted chunks are not written back ----------------------------------------------------------------


def test_a_chunk_promoted_from_the_store_is_not_written_back(redis_server, kvtier_server, tmp_path):
    srv = redis_server()
    a, b = start_nodes(kvtier_server, srv.url, tmp_path)  # each with its own L2
    tokens = prompt(7, 16 * 16)  # 4 whole chunks
    ca, cb = client(a.url), client(b.url)
    sets = cmdstat(srv.url, "set", "calls")
    store_and_drain(ca, [tokens])
    after_a = cmdstat(srv.url, "set", "calls")
    assert after_a - sets >= 4 * 3  # the control: A's writes are seen (parts, header, aliases per chunk)

    found = lookup(cb, tokens)
    assert found.blocks == 16 and set(found.tiers) == {"remote"}
    assert read_blocks(cb, found) == 16
    assert set(cb.lookup(NS, tokens).tiers) == {"l1"}  # promoted into B's L1
    assert cb.stats()["remote_promoted"] == 4
    time.sleep(1.0)  # a write-behind of the promoted chunks would have been sent by now
    stats = cb.stats()
    assert stats["remote_written"] == 0 and stats["remote_queue_depth"] == 0 and stats["remote_inflight"] == 0
    assert stats["remote_existing_writes"] == 0
    assert cmdstat(srv.url, "set", "calls") == after_a


# -- timeouts from the measured bandwidth; the connection's own floor ------------------------------------


class SlowLink:
    """A TCP proxy on loopback to a store's port: the store's answers are paced at `rate` bytes/s (0: not
    paced), and the first answer on each connection waits `first_delay_s` (a far store's handshake)."""

    PIECE = 16 << 10

    def __init__(self, port: int) -> None:
        self.port_to = port
        self.rate = 0.0
        self.first_delay_s = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                down, _ = self._listener.accept()
                up = socket.create_connection(("127.0.0.1", self.port_to))
                self._socks += [down, up]
                threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        first = True
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if answers and first and self.first_delay_s:
                    time.sleep(self.first_delay_s)
                first = False
                for off in range(0, len(data), self.PIECE):
                    piece = data[off : off + self.PIECE]
                    if answers and self.rate:
                        time.sleep(len(piece) / self.rate)
                    dst.sendall(piece)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def slow_link(redis_server) -> Iterator[tuple[SlowLink, str]]:  # noqa: F811
    srv = redis_server()
    link = SlowLink(int(srv.url.rsplit(":", 1)[1]))
    yield link, srv.url
    link.close()


def test_a_thread_client_follows_the_measured_bandwidth(slow_link, tiers):  # noqa: F811
    """Made on a fast link (a 100 ms floor), the read thread's client is made anew when the measured
    bandwidth says a part takes longer: a part paced at 4 MB/s (~0.26 s) is read, not timed out."""
    link, _ = slow_link
    tier = tiers(f"redis://127.0.0.1:{link.port}", timeout_ms=100)
    meta = new_meta(os.urandom(16), PART_BYTES, 1)
    data = os.urandom(PART_BYTES)
    assert tier.put(meta, data) and read(tier, meta) == data  # this thread's client, made for a fast link
    link.rate = 4e6
    now = time.perf_counter()
    for i in range(20):  # what slow transfers would have measured
        tier._bw.add(PART_BYTES, now + i, now + i + PART_BYTES / link.rate)  # noqa: SLF001
    assert read(tier, meta) == data
    assert tier.timeouts == 0


def test_a_slow_connection_setup_has_its_own_floor(slow_link, tiers):  # noqa: F811
    """Each connection's first answer comes 0.5 s late (its handshake across a far link); calls take 100 ms
    at most: the connection is made within --remote-connect-timeout-ms (1 s), and the calls then work."""
    link, _ = slow_link
    link.first_delay_s = 0.5
    tier = tiers(f"redis://127.0.0.1:{link.port}", timeout_ms=100)
    meta = new_meta(os.urandom(16), SMALL, 1)
    data = os.urandom(SMALL)
    assert tier.put(meta, data)
    assert read(tier, meta) == data


def test_a_read_refreshes_the_ttl_on_every_master_of_a_cluster(redis_cluster, tiers):  # noqa: F811
    """The aliases of a chunk on other masters than its own get their TTL back too (a pipeline per node)."""
    ttl_s = 2.0
    tier = tiers(redis_cluster, ttl_s=ttl_s)
    tier.scan()  # the slot map
    ns = os.urandom(16)
    hot = new_meta(ns)
    while len({tier._node_of(k) for k in (hot.key, *hot.aliases)}) < 2:  # noqa: SLF001
        hot = new_meta(ns)
    data = os.urandom(hot.size)
    assert tier.put(hot, data)
    start = time.monotonic()
    while time.monotonic() - start < 2.5 * ttl_s:
        assert read(tier, hot) == data, f"the chunk vanished {time.monotonic() - start:.1f} s in"
        time.sleep(0.25)
    for alias in hot.aliases:
        assert keys_matching(redis_cluster, f"{tier.prefix}:{ns.hex()}:{{{alias.hex()}}}:a")
    other = tiers(redis_cluster)
    assert answered(other, [[*hot.aliases[:1]]], ns) == [(hot, 1)]  # a lookup ending inside the chunk


def test_a_full_cluster_pauses_writes_per_master(redis_cluster_own, tiers):  # noqa: F811
    """Every master of a Cluster of the test's own full (noeviction): each refuses a few SETs at most."""
    url, ports = redis_cluster_own
    for port in ports:
        node = f"redis://127.0.0.1:{port}"
        room = int(info(node, "memory")["used_memory"]) + (3 << 20)
        command(node, "CONFIG", "SET", "maxmemory", str(room))
    tier = tiers(url)
    tier.scan()
    ns = os.urandom(16)
    start = time.monotonic()
    written = sum(tier.put(new_meta(ns, SMALL, 1), os.urandom(SMALL)) for _ in range(300))
    elapsed = time.monotonic() - start
    refused = [cmdstat(f"redis://127.0.0.1:{port}", "set", "rejected_calls") for port in ports]
    bound = 2 + math.ceil(math.log2(elapsed / FULL_PAUSE_S[0] + 1))
    assert all(1 <= r <= bound for r in refused), (refused, bound, elapsed)
    assert written > 0 and tier.skipped + tier.errors + written == 300
    assert tier.errors <= sum(refused) <= tier.errors + 1  # and the start's probe SET, if its master was full
