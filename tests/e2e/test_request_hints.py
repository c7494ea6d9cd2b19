"""Request hints through a real vLLM (issue 32, check 2; docs/hints.md): each hint travels in the OpenAI request's
`kv_transfer_params` and does what the docs say, every request answers HTTP 200 with the greedy output of vLLM's own
computation of the same split.

* ``test_store_false_leaves_nothing_in_any_tier``: a `store: false` prompt leaves nothing in L1 (`/status`) nor in
  the L2 directory, and nothing of it loads when it comes again; a plain prompt beside it is in both and reloads.
* ``test_max_store_tokens_stores_only_that_prefix``: only the whole blocks within the first N tokens are stored,
  and a longer prompt sharing the whole stored prompt loads exactly those.
* ``test_bad_hints_are_ignored_and_counted``: malformed and unknown fields answer HTTP 200, are counted on the
  server's `kvtier_hints_ignored_total{reason}`, and the request is stored as without them.
* ``test_retained_and_session_chunks_survive_a_flood``: a flood of unrelated prompts twice L1's size evicts a
  plain prompt (it reloads nothing) but not one stored with `retain_s` nor a live `session`'s (both reload
  fully); after the session's last turn (`end: true`) the next flood takes the session's chunks, while the
  retained prompt still reloads. The server runs LRU so that a flood surely evicts what no hint keeps.

One vLLM serves the whole module (hint_rig.py); each test starts its own kvtier server.
"""

from __future__ import annotations

import time
from pathlib import Path

import harness
import pytest
from hint_rig import BLOCK, FULL, PROMPT_LEN, Rig, chunks_of, hints, rig_fixtures

pytestmark = pytest.mark.e2e

L1_GB = 0.0625  # 64 MiB: 256 blocks of the tiny model, about 17 stored 2,000-token prompts
LRU = ["--eviction-policy", "lru"]


rig, _kill_leftovers = rig_fixtures("test_request_hints", L1_GB, LRU)


def l2_files(l2: Path) -> set[Path]:
    return set(l2.rglob("*.kv"))


