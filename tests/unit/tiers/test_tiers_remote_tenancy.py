"""The remote tier's per-tenant key layout (server/tiers/remote/layout.py `tenant_base`, tenancy.py `Tenancy`) and
where its tenant names come from (server/config.py): a named tenant's keys under `<prefix>:t:<tenant>:`, the
default tenant's exactly as before tenants, and ACL key patterns that do not reach another tenant's keys."""

from __future__ import annotations

import fnmatch
import os

import pytest
from kvtier.server.config import ServerConfig
from kvtier.server.keys import Namespace
from kvtier.server.tiers.remote.layout import acl_key_pattern, key_name, part_key_name, tenant_base
from kvtier.server.tiers.remote.tenancy import Tenancy, UnknownNamespace

pytestmark = pytest.mark.unit

PREFIX = "prod-llama8b"


def namespace(salt: str) -> Namespace:
    return Namespace(model="org/tenancy", dtype="bfloat16", num_layers=2, kv_heads=2, head_size=64, block_size=16,
                     layout="cpu", chunk_size=64, cache_salt=salt)


def registered(*namespaces: Namespace) -> dict[bytes, Namespace]:
    return {ns.fingerprint(): ns for ns in namespaces}


def acl_allows(pattern: str, key: str) -> bool:
    """Whether an ACL key pattern (`~glob`) grants `key` (Redis globs: these patterns use `*` only)."""
    return fnmatch.fnmatchcase(key, pattern.removeprefix("~"))


def test_the_default_tenant_keeps_the_layout_from_before_tenants():
    ns, key, gen = os.urandom(16), os.urandom(16), os.urandom(8)
    base = tenant_base(PREFIX, "*")
    assert key_name(base, ns, key, "h") == f"{PREFIX}:{ns.hex()}:{{{key.hex()}}}:h"
    assert part_key_name(base, ns, key, gen, 3) == f"{PREFIX}:{ns.hex()}:{{{key.hex()}}}:{gen.hex()}:3"


def test_a_named_tenant_s_keys_live_under_its_own_base():
    ns, key = os.urandom(16), os.urandom(16)
    assert key_name(tenant_base(PREFIX, "team-a"), ns, key, "a") == f"{PREFIX}:t:team-a:{ns.hex()}:{{{key.hex()}}}:a"


@pytest.mark.parametrize("bad", ["a:b", "a*", "a?", "[a]", "", "a b", "x" * 129])
def test_a_name_that_could_not_be_told_apart_in_an_acl_pattern_is_refused(bad):
    with pytest.raises(ValueError, match="cannot name remote keys"):
        tenant_base(PREFIX, bad)


def test_one_tenant_s_acl_pattern_grants_its_keys_and_no_other_tenant_s():
    ns, key = os.urandom(16), os.urandom(16)
    keys = {t: key_name(tenant_base(PREFIX, t), ns, key, "h") for t in ("a", "ab", "a.b", "b", "*")}
    allowed = {t for t, k in keys.items() if acl_allows(acl_key_pattern(PREFIX, "a"), k)}
    assert allowed == {"a"}
    assert acl_key_pattern(PREFIX, "a") == f"~{PREFIX}:t:a:*"
    # The default tenant's pattern is the one of docs/remote.md's ACL line: every key under the prefix.
    assert acl_key_pattern(PREFIX, "*") == f"~{PREFIX}:*"
    assert all(acl_allows(acl_key_pattern(PREFIX, "*"), k) for k in keys.values())


def test_a_namespace_s_base_follows_its_salt():
    a, a_request, engine_a, other, plain = (namespace(s) for s in ("team-a", "eng|team-a", "team-a|req-7",
                                                                   "team-c", ""))
    tenancy = Tenancy(PREFIX, ["team-a", "team-b", "*"], registered(a, a_request, engine_a, other, plain).get)
    for ns in (a, a_request, engine_a):
        assert tenancy.tenant(ns.fingerprint()) == "team-a"
        assert tenancy.base(ns.fingerprint()) == f"{PREFIX}:t:team-a"
    for ns in (other, plain):  # not a named tenant: the default tenant's layout
        assert tenancy.tenant(ns.fingerprint()) == "*"
        assert tenancy.base(ns.fingerprint()) == PREFIX


