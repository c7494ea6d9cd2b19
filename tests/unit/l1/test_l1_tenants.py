"""Tenant quotas and request hints in L1 (l1/tenants.py, l1/retention.py, l1/reconfig.py): who a store may
evict, what it is refused and why, what hints keep, and the quota table's parser (server/tenants.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvtier.server import protocol as p
from kvtier.server.eviction import POLICIES, make_policy
from kvtier.server.keys import digest
from kvtier.server.l1.holdings import ClientState
from kvtier.server.l1.holds import Holds
from kvtier.server.l1.pool import PagePool
from kvtier.server.l1.reconfig import set_policy, set_quotas
from kvtier.server.l1.retention import DEFAULT_BOUNDS, HintBounds
from kvtier.server.l1.store import L1Store
from kvtier.server.metrics import Metrics
from kvtier.server.tenants import DEFAULT_TENANT, WALK_BOUND, QuotaTable, tenant_of
from l1_helpers import MIN_BLOCK_BYTES, NS, PAGE, FakeClock, hello

pytestmark = pytest.mark.unit

PAGES = 20


class L1:
    """An L1 of PAGES one-page chunks with namespaces for tenants A and B (by request salt) and one client."""

    def __init__(self, policy: str = "lru", table: str = "", bounds: HintBounds = DEFAULT_BOUNDS, pages: int = PAGES
                 ) -> None:
        self.clock = FakeClock()
        metrics = Metrics()
        self.store = L1Store(PagePool(pages, PAGE), make_policy(policy), metrics, min_block_bytes=MIN_BLOCK_BYTES)
        self.holds = Holds(self.store, metrics, clock=self.clock, hints=bounds)
        self.fp = {t: self.holds.register(replace(NS, cache_salt=f"engine|{t}")) for t in "AB"}
        self.client: ClientState = hello(self.holds, b"c")
        self.n = 0
        if table:
            set_quotas(self.store, QuotaTable.parse(table))

    def store_one(self, tenant: str, hint: p.Hint = p.NO_HINT) -> tuple[bytes, list]:
        self.n += 1
        key = digest(b"%s/%d" % (tenant.encode(), self.n))
        [got] = self.holds.reserve(self.client, self.fp[tenant], [p.StoreItem(key, PAGE, 1, ())], hint=hint)
        if got[0] == p.RESERVED:
            self.holds.commit(self.client, [got[1]])
        return key, got

    def held(self, keys: list[bytes]) -> int:
        return sum(k in self.store.entries for k in keys)

    def tenant_pages(self, tenant: str) -> int:
        return self.store.tenants.usage[tenant].pages


def test_quota_table_parse_and_limits() -> None:
    table = QuotaTable.parse("A=30%, B=2KiB:50%,*=0:10%")
    assert table.names == ("A", "B", "*")
    limits = table.limits(10 * 1024)
    assert (limits["A"].guaranteed, limits["A"].maximum) == (3072, 10240)
    assert (limits["B"].guaranteed, limits["B"].maximum) == (2048, 5120)
    assert limits["*"].maximum == 1024
    assert QuotaTable.parse(table.text()) == table
    for bad in ("A", "A=", "A=x", "A=30%,A=1%", "A=60%,B=50%", "A=120%", "A=50%:10%", "A B=1%"):
        with pytest.raises(ValueError):
            QuotaTable.parse(bad)
    with pytest.raises(ValueError, match="more than the tier"):
        QuotaTable.parse("A=2MiB").limits(1 << 20)


def test_tenant_of_a_salt() -> None:
    names = {"A", "B"}
    assert tenant_of("A", names) == "A"
    assert tenant_of("engine|B", names) == "B"  # the request's part
    assert tenant_of("A|other", names) == "A"  # the engine's part
    assert tenant_of("A|B", names) == "B"  # the request's part first
    assert tenant_of("x|y", names) == DEFAULT_TENANT
    assert tenant_of("", names) == DEFAULT_TENANT


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_guarantee_holds_against_another_tenants_flood(policy: str) -> None:
    for table, kept in (("A=0%,B=50%", True), ("", False)):
        l1 = L1(policy, table)
        b_keys = [l1.store_one("B")[0] for _ in range(PAGES // 2)]
        for _ in range(4 * PAGES):
            l1.store_one("A")
        if kept:
            assert l1.held(b_keys) == PAGES // 2, policy
            assert l1.store.tenants.usage["B"].evictions.get("capacity", 0) == 0
        else:
            assert l1.held(b_keys) < PAGES // 2, policy


def test_a_maximum_makes_room_from_its_own_chunks_first() -> None:
    l1 = L1("lru", "A=0:25%")
    b_keys = [l1.store_one("B")[0] for _ in range(5)]  # B's are the oldest: LRU's first victims otherwise
    for _ in range(30):
        l1.store_one("A")
        assert l1.tenant_pages("A") <= PAGES // 4
    assert l1.held(b_keys) == 5
    assert l1.store.tenants.usage["A"].evictions["quota"] > 0


def test_refusals_name_their_reason() -> None:
    l1 = L1("lru", "B=100%")
    for _ in range(PAGES):
        assert l1.store_one("B")[1][0] == p.RESERVED
    got = l1.store_one("A")[1]
    assert got == [p.REFUSED, p.TENANT_GUARANTEE]
    assert l1.store.tenants.usage["*"].refused == {p.TENANT_GUARANTEE: 1}
    assert l1.store_one("B")[1][0] == p.RESERVED  # B itself evicts its own

    l1 = L1("lru", "A=0:0")
    assert l1.store_one("A")[1] == [p.REFUSED, p.TENANT_MAX]


def test_reconfigured_table_acts_at_once() -> None:
    l1 = L1("lru")
    for _ in range(12):
        l1.store_one("A")
    result = set_quotas(l1.store, QuotaTable.parse("A=0:25%"))
    assert result["evicted_entries"] == 12 - PAGES // 4
    assert l1.tenant_pages("A") == PAGES // 4
    assert l1.store.tenants.usage["A"].evictions["quota"] == 12 - PAGES // 4
    set_quotas(l1.store, None)
    assert l1.store.tenants.usage[DEFAULT_TENANT].pages == PAGES // 4  # every chunk back in `*`
    with pytest.raises(ValueError):
        set_quotas(l1.store, QuotaTable.parse("A=1MiB"))


def test_retain_s_keeps_chunks_until_it_is_over() -> None:
    l1 = L1("lru", bounds=HintBounds(max_retain_s=100))
    kept = [l1.store_one("A", p.Hint(retain_s=10_000))[0] for _ in range(3)]
    plain = [l1.store_one("A")[0] for _ in range(3)]
    for _ in range(2 * PAGES):
        l1.store_one("B")
    assert l1.held(kept) == 3 and l1.held(plain) == 0
    assert l1.store.kept_pages == 3
    l1.clock.now += 101  # capped at max_retain_s
    l1.holds.sweep()
    assert l1.store.kept_pages == 0
    for _ in range(2 * PAGES):
        l1.store_one("B")
    assert l1.held(kept) == 0


def test_a_session_keeps_its_chunks_until_it_ends() -> None:
    l1 = L1("lru", bounds=HintBounds(session_idle_s=50))
    turn = p.Hint(session="s1")
    history = [l1.store_one("A", turn)[0] for _ in range(4)]
    for _ in range(2 * PAGES):
        l1.store_one("B")
    assert l1.held(history) == 4
    assert l1.holds.retention.end("s1")
    assert not l1.holds.retention.end("s1")
    late = l1.store_one("A", turn)[0]  # a late store of an ended session is not kept
    assert not l1.store.entries[late].kept
    for _ in range(2 * PAGES):
        l1.store_one("B")
    assert l1.held(history) == 0
    idle = [l1.store_one("A", p.Hint(session="s2"))[0] for _ in range(2)]
    l1.clock.now += 51
    l1.holds.sweep()  # idle past session_idle_s: ended by the sweep
    assert not any(l1.store.entries[k].kept for k in idle)


def test_an_existing_chunk_offered_with_a_session_is_kept() -> None:
    l1 = L1("lru")
    l1.n = 0
    key, _ = l1.store_one("A")
    l1.n = 0
    again, got = l1.store_one("A", p.Hint(session="s"))
    assert again == key and got == [p.EXISTS]
    assert l1.store.entries[key].kept


def test_when_only_kept_chunks_could_make_room_the_store_is_refused_retained() -> None:
    l1 = L1("lru")
    for _ in range(PAGES):
        assert l1.store_one("A", p.Hint(session="s"))[1][0] == p.RESERVED
    assert l1.store_one("B")[1] == [p.REFUSED, p.RETAINED]
    assert l1.store.tenants.usage["*"].refused == {p.RETAINED: 1}
    l1.holds.retention.end("s")
    assert l1.store_one("B")[1][0] == p.RESERVED


def test_sessions_are_bounded() -> None:
    l1 = L1("lru", bounds=HintBounds(max_sessions=1))
    a = l1.store_one("A", p.Hint(session="one"))[0]
    b = l1.store_one("A", p.Hint(session="two"))[0]
    assert l1.store.entries[a].kept and not l1.store.entries[b].kept
    assert l1.holds.retention.refused_sessions == 1


def test_priority_orders_eviction() -> None:
    l1 = L1("lru")
    oldest = [l1.store_one("B")[0] for _ in range(5)]
    high = [l1.store_one("A", p.Hint(priority=2))[0] for _ in range(5)]
    normal = [l1.store_one("A")[0] for _ in range(5)]
    low = [l1.store_one("A", p.Hint(priority=0))[0] for _ in range(5)]
    for _ in range(5):
        l1.store_one("B")
    assert l1.held(low) == 0 and l1.held(oldest) == 5 and l1.held(normal) == 5
    for _ in range(10):
        l1.store_one("B")
    assert l1.held(oldest) == 0 and l1.held(normal) == 0 and l1.held(high) == 5


def test_the_walk_is_bounded_and_the_fallback_finds_a_victim() -> None:
    """B's guaranteed chunks at the front of LRU's order: A's store passes at most WALK_BOUND of them, then takes
    A's own oldest chunk from the per-tenant order."""
    l1 = L1("lru", "B=60%", pages=40)
    b_keys = [l1.store_one("B")[0] for _ in range(24)]
    a_keys = [l1.store_one("A")[0] for _ in range(16)]
    assert len(b_keys) > WALK_BOUND
    fallbacks = []
    fallback = l1.store.tenants.fallback

    def counting(allowed):  # type: ignore[no-untyped-def]
        fallbacks.append(allowed)
        return fallback(allowed)

    l1.store.tenants.fallback = counting  # type: ignore[method-assign]
    newest = l1.store_one("A")[0]
    assert len(fallbacks) == 1 and newest in l1.store.entries
    assert l1.held(b_keys) == 24 and a_keys[0] not in l1.store.entries and l1.held(a_keys) == 15


def test_a_policy_swap_leaves_kept_chunks_out_of_the_order() -> None:
    l1 = L1("lru")
    kept = l1.store_one("A", p.Hint(session="s"))[0]
    set_policy(l1.store, make_policy("s3fifo"))
    assert kept not in l1.store.policy
    l1.holds.retention.end("s")
    assert kept in l1.store.policy


def test_a_maximum_counts_the_pages_of_one_reserves_earlier_items() -> None:
    l1 = L1("lru", "A=0:25%")
    items = [p.StoreItem(digest(b"one-request/%d" % i), PAGE, 1, ()) for i in range(PAGES // 4 + 3)]
    got = l1.holds.reserve(l1.client, l1.fp["A"], items)
    assert [g[0] for g in got] == [p.RESERVED] * (PAGES // 4) + [p.REFUSED] * 3
    assert got[PAGES // 4] == [p.REFUSED, p.TENANT_MAX]
    l1.holds.commit(l1.client, [g[1] for g in got if g[0] == p.RESERVED])
    assert l1.tenant_pages("A") == PAGES // 4
    assert l1.store_one("A")[1][0] == p.RESERVED  # the writes ended: it makes room from its own again
