"""The bench's delaying TCP proxy (server/bench/delay_proxy.py) in front of a real Redis: a round trip through
it takes about the RTT it adds (against direct, in the same test; loose bounds: the machine is shared), and
every byte passes intact and in order, pipelined and large."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import glide_sync as glide
import pytest
from kvtier.server.bench.delay_proxy import DelayProxy, spawn
from kvtier.server.bench.remote_rtt import ping_s

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_standalone

RTT_S = 0.02  # large against this machine's scheduling noise (a loaded 2-core VM adds ~0.5 ms)


def _client(port: int) -> glide.GlideClient:
    return glide.GlideClient.create(glide.GlideClientConfiguration([glide.NodeAddress("127.0.0.1", port)],
                                                                   request_timeout=30_000))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@contextlib.contextmanager
def _in_thread(host: str, port: int, rtt_s: float) -> Iterator[int]:
    with DelayProxy(host, port, rtt_s) as proxy:
        yield proxy.port


@pytest.mark.parametrize("start", [_in_thread, spawn], ids=["thread", "process"])
def test_a_round_trip_through_the_proxy_takes_the_added_rtt(redis_standalone, start):
    direct = _client(_port(redis_standalone))
    try:
        base = ping_s(direct, 7)
        with start("127.0.0.1", _port(redis_standalone), RTT_S) as port:
            client = _client(port)
            try:
                added = ping_s(client, 7) - base
            finally:
                client.close()
    finally:
        direct.close()
    assert 0.9 * RTT_S <= added <= 3 * RTT_S, added


def test_bytes_pass_intact_in_order_pipelined_and_large(redis_standalone):
    """A 5 MiB value, and a batch of 200 values of distinct sizes, written and read through a proxy process."""
    with spawn("127.0.0.1", _port(redis_standalone), 0.002) as port:
        client = _client(port)
        try:
            big = os.urandom(5 << 20)
            client.set("delay-proxy-test:big", big)
            assert client.get("delay-proxy-test:big") == big
            values = [os.urandom(1 + 997 * i) for i in range(200)]
            batch = glide.Batch(is_atomic=False)
            for i, v in enumerate(values):
                batch.set(f"delay-proxy-test:{i}", v)
            client.exec(batch, raise_on_error=True)
            batch = glide.Batch(is_atomic=False)
            for i in range(len(values)):
                batch.get(f"delay-proxy-test:{i}")
            assert client.exec(batch, raise_on_error=True) == values
            client.unlink(["delay-proxy-test:big", *(f"delay-proxy-test:{i}" for i in range(len(values)))])
        finally:
            client.close()
