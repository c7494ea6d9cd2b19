"""The asynchronous connector (`kvtier.async_transfers`) on a real CPU vLLM (issue 14, check 2).

A gate proxy (gate_proxy.py) sits between the connector and the kvtier server and holds chosen requests for as
long as a test needs: a load ("acquire") or a store ("reserve") stays in flight while the test watches vLLM.

* ``test_load_in_flight_does_not_block_other_requests``: while one request's load is held, another request
  is served to the end; the held one then loads its 896 tokens with the output of vLLM's own prefix hit.
* ``test_store_holds_its_blocks_until_done``: a request whose store is held has returned to its client, but
  its KV blocks stay in use (vLLM's KV usage) until the store is done; what was stored reloads right.
* ``test_preemption_during_a_store_loses_nothing``: a request preempted (a KV cache of 24 blocks, two growing
  requests) while its store is held: the engine waits for the store before the blocks are reused (the other
  request's stream stalls until the gate opens), both requests complete, and the stored prompt reloads with
  the output of vLLM's own prefix hit.

References are like for like (see test_connector_reload.py): a reload of n tokens is compared with vLLM's own
prefix-cache hit of the same n tokens, made under a fresh `cache_salt` so that it shares nothing.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import harness
import pytest
from gate_proxy import GateProxy

pytestmark = pytest.mark.e2e

BLOCK = 128
PROMPT = 1024  # 8 blocks
RELOAD = (PROMPT - 1) // BLOCK * BLOCK  # 896: the whole blocks before the last prompt token
NUM_BLOCKS = 24  # a small KV cache, so that two growing requests preempt one
MAX_MODEL_LEN = 2048
USAGE = "vllm:kv_cache_usage_perc"
EXTERNAL = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")


class Rig:
    def __init__(self, port: int, proxy: GateProxy, procs: tuple[harness.Proc, ...]) -> None:
        self.port = port
        self.proxy = proxy
        self.procs = procs

    def external(self) -> float:
        return harness.metric(harness.metrics(self.port), EXTERNAL[0], source=EXTERNAL[1])

    def usage(self) -> float:
        return harness.metric(harness.metrics(self.port), USAGE)

    def quiesce(self, timeout: float = 60.0) -> None:
        """Wait until no KV block is in use (every held store reported)."""
        deadline = time.monotonic() + timeout
        while self.usage() > 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks still in use after {timeout} s")
            time.sleep(0.1)

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """vLLM's own output after a prefix-cache hit of RELOAD tokens, under a salt nothing else uses."""
        salt = f"ref-{uuid.uuid4().hex}"
        harness.complete(self.port, prompt, 1, cache_salt=salt)
        out, _ = harness.complete(self.port, prompt, max_tokens, cache_salt=salt)
        return out


