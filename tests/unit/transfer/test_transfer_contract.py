"""The copy-engine seam (server/transfer/base.py): a copy names some blocks of one chunk completely; the
contracts are abstract."""

from __future__ import annotations

import pytest
from kvtier.server.transfer.base import Copy, CopyEngine, DeviceBackend

pytestmark = pytest.mark.unit


def test_a_copy_names_blocks_of_one_chunk_its_runs_and_size() -> None:
    Copy(b"k" * 16, (3, 4), 1, 3, (10, 2), 4096)
    for bad in [dict(key=b"k"), dict(block_ids=()), dict(extents=(10,)), dict(extents=()), dict(size=0),
                dict(first=-1), dict(first=2), dict(blocks=1)]:
        with pytest.raises(ValueError):
            Copy(**{"key": b"k" * 16, "block_ids": (3,), "first": 1, "blocks": 2, "extents": (10, 2), "size": 1,
                    **bad})


def test_the_contracts_have_no_implementation_to_call_by_accident() -> None:
    for contract in (CopyEngine, DeviceBackend):
        with pytest.raises(TypeError):
            contract()  # type: ignore[abstract]
