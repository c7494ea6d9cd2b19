"""What the remote tier (server/tiers/remote/) reports through the event seam (server/events.py), against a
real Redis (tests/integration/redis_servers.py): a successful write is a Stored, a write of a chunk the store
has already is nothing, a chunk found damaged or gone is a Removed with that reason, a removal a Removed, a
clear one Cleared."""

from __future__ import annotations

import os
import uuid

import pytest
from kvtier.server.events import Bus, Cleared, Removed, Stored
from kvtier.server.tiers.remote.tier import RemoteTier
from test_remote_tier import corrupt_case, new_meta, read

pytest_plugins = ("redis_servers",)
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("how,reason", [("flipped", "corrupt"), ("part_missing", "missing")])
def test_remote_tier_reports_writes_losses_removals_and_clears(redis_standalone, how, reason):
    prefix = f"t{uuid.uuid4().hex[:12]}"
    a, b = RemoteTier(redis_standalone, prefix=prefix), RemoteTier(redis_standalone, prefix=prefix)  # two nodes
    bus = Bus()
    sub = bus.subscribe(depth=100)
    a.report = b.report = bus.post  # type: ignore[method-assign]  # as the cache does
    try:
        ns = os.urandom(16)
        m1, m2, m3 = new_meta(ns), new_meta(ns), new_meta(ns)
        for m in (m1, m2, m3):
            assert a.put(m, os.urandom(m.size))
        assert not b.put(m1, os.urandom(m1.size))  # the store has it: not stored by b
        assert sub.take(100, 0) == [Stored("remote", ns, m.key, m.blocks, m.aliases, m.size) for m in (m1, m2, m3)]
        corrupt_case(redis_standalone, a, m1, how)
        assert read(b, m1) is None
        assert a.remove(m2.key)
        a.clear(ns)
        assert sub.take(100, 0) == [Removed("remote", ns, m1.key, reason), Removed("remote", ns, m2.key, "removed"),
                                    Cleared("remote", ns)]
    finally:
        a.close()
        b.close()
