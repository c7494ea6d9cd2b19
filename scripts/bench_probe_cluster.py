"""A lookup's probe on a Redis Cluster behind delaying proxies: this code against an older commit's, same run.
A manual bench (it reconfigures the Cluster it is given), not a CI test.

    bash scripts/redis_env.sh cluster /tmp/cl P1 P2 P3
    .venv/bin/python scripts/bench_probe_cluster.py --ports P1,P2,P3 --rtt-ms 5 [--old 7405638]

One delay proxy (server/bench/delay_proxy.py, a process each) per master; each master's
`cluster-announce-port` is set to its proxy's (the bus port kept), so clients follow the proxies; both are
reset at the end. A writer stores 12 one-block chunks through the proxies; then `--trials` times, a fresh
reader (its probe thread's client connected first) runs `find_prefix` on the 12-chunk run from its first
call until it answers, with this tree's `RemoteTier._get_many` and with `--old`'s (loaded from git),
alternating which goes first. Prints the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from kvtier.server.bench.delay_proxy import spawn
from kvtier.server.tiers.record import ChunkMeta
from kvtier.server.tiers.remote.tier import RemoteTier

REPO = Path(__file__).resolve().parent.parent
CHUNKS = 12
GOSSIP_S = 3.0


def _cli(port: int, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def _old_get_many(commit: str) -> types.FunctionType:
    source = subprocess.run(["git", "show", f"{commit}:server/tiers/redis.py"], capture_output=True, text=True,
                            check=True, cwd=REPO).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(source)
    spec = importlib.util.spec_from_file_location("kvtier_old_redis", fh.name)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["kvtier_old_redis"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    os.unlink(fh.name)
    return module.RemoteTier._get_many


def _lookup_s(url: str, prefix: str, metas: list[ChunkMeta], get_many: types.FunctionType | None) -> float:
    reader = RemoteTier(url, prefix=prefix)
    try:
        reader.scan()
        if get_many is not None:
            reader._get_many = types.MethodType(get_many, reader)  # type: ignore[method-assign]
        reader.find_prefix([[os.urandom(16)]], metas[0].ns)  # the probe thread's client connects
        time.sleep(0.3)
        chunks = [[*m.aliases, m.key] for m in metas]
        t0 = time.perf_counter()
        while (found := reader.find_prefix(chunks, metas[0].ns)) is None:
            time.sleep(0.0005)
        took = time.perf_counter() - t0
        if len(found) != len(metas):
            raise RuntimeError(f"the lookup found {len(found)} of {len(metas)} chunks: {reader.stats()}")
        return took
    finally:
        reader.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", required=True, help="the Cluster's master ports on 127.0.0.1, comma-separated")
    parser.add_argument("--rtt-ms", type=float, default=5.0, help="round trip each proxy adds (default 5)")
    parser.add_argument("--old", default="7405638", help="the commit to compare with (default 7405638)")
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    old = _old_get_many(args.old)
    prefix = f"kvtier-probe-bench-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(spawn("127.0.0.1", p, args.rtt_ms / 1000)) for p in ports]
        try:
            for port, proxy in zip(ports, proxies, strict=True):
                _cli(port, "CONFIG", "SET", "cluster-announce-bus-port", str(port + 10000))
                _cli(port, "CONFIG", "SET", "cluster-announce-port", str(proxy))
            time.sleep(GOSSIP_S)
            url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in proxies)
            writer = RemoteTier(url, prefix=prefix)
            writer.scan()
            ns = os.urandom(16)
            metas = [ChunkMeta(os.urandom(16), ns, 4, tuple(os.urandom(16) for _ in range(3)), 1000)
                     for _ in range(CHUNKS)]
            for meta in metas:
                if not writer.put(meta, os.urandom(meta.size)):
                    raise RuntimeError(f"the writer's put failed: {writer.stats()}")
            masters = len({writer._node_of(m.key) for m in metas})
            times: dict[str, list[float]] = {"new": [], "old": []}
            for trial in range(args.trials):
                for side in ("new", "old") if trial % 2 else ("old", "new"):
                    times[side].append(_lookup_s(url, prefix, metas, old if side == "old" else None))
            writer.clear(None)
            writer.close()
        finally:
            for port in ports:
                _cli(port, "CONFIG", "SET", "cluster-announce-port", "0")
                _cli(port, "CONFIG", "SET", "cluster-announce-bus-port", "0")
    print(f"lookup of {CHUNKS} chunks on {masters} masters, +{args.rtt_ms:g} ms per proxy, {args.trials} trials: "
          + ", ".join(f"{side} ({'this tree' if side == 'new' else args.old}) median "
                      f"{statistics.median(xs) * 1000:.1f} ms" for side, xs in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
