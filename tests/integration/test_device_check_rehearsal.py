"""The device check (tests/gpu/run.sh) rehearsed on CPU, as CI runs it: the whole script against a real
`kvtier server --gpu-fake-engine` and its copier process, over the layouts vLLM 0.32 produces
(tests/gpu/layouts.json), with the primitives phase skipped. It must find every round trip bit-exact, the
split layout regrouped bit-exact or refused, the killed copier's canaries intact, and print its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = Path(__file__).resolve().parents[1] / "gpu" / "run.sh"


def test_the_device_check_rehearses_green_on_cpu_and_prints_its_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(RUN), "--rehearse"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rehearse"] and summary["ok"] and not summary["errors"], summary
    e2e = summary["end_to_end"]
    for case in ("nhd", "hnd", "mla", "fp8", "split_nhd", "two_layers"):
        verdicts = {k: v for k, v in e2e[case].items() if isinstance(v, bool)}
        assert verdicts == {"stored": True, "l1_as_vllm_lays_it": True, "loaded": True, "inside_a_chunk": True,
                            "partial_chunk": True, "one_block": True}, (case, e2e[case])
    assert "refused" in e2e["split_hnd"] or all(e2e["split_hnd"][k] is True for k in ("loaded", "partial_chunk"))
    killed = e2e["copier_killed"]
    assert all(killed[k] is True for k in ("stored", "consistent", "canaries_intact", "copier_replaced",
                                           "load_after_exact")), killed
    assert e2e["idle_worker"]["exact"] is True, e2e["idle_worker"]
    assert "primitives" not in summary  # skipped without CUDA
    table = done.stdout
    assert "kvtier device check: CPU REHEARSAL" in table and "primitives    skipped" in table, table
    assert all(f"  {name} " in table for name in ("d2h", "h2d", "both")) and "ok=True" in table, table
