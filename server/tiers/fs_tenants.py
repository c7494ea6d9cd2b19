"""The filesystem tier's tenants: which tenant each chunk file counts to, each tenant's bytes, entries,
evictions and refusals, and the quota rules of the tier's room-making (fs.py calls them under its lock).

A chunk counts to the tenant of its namespace: `tenant_of(namespace.cache_salt, table.names)`. The tier knows
a namespace from its fingerprint (in every record header) once it is registered with the server (`lookup`, the
L1 store's registrations); the salt is remembered from then on while the tier holds chunks of it. A chunk
whose namespace is not registered (files from an earlier run, before their engine registers again) counts to
the default tenant `*` until it is: `refresh` moves it then (fs.py calls it before each room-making and status).
Usage is kept per fingerprint, so a new table or a newly known namespace moves whole namespaces between
tenants in O(namespaces).

The rules (docs/l2.md, "Tenants"): a tenant over its maximum makes room from its own chunks first (reason
"quota"; a put that cannot fit within the maximum is refused `tenant_max`); another tenant's chunk is never a
victim when evicting it would take that tenant under its guarantee (a put that cannot get room is refused
`tenant_guarantee`); a put that keeps its tenant within its guarantee skips the policy's admission and takes
the room from other tenants first, its own chunks only after (it grows into its share: a loop that fits it
is kept); otherwise the policy's order stands. As in L1 (server/l1/tenants.py), a victim search
passes at most WALK_BOUND chunks it may not evict in the policy's order; then the victim is the oldest file
(in the order files were indexed) of the tenant furthest over its guarantee, so a guaranteed tenant's cold
files at the front of the order never make each put walk them all while holding the tier's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvtier.server.eviction.base import EvictionPolicy
from kvtier.server.keys import Namespace
from kvtier.server.protocol import TENANT_GUARANTEE, TENANT_MAX
from kvtier.server.tenants import DEFAULT_TENANT, Bounded, Limits, QuotaTable, bounded_pick, tenant_of
from kvtier.server.tiers.record import ChunkMeta
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

QUOTA = "quota"  # eviction reason: the tenant's own chunk, removed to keep it within its maximum
EVICTIONS = ("capacity", QUOTA, "clear")  # reasons every tenant's series carry from the start (0 until the first)
REFUSALS = (TENANT_MAX, TENANT_GUARANTEE)
Allowed = Callable[[ChunkMeta], bool]
Evict = Callable[[str, Allowed], bool]  # (reason, which chunks may go) -> whether a victim was evicted


@dataclass
class TenantUsage:
    """One tenant's share of the tier: bytes (in-flight writes included), files, removals and refusals."""

    used_bytes: int = 0
    entries: int = 0
    evictions: Counter[str] = field(default_factory=Counter)  # reason -> chunks removed
    refused: Counter[str] = field(default_factory=Counter)  # reason -> puts refused


@dataclass
class _Held:
    """One namespace's chunks in the tier."""

    entries: int = 0
    nbytes: int = 0  # file bytes, those of its writes in flight included
    order: dict[bytes, tuple[int, ChunkMeta]] = field(default_factory=dict)  # key -> (seq, record), oldest first


