"""Real vLLM, documents re-read in a cycle 1.6x larger than L1: the default policy loads what the replay
predicts (Belady's figure), with identical greedy output; LRU would load nothing (docs/performance.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench_vllm_reread import run_config
from kvtier.server.eviction import DEFAULT_POLICY

L1_GIB = 0.0427  # 700 pages for the workload's 1,120


def test_default_policy_serves_the_part_of_the_cycle_that_fits(tiny_model: Path, vllm_python: Path,
                                                                logdir: Path) -> None:
    (logdir / "logs").mkdir(exist_ok=True)
    row = run_config(L1_GIB, DEFAULT_POLICY, tiny_model, argparse.Namespace(max_tokens=4), logdir, vllm_python)
    assert 1.55 < row["working_set_vs_l1"] < 1.65
    assert row["outputs_identical"]
    assert row["loaded_tokens"] == row["replay_tokens"]
    assert row["loaded_tokens"] >= 0.8 * row["belady_tokens"] > 0
