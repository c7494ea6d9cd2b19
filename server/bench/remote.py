"""`kvtier bench remote`: the remote tier (server/tiers/remote/) against the raw glide client on the same
payloads, the same store and the same run; and, with `--redis-pid`, L1 hits and stores of a server whose
Redis is SIGSTOPped against a server without a remote tier.

It starts no Redis: `--remote-url` names a running one (standalone or Cluster), and every key it writes is
under a prefix of its own, removed at the end.

* throughput (`--chunk-mib`, default 4 and 32): chunks of that size through `RemoteTier` as the write-behind
  and promotion threads call it: SET = `prepare` (1 MiB parts, XXH3-128 of the payload) + `put` (EXISTS, the
  parts in one non-atomic batch, the header and alias keys with NX, all with a TTL); GET = `get` (the header,
  each part straight into the destination buffer, sizes and checksum verified). The raw baseline moves the
  same bytes in the same 1 MiB parts with the same glide-sync client: one non-atomic batch of SETs (from
  memoryviews, with the TTL) per chunk, one buffer GET per part. The two sides alternate chunk by chunk
  (which goes first alternating too), each chunk timed; a first rep warms the store up and is not counted;
  every byte read is compared with what was written (outside the timing). "SET, write-behind": the same
  chunks through the server's own write path (L2Writer: `prepare` on its first stage, `put` on two I/O
  threads), timed from the first submit until it is idle, against the raw SETs of the group one after the
  other (which goes first alternating by rep).
* latency (remote_latency.py, with `--redis-pid`): two kvtier servers started here, one with `--remote-url`
  and one without; per iteration a new prompt is stored and then read as an L1 hit (lookup + acquire + copy
  out + release, KVTierClient) on each, alternating which goes first: with Redis running; with `--redis-pid`
  (the redis-server behind `--remote-url`, checked against its INFO) SIGSTOPped, at once (the write-behind's
  calls time out, the breaker still closed) and again once the breaker opened; then Redis is resumed.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import numpy as np
from kvtier.server.bench import common as bc

MiB = 1 << 20
BLOCKS = 16  # engine blocks per chunk (a 256-token chunk of 16-token blocks): 15 alias keys per header
TTL_MS = 600_000
OPS = {"set": "SET", "get": "GET", "set_writer": "SET, write-behind"}  # the rows, and their titles
PINGS = 20  # the RTT reported: the median PING of a connected client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote-url", required=True,
                        help="a running Redis/Valkey: redis://host:port[/db], redis+cluster://h:p,h:p,...")
    parser.add_argument("--chunk-mib", default="4,32", help="chunk sizes in MiB, comma-separated (default 4,32)")
    parser.add_argument("--total-mib", type=float, default=128.0,
                        help="bytes per chunk size, side and rep, in MiB (default 128; at least one chunk)")
    parser.add_argument("--reps", type=int, default=4, help="repetitions, alternating which side goes first")
    parser.add_argument("--redis-pid", type=int, default=0,
                        help="pid of the (local, standalone) redis-server behind --remote-url: also measure L1 hits "
                             "and stores while it is SIGSTOPped, against a server without remote (0: skip)")
    parser.add_argument("--prompts", type=int, default=40, help="latency: prompts per phase (default 40)")
    parser.add_argument("--latency-chunk-kib", type=int, default=1024, help="latency: chunk size (default 1024)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


# -- the raw baseline ------------------------------------------------------------------------------------------


def raw_client(url: str) -> Any:
    """A glide-sync client of `url` (credentials, TLS, db as the tier's), generous timeouts."""
    import glide_sync as glide
    from kvtier.server.config import parse_remote_url

    u = parse_remote_url(url)
    nodes = [glide.NodeAddress(h, p) for h, p in u.nodes]
    creds = glide.ServerCredentials(u.password, u.username or None) if u.password else None
    common = dict(use_tls=u.tls, credentials=creds, request_timeout=30_000)
    if u.cluster:
        return glide.GlideClusterClient.create(glide.GlideClusterClientConfiguration(nodes, **common))
    return glide.GlideClient.create(glide.GlideClientConfiguration(nodes, database_id=u.db or None, **common))


def server_info(client: Any, cluster: bool) -> dict[str, str]:
    """INFO server of one node, as a dict."""
    import glide_sync as glide

    reply = client.custom_command(["INFO", "server"], route=glide.RandomNode()) if cluster else \
        client.custom_command(["INFO", "server"])
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line)


