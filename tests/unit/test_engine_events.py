"""kvtier's feed events as the engine's own KV events (connector/vllm/engine_events.py): the block hashes equal
the ones vLLM's request block hasher gives the same prompt, chunks chain through their parents in any order, a
chunk whose parent never comes is skipped and counted, blocks shared by a partial and a full chunk are announced
and removed once, and a clear or a daemon restart removes what was announced in that medium, never with
AllBlocksCleared.

Needs vLLM: the dev venv skips it; tests/e2e/test_torch_unit_tests.py runs it in vLLM's venv. The feed maps are
made by the daemon's own encoder (server/feed.py) from server/events.py events and server/keys.py keys.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

from kvtier.connector.vllm.engine_events import Converter, EngineEvents, connect_address, engine_hasher  # noqa: E402
from kvtier.connector.vllm.meta import ConnectorOptions  # noqa: E402
from kvtier.server.events import Bus, Cleared, Removed, Stored  # noqa: E402
from kvtier.server.feed import Feed, FeedConfig, encode  # noqa: E402
from kvtier.server.keys import Namespace, chunk_keys  # noqa: E402
from kvtier.server.metrics import FeedMetrics, Metrics  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

pytestmark = pytest.mark.unit

BS = 16
NS = Namespace(model="org/tiny", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=BS,
               layout="paged", chunk_size=4 * BS)
FP = NS.fingerprint()
ALGO = "sha256"


@pytest.fixture(autouse=True, scope="module")
def _none_hash() -> None:
    init_none_hash(get_hash_fn_by_name(ALGO))  # as vLLM's engine core does before its first step


def engine_hashes(tokens: list[int]) -> list[bytes | int]:
    """The block hashes vLLM's own request block hasher gives a prompt, as the engine's GPU events carry them
    (64-bit integers unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    hasher = get_request_block_hasher(BS, get_hash_fn_by_name(ALGO))
    request = Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 30_000, n).tolist()


def stored(tokens: list[int], tier: str = "l1", with_tokens: bool = True, ns: Namespace = NS) -> list[dict]:
    """The feed's Stored maps of a prompt's chunks, as the daemon publishes them."""
    return [encode(Stored(tier, ns.fingerprint(), c.key, len(c.block_keys), c.aliases, 1024,
                          c.tokens if with_tokens else b"", c.parent if with_tokens else b""))
            for c in chunk_keys(ns, tokens)]


def run(conv: Converter, *events: dict, epoch: str = "e1") -> list:
    return conv.batch({"epoch": epoch, "ts": 0.0, "events": list(events)})


def converter(**kw: int) -> Converter:
    return Converter(FP, BS, engine_hasher(ALGO), **kw)


def hashes_of(events: list, kind: type) -> list[bytes | int]:
    return [h for e in events if isinstance(e, kind) for h in e.block_hashes]


def test_block_hashes_equal_the_engines_own_and_events_describe_their_blocks():
    tokens = prompt(3 * NS.chunk_size + BS, 1)  # three full chunks and a partial one of one block
    conv = converter()
    out = run(conv, *stored(tokens))
    assert hashes_of(out, BlockStored) == engine_hashes(tokens)
    first = out[0]
    assert first.parent_block_hash is None and first.token_ids == tokens[: NS.chunk_size]
    assert first.block_size == BS and first.medium == "CPU" and first.lora_name is None
    for before, after in zip(out, out[1:], strict=False):
        assert after.parent_block_hash == before.block_hashes[-1]
    assert [t for e in out for t in e.token_ids] == tokens
    assert not conv.skipped


def test_children_first_wait_for_their_parent_and_a_parent_never_seen_is_skipped_and_counted():
    tokens = prompt(3 * NS.chunk_size, 2)
    first, second, third = stored(tokens)
    conv = converter()
    assert run(conv, third, second) == []  # as a commit posts them: the last chunk first
    out = run(conv, first)
    assert hashes_of(out, BlockStored) == engine_hashes(tokens)

    lonely = converter(max_orphans=1)
    a, b = stored(prompt(2 * NS.chunk_size, 3))[1], stored(prompt(2 * NS.chunk_size, 4))[1]
    assert run(lonely, a, b) == []
    assert lonely.skipped == {"unknown_parent": 1}


