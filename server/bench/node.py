"""`kvtier bench node`: one real `kvtier server` driven by N engine-like client processes (server/bench/
node_worker.py), against the same N driving a bare ZeroMQ ROUTER + msgpack echo process (bench/lookup.py's echo)
with the same request frames, in the same run, N by N.

Each client replays what the kvtier connector sends per request of a prefix-repetition workload (32 shared
prefixes of 2,000 tokens, a unique 100-token suffix, 1 request in 10 a new prefix): lookup with lease, then
acquire/read/release of the hit blocks (or the miss path), the lookup lease's release (not waited), and
reserve/copy/commit of the chunks not served. The namespace is vLLM's CPU build serving the project's tiny model
(128-token engine blocks, 256-token chunks; `--block-tokens 16` for GPU-like blocks).

Per N: requests/s and operations/s, p50/p99 per operation, and the daemon's CPU seconds per operation (utime +
stime of the server process from /proc, read before and after the phase). From the CPU per operation: the op
rate at which the daemon's one serving loop is CPU-bound, and the node it would serve under a stated engine rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.server.bench import common as bc
from kvtier.server.bench.lookup import ECHO_SYNC
from kvtier.server.bench.node_worker import OPS, Histogram, WorkerSpec

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", default="1,2,4,8,16", help="client process counts N (default 1,2,4,8,16)")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each kvtier phase (default 6)")
    parser.add_argument("--echo-seconds", type=float, default=3.0, help="length of each echo phase (default 3)")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="requests per client and phase at most")
    parser.add_argument("--block-tokens", type=int, default=128, help="engine block tokens (128 vLLM CPU; 16 GPU)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="chunk tokens (default 256)")
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="shared prefix length (default 2000)")
    parser.add_argument("--suffix-tokens", type=int, default=100, help="unique suffix length (default 100)")
    parser.add_argument("--prefixes", type=int, default=32, help="shared prefixes (default 32)")
    parser.add_argument("--fresh", type=float, default=0.1,
                        help="fraction of requests with a never-seen prefix: the miss path (default 0.1)")
    parser.add_argument("--l1-gb", type=float, default=0.5, help="the server's --l1-size-gb (default 0.5)")
    parser.add_argument("--no-copy", action="store_true", help="clients skip the memcpy into/out of L1 pages")
    parser.add_argument("--gpus", type=int, default=8, help="node size assumed for the saturation statement")
    parser.add_argument("--engine-rps", type=float, default=20.0,
                        help="requests/s one GPU engine sends kvtier, assumed for the saturation statement")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


@dataclass
class Phase:
    target: str  # kvtier | echo
    clients: int
    wall_s: float
    cpu_s: float  # of the server (or echo) process over the phase
    requests: int
    hits: int
    errors: int
    ops: dict[str, int]
    stores: dict[str, int]
    latency_us: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def summary(self) -> dict[str, Any]:
        n = self.total_ops
        return {**asdict(self), "requests_per_s": self.requests / self.wall_s, "ops_per_s": n / self.wall_s,
                "ops_per_request": n / self.requests if self.requests else 0.0,
                "cpu_us_per_op": self.cpu_s / n * 1e6 if n else 0.0, "cpu_cores": self.cpu_s / self.wall_s,
                "hit_fraction": self.hits / self.requests if self.requests else 0.0}


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # fields 14 and 15 of proc(5)


class Pool:
    """The client processes, each answering one JSON line per command."""

    def __init__(self, specs: list[WorkerSpec]) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-m", "kvtier.server.bench.node_worker",
                                        json.dumps(asdict(s))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, bufsize=1) for s in specs]
        for proc in self.procs:
            if not json.loads(self._line(proc)).get("ready"):
                raise RuntimeError("a bench client did not start")

    @staticmethod
    def _line(proc: subprocess.Popen) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench client {proc.pid} exited (rc {proc.wait()})")
        return line

    def command(self, n: int, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Send `cmd` to the first n clients at once; their answers."""
        for proc in self.procs[:n]:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        return [json.loads(self._line(proc)) for proc in self.procs[:n]]

    def close(self) -> None:
        for proc in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    proc.stdin.flush()
                proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


def phase(pool: Pool, target: str, n: int, pid: int, seconds: float, max_requests: int) -> Phase:
    pool.command(n, {"cmd": "prepare"})  # an idle client the server dropped says hello again, before the window
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    outs = pool.command(n, {"cmd": "run", "target": target, "seconds": seconds, "max_requests": max_requests})
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    ops: dict[str, int] = {}
    stores: dict[str, int] = {}
    hists = {op: Histogram() for op in OPS}
    for out in outs:
        for op, count in out["ops"].items():
            ops[op] = ops.get(op, 0) + count
        for name, count in out["stores"].items():
            stores[name] = stores.get(name, 0) + count
        for op, bins in out["latency"].items():
            hists.setdefault(op, Histogram()).merge(bins)
    latency = {op: {"p50_us": h.percentile_us(50), "p99_us": h.percentile_us(99), "n": h.count}
               for op, h in hists.items() if h.count}
    return Phase(target, n, wall, cpu, sum(o["requests"] for o in outs), sum(o["hits"] for o in outs),
                 sum(o["errors"] for o in outs), ops, stores, latency)


