"""A document followed by different questions, through the shared store (issue 30; the remote tier's side of
test_l2_shared_alias.py): two chunks hold the same leading blocks, each a holder of the same block-prefix
alias keys; when the first holder leaves the store (it expires, or it is removed), a lookup of the shared
prefix from another node still hits through the second holder, bit-exact. On a standalone Redis and a
three-master Cluster (an alias key, its chunk and the other holder on different masters), and as the ACL user
docs/remote.md documents (its line must grant what the holders' writes use).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
from _support import wait_for
from kvtier.server.keys import chunk_keys
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.layout import ALIAS, ALIAS_COMPACT_BYTES, ALIAS_HOLDERS
from kvtier.server.tiers.remote.tier import RemoteTier
from test_remote_nodes import BLOCK_BYTES, NS, client, lookup, prompt, read_blocks, start_nodes, write
from test_remote_tier import answered, keys_matching, raw_client, read, tiers, url  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration
# redis_standalone, redis_cluster, valkey_standalone, redis_acl
pytest_plugins = ("redis_servers",)

BLOCKS = 4


def sharing(ns: bytes, shared: list[bytes], size: int = 70_000) -> ChunkMeta:
    """A chunk whose first len(`shared`) blocks are `shared` (block-prefix keys), the rest its own."""
    aliases = (*shared, *(os.urandom(16) for _ in range(BLOCKS - 1 - len(shared))))
    return ChunkMeta(os.urandom(16), ns, BLOCKS, aliases, size)


def unlink_chunk(store: str, tier_prefix: str, key: bytes) -> None:
    """Remove a chunk's header and parts from the store, as its expiry (or another node's delete) does."""
    keys = keys_matching(store, f"{tier_prefix}:*:{{{key.hex()}}}:*")
    assert keys, "the chunk is not in the store"
    c = raw_client(store)
    try:
        for k in keys:  # one by one: on a Cluster each is its own request
            c.unlink([k])
    finally:
        c.close()


def alias_key(tier: RemoteTier, ns: bytes, alias: bytes) -> str:
    return tier._key(ns, alias, "a")  # noqa: SLF001


@pytest.mark.parametrize("store", ["redis_standalone", "redis_cluster"])
def test_another_node_finds_the_document_through_the_second_question_once_the_first_is_gone(
        store, request, kvtier_server, tmp_path):
    url_ = request.getfixturevalue(store)
    a, b = start_nodes(kvtier_server, url_, tmp_path)
    tier_prefix = a.args[a.args.index("--remote-prefix") + 1]
    doc = prompt(301, 10 * NS.block_size)  # chunks 0 and 1, and the first 2 blocks of chunk 2
    asks = [np.concatenate([doc, prompt(310 + q, 6 * NS.block_size)]) for q in range(3)]  # doc + question q
    ca = client(a.url)
    for n, tokens in ((4, asks[0]), (6, asks[1])):  # one after the other: question 0's chunk 2 holds first
        ca.store(NS, tokens, lambda ch: len(ch.block_keys) * BLOCK_BYTES, write)
        wait_for(lambda n=n: (s := ca.stats()) and s["remote_written"] >= n and s["remote_queue_depth"] == 0
                 and s["remote_inflight"] == 0, timeout=60, what=f"{n} chunks written to the store")
    first, second = chunk_keys(NS, asks[0])[2], chunk_keys(NS, asks[1])[2]
    assert first.key != second.key and first.aliases[:2] == second.aliases[:2]
    unlink_chunk(url_, tier_prefix, first.key)

    cb = client(b.url)
    found = lookup(cb, asks[2])
    assert not found.pending and set(found.tiers) == {"remote"}
    assert found.blocks == 10, "the document's last 2 blocks were not found through question 1's chunk"
    assert read_blocks(cb, found) == 10


def test_the_shared_prefix_outlives_its_first_holder_s_ttl(url, tiers):  # noqa: F811
    """Real expiry: the first holder is written with a 1 s TTL, the second with a long one; the alias keys
    they share live as long as their newest holder's write says."""
    short, long_, reader = tiers(url, ttl_s=1.0), tiers(url, ttl_s=600.0), tiers(url)
    ns = os.urandom(16)
    shared = [os.urandom(16), os.urandom(16)]
    first, second = sharing(ns, shared), sharing(ns, shared)
    data = os.urandom(second.size)
    assert short.put(first, os.urandom(first.size))
    assert long_.put(second, data)
    deadline = time.monotonic() + 10.0
    while keys_matching(url, f"{short.prefix}:{ns.hex()}:{{{first.key.hex()}}}:h"):
        assert time.monotonic() < deadline, "the first holder did not expire"
        time.sleep(0.1)
    assert answered(reader, [[*shared, os.urandom(16), os.urandom(16)]], ns) == [(second, 2)]
    assert answered(tiers(url), [shared[:1]], ns) == [(second, 1)]
    assert read(reader, second) == data


