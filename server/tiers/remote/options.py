"""The remote tier's own options: its --remote-url parsed (`RemoteUrl`), how it reaches the store beyond the
URL (`RemoteAccess`: TLS, password file, where reads go), the tenants given their own key prefix
(`tenant_names`), and `RemoteOptions`, everything the tier is made with (server/config.py fills it from its
--remote-* flags and the quota tables). Nothing of glide: config.py imports this."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

from kvtier.server.tenants import DEFAULT_TENANT, MAX_TENANTS, QuotaTable
from kvtier.server.tiers.remote.layout import tenant_base

READ_FROM = ("primary", "prefer_replica", "az_affinity")  # --remote-read-from: glide's ReadFrom of the same name
_SCHEMES = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
            "rediss+cluster": (True, True)}  # scheme -> (TLS, cluster)
DEFAULT_REDIS_PORT = 6379


@dataclass(frozen=True)
class RemoteUrl:
    """A parsed --remote-url: the nodes to connect to (a Cluster's are seeds; a standalone primary and its
    replicas with --remote-read-from), TLS, credentials, database."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool = False
    cluster: bool = False
    username: str = ""
    password: str = field(default="", repr=False)
    db: int = 0

    def redacted(self) -> str:
        """The URL without its password, for logs and messages."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = f"{self.username}@" if self.username else ""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{user}{hosts}" + (f"/{self.db}" if self.db else "")


@dataclass(frozen=True)
class RemoteAccess:
    """How the remote tier reaches its store beyond the URL: TLS files, a password file, where reads go."""

    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    password_file: str = ""
    read_from: str = "primary"
    az: str = ""

    def validate(self, url: RemoteUrl) -> None:
        """ValueError naming the flag when these settings do not fit `url` or a file cannot be read."""
        if (self.tls_ca_file or self.tls_cert_file or self.tls_key_file) and not url.tls:
            raise ValueError("--remote-tls-* files need a TLS URL: rediss:// or rediss+cluster://")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("--remote-tls-cert-file and --remote-tls-key-file go together")
        if self.password_file and url.password:
            raise ValueError("--remote-password-file replaces the password in --remote-url: give only one")
        if self.read_from not in READ_FROM:
            raise ValueError(f"--remote-read-from must be one of {', '.join(READ_FROM)}")
        if not url.cluster and len(url.nodes) > 1 and self.read_from == "primary":
            raise ValueError("--remote-url names several hosts: use redis+cluster:// (or rediss+cluster://) for a "
                             "Cluster; a standalone primary and its replicas go with --remote-read-from "
                             "prefer_replica or az_affinity")
        if (self.read_from == "az_affinity") != bool(self.az):
            raise ValueError("--remote-az goes with --remote-read-from az_affinity (and it needs one)")
        for flag, path in (("--remote-tls-ca-file", self.tls_ca_file), ("--remote-tls-cert-file", self.tls_cert_file),
                           ("--remote-tls-key-file", self.tls_key_file),
                           ("--remote-password-file", self.password_file)):
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{flag}: cannot read {path}")
        if self.password_file and not Path(self.password_file).read_text().rstrip("\r\n"):
            raise ValueError(f"--remote-password-file: {self.password_file} is empty")
        for flag, path, what in (("--remote-tls-ca-file", self.tls_ca_file, "CERTIFICATE"),
                                 ("--remote-tls-cert-file", self.tls_cert_file, "CERTIFICATE"),
                                 ("--remote-tls-key-file", self.tls_key_file, "PRIVATE KEY")):
            if path and f"{what}-----".encode() not in Path(path).read_bytes():
                raise ValueError(f"{flag}: {path} holds no PEM {what.lower()}")


def parse_remote_url(url: str) -> RemoteUrl:
    """--remote-url's value; ValueError (never showing the password) when it is not one of the documented forms."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ValueError("--remote-url must start with redis://, rediss://, redis+cluster:// or rediss+cluster://")
    tls, cluster = _SCHEMES[scheme.lower()]
    userinfo, _, rest = rest.rpartition("@")
    hosts, _, db_text = rest.partition("/")
    username, _, password = userinfo.partition(":")
    nodes = tuple(_host_port(h) for h in hosts.split(","))
    if (db_text and not db_text.isdigit()) or (cluster and db_text.strip("0")):
        raise ValueError("--remote-url: the database (after /) must be a non-negative integer, and 0 for a Cluster")
    db = int(db_text) if db_text else 0
    return RemoteUrl(nodes, tls, cluster, unquote(username), unquote(password), db)


def tenant_names(prefix: str, tables: dict[str, str], extra: str) -> tuple[str, ...]:
    """The tenants whose keys get their own prefix: those the quota `tables` (flag -> its text) name, then the
    comma-separated `extra` (--remote-tenants), each once, the default tenant left out; ValueError naming the
    flag for a bad table or a name that cannot be a key prefix (layout.tenant_base)."""
    names: list[str] = []
    for flag, text in [*tables.items(), ("--remote-tenants", extra)]:
        try:
            if flag == "--remote-tenants":
                given = [n.strip() for n in text.split(",") if n.strip()]
                if len(given) > MAX_TENANTS:
                    raise ValueError(f"at most {MAX_TENANTS} tenants")
            else:
                given = list(QuotaTable.parse(text).names)
            for name in given:
                if name != DEFAULT_TENANT:
                    tenant_base(prefix, name)
                    names.append(name)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return tuple(dict.fromkeys(names))


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host or any(c in host for c in " /?#[]"):
        raise ValueError(f"--remote-url: bad host {text!r}")
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--remote-url: the port of {host} must be in 1..65535")
    return host, int(port) if port else DEFAULT_REDIS_PORT


@dataclass(frozen=True)
class RemoteOptions:
    """What the remote tier is made with (`RemoteTier.__init__`'s arguments, the flags' defaults)."""

    url: str
    prefix: str = "kvtier"
    ttl_s: float = 86400.0
    timeout_ms: int = 200
    connect_timeout_ms: int = 1000
    breaker_threshold: int = 5
    breaker_reset_s: float = 5.0
    queue_depth: int = 256
    access: RemoteAccess = field(default_factory=lambda: RemoteAccess())
    tenants: tuple[str, ...] = ()  # tenants whose keys live under <prefix>:t:<tenant> (tenancy.py)
