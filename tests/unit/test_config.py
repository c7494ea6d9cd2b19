"""Server configuration: flag > env > TOML > default; unsafe binds and unknown keys are rejected."""

from __future__ import annotations

import argparse

import pytest
from kvtier.server import config as cfg

pytestmark = pytest.mark.unit


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser)
    return parser.parse_args(argv)


def load(argv: list[str], env: dict[str, str] | None = None) -> cfg.ServerConfig:
    return cfg.from_args(parse(argv), environ=env or {})


def write_toml(tmp_path, text: str) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_source():
    c = load([])
    d = cfg.ServerConfig()
    assert c == d
    assert c.port == 5555 and c.host == "127.0.0.1"


@pytest.mark.parametrize(
    "name, flag, env, toml",
    [
        ("port", "6001", "6002", "6003"),
        ("l1_size_gb", "0.5", "0.25", "2.0"),
        ("eviction_policy", "lru", "lirs", "lru"),
        ("lease_ttl_s", "1.5", "2.5", "3.5"),
        ("log_level", "debug", "warning", '"error"'),
    ],
)
def test_precedence_flag_env_toml_default(tmp_path, name, flag, env, toml):
    kind = type(getattr(cfg.ServerConfig(), name))
    toml_value = toml if kind is not str or toml.startswith('"') else f'"{toml}"'
    path = write_toml(tmp_path, f"{name} = {toml_value}\n")
    flag_args = [cfg.flag_name(name), flag]
    env_map = {cfg.env_name(name): env}
    expected_toml = kind(toml.strip('"'))
    default = getattr(cfg.ServerConfig(), name)

    assert getattr(load([]), name) == default
    assert getattr(load(["--config", path]), name) == expected_toml
    assert getattr(load(["--config", path], env_map), name) == kind(env)
    assert getattr(load(["--config", path, *flag_args], env_map), name) == kind(flag)
    assert getattr(load(flag_args, env_map), name) == kind(flag)
    assert getattr(load([], env_map), name) == kind(env)


def test_sources_combine_per_key(tmp_path):
    path = write_toml(tmp_path, 'port = 7000\nchunk_size = 512\nshm_name = "from-toml"\n')
    c = load(["--config", path, "--chunk-size", "128"], {"KVTIER_PORT": "7001"})
    assert (c.port, c.chunk_size, c.shm_name) == (7001, 128, "from-toml")
    assert c.segment_name == "from-toml"
    assert load(["--port", "7002"]).segment_name == "kvtier-7002"


def test_toml_accepts_dashed_names_and_ints_for_floats(tmp_path):
    path = write_toml(tmp_path, "lease-ttl-s = 4\n")
    c = load(["--config", path])
    assert c.lease_ttl_s == 4.0 and isinstance(c.lease_ttl_s, float)


def test_unknown_toml_key_is_rejected(tmp_path):
    path = write_toml(tmp_path, "port = 7000\nno_such_option = 1\n")
    with pytest.raises(ValueError, match="no_such_option"):
        load(["--config", path])


def test_mistyped_toml_value_is_rejected(tmp_path):
    path = write_toml(tmp_path, 'port = "seven"\n')
    with pytest.raises(ValueError, match="port"):
        load(["--config", path])


def test_mistyped_env_value_is_rejected():
    with pytest.raises(ValueError, match="KVTIER_PORT"):
        load([], {"KVTIER_PORT": "seven"})


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_non_loopback_host_requires_a_token(host):
    with pytest.raises(ValueError, match="admin-token"):
        load(["--host", host])
    c = load(["--host", host], {"KVTIER_ADMIN_TOKEN": "s3cret"})
    assert c.host == host and c.admin_token == "s3cret"


def test_non_loopback_admin_http_requires_a_token():
    with pytest.raises(ValueError, match="admin-token"):
        load(["--http-host", "0.0.0.0"])
    # With the admin API disabled there is nothing to protect.
    assert load(["--http-host", "0.0.0.0", "--http-port", "0"]).http_port == 0
    assert load(["--http-host", "0.0.0.0", "--admin-token", "t"]).admin_token == "t"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_loopback_hosts_need_no_token(host):
    assert load(["--host", host]).host == host


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "0"],
        ["--port", "70000"],
        ["--l1-size-gb", "0.00001"],  # less than one 64 KiB page
        ["--chunk-size", "0"],
        ["--page-size-kb", "0"],
        ["--shm-mode", "9z"],
    ],
)
def test_invalid_values_are_rejected(argv):
    with pytest.raises(ValueError):
        load(argv)


def test_invalid_policy_in_env_is_rejected():
    with pytest.raises(ValueError, match="eviction-policy"):
        load([], {"KVTIER_EVICTION_POLICY": "fifo"})


def test_cli_reports_config_errors_with_exit_code_2(capsys):
    from kvtier.server import cli

    assert cli.main(["server", "--host", "0.0.0.0", "--http-port", "0"]) == 2
    assert "admin-token" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--remote-tls-ca-file", "{file}"], "need a TLS URL"),
    (["--remote-url", "rediss://h:1", "--remote-tls-cert-file", "{file}"], "go together"),
    (["--remote-url", "rediss://h:1", "--remote-tls-ca-file", "{missing}"], "--remote-tls-ca-file: cannot read"),
    (["--remote-url", "rediss://h:1", "--remote-tls-ca-file", "{file}"], "--remote-tls-ca-file: .* no PEM cert"),
    (["--remote-url", "rediss://h:1", "--remote-tls-cert-file", "{pem}", "--remote-tls-key-file", "{pem}"],
     "--remote-tls-key-file: .* no PEM private key"),
    (["--remote-url", "redis://u:pw@h:1", "--remote-password-file", "{file}"], "give only one"),
    (["--remote-password-file", "{empty}"], "is empty"),
    (["--remote-url", "redis://h:1,h:2"], "several hosts"),
    (["--remote-read-from", "az_affinity"], "--remote-az"),
    (["--remote-az", "use1-az1"], "--remote-az"),
])
def test_remote_access_settings_are_checked(tmp_path, extra, message):
    (tmp_path / "f").write_text("secret\n")
    (tmp_path / "e").write_text("\n")
    (tmp_path / "c").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    files = {"file": tmp_path / "f", "empty": tmp_path / "e", "missing": tmp_path / "nope", "pem": tmp_path / "c"}
    argv = ["--remote-url", "redis://h:1", *(a.format(**files) for a in extra)]
    with pytest.raises(ValueError, match=message):
        load(argv)


def test_remote_access_settings_reach_the_tier(tmp_path):
    (tmp_path / "pw").write_text("secret\n")
    (tmp_path / "ca").write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    c = load(["--remote-url", "rediss://u@h:1,h:2", "--remote-read-from", "prefer_replica"],
             env={"KVTIER_REMOTE_PASSWORD_FILE": str(tmp_path / "pw"),
                  "KVTIER_REMOTE_TLS_CA_FILE": str(tmp_path / "ca")})
    assert c.remote_access == cfg.RemoteAccess(tls_ca_file=str(tmp_path / "ca"), password_file=str(tmp_path / "pw"),
                                               read_from="prefer_replica")
