"""kvtier's blocks in each engine's own KV-event stream (connector/vllm/engine_events.py, docs/events.md), with
two real vLLM engines sharing one kvtier server, each publishing its KV events with `--kv-events-config`
(ZeroMQ) and running the connector with `"engine_events": true`. The events are decoded by vLLM's own msgspec
structs (`KVEventBatch`, tests/e2e/kv_events_sub.py, in vLLM's python).

A prompt sent to engine A only: A's stream shows kvtier's `BlockStored` (medium CPU, ownership kvtier) with the
prompt's token ids and the very block hashes of A's own GPU `BlockStored` of those blocks. Engine B, started
after that store, shows the same blocks as loadable (from a snapshot of the server's feed), and a second prompt
sent to A only reaches B's stream through the live feed. An L1 shrink evicts two of the four chunks:
`BlockRemoved` of their blocks in both streams; an admin clear removes the others: `BlockRemoved` again, never
`AllBlocksCleared`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import harness
import pytest

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM CPU block size
SUBSCRIBER = Path(__file__).resolve().parent / "kv_events_sub.py"


class Stream:
    """One engine's KV events, decoded by a subscriber process in vLLM's python."""

    def __init__(self, python: Path, port: int, logdir: Path, name: str) -> None:
        self.path = logdir / f"{name}-events.jsonl"
        self.path.touch()
        self.proc = harness.Proc(f"sub-{name}", [str(python), str(SUBSCRIBER), f"tcp://127.0.0.1:{port}",
                                                 str(self.path)], logdir / f"sub-{name}.log", cwd=harness.REPO)

    def events(self, **match: object) -> list[dict]:
        lines = self.path.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.endswith("}")]
        return [e for e in events if all(e.get(k) == v for k, v in match.items())]

    def kvtier(self, kind: str) -> list[dict]:
        return self.events(type=kind, ownership="kvtier")


def engine(python: Path, model: Path, kvtier_port: int, events_port: int, logdir: Path, name: str) -> harness.Proc:
    config = harness.kvtier_connector_config(kvtier_port)
    config["kv_connector_extra_config"]["engine_events"] = True
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
    return harness.start_vllm(model, harness.free_port(), config, python=python, logdir=logdir, name=name,
                              extra_args=["--kv-events-config", json.dumps(events)], timeout=300)


def until(what: str, done: Callable[[], bool], engines: list[harness.Proc], timeout: float = 90.0) -> None:
    """Wait for `done`, running a short request on each engine meanwhile: vLLM takes the connector's events
    after an engine step, so an idle engine publishes nothing."""
    deadline, seed = time.monotonic() + timeout, 1000
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        for e in engines:
            e.check_alive()
            seed += 1
            harness.complete(e.port, harness.prompt_ids(8, seed=seed), 1)  # under a block: stores nothing
        time.sleep(0.2)


def hashes(events: list[dict]) -> list:
    return [h for e in events for h in e["block_hashes"]]


def test_kvtier_blocks_in_both_engines_streams_stored_evicted_cleared(vllm_python: Path, tiny_model: Path,
                                                                      logdir: Path):
    port, http, feed, replay, events_a, events_b = (harness.free_port() for _ in range(6))
    with harness.start_kvtier(port, http, 0.25, ["--events-endpoint", f"tcp://127.0.0.1:{feed}",
                                                 "--events-replay-endpoint", f"tcp://127.0.0.1:{replay}"],
                              python=vllm_python, logdir=logdir):
        stream_a = Stream(vllm_python, events_a, logdir, "a")
        stream_b = Stream(vllm_python, events_b, logdir, "b")
        with stream_a.proc, stream_b.proc, engine(vllm_python, tiny_model, port, events_a, logdir, "vllm-a") as a:
            first = harness.prompt_ids(4 * BLOCK + 40, seed=11)  # 4 whole blocks: 2 kvtier chunks
            harness.complete(a.port, first, 4)
            until("A's GPU blocks and kvtier's", lambda: len(gpu_blocks(stream_a, first)) == 4
                  and len(hashes(stream_a.kvtier("BlockStored"))) == 4, [a])
            hashes_first = gpu_blocks(stream_a, first)
            assert hashes(stream_a.kvtier("BlockStored")) == hashes_first  # the engine's own hashes of the blocks
            with engine(vllm_python, tiny_model, port, events_b, logdir, "vllm-b") as b:
                # B came after the store: it learns the first prompt's blocks from a snapshot of the server
                until("the first prompt's blocks in B's stream",
                      lambda: len(hashes(stream_b.kvtier("BlockStored"))) == 4, [a, b])
                # a second prompt, sent to A only, reaches B through the live feed
                second = harness.prompt_ids(4 * BLOCK + 40, seed=12)
                harness.complete(a.port, second, 4)
                until("the second prompt's blocks in both streams", lambda: len(gpu_blocks(stream_a, second)) == 4
                      and all(len(hashes(s.kvtier("BlockStored"))) == 8 for s in (stream_a, stream_b)), [a, b])
                both = hashes_first + gpu_blocks(stream_a, second)
                for stream in (stream_a, stream_b):
                    stored = stream.kvtier("BlockStored")
                    assert hashes(stored) == both
                    assert [t for e in stored for t in e["token_ids"]] == first[: 4 * BLOCK] + second[: 4 * BLOCK]
                    assert {(e["medium"], e["block_size"], e["locality"]) for e in stored} == {("CPU", BLOCK, "LOCAL")}
                    assert stored[0]["parent_block_hash"] is None
                assert not set(both) & set(hashes(stream_b.events(type="BlockStored", ownership=None)))

                # an L1 shrink to half of what the four chunks take evicts two: BlockRemoved in both streams
                l1 = harness.kvtier_status(http)["l1"]
                assert l1["entries"] == 4
                harness.http_json(http, "/reconfigure", {"l1_size_bytes": l1["used_bytes"] // 2})
                until("an eviction in both streams", lambda: all(
                    len(hashes(s.kvtier("BlockRemoved"))) == 4 for s in (stream_a, stream_b)), [a, b])
                assert harness.kvtier_status(http)["l1"]["entries"] == 2
                evicted = set(hashes(stream_a.kvtier("BlockRemoved")))
                assert evicted < set(both) and evicted == set(hashes(stream_b.kvtier("BlockRemoved")))

                # an admin clear removes the rest; never AllBlocksCleared (routers would drop the GPU blocks too)
                harness.http_json(http, "/cache/clear", {"scope": "all"})
                until("the clear in both streams", lambda: all(
                    set(hashes(s.kvtier("BlockRemoved"))) == set(both) for s in (stream_a, stream_b)), [a, b])
                for stream in (stream_a, stream_b):
                    assert {e["medium"] for e in stream.kvtier("BlockRemoved")} == {"CPU"}
                    assert not stream.events(type="AllBlocksCleared")


def gpu_blocks(stream: Stream, prompt: list[int]) -> list:
    """The engine's own hashes of the prompt's 4 whole blocks, from its GPU BlockStored events, in prompt order
    ([] until all four were seen)."""
    blocks = [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(4)]
    found = {}
    for e in stream.events(type="BlockStored", ownership=None):
        for i, h in enumerate(e["block_hashes"]):
            tokens = e["token_ids"][i * BLOCK:(i + 1) * BLOCK]
            if tokens in blocks:
                found[blocks.index(tokens)] = h
    return [found[i] for i in range(4)] if len(found) == 4 else []