def start_echo() -> tuple[subprocess.Popen, str]:
    url = f"tcp://127.0.0.1:{bc.free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SYNC, url], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("echo process failed to start")
    return proc, url


def run(args: argparse.Namespace) -> int:
    counts = sorted({int(x) for x in args.clients.split(",") if x.strip()})
    if not counts or counts[0] < 1:
        raise SystemExit("--clients: positive integers, e.g. 1,2,4")
    load0 = os.getloadavg()
    http_port = bc.free_port()
    server = bc.start_server(args.l1_gb, http_port=http_port)  # its defaults, admin API included
    echo, echo_url = start_echo()
    pool = None
    try:
        base = WorkerSpec(0, server.url, echo_url, args.block_tokens, args.chunk_tokens, args.prefix_tokens,
                          args.suffix_tokens, args.prefixes, args.fresh, not args.no_copy)
        pool = Pool([WorkerSpec(**{**asdict(base), "index": i}) for i in range(max(counts))])
        _wait_prefault(server.url)
        pool.command(1, {"cmd": "warm"})  # every shared prefix stored once: the steady state from the start
        rows = []
        for n in counts:
            k = phase(pool, "kvtier", n, server.pid, args.seconds, args.max_requests)
            e = phase(pool, "echo", n, echo.pid, args.echo_seconds, args.max_requests)
            ks, es = k.summary(), e.summary()
            rows.append({"clients": n, "kvtier": ks, "echo": es,
                         "ops_ratio": ks["ops_per_s"] / es["ops_per_s"] if e.total_ops else 0.0,
                         "cpu_ratio": ks["cpu_us_per_op"] / es["cpu_us_per_op"] if e.cpu_s else 0.0})
        rss = bc.memory(server.pid)["VmRSS"]
        counted = server_counts(http_port)
    finally:
        if pool is not None:
            pool.close()
        echo.kill()
        echo.wait()
        server.stop()
    result = _result(args, rows, load0, os.getloadavg(), rss)
    result["server_counted"] = counted
    bc.emit(result, args.json, _text(result) + _counted_text(counted))
    return 0


def server_counts(http_port: int) -> dict[str, Any]:
    """What the server itself counted (its /metrics): requests by op, error replies, evictions."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, Any] = {"requests": {}, "errors": {}, "evictions": 0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("kvtier_requests_total{"):
            out["requests"][re.search(r'op="([^"]*)"', name).group(1)] = int(float(value))  # type: ignore[union-attr]
        elif name.startswith("kvtier_request_errors_total{") and float(value):
            out["errors"][re.search(r'code="([^"]*)"', name).group(1)] = int(float(value))  # type: ignore[union-attr]
        elif name.startswith("kvtier_evictions_total{"):
            out["evictions"] += int(float(value))
    return out


def _wait_prefault(url: str, timeout: float = 60.0) -> None:
    """Wait for the server's L1 prefault thread to finish, so that its CPU is not counted in a phase."""
    from kvtier.connector.client import ClientConfig, KVTierClient

    client = KVTierClient(ClientConfig(url=url, strict=True))
    client.connect()
    end = time.monotonic() + timeout
    while (client.stats() or {}).get("l1_prefault") == "running" and time.monotonic() < end:
        time.sleep(0.1)
    client.close()


def _result(args: argparse.Namespace, rows: list[dict[str, Any]], load0: tuple[float, ...],
            load1: tuple[float, ...], rss: int) -> dict[str, Any]:
    top = max(rows, key=lambda r: r["kvtier"]["ops_per_s"])
    k = top["kvtier"]
    cpu_op = k["cpu_us_per_op"] / 1e6
    ops_req = k["ops_per_request"]
    sat_ops = 1.0 / cpu_op if cpu_op else 0.0
    sat_req = sat_ops / ops_req if ops_req else 0.0
    node_ops = args.gpus * args.engine_rps * ops_req
    return {
        "bench": "node",
        "machine": bc.machine(),
        "loadavg_before": list(load0), "loadavg_after": list(load1),
        "workload": {"block_tokens": args.block_tokens, "chunk_tokens": args.chunk_tokens,
                     "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
                     "prefixes": args.prefixes, "fresh": args.fresh, "copy": not args.no_copy,
                     "l1_gb": args.l1_gb, "seconds": args.seconds, "echo_seconds": args.echo_seconds},
        "rows": rows,
        "server_rss_bytes": rss,
        "saturation": {
            "at_clients": top["clients"], "cpu_us_per_op": k["cpu_us_per_op"], "ops_per_request": ops_req,
            "measured_ops_per_s": k["ops_per_s"], "measured_cpu_cores": k["cpu_cores"],
            "ops_per_s_at_one_core": sat_ops, "requests_per_s_at_one_core": sat_req,
            "assumed_gpus": args.gpus, "assumed_engine_rps": args.engine_rps,
            "node_ops_per_s": node_ops, "node_core_fraction": node_ops * cpu_op,
            "gpus_served": sat_req / args.engine_rps if args.engine_rps else 0.0,
            "cpu_us_per_op_range": [min(r["kvtier"]["cpu_us_per_op"] for r in rows),
                                    max(r["kvtier"]["cpu_us_per_op"] for r in rows)],
        },
        "figure": {"name": f"kvtier ops/s at N={top['clients']}", "value": k["ops_per_s"]},
        "baseline": {"name": f"bare ZeroMQ ROUTER + msgpack echo ops/s, same frames, N={top['clients']}",
                     "value": top["echo"]["ops_per_s"]},
        "ratio": top["ops_ratio"],
    }


