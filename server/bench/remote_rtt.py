"""`kvtier bench remote-rtt`: remote reads through the tier against a raw pipelined glide client of the same
payloads, at added round trips (`--rtt-ms`, default 0,1,5) from a delaying TCP proxy of the bench's own
(delay_proxy.py, a process of its own) between the readers and a standalone Redis/Valkey (netem stands in
for a network where it is available; it is not here).

Per chunk size (`--chunk-mib`), `n` chunks are written once per RTT, straight to the store: through a writer
`RemoteTier` (the tier's keys) and, the same bytes, with the raw client (1 MiB parts under one hash tag, one
batch per chunk). Then, through the proxy, chunk by chunk and in turn (the order rotating):

* **tier**: `RemoteTier.get` of a reader that found the chunk with a lookup first (`find_prefix`, whose probe
  read its header: as in the server, where a promotion follows the lookup that found the chunk; the lookup
  is not timed, the raw side has none);
* **tier, not looked up**: `get` of another reader that never probed it (one more round trip: the header,
  then the parts) — a chunk this node wrote itself and no longer holds, or a lookup's answer forgotten;
* **raw**: one non-atomic batch of every part's GET, each value copied into the destination (glide's batch
  returns bytes; the tier's reads land in the destination too).

Every byte read is compared with what was written (outside the timing); the first rep is not counted. The
added RTT reported is the median PING through the proxy minus the direct one. Starts no Redis; its keys are
under a prefix of its own, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import numpy as np
from kvtier.server.bench import common as bc
from kvtier.server.bench.delay_proxy import spawn
from kvtier.server.bench.remote import TTL_MS, MiB, _new_metas, raw_client, server_info

SIDES = ("tier", "tier_cold", "raw")
TITLES = {"tier": "tier", "tier_cold": "tier, not looked up", "raw": "raw batch"}
PINGS = 20
LOOKUP_WAIT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--remote-url", required=True, help="a running standalone Redis/Valkey: redis://host:port")
    parser.add_argument("--rtt-ms", default="0,1,5", help="round trips added by the proxy, ms (default 0,1,5)")
    parser.add_argument("--chunk-mib", default="4,32", help="chunk sizes in MiB, comma-separated (default 4,32)")
    parser.add_argument("--total-mib", type=float, default=64.0,
                        help="bytes per chunk size, side and rep, in MiB (default 64; at least one chunk)")
    parser.add_argument("--reps", type=int, default=3, help="counted repetitions (after one warm-up rep)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def proxied(url: str, port: int) -> str:
    """`url` with its host:port replaced by the proxy's (scheme, credentials and database kept)."""
    scheme, _, rest = url.partition("://")
    creds, at, hosts = rest.rpartition("@")
    _, slash, db = hosts.partition("/")
    return f"{scheme}://{creds}{at}127.0.0.1:{port}{slash}{db}"


def ping_s(client: Any, n: int = PINGS) -> float:
    """The median round trip of `n` PINGs on a connected client (one PING first connects it)."""
    client.ping()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.ping()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


