"""`kvtier status` rendering: every lower tier of /status `tiers` shows the same way, a tier the CLI does not
know by name too (the real server's l2 and remote tiers: tests/integration/test_admin_api.py)."""

from __future__ import annotations

import pytest
from kvtier.admin_api.status_cli import render

pytestmark = pytest.mark.unit


def test_unknown_tier_gets_generic_line():
    status = {"l2": {"l2_enabled": False}, "remote": {"remote_enabled": False},
              "tiers": [{"name": "nvme", "nvme_enabled": True, "nvme_entries": 7, "nvme_used_bytes": 4096,
                         "nvme_odirect": True, "nvme_path": "/mnt/x"}]}
    out = render(status).splitlines()
    at = next(i for i, x in enumerate(out) if x.startswith("nvme  "))
    # the name, its text facts, its usage; the counts every tier has; its own facts
    assert out[at] == "nvme  /mnt/x  4.0 KiB used of no limit, 7 chunks; read not measured, write not measured", out
    assert out[at + 1].startswith("    0 written, 0 queued writes") and out[at + 2] == "    odirect yes", out
    assert "L2  off" in out  # no l2 among the tiers: as before


def test_old_server_without_tiers_renders_l2():
    out = render({"l2": {"l2_enabled": True, "l2_entries": 3, "l2_capacity_bytes": 1024, "l2_used_bytes": 512}})
    assert "512 B used of 1.0 KiB (50%), 3 chunks" in out
