"""Smoke test of `kvtier bench l2` with tiny sizes: it runs end to end (real L2 writer and tier, a real server
restarted on its L2 directory) and reports positive figures and same-run baselines. No wall-time checks."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_bench_l2_json(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.server.cli", "bench", "l2", "--dir", str(tmp_path), "--chunks", "4",
         "--chunk-mb", "0.25", "--reps", "1", "--lookups", "3", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["bench"] == "l2"
    assert _positive(res["figure"]["value"]) and _positive(res["baseline"]["value"]) and _positive(res["ratio"])
    assert set(res["figures"]) == {"write_gbps", "read_cold_gbps", "read_warm_gbps", "promote_lookup_p50_us"}
    assert set(res["baselines"]) == {"write_gbps", "read_cold_gbps", "read_warm_gbps", "l1_hit_lookup_p50_us"}
    for name, value in (*res["figures"].items(), *res["baselines"].items(), *res["ratios"].items()):
        assert _positive(value), (name, value)
    assert res["io"]["bytes_per_phase"] == 4 * res["io"]["file_bytes"]
    assert res["lookup"]["promoted"] == 3
    assert res["lookup"]["promote_lookup"]["n"] == 3 and res["lookup"]["l1_hit_lookup"]["n"] == 3
    assert res["filesystem"]["fstype"] not in ("", "?")
    assert "not implemented" in res["odirect"]
    # the bench cleans up after itself inside --dir
    assert list(tmp_path.iterdir()) == []
