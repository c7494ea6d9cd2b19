"""A key prefix per tenant in the remote tier (issue 32; docs/remote.md, "Tenants"), with real kvtier servers and
a real Redis 7:

* a named tenant's chunks (its tenant named by a quota table or by --remote-tenants; its namespaces by their
  cache salt, whole or the request's part) are written under `<prefix>:t:<tenant>:`, the default tenant's under
  the layout from before tenants, nothing elsewhere; a second node reads every one back bit-exact;
* an ACL user allowed only `~<prefix>:t:team-a:*` (docs/remote.md's ACL line otherwise): a node as that user
  stores team-a's chunks and another node as that user loads them bit-exact from the store, while team-b's
  and the default tenant's keys are refused by Redis (NOPERM): through the node (lookups miss and writes
  are dropped, both counted, nothing written) and through a raw client (redis-cli as that user), which
  still lists their names with SCAN (a documented limit).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid

import numpy as np
import pytest
from _support import free_port, payload_of, prompt, read_checked, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.results import LookupResult
from kvtier.server.keys import Namespace
from redis_servers import make_acl_user, redis_cluster, redis_standalone  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

BLOCK_BYTES = 16 << 10


def namespace(salt: str) -> Namespace:
    return Namespace(model="org/remote-tenants", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
                     block_size=16, layout="cpu", chunk_size=64, cache_salt=salt)  # 4 blocks per chunk


NS_A = namespace("team-a")  # tenant team-a by its whole salt (named by --l1-tenant-quotas)
NS_A_REQUEST = namespace("engine-7|team-a")  # ... by the request's part of the salt
NS_B = namespace("team-b")  # tenant team-b (named by --remote-tenants only)
NS_DEFAULT = namespace("team-c")  # a salt no table names: the default tenant
TOKENS = 2 * 64  # two whole chunks per prompt


def node(kvtier_server, url: str, prefix: str, seed: str, tenants: str = "team-b",  # type: ignore[no-untyped-def]
         http: int = 0):
    return kvtier_server(l1_gb=0.125, env={"PYTHONHASHSEED": seed}, extra=[
        "--remote-url", url, "--remote-prefix", prefix, "--remote-timeout-ms", "2000",
        "--l1-tenant-quotas", "team-a=0", "--remote-tenants", tenants, *(["--http-port", str(http)] if http else [])])


def client(url: str) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, strict=True, request_timeout_s=10.0))
    assert c.connect()
    return c


def store(c: KVTierClient, ns: Namespace, tokens: np.ndarray) -> None:
    """Store a prompt through `c` and wait until the node's remote write-behind is done with it."""
    c.store(ns, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES,
            lambda ch, span: span.write(0, payload_of(ch.key, len(ch.block_keys) * BLOCK_BYTES)))
    wait_for(lambda: (s := c.stats()) and s["remote_queue_depth"] == 0 and s["remote_inflight"] == 0,
             timeout=60, what="the remote writes done")


def lookup(c: KVTierClient, ns: Namespace, tokens: np.ndarray, timeout: float = 10.0) -> LookupResult:
    """A lookup asked again while the remote tier is still probing ("pending"), as the connector does."""
    deadline = time.monotonic() + timeout
    while True:
        found = c.lookup(ns, tokens)
        if not found.pending or time.monotonic() > deadline:
            return found
        time.sleep(0.01)


def cli(url: str, *args: str) -> str:
    """redis-cli's answer (an error reply included: redis-cli may exit 1 on it)."""
    run = subprocess.run(["redis-cli", "--no-auth-warning", "-u", url, *args], capture_output=True, text=True, errors="replace",
                         timeout=60)
    return (run.stdout + run.stderr).strip()


def keys(url: str, pattern: str) -> list[str]:
    """The keys matching `pattern` (on every master of a redis+cluster:// URL)."""
    if url.startswith("redis+cluster://"):
        return [k for node in url.removeprefix("redis+cluster://").split(",")
                for k in keys(f"redis://{node}", pattern)]
    return cli(url, "--scan", "--pattern", pattern).split()


