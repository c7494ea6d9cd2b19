"""Several requests in flight on one KVTierClient socket, against a real server process: threads sharing a
client each get their own replies, a reply that overtakes an earlier one (a lookup waiting on L2 promotions)
is matched by id, and a server restart resolves the requests in flight to None, never to another's reply."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest
from _support import payload_of, prompt, read_checked, wait_for
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace, chunk_keys

pytestmark = pytest.mark.integration

NS = Namespace(model="org/tiny-pipelining", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64,
               block_size=16, layout="NHD", chunk_size=256)
SMALL = 64 * 1024
BIG = 1 << 20
N_BIG = 112  # chunks of the promotion that keeps a lookup's reply waiting (as in test_l2_promotion_server)



def client(url: str, strict: bool = True) -> KVTierClient:
    c = KVTierClient(ClientConfig(url=url, connect_timeout_s=5.0, request_timeout_s=20.0, strict=strict))
    assert c.connect()
    return c


def store(c: KVTierClient, tokens: np.ndarray, size: int) -> int:
    return c.store(NS, tokens, lambda _c: size, lambda ch, span: span.write(0, payload_of(ch.key, size))).stored



def test_threads_share_one_client_and_get_their_own_replies(kvtier_server):
    srv = kvtier_server(l1_gb=0.25)
    c = client(srv.url)
    n_threads, rounds = 6, 15
    # thread i's prompt has i + 1 chunks: a reply handed to the wrong request shows in its length
    prompts = [prompt(100 + i, (i + 1) * NS.chunk_size) for i in range(n_threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def work(i: int) -> None:
        try:
            tokens, n = prompts[i], i + 1
            start.wait(timeout=30)
            assert store(c, tokens, SMALL) == n
            for _ in range(rounds):
                pending = [c.submit({"op": "lookup", "chunks": [k.block_keys for k in chunk_keys(NS, tokens)]}, NS)
                           for _ in range(3)]
                stats = c.submit({"op": "stats"})
                found = c.lookup(NS, tokens)
                assert found.tokens == len(tokens) and len(found.hits) == n
                assert read_checked(c, NS, found.hits) == n * NS.chunk_size // NS.block_size
                for pend in reversed(pending):  # collected in another order than sent
                    reply = pend.result()
                    assert reply is not None and len(reply["hits"]) == n and "entries" not in reply
                s = stats.result()
                assert s is not None and "entries" in s and "hits" not in s
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[0]
    s = c.stats()
    assert s["entries"] == sum(range(1, n_threads + 1)) and s["leases"] == 0 and s["reservations"] == 0
    c.close()


def l2_server(kvtier_server, tmp_path):
    """A server whose L2 holds a large prompt that is not in L1 (stored, then the server restarted cold)."""
    srv = kvtier_server(l1_gb=0.5, extra=["--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1",
                                          "--l2-queue-depth", "512", "--no-l1-adopt"])
    big = prompt(1, N_BIG * NS.chunk_size)
    c = client(srv.url)
    assert store(c, big, BIG) == N_BIG
    wait_for(lambda: (s := c.stats()) and s["l2_inflight"] == 0 and s["l2_written"] >= N_BIG, timeout=120,
             what="L2 writes durable")
    c.close()
    srv.signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0, srv.log_text()
    srv.start()
    return srv, big


def acquire_message(tokens: np.ndarray) -> dict:
    return {"op": "lookup", "chunks": [k.block_keys for k in chunk_keys(NS, tokens)], "acquire": True}


def test_a_reply_that_overtakes_an_earlier_one_is_matched_by_id(kvtier_server, tmp_path):
    srv, big = l2_server(kvtier_server, tmp_path)
    c = client(srv.url)
    slow = c.submit(acquire_message(big), NS)  # answered once every chunk is promoted from L2
    fast = c.submit({"op": "stats"})
    assert slow is not None and fast is not None
    s = fast.result()
    # answered while the promotions the earlier request waits for were still running: it came back first
    assert s is not None and "entries" in s and "lease" not in s and s["l2_promoted"] < N_BIG, s
    leased = slow.result()
    assert slow.done() and leased is not None and "entries" not in leased
    assert leased["tiers"] == ["l2"] * N_BIG and leased["lease"] > 0 and len(leased["items"]) == N_BIG
    assert c.request({"op": "release", "leases": [leased["lease"]]})["released"] == 1
    assert c.stats()["leases"] == 0
    c.close()


def test_server_restart_resolves_requests_in_flight_to_none(kvtier_server, tmp_path):
    srv, big = l2_server(kvtier_server, tmp_path)
    c = client(srv.url, strict=False)
    first_id = c.server_id
    waiting = [c.submit(acquire_message(big), NS) for _ in range(3)]
    assert all(w is not None and not w.done() for w in waiting)
    srv.signal(signal.SIGKILL)
    srv.proc.wait(timeout=30)
    srv.start()
    # the new server marked the old one's presence filter closed: the client takes its server as gone, so its
    # next request says hello on a new connection instead of going out on the old one
    assert not c.connected
    results: list[dict | None] = []
    collector = threading.Thread(target=lambda: results.extend(w.result() for w in waiting))
    collector.start()
    s = c.stats()  # says hello again: a new connection, whose replies the old requests must not get
    assert s is not None and "entries" in s and c.server_id and c.server_id != first_id
    collector.join(timeout=60)
    assert not collector.is_alive() and results == [None, None, None]
    again = c.submit(acquire_message(big), NS)
    assert again is not None
    reply = again.result(timeout=60)
    assert reply is not None and reply["tiers"] == ["l2"] * N_BIG
    assert c.request({"op": "release", "leases": [reply["lease"]]})["released"] == 1
    c.close()
