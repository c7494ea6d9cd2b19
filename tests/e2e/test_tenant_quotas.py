"""Tenant quotas through a real vLLM (issue 32, check 2; docs/tenants.md): two tenants named by the request's
`cache_salt` on one engine and one kvtier server. Tenant B serves a few documents, tenant A then floods twice L1's
size with unrelated prompts, and B asks for its documents again (vLLM's own prefix cache emptied).

* ``test_a_guaranteed_tenant_keeps_its_chunks_through_anothers_flood``: with `--l1-tenant-quotas 'tenant-b=50%'`
  every B document reloads fully from kvtier, with the greedy output of vLLM's own prefix hit of the same blocks;
  `/status` shows B holding all its documents' bytes with no eviction, the flood's tenant (`*`) evicting.
* ``test_without_quotas_the_flood_leaves_the_other_tenant_nothing``: the same run without the table: A's flood
  evicts all of B's chunks, B's documents load nothing (and are recomputed, with their cold output).

The server runs LRU in both, so the contrast is the quota table's alone (a scan-resistant policy would keep
part of B's documents by itself). Every request answers HTTP 200. One vLLM serves the module (hint_rig.py).
"""

from __future__ import annotations

import harness
import pytest
from hint_rig import BLOCK, BLOCK_BYTES, FULL, PROMPT_LEN, Rig, Served, rig_fixtures

pytestmark = pytest.mark.e2e

L1_GB = 0.0625  # 64 MiB: 256 blocks of the tiny model
LRU = ["--eviction-policy", "lru"]
QUOTAS = ["--l1-tenant-quotas", "tenant-b=50%"]
A, B = {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}
DOCS = 3  # B's documents: 45 blocks, within its guaranteed half of L1 (128 blocks)


rig, _kill_leftovers = rig_fixtures("test_tenant_quotas", L1_GB, LRU)


def flooded(rig: Rig, args: list[str], seed: int) -> tuple[list[tuple[list[int], list[int], Served]], dict]:
    """A fresh server with `args`; B's documents served (cold, then from vLLM's cache), A's flood, B's documents
    again: per document (cold output, cached output, the reload), and L1's tenants (`/status`) after the flood."""
    rig.start_kvtier(L1_GB, LRU + args)
    docs = [harness.prompt_ids(PROMPT_LEN, seed=4100 + i) for i in range(DOCS)]
    refs = [rig.cold_and_cached(doc, **B) for doc in docs]
    evicted = harness.metric(rig.kv_metrics(), "kvtier_evictions_total")
    rig.flood(L1_GB, 2.0, seed=seed, **A)
    assert harness.metric(rig.kv_metrics(), "kvtier_evictions_total") > evicted + DOCS, "no flood"
    tenants = {row["tenant"]: row for row in rig.status()["l1"]["tenants"]}
    return [(cold, cached, rig.serve(doc, reset=True, **B))
            for doc, (cold, cached) in zip(docs, refs, strict=True)], tenants


def test_a_guaranteed_tenant_keeps_its_chunks_through_anothers_flood(rig: Rig):
    reloads, tenants = flooded(rig, QUOTAS, seed=410_000)
    for _cold, cached, reload in reloads:
        assert reload.external == FULL and reload.out == cached, reload
    b, rest = tenants["tenant-b"], tenants["*"]
    assert b["used_bytes"] == DOCS * (PROMPT_LEN // BLOCK) * BLOCK_BYTES and not sum(b["evictions"].values()), b
    assert sum(rest["evictions"].values()) > 0, rest


def test_without_quotas_the_flood_leaves_the_other_tenant_nothing(rig: Rig):
    reloads, tenants = flooded(rig, [], seed=420_000)
    for cold, _cached, reload in reloads:
        assert reload.external == 0 and reload.local_hit == 0 and reload.out == cold, reload
    assert list(tenants) == ["*"]  # without a table every namespace is the default tenant
