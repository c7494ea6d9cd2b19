"""The dependency rules of ../shared/DESIGN.md ("Layout"), checked by parsing the imports of every module in
the four product folders (server/, connector/, shm/, admin_api/), the size of those modules, and the packaging
of those folders."""

from __future__ import annotations

import ast
import functools
import shutil
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# Product folder -> the package it is installed as (pyproject.toml's package-dir).
FOLDERS = {"server": "kvtier.server", "connector": "kvtier.connector", "shm": "kvtier.shm",
           "admin_api": "kvtier.admin_api"}

CONTRACT = ("kvtier.server.keys", "kvtier.server.protocol")

RULE_SHM = "shm imports nothing of kvtier"
RULE_CONNECTOR = "connector imports only kvtier.server.keys, kvtier.server.protocol and kvtier.shm"
RULE_SERVER = "server modules never import kvtier.connector or kvtier.admin_api (server/cli.py and server/bench/ excepted)"
RULE_LOWER = "server/l1/ and server/tiers/ never import kvtier.server.cache, kvtier.server.rpc or kvtier.server.daemon"
RULE_TRANSFER = "server/transfer/ imports only kvtier.shm, kvtier.server.keys and kvtier.server.protocol"
RULE_BENCH = "only server/cli.py imports kvtier.server.bench"
RULE_EVENTS = "server/events.py imports nothing of kvtier"
RULE_FEED = "server/l1/ and server/tiers/ never import kvtier.server.feed"
RULE_TIERS_CONFIG = "server/tiers/ never imports kvtier.server.config"
RULE_L1_TIERS = "server/l1/ never imports kvtier.server.tiers"
RULES = (RULE_SHM, RULE_CONNECTOR, RULE_SERVER, RULE_LOWER, RULE_TRANSFER, RULE_BENCH, RULE_EVENTS, RULE_FEED,
         RULE_TIERS_CONFIG, RULE_L1_TIERS)

MAX_LINES = 420  # a product module over this many lines does more than one job (issue 30: "about 400")


def _within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _broken_rules(src: str, target: str) -> list[str]:
    """The rules that module `src` importing `target` (both dotted kvtier names) breaks."""
    broken = []
    if _within(src, "kvtier.shm") and not _within(target, "kvtier.shm"):
        broken.append(RULE_SHM)
    if _within(src, "kvtier.connector") and not _within(target, "kvtier.connector", "kvtier.shm", *CONTRACT):
        broken.append(RULE_CONNECTOR)
    composition_root = src == "kvtier.server.cli" or _within(src, "kvtier.server.bench")
    if (_within(src, "kvtier.server") and not composition_root
            and _within(target, "kvtier.connector", "kvtier.admin_api")):
        broken.append(RULE_SERVER)
    if (_within(src, "kvtier.server.l1", "kvtier.server.tiers")
            and _within(target, "kvtier.server.cache", "kvtier.server.rpc", "kvtier.server.daemon")):
        broken.append(RULE_LOWER)
    if (_within(src, "kvtier.server.transfer")
            and not _within(target, "kvtier.server.transfer", "kvtier.shm", *CONTRACT)):
        broken.append(RULE_TRANSFER)
    if not composition_root and _within(target, "kvtier.server.bench"):
        broken.append(RULE_BENCH)
    if src == "kvtier.server.events":
        broken.append(RULE_EVENTS)
    if _within(src, "kvtier.server.l1", "kvtier.server.tiers") and _within(target, "kvtier.server.feed"):
        broken.append(RULE_FEED)
    if _within(src, "kvtier.server.tiers") and _within(target, "kvtier.server.config"):
        broken.append(RULE_TIERS_CONFIG)
    if _within(src, "kvtier.server.l1") and _within(target, "kvtier.server.tiers"):
        broken.append(RULE_L1_TIERS)
    return broken


def _module_name(rel: Path) -> tuple[str, str]:
    """(module, package it resolves relative imports against) of a file path relative to the root."""
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:-1]]
    if rel.name != "__init__.py":
        return ".".join([*parts, rel.stem]), ".".join(parts)
    return ".".join(parts), ".".join(parts)


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every kvtier import, relative ones resolved; `from a import b` yields a.b, so a
    submodule imported by name is seen as itself rather than as its package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)] if node.level - 1 < len(anchor) else []
                base = ".".join(p for p in [*anchor, base] if p)
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}".strip("."))
                      for alias in node.names]
    return [(line, name) for line, name in found if _within(name, "kvtier")]


@functools.cache
def _file_edges(rel: str, text: str) -> tuple[str, ...]:
    """The forbidden edges of one file (by its path relative to the root and its text; cached, so the planted
    copies below parse only what was planted)."""
    src, package = _module_name(Path(rel))
    try:
        tree = ast.parse(text, filename=rel)
    except SyntaxError as exc:
        return (f"{rel}:{exc.lineno}: does not parse ({exc.msg})",)
    return tuple(f"{rel}:{line}: {src} imports {target} ({rule})"
                 for line, target in _imports(tree, package) for rule in _broken_rules(src, target))


def forbidden_edges(root: Path) -> list[str]:
    """Every import in root's product folders that breaks a dependency rule, as 'file:line: src imports
    target (rule)', sorted; a file that does not parse is reported too."""
    edges: list[str] = []
    for folder in FOLDERS:
        for path in (root / folder).rglob("*.py"):
            edges += _file_edges(path.relative_to(root).as_posix(), path.read_text(encoding="utf-8"))
    return sorted(edges)