def _counted_text(c: dict[str, Any]) -> str:
    ops = ", ".join(f"{op} {c['requests'].get(op, 0)}" for op in OPS)
    errors = ", ".join(f"{n} {code}" for code, n in c["errors"].items()) or "none"
    return (f"\nSERVER      counted {ops}; {c['evictions']} evictions; error replies: {errors} (its /metrics; "
            "not_registered: an idle client the server dropped, registering again before its phase)")


def _text(r: dict[str, Any]) -> str:
    w = r["workload"]
    lines = [f"kvtier bench node: {w['prefixes']} prefixes x {w['prefix_tokens']} tokens + {w['suffix_tokens']}-token "
             f"unique suffixes, {w['fresh']:.0%} new prefixes; blocks {w['block_tokens']}, chunks {w['chunk_tokens']}"
             f", L1 {w['l1_gb']} GiB, copies {'on' if w['copy'] else 'off'}; {r['machine'].get('cpus')} CPUs, "
             f"load average {r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after"]
    head = f"{'N':>3} {'req/s':>7} {'ops/s':>7} {'hit':>4} {'srv cores':>9} {'CPU us/op':>9}  "
    head += "  ".join(f"{op + ' p50/p99 us':>20}" for op in OPS)
    head += f"  {'echo ops/s':>10} {'echo CPU us/op':>14} {'echo lookup p50':>15} {'ops vs echo':>11} {'CPU/op vs echo':>14}"
    lines.append(head)
    for row in r["rows"]:
        k, e = row["kvtier"], row["echo"]
        lat = k["latency_us"]
        cells = [f"{lat[op]['p50_us']:9.0f}/{lat[op]['p99_us']:<10.0f}" if op in lat else f"{'-':>20}" for op in OPS]
        elook = e["latency_us"].get("lookup", {}).get("p50_us", 0.0)
        lines.append(f"{row['clients']:>3} {k['requests_per_s']:7.0f} {k['ops_per_s']:7.0f} {k['hit_fraction']:4.2f} "
                     f"{k['cpu_cores']:9.2f} {k['cpu_us_per_op']:9.1f}  " + "  ".join(cells)
                     + f"  {e['ops_per_s']:10.0f} {e['cpu_us_per_op']:14.1f} {elook:15.0f} {row['ops_ratio']:10.2f}x"
                     f" {row['cpu_ratio']:13.1f}x")
        not_stored = {name: n for name, n in k["stores"].items() if name != "stored" and n}
        if k["errors"] or e["errors"] or not_stored:
            lines.append(f"    errors: kvtier {k['errors']}, echo {e['errors']}; chunks not stored: {not_stored}")
    s = r["saturation"]
    lines.append(
        f"\nSATURATION  at N={s['at_clients']} the daemon spent {s['cpu_us_per_op']:.1f} us CPU per op "
        f"({s['measured_ops_per_s']:.0f} ops/s used {s['measured_cpu_cores']:.2f} cores); one core would serve "
        f"~{s['ops_per_s_at_one_core']:.0f} ops/s = ~{s['requests_per_s_at_one_core']:.0f} requests/s at "
        f"{s['ops_per_request']:.2f} ops per request (CPU per op over all N: {s['cpu_us_per_op_range'][0]:.1f}-"
        f"{s['cpu_us_per_op_range'][1]:.1f} us)")
    lines.append(
        f"NODE        assuming {s['assumed_engine_rps']:.0f} requests/s per GPU engine: {s['assumed_gpus']} GPUs "
        f"send {s['node_ops_per_s']:.0f} ops/s = {s['node_core_fraction']:.0%} of the serving loop's core; "
        f"one daemon serves ~{s['gpus_served']:.0f} such GPUs")
    lines.append(f"RATIO       kvtier ops/s {r['figure']['value']:.0f} vs echo {r['baseline']['value']:.0f}: "
                 f"{r['ratio']:.2f}x (same clients, same frames, same run)")
    return "\n".join(lines)
