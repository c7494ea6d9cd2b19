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


def test_tenants_table_only_with_a_quota_table():
    row = {"tenant": "A", "used_bytes": 3 << 20, "guaranteed_bytes": 1 << 20, "max_bytes": 4 << 20, "entries": 3,
           "requested_tokens": 400, "hit_tokens": 100, "evictions": {"quota": 10, "capacity": 2, "clear": 0},
           "refused": {"tenant_max": 0}}
    star = {**row, "tenant": "*", "requested_tokens": 0, "evictions": {}, "refused": {"retained": 5}}
    out = render({"l1": {"tenant_quotas": "A=1MiB:4MiB", "tenants": [row, star]}}).splitlines()
    at = out.index("Tenants in L1 (A=1MiB:4MiB)")
    assert out[at + 1].split() == ["TENANT", "USED", "GUARANTEED", "MAX", "CHUNKS", "HIT", "RATIO", "EVICTIONS",
                                   "REFUSED"]
    a, b = out[at + 3].split(), out[at + 4].split()
    assert a[:10] == ["A", "3.0", "MiB", "1.0", "MiB", "4.0", "MiB", "3", "25.0", "%"], out
    assert " ".join(a[10:]) == "12 (quota 10, capacity 2) 0", out
    assert b[0] == "*" and "-" in b and " ".join(b[-3:]) == "5 (retained 5)", out
    no_table = render({"l1": {"tenant_quotas": "", "tenants": [star]}})
    assert "Tenants in L1" not in no_table


def test_a_lower_tiers_tenants_get_their_own_table_under_it():
    row = {"tenant": "B", "used_bytes": 2 << 20, "guaranteed_bytes": 2 << 20, "max_bytes": 8 << 20, "entries": 8,
           "evictions": {"capacity": 0, "quota": 0, "clear": 0}, "refused": {"tenant_guarantee": 3}}
    tier = {"name": "l2", "l2_enabled": True, "l2_entries": 8, "l2_capacity_bytes": 8 << 20,
            "l2_used_bytes": 2 << 20, "l2_tenant_quotas": "B=25%", "l2_tenants": [row]}
    out = render({"tiers": [tier]}).splitlines()
    at = out.index("Tenants in L2 (B=25%)")
    assert out[at + 1].split() == ["TENANT", "USED", "GUARANTEED", "MAX", "CHUNKS", "EVICTIONS", "REFUSED"]
    assert out[at + 3].split() == ["B", "2.0", "MiB", "2.0", "MiB", "8.0", "MiB", "8", "0", "3", "(tenant_guarantee",
                                   "3)"], out
    assert not any("tenants:" in line or "B=25%" in line for line in out[:at]), out  # not among the tier's facts
    no_table = render({"tiers": [{**tier, "l2_tenant_quotas": ""}]})
    assert "Tenants in L2" not in no_table and "tenants:" not in no_table
