"""What any networked tier shares (server/tiers/networked/): the presence cache's shadowed-holder fallback
for a shared block-prefix alias (as PrefixIndex's), its expiries, and the per-node breakers whose failure
classifier the tier injects; and that none of it imports a store's client library."""

from __future__ import annotations

import ast
import os
import threading
import time
from pathlib import Path

import pytest
from kvtier.server.tiers.networked.breaker import Breakers, OpenedState
from kvtier.server.tiers.networked.presence import MISSING_TTL_S, PRESENT_TTL_S, UNKNOWN, Presence
from kvtier.server.tiers.networked.prober import Prober
from kvtier.server.tiers.record import ChunkMeta

pytestmark = pytest.mark.unit

NS = b"n" * 16


def chunk(aliases: list[bytes], blocks: int = 4) -> ChunkMeta:
    return ChunkMeta(os.urandom(16), NS, blocks, tuple(aliases), 1024)


def test_an_alias_falls_back_to_its_shadowed_holder_when_the_holder_goes():
    doc = [os.urandom(16), os.urandom(16)]  # the shared document's leading blocks
    first, second = chunk([*doc, os.urandom(16)]), chunk([*doc, os.urandom(16)])
    p, now = Presence(), 100.0
    p.add(first, now)
    p.add(second, now)
    assert p.get(doc[1], now) == (first, 2)  # the first holder keeps the alias
    p.drop(first, now)
    assert p.get(doc[1], now) == (second, 2) and p.get(doc[0], now) == (second, 1)
    assert p.get(first.key, now) is None  # known missing
    p.drop(second, now)
    assert p.get(doc[1], now) is UNKNOWN  # no holder left: asked again


def test_a_shadowed_holder_that_expired_or_was_cleared_is_not_a_fallback():
    doc = [os.urandom(16)]
    first, second, third = (chunk([*doc, os.urandom(16)]) for _ in range(3))
    p = Presence()
    p.add(first, 100.0)
    p.add(second, 50.0)  # seen long ago: its entry expired by now
    p.add(third, 100.0)
    p.drop(first, 100.0 + PRESENT_TTL_S - 60.0)
    assert p.get(doc[0], 100.0 + PRESENT_TTL_S - 60.0) == (third, 1)
    p.forget(NS)
    p.add(first, 200.0)
    p.drop(first, 200.0)
    assert p.get(doc[0], 200.0) is UNKNOWN


def test_presence_counts_chunks_and_expires_misses():
    a = chunk([os.urandom(16)])
    p = Presence(max_entries=4)
    p.add(a, 0.0)
    assert p.chunks == 1 and p.get(a.key, 1.0) == (a, a.blocks)
    p.missing([b"x" * 16], 0.0)
    assert p.get(b"x" * 16, MISSING_TTL_S / 2) is None and p.get(b"x" * 16, MISSING_TTL_S + 1) is UNKNOWN
    for _ in range(4):
        p.add(chunk([]), 1.0)
    assert p.get(a.key, 1.0) is UNKNOWN and p.chunks == 4  # the oldest went first


class NodeDown(Exception):
    pass


def test_the_injected_classifier_decides_what_opens_a_breaker():
    opened: list[str] = []
    brks = Breakers(2, 60.0, lambda exc: isinstance(exc, NodeDown), on_new=lambda n, b: opened.append(n))

    def fail(exc: Exception) -> None:
        with pytest.raises(type(exc)):
            brks.get("a").call(lambda: (_ for _ in ()).throw(exc))

    for _ in range(5):
        fail(ValueError("the server's answer"))  # not a node failure: never opens it
    assert brks.available("a")
    fail(NodeDown())
    fail(NodeDown())
    assert not brks.available("a") and brks.is_open("a") and opened == ["a"]
    with pytest.raises(OpenedState):
        brks.get("a").call(lambda: None)
    assert not brks.is_open("b") and brks.keep_only({"b"}) == ["a"] and not brks.is_open("a")


def test_the_prober_runs_one_probe_per_id_at_a_time():
    prober, release, ran = Prober("test", depth=4), threading.Event(), []
    try:
        for _ in range(3):
            prober.probe("k", lambda: (release.wait(5), ran.append("k")))
        release.set()
        deadline = time.monotonic() + 5
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert ran == ["k"]
    finally:
        prober.close()


def test_networked_imports_no_client_library():
    folder = Path(__file__).resolve().parents[3] / "server" / "tiers" / "networked"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("glide", "glide_sync", "redis", "valkey") for n in names), path
