"""Tenant quotas in the filesystem tier (tiers/fs_tenants.py and its hooks in tiers/fs.py): which tenant a chunk
counts to, the room-making rules (own chunks first over the maximum, guarantees never displaced), refusals,
`set_quotas` acting at once, the start-up scan, and the per-tenant metrics (real files in a temp directory)."""

from __future__ import annotations

import numpy as np
import pytest
from kvtier.server.config import ServerConfig
from kvtier.server.eviction import LRUPolicy
from kvtier.server.keys import Namespace, digest
from kvtier.server.metrics import Metrics
from kvtier.server.tenants import WALK_BOUND, QuotaTable
from kvtier.server.tiers.fs import FsOptions, FsTier, make_tier
from kvtier.server.tiers.record import ChunkMeta
from prometheus_client import generate_latest

pytestmark = pytest.mark.unit

SIZE = 3000  # payload bytes: one 4 KiB header block and one 4 KiB payload block a file
FILE = 8192


def namespace(salt: str) -> Namespace:
    return Namespace("m", "float16", 2, 2, 64, 16, "nhd", cache_salt=salt)


A, B, C = (namespace(s).fingerprint() for s in ("eng|A", "B", "C"))  # A by its request part


def meta(ns: bytes, i: int) -> ChunkMeta:
    return ChunkMeta(digest(ns + b"%d" % i), ns, 4, (), SIZE)


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def tier_of(tmp_path, files: int, table: str | None, registered=(A, B), evicted=None) -> FsTier:
    known = {fp: ns for fp, ns in ((namespace(s).fingerprint(), namespace(s)) for s in ("eng|A", "B", "C"))
             if fp in registered}
    tier = FsTier(str(tmp_path), files * FILE, on_evict=(evicted.append if evicted is not None else None),
                  tenant_quotas=QuotaTable.parse(table) if table is not None else None)
    tier.know_namespaces(known.get)
    return tier


def fill(tier: FsTier, ns: bytes, start: int, n: int) -> list[bool]:
    return [tier.put(meta(ns, i), payload(i)) for i in range(start, start + n)]


def rows(tier: FsTier) -> dict[str, dict]:
    return {row["tenant"]: row for row in tier.tenant_rows()}


def held(tier: FsTier, ns: bytes, start: int, n: int) -> list[bool]:
    return [tier.contains(meta(ns, i).key) for i in range(start, start + n)]


def test_a_tenant_over_its_maximum_makes_room_from_its_own_chunks(tmp_path):
    evicted: list[str] = []
    tier = tier_of(tmp_path, 8, "A=0:50%,B=0", evicted=evicted)
    assert all(fill(tier, B, 0, 2)) and all(fill(tier, A, 0, 4))  # B's chunks are the oldest
    assert all(fill(tier, A, 4, 2))  # the tier has room, A has not: A's own oldest go
    assert held(tier, B, 0, 2) == [True, True]
    assert held(tier, A, 0, 6) == [False, False, True, True, True, True]
    r = rows(tier)
    assert r["A"]["used_bytes"] == 4 * FILE and r["A"]["entries"] == 4 and r["A"]["max_bytes"] == 4 * FILE
    assert r["A"]["evictions"] == {"quota": 2} and r["B"]["evictions"] == {}
    assert evicted == ["quota", "quota"]
    assert tier.used_bytes == 6 * FILE


def test_a_chunk_larger_than_its_tenants_maximum_is_refused(tmp_path):
    tier = tier_of(tmp_path, 8, f"A=0:{FILE - 1}")
    assert all(fill(tier, B, 0, 2))
    assert fill(tier, A, 0, 1) == [False]
    assert rows(tier)["A"]["refused"] == {"tenant_max": 1} and tier.entries == 2


def test_guarantee_survives_another_tenants_flood_and_goes_without_a_table(tmp_path):
    for table, kept in (("B=50%", [True] * 3), (None, [False] * 3)):
        directory = tmp_path / str(table)
        tier = tier_of(directory, 6, table)
        assert all(fill(tier, B, 0, 3))
        assert all(fill(tier, A, 0, 12))  # twice the tier, A's chunks newer than B's
        assert held(tier, B, 0, 3) == kept
        assert tier.used_bytes <= 6 * FILE
    assert rows(tier)["*"]["entries"] == 6  # without a table every chunk counts to `*`


