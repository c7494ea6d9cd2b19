"""The vLLM scheduler's lookup asks the server only when the server's presence filter (shm/presence.py, read by
KVTierClient.may_hold) says the first block past vLLM's own prefix-cache hit may be held; otherwise the request
is a miss without a round trip, reported so that the server's lookup metrics still count it
(tests/integration/test_presence_served.py tests the filter itself against a real server).

Its package imports torch and vLLM: the dev venv skips it; tests/e2e/test_torch_unit_tests.py runs it in vLLM's
venv.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from kvtier.server.keys import chunk_keys  # noqa: E402

from tests.unit.test_request_hints import BS, PROMPT, request, scheduler  # noqa: E402

pytestmark = pytest.mark.unit

LIMIT = (len(PROMPT) - 1) // BS * BS  # what a lookup asks for: whole blocks, one token left to compute


def block_key(side, block: int) -> bytes:
    ns = side.namespace("")
    return chunk_keys(ns, PROMPT[:LIMIT])[block // ns.blocks_per_chunk].block_keys[block % ns.blocks_per_chunk]


def test_a_block_past_vllms_hit_held_by_no_tier_is_a_miss_without_a_round_trip():
    side, server = scheduler()
    server.present = {block_key(side, 3)}  # held, but inside vLLM's own hit of four blocks
    assert side.get_num_new_matched_tokens(request("r", None), 4 * BS) == (0, False)
    assert server.lookups == 0
    side.tally.flush()
    [counts] = [c for c in server.reports if c.get("local_lookups")]
    assert (counts["local_lookups"], counts["local_blocks"]) == (1, LIMIT // BS)


def test_a_block_the_filter_may_hold_is_asked_of_the_server():
    side, server = scheduler()
    server.present = {block_key(side, 4)}
    assert side.get_num_new_matched_tokens(request("r", None), 4 * BS) == (0, False)
    assert server.lookups == 1
    side.tally.flush()
    assert not [c for c in server.reports if c.get("local_lookups")]  # counted by the server's own lookup


def test_without_a_filter_every_lookup_goes_to_the_server():
    side, server = scheduler()
    assert server.present is None
    side.get_num_new_matched_tokens(request("r", None), 0)
    side.get_num_new_matched_tokens(request("q", None), 4 * BS)
    assert server.lookups == 2
