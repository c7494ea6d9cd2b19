"""open_l1 with something other than a segment or journal at their paths (issue 29, item 13): a symbolic link
is never followed (the start is empty and the link's target untouched), an empty directory is replaced, a
directory that cannot be removed is a clear SegmentMismatch naming it, never a traceback from deep inside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from kvtier.server.eviction import make_policy
from kvtier.server.l1.adopt import JOURNAL_SUFFIX, L1Files, open_l1
from kvtier.server.metrics import Metrics
from kvtier.shm.segment import SegmentMismatch
from l1_helpers import MIN_BLOCK_BYTES, PAGE

pytestmark = pytest.mark.unit

PAGES = 32
WHERE = pytest.mark.parametrize("suffix", ["", JOURNAL_SUFFIX], ids=["segment", "journal"])


@pytest.fixture
def files(tmp_path: Path) -> L1Files:
    return L1Files("kvtier-unit-odd", str(tmp_path), 0o600)


def start(files: L1Files) -> str:
    l1 = open_l1(files, PAGES, PAGE, make_policy("lru"), Metrics(), min_block_bytes=MIN_BLOCK_BYTES)
    outcome = l1.outcome
    l1.abandon()
    return outcome


def in_place(files: L1Files, suffix: str) -> Path:
    """The path of the segment or journal, emptied; for the journal, a segment left beside it."""
    path = Path(files.directory, files.name + suffix)
    if suffix:
        start(files)
        path.unlink()
    return path


@WHERE
def test_a_symlink_in_place_is_never_followed_and_the_start_is_empty(files, suffix):
    target = Path(files.directory, "target")
    target.write_bytes(b"not yours" * 100)
    path = in_place(files, suffix)
    path.symlink_to(target)
    assert start(files).startswith("L1 starts empty")
    assert not path.is_symlink() and path.is_file()
    assert target.read_bytes() == b"not yours" * 100


@WHERE
def test_an_empty_directory_in_place_is_replaced_and_the_start_is_empty(files, suffix):
    path = in_place(files, suffix)
    path.mkdir()
    outcome = start(files)
    assert outcome.startswith("L1 starts empty") and "directory" in outcome
    assert path.is_file()


@WHERE
def test_a_directory_that_cannot_be_removed_is_a_clear_error(files, suffix):
    path = in_place(files, suffix)
    path.mkdir()
    (path / "keep").touch()
    with pytest.raises(SegmentMismatch, match=rf"{path} is a directory .*cannot be removed"):
        start(files)
    assert path.is_dir() and os.listdir(path) == ["keep"]
