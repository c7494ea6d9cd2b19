"""Smoke test of `kvtier bench node` with N in (1, 2) and short phases: a real server and a real echo process
driven by real client processes. The rows must show work done (requests, every operation type timed, the
server's CPU spent) and the server's own /metrics must have counted at least the operations the clients say
they sent. No wall-time checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

OPS = ("lookup", "acquire", "release", "reserve", "commit")


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_bench_node_json():
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.server.cli", "bench", "node", "--clients", "1,2", "--seconds", "1.5",
         "--echo-seconds", "1", "--prefixes", "4", "--fresh", "0.2", "--l1-gb", "0.25", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["bench"] == "node"
    assert [row["clients"] for row in res["rows"]] == [1, 2]
    sent = {op: 0 for op in OPS}
    for row in res["rows"]:
        k, e = row["kvtier"], row["echo"]
        for phase in (k, e):
            assert phase["errors"] == 0, row
            for name in ("requests", "requests_per_s", "ops_per_s", "cpu_s", "cpu_us_per_op", "hit_fraction"):
                assert _positive(phase[name]), (phase["target"], name, phase[name])
            assert phase["ops"]["lookup"] == phase["requests"]  # one lookup per request
            assert 0 < phase["hits"] < phase["requests"]  # both paths taken (--fresh 0.2)
            for op in OPS:  # every operation type was sent and timed
                assert phase["ops"][op] > 0 and phase["latency_us"][op]["n"] > 0, (phase["target"], op)
                assert 0 < phase["latency_us"][op]["p50_us"] <= phase["latency_us"][op]["p99_us"]
        # the hit path: an acquire and two releases (the acquire's, the lookup lease's) per hit
        assert k["ops"]["acquire"] == k["hits"] and k["ops"]["release"] == 2 * k["hits"]
        assert k["ops"]["reserve"] == k["requests"] and e["ops"]["commit"] == e["requests"]  # each stores its new chunks
        assert 0 < k["ops"]["commit"] <= k["ops"]["reserve"] and k["stores"]["stored"] >= k["ops"]["commit"]
        assert _positive(row["ops_ratio"])
        for op in OPS:
            sent[op] += k["ops"][op]
    counted = res["server_counted"]
    for op in OPS:  # the server saw what the clients sent (and the warm-up's and prepares' requests)
        assert counted["requests"][op] >= sent[op], (op, counted, sent)
    assert set(counted["errors"]) <= {"not_registered"}, counted  # only idle clients the server dropped
    s = res["saturation"]
    for name in ("cpu_us_per_op", "ops_per_s_at_one_core", "requests_per_s_at_one_core", "gpus_served"):
        assert _positive(s[name]), (name, s)
    assert _positive(res["ratio"])
