"""Smoke test of `kvtier bench l2` with tiny sizes: it runs end to end (real L2 writer and tier, a real server
restarted on its L2 directory) and reports positive figures and same-run baselines, buffered and O_DIRECT,
and writes its plot. No wall-time checks."""

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
    work, plot = tmp_path / "work", tmp_path / "plots" / "l2.png"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "kvtier.server.cli", "bench", "l2", "--dir", str(work), "--chunks", "4",
         "--chunk-mb", "0.25", "--reps", "1", "--lookups", "3", "--json", "--plot", str(plot)],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["bench"] == "l2"
    assert _positive(res["figure"]["value"]) and _positive(res["baseline"]["value"]) and _positive(res["ratio"])
    kinds = ("write", "read_cold", "read_warm")
    assert set(res["figures"]) == {f"{m}{k}_gbps" for m in ("", "odirect_") for k in kinds} | {"promote_lookup_p50_us"}
    assert set(res["baselines"]) == {f"{m}{k}_gbps" for m in ("", "odirect_") for k in kinds} | {
        "l1_hit_lookup_p50_us"}
    assert set(res["ratios"]) == {f"{m}{k}" for m in ("", "odirect_") for k in kinds}
    for name, value in (*res["figures"].items(), *res["baselines"].items(), *res["ratios"].items()):
        assert _positive(value), (name, value)
    assert res["io"]["buffered"]["odirect_active"] is False
    assert res["io"]["odirect"]["odirect_active"] is res["odirect_active"]
    assert res["io"]["bytes_per_phase"] == 4 * res["io"]["file_bytes"]
    assert res["lookup"]["promoted"] == 3
    assert res["lookup"]["promote_lookup"]["n"] == 3 and res["lookup"]["l1_hit_lookup"]["n"] == 3
    assert res["filesystem"]["fstype"] not in ("", "?")
    assert res["plot"] == str(plot) and plot.stat().st_size > 0
    # the bench cleans up after itself inside --dir
    assert list(work.iterdir()) == []