class FsTenants:
    """Per-tenant accounting of one tier of `capacity` bytes under a quota table (None: every chunk in `*`,
    no limits), and its victims. Not thread-safe: the tier calls it under its lock."""

    def __init__(self, capacity: int, table: QuotaTable | None = None,
                 lookup: Callable[[bytes], Namespace | None] | None = None) -> None:
        self.capacity = capacity
        self.lookup: Callable[[bytes], Namespace | None] = lookup or (lambda _fp: None)
        self._ns: dict[bytes, _Held] = {}  # fingerprint -> what the tier holds of it
        self._charged: dict[bytes, str] = {}  # fingerprint -> the tenant its usage counts to now
        self._salts: dict[bytes, str] = {}  # fingerprint -> cache salt, once its namespace was registered
        self._seq = 0  # files indexed so far: the fallback order across namespaces
        self.table: QuotaTable | None = None
        self.limits: dict[str, Limits] = {}
        self.usage: dict[str, TenantUsage] = {}
        self.set_table(table)

    @property
    def active(self) -> bool:
        """Whether a table is set (without one, room-making is the policy's alone)."""
        return self.table is not None

    def set_table(self, table: QuotaTable | None) -> None:
        """Apply `table` (ValueError, nothing changed, if its guarantees exceed the tier) and count every
        namespace to its tenant under it. Tenants the new table drops keep no row."""
        limits = table.limits(self.capacity) if table is not None else {DEFAULT_TENANT: Limits(0, self.capacity)}
        self.table, self.limits = table, limits
        self.usage = {name: self.usage.get(name) or TenantUsage() for name in limits}
        for usage in self.usage.values():
            usage.used_bytes = usage.entries = 0
        self._charged.clear()
        for fp, held in self._ns.items():
            usage = self.usage[self._charge_to(fp)]
            usage.entries += held.entries
            usage.used_bytes += held.nbytes

    # -- which tenant ----------------------------------------------------------------------------

    def tenant(self, fp: bytes) -> str:
        """The tenant chunks of namespace `fp` count to now."""
        return self._charged.get(fp) or self._resolve(fp)

    def _resolve(self, fp: bytes, remember: bool = False) -> str:
        """The tenant of namespace `fp` by its salt (`*` while it is not registered); `remember` keeps the
        salt (only for namespaces the tier holds chunks of: it is forgotten with the last one)."""
        salt = self._salts.get(fp)
        if salt is None:
            namespace = self.lookup(fp)
            if namespace is None:
                return DEFAULT_TENANT
            salt = namespace.cache_salt
            if remember:
                self._salts[fp] = salt
        return tenant_of(salt, self.table.names if self.table is not None else ())

    def _charge_to(self, fp: bytes) -> str:
        tenant = self._charged[fp] = self._resolve(fp, remember=True)
        return tenant

    def refresh(self) -> None:
        """Move namespaces counted to `*` because they were not registered to their tenant, if they are now."""
        if not self.active:
            return
        for fp in [fp for fp, t in self._charged.items() if t == DEFAULT_TENANT and fp not in self._salts]:
            tenant = self._resolve(fp, remember=True)
            if tenant != DEFAULT_TENANT:
                held, old, new = self._ns[fp], self.usage[DEFAULT_TENANT], self.usage[tenant]
                old.entries -= held.entries
                old.used_bytes -= held.nbytes
                new.entries += held.entries
                new.used_bytes += held.nbytes
                self._charged[fp] = tenant

    # -- accounting ------------------------------------------------------------------------------

    def reserve(self, fp: bytes, nbytes: int) -> None:
        """Count the bytes of a write of namespace `fp` in flight (negative: it failed or was dropped)."""
        self._account(fp, 0, nbytes)

    def add(self, meta: ChunkMeta, reserved: bool = False) -> None:
        """Count an indexed file (its bytes already, if a put `reserved` them)."""
        held = self._account(meta.ns, 1, 0 if reserved else meta.file_bytes)
        self._seq += 1
        held.order[meta.key] = (self._seq, meta)

    def drop(self, meta: ChunkMeta, reason: str | None = None) -> None:
        """Count a file the tier forgot; `reason` counts it as its tenant's eviction."""
        if reason is not None:
            self.usage[self.tenant(meta.ns)].evictions[reason] += 1
        held = self._ns.get(meta.ns)
        if held is not None:
            held.order.pop(meta.key, None)
        self._account(meta.ns, -1, -meta.file_bytes)

    def _account(self, fp: bytes, entries: int, nbytes: int) -> _Held:
        held = self._ns.get(fp)
        if held is None:
            held = self._ns[fp] = _Held()
        usage = self.usage[self._charged.get(fp) or self._charge_to(fp)]
        held.entries += entries
        held.nbytes += nbytes
        usage.entries += entries
        usage.used_bytes += nbytes
        if not held.entries and not held.nbytes:  # nothing of it held: forget it (the maps stay bounded)
            del self._ns[fp]
            self._charged.pop(fp, None)
            self._salts.pop(fp, None)
        return held

    def refuse(self, tenant: str, reason: str) -> None:
        self.usage[tenant].refused[reason] += 1

    # -- the rules -------------------------------------------------------------------------------

    def over_maximum(self, tenant: str, need: int) -> bool:
        """Whether `need` more bytes would take `tenant` over its maximum."""
        return self.usage[tenant].used_bytes + need > self.limits[tenant].maximum

    def within_guarantee(self, fp: bytes, need: int) -> bool:
        """Whether a put of `need` bytes of namespace `fp` keeps its tenant within its guarantee (False without
        a table): such a put skips the policy's admission and takes the room from other tenants first."""
        if not self.active:
            return False
        self.refresh()
        tenant = self.tenant(fp)
        return self.usage[tenant].used_bytes + need <= self.limits[tenant].guaranteed

    def may_displace(self, writer: str, own: bool = True) -> Allowed:
        """Which chunks a put of tenant `writer` may evict: another tenant's only if that tenant stays at or
        over its guarantee, and (if `own`) its own."""
        def allowed(victim: ChunkMeta) -> bool:
            owner = self.tenant(victim.ns)
            if owner == writer:
                return own
            return self.usage[owner].used_bytes - victim.file_bytes >= self.limits[owner].guaranteed
        return allowed

    def own(self, tenant: str) -> Allowed:
        return lambda victim: self.tenant(victim.ns) == tenant

    def make_room(self, meta: ChunkMeta, need: int, evict: Evict, full: Callable[[], bool]) -> str | None:
        """Evict (`evict(reason, allowed)`) for a put of `meta`, `need` bytes, until the tier is no longer
        `full`: None when the put may go ahead, else the refusal reason (counted by the caller)."""
        self.refresh()
        writer = self.tenant(meta.ns)
        maximum = self.limits[writer].maximum
        if need > maximum:
            return TENANT_MAX
        if maximum < self.capacity:  # a maximum of the whole tier is the capacity rule's
            own = self.own(writer)
            while self.over_maximum(writer, need):
                if not evict(QUOTA, own):
                    return TENANT_MAX
        if self.within_guarantee(meta.ns, need):  # it grows into its share: the others' room first
            others = self.may_displace(writer, own=False)
            while full() and evict("capacity", others):
                pass
        allowed = self.may_displace(writer)
        while full():
            if not evict("capacity", allowed):  # none indexed: only writes in flight hold the room
                return TENANT_GUARANTEE if any(h.entries for h in self._ns.values()) else None
        return None

    def shed(self, evict: Evict) -> int:
        """Evict (reason "quota") each tenant's own chunks, in the policy's order, while it is over its
        maximum: the chunks removed."""
        removed = 0
        for tenant in [name for name, u in self.usage.items() if u.used_bytes > self.limits[name].maximum]:
            own = self.own(tenant)
            while self.over_maximum(tenant, 0) and evict(QUOTA, own):
                removed += 1
        return removed

    # -- victims ---------------------------------------------------------------------------------

    def victim(self, policy: EvictionPolicy, index: Mapping[bytes, ChunkMeta], allowed: Allowed) -> bytes | None:
        """The policy's next victim among the chunks `allowed` names; when its walk passes more than
        WALK_BOUND others (a guaranteed tenant's cold chunks at the front of the order), the fallback's."""
        try:
            return bounded_pick(policy, index.get, allowed)
        except Bounded:
            return self._fallback(allowed)

    def _fallback(self, allowed: Allowed) -> bytes | None:
        """The oldest indexed chunk (in the order files were indexed) of the tenant furthest over its
        guarantee whose oldest chunk is allowed."""
        oldest: dict[str, tuple[int, ChunkMeta]] = {}
        for fp, held in self._ns.items():
            if held.order:
                first = next(iter(held.order.values()))
                tenant = self._charged[fp]
                if tenant not in oldest or first[0] < oldest[tenant][0]:
                    oldest[tenant] = first
        for tenant in sorted(oldest, key=lambda t: self.usage[t].used_bytes - self.limits[t].guaranteed,
                             reverse=True):
            if allowed(oldest[tenant][1]):
                return oldest[tenant][1].key
        return None

    def rows(self) -> list[dict]:
        """Per tenant, for /status (the tier's `l2_tenants`)."""
        return [{"tenant": name, "used_bytes": u.used_bytes, "entries": u.entries,
                 "guaranteed_bytes": self.limits[name].guaranteed, "max_bytes": self.limits[name].maximum,
                 "evictions": dict(u.evictions), "refused": dict(u.refused)} for name, u in self.usage.items()]


