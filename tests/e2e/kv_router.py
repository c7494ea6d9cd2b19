"""A minimal prefix-aware router over vLLM's KV-event streams (test harness for issue 30, docs/routing.md).

Run with the vLLM venv's python (it decodes with vLLM's own ``KVEventBatch`` and hashes with vLLM's own
``hash_block_tokens``)::

    python tests/e2e/kv_router.py --port 8000 --policy prefix \\
        --node http://127.0.0.1:8101=tcp://127.0.0.1:5601 --node http://127.0.0.1:8102=tcp://127.0.0.1:5602

* One SUB socket per node on the engine's ``--kv-events-config`` endpoint; each batch is decoded as vLLM's
  ``KVEventBatch``. ``BlockStored`` adds (node, medium) holders of each hash, ``BlockRemoved`` drops them,
  ``AllBlocksCleared`` drops the node's GPU entries (the engine reset its prefix cache; blocks announced in
  another medium, e.g. kvtier's ``CPU``, are still loadable).
* A request's block hashes are the engine's: full blocks of its prompt token ids (a text prompt is tokenized
  with ``--tokenizer``), chained by ``hash_block_tokens`` with ``--hash-algo`` from NONE_HASH, so the router
  needs the engines' PYTHONHASHSEED (or none, as they have none) and block size.
* ``prefix``: the node holding the longest run of the prompt's leading blocks (in any medium); on a tie or no
  match the one with the fewest requests in flight, then round robin. ``rr``: round robin.
* HTTP: ``POST /v1/completions`` is forwarded to the chosen node, streamed responses chunk by chunk;
  ``GET /router/stats`` tells each decision (node, matched blocks) and what the index holds per node/medium;
  ``POST /router/match`` with ``{"prompt": ...}`` the prompt's leading blocks each node holds, per medium.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import logging
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
from vllm.distributed.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

log = logging.getLogger("kv_router")
MAX_DECISIONS = 10_000


@dataclass(frozen=True)
class Node:
    url: str  # http://host:port of the engine's OpenAI server
    events: str  # the SUB address of its --kv-events-config endpoint


@dataclass
class BlockIndex:
    """hash -> node -> mediums holding it, from the nodes' KV events."""

    holders: dict[Any, dict[str, set[str]]] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, node: str, batch: KVEventBatch) -> None:
        with self.lock:
            for ev in batch.events:
                self.events[node] += 1
                if isinstance(ev, BlockStored):
                    for h in ev.block_hashes:
                        self.holders.setdefault(h, {}).setdefault(node, set()).add(ev.medium or MEDIUM_GPU)
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        self._drop(h, node, ev.medium or MEDIUM_GPU)
                elif isinstance(ev, AllBlocksCleared):
                    for h in [h for h, nodes in self.holders.items() if node in nodes]:
                        self._drop(h, node, MEDIUM_GPU)

    def _drop(self, h: Any, node: str, medium: str) -> None:
        nodes = self.holders.get(h)
        if nodes is None or node not in nodes:
            return
        nodes[node].discard(medium)
        if not nodes[node]:
            del nodes[node]
        if not nodes:
            del self.holders[h]

    def prefix_blocks(self, node: str, hashes: Sequence[Any], medium: str | None = None) -> int:
        """How many of `hashes`, from the first, `node` holds (in `medium`, or in any)."""
        with self.lock:
            n = 0
            for h in hashes:
                mediums = self.holders.get(h, {}).get(node)
                if not mediums or (medium is not None and medium not in mediums):
                    break
                n += 1
            return n

    def summary(self) -> dict[str, dict[str, int]]:
        with self.lock:
            out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            for nodes in self.holders.values():
                for node, mediums in nodes.items():
                    for m in mediums:
                        out[node][m] += 1
            return {n: dict(m) for n, m in out.items()}