def test_shared_blocks_are_announced_once_and_removed_when_no_chunk_names_them():
    tokens = prompt(NS.chunk_size, 5)
    full_hashes = engine_hashes(tokens)
    partial = stored(tokens[: 2 * BS])[0]  # the first two blocks, stored before the full chunk
    (full,) = stored(tokens)
    conv = converter()
    assert hashes_of(run(conv, partial), BlockStored) == full_hashes[:2]
    out = run(conv, full)
    assert len(out) == 1 and out[0].block_hashes == full_hashes[2:]
    assert out[0].parent_block_hash == full_hashes[1] and out[0].token_ids == tokens[2 * BS:]
    superseded = encode(Removed("l1", FP, partial["key"], "superseded"))
    assert run(conv, superseded) == []  # the full chunk still holds those blocks
    out = run(conv, encode(Removed("l1", FP, full["key"], "capacity")))
    assert len(out) == 1 and isinstance(out[0], BlockRemoved) and out[0].medium == "CPU"
    assert sorted(out[0].block_hashes) == sorted(full_hashes)


def test_lower_tiers_are_storage_and_a_clear_removes_only_its_medium_never_all_blocks():
    tokens = prompt(2 * NS.chunk_size, 6)
    conv = converter()
    run(conv, *stored(tokens))
    out = run(conv, *stored(tokens, tier="l2", with_tokens=False))  # an L2 write names no tokens: known keys
    assert {e.medium for e in out} == {"STORAGE"} and hashes_of(out, BlockStored) == engine_hashes(tokens)
    assert [t for e in out for t in e.token_ids] == tokens and out[0].locality == "LOCAL"
    assert run(conv, encode(Cleared("l1", b"\x01" * 16))) == []  # another namespace's clear
    out = run(conv, encode(Cleared("l1", None)))
    assert not any(isinstance(e, AllBlocksCleared) for e in out)
    assert [e.medium for e in out] == ["CPU"] and sorted(hashes_of(out, BlockRemoved)) == sorted(engine_hashes(tokens))
    first, second = stored(tokens)
    assert run(conv, first | {"tier": "remote"}) == []  # the remote tier holds chunk 0 too: no new block in STORAGE
    out = run(conv, encode(Removed("l2", FP, second["key"], "capacity")))
    assert hashes_of(out, BlockRemoved) == engine_hashes(tokens)[4:]
    assert run(conv, encode(Removed("l2", FP, first["key"], "capacity"))) == []  # the remote tier still holds it
    assert run(converter(), first | {"tier": "remote"})[0].locality == "REMOTE"


def test_unknown_chunks_other_namespaces_bad_events_and_a_restart():
    conv = converter()
    tokens = prompt(NS.chunk_size, 7)
    assert run(conv, *stored(tokens, tier="l2", with_tokens=False)) == []
    other = Namespace(**{**NS.to_dict(), "model": "org/other"})
    assert run(conv, *stored(tokens, ns=other)) == []
    bad = {**stored(tokens)[0], "tokens": b"\x00" * 12}
    assert run(conv, bad, {"type": "Stored", "ns": FP}) == []
    assert conv.skipped == {"no_tokens": 1, "other_namespace": 1, "malformed": 2}
    run(conv, *stored(tokens))
    out = run(conv, *stored(prompt(NS.chunk_size, 8)), epoch="e2")  # the daemon restarted
    assert hashes_of(out, BlockRemoved) == engine_hashes(tokens) and conv.skipped["restart"] == 1
    assert hashes_of(out, BlockStored) == engine_hashes(prompt(NS.chunk_size, 8))


def test_the_option_and_the_feed_address():
    assert ConnectorOptions.from_extra({"engine_events": True}).engine_events
    assert ConnectorOptions.from_extra({"kvtier.engine_events": "true"}).engine_events
    assert not ConnectorOptions.from_extra({}).engine_events
    with pytest.raises(ValueError):
        ConnectorOptions.from_extra({"engine_events": "maybe"})
    assert connect_address("tcp://*:5557", "tcp://10.0.0.2:5555") == "tcp://10.0.0.2:5557"
    assert connect_address("tcp://127.0.0.1:5557", "tcp://10.0.0.2:5555") == "tcp://127.0.0.1:5557"
    assert connect_address("ipc:///run/kvtier.feed", "tcp://10.0.0.2:5555") == "ipc:///run/kvtier.feed"


