"""The per-tenant L1 series (server/metrics.py TenantCollector): read from the rows at each scrape, every known
reason present from the start, a new reason at its first count."""

from __future__ import annotations

import pytest
from kvtier.server.metrics import TENANT_EVICTIONS, TENANT_REFUSALS, Metrics
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.unit


def scrape(m: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("kvtier_tenant")}


def test_rows_are_read_at_each_scrape():
    rows = [{"tenant": "A", "used_bytes": 4096, "entries": 2, "guaranteed_bytes": 1024, "max_bytes": 8192,
             "stored_tokens": 128, "requested_tokens": 300, "hit_tokens": 64, "evictions": {"quota": 3},
             "refused": {}}]
    m = Metrics()
    m.watch_tenants(lambda: rows)
    got = scrape(m)
    assert got[("kvtier_tenant_used_bytes", (("tenant", "A"),))] == 4096
    assert got[("kvtier_tenant_max_bytes", (("tenant", "A"),))] == 8192
    assert got[("kvtier_tenant_requested_tokens_total", (("tenant", "A"),))] == 300
    assert got[("kvtier_tenant_evictions_total", (("reason", "quota"), ("tenant", "A")))] == 3
    for reason in TENANT_EVICTIONS:
        assert ("kvtier_tenant_evictions_total", (("reason", reason), ("tenant", "A"))) in got
    for reason in TENANT_REFUSALS:
        assert got[("kvtier_tenant_refused_stores_total", (("reason", reason), ("tenant", "A")))] == 0
    rows[0] = {**rows[0], "used_bytes": 0, "refused": {"tenant_max": 5, "something_new": 1}}
    rows.append({**rows[0], "tenant": "*", "refused": {}})
    got = scrape(m)
    assert got[("kvtier_tenant_used_bytes", (("tenant", "A"),))] == 0
    assert got[("kvtier_tenant_refused_stores_total", (("reason", "tenant_max"), ("tenant", "A")))] == 5
    assert got[("kvtier_tenant_refused_stores_total", (("reason", "something_new"), ("tenant", "A")))] == 1
    assert ("kvtier_tenant_entries", (("tenant", "*"),)) in got