def subscribe(node: Node, index: BlockIndex, stop: threading.Event) -> None:
    """Feed one node's KV-event stream into `index` until `stop` (frames: topic, seq, payload)."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(node.events)
    try:
        while not stop.is_set():
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            try:
                index.apply(node.url, decoder.decode(frames[-1]))
            except msgspec.DecodeError as e:
                log.warning("undecodable KV event batch from %s: %s", node.url, e)
    finally:
        sock.close(linger=0)


class BlockHasher:
    """The engine's block hashes of a prompt: vLLM's function, seed and block size."""

    def __init__(self, algo: str, block_size: int, tokenizer: str | None) -> None:
        self.fn = get_hash_fn_by_name(algo)
        init_none_hash(self.fn)
        self.block_size = block_size
        self.tokenizer = None
        if tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)

    def token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer.encode(prompt)
        return []  # unknown prompt form: routed as a miss

    def hashes(self, tokens: Sequence[int]) -> list[Any]:
        out, parent = [], None
        for i in range(0, len(tokens) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(self.fn, parent, tokens[i:i + self.block_size])
            out.append(maybe_convert_block_hash(parent))
        return out


@dataclass
class Decision:
    node: str
    matched_blocks: int
    prompt_blocks: int


class Router:
    def __init__(self, nodes: Sequence[Node], policy: str, hasher: BlockHasher, index: BlockIndex) -> None:
        self.nodes, self.policy, self.hasher, self.index = list(nodes), policy, hasher, index
        self._rr = itertools.cycle(range(len(self.nodes)))
        self._lock = threading.Lock()
        self.in_flight: dict[str, int] = {n.url: 0 for n in self.nodes}
        self.decisions: list[Decision] = []

    def pick(self, prompt: Any) -> Decision:
        hashes = self.hasher.hashes(self.hasher.token_ids(prompt))
        with self._lock:
            start = next(self._rr)
            order = self.nodes[start:] + self.nodes[:start]  # round robin among equals
            if self.policy == "rr":
                best, matched = order[0], 0
            else:
                scored = [(self.index.prefix_blocks(n.url, hashes), -self.in_flight[n.url], i, n)
                          for i, n in enumerate(order)]
                matched, _, _, best = max(scored, key=lambda s: (s[0], s[1], -s[2]))
            d = Decision(best.url, matched, len(hashes))
            self.in_flight[best.url] += 1
            if len(self.decisions) < MAX_DECISIONS:
                self.decisions.append(d)
            return d

    def match(self, prompt: Any) -> dict[str, dict[str, int]]:
        """Per node, the prompt's leading blocks held in any medium ("any") and in each medium."""
        hashes = self.hasher.hashes(self.hasher.token_ids(prompt))
        mediums = sorted({m for n in self.index.summary().values() for m in n})
        return {n.url: {"any": self.index.prefix_blocks(n.url, hashes),
                        **{m: self.index.prefix_blocks(n.url, hashes, m) for m in mediums}} for n in self.nodes}

    def done(self, d: Decision) -> None:
        with self._lock:
            self.in_flight[d.node] -= 1


def make_handler(router: Router) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # one line per request would flood the log
            pass

        def _json(self, code: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"ok": True})
            elif self.path == "/router/stats":
                self._json(200, {"policy": router.policy,
                                 "decisions": [d.__dict__ for d in router.decisions],
                                 "events": dict(router.index.events), "index": router.index.summary()})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path not in ("/v1/completions", "/router/match"):
                self._json(404, {"error": "not found"})
                return
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                self._json(400, {"error": "body is not JSON"})
                return
            if self.path == "/router/match":
                self._json(200, router.match(body.get("prompt")))
                return
            d = router.pick(body.get("prompt"))
            try:
                self._forward(d.node, raw)
            finally:
                router.done(d)

        def _forward(self, node: str, raw: bytes) -> None:
            u = urlsplit(node)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
            try:
                conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
                self.send_header("X-Routed-To", node)
                self.send_header("Connection", "close")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.close_connection = True
            finally:
                conn.close()

    return Handler


def parse_node(spec: str) -> Node:
    url, _, events = spec.partition("=")
    if not url.startswith("http://") or not events.startswith(("tcp://", "ipc://")):
        raise argparse.ArgumentTypeError(f"--node wants http://HOST:PORT=(tcp|ipc)://ADDRESS, got {spec!r}")
    return Node(url, events)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node", type=parse_node, action="append", required=True)
    p.add_argument("--policy", choices=("prefix", "rr"), default="prefix")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--hash-algo", default="sha256", help="the engines' --prefix-caching-hash-algo")
    p.add_argument("--tokenizer", default=None, help="model directory to tokenize text prompts with")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    index, stop = BlockIndex(), threading.Event()
    for n in a.node:
        threading.Thread(target=subscribe, args=(n, index, stop), daemon=True, name=f"sub-{n.url}").start()
    router = Router(a.node, a.policy, BlockHasher(a.hash_algo, a.block_size, a.tokenizer), index)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), make_handler(router))
    log.info("kv router ready on :%d, policy %s, %d nodes", a.port, a.policy, len(a.node))
    try:
        server.serve_forever()
    finally:
        stop.set()


if __name__ == "__main__":
    main()
