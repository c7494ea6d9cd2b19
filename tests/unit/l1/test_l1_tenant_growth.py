"""A tenant within its guarantee grows into it: its stores take room from tenants above their guarantees before
its own chunks (l1/tenants.py `growing`), so a loop that fits its share is not evicted by its own misses."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtier.server import protocol as p
from kvtier.server.eviction import POLICIES, make_policy
from kvtier.server.keys import digest
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.reconfig import set_quotas
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.tenants import QuotaTable
from l1_helpers import MIN_BLOCK_BYTES, NS, PAGE, FakeClock, hello

pytestmark = pytest.mark.unit

PAGES = 20  # A is guaranteed 6 pages, B 14


class Tenants:
    def __init__(self, policy: str) -> None:
        metrics = Metrics()
        self.store = L1Store(PagePool(PAGES, PAGE), make_policy(policy), metrics, min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, metrics, clock=FakeClock())
        self.fp = {t: self.holds.register(replace(NS, cache_salt=t)) for t in "AB"}
        self.client = hello(self.holds, b"c")
        set_quotas(self.store, QuotaTable.parse("A=30%,B=70%"))
        self.n = 0

    def put(self, tenant: str) -> bytes:
        self.n += 1
        key = digest(b"%s/%d" % (tenant.encode(), self.n))
        [got] = self.holds.reserve(self.client, self.fp[tenant], [p.StoreItem(key, PAGE, 1, ())])
        assert got[0] == p.RESERVED, got
        self.holds.commit(self.client, [got[1]])
        return key

    def pages(self, tenant: str) -> int:
        return self.store.tenants.usage[tenant].pages


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_tenant_within_its_guarantee_evicts_the_others_before_its_own(policy: str) -> None:
    l1 = Tenants(policy)
    loop = [l1.put("B") for _ in range(8)]  # B's oldest chunks: first in any recency order
    scan = [l1.put("A") for _ in range(12)]
    assert l1.store.pool.free_pages == 0 and l1.pages("A") == 12
    loop += [l1.put("B") for _ in range(6)]  # B grows to its 14 guaranteed pages
    assert all(key in l1.store.entries for key in loop)
    assert l1.pages("A") == 6 and sum(key in l1.store.entries for key in scan) == 6
    assert l1.store.tenants.usage["B"].evictions.get("capacity", 0) == 0


def test_past_its_guarantee_a_tenant_evicts_as_the_policy_orders_again() -> None:
    l1 = Tenants("lru")
    loop = [l1.put("B") for _ in range(14)]
    [l1.put("A") for _ in range(6)]
    l1.put("B")  # 15 pages would be past B's 14: B's least recent chunk goes, A keeps its guarantee
    assert loop[0] not in l1.store.entries and all(key in l1.store.entries for key in loop[1:])
    assert l1.pages("A") == 6