def clear(http: int, body: dict) -> dict:
    """POST /cache/clear of a node's admin API: what it cleared per tier."""
    request = urllib.request.Request(f"http://127.0.0.1:{http}/cache/clear", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["tiers"]


@pytest.mark.parametrize("backend", ["redis_standalone", "redis_cluster"])
def test_a_named_tenant_s_chunks_live_under_its_prefix_and_another_node_reads_them(backend, request, kvtier_server):
    url, prefix, http = request.getfixturevalue(backend), f"t{uuid.uuid4().hex[:10]}", free_port()
    a, b = node(kvtier_server, url, prefix, "1", http=http), node(kvtier_server, url, prefix, "2")
    ca, cb = client(a.url), client(b.url)
    prompts = {ns.cache_salt: (ns, prompt(i, TOKENS)) for i, ns in enumerate((NS_A, NS_A_REQUEST, NS_B,
                                                                                NS_DEFAULT))}
    for ns, tokens in prompts.values():
        store(ca, ns, tokens)
    assert ca.stats()["remote_written"] == 2 * len(prompts)

    bases = {NS_A: f"{prefix}:t:team-a", NS_A_REQUEST: f"{prefix}:t:team-a", NS_B: f"{prefix}:t:team-b",
             NS_DEFAULT: prefix}
    for ns, base in bases.items():
        fp = ns.fingerprint().hex()
        assert len(keys(url, f"{base}:{fp}:*:h")) == 2, ns.cache_salt  # its two chunks' headers
        if base != prefix:  # not under the layout from before tenants
            assert keys(url, f"{prefix}:{fp}:*") == []
        else:
            assert keys(url, f"{prefix}:t:*:{fp}:*") == []
    # Nothing else under the prefix: parts, headers and alias keys all under their namespace's base.
    everything = keys(url, f"{prefix}:*")
    assert everything and all(any(k.startswith(f"{base}:{ns.fingerprint().hex()}:") for ns, base in bases.items())
                              for k in everything)

    for ns, tokens in prompts.values():  # node B finds and reads each tenant's chunks in the store
        found = lookup(cb, ns, tokens)
        assert not found.pending and found.blocks == TOKENS // 16 and set(found.tiers) == {"remote"}, ns.cache_salt
        assert read_checked(cb, ns, found.hits) == TOKENS // 16

    # A clear of one namespace of team-a removes its keys under team-a's prefix, and only those; a clear of
    # everything, every tenant's.
    a_fp = NS_A.fingerprint().hex()
    assert clear(http, {"scope": "namespace", "namespace": a_fp})["remote"]["entries"] == 2
    assert keys(url, f"{prefix}:t:team-a:{a_fp}:*") == []
    assert len(keys(url, f"{prefix}:t:team-a:*:h")) == 2  # NS_A_REQUEST's
    assert clear(http, {"scope": "all"})["remote"] == {"entries": 6, "bytes": 0, "failed": 0}
    assert keys(url, f"{prefix}:*") == []


def test_a_user_limited_to_one_tenant_reaches_its_keys_and_is_refused_the_others(
        redis_standalone, kvtier_server, make_acl_user):  # noqa: F811
    prefix = f"t{uuid.uuid4().hex[:10]}"
    user_a = make_acl_user(redis_standalone, f"tenant-a-{prefix}", keys=(f"{prefix}:t:team-a:*",))
    tenants = "aaa,team-b"  # prefixes team-a's user may not write ordered before its own: aaa, team-a, team-b
    admin = client(node(kvtier_server, redis_standalone, prefix, "1", tenants).url)  # the default user: every key
    node_a1 = node(kvtier_server, user_a, prefix, "2", tenants)
    a1, a2 = client(node_a1.url), client(node(kvtier_server, user_a, prefix, "3", tenants).url)
    # Its start-up probe (a 1 MiB SET and GET) went under the first prefix the user may write.
    assert "1 MiB SET" in node_a1.log_text() and "did not answer" not in node_a1.log_text()
    b_tokens, d_tokens, a_tokens = prompt(10, TOKENS), prompt(11, TOKENS), prompt(12, TOKENS)
    store(admin, NS_B, b_tokens)
    store(admin, NS_DEFAULT, d_tokens)

    # Tenant A's node stores A's chunks through its user, and another node of that user loads them bit-exact.
    store(a1, NS_A, a_tokens)
    assert a1.stats()["remote_written"] == 2 and a1.stats()["remote_errors"] == 0
    a_headers = keys(redis_standalone, f"{prefix}:t:team-a:{NS_A.fingerprint().hex()}:*:h")
    assert len(a_headers) == 2
    found = lookup(a2, NS_A, a_tokens)
    assert found.blocks == TOKENS // 16 and set(found.tiers) == {"remote"}
    assert read_checked(a2, NS_A, found.hits) == TOKENS // 16

    # B's chunks (and the default tenant's) are in the store, but Redis refuses them to A's user: a lookup
    # through A's node is a miss with the refusal counted, a store is dropped with it counted.
    b_keys = sorted(keys(redis_standalone, f"{prefix}:t:team-b:*"))
    d_keys = sorted(keys(redis_standalone, f"{prefix}:{NS_DEFAULT.fingerprint().hex()}:*"))
    assert b_keys and d_keys
    for ns, tokens in ((NS_B, b_tokens), (NS_DEFAULT, d_tokens)):
        errors = a1.stats()["remote_errors"]
        missed = lookup(a1, ns, tokens)
        assert missed.blocks == 0 and not missed.pending, ns.cache_salt
        assert a1.stats()["remote_errors"] > errors
    errors = a1.stats()["remote_errors"]
    store(a1, NS_B, prompt(13, TOKENS))
    store(a1, NS_DEFAULT, prompt(14, TOKENS))
    stats = a1.stats()
    assert stats["remote_written"] == 2 and stats["remote_errors"] >= errors + 4  # 2 chunks each, refused
    assert sorted(keys(redis_standalone, f"{prefix}:t:team-b:*")) == b_keys
    assert sorted(keys(redis_standalone, f"{prefix}:{NS_DEFAULT.fingerprint().hex()}:*")) == d_keys

    # A raw client as A's user: A's keys answer, B's and the default tenant's are refused by Redis.
    b_header = next(k for k in b_keys if k.endswith(":h"))
    assert cli(user_a, "EXISTS", a_headers[0]) == "1"
    assert "NOPERM" not in (header := cli(user_a, "GET", a_headers[0])) and header
    assert "NOPERM" in cli(user_a, "GET", b_header)
    assert "NOPERM" in cli(user_a, "GET", d_keys[0])
    assert "NOPERM" in cli(user_a, "SET", f"{prefix}:t:team-b:planted", "x")
    assert "NOPERM" in cli(user_a, "SET", f"{prefix}:{NS_DEFAULT.fingerprint().hex()}:planted", "x")
    assert keys(redis_standalone, f"{prefix}:*planted") == []
    # Not separated (docs/remote.md, "Tenants"): SCAN takes no key, so the user lists B's key names.
    assert b_header in keys(user_a, f"{prefix}:t:team-b:*")
