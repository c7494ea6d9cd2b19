"""Sampled verification: KV the engine just recomputed against what kvtier holds under the same keys.

The same model with the same kernels computes the same KV up to rounding (a prompt prefilled in other batch
shapes or chunk splits rounds differently), so blocks are compared by their relative L2 difference
||stored - recomputed|| / ||recomputed|| over every layer, against a tolerance (`kvtier.verify_tolerance`,
0.05 by default: docs/vllm.md gives the figures measured on honest hits and on another adapter's KV). A dtype
this module cannot decode is compared byte for byte.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


def as_float(raw: np.ndarray, dtype: str) -> np.ndarray | None:
    """The float32 values of raw KV bytes of a vLLM KV dtype; None for a dtype without a decoder here."""
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype in ("float16", "half"):
        return raw.view(np.float16).astype(np.float32)
    if dtype in ("float32", "float"):
        return raw.view(np.float32)
    return None


@dataclass
class Difference:
    """Accumulated squares of (stored - recomputed) and of recomputed, and bytes that differ where a dtype
    cannot be decoded."""

    diff_sq: float = 0.0
    ref_sq: float = 0.0
    bytes_differ: int = 0

    def add(self, stored: np.ndarray, recomputed: np.ndarray, dtype: str) -> None:
        a, b = as_float(stored, dtype), as_float(recomputed, dtype)
        if a is None or b is None:
            self.bytes_differ += int(np.count_nonzero(stored != recomputed))
            return
        finite = np.isfinite(a) & np.isfinite(b)
        if not finite.all():  # a NaN or an infinity must be the very same value on both sides
            odd = ~finite
            self.bytes_differ += int(np.count_nonzero(a[odd].view(np.uint32) != b[odd].view(np.uint32)))
            a, b = a[finite], b[finite]
        d = a - b
        self.diff_sq += float(np.dot(d, d))
        self.ref_sq += float(np.dot(b, b))

    @property
    def relative(self) -> float:
        if self.bytes_differ:
            return math.inf
        return math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else (0.0 if not self.diff_sq else math.inf)


def difference(pairs: Iterable[tuple[np.ndarray, np.ndarray]], dtype: str) -> Difference:
    out = Difference()
    for stored, recomputed in pairs:
        out.add(stored, recomputed, dtype)
    return out
