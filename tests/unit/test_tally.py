"""connector/tally.py: a connector's counts reach the server once per interval from the tally's own thread
(an idle engine still reports), nothing is lost while the server cannot be reached, and close sends the rest."""

from __future__ import annotations

import threading
import time

import pytest
from kvtier.connector.tally import Tally
from kvtier.server.keys import Namespace

pytestmark = pytest.mark.unit

NS = Namespace(model="m", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=8, block_size=16,
               layout="paged", chunk_size=64)


class Server:
    def __init__(self) -> None:
        self.up = True
        self.got: list[tuple[dict, Namespace | None]] = []
        self.sent = threading.Event()

    def send(self, counts: dict, ns: Namespace | None) -> bool:
        if self.up:
            self.got.append((counts, ns))
            self.sent.set()
        return self.up

    def totals(self) -> tuple[dict, dict, list[int]]:
        skipped: dict = {}
        undelivered: dict = {}
        verified = [0, 0]
        for counts, _ in self.got:
            for k, v in counts.get("skipped", {}).items():
                skipped[k] = skipped.get(k, 0) + v
            for k, v in counts.get("undelivered", {}).items():
                undelivered[k] = undelivered.get(k, 0) + v
            verified[0] += counts.get("verified", 0)
            verified[1] += counts.get("mismatched", 0)
        return skipped, undelivered, verified


def test_counts_are_sent_by_the_tally_itself_without_another_call():
    server = Server()
    tally = Tally(server.send, every_s=0.05)
    tally.skipped("lora_unknown")
    tally.skipped("lora_unknown")
    tally.undelivered("missing", 256)
    tally.undelivered("missing", 0)  # nothing to count
    tally.verified(NS, mismatched=True)
    tally.verified(NS, mismatched=False)
    deadline = time.monotonic() + 5
    while server.totals()[2][0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.totals() == ({"lora_unknown": 2}, {"missing": 256}, [2, 1])
    assert all(ns == NS for counts, ns in server.got if "verified" in counts)
    tally.close()
    assert server.totals() == ({"lora_unknown": 2}, {"missing": 256}, [2, 1])  # nothing sent twice


def test_nothing_is_lost_while_the_server_is_unreachable():
    server = Server()
    server.up = False
    tally = Tally(server.send, every_s=0.02)
    tally.undelivered("unreachable", 128)
    tally.verified(NS, mismatched=False)
    time.sleep(0.2)  # several failed sends
    server.up = True
    tally.undelivered("unreachable", 128)
    tally.close()
    assert server.totals() == ({}, {"unreachable": 256}, [1, 0])


def test_no_thread_until_something_is_counted():
    server = Server()
    tally = Tally(server.send, every_s=0.01)
    time.sleep(0.05)
    tally.close()
    assert server.got == [] and tally._thread is None


def test_ignored_hints_are_reported_by_reason_and_kept_while_unreachable():
    server = Server()
    server.up = False
    tally = Tally(server.send, every_s=0.02)
    tally.hint_ignored("retain_s")
    tally.hint_ignored("retain_s")
    time.sleep(0.1)  # failed sends
    server.up = True
    tally.hint_ignored("unknown_key")
    tally.close()
    totals: dict = {}
    for counts, ns in server.got:
        assert ns is None
        for k, v in counts.get("hints_ignored", {}).items():
            totals[k] = totals.get(k, 0) + v
    assert totals == {"retain_s": 2, "unknown_key": 1}


def test_local_misses_are_sent_per_namespace_and_kept_while_the_server_is_unreachable():
    server = Server()
    server.up = False
    tally = Tally(server.send, every_s=3600)
    tally.local_miss(NS, 16)
    tally.local_miss(NS, 8)
    tally.flush()  # refused: kept
    server.up = True
    tally.local_miss(NS, 4)
    tally.close()
    [(counts, ns)] = server.got
    assert ns == NS and (counts["local_lookups"], counts["local_blocks"]) == (3, 28)
    assert (counts["verified"], counts["mismatched"]) == (0, 0)
