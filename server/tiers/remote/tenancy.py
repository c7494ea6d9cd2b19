"""Which key base a namespace's keys live under in the remote store (`Tenancy`): a namespace of a named tenant
under `<prefix>:t:<tenant>`, every other one under the prefix as before tenants (layout.tenant_base), so that
a Redis ACL user can be limited to one tenant's keys (docs/remote.md, "Tenants").

The tier sees namespace fingerprints only; the tenant comes from the namespace's cache salt (tenants.py's
`tenant_of`), of the namespace `lookup` finds registered on this node (the L1 store's, given through the tier's
`know_namespaces`). The names are fixed at start (the configured quota tables and --remote-tenants): a namespace always
maps to the same base, and every node with the same names maps it alike."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection

from kvtier.server.keys import Namespace
from kvtier.server.tenants import DEFAULT_TENANT, tenant_of
from kvtier.server.tiers.remote.layout import tenant_base

MEMO_MAX = 8192  # fingerprints whose base is remembered (twice the namespaces L1 registers at once)


class UnknownNamespace(KeyError):
    """A fingerprint whose tenant cannot be told: not registered on this node (any more), not remembered."""


class Tenancy:
    """Fingerprint -> key base. Without tenant names every fingerprint's base is the prefix (no look-up)."""

    def __init__(self, prefix: str, names: Collection[str] = (),
                 lookup: Callable[[bytes], Namespace | None] | None = None) -> None:
        self.prefix = prefix
        self.names = frozenset(n for n in names if n != DEFAULT_TENANT)
        self._bases = {name: tenant_base(prefix, name) for name in sorted(self.names)}  # checks every name
        self.lookup = lookup  # a registered namespace by fingerprint (None: not registered)
        self._memo: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def tenant(self, fp: bytes) -> str:
        """The tenant of namespace `fp`; UnknownNamespace when it cannot be told."""
        if not self.names:
            return DEFAULT_TENANT
        with self._lock:
            known = self._memo.get(fp)
            if known is not None:
                self._memo.move_to_end(fp)
                return known
        namespace = self.lookup(fp) if self.lookup is not None else None
        if namespace is None:
            raise UnknownNamespace(fp.hex())
        tenant = tenant_of(namespace.cache_salt, self.names)
        with self._lock:
            self._memo[fp] = tenant
            while len(self._memo) > MEMO_MAX:
                self._memo.popitem(last=False)
        return tenant

    def base(self, fp: bytes) -> str:
        """Where namespace `fp`'s keys start; UnknownNamespace when its tenant cannot be told."""
        if not self.names:
            return self.prefix
        tenant = self.tenant(fp)
        return self.prefix if tenant == DEFAULT_TENANT else self._bases[tenant]

    def known(self, fp: bytes) -> bool:
        """Whether namespace `fp`'s keys can be named (and remember its tenant if so)."""
        try:
            self.tenant(fp)
        except UnknownNamespace:
            return False
        return True

    def bases(self) -> list[str]:
        """Every named tenant's base, then the prefix (the default tenant's, and above every other)."""
        return [*self._bases.values(), self.prefix]

    def clear_patterns(self, fp: bytes | None) -> list[str]:
        """SCAN patterns of a clear of namespace `fp` (None: of everything). Everything: each named tenant's
        keys first, then every key under the prefix (unnamed tenants' too), so a user limited to some tenants
        still clears theirs before the keys it may not touch. A namespace whose tenant cannot be told: under
        every base."""
        if fp is None:
            return [f"{base}:*" for base in self.bases()]
        try:
            return [f"{self.base(fp)}:{fp.hex()}:*"]
        except UnknownNamespace:
            return [f"{base}:{fp.hex()}:*" for base in self.bases()]