def test_a_tenant_over_its_guarantee_is_displaced_down_to_it_then_stores_are_refused(tmp_path):
    tier = tier_of(tmp_path, 4, "B=50%")
    assert all(fill(tier, B, 0, 4))
    assert all(fill(tier, A, 0, 2))  # B at 4 files, guaranteed 2: its two oldest go
    assert held(tier, B, 0, 4) == [False, False, True, True]
    assert all(fill(tier, A, 2, 2))  # then A's own
    assert held(tier, A, 0, 4) == [False, False, True, True]
    r = rows(tier)
    assert r["B"]["evictions"] == {"capacity": 2} and r["*"]["evictions"] == {"capacity": 2}  # A: not named

    full = tier_of(tmp_path / "full", 4, "B=100%")
    assert all(fill(full, B, 0, 4))
    assert fill(full, A, 0, 1) == [False]  # nothing of A's to evict, B's all guaranteed
    assert rows(full)["*"]["refused"] == {"tenant_guarantee": 1} and held(full, B, 0, 4) == [True] * 4
    assert all(fill(full, B, 4, 1)) and held(full, B, 0, 5) == [False, True, True, True, True]  # B's own


class Refusing(LRUPolicy):
    """LRU whose admission refuses every chunk offered while the tier is full, while `refusing`."""

    refusing = True

    def admit(self, key: bytes, size: int, evictable) -> bool:
        return not self.refusing


def test_a_tenant_growing_into_its_guarantee_takes_the_room_from_others_first_and_skips_admission(tmp_path):
    policy = Refusing()
    tier = FsTier(str(tmp_path), 8 * FILE, tenant_quotas=QuotaTable.parse("B=50%"), policy=policy)
    tier.know_namespaces({B: namespace("B")}.get)
    assert all(fill(tier, B, 0, 2)) and all(fill(tier, A, 0, 6))  # B's the oldest; the tier is full
    assert fill(tier, A, 6, 1) == [False]  # A is not within a guarantee: the policy's admission refuses it
    assert all(fill(tier, B, 2, 2))  # within B's 4 files: A's oldest go, not B's own older ones
    assert held(tier, B, 0, 4) == [True] * 4 and held(tier, A, 0, 6) == [False, False] + [True] * 4
    assert fill(tier, B, 4, 1) == [False]  # past its guarantee B is an ordinary put: the policy refuses it
    policy.refusing = False
    assert all(fill(tier, B, 4, 1))  # and then it loses its own oldest, in the policy's order
    assert held(tier, B, 0, 5) == [False] + [True] * 4 and tier.entries == 8


def test_a_victim_search_passes_at_most_walk_bound_chunks_then_takes_the_oldest_allowed_file(tmp_path):
    n = WALK_BOUND + 4
    tier = tier_of(tmp_path, 2 * n, "B=50%")
    assert all(fill(tier, B, 0, n))  # at its guarantee, at the front of the LRU order
    assert all(fill(tier, A, 0, n))  # the tier is full
    looked: list[ChunkMeta] = []

    def allowed(victim: ChunkMeta) -> bool:
        looked.append(victim)
        return victim.ns == A

    index = {m.key: m for m in (*[meta(B, i) for i in range(n)], *[meta(A, i) for i in range(n)])}
    assert tier.tenants.victim(tier.policy, index, allowed) == meta(A, 0).key
    assert len(looked) <= WALK_BOUND + 2  # the bounded walk, then the fallback's one look
    assert tier.get(meta(A, 0), [memoryview(bytearray(SIZE))])  # a read: A's oldest is no longer LRU's first
    assert all(fill(tier, A, n, 2)) and all(held(tier, B, 0, n))
    # past the bound the victim is the oldest file indexed, read or not (the policy would have kept it)
    assert held(tier, A, 0, 3) == [False, False, True]
    assert tier.set_quotas(QuotaTable.parse("A=0:25%,B=50%"))["evicted_entries"] == n - n // 2
    assert all(held(tier, B, 0, n)) and rows(tier)["A"]["used_bytes"] <= n // 2 * FILE