class TenantCollector:
    """The tier's per-tenant metrics, read at scrape time from `rows` (FsTenants.rows, under the tier's lock):
    kvtier_<tier>_tenant_used_bytes{tenant}, _evictions_total{tenant,reason}, _refused_total{tenant,reason}.
    Labels stay bounded: only the table's tenants and `*`, and the tier's own reasons (the usual ones from
    the start, at 0, so that a dashboard can divide by them)."""

    def __init__(self, tier: str, rows: Callable[[], list[dict]]) -> None:
        self.prefix = f"kvtier_{tier}_tenant"
        self.rows = rows

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        rows = self.rows()
        used = GaugeMetricFamily(f"{self.prefix}_used_bytes", "Bytes a tenant holds in the tier", labels=["tenant"])
        entries = GaugeMetricFamily(f"{self.prefix}_entries", "Chunks a tenant holds in the tier", labels=["tenant"])
        evictions = CounterMetricFamily(f"{self.prefix}_evictions", "A tenant's chunks removed from the tier, by "
                                        "reason", labels=["tenant", "reason"])
        refused = CounterMetricFamily(f"{self.prefix}_refused", "A tenant's writes the tier refused, by reason",
                                      labels=["tenant", "reason"])
        for row in rows:
            used.add_metric([row["tenant"]], row["used_bytes"])
            entries.add_metric([row["tenant"]], row["entries"])
            for family, known, counts in ((evictions, EVICTIONS, row["evictions"]), (refused, REFUSALS, row["refused"])):
                for reason, n in sorted({**dict.fromkeys(known, 0), **counts}.items()):
                    family.add_metric([row["tenant"], reason], n)
        yield from (used, entries, evictions, refused)

    def describe(self) -> list:
        return []  # no fixed series: registering does not call `collect` (the tier is not scanned yet)
