"""The helpers of `kvtier bench node`: the latency histogram that merges client processes' samples (within its
2 % bins of the exact percentiles, also after a JSON round trip as the clients send it), and the /proc CPU
reading of a process."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from kvtier.server.bench.node import cpu_seconds
from kvtier.server.bench.node_worker import Histogram

pytestmark = pytest.mark.unit


def test_histogram_percentiles_merge_across_processes() -> None:
    rng = np.random.default_rng(0)
    samples = rng.lognormal(np.log(300e-6), 0.8, 20_000)
    parts = [Histogram(), Histogram()]
    for i, s in enumerate(samples):
        parts[i % 2].add(float(s))
    merged = Histogram()
    for part in parts:
        merged.merge(json.loads(json.dumps(part.bins)))  # string keys, as the clients' JSON lines carry them
    assert merged.count == len(samples)
    for q in (50, 99):
        exact = float(np.percentile(samples, q)) * 1e6
        assert abs(merged.percentile_us(q) / exact - 1) < 0.03, q
    assert Histogram().percentile_us(50) == 0.0


def test_cpu_seconds_grows_with_work() -> None:
    before = cpu_seconds(os.getpid())
    x = 0
    while cpu_seconds(os.getpid()) - before < 0.05:
        x += sum(range(10_000))
    assert cpu_seconds(os.getpid()) > before
