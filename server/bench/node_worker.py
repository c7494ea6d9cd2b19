"""One engine-like client process of `kvtier bench node` (node.py starts N of them).

It replays what the kvtier connector sends for each request of a prefix-repetition workload, through the real
KVTierClient: a lookup of the prompt with a lease (the scheduler), then either the hit path (acquire the looked-up
blocks, copy them into a stand-in paged KV cache, release: the worker's load, `read_prefix`) or the miss path,
then the release of the lookup's lease (sent without waiting, as the scheduler does) and the store of the chunks
not served (reserve, copy into the pages, commit: the worker's save). Against the echo server it sends the same
sequence of request frames, built from the same keys, and waits for their echoes: the transport's ceiling.

Commands arrive on stdin as JSON lines and every answer is one JSON line on stdout:
  {"cmd": "prepare"}                      heartbeat (re-register if the server dropped this idle client)
  {"cmd": "warm"}                         store every shared prefix once
  {"cmd": "run", "target": "kvtier"|"echo", "seconds": s, "max_requests": n}
  {"cmd": "quit"}
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zmq
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.connector.kv_blocks import PagedKV
from kvtier.connector.results import L1_TIER, ReadChunk
from kvtier.server import protocol as p
from kvtier.server.keys import ChunkKeys, Namespace, chunk_keys

OPS = ("lookup", "acquire", "release", "reserve", "commit")
BIN_RATIO = 1.02  # latency histogram: bins 2% wide from 1 us (p50/p99 within 1%)
BIN_LOG = math.log(BIN_RATIO)
TINY_MODEL = {"layers": 4, "kv_heads": 2, "head_size": 64, "dtype_bytes": 2}  # tests/e2e/tiny_model.py


@dataclass
class WorkerSpec:
    index: int
    url: str
    echo_url: str
    block_tokens: int = 128
    chunk_tokens: int = 256
    prefix_tokens: int = 2000
    suffix_tokens: int = 100
    prefixes: int = 32
    fresh: float = 0.1  # fraction of requests that bring a prefix never seen before (the miss path)
    copy: bool = True
    seed: int = 0


@dataclass
class Histogram:
    """Latencies in log-spaced bins (sparse), mergeable across processes."""

    bins: dict[int, int] = field(default_factory=dict)

    def add(self, seconds: float) -> None:
        b = max(0, int(math.log(max(seconds, 1e-6) / 1e-6) / BIN_LOG))
        self.bins[b] = self.bins.get(b, 0) + 1

    def merge(self, other: dict[int | str, int]) -> None:
        for b, n in other.items():
            self.bins[int(b)] = self.bins.get(int(b), 0) + n

    @property
    def count(self) -> int:
        return sum(self.bins.values())

    def percentile_us(self, q: float) -> float:
        """The q-th percentile in microseconds (the geometric middle of its bin); 0.0 when empty."""
        total = self.count
        if not total:
            return 0.0
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= q / 100 * total:
                return BIN_RATIO ** (b + 0.5)
        return 0.0


@dataclass
class RunResult:
    requests: int = 0
    hits: int = 0  # requests whose lookup found the prefix (the hit path)
    elapsed_s: float = 0.0
    ops: dict[str, int] = field(default_factory=dict)  # every request sent, by op (non-waited releases too)
    latency: dict[str, dict[int, int]] = field(default_factory=dict)  # waited round trips, by op
    errors: int = 0
    stores: dict[str, int] = field(default_factory=dict)  # chunks by store outcome: stored, existing, busy, refused


def namespace(block_tokens: int, chunk_tokens: int) -> Namespace:
    """vLLM's CPU build serving the project's tiny model (bf16, 4 layers, 2 KV heads of 64)."""
    m = TINY_MODEL
    return Namespace(model="kvtier-bench-node-tiny-llama", dtype="bfloat16", num_layers=m["layers"],
                     kv_heads=m["kv_heads"], head_size=m["head_size"], block_size=block_tokens,
                     layout=f"vllm-cpu-paged-b{block_tokens}", chunk_size=chunk_tokens)


class TimedClient(KVTierClient):
    """KVTierClient that counts every request it sends and times every one it waits for, by op."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.run = RunResult()

    def submit(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None) -> Any:
        op = str(message.get("op"))
        self.run.ops[op] = self.run.ops.get(op, 0) + 1
        return super().submit(message, ns, timeout_s)

    def _exchange(self, message: dict[str, Any], ns: Namespace | None = None, timeout_s: float | None = None) -> Any:
        started = time.perf_counter()
        got = super()._exchange(message, ns, timeout_s)
        hist = self.run.latency.setdefault(str(message.get("op")), {})
        Histogram(hist).add(time.perf_counter() - started)
        return got


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.ns = namespace(spec.block_tokens, spec.chunk_tokens)
        self.client = TimedClient(ClientConfig(url=spec.url, strict=True, request_timeout_s=10.0,
                                               instance=f"bench-node-{spec.index}"))
        self.client.connect()
        self.fp = self.client._ns_id(self.ns)  # the fingerprint the client sends (the echo frames carry it)
        shared = np.random.default_rng(spec.seed)  # every worker draws the same shared prefixes
        self.prefixes = [shared.integers(0, 1 << 31, spec.prefix_tokens, dtype=np.int64) for _ in range(spec.prefixes)]
        self.rng = np.random.default_rng(spec.seed + 1 + spec.index)
        m = TINY_MODEL
        block_bytes = 2 * m["kv_heads"] * m["head_size"] * m["dtype_bytes"] * spec.block_tokens  # K and V
        blocks = (spec.prefix_tokens + spec.suffix_tokens) // spec.block_tokens + 1
        self.kv = PagedKV([np.zeros((blocks, block_bytes), np.uint8) for _ in range(m["layers"])])
        self.block_ids = list(range(blocks))
        self.echo = zmq.Context.instance().socket(zmq.DEALER)
        self.echo.setsockopt(zmq.LINGER, 0)
        self.echo.connect(spec.echo_url)
        self._echo_id = 0

    # -- the workload --------------------------------------------------------------------------------

    def _prompt(self, prefix: int | None = None) -> tuple[np.ndarray, bool]:
        """A prompt: a shared prefix (or, with probability `fresh`, a new one) and a unique suffix."""
        s = self.spec
        fresh = prefix is None and self.rng.random() < s.fresh
        if fresh:
            head = self.rng.integers(0, 1 << 31, s.prefix_tokens, dtype=np.int64)
        else:
            head = self.prefixes[int(self.rng.integers(s.prefixes)) if prefix is None else prefix]
        return np.concatenate([head, self.rng.integers(0, 1 << 31, s.suffix_tokens, dtype=np.int64)]), fresh

    def _keys(self, tokens: np.ndarray) -> tuple[list[ChunkKeys], list[ChunkKeys]]:
        """(what the scheduler looks up: all but the last token's block, what the worker stores: whole blocks)."""
        bt = self.spec.block_tokens
        limit, whole = (len(tokens) - 1) // bt * bt, len(tokens) // bt * bt
        stored = chunk_keys(self.ns, tokens[:whole])
        return (stored if limit == whole else chunk_keys(self.ns, tokens[:limit])), stored

    def kvtier_request(self, prefix: int | None = None) -> None:
        tokens, _ = self._prompt(prefix)
        looked, stored = self._keys(tokens)
        c, bt = self.client, self.spec.block_tokens
        found = c.lookup_chunks(self.ns, looked, lease=True)
        in_l1 = sum(m for m, t in zip(found.matches, found.tiers, strict=True) if t == L1_TIER)
        if in_l1:
            self.client.run.hits += 1
            c.retrieve_chunks(self.ns, found.hits[: len(found.matches)], self._read)
        if found.lease:
            c.release([found.lease], wait=False)  # the scheduler's release, batched with the next step's
        skip = in_l1 * bt // self.spec.chunk_tokens
        if skip < len(stored):
            res = c.store_chunks(self.ns, stored[skip:], lambda ck: self.kv.chunk_bytes(len(ck.block_keys)),
                                 self._write)
            tally = c.run.stores
            for name, n in (("stored", res.stored), ("existing", res.existing), ("busy", res.busy),
                            *((f"refused_{why}", k) for why, k in res.refused.items())):
                tally[name] = tally.get(name, 0) + n

    def _read(self, chunk: ReadChunk) -> None:
        if self.spec.copy:
            base = chunk.chunk.start_token // self.spec.block_tokens
            self.kv.load(chunk.span, chunk.blocks, 0, self.block_ids[base: base + chunk.match])

    def _write(self, chunk: ChunkKeys, span: Any) -> None:
        if self.spec.copy:
            first = chunk.start_token // self.spec.block_tokens
            self.kv.save(span, self.block_ids[first: first + len(chunk.block_keys)])

    def echo_request(self, run: RunResult) -> None:
        """The same request frames as `kvtier_request` (a hit when the prefix is shared), echoed."""
        tokens, fresh = self._prompt()
        looked, stored = self._keys(tokens)
        bt, ct = self.spec.block_tokens, self.spec.chunk_tokens
        self._echo(run, {"op": "lookup", "chunks": [ck.block_keys for ck in looked], "lease": True, "ns": self.fp})
        hit = 0 if fresh else min(self.spec.prefix_tokens // bt, sum(len(ck.block_keys) for ck in looked))
        if hit:
            run.hits += 1
            keys, left = [], hit
            for ck in looked:
                if left <= 0:
                    break
                keys.append(ck.block_keys[min(left, len(ck.block_keys)) - 1])
                left -= len(ck.block_keys)
            self._echo(run, {"op": "acquire", "keys": keys, "ns": self.fp})
            self._echo(run, {"op": "release", "leases": [1 << 50]})
            self._echo(run, {"op": "release", "leases": [1 << 50]}, wait=False)
        todo = stored[hit * bt // ct:]
        if todo:
            size = self.kv.chunk_bytes
            items = [p.StoreItem(ck.key, size(len(ck.block_keys)), len(ck.block_keys), ck.aliases, b"", ck.parent)
                     for ck in todo]
            self._echo(run, {"op": "reserve", "items": [i.to_wire() for i in items], "ns": self.fp})
            self._echo(run, {"op": "commit", "res": [(1 << 50) + i for i in range(len(todo))]})

    def _echo(self, run: RunResult, message: dict[str, Any], wait: bool = True) -> None:
        """One round trip as the transport does it: pack, send, poll, recv until the reply with our id."""
        op = message["op"]
        run.ops[op] = run.ops.get(op, 0) + 1
        self._echo_id += 1
        message["id"] = rid = self._echo_id
        started = time.perf_counter()
        self.echo.send(p.pack(message))
        while wait:
            if not self.echo.poll(5000):
                raise RuntimeError("echo timed out")
            if p.unpack_reply(self.echo.recv()).get("id") == rid:  # else: a non-waited request's echo
                Histogram(run.latency.setdefault(op, {})).add(time.perf_counter() - started)
                return

    # -- commands ------------------------------------------------------------------------------------

    def warm(self) -> dict[str, Any]:
        for i in range(self.spec.prefixes):
            self.kvtier_request(i)
        return {"warmed": self.spec.prefixes}

    def run(self, target: str, seconds: float, max_requests: int) -> dict[str, Any]:
        run = self.client.run = RunResult()
        one: Callable[[], None] = self.kvtier_request if target == "kvtier" else lambda: self.echo_request(run)
        started = time.perf_counter()
        end = started + seconds
        while run.requests < max_requests and time.perf_counter() < end:
            try:
                one()
            except Exception as exc:  # counted: a bench that hides errors measures nothing
                run.errors += 1
                print(f"worker {self.spec.index}: {type(exc).__name__}: {exc}", file=sys.stderr)
                if run.errors > 100:
                    break
            run.requests += 1
        run.elapsed_s = time.perf_counter() - started
        return asdict(run)


def main() -> int:
    worker = Worker(WorkerSpec(**json.loads(sys.argv[1])))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "prepare":
            out: dict[str, Any] = {"alive": worker.client.heartbeat()}
        elif cmd["cmd"] == "warm":
            out = worker.warm()
        else:
            out = worker.run(cmd["target"], float(cmd["seconds"]), int(cmd.get("max_requests", 1 << 40)))
        print(json.dumps(out), flush=True)
    worker.client.close()
    worker.echo.close(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
