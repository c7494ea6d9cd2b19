"""The event feed's cost to the serving loop: stores and lookups through KVTierClient against a server without
the feed and one with it and a stalled subscriber (a SUB that never reads), interleaved in one run.

    .venv/bin/python scripts/bench_feed.py [ROUNDS] [PROMPTS] [aa]
    .venv/bin/python scripts/bench_feed.py lookup [ROUNDS]

Each round stores PROMPTS new 4-chunk prompts and looks each up once on both servers (alternating which goes
first); prints each round's time per prompt and the ratio of the medians (feed / no feed). `aa`: the second
server without the feed too (the run's noise: the ratio of two equal servers).

`lookup`: `kvtier bench lookup` itself (10^3 and 10^4 chunks stored, 500 lookups per level), ROUNDS times with
and without `--stalled-subscriber`, alternating which goes first; prints the ratio of the medians of the p50
lookup latency at each level (stalled subscriber / no feed).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import zmq
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.keys import Namespace

NS = Namespace(model="bench/feed", dtype="bfloat16", num_layers=1, kv_heads=2, head_size=64, block_size=128,
               layout="cpu", chunk_size=256)
CHUNK_BYTES = 2 * 8192


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port, log = free_port(), tempfile.NamedTemporaryFile(suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.server.cli", "server", "--port", str(port), "--http-port",
                             "0", "--l1-size-gb", "1", "--no-l1-adopt", "--shm-name", f"kvtier-bench-{uuid.uuid4().hex[:8]}",
                             *extra], stdout=log, stderr=subprocess.STDOUT)
    while "kvtier server ready" not in open(log.name).read():  # noqa: SIM115
        if proc.poll() is not None:
            raise SystemExit(open(log.name).read())  # noqa: SIM115
        time.sleep(0.05)
    return proc, f"tcp://127.0.0.1:{port}"


def rounds_of(c: KVTierClient, seed: int, prompts: int) -> float:
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for _ in range(prompts):
        tokens = rng.integers(0, 50_000, 4 * NS.chunk_size)
        c.store(NS, tokens, lambda ch: CHUNK_BYTES, lambda ch, span: span.write(0, np.zeros(CHUNK_BYTES, np.uint8)))
        c.lookup(NS, tokens)
    return (time.perf_counter() - t0) / prompts


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    feed_addr = f"ipc://{tempfile.gettempdir()}/kvtier-bench-feed-{os.getpid()}"
    plain, plain_url = start([])
    fed, fed_url = start([] if sys.argv[3:] == ["aa"] else ["--events-endpoint", feed_addr])
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(feed_addr)  # never read
    clients = {"no feed": KVTierClient(ClientConfig(url=plain_url)), "feed": KVTierClient(ClientConfig(url=fed_url))}
    times: dict[str, list[float]] = {name: [] for name in clients}
    try:
        for r in range(rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))
            for name in order:
                times[name].append(rounds_of(clients[name], 1000 * r + 1, prompts))
        for name, ts in times.items():
            print(f"{name:8} store+lookup per prompt (4 chunks) ms: " + " ".join(f"{t * 1e3:.3f}" for t in ts))
        ratio = statistics.median(times["feed"]) / statistics.median(times["no feed"])
        print(f"ratio of medians feed / no feed: {ratio:.3f}")
    finally:
        for c in clients.values():
            c.close()
        ctx.destroy(linger=0)
        for proc in (plain, fed):
            proc.terminate()
            proc.wait(timeout=30)


def lookup_rounds(rounds: int) -> None:
    base = [sys.executable, "-m", "kvtier.server.cli", "bench", "lookup", "--iters", "500", "--max-entries", "10000",
            "--no-idle", "--json"]
    runs: dict[str, list[dict[int, float]]] = {"no feed": [], "stalled": []}
    for r in range(rounds):
        for name in (["no feed", "stalled"] if r % 2 == 0 else ["stalled", "no feed"]):
            out = subprocess.run(base + (["--stalled-subscriber"] if name == "stalled" else []), check=True,
                                 capture_output=True, text=True, timeout=900)
            levels = json.loads(out.stdout)["levels"]
            runs[name].append({lv["entries"]: lv["latency"]["kvtier_lookup"]["p50_us"] for lv in levels})
    for entries in runs["no feed"][0]:
        per = {name: [run[entries] for run in rs] for name, rs in runs.items()}
        for name, ps in per.items():
            print(f"{entries:>6} chunks {name:8} lookup p50 us: " + " ".join(f"{v:.0f}" for v in ps))
        ratio = statistics.median(per["stalled"]) / statistics.median(per["no feed"])
        print(f"{entries:>6} chunks ratio of medians stalled subscriber / no feed: {ratio:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["lookup"]:
        lookup_rounds(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    else:
        main()