def wait_l2_files(rig: Rig, l2: Path, count: int, timeout: float = 60.0) -> set[Path]:
    """The L2 directory's chunk files once there are `count` of them and no write is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        files = l2_files(l2)
        if len(files) >= count and rig.status()["l2"].get("l2_inflight") == 0:
            return files
        assert time.monotonic() < deadline, f"{len(files)} L2 files, not {count}: {rig.status()['l2']}"
        time.sleep(0.2)


def test_store_false_leaves_nothing_in_any_tier(rig: Rig, tmp_path: Path):
    l2 = tmp_path / "l2"
    rig.start_kvtier(0.25, ["--l2-path", str(l2), "--l2-size-gb", "1"])
    before = wait_l2_files(rig, l2, rig.l1_entries())  # the connection's throwaway prompts, written behind
    entries = rig.l1_entries()
    secret, plain = harness.prompt_ids(PROMPT_LEN, seed=3201), harness.prompt_ids(PROMPT_LEN, seed=3202)

    first = rig.serve(secret, reset=True, **hints(store=False))
    assert first.external == 0 and first.local_hit == 0, first
    assert rig.l1_entries() == entries, "a store: false prompt was stored in L1"

    _, plain_ref = rig.cold_and_cached(plain)  # stored, and written behind to L2
    assert rig.l1_entries() == entries + chunks_of(PROMPT_LEN)
    files = wait_l2_files(rig, l2, len(before) + chunks_of(PROMPT_LEN))
    time.sleep(0.5)  # anything of the store: false prompt would have been written with the plain one's
    assert len(l2_files(l2)) == len(files) == len(before) + chunks_of(PROMPT_LEN), "a store: false chunk in L2"
    assert rig.l1_entries() == entries + chunks_of(PROMPT_LEN)

    again = rig.serve(secret, reset=True)  # asked for plainly now: nothing of it anywhere to load
    assert again.external == 0 and again.local_hit == 0 and again.out == first.out, again
    back = rig.serve(plain, reset=True)
    assert back.external == FULL and back.out == plain_ref, back


def test_max_store_tokens_stores_only_that_prefix(rig: Rig):
    rig.start_kvtier(0.25)
    limit = 6 * BLOCK + 40  # six whole blocks: 768 tokens
    kept = limit // BLOCK * BLOCK
    shared = harness.prompt_ids(PROMPT_LEN, seed=3301)
    longer = shared + harness.prompt_ids(300, seed=3302)
    # The reference: `longer` with vLLM's own prefix-cache hit of exactly its first six blocks (neither stored).
    rig.serve(shared[:limit], reset=True, **hints(store=False))
    ref = rig.serve(longer, **hints(store=False))
    assert ref.local_hit == kept and ref.external == 0, ref
    entries = rig.l1_entries()

    stored = rig.serve(shared, reset=True, **hints(max_store_tokens=limit))
    assert stored.external == 0 and stored.local_hit == 0, stored
    assert rig.l1_entries() == entries + chunks_of(kept), "not only the prefix within max_store_tokens was stored"

    got = rig.serve(longer, reset=True)  # shares all of `shared`, finds only its stored prefix
    assert got.external == kept and got.out == ref.out, got


def test_bad_hints_are_ignored_and_counted(rig: Rig):
    rig.start_kvtier(0.25)
    entries = rig.l1_entries()
    bad = {"kv_transfer_params": {"kvtier": {"retain_s": -1, "priority": "urgent", "colour": "red"}}}
    served = rig.serve(harness.prompt_ids(PROMPT_LEN, seed=3501), reset=True, **bad)
    assert served.computed == PROMPT_LEN
    assert rig.l1_entries() == entries + chunks_of(PROMPT_LEN)  # stored as a request without hints
    want = {"retain_s": 1, "priority": 1, "unknown_key": 1}
    deadline = time.monotonic() + 10  # the connector reports its counts once a second
    while True:
        m = rig.kv_metrics()
        got = {r: harness.metric(m, "kvtier_hints_ignored_total", reason=r) for r in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want
    assert harness.metric(m, "kvtier_hints_ignored_total") == 3


def test_retained_and_session_chunks_survive_a_flood(rig: Rig):
    rig.start_kvtier(L1_GB, LRU)
    plain, kept, talk = (harness.prompt_ids(PROMPT_LEN, seed=3400 + i) for i in range(3))
    last = talk + harness.prompt_ids(400, seed=3403)  # the conversation's last turn: its history and more
    retain = hints(retain_s=600)
    live, end = hints(session={"id": "conv-1"}), hints(session={"id": "conv-1", "end": True})
    last_cold = rig.serve(last, reset=True, **hints(store=False)).out  # the reference of a cold `last`
    plain_cold, _ = rig.cold_and_cached(plain)
    _, kept_ref = rig.cold_and_cached(kept, **retain)
    _, talk_ref = rig.cold_and_cached(talk, **live)
    last_ref = rig.serve(last, **hints(store=False))  # `last` with vLLM's own hit of talk's whole blocks
    assert last_ref.local_hit == FULL, last_ref

    rig.flood(L1_GB, 2.0, seed=350_000)
    gone = rig.serve(plain, reset=True)
    assert gone.external == 0 and gone.out == plain_cold, f"the flood did not evict the plain prompt: {gone}"
    back = rig.serve(kept, reset=True, **retain)
    assert back.external == FULL and back.out == kept_ref, back
    back = rig.serve(talk, reset=True, **live)
    assert back.external == FULL and back.out == talk_ref, back

    final = rig.serve(last, reset=True, **end)  # loads the history, stores its own chunks, ends the session
    assert final.external == FULL and final.out == last_ref.out, final
    rig.flood(L1_GB, 2.0, seed=360_000)
    after = rig.serve(last, reset=True)
    assert after.external == 0 and after.out == last_cold, f"the ended session's chunks outlived a flood: {after}"
    back = rig.serve(kept, reset=True, **retain)
    assert back.external == FULL and back.out == kept_ref, back
