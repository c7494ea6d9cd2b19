"""The harness router (kv_router.py) over two kvtier nodes routes by the engines' KV events (issue 30, Done-when 3;
the figures are tests/e2e/bench_router.py's, docs/performance.md).

* Engine events only: a document's repeat goes to the node whose events showed the document, with its leading
  blocks matched (token-id prompts and a text prompt tokenized by the router).
* kvtier events too (`engine_events`): after the document left that engine's GPU cache (evicted by other
  documents), the node's stream still shows it in medium CPU (kvtier's L1); the repeat goes there and the engine
  loads it from kvtier.
"""

from __future__ import annotations

import time
from pathlib import Path

import harness
import pytest
from bench_router import BLOCK, start_cluster

pytestmark = pytest.mark.e2e

DOC = 1920  # 15 blocks
TEXT = " ".join(f"word{i} alpha beta gamma" for i in range(100))  # 1,434 tokens of the tiny model: 11 blocks


def complete_text(port: int, text: str) -> None:
    harness.http_json(port, "/v1/completions", {"model": harness.SERVED_MODEL_NAME, "prompt": text,
                                                "max_tokens": 2, "temperature": 0.0})


def last_decision(port: int) -> dict:
    return harness.http_json(port, "/router/stats")["decisions"][-1]


def wait_match(port: int, prompt: list[int] | str, node: str, medium: str, blocks: int,
               timeout: float = 30.0, gone: str = "") -> dict:
    """The router's /router/match for `prompt` once `node` holds its `blocks` leading blocks in `medium` (and,
    with `gone`, none in that medium: events arrive asynchronously, an engine's removals after its eviction)."""
    deadline = time.monotonic() + timeout
    while True:
        m = harness.http_json(port, "/router/match", {"prompt": prompt})
        if m[node].get(medium, 0) >= blocks and not (gone and m[node].get(gone, 0)):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the router never saw {blocks} {medium} blocks of the prompt on {node}"
                                 f"{f' and none in {gone}' if gone else ''}: {m}")
        time.sleep(0.2)


def first_ask(port: int, seed: int) -> tuple[list[int], list[int] | str, dict]:
    """A new document's first question through the router: (document, greedy output, the router's decision)."""
    doc = harness.prompt_ids(DOC, seed=seed)
    out, _ = harness.complete(port, doc + harness.prompt_ids(40, seed=1), 8)
    d = last_decision(port)
    assert d["matched_blocks"] == 0, d
    return doc, out, d


def test_repeat_goes_to_the_node_whose_engine_events_show_the_prefix(tiny_model: Path, vllm_python: Path,
                                                                    logdir: Path) -> None:
    with start_cluster("prefix", False, vllm_python, tiny_model, logdir, "smoke") as cluster:
        port = cluster.router.port
        doc, _, first = first_ask(port, 3001)
        wait_match(port, doc, first["node"], "GPU", DOC // BLOCK)
        for q in (2, 3):
            harness.complete(port, doc + harness.prompt_ids(40, seed=q), 2)
            d = last_decision(port)
            assert d["node"] == first["node"] and d["matched_blocks"] == DOC // BLOCK, d

        # a text prompt: the router tokenizes it with the model's tokenizer, as vLLM does
        complete_text(port, TEXT)
        text_first = last_decision(port)
        blocks = text_first["prompt_blocks"]
        assert blocks == 11, text_first
        wait_match(port, TEXT, text_first["node"], "GPU", blocks)
        complete_text(port, TEXT + " and one more question")
        d = last_decision(port)
        assert d["node"] == text_first["node"] and d["matched_blocks"] == blocks, d


def test_repeat_follows_kvtier_events_after_the_engine_evicted_it(tiny_model: Path, vllm_python: Path,
                                                                 logdir: Path) -> None:
    with start_cluster("prefix", True, vllm_python, tiny_model, logdir, "smokekv") as cluster:
        port = cluster.router.port
        doc, expected, first = first_ask(port, 3002)
        holder = first["node"]
        vllm = next(v for _, v in cluster.nodes if holder.endswith(f":{v.port}"))
        for s in range(3):  # other documents straight to the holder: its 33-block GPU cache drops the first
            harness.complete(vllm.port, harness.prompt_ids(DOC, seed=4000 + s), 1)
        # the engine's own view loses it (its removal events may come a moment after the requests): only
        # kvtier's events keep it
        wait_match(port, doc, holder, "CPU", DOC // BLOCK, gone="GPU")
        before = harness.metric(harness.metrics(vllm.port), "vllm:prompt_tokens_by_source_total",
                                source="external_kv_transfer")
        out, _ = harness.complete(port, doc + harness.prompt_ids(40, seed=1), 8)
        d = last_decision(port)
        loaded = harness.metric(harness.metrics(vllm.port), "vllm:prompt_tokens_by_source_total",
                                source="external_kv_transfer") - before
        assert d["node"] == holder and d["matched_blocks"] == DOC // BLOCK, d
        assert loaded >= DOC - BLOCK, loaded
        assert out == expected
