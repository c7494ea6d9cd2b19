"""`kvtier bench lookup`: the lookup round trip through KVTierClient against a bare ZeroMQ DEALER/ROUTER +
msgpack echo of the same request frame between two processes, measured in the same run, interleaved; the
lookup latency and the server's RSS as the index grows from 10^3 to 10^6 stored chunks; and the idle RSS
and startup time of a server started with the defaults.

The query is a 65,536-token prompt in a vLLM-CPU-like namespace (engine block 128, chunk 256): 256 chunks
whose block keys make 512 keys per lookup, all stored (a full hit, the server's worst case: every chunk is
probed). The index is filled with 1-page chunks of another namespace through reserve/commit batches of up
to 65,536 items (1 KiB pages so that 10^6 entries fit a sparse 1 GiB segment that nobody touches).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from kvtier.server.bench import common as bc

MiB = 1 << 20
LEVELS = (1_000, 10_000, 100_000, 1_000_000)
BATCH = 16384  # reserve/commit accept up to 65,536 items; smaller batches keep each RPC short


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=int, default=512, help="keys per lookup (default 512: 256 chunks x 2 blocks)")
    parser.add_argument("--iters", type=int, default=1000, help="timed round trips per method and level (default 1000)")
    parser.add_argument("--max-entries", type=int, default=1_000_000,
                        help="fill the index up to this many chunks (levels 10^3..10^6 below it; default 10^6)")
    parser.add_argument("--url", default="", help="use a running server (no fill levels, no RSS)")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle-server RSS / startup measurement")
    parser.add_argument("--plot", default="", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--stalled-subscriber", action="store_true",
                        help="start the server with the event feed (--events-endpoint) and a subscriber that never "
                             "reads: what a stalled feed consumer costs a lookup")


# -- the echo baseline -----------------------------------------------------------------------------

ECHO_SYNC = """
import sys, zmq, msgpack
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1]); print("ready", flush=True)
while True:
    ident, frame = s.recv_multipart()
    s.send_multipart([ident, msgpack.packb(msgpack.unpackb(frame, raw=False), use_bin_type=True)])
"""

ECHO_UVLOOP = """
import sys, zmq, zmq.asyncio, msgpack, uvloop
async def main():
    ctx = zmq.asyncio.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.LINGER, 0)
    s.bind(sys.argv[1]); print("ready", flush=True)
    while True:
        ident, frame = await s.recv_multipart()
        await s.send_multipart([ident, msgpack.packb(msgpack.unpackb(frame, raw=False), use_bin_type=True)])
