"""Smoke test of `kvtier bench datapath` and `kvtier bench lookup` at tiny sizes: each starts a real server
process and prints JSON with its figure and the same-run baseline. No wall-time assertions (2-core CI)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _bench(*argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.server.cli", "bench", *argv, "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_figure(result: dict) -> None:
    for name in ("figure", "baseline"):
        assert isinstance(result[name]["name"], str) and result[name]["name"]
        assert _positive(result[name]["value"]), result[name]
    assert _positive(result["ratio"])


@pytest.mark.parametrize("extra", [(), ("--populate",)], ids=["first-touch", "mapped-ahead"])
def test_bench_datapath_tiny(extra: tuple[str, ...]) -> None:
    result = _bench("datapath", "--sizes-mib", "0.25,0.5", "--block-kib", "64", "--request-mib", "1",
                    "--l1-mib", "8", "--warm-passes", "1", *extra)
    _check_figure(result)
    assert set(result["sizes"]) == {"0.25", "0.5"}
    for row in result["sizes"].values():
        assert row["resident_prompts_read"] > 0
        for name in ("store_cold_chunk", "store_warm_blocks", "retrieve_warm_chunk", "retrieve_warm_blocks"):
            assert _positive(row["path"][name]["copy_gbps"]), name
            assert _positive(row["path"][name]["e2e_gbps"]), name
        for name in ("memcpy_chunk", "memcpy_blocks", "shm_write_cold_chunk", "shm_write_warm_blocks"):
            assert _positive(row["raw"][name]["copy_gbps"]), name


def test_bench_lookup_tiny() -> None:
    result = _bench("lookup", "--keys", "32", "--iters", "40", "--max-entries", "300")
    _check_figure(result)
    assert result["keys_per_lookup"] == 32
    level = result["levels"][0]
    assert level["entries"] >= 300
    for name in ("kvtier_lookup", "echo_sync", "echo_uvloop", "kvtier_lookup_miss"):
        assert _positive(level["latency"][name]["p50_us"]), name
        assert _positive(level["latency"][name]["p99_us"]), name
    assert _positive(level["rss"]["VmRSS"])
    idle = result["idle"]
    for name in ("defaults", "no_admin_api"):
        assert _positive(idle[name]["VmRSS"]) and _positive(idle[name]["startup_s"])
    assert _positive(result["idle_figure"]["value"])
