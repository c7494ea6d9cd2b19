"""Tenants and their quota tables: which tenant a namespace belongs to, and how much of a tier each may hold.

A tenant is a cache salt the operator names in a quota table (docs/tenants.md). A namespace's salt is
`engine|request` (the connector's `kvtier.cache_salt` or `kvtier.tenant`, and the request's `cache_salt`), or one
of the two alone; the namespace belongs to the first named tenant among the whole salt, the request's part and
the engine's part, else to the default tenant `*`. Clients never create tenants: only the table names them, so
the per-tenant metric labels stay bounded (at most MAX_TENANTS names and `*`).

Table syntax: `NAME=GUARANTEED[:MAXIMUM],...`, each amount in bytes (`512MiB`, `2GB`, `1048576`) or a share of
the tier (`30%`); a missing maximum is the whole tier. Also the bounded walk both tiers choose victims with
(`bounded_pick`). Imports nothing of kvtier at run time: l1/ and tiers/ both use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvtier.server.eviction.base import EvictionPolicy

DEFAULT_TENANT = "*"
MAX_TENANTS = 64
WALK_BOUND = 16  # chunks a victim search may pass in the policy's order before it takes a fallback
T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|[kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "ki": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "mi": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "gi": 1 << 30, "t": 10**12,
          "tb": 10**12, "tib": 1 << 40, "ti": 1 << 40}


@dataclass(frozen=True, slots=True)
class Amount:
    """Bytes, or a share of the tier's capacity when `share`."""

    value: float
    share: bool

    def bytes_of(self, capacity: int) -> int:
        return int(self.value * capacity / 100) if self.share else int(self.value)

    def text(self) -> str:
        return f"{self.value:g}%" if self.share else str(int(self.value))


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's quota in bytes of one tier."""

    guaranteed: int
    maximum: int


@dataclass(frozen=True, slots=True)
class Quota:
    guaranteed: Amount
    maximum: Amount | None = None  # None: the whole tier

    def limits(self, capacity: int) -> Limits:
        top = capacity if self.maximum is None else min(capacity, self.maximum.bytes_of(capacity))
        low = self.guaranteed.bytes_of(capacity)
        return Limits(low if low > capacity else min(low, top), top)  # a guarantee beyond the tier is refused


@dataclass(frozen=True)
class QuotaTable:
    """Tenant name -> quota, in the order written."""

    quotas: tuple[tuple[str, Quota], ...] = ()

    @classmethod
    def parse(cls, text: str) -> QuotaTable:
        """The table `text` names, or ValueError saying what is wrong with it."""
        quotas: dict[str, Quota] = {}
        for part in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or not (name == DEFAULT_TENANT or _NAME.match(name)):
                raise ValueError(f"tenant quota {part!r}: expected NAME=GUARANTEED[:MAXIMUM] with a name of "
                                 "letters, digits and _.:@/+-")
            if name in quotas:
                raise ValueError(f"tenant {name!r} is named twice")
            low, _, high = value.partition(":")
            quota = Quota(_amount(low, name), _amount(high, name) if high.strip() else None)
            if quota.maximum is not None and quota.guaranteed.share == quota.maximum.share \
                    and quota.guaranteed.value > quota.maximum.value:
                raise ValueError(f"tenant {name!r}: the guaranteed amount exceeds the maximum")
            quotas[name] = quota
        if len([n for n in quotas if n != DEFAULT_TENANT]) > MAX_TENANTS:
            raise ValueError(f"at most {MAX_TENANTS} tenants besides {DEFAULT_TENANT!r}")
        shares = sum(q.guaranteed.value for q in quotas.values() if q.guaranteed.share)
        if shares > 100:
            raise ValueError(f"the guaranteed shares add up to {shares:g}% (at most 100%)")
        return cls(tuple(quotas.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.quotas)

    def text(self) -> str:
        return ",".join(f"{name}={q.guaranteed.text()}" + (f":{q.maximum.text()}" if q.maximum else "")
                        for name, q in self.quotas)

    def limits(self, capacity: int) -> dict[str, Limits]:
        """Every named tenant's limits in a tier of `capacity` bytes (the default tenant's too: unlimited when
        the table does not name it). ValueError when the guarantees together exceed the tier."""
        out = {name: quota.limits(capacity) for name, quota in self.quotas}
        total = sum(limit.guaranteed for limit in out.values())
        if total > capacity:
            raise ValueError(f"the guaranteed amounts add up to {total} bytes, more than the tier's {capacity}")
        out.setdefault(DEFAULT_TENANT, Limits(0, capacity))
        return out


def _amount(text: str, name: str) -> Amount:
    match = _AMOUNT.match(text)
    if match is None:
        raise ValueError(f"tenant {name!r}: {text.strip()!r} is not an amount (bytes such as 512MiB, or a share "
                         "such as 30%)")
    value, unit = float(match.group(1)), (match.group(2) or "")
    if unit == "%":
        if value > 100:
            raise ValueError(f"tenant {name!r}: {value:g}% is more than the whole tier")
        return Amount(value, True)
    return Amount(value * _UNITS[unit.lower()], False)


def tenant_of(cache_salt: str, names: Collection[str]) -> str:
    """The tenant a namespace of this salt belongs to among the table's `names`."""
    if cache_salt in names:
        return cache_salt
    engine, sep, request = cache_salt.rpartition("|")
    if sep:
        for part in (request, engine):
            if part and part in names:
                return part
    return DEFAULT_TENANT


class Bounded(Exception):
    """The policy's walk passed WALK_BOUND chunks it may not evict: the caller takes its victim elsewhere."""


def bounded_pick(policy: EvictionPolicy, candidate: Callable[[bytes], T | None], allowed: Callable[[T], bool]
                 ) -> bytes | None:
    """The policy's next victim among the keys `candidate` resolves (None: not evictable at all) and `allowed`
    takes; raises Bounded after WALK_BOUND candidates it refused (a guaranteed tenant's cold chunks at the front
    of the order must not make a store walk the whole tier)."""
    passed = 0

    def evictable(key: bytes) -> bool:
        nonlocal passed
        item = candidate(key)
        if item is None:
            return False
        if allowed(item):
            return True
        passed += 1
        if passed > WALK_BOUND:
            raise Bounded
        return False
    return policy.pick_victim(evictable)