uvloop.run(main())
"""


class Echo:
    """An echo process (plain blocking pyzmq, or zmq.asyncio under uvloop like the daemon) and a DEALER."""

    def __init__(self, code: str) -> None:
        import zmq

        url = f"tcp://127.0.0.1:{bc.free_port()}"
        self.proc = subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("echo process failed to start")
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self._id = 0

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """One round trip done like KVTierClient._call: pack, send, poll, recv, unpack."""
        from kvtier.server import protocol as p

        self._id += 1
        message["id"] = self._id
        self.sock.send(p.pack(message))
        if not self.sock.poll(5000):
            raise RuntimeError("echo timed out")
        return p.unpack_reply(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)
        self.proc.kill()
        self.proc.wait()


# -- measurements ----------------------------------------------------------------------------------


def _timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def measure(methods: dict[str, Any], iters: int, rounds: int = 10) -> dict[str, dict[str, float]]:
    """Round trips of every method, interleaved in `rounds` blocks so that machine noise hits all alike."""
    for fn in methods.values():  # warm-up
        _timed(fn, max(5, iters // 20))
    samples: dict[str, list[float]] = {name: [] for name in methods}
    per = max(1, iters // rounds)
    for _ in range(rounds):
        for name, fn in methods.items():
            samples[name] += _timed(fn, per)
    return {name: bc.percentiles(s) for name, s in samples.items()}


def idle_server() -> dict[str, Any]:
    """A server with the defaults (--l1-size-gb 1, admin API on) and one without the admin API."""
    out: dict[str, Any] = {}
    for name, http in (("defaults", bc.free_port()), ("no_admin_api", 0)):
        server = bc.start_server(1.0, http_port=http)
        try:
            time.sleep(1.0)  # let start-up garbage settle; the loop is idle now
            out[name] = {"startup_s": server.startup_s, **bc.memory(server.pid)}
        finally:
            server.stop()
    return out


def run(args: argparse.Namespace) -> int:
    from kvtier.server.keys import Namespace, chunk_keys

    if args.keys < 2 or args.keys % 2:
        raise SystemExit("--keys must be a positive even number (2 block keys per chunk)")
    idle = None if args.no_idle else idle_server()
    levels = [n for n in LEVELS if n <= args.max_entries] or [args.max_entries]
    top = max(levels)
    page_kb = 2  # one page per chunk: MIN_BLOCK_BYTES per block of the 2-block chunks
    l1_gb = max(0.01, (top + 2 * args.keys) * page_kb * 1024 / (1 << 30) * 1.01)
    ns = Namespace(model="kvtier-bench-lookup", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
                   block_size=128, layout="cpu-bench", chunk_size=256)
    filler = Namespace(model="kvtier-bench-filler", dtype="bfloat16", num_layers=1, kv_heads=1, head_size=1,
                       block_size=256, layout="filler", chunk_size=256)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1 << 31, args.keys // 2 * 256, dtype=np.int64)
    miss_tokens = rng.integers(0, 1 << 31, len(tokens), dtype=np.int64)
    chunks = chunk_keys(ns, tokens)
    miss_chunks = chunk_keys(ns, miss_tokens)
    nkeys = sum(len(c.block_keys) for c in chunks)

    rows: list[dict[str, Any]] = []
    echo_sync, echo_uv = Echo(ECHO_SYNC), Echo(ECHO_UVLOOP)
    try:
        state = _levels(args, levels, l1_gb, page_kb, ns, filler, tokens, chunks, miss_chunks, nkeys,
                        echo_sync, echo_uv, rows, rng)
    finally:
        echo_sync.close()
        echo_uv.close()
    request_bytes, fill_s, rss0 = state
    result = _result(args, rows, nkeys, chunks, request_bytes, fill_s, rss0, idle)
    if args.plot:
        _plot(result, args.plot)
        result["plot"] = args.plot
    bc.emit(result, args.json, _text(result))
    return 0


@contextlib.contextmanager
def _stalled(on: bool, address: str) -> Iterator[None]:
    """A SUB on the server's event feed that never reads (its 10-message queue fills at once), held open."""
    if not on:
        yield
        return
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 10)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(address)
    try:
        yield
    finally:
        sub.close(linger=0)
        ctx.term()


def _levels(args, levels, l1_gb, page_kb, ns, filler, tokens, chunks, miss_chunks, nkeys,  # noqa: ANN001
            echo_sync, echo_uv, rows, rng) -> tuple[int, float, dict[str, int]]:  # noqa: ANN001
    """Fill the index level by level and measure every method at each level (rows appended)."""
    from kvtier.connector.client import ClientConfig, KVTierClient
    from kvtier.server import protocol as p
    from kvtier.server.keys import ChunkKeys

    feed = f"ipc://{tempfile.gettempdir()}/kvtier-bench-lookup-feed-{os.getpid()}"
    extra = ["--page-size-kb", str(page_kb), "--eviction-policy", "lru"]
    with bc.server_or_url(args.url or None, l1_gb, extra + (["--events-endpoint", feed] if args.stalled_subscriber
                                                            else [])) as server, _stalled(args.stalled_subscriber, feed):
        client = KVTierClient(ClientConfig(url=args.url or server.url, strict=True, request_timeout_s=120.0))
        client.connect()
        fp = client._ns_id(ns)  # the same frame the client sends, for the echo
        frame = {"op": "lookup", "chunks": [list(c.block_keys) for c in chunks], "ns": fp}
        res = client.store_chunks(ns, chunks, lambda c: 1, lambda c, s: None)
        if res.stored + res.existing != len(chunks):
            raise RuntimeError(f"could not store the query prompt: {res}")
        if client.lookup_chunks(ns, chunks).blocks != nkeys:
            raise RuntimeError("the query prompt is not a full hit")
        rss0 = bc.memory(server.pid) if server else {}
        entries0 = client.stats()["entries"]
        methods = {
            "kvtier_lookup": lambda: client.lookup_chunks(ns, chunks),
            "echo_sync": lambda: echo_sync.call(dict(frame)),
            "echo_uvloop": lambda: echo_uv.call(dict(frame)),
            "kvtier_lookup_with_hashing": lambda: client.lookup(ns, tokens),
            "kvtier_lookup_miss": lambda: client.lookup_chunks(ns, miss_chunks),
        }
        request_bytes = len(p.pack({**frame, "id": 1}))
        entries = entries0
        fill_s = 0.0
        for level in levels:
            if server is not None:
                t = time.perf_counter()
                while entries < level:
                    n = min(BATCH, level - entries)
                    raw = rng.bytes(16 * n)
                    batch = [ChunkKeys(0, 0, 1, (raw[i : i + 16],)) for i in range(0, 16 * n, 16)]
                    r = client.store_chunks(filler, batch, lambda c: 1, lambda c, s: None)
                    if r.stored == 0:
                        raise RuntimeError(f"fill stored 0 of {n}: {r} (server stats {client.stats()})")
                    entries += r.stored
                fill_s += time.perf_counter() - t
            stats = client.stats()
            lat = measure(methods, args.iters)
            row = {"entries": stats["entries"], "index_keys": stats["index_keys"], "latency": lat,
                   "ratio_p50": lat["kvtier_lookup"]["p50_us"] / lat["echo_sync"]["p50_us"],
                   "ratio_p50_uvloop_echo": lat["kvtier_lookup"]["p50_us"] / lat["echo_uvloop"]["p50_us"]}
            if server is not None:
                mem = bc.memory(server.pid)
                row["rss"] = mem
                added = stats["entries"] - entries0
                row["rss_bytes_per_entry"] = (mem["VmRSS"] - rss0["VmRSS"]) / added if added > 0 else None
            rows.append(row)
            if args.url:
                break
        client.close()
    return request_bytes, fill_s, rss0