@pytest.fixture(scope="module")
def rig(tiny_model: Path, vllm_python: Path, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("async-logs")
    port, http_port, proxy_port, vllm_port = (harness.free_port() for _ in range(4))
    server = harness.start_kvtier(port, http_port, 0.25, python=vllm_python, logdir=logdir)
    proxy = GateProxy(proxy_port, f"tcp://127.0.0.1:{port}")
    config = harness.kvtier_connector_config(proxy_port, async_transfers=True, request_timeout_s=120.0)
    vllm = harness.start_vllm(tiny_model, vllm_port, config, python=vllm_python, logdir=logdir,
                              extra_args=["--max-model-len", str(MAX_MODEL_LEN),
                                          "--num-gpu-blocks-override", str(NUM_BLOCKS)])
    try:
        yield Rig(vllm_port, proxy, (server, vllm))
    finally:
        proxy.release()
        vllm.stop()
        server.stop()
        proxy.close()


@pytest.fixture(autouse=True)
def _kill_leftovers(request):
    """Overrides conftest's: the module's server and vLLM stay up from test to test."""
    yield
    keep = request.getfixturevalue("rig").procs
    with harness._LIVE_LOCK:
        leftovers = [p for p in harness._LIVE if p not in keep]
    for proc in leftovers:
        proc.kill9()


class Background(threading.Thread):
    """A completion in a thread; `result` once joined."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.args = (port, prompt, max_tokens)
        self.result: list[int] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result, _ = harness.complete(*self.args, timeout=300)
        except BaseException as exc:  # handed to the test
            self.error = exc


class Stream(threading.Thread):
    """A streaming completion recording when each token arrived."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.prompt, self.max_tokens = port, prompt, max_tokens
        self.ids: list[int] = []
        self.arrivals: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        body = json.dumps({"model": harness.SERVED_MODEL_NAME, "prompt": self.prompt, "max_tokens": self.max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                           "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body, method="POST")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices") or []:
                        got = choice.get("token_ids") or []
                        self.ids.extend(got)
                        self.arrivals.extend(time.monotonic() for _ in got)
        except BaseException as exc:
            self.error = exc


def test_load_in_flight_does_not_block_other_requests(rig: Rig):
    doc = harness.prompt_ids(PROMPT, seed=1401)
    harness.complete(rig.port, doc, 1)  # computed, stored in the background
    rig.quiesce()
    expected, _ = harness.complete(rig.port, doc, 8)  # vLLM's own prefix hit of RELOAD tokens
    harness.reset_prefix_cache(rig.port)
    before = rig.external()

    rig.proxy.gate("acquire")
    held = Background(rig.port, doc, 8)
    held.start()
    try:
        rig.proxy.wait_held("acquire")
        other, _ = harness.complete(rig.port, harness.prompt_ids(300, seed=1402), 16, timeout=60)
        assert len(other) == 16
        assert held.is_alive(), "the request whose load is held finished before its load"
    finally:
        rig.proxy.release()
    held.join(120)
    assert held.error is None and held.result == expected
    assert rig.external() - before == RELOAD


def test_store_holds_its_blocks_until_done(rig: Rig):
    prompt = harness.prompt_ids(PROMPT, seed=1411)
    expected = rig.reference(prompt, 8)
    rig.quiesce()

    rig.proxy.gate("reserve")
    try:
        harness.complete(rig.port, prompt, 1, timeout=60)  # answered while its store waits at the gate
        rig.proxy.wait_held("reserve")
        time.sleep(0.5)  # a few engine steps: vLLM would have freed the blocks by now if they were not held
        in_use = rig.usage()
        assert in_use >= (PROMPT // BLOCK) / NUM_BLOCKS * 0.9, f"blocks not held while the store runs: {in_use}"
    finally:
        rig.proxy.release()
    rig.quiesce()  # reported done: released

    harness.reset_prefix_cache(rig.port)
    before = rig.external()
    out, _ = harness.complete(rig.port, prompt, 8)
    assert rig.external() - before == RELOAD
    assert out == expected


def test_preemption_during_a_store_loses_nothing(rig: Rig):
    stored = harness.prompt_ids(PROMPT, seed=1421)
    expected = rig.reference(stored, 8)
    rig.quiesce()
    preemptions = harness.metric(harness.metrics(rig.port), "vllm:num_preemptions_total")

    # G first (it stays ahead in vLLM's running queue), then S: both grow until the cache is full and vLLM
    # preempts the later one, S, while its store is held.
    reserves = rig.proxy.seen["reserve"]
    grower = Stream(rig.port, harness.prompt_ids(600, seed=1422), 1400)
    grower.start()
    deadline = time.monotonic() + 60
    while not grower.ids or rig.proxy.seen["reserve"] == reserves:  # G's own store went through
        assert time.monotonic() < deadline and grower.error is None, "the first request did not start"
        time.sleep(0.02)
    rig.proxy.gate("reserve")
    victim = Background(rig.port, stored, 900)
    try:
        victim.start()
        rig.proxy.wait_held("reserve")
        # The engine waits for S's store before the forward pass that could reuse its blocks: G stalls.
        deadline = time.monotonic() + 180
        while True:
            assert grower.is_alive(), "the first request finished without a preemption stalling it"
            assert time.monotonic() < deadline, "no preemption waited for the held store"
            if grower.arrivals and time.monotonic() - grower.arrivals[-1] > 3.0:
                break
            time.sleep(0.05)
    finally:
        rig.proxy.release()
    grower.join(300)
    victim.join(300)
    assert grower.error is None and len(grower.ids) == 1400
    assert victim.error is None and victim.result is not None and len(victim.result) == 900
    assert harness.metric(harness.metrics(rig.port), "vllm:num_preemptions_total") > preemptions
    rig.quiesce()

    harness.reset_prefix_cache(rig.port)
    before = rig.external()
    out, _ = harness.complete(rig.port, stored, 8)
    assert rig.external() - before == RELOAD
    assert out == expected
