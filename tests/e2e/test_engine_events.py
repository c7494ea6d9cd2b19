"""kvtier's blocks in each engine's own KV-event stream (connector/vllm/engine_events.py, docs/events.md), with
two real vLLM engines sharing one kvtier server, each publishing its KV events with `--kv-events-config`
(ZeroMQ) and running the connector with `"engine_events": true`. The events are decoded by vLLM's own msgspec
structs (`KVEventBatch`, tests/e2e/kv_events_sub.py, in vLLM's python).

A prompt sent to engine A only: A's stream shows kvtier's `BlockStored` (medium CPU, ownership kvtier) with the
prompt's token ids and the very block hashes of A's own GPU `BlockStored` of those blocks; B's stream shows the
same blocks as loadable, though B never saw the prompt. An L1 shrink evicts one of the prompt's two chunks:
`BlockRemoved` of its blocks in both streams; an admin clear removes the other: `BlockRemoved` again, never
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
    port, http, feed, events_a, events_b = (harness.free_port() for _ in range(5))
    with harness.start_kvtier(port, http, 0.25, ["--events-endpoint", f"tcp://127.0.0.1:{feed}"],
                              python=vllm_python, logdir=logdir):
        stream_a = Stream(vllm_python, events_a, logdir, "a")
        stream_b = Stream(vllm_python, events_b, logdir, "b")
        with stream_a.proc, stream_b.proc, \
                engine(vllm_python, tiny_model, port, events_a, logdir, "vllm-a") as a, \
                engine(vllm_python, tiny_model, port, events_b, logdir, "vllm-b") as b:
            prompt = harness.prompt_ids(4 * BLOCK + 40, seed=11)  # 4 whole blocks: 2 kvtier chunks
            harness.complete(a.port, prompt, 4)

            blocks = [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(4)]

            def gpu_blocks() -> list:
                """A's own hashes of the prompt's blocks, from its GPU BlockStored events, in prompt order."""
                found = {}
                for e in stream_a.events(type="BlockStored", ownership=None):
                    for i, h in enumerate(e["block_hashes"]):
                        tokens = e["token_ids"][i * BLOCK:(i + 1) * BLOCK]
                        if tokens in blocks:
                            found[blocks.index(tokens)] = h
                return [found[i] for i in range(4)] if len(found) == 4 else []

            until("A's GPU blocks and kvtier's blocks in both streams",
                  lambda: len(gpu_blocks()) == 4 and len(hashes(stream_a.kvtier("BlockStored"))) >= 4
                  and len(hashes(stream_b.kvtier("BlockStored"))) >= 4, [a, b])
            engine_hashes = gpu_blocks()
            for stream in (stream_a, stream_b):
                stored = stream.kvtier("BlockStored")
                assert hashes(stored) == engine_hashes  # the engine's own hashes of the prompt's blocks
                assert [t for e in stored for t in e["token_ids"]] == prompt[: 4 * BLOCK]
                assert {(e["medium"], e["block_size"], e["locality"]) for e in stored} == {("CPU", BLOCK, "LOCAL")}
                assert stored[0]["parent_block_hash"] is None
            assert not set(engine_hashes) & set(hashes(stream_b.events(type="BlockStored", ownership=None)))

            # an L1 shrink to half of what the two chunks take evicts one: BlockRemoved of its blocks in both streams
            l1 = harness.kvtier_status(http)["l1"]
            assert l1["entries"] == 2
            harness.http_json(http, "/reconfigure", {"l1_size_bytes": l1["used_bytes"] // 2})
            until("an eviction in both streams", lambda: stream_a.kvtier("BlockRemoved")
                  and stream_b.kvtier("BlockRemoved"), [a, b])
            assert harness.kvtier_status(http)["l1"]["entries"] == 1
            evicted = set(hashes(stream_a.kvtier("BlockRemoved")))
            assert len(evicted) == 2 and evicted <= set(engine_hashes)
            assert evicted == set(hashes(stream_b.kvtier("BlockRemoved")))

            # an admin clear removes the rest; never AllBlocksCleared (routers would drop the GPU blocks too)
            harness.http_json(http, "/cache/clear", {"scope": "all"})
            until("the clear in both streams", lambda: all(
                set(hashes(s.kvtier("BlockRemoved"))) == set(engine_hashes) for s in (stream_a, stream_b)), [a, b])
            for stream in (stream_a, stream_b):
                assert {e["medium"] for e in stream.kvtier("BlockRemoved")} == {"CPU"}
                assert not stream.events(type="AllBlocksCleared")
