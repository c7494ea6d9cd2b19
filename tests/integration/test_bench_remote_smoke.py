"""Smoke test of `kvtier bench remote` and `kvtier bench remote-rtt` at tiny sizes against a Redis of the
test's own: they run end to end (throughput through the tier and the raw client; latency of two kvtier servers
with that Redis running and SIGSTOPped; reads through the delaying proxy), report positive figures and same-run
baselines, resume the Redis, leave no key behind, and refuse to stop a process that is not the Redis. No
wall-time checks (only that the proxy added at least most of the round trip it was asked for)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _support import REPO

pytestmark = pytest.mark.integration
pytest_plugins = ("redis_servers",)  # redis_server: a standalone Redis of the test's own


def _positive(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.server.cli", "bench", "remote", *argv], capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _cli(url: str, *args: str) -> str:
    port = url.rsplit(":", 1)[1]
    return subprocess.run(["redis-cli", "-p", port, *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()


def test_bench_remote_json(redis_server):
    redis = redis_server()
    r = _bench("--remote-url", redis.url, "--chunk-mib", "1,2.5", "--total-mib", "5", "--reps", "2",
               "--redis-pid", str(redis.pid), "--prompts", "3", "--latency-chunk-kib", "256", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["bench"] == "remote" and res["reps"] == 2
    for name in ("figure", "baseline"):
        assert res[name]["name"] and _positive(res[name]["value"]), res[name]
    assert _positive(res["ratio"])
    tp = res["throughput"]
    assert tp["part_bytes"] == 1 << 20 and _positive(tp["rtt_us"]) and tp["server"]["redis_version"]
    assert {k: (v["chunks"], v["parts"]) for k, v in tp["sizes"].items()} == {"1": (5, 1), "2.5": (2, 3)}
    for row in tp["sizes"].values():
        for op in ("set", "get", "set_writer"):
            assert all(_positive(row[op][k]) for k in ("tier_gbps", "raw_gbps", "ratio")), row
    lat = res["latency"]
    for phase in ("up", "stopped", "stopped_open"):
        for side in ("remote", "no_remote"):
            for op in ("store", "l1_hit"):
                x = lat[phase][side][op]
                assert x["n"] == 3 and _positive(x["p50_us"]) and _positive(x["p99_us"]), (phase, side, op)
    assert set(res["ratios"]) == {f"{op}_{size}MiB" for op in ("set", "get", "set_writer") for size in ("1", "2.5")} | {
        f"{op}_{phase}_vs_no_remote_p50" for op in ("store", "l1_hit") for phase in ("stopped", "stopped_open")}
    assert all(_positive(v) for v in res["ratios"].values())
    assert lat["stats_stopped"]["remote_written"] >= 1  # the up phase wrote through the tier
    assert lat["stats_stopped_open"]["remote_breakers_open"] == [redis.url.removeprefix("redis://")]
    # Redis resumed, and nothing of the bench left in it
    assert "State:\tT" not in Path(f"/proc/{redis.pid}/status").read_text()
    assert _cli(redis.url, "PING") == "PONG" and _cli(redis.url, "DBSIZE") == "0"


def test_bench_remote_refuses_a_pid_that_is_not_the_redis(redis_server):
    redis = redis_server()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r = _bench("--remote-url", redis.url, "--redis-pid", str(bystander.pid), "--chunk-mib", "1", "--total-mib",
                   "1", "--reps", "1")
        assert r.returncode != 0 and "is not the server of --remote-url" in r.stderr, r.stderr
        assert "State:\tT" not in Path(f"/proc/{bystander.pid}/status").read_text()
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


def test_bench_remote_rtt_json(redis_server):
    """`kvtier bench remote-rtt` at tiny sizes: every RTT and size has positive figures for the three readers,
    the proxy added a round trip of about the asked one (loose: a shared machine), nothing left behind."""
    redis = redis_server()
    r = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "bench", "remote-rtt", "--remote-url", redis.url,
                        "--rtt-ms", "0,5", "--chunk-mib", "1,2.5", "--total-mib", "3", "--reps", "1", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["bench"] == "remote-rtt" and res["reps"] == 1 and _positive(res["direct_rtt_us"])
    assert set(res["rtts"]) == {"0", "5"}
    assert res["rtts"]["5"]["added_rtt_us"] >= 4000
    for x in res["rtts"].values():
        assert {k: (v["chunks"], v["parts"]) for k, v in x["sizes"].items()} == {"1": (3, 1), "2.5": (1, 3)}
        for row in x["sizes"].values():
            assert all(_positive(row[k]) for k in ("tier_gbps", "tier_cold_gbps", "raw_gbps", "tier_ratio",
                                                    "tier_cold_ratio")), row
    assert set(res["ratios"]) == {f"get_{rtt}ms_{size}MiB" for rtt in ("0", "5") for size in ("1", "2.5")}
    assert res["figure"]["value"] == min(v for k, v in res["ratios"].items() if k.startswith("get_5ms"))
    assert _cli(redis.url, "DBSIZE") == "0"


def test_bench_remote_rtt_refuses_a_cluster():
    r = subprocess.run([sys.executable, "-m", "kvtier.server.cli", "bench", "remote-rtt", "--remote-url",
                        "redis+cluster://127.0.0.1:1,127.0.0.1:2"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode != 0 and "must be a standalone server" in r.stderr, r.stderr