def test_without_tenant_names_nothing_is_looked_up():
    def lookup(fp: bytes) -> Namespace | None:
        raise AssertionError("looked up")

    tenancy = Tenancy(PREFIX, ["*"], lookup)
    fp = os.urandom(16)
    assert tenancy.base(fp) == PREFIX and tenancy.known(fp)
    assert tenancy.clear_patterns(None) == [f"{PREFIX}:*"]
    assert tenancy.clear_patterns(fp) == [f"{PREFIX}:{fp.hex()}:*"]


def test_a_namespace_not_registered_cannot_be_named_and_a_known_one_is_remembered():
    a = namespace("team-a")
    known = registered(a)
    tenancy = Tenancy(PREFIX, ["team-a"], known.get)
    stranger = os.urandom(16)
    assert not tenancy.known(stranger)
    with pytest.raises(UnknownNamespace):
        tenancy.base(stranger)
    assert tenancy.known(a.fingerprint())
    known.clear()  # forgotten by L1 after the tier saw it: its keys are still named alike
    assert tenancy.base(a.fingerprint()) == f"{PREFIX}:t:team-a"


def test_clear_patterns_cover_each_tenant_then_everything():
    a, plain = namespace("team-a"), namespace("")
    tenancy = Tenancy(PREFIX, ["team-b", "team-a"], registered(a, plain).get)
    assert tenancy.clear_patterns(None) == [f"{PREFIX}:t:team-a:*", f"{PREFIX}:t:team-b:*", f"{PREFIX}:*"]
    fa, fp = a.fingerprint(), plain.fingerprint()
    assert tenancy.clear_patterns(fa) == [f"{PREFIX}:t:team-a:{fa.hex()}:*"]
    assert tenancy.clear_patterns(fp) == [f"{PREFIX}:{fp.hex()}:*"]
    stranger = os.urandom(16)  # tenant unknown: wherever it may be
    assert tenancy.clear_patterns(stranger) == [f"{PREFIX}:t:team-a:{stranger.hex()}:*",
                                                f"{PREFIX}:t:team-b:{stranger.hex()}:*", f"{PREFIX}:{stranger.hex()}:*"]


def test_the_config_names_the_quota_tables_tenants_and_the_remote_ones():
    config = ServerConfig(remote_url="redis://127.0.0.1:6379", l1_tenant_quotas="a=10%,*=0:50%,b=1MiB",
                          l2_tenant_quotas="d=1MiB,b=5%", remote_tenants=" c, a ,*,")
    config.validate()
    assert config.remote_tenant_names() == ("a", "b", "d", "c")
    assert config.remote_options().tenants == ("a", "b", "d", "c")
    assert ServerConfig(remote_url="redis://127.0.0.1:6379").remote_options().tenants == ()


@pytest.mark.parametrize(("flags", "message"), [
    ({"remote_tenants": "a:b"}, "--remote-tenants: tenant 'a:b' cannot name remote keys"),
    ({"l1_tenant_quotas": "team:x=10%"}, "--l1-tenant-quotas: tenant 'team:x' cannot name remote keys"),
    ({"l2_tenant_quotas": "team:y=1GiB"}, "--l2-tenant-quotas: tenant 'team:y' cannot name remote keys"),
    ({"remote_tenants": ",".join(f"t{i}" for i in range(65))}, "--remote-tenants: at most 64 tenants")])
def test_the_config_refuses_tenants_that_cannot_have_a_remote_base(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(remote_url="redis://127.0.0.1:6379", **flags).validate()
    ServerConfig(**flags).validate()  # without a remote tier, no remote key prefix to refuse
