"""docs/architecture.md names every product module (by path or by file name in its folder's row), so the module
table cannot silently fall behind the tree again (issue 30: it had omitted the Redis tier, transfer/ and
gpu_ops.py). Folders documented as a whole by their row: server/bench/ and server/eviction/ (policies by name)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("server", "connector", "shm", "admin_api")
WHOLE_FOLDERS = ("server/bench/", "server/eviction/")


def unnamed_modules(root: Path, doc: str) -> list[str]:
    """Product modules (not __init__.py, not in WHOLE_FOLDERS) that `doc` names neither by path nor by file name."""
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.name == "__init__.py" or rel.startswith(WHOLE_FOLDERS):
                continue
            if rel not in doc and path.name not in doc:
                out.append(rel)
    return out


def test_architecture_doc_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = unnamed_modules(ROOT, doc)
    assert not missing, f"docs/architecture.md does not name: {missing} (add them to its module table)"
    assert "server/bench/" in doc and "server/eviction/" in doc


def test_a_module_missing_from_the_doc_is_caught() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert unnamed_modules(ROOT, doc.replace("gpu_ops.py", "gpu-ops")) == ["server/gpu_ops.py"]