def check_pid(url: str, pid: int) -> None:
    """Refuse to stop a process that is not the Redis behind `url` (its INFO's process_id)."""
    client = raw_client(url)
    try:
        found = server_info(client, cluster=False).get("process_id", "")
    finally:
        client.close()
    if found != str(pid):
        raise SystemExit(f"--redis-pid {pid} is not the server of --remote-url (its process_id is {found})")


class Raw:
    """The baseline: a chunk as PART_BYTES values under one hash tag, SET in one non-atomic batch, each GET
    into the caller's buffer."""

    def __init__(self, client: Any, cluster: bool, prefix: str, part: int) -> None:
        import glide_sync as glide

        self.glide, self.client, self.cluster, self.prefix, self.part = glide, client, cluster, prefix, part
        self.expiry = glide.ExpirySet(glide.ExpiryType.MILLSEC, TTL_MS)

    def keys(self, chunk: bytes, size: int) -> list[str]:
        return [f"{self.prefix}:raw:{{{chunk.hex()}}}:{i}" for i in range(-(-size // self.part))]

    def set(self, chunk: bytes, data: memoryview) -> None:
        g = self.glide
        batch = g.ClusterBatch(is_atomic=False) if self.cluster else g.Batch(is_atomic=False)
        for i, key in enumerate(self.keys(chunk, len(data))):
            batch.set(key, data[i * self.part:(i + 1) * self.part], expiry=self.expiry)
        results = self.client.exec(batch, raise_on_error=True)
        if results is None or len(results) != -(-len(data) // self.part):
            raise RuntimeError(f"raw SET batch answered {results!r}")

    def get(self, chunk: bytes, out: memoryview) -> None:
        for i, key in enumerate(self.keys(chunk, len(out))):
            target = out[i * self.part:(i + 1) * self.part]
            got = self.client.get(key, buffer=target)
            if got is None or int(got) != len(target):
                raise RuntimeError(f"raw GET of {key} answered {got!r}")

    def delete(self, chunk: bytes, size: int) -> None:
        self.client.unlink(self.keys(chunk, size))


# -- throughput ------------------------------------------------------------------------------------------------


class TierSide:
    """RemoteTier as the write-behind and promotion threads call it, in Raw's shape."""

    def __init__(self, tier: Any) -> None:
        self.tier = tier

    def set(self, meta: Any, data: memoryview) -> None:
        if not self.tier.put(meta, self.tier.prepare(meta, [data])):
            raise RuntimeError(f"the tier's put failed: {self.tier.stats()}")

    def get(self, meta: Any, out: memoryview) -> None:
        if not self.tier.get(meta, [out]):
            raise RuntimeError(f"the tier's get failed: {self.tier.stats()}")


def _new_metas(n: int, size: int) -> list[Any]:
    from kvtier.server.tiers.record import ChunkMeta

    ns = os.urandom(16)
    return [ChunkMeta(os.urandom(16), ns, BLOCKS, tuple(os.urandom(16) for _ in range(BLOCKS - 1)), size)
            for _ in range(n)]


def _write_behind(writer: Any, metas: list[Any], views: list[memoryview]) -> float:
    """Seconds to write `metas` through the server's write-behind (L2Writer: a prepare stage, then the puts on
    its I/O threads), from the first submit until it is idle."""
    from kvtier.server.tiers.writer import WriteJob

    done = writer.done
    t0 = time.perf_counter()
    for meta, view in zip(metas, views, strict=True):
        if not writer.submit(WriteJob(meta, lambda view=view: [view], lambda: None)):
            raise RuntimeError("the write-behind queue is full")
    if not writer.wait_idle(600):
        raise RuntimeError("the write-behind did not finish")
    took = time.perf_counter() - t0
    if writer.done - done != len(metas):
        raise RuntimeError(f"the write-behind wrote {writer.done - done} of {len(metas)} chunks: {writer.tier.stats()}")
    return took


def _size_row(tier: TierSide, writer: Any, raw: Raw, size: int, n: int, reps: int,
              rng: np.random.Generator) -> dict[str, Any]:
    """n chunks of `size` bytes, each SET then GET through both sides, `reps` times (after a warm-up); then
    SET through the write-behind against the raw client, the whole group each, which goes first alternating."""
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    views = [memoryview(src[i * size:(i + 1) * size]) for i in range(n)]
    outs = [memoryview(dst[i * size:(i + 1) * size]) for i in range(n)]
    sides = {"tier": tier, "raw": raw}
    seconds = {(side, op): 0.0 for side in sides for op in ("set", "get", "set_writer")}
    for rep in range(-1, reps):  # rep -1: a warm-up, not counted (the store allocates its memory)
        items = {"tier": _new_metas(n, size), "raw": [os.urandom(16) for _ in range(n)]}
        for op in ("set", "get"):
            for i in range(n):  # chunk by chunk, both sides, which goes first alternating
                for side in ("tier", "raw") if (i + rep) % 2 == 0 else ("raw", "tier"):
                    if op == "get":
                        dst[i * size:(i + 1) * size] = 0
                    t0 = time.perf_counter()
                    getattr(sides[side], op)(items[side][i], views[i] if op == "set" else outs[i])
                    if rep >= 0:
                        seconds[side, op] += time.perf_counter() - t0
                    if op == "get" and not np.array_equal(dst[i * size:(i + 1) * size], src[i * size:(i + 1) * size]):
                        raise RuntimeError(f"{side} GET of a {size} B chunk returned other bytes")
        metas, chunks = _new_metas(n, size), [os.urandom(16) for _ in range(n)]
        for side in ("tier", "raw") if rep % 2 == 0 else ("raw", "tier"):
            t0 = time.perf_counter()
            if side == "tier":
                took = _write_behind(writer, metas, views)
            else:
                for chunk, view in zip(chunks, views, strict=True):
                    raw.set(chunk, view)
                took = time.perf_counter() - t0
            if rep >= 0:
                seconds[side, "set_writer"] += took
        tier.tier.clear(None)
        for chunk in items["raw"] + chunks:
            raw.delete(chunk, size)
    row: dict[str, Any] = {"chunks": n, "chunk_bytes": size, "parts": -(-size // raw.part)}
    for op in ("set", "get", "set_writer"):
        t, r = bc.gbps(n * size * reps, seconds["tier", op]), bc.gbps(n * size * reps, seconds["raw", op])
        row[op] = {"tier_gbps": t, "raw_gbps": r, "ratio": t / r if r else 0.0}
    return row


def bench_throughput(url: str, sizes: list[int], total: int, reps: int) -> dict[str, Any]:
    """Per chunk size: SET and GET GB/s through RemoteTier and through the raw client (see the docstring)."""
    from kvtier.server.config import parse_remote_url
    from kvtier.server.tiers.remote.layout import PART_BYTES
    from kvtier.server.tiers.remote.tier import RemoteTier
    from kvtier.server.tiers.writer import L2Writer

    cluster = parse_remote_url(url).cluster
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    tier = RemoteTier(url, prefix=prefix, ttl_s=TTL_MS / 1000)
    client = raw_client(url)
    raw = Raw(client, cluster, prefix, PART_BYTES)
    writer = L2Writer(tier, max(1, total // min(sizes)))
    writer.start()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"server": server_info(client, cluster), "part_bytes": PART_BYTES, "prefix": prefix}
    try:
        tier.scan()  # as the server does at start: the slot map, a first bandwidth
        pings = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            client.ping()
            pings.append(time.perf_counter() - t0)
        out["rtt_us"] = bc.percentiles(pings)["p50_us"]
        out["sizes"] = {str(size // MiB if size % MiB == 0 else size / MiB):
                        _size_row(TierSide(tier), writer, raw, size, max(1, total // size), reps, rng)
                        for size in sizes}
    finally:
        writer.stop()
        tier.clear(None)
        tier.close()
        client.close()
    return out


# -- entry point -----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from kvtier.server.config import parse_remote_url

    sizes = [round(float(s) * MiB) for s in args.chunk_mib.split(",") if s.strip()]
    total = round(args.total_mib * MiB)
    if not sizes or min(sizes) < 1 or total < 1 or args.reps < 1 or args.prompts < 1:
        raise SystemExit("--chunk-mib, --total-mib, --reps and --prompts must be positive")
    url = parse_remote_url(args.remote_url)
    if args.redis_pid:
        if url.cluster:
            raise SystemExit("--redis-pid needs a standalone --remote-url (the server it stops)")
        check_pid(args.remote_url, args.redis_pid)
    tp = bench_throughput(args.remote_url, sizes, total, args.reps)
    result: dict[str, Any] = {"bench": "remote", "machine": bc.machine(), "remote_url": url.redacted(),
                              "reps": args.reps, "throughput": tp}
    first = next(iter(tp["sizes"].values()))
    result["figure"] = {"name": f"remote tier GET GB/s, {first['chunk_bytes'] / MiB:g} MiB chunks in 1 MiB parts",
                        "value": first["get"]["tier_gbps"]}
    result["baseline"] = {"name": "raw glide-sync buffer GETs of the same parts, same run",
                          "value": first["get"]["raw_gbps"]}
    result["ratio"] = first["get"]["ratio"]
    result["ratios"] = {f"{op}_{name}MiB": row[op]["ratio"] for name, row in tp["sizes"].items() for op in OPS}
    if args.redis_pid:
        from kvtier.server.bench.remote_latency import bench_latency

        lat = bench_latency(args.remote_url, args.redis_pid, args.prompts, args.latency_chunk_kib * 1024)
        result["latency"] = lat
        result["ratios"].update({f"{k}_vs_no_remote_p50": v for k, v in lat["ratios"].items()})
    bc.emit(result, args.json, _text(result))
    return 0


def _text(r: dict[str, Any]) -> str:
    tp = r["throughput"]
    srv = tp["server"]
    name = srv.get("server_name", "redis")
    version = srv.get("valkey_version") or srv.get("redis_version", "?")
    lines = [f"kvtier bench remote: {r['remote_url']} ({name} {version}), {tp['part_bytes'] // MiB} MiB parts, "
             f"{r['reps']} reps, RTT {tp['rtt_us']:.0f} us. GB/s = 1e9 B/s of payload.",
             f"  {'chunk':>8} {'op':>18} {'chunks':>7} {'tier GB/s':>10} {'raw GB/s':>10} {'ratio':>7}"]
    for name, row in tp["sizes"].items():
        for op, title in OPS.items():
            x = row[op]
            lines.append(f"  {name + ' MiB':>8} {title:>18} {row['chunks']:>7} {x['tier_gbps']:10.2f} "
                         f"{x['raw_gbps']:10.2f} {x['ratio']:6.2f}x")
    lines.append(f"FIGURE   {r['figure']['name']}: {r['figure']['value']:.2f} GB/s")
    lines.append(f"BASELINE {r['baseline']['name']}: {r['baseline']['value']:.2f} GB/s")
    lines.append("RATIO    " + ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items() if "MiB" in k)
                 + " (goal >= 0.8x)")
    if "latency" in r:
        from kvtier.server.bench.remote_latency import text

        lines.append(text(r["latency"]))
    return "\n".join(lines)
