"""The tenant quota tables a server runs with, kept beside its L1 segment (`<segment>.tenants`) so that a table
changed through /reconfigure survives a warm restart (docs/tenants.md).

The file records the configured tables (flags, environment, config file) next to the current ones. At start
the current ones are taken back only while the configuration is the one they were changed from: an operator
who changes the configured table meant the new one, and it wins. A damaged file is ignored (logged): the
configured tables apply.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable

from kvtier.server.tenants import QuotaTable
from kvtier.shm.segment import TENANTS_NAME_SUFFIX

log = logging.getLogger("kvtier.tenants")


class TenantTables:
    """Tier name ("l1", "l2") -> table text: what runs now, and where to apply and keep a change."""

    def __init__(self, path: str, configured: dict[str, str], keep: bool) -> None:
        """`keep`: the server keeps its L1 over restarts (--l1-adopt), so its tables too."""
        self.path = path
        self.configured = dict(configured)
        self.keep = keep
        self.current = dict(configured)
        self.appliers: dict[str, Callable[[QuotaTable | None], dict]] = {}

    @classmethod
    def beside(cls, directory: str, segment: str, configured: dict[str, str], keep: bool) -> TenantTables:
        return cls(os.path.join(directory, segment + TENANTS_NAME_SUFFIX), configured, keep)

    def restore(self, discard: bool) -> str:
        """Take back the tables of the last run when the configuration is unchanged; the log line."""
        if not self.keep or discard:
            self._remove()
            return "tenant quota tables: as configured"
        try:
            with open(self.path) as f:
                kept = json.load(f)
        except FileNotFoundError:
            return "tenant quota tables: as configured"
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s: %s", self.path, exc)
            return "tenant quota tables: as configured"
        if not isinstance(kept, dict) or kept.get("configured") != self.configured \
                or not isinstance(kept.get("current"), dict):
            return "tenant quota tables: as configured (the configuration changed since they were kept)"
        current = {tier: text for tier, text in kept["current"].items()
                   if tier in self.configured and isinstance(text, str)}
        for text in current.values():
            try:
                QuotaTable.parse(text)
            except ValueError as exc:
                log.warning("ignoring %s: %s", self.path, exc)
                return "tenant quota tables: as configured"
        self.current.update(current)
        return f"tenant quota tables: kept from the last run ({self.current})"

    def apply(self, tier: str, text: str) -> dict:
        """Parse and apply `text` to `tier` at once and keep it; ValueError (nothing changes) for a bad table or
        one whose guarantees exceed the tier, KeyError for a tier without tables."""
        table = QuotaTable.parse(text)
        result = self.appliers[tier](table if table.quotas else None)
        self.current[tier] = table.text()
        self._save()
        return result

    def _save(self) -> None:
        if not self.keep or not any((*self.configured.values(), *self.current.values())):
            self._remove()
            return
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"configured": self.configured, "current": self.current}, f)
            os.replace(tmp, self.path)
        except OSError as exc:  # the change holds until a restart all the same
            log.warning("could not keep the tenant quota tables in %s: %s", self.path, exc)

    def _remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
