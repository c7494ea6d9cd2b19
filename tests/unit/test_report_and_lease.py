"""The `report` op (a connector's counts on the server's metrics) and the lookup that leases what it found in
L1 (a lookup's answer is a promise: nothing evicts a leased chunk before the engine loads it)."""

from __future__ import annotations

import pytest
from kvtier.server import protocol as p
from kvtier.server.keys import chunk_keys

from tests.unit.test_protocol_rpc import NS, call, registered

pytestmark = pytest.mark.unit


def sample(h, name: str, **labels: str) -> float:
    return h.metrics.registry.get_sample_value(name, labels) or 0.0


def test_report_counts_skips_undelivered_tokens_and_verifications():
    h, fp = registered()
    reply = call(h, {"op": "report", "id": 3, "skipped": {p.SKIP_LORA: 2, p.SKIP_MM: 1},
                     "undelivered": {p.UNDELIVERED_MISSING: 256, p.UNDELIVERED_LEASE_LOST: 128}})
    assert reply["ok"], reply
    assert sample(h, "kvtier_identity_skips_total", reason=p.SKIP_LORA) == 2
    assert sample(h, "kvtier_identity_skips_total", reason=p.SKIP_MM) == 1
    assert sample(h, "kvtier_undelivered_tokens_total", reason=p.UNDELIVERED_MISSING) == 256
    assert sample(h, "kvtier_undelivered_tokens_total", reason=p.UNDELIVERED_LEASE_LOST) == 128
    assert call(h, {"op": "report", "id": 4, "verified": 5, "mismatched": 2, "ns": fp})["ok"]
    label = fp.hex()[:16]
    assert sample(h, "kvtier_verify_checks_total", namespace=label) == 5
    assert sample(h, "kvtier_verify_mismatches_total", namespace=label) == 2


def test_report_counts_ignored_hints_by_reason():
    h, _ = registered()
    assert all(sample(h, "kvtier_hints_ignored_total", reason=r) == 0 for r in p.HINT_IGNORED_REASONS)
    assert call(h, {"op": "report", "id": 3, "hints_ignored": {"retain_s": 3, "unknown_key": 1}})["ok"]
    assert sample(h, "kvtier_hints_ignored_total", reason="retain_s") == 3
    assert sample(h, "kvtier_hints_ignored_total", reason="unknown_key") == 1
    # a reason outside the fixed set is refused, so a client cannot grow the label set
    reply = call(h, {"op": "report", "id": 4, "hints_ignored": {"made_up": 1, "retain_s": 1}})
    assert reply["code"] == p.BAD_REQUEST
    assert sample(h, "kvtier_hints_ignored_total", reason="retain_s") == 3
    assert h.metrics.registry.get_sample_value("kvtier_hints_ignored_total", {"reason": "made_up"}) is None


def test_report_counts_lookups_the_client_answered_locally_as_the_servers_misses():
    h, fp = registered()
    assert call(h, {"op": "report", "id": 3, "local_lookups": 3, "local_blocks": 12, "ns": fp})["ok"]
    assert sample(h, "kvtier_lookups_total") == 3
    assert sample(h, "kvtier_lookup_requested_blocks_total") == 12
    assert sample(h, "kvtier_requested_tokens_total") == 12 * NS.block_size
    assert sample(h, "kvtier_hit_tokens_total", tier="l1") == 0
    reply = call(h, {"op": "report", "id": 4, "local_lookups": -1, "local_blocks": 12, "ns": fp})
    assert reply["code"] == p.BAD_REQUEST and sample(h, "kvtier_lookups_total") == 3


def test_a_refused_report_counts_nothing():
    h, fp = registered()
    reply = call(h, {"op": "report", "id": 3, "skipped": {p.SKIP_LORA: 2, "nope": 1}})
    assert reply["code"] == p.BAD_REQUEST
    assert sample(h, "kvtier_identity_skips_total", reason=p.SKIP_LORA) == 0
    reply = call(h, {"op": "report", "id": 4, "verified": 1, "ns": bytes(16)})
    assert reply["code"] == p.UNKNOWN_NAMESPACE


def _store(h, fp, chunks) -> None:
    items = [p.StoreItem(c.key, 100, len(c.block_keys), c.aliases).to_wire() for c in chunks]
    reply = call(h, {"op": "reserve", "id": 5, "ns": fp, "items": items})
    assert call(h, {"op": "commit", "id": 6, "res": [r[1] for r in reply["results"]]})["committed"] == len(chunks)


def test_a_leasing_lookup_holds_its_l1_hits_until_released():
    h, fp = registered()
    chunks = chunk_keys(NS, list(range(2 * NS.chunk_size)))
    _store(h, fp, chunks)
    plain = call(h, {"op": "lookup", "id": 7, "ns": fp, "chunks": [list(c.block_keys) for c in chunks]})
    assert "lease" not in plain and not h.holds.leases
    reply = call(h, {"op": "lookup", "id": 8, "ns": fp, "chunks": [list(c.block_keys) for c in chunks],
                     "lease": True})
    assert reply["hits"] == [4, 4] and reply["lease"] in h.holds.leases
    store = h.cache.store
    entries = [store.entries[c.key] for c in chunks]
    assert [e.readers for e in entries] == [1, 1] and store.evictable_pages == 0  # nothing can evict them
    assert call(h, {"op": "release", "id": 9, "leases": [reply["lease"]]})["released"] == 1
    assert not h.holds.leases
    assert [e.readers for e in entries] == [0, 0] and store.evictable_pages > 0


def test_a_leasing_lookup_that_finds_nothing_takes_no_lease():
    h, fp = registered()
    chunks = chunk_keys(NS, list(range(NS.chunk_size)))
    reply = call(h, {"op": "lookup", "id": 7, "ns": fp, "chunks": [list(c.block_keys) for c in chunks],
                     "lease": True})
    assert reply["hits"] == [] and "lease" not in reply and not h.holds.leases


def test_a_lookup_asked_again_is_not_counted_twice():
    h, fp = registered()
    chunks = chunk_keys(NS, list(range(2 * NS.chunk_size)))
    _store(h, fp, chunks)
    wire = [list(c.block_keys) for c in chunks]
    assert call(h, {"op": "lookup", "id": 7, "ns": fp, "chunks": wire})["hits"] == [4, 4]
    requested = sample(h, "kvtier_requested_tokens_total")
    hits = sample(h, "kvtier_hit_tokens_total", tier="l1")
    lookups = sample(h, "kvtier_lookups_total")
    assert (requested, hits, lookups) == (2 * NS.chunk_size, 2 * NS.chunk_size, 1)
    again = call(h, {"op": "lookup", "id": 8, "ns": fp, "chunks": wire, "again": True, "lease": True})
    assert again["hits"] == [4, 4] and again["lease"]  # answered and leased like any lookup
    assert sample(h, "kvtier_requested_tokens_total") == requested
    assert sample(h, "kvtier_hit_tokens_total", tier="l1") == hits
    assert sample(h, "kvtier_lookups_total") == lookups
