"""The copy-engine seam (server/transfer/base.py): a copy names one chunk completely; the contract is abstract."""

from __future__ import annotations

import pytest
from kvtier.server.transfer.base import Copy, CopyEngine

pytestmark = pytest.mark.unit


def test_a_copy_names_one_chunk_its_blocks_runs_and_size() -> None:
    Copy(b"k" * 16, (3, 4), (10, 2), 4096)
    for bad in [dict(key=b"k"), dict(block_ids=()), dict(extents=(10,)), dict(size=0)]:
        with pytest.raises(ValueError):
            Copy(**{"key": b"k" * 16, "block_ids": (3,), "extents": (10, 2), "size": 1, **bad})


def test_the_engine_contract_has_no_implementation_to_call_by_accident() -> None:
    with pytest.raises(TypeError):
        CopyEngine()  # type: ignore[abstract]