def _result(args, rows, nkeys, chunks, request_bytes, fill_s, rss0, idle) -> dict[str, Any]:  # noqa: ANN001
    first, last = rows[0], rows[-1]
    result: dict[str, Any] = {
        "bench": "lookup",
        "machine": bc.machine(),
        "keys_per_lookup": nkeys,
        "chunks_per_lookup": len(chunks),
        "request_bytes": request_bytes,
        "levels": rows,
        "fill_seconds": fill_s,
        "rss_before_fill": rss0,
        "idle": idle,
        "stalled_subscriber": args.stalled_subscriber,
        "figure": {"name": f"kvtier lookup p50 us ({nkeys} keys, full hit, {first['entries']} entries)",
                   "value": first["latency"]["kvtier_lookup"]["p50_us"]},
        "baseline": {"name": f"bare ZeroMQ DEALER/ROUTER + msgpack echo p50 us of the same {request_bytes}-byte "
                             "request (two processes, same run, interleaved)",
                     "value": first["latency"]["echo_sync"]["p50_us"]},
        "flatness": {"p50_us": {r["entries"]: r["latency"]["kvtier_lookup"]["p50_us"] for r in rows},
                     "p50_last_over_first": last["latency"]["kvtier_lookup"]["p50_us"]
                     / first["latency"]["kvtier_lookup"]["p50_us"]},
    }
    result["ratio"] = result["figure"]["value"] / result["baseline"]["value"]
    if len(rows) > 1 and "rss" in last and "rss" in rows[-2]:
        d = last["entries"] - rows[-2]["entries"]
        result["rss_bytes_per_entry_marginal"] = (last["rss"]["VmRSS"] - rows[-2]["rss"]["VmRSS"]) / d
    if idle:
        result["idle_figure"] = {"name": "idle server VmRSS MiB, defaults (--l1-size-gb 1, admin API on)",
                                 "value": idle["defaults"]["VmRSS"] / MiB, "goal": 150}
    return result