def test_an_alias_of_an_earlier_kvtier_is_read_and_a_foreign_value_is_a_miss(url, tiers):  # noqa: F811
    writer, reader = tiers(url), tiers(url)
    ns = os.urandom(16)
    old, foreign = os.urandom(16), os.urandom(16)
    meta = sharing(ns, [old])
    assert writer.put(meta, os.urandom(meta.size))
    c = raw_client(url)
    try:
        c.set(alias_key(writer, ns, old), ALIAS.pack(meta.key, 1))  # as SET NX wrote it before: one record
        c.set(alias_key(writer, ns, foreign), b"not kvtier's")
    finally:
        c.close()
    assert answered(reader, [[old, os.urandom(16)]], ns) == [(meta, 1)]
    assert answered(reader, [[foreign, os.urandom(16)]], ns) == []
    assert reader.errors == 0 and reader.corrupt == 0
    later = sharing(ns, [old])  # a holder appended to the earlier kvtier's value
    data = os.urandom(later.size)
    assert writer.put(later, data)
    unlink_chunk(url, writer.prefix, meta.key)
    other = tiers(url)
    assert answered(other, [[old]], ns) == [(later, 1)] and read(other, later) == data


def test_an_alias_keeps_its_newest_holders(url, tiers):  # noqa: F811
    writer = tiers(url)
    ns = os.urandom(16)
    shared = [os.urandom(16)]
    metas = [sharing(ns, shared, 4096) for _ in range(3 * ALIAS_HOLDERS)]
    for meta in metas:
        assert writer.put(meta, os.urandom(meta.size))
    c = raw_client(url)
    try:
        value = c.get(alias_key(writer, ns, shared[0]))
    finally:
        c.close()
    assert isinstance(value, bytes) and len(value) % ALIAS.size == 0
    assert ALIAS.size * ALIAS_HOLDERS <= len(value) <= ALIAS_COMPACT_BYTES
    assert ALIAS.unpack(value[-ALIAS.size:]) == (metas[-1].key, 1)
    for meta in metas[-ALIAS_HOLDERS + 1:]:  # all but the oldest of the newest go: that one still serves
        unlink_chunk(url, writer.prefix, meta.key)
    assert answered(tiers(url), [shared], ns) == [(metas[-ALIAS_HOLDERS], 1)]


def test_a_user_that_may_not_append_keeps_the_first_holder_and_is_told_once(redis_standalone, make_acl_user,
                                                                           tiers, caplog):  # noqa: F811
    """The ACL line of an earlier kvtier (no APPEND): aliases are written as then, the first holder kept."""
    user = make_acl_user(redis_standalone, f"noappend-{os.urandom(4).hex()}", drop=("+append",))
    with caplog.at_level(logging.WARNING, logger="kvtier.server.remote"):
        writer = tiers(user)
        ns = os.urandom(16)
        shared = [os.urandom(16)]
        metas = [sharing(ns, [os.urandom(16)]), *(sharing(ns, shared) for _ in range(3))]
        for meta in metas:
            assert writer.put(meta, os.urandom(meta.size))
    messages = [r.getMessage() for r in caplog.records]
    assert sum("refused APPEND" in m for m in messages) == 1, messages
    assert answered(tiers(user), [shared], ns) == [(metas[1], 1)]  # written after the refusal: its first holder
