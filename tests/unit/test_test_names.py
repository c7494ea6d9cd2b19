"""scripts/test.sh collects tests/unit and tests/integration in one pytest run, and the test folders are not
packages (rootdir-relative imports), so two test modules with one file name there stop collection with
"import file mismatch" (CI failed that way once). tests/e2e runs alone and may reuse a name."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]


def test_unit_and_integration_test_modules_have_distinct_file_names() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for folder in ("unit", "integration"):
        for path in (TESTS / folder).rglob("test_*.py"):
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules collected together share a file name: {clashes}"