def _text(r: dict[str, Any]) -> str:
    lines = [f"kvtier bench lookup: {r['keys_per_lookup']} keys ({r['chunks_per_lookup']} chunks) per lookup, "
             f"request frame {r['request_bytes']} bytes; round trips in us"]
    lines.append(f"{'entries':>9}{'index keys':>11}  {'lookup p50':>10}{'p99':>8}  {'echo p50':>9}{'p99':>8}  "
                 f"{'uvloop echo p50':>15}  {'w/ hashing p50':>14}  {'miss p50':>8}  {'ratio':>6}  "
                 f"{'RSS MiB':>8}{'B/entry':>8}")
    for row in r["levels"]:
        lat = row["latency"]
        rss = row.get("rss", {}).get("VmRSS", 0) / MiB
        bpe = row.get("rss_bytes_per_entry") or 0
        lines.append(
            f"{row['entries']:>9}{row['index_keys']:>11}  {lat['kvtier_lookup']['p50_us']:10.0f}"
            f"{lat['kvtier_lookup']['p99_us']:8.0f}  {lat['echo_sync']['p50_us']:9.0f}{lat['echo_sync']['p99_us']:8.0f}"
            f"  {lat['echo_uvloop']['p50_us']:15.0f}  {lat['kvtier_lookup_with_hashing']['p50_us']:14.0f}"
            f"  {lat['kvtier_lookup_miss']['p50_us']:8.0f}  {row['ratio_p50']:5.2f}x  {rss:8.1f}{bpe:8.0f}")
    if "rss_bytes_per_entry_marginal" in r:
        lines.append(f"marginal RSS per entry between the last two levels: {r['rss_bytes_per_entry_marginal']:.0f} B "
                     f"(fill took {r['fill_seconds']:.1f} s)")
    lines.append(f"\nFIGURE   {r['figure']['name']}: {r['figure']['value']:.0f} us")
    lines.append(f"BASELINE {r['baseline']['name']}: {r['baseline']['value']:.0f} us")
    lines.append(f"RATIO    {r['ratio']:.2f}x (goal <= 1.5x)")
    lines.append(f"FLAT     p50 at {r['levels'][-1]['entries']} entries / p50 at {r['levels'][0]['entries']}: "
                 f"{r['flatness']['p50_last_over_first']:.2f}x")
    if r.get("idle"):
        for name, m in r["idle"].items():
            lines.append(f"IDLE     {name}: VmRSS {m['VmRSS'] / MiB:.1f} MiB (anon {m['RssAnon'] / MiB:.1f}, file "
                         f"{m['RssFile'] / MiB:.1f}, shmem {m['RssShmem'] / MiB:.1f}), PSS {m.get('Pss', 0) / MiB:.1f} "
                         f"MiB, {m['Threads']} threads, ready after {m['startup_s']:.2f} s (goal <= 150 MiB)")
    return "\n".join(lines)


def _plot(r: dict[str, Any], path: str) -> None:
    plt = bc.plotting(path)
    if plt is None:
        return
    xs = [row["entries"] for row in r["levels"]]
    idle = r.get("idle")
    if idle:
        fig, (ax, ax_idle) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
        _plot_idle(ax_idle, idle)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, label, style in (("kvtier_lookup", "kvtier lookup (client)", "o-"),
                               ("echo_sync", "bare ZMQ+msgpack echo", "s--"),
                               ("echo_uvloop", "echo under uvloop (zmq.asyncio)", "^:"),
                               ("kvtier_lookup_miss", "kvtier lookup, miss", "x-.")):
        ax.plot(xs, [row["latency"][name]["p50_us"] for row in r["levels"]], style, label=f"{label} p50")
    ax.plot(xs, [row["latency"]["kvtier_lookup"]["p99_us"] for row in r["levels"]], "o-", alpha=0.4,
            label="kvtier lookup p99")
    ax.set_xscale("log")
    ax.set_xlabel("stored chunks (entries)")
    ax.set_ylabel(f"round trip, us ({r['keys_per_lookup']} keys per lookup)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if all("rss" in row for row in r["levels"]):
        ax2 = ax.twinx()
        ax2.plot(xs, [row["rss"]["VmRSS"] / MiB for row in r["levels"]], "k*-", alpha=0.5, label="server RSS")
        ax2.set_ylabel("server VmRSS, MiB")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("kvtier lookup vs a bare ZeroMQ+msgpack echo, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_idle(ax: Any, idle: dict[str, Any]) -> None:
    """Idle server RSS per configuration against the 150 MiB goal."""
    names = list(idle)
    parts = (("RssAnon", "anon"), ("RssFile", "file"), ("RssShmem", "shmem"))
    bottom = [0.0] * len(names)
    for key, label in parts:
        vals = [idle[n].get(key, 0) / MiB for n in names]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, n in enumerate(names):
        ax.text(i, bottom[i] + 2, f"{idle[n]['VmRSS'] / MiB:.0f} MiB\nready {idle[n]['startup_s']:.2f} s",
                ha="center", fontsize=8)
    ax.axhline(150, color="red", linestyle="--", label="goal 150 MiB")
    ax.set_ylabel("idle server VmRSS, MiB")
    ax.set_ylim(0, 170)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("idle server, --l1-size-gb 1", fontsize=10)
