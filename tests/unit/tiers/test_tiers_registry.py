"""The lazy registry of lower tiers (server/tiers/registry.py) and the composition from a configuration
(server/tier_setup.py): a kind or an import path names a factory; the remote tier's module (glide) is imported
only when a remote tier is configured; a bad name is a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvtier.server.config import ServerConfig
from kvtier.server.tier_setup import tier_options
from kvtier.server.tiers.registry import TIERS, tier_factory

pytestmark = pytest.mark.unit


def test_kinds_and_import_paths_name_factories():
    assert set(TIERS) == {"l2", "remote"}
    assert tier_factory("l2").__module__ == "kvtier.server.tiers.fs"
    assert tier_factory("kvtier.server.tiers.fs:make_tier") is tier_factory("l2")
    for bad in ("l3", "nosuchmodule:make", "kvtier.server.tiers.fs:nosuch", "kvtier.server.tiers.fs:SYNC_BATCH"):
        with pytest.raises(ValueError, match="tier"):
            tier_factory(bad)


def test_options_in_lookup_order(tmp_path):
    config = ServerConfig(l2_path=str(tmp_path), remote_url="redis://127.0.0.1:1",
                          extra_tiers="pkg.mod:make=/some/path:x, other:make")
    kinds = tier_options(config)
    assert [k for k, _ in kinds] == ["l2", "remote", "pkg.mod:make", "other:make"]
    assert kinds[0][1].path == str(tmp_path) and kinds[1][1].url == "redis://127.0.0.1:1"
    assert kinds[2][1] == "/some/path:x" and kinds[3][1] == ""


def test_glide_is_imported_only_with_a_remote_tier(tmp_path):
    code = f"""
import sys
from kvtier.server.config import ServerConfig
from kvtier.server.metrics import Metrics
from kvtier.server.tiers.registry import tier_factory
t = tier_factory("l2")(ServerConfig(l2_path={str(tmp_path)!r}).l2_options(), Metrics())
assert t.name == "l2" and t.m.name == "l2"
print("glide" if "glide_sync" in sys.modules else "no glide")
tier_factory("remote")
print("glide" if "glide_sync" in sys.modules else "no glide")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["no glide", "glide"]