def test_a_server_without_a_feed_is_one_error_and_no_events(caplog):
    events = EngineEvents(lambda: ("", ""), lambda: True, "tcp://127.0.0.1:5555", converter())
    with caplog.at_level(logging.ERROR, logger="kvtier.connector"):
        assert events.take() == [] and events.take() == []
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "--events-endpoint" in caplog.text
    events.close()


def test_a_snapshot_replaces_the_view_keeping_the_remote_tiers_chunks():
    conv = converter()
    kept, gone, remote = prompt(NS.chunk_size, 9), prompt(NS.chunk_size, 10), prompt(NS.chunk_size, 11)
    run(conv, *stored(kept), *stored(gone), *stored(remote, tier="remote"))
    fresh = prompt(NS.chunk_size, 12)
    out = conv.resync("e2", [*stored(kept), *stored(fresh)])  # a restarted daemon that kept one chunk
    assert hashes_of(out, BlockRemoved) == engine_hashes(gone)
    assert hashes_of(out, BlockStored) == engine_hashes(fresh) and conv.epoch == "e2"
    assert run(conv, *stored(remote, tier="remote"), epoch="e2") == []  # still announced


def chunks_of(tokens: list[int]) -> list[Stored]:
    return [Stored("l1", FP, c.key, len(c.block_keys), c.aliases, 1024, c.tokens, c.parent)
            for c in chunk_keys(NS, tokens)]


def collect(events: EngineEvents, got: list, until_: object, what: str, poke: object = None) -> None:
    for _ in range(400):
        if poke is not None:
            poke()  # type: ignore[operator]
        got += events.take()
        if until_():  # type: ignore[operator]
            return
        time.sleep(0.025)
    raise AssertionError(f"timed out waiting for {what}")


def test_over_a_real_feed_a_late_engine_starts_from_a_snapshot_and_a_restart_resyncs(tmp_path):
    """A real daemon feed (server/feed.py, real ZeroMQ sockets, no server): what was stored before the engine
    subscribed comes from a snapshot, later stores live; a restarted feed (another epoch) that kept one prompt
    only is a resync: BlockRemoved for the other, nothing again for the kept one."""
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    before, after = prompt(2 * NS.chunk_size, 20), prompt(2 * NS.chunk_size, 21)  # 8 blocks each
    held = chunks_of(before)

    def feed_with(listing: list[Stored]) -> tuple[Bus, Feed]:
        bus = Bus()
        feed = Feed(bus, FeedConfig(pub, replay), FeedMetrics(Metrics()), lambda: list(listing))
        feed.start(lambda fn, *a: fn(*a))
        return bus, feed

    bus, feed = feed_with(held)
    events = EngineEvents(lambda: (pub, replay), lambda: True, "tcp://127.0.0.1:5555", converter())
    got: list = []
    try:
        events.start()
        collect(events, got, lambda: len(hashes_of(got, BlockStored)) == 8, "the snapshot's blocks")
        assert hashes_of(got, BlockStored) == engine_hashes(before) and events.snapshots == 1
        for s in chunks_of(after):
            bus.post(s)
            held.append(s)
        collect(events, got, lambda: len(hashes_of(got, BlockStored)) == 16, "the live store's blocks")
        assert hashes_of(got, BlockStored)[8:] == engine_hashes(after)

        feed.stop()
        bus, feed = feed_with(held[2:])  # another epoch, holding the second prompt only
        # its batches (of another namespace's chunk, until the subscriber has joined) show the new epoch
        collect(events, got, lambda: hashes_of(got, BlockRemoved), "the resync",
                lambda: bus.post(Stored("l1", b"\x07" * 16, b"\x07" * 16, 1, (), 1024)))
        assert hashes_of(got, BlockRemoved) == engine_hashes(before) and events.snapshots == 2
        assert len(hashes_of(got, BlockStored)) == 16
    finally:
        events.close()
        feed.stop()