@pytest.mark.parametrize("rule", RULES)
def test_the_tree_keeps_the_rule(rule: str) -> None:
    edges = [edge for edge in forbidden_edges(ROOT) if edge.endswith(f"({rule})")]
    assert not edges, "forbidden imports:\n" + "\n".join(edges)


def test_every_product_module_parses() -> None:
    broken = [edge for edge in forbidden_edges(ROOT) if not edge.endswith(tuple(f"({rule})" for rule in RULES))]
    assert not broken, "\n".join(broken)


def oversized_modules(root: Path) -> dict[str, int]:
    """Product modules (every .py under root's product folders, server/bench/ included) over MAX_LINES lines:
    path relative to root -> lines."""
    sizes = {path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
             for folder in FOLDERS for path in (root / folder).rglob("*.py")}
    return {rel: n for rel, n in sorted(sizes.items()) if n > MAX_LINES}


def test_no_product_module_is_over_the_line_limit() -> None:
    over = oversized_modules(ROOT)
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_a_planted_oversized_module_is_caught(tmp_path: Path) -> None:
    root = _copy_product(tmp_path)
    before = oversized_modules(root)
    (root / "server/l1/planted_size_probe.py").write_text("x = 0\n" * (MAX_LINES + 1), encoding="utf-8")
    (root / "connector/planted_size_probe.py").write_text("x = 0\n" * MAX_LINES, encoding="utf-8")  # at the limit
    after = oversized_modules(root)
    assert set(after) - set(before) == {"server/l1/planted_size_probe.py"}
    assert after["server/l1/planted_size_probe.py"] == MAX_LINES + 1


def _copy_product(tmp_path: Path) -> Path:
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _planted(root: Path, rel: str, line: str) -> tuple[list[str], int]:
    """Edges of root before planting `line` at the end of root/rel (created if missing), and its line number."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    before = forbidden_edges(root)
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    path.write_text(text + line + "\n", encoding="utf-8")
    return before, text.count("\n") + 1


@pytest.mark.parametrize("path, line_text, module, target, rule", [
    ("server/keys.py", "import kvtier.connector.client", "kvtier.server.keys", "kvtier.connector.client", RULE_SERVER),
    ("server/l1/planted_layering_probe.py", "from kvtier.server import rpc", "kvtier.server.l1.planted_layering_probe",
     "kvtier.server.rpc", RULE_LOWER),
    ("server/tiers/planted_layering_probe.py", "from .. import daemon",  # a relative import, resolved
     "kvtier.server.tiers.planted_layering_probe", "kvtier.server.daemon", RULE_LOWER),
    ("server/events.py", "from kvtier.server import keys", "kvtier.server.events", "kvtier.server.keys", RULE_EVENTS),
    ("server/tiers/planted_layering_probe.py", "from kvtier.server.feed import Feed",
     "kvtier.server.tiers.planted_layering_probe", "kvtier.server.feed.Feed", RULE_FEED),
    ("server/tiers/planted_layering_probe.py", "from kvtier.server import config",
     "kvtier.server.tiers.planted_layering_probe", "kvtier.server.config", RULE_TIERS_CONFIG),
    ("server/tiers/fs.py", "from ..config import ServerConfig",  # a relative import, in an existing tier
     "kvtier.server.tiers.fs", "kvtier.server.config.ServerConfig", RULE_TIERS_CONFIG),
    ("server/l1/planted_layering_probe.py", "from kvtier.server.tiers.base import LowerTier",
     "kvtier.server.l1.planted_layering_probe", "kvtier.server.tiers.base.LowerTier", RULE_L1_TIERS),
    ("server/l1/store.py", "import kvtier.server.tiers",
     "kvtier.server.l1.store", "kvtier.server.tiers", RULE_L1_TIERS),
    ("server/events.py", "import kvtier.server.l1.store", "kvtier.server.events", "kvtier.server.l1.store",
     RULE_EVENTS),
])
def test_a_planted_forbidden_import_is_caught(tmp_path: Path, path: str, line_text: str, module: str, target: str,
                                              rule: str) -> None:
    root = _copy_product(tmp_path)
    before, line = _planted(root, path, line_text)
    after = forbidden_edges(root)
    assert set(before) <= set(after)
    assert sorted(set(after) - set(before)) == [f"{path}:{line}: {module} imports {target} ({rule})"]


def _package_dir(name: str, mapping: dict[str, str]) -> Path:
    """Where setuptools looks for package `name`: its package-dir entry, else its nearest mapped parent's."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mapping:
            return ROOT.joinpath(mapping[prefix], *parts[n:])
    return ROOT.joinpath(*parts)


def test_every_package_folder_is_packaged() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed, mapping = tool["packages"], tool.get("package-dir", {})
    folders = {
        ".".join([FOLDERS[folder], *d.relative_to(ROOT / folder).parts])
        for folder in FOLDERS
        for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    assert folders - set(listed) == set(), "package folders missing from pyproject.toml's packages"
    missing = [name for name in listed if not any(_package_dir(name, mapping).glob("*.py"))]
    assert missing == [], "pyproject.toml lists packages with no folder of .py files"
    assert len(listed) == len(set(listed))