class RawReader:
    """The baseline: a chunk's parts (as remote.Raw writes them) in one non-atomic batch of GETs."""

    def __init__(self, client: Any, prefix: str, part: int) -> None:
        import glide_sync as glide

        self.glide, self.client, self.prefix, self.part = glide, client, prefix, part

    def keys(self, chunk: bytes, size: int) -> list[str]:
        return [f"{self.prefix}:raw:{{{chunk.hex()}}}:{i}" for i in range(-(-size // self.part))]

    def set(self, chunk: bytes, data: memoryview) -> None:
        batch = self.glide.Batch(is_atomic=False)
        expiry = self.glide.ExpirySet(self.glide.ExpiryType.MILLSEC, TTL_MS)
        for i, key in enumerate(self.keys(chunk, len(data))):
            batch.set(key, data[i * self.part:(i + 1) * self.part], expiry=expiry)
        self.client.exec(batch, raise_on_error=True)

    def get(self, chunk: bytes, out: memoryview) -> None:
        batch = self.glide.Batch(is_atomic=False)
        for key in self.keys(chunk, len(out)):
            batch.get(key)
        values = self.client.exec(batch, raise_on_error=True) or []
        if len(values) != -(-len(out) // self.part):
            raise RuntimeError(f"raw batch answered {len(values)} values")
        for i, value in enumerate(values):
            out[i * self.part:(i + 1) * self.part] = value


def _looked_up(tier: Any, metas: list[Any]) -> None:
    """find_prefix on each chunk until it is found (its probe read the header)."""
    deadline = time.monotonic() + LOOKUP_WAIT_S
    for meta in metas:
        while not tier.find_prefix([[*meta.aliases, meta.key]], meta.ns):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the reader's lookup did not find a chunk: {tier.stats()}")
            time.sleep(0.002)


def _size_row(url: str, direct: Any, proxy_url: str, prefix: str, size: int, n: int, reps: int,
              rng: np.random.Generator) -> dict[str, Any]:
    from kvtier.server.tiers.remote.layout import PART_BYTES
    from kvtier.server.tiers.remote.tier import RemoteTier

    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    out = memoryview(dst)
    views = [memoryview(src[i * size:(i + 1) * size]) for i in range(n)]
    seconds = dict.fromkeys(SIDES, 0.0)
    raw_direct = RawReader(direct, prefix, PART_BYTES)
    client = raw_client(proxy_url)
    raw = RawReader(client, prefix, PART_BYTES)
    tiers = {side: RemoteTier(u, prefix=prefix, ttl_s=TTL_MS / 1000)
             for side, u in (("writer", url), ("tier", proxy_url), ("tier_cold", proxy_url))}
    try:
        for tier in tiers.values():
            tier.scan()  # as the server does at start: a first bandwidth, which sizes the reads' MGETs
        for rep in range(-1, reps):  # rep -1: a warm-up, not counted
            metas, chunks = _new_metas(n, size), [os.urandom(16) for _ in range(n)]
            for meta, chunk, view in zip(metas, chunks, views, strict=True):
                if not tiers["writer"].put(meta, tiers["writer"].prepare(meta, [view])):
                    raise RuntimeError(f"the writer's put failed: {tiers['writer'].stats()}")
                raw_direct.set(chunk, view)
            _looked_up(tiers["tier"], metas)
            for i in range(n):
                order = SIDES[(i + rep) % 3:] + SIDES[:(i + rep) % 3]
                for side in order:
                    dst[:] = 0
                    t0 = time.perf_counter()
                    if side == "raw":
                        raw.get(chunks[i], out)
                    elif not tiers[side].get(metas[i], [out]):
                        raise RuntimeError(f"the {side} reader's get failed: {tiers[side].stats()}")
                    if rep >= 0:
                        seconds[side] += time.perf_counter() - t0
                    if not np.array_equal(dst, src[i * size:(i + 1) * size]):
                        raise RuntimeError(f"{side} GET of a {size} B chunk returned other bytes")
            tiers["writer"].clear(None)  # every key under the prefix, the raw ones too
    finally:
        for tier in tiers.values():
            tier.close()
        client.close()
    row: dict[str, Any] = {"chunks": n, "chunk_bytes": size, "parts": -(-size // PART_BYTES)}
    for side in SIDES:
        row[f"{side}_gbps"] = bc.gbps(n * size * reps, seconds[side])
    for side in ("tier", "tier_cold"):
        row[f"{side}_ratio"] = row[f"{side}_gbps"] / row["raw_gbps"] if row["raw_gbps"] else 0.0
    return row


def bench_rtt(url: str, rtts_ms: list[float], sizes: list[int], total: int, reps: int) -> dict[str, Any]:
    import glide_sync as glide
    from kvtier.server.config import parse_remote_url

    glide.Logger.init(glide.LogLevel.ERROR)  # as RemoteTier does, before any client: no warnings on stdout
    u = parse_remote_url(url)
    host, port = u.nodes[0]
    prefix = f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    direct = raw_client(url)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"server": server_info(direct, False), "prefix": prefix, "rtts": {}}
    try:
        direct_ping = ping_s(direct)
        out["direct_rtt_us"] = direct_ping * 1e6
        for rtt in rtts_ms:
            with spawn(host, port, rtt / 1000) as proxy_port:
                proxy_url = proxied(url, proxy_port)
                pinger = raw_client(proxy_url)
                try:
                    added = ping_s(pinger) - direct_ping
                finally:
                    pinger.close()
                rows = {f"{size / MiB:g}": _size_row(url, direct, proxy_url, prefix, size, max(1, total // size),
                                                     reps, rng) for size in sizes}
            out["rtts"][f"{rtt:g}"] = {"added_rtt_us": added * 1e6, "sizes": rows}
    finally:
        direct.close()
    return out


def run(args: argparse.Namespace) -> int:
    from kvtier.server.config import parse_remote_url

    rtts = [float(s) for s in args.rtt_ms.split(",") if s.strip()]
    sizes = [round(float(s) * MiB) for s in args.chunk_mib.split(",") if s.strip()]
    total = round(args.total_mib * MiB)
    if not rtts or min(rtts) < 0 or not sizes or min(sizes) < 1 or total < 1 or args.reps < 1:
        raise SystemExit("--rtt-ms must be >= 0; --chunk-mib, --total-mib and --reps positive")
    url = parse_remote_url(args.remote_url)
    if url.cluster or len(url.nodes) != 1:
        raise SystemExit("--remote-url must be a standalone server (a Cluster redirects clients past the proxy)")
    r = bench_rtt(args.remote_url, rtts, sizes, total, args.reps)
    result: dict[str, Any] = {"bench": "remote-rtt", "machine": bc.machine(), "remote_url": url.redacted(),
                              "reps": args.reps, **r}
    result["ratios"] = {f"get_{rtt}ms_{name}MiB": row["tier_ratio"] for rtt, x in r["rtts"].items()
                        for name, row in x["sizes"].items()}
    worst = min((v, k) for k, v in result["ratios"].items() if not k.startswith("get_0ms"))
    result["figure"] = {"name": "worst tier/raw GET ratio at an added RTT > 0 (" + worst[1] + ")",
                        "value": worst[0]} if any(rtt > 0 for rtt in rtts) else {}
    bc.emit(result, args.json, _text(result))
    return 0


def _text(r: dict[str, Any]) -> str:
    srv = r["server"]
    version = srv.get("valkey_version") or srv.get("redis_version", "?")
    lines = [f"kvtier bench remote-rtt: {r['remote_url']} ({srv.get('server_name', 'redis')} {version}) through a "
             f"delaying proxy, {r['reps']} reps, direct RTT {r['direct_rtt_us']:.0f} us. GB/s = 1e9 B/s of payload.",
             f"  {'RTT +ms':>7} {'measured':>9} {'chunk':>8} {'chunks':>6} {'tier':>7} {'not looked up':>13} "
             f"{'raw batch':>9} {'tier/raw':>8} {'n.l.u./raw':>10}"]
    for rtt, x in r["rtts"].items():
        for name, row in x["sizes"].items():
            lines.append(f"  {rtt:>7} {x['added_rtt_us'] / 1000:7.2f}ms {name + ' MiB':>8} {row['chunks']:>6} "
                         f"{row['tier_gbps']:7.2f} {row['tier_cold_gbps']:13.2f} {row['raw_gbps']:9.2f} "
                         f"{row['tier_ratio']:7.2f}x {row['tier_cold_ratio']:9.2f}x")
    lines.append("RATIO    tier/raw: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
                 + " (goal >= 0.8x at 1 and 5 ms)")
    return "\n".join(lines)
