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
`tenant_guarantee`); otherwise the policy's order stands.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from kvtier.server.keys import Namespace
from kvtier.server.protocol import TENANT_GUARANTEE, TENANT_MAX
from kvtier.server.tenants import DEFAULT_TENANT, Limits, QuotaTable, tenant_of
from kvtier.server.tiers.record import ChunkMeta
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

QUOTA = "quota"  # eviction reason: the tenant's own chunk, removed to keep it within its maximum
EVICTIONS = ("capacity", QUOTA, "clear")  # reasons every tenant's series carry from the start (0 until the first)
REFUSALS = (TENANT_MAX, TENANT_GUARANTEE)
Evict = Callable[[str, Callable[[bytes], bool]], bool]  # (reason, allowed) -> whether a victim was evicted


@dataclass
class TenantUsage:
    """One tenant's share of the tier: bytes (in-flight writes included), files, removals and refusals."""

    used_bytes: int = 0
    entries: int = 0
    evictions: Counter[str] = field(default_factory=Counter)  # reason -> chunks removed
    refused: Counter[str] = field(default_factory=Counter)  # reason -> puts refused


class FsTenants:
    """Per-tenant accounting of one tier of `capacity` bytes under a quota table (None: every chunk in `*`,
    no limits). Not thread-safe: the tier calls it under its lock."""

    def __init__(self, capacity: int, table: QuotaTable | None = None,
                 lookup: Callable[[bytes], Namespace | None] | None = None) -> None:
        self.capacity = capacity
        self.lookup: Callable[[bytes], Namespace | None] = lookup or (lambda _fp: None)
        self._ns: dict[bytes, list[int]] = {}  # fingerprint -> [entries, bytes] held (reserved bytes included)
        self._charged: dict[bytes, str] = {}  # fingerprint -> the tenant its usage counts to now
        self._salts: dict[bytes, str] = {}  # fingerprint -> cache salt, once its namespace was registered
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
        for fp, (entries, nbytes) in self._ns.items():
            usage = self.usage[self._charge_to(fp)]
            usage.entries += entries
            usage.used_bytes += nbytes

    # -- accounting ------------------------------------------------------------------------------

    def tenant(self, fp: bytes) -> str:
        """The tenant chunks of namespace `fp` count to now."""
        return self._charged.get(fp) or self._resolve(fp)

    def _resolve(self, fp: bytes, remember: bool = False) -> str:
        """The tenant of namespace `fp` by its salt (`*` while it is not registered); `remember` keeps the
        salt (only for namespaces the tier holds chunks of: `charge` forgets it with the last one)."""
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

    def charge(self, fp: bytes, entries: int, nbytes: int) -> None:
        """Add `entries` files and `nbytes` bytes (negative: remove) to namespace `fp`'s tenant. A put
        reserves its bytes first (0, need) and adds the file once indexed (1, 0)."""
        held = self._ns.setdefault(fp, [0, 0])
        tenant = self._charged.get(fp) or self._charge_to(fp)
        held[0] += entries
        held[1] += nbytes
        usage = self.usage[tenant]
        usage.entries += entries
        usage.used_bytes += nbytes
        if held == [0, 0]:  # nothing of it held: forget it, so the maps stay bounded by what the tier holds
            del self._ns[fp]
            self._charged.pop(fp, None)
            self._salts.pop(fp, None)

    def refresh(self) -> None:
        """Move namespaces counted to `*` because they were not registered to their tenant, if they are now."""
        if not self.active:
            return
        for fp in [fp for fp, t in self._charged.items() if t == DEFAULT_TENANT and fp not in self._salts]:
            tenant = self._resolve(fp, remember=True)
            if tenant != DEFAULT_TENANT:
                entries, nbytes = self._ns[fp]
                old, new = self.usage[DEFAULT_TENANT], self.usage[tenant]
                old.entries -= entries
                old.used_bytes -= nbytes
                new.entries += entries
                new.used_bytes += nbytes
                self._charged[fp] = tenant

    def evicted(self, meta: ChunkMeta, reason: str) -> None:
        """Count a removal of `meta`'s chunk (before `charge` takes it out)."""
        self.usage[self.tenant(meta.ns)].evictions[reason] += 1

    def refuse(self, tenant: str, reason: str) -> None:
        self.usage[tenant].refused[reason] += 1

    # -- the rules -------------------------------------------------------------------------------

    def over_maximum(self, tenant: str, need: int) -> bool:
        """Whether `need` more bytes would take `tenant` over its maximum."""
        return self.usage[tenant].used_bytes + need > self.limits[tenant].maximum

    def may_displace(self, writer: str, victim: ChunkMeta) -> bool:
        """Whether a put of tenant `writer` may evict `victim`: its own chunk always, another tenant's only
        if that tenant stays at or over its guarantee."""
        owner = self.tenant(victim.ns)
        if owner == writer:
            return True
        return self.usage[owner].used_bytes - victim.file_bytes >= self.limits[owner].guaranteed

    def make_room(self, meta: ChunkMeta, need: int, index: Mapping[bytes, ChunkMeta], evict: Evict,
                  full: Callable[[], bool]) -> str | None:
        """Evict (`evict(reason, allowed)`: the policy's next victim among the keys `allowed`, False if none)
        for a put of `meta`, `need` bytes, until the tier is no longer `full`: None when the put may go ahead,
        else the refusal reason (counted by the caller)."""
        self.refresh()
        writer = self.tenant(meta.ns)
        if need > self.limits[writer].maximum:
            return TENANT_MAX
        own = self._owned_by(writer, index)
        while self.limits[writer].maximum < self.capacity and self.over_maximum(writer, need):
            if not evict(QUOTA, own):  # a maximum of the whole tier is the capacity rule's
                return TENANT_MAX

        def allowed(key: bytes) -> bool:
            victim = index.get(key)
            return victim is not None and self.may_displace(writer, victim)

        while full():
            if not evict("capacity", allowed):
                return TENANT_GUARANTEE if index else None  # none indexed: only writes in flight
        return None

    def shed(self, index: Mapping[bytes, ChunkMeta], evict: Evict) -> int:
        """Evict (reason "quota") each tenant's own chunks, in the policy's order, while it is over its
        maximum: the chunks removed."""
        removed = 0
        for tenant in [name for name, u in self.usage.items() if u.used_bytes > self.limits[name].maximum]:
            own = self._owned_by(tenant, index)
            while self.over_maximum(tenant, 0) and evict(QUOTA, own):
                removed += 1
        return removed

    def _owned_by(self, tenant: str, index: Mapping[bytes, ChunkMeta]) -> Callable[[bytes], bool]:
        def own(key: bytes) -> bool:
            victim = index.get(key)
            return victim is not None and self.tenant(victim.ns) == tenant
        return own

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
