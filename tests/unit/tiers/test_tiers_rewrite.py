"""Write-behind of adopted chunks after a warm restart (Cache.write_behind_again, no server process): newest
first, what the tier has or L1 lost is skipped, never more than half the writer's queue (no drops: new
commits keep the other half), and a clear of the tier since the call skips the rest."""

from __future__ import annotations

import asyncio

import pytest
from kvtier.server.keys import chunk_keys
from kvtier.server.l1.store import Entry
from test_tiers_attached import L1, NS, put_chunks

pytestmark = pytest.mark.unit

SIZE = 2500  # three pages
DEPTH = 4


def adopted(l1: L1, n: int) -> list[Entry]:
    """`n` chunks committed to L1 before any tier is attached (as an adoption leaves them), oldest first."""
    fp = l1.holds.register(NS)
    put_chunks(l1, fp, chunk_keys(NS, list(range(n * NS.chunk_size))), SIZE)
    return list(l1.store.entries.values())


def stopped_disk(l1: L1, path) -> object:  # noqa: ANN001
    """The filesystem tier, scanned, its writer's threads stopped: jobs stay queued until run_pending."""
    tier = l1.filesystem(path, 1 << 30, DEPTH)
    tier.writer.stop()
    tier.writer._stopping = False
    return tier


async def _settle(task: asyncio.Future, until) -> None:  # noqa: ANN001
    for _ in range(200):
        if until() or task.done():
            return
        await asyncio.sleep(0.01)


def test_newest_first_skips_what_the_tier_has_or_l1_lost_and_never_drops(tmp_path):
    l1 = L1()
    entries = adopted(l1, 8)
    tier = stopped_disk(l1, tmp_path)
    try:
        there, gone = entries[6], entries[5]
        tier.write_behind(there)  # written behind before the "restart"
        tier.writer.run_pending()
        assert tier.tier.contains(there.key)
        l1.store.remove(gone, "evicted")
        written: list[bytes] = []

        async def scenario() -> None:
            task = asyncio.ensure_future(l1.cache.write_behind_again(entries))
            while not task.done():
                await _settle(task, lambda: tier.writer.room <= DEPTH // 2)
                assert tier.writer.queue_depth <= DEPTH // 2  # half the queue stays free for new commits
                written.extend(job_keys(tier))
                tier.writer.run_pending()
            await task

        asyncio.run(scenario())
        newest_first = [e.key for e in reversed(entries) if e not in (there, gone)]
        assert written == newest_first
        assert tier.writer.dropped == 0 and all(tier.tier.contains(e.key) for e in entries if e is not gone)
        assert all(e.readers == 0 for e in l1.store.entries.values())  # every write's hold returned
    finally:
        l1.close()


def test_a_clear_of_the_tier_since_the_call_skips_the_rest(tmp_path):
    l1 = L1()
    entries = adopted(l1, 6)
    tier = stopped_disk(l1, tmp_path)
    try:
        async def scenario() -> None:
            task = asyncio.ensure_future(l1.cache.write_behind_again(entries))
            await _settle(task, lambda: tier.writer.room <= DEPTH // 2)
            assert tier.writer.queue_depth == DEPTH // 2
            await l1.cache.clear(None, l1=False, lower=["l2"])  # the queued jobs are dropped as stale too
            tier.writer.run_pending()
            await asyncio.wait_for(task, 5)

        asyncio.run(scenario())
        assert tier.tier.entries == 0 and tier.writer.stale == DEPTH // 2 and tier.writer.inflight == 0
    finally:
        l1.close()


def job_keys(tier) -> list[bytes]:  # noqa: ANN001
    return [job.meta.key for job in list(tier.writer._queue.queue) if job is not None]