def test_an_unregistered_namespace_counts_to_the_default_tenant_until_registered(tmp_path):
    known: dict[bytes, Namespace] = {}
    tier = FsTier(str(tmp_path), 8 * FILE, tenant_quotas=QuotaTable.parse("B=25%"))
    tier.know_namespaces(known.get)
    assert all(fill(tier, B, 0, 2))
    assert rows(tier)["*"]["entries"] == 2 and rows(tier)["B"]["entries"] == 0
    known[B] = namespace("B")
    assert rows(tier)["B"]["entries"] == 2 and rows(tier)["*"]["used_bytes"] == 0
    del known[B]  # the server forgot it (no client, nothing in L1): the tier still knows its salt
    assert all(fill(tier, B, 2, 1)) and rows(tier)["B"]["entries"] == 3

    scanned = FsTier(str(tmp_path), 8 * FILE, tenant_quotas=QuotaTable.parse("B=25%"))
    scanned.know_namespaces(known.get)
    assert scanned.scan() == 3 and rows(scanned)["*"]["entries"] == 3
    known[B] = namespace("B")
    assert all(fill(scanned, A, 0, 7))  # the put's room-making sees B registered: its guarantee holds
    assert sum(held(scanned, B, 0, 3)) == 2 and rows(scanned)["B"]["used_bytes"] == 2 * FILE


def test_set_quotas_acts_at_once_and_a_bad_table_changes_nothing(tmp_path):
    tier = tier_of(tmp_path, 8, None)
    assert all(fill(tier, A, 0, 4)) and all(fill(tier, B, 0, 2))
    out = tier.set_quotas(QuotaTable.parse("A=0:25%,B=10%"))
    assert out == {"table": "A=0:25%,B=10%", "evicted_entries": 2, "evicted_bytes": 2 * FILE}
    assert held(tier, A, 0, 4) == [False, False, True, True]  # the oldest of A's, in the policy's order
    r = rows(tier)
    assert r["A"]["evictions"] == {"quota": 2} and r["B"]["guaranteed_bytes"] == int(0.1 * 8 * FILE)
    with pytest.raises(ValueError, match="more than the tier"):
        tier.set_quotas(QuotaTable.parse(f"A={8 * FILE},B=1"))
    assert rows(tier)["A"]["max_bytes"] == 2 * FILE
    assert tier.set_quotas(None)["table"] == "" and set(rows(tier)) == {"*"}
    assert rows(tier)["*"]["entries"] == 4
    assert all(fill(tier, A, 4, 4)) and tier.entries == 8  # no maximum any more


def test_scan_sheds_a_tenant_over_its_maximum(tmp_path):
    assert all(fill(tier_of(tmp_path, 8, None), A, 0, 6))
    again = tier_of(tmp_path, 8, "A=0:50%")
    assert again.scan() == 4 and rows(again)["A"]["evictions"] == {"quota": 2}


def test_per_tenant_metrics_and_status_rows(tmp_path):
    metrics = Metrics()
    tier = make_tier(FsOptions(str(tmp_path), 2 * FILE, tenant_quotas=QuotaTable.parse("B=100%")), metrics)
    tier.know_namespaces({B: namespace("B")}.get)
    assert all(fill(tier, B, 0, 2)) and fill(tier, A, 0, 1) == [False]
    text = generate_latest(metrics.registry).decode()
    assert f'kvtier_l2_tenant_used_bytes{{tenant="B"}} {float(2 * FILE)}' in text
    assert 'kvtier_l2_tenant_used_bytes{tenant="*"} 0.0' in text
    assert 'kvtier_l2_tenant_refused_total{reason="tenant_guarantee",tenant="*"} 1.0' in text
    assert 'kvtier_l2_tenant_evictions_total{reason="quota",tenant="B"} 0.0' in text  # known reasons from 0
    assert 'kvtier_l2_tenant_refused_total{reason="tenant_max",tenant="*"} 0.0' in text
    assert tier.stats()["l2_tenant_quotas"] == "B=100%"
    stats = tier.stats()["l2_tenants"]
    assert [(r["tenant"], r["entries"], r["max_bytes"]) for r in stats] == [("B", 2, 2 * FILE), ("*", 0, 2 * FILE)]


def test_the_flag_reaches_the_tier_and_a_bad_table_is_a_start_up_error():
    config = ServerConfig(l2_path="/tmp/x", l2_size_gb=1.0, l2_tenant_quotas="B=30%,A=0:2GiB")
    config.validate()
    assert config.l2_options().tenant_quotas == QuotaTable.parse("B=30%,A=0:2GiB")
    assert ServerConfig(l2_path="/tmp/x").l2_options().tenant_quotas is None
    for bad, why in (("B=600MiB,A=600MiB", "more than the tier"), ("B", "NAME=GUARANTEED"), ("B=70%,A=40%", "100%")):
        with pytest.raises(ValueError, match=f"--l2-tenant-quotas: .*{why}"):
            ServerConfig(l2_path="/tmp/x", l2_size_gb=1.0, l2_tenant_quotas=bad).validate()
