"""Server configuration: one dataclass is the single source of every flag, KVTIER_* variable and TOML key.

Precedence: command-line flag > environment variable > `--config` TOML file > built-in default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvtier.server.eviction import DEFAULT_POLICY, POLICIES
from kvtier.server.tenants import QuotaTable
from kvtier.server.tiers.fs import FsOptions
from kvtier.server.tiers.remote.options import (
    READ_FROM,
    RemoteAccess,
    RemoteOptions,
    parse_remote_url,
    tenant_names,
)
from kvtier.shm.segment import tmpfs_options

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ServerConfig:
    l1_size_gb: float = _opt(1.0, "L1 shared-memory pool size in GiB (an exact budget)")
    host: str = _opt("127.0.0.1", "address of the ZeroMQ request port (loopback by default)")
    port: int = _opt(5555, "ZeroMQ request port (tcp)")
    ipc_path: str = _opt("", "also listen on this ipc:// socket path (same-node clients)")
    chunk_size: int = _opt(256, "default chunk size in tokens announced to clients")
    page_size_kb: int = _opt(64, "L1 page size in KiB: a chunk takes ceil(size/page) pages")
    eviction_policy: str = _opt(DEFAULT_POLICY, "eviction policy", choices=sorted(POLICIES))
    lease_ttl_s: float = _opt(30.0, "seconds a read lease (lookup pin / acquire) holds a chunk")
    reservation_ttl_s: float = _opt(30.0, "seconds a write reservation stays open before reclaim")
    client_timeout_s: float = _opt(15.0, "seconds without a request or heartbeat before a client is dropped")
    l1_prefault: bool = _opt(True, "back all of L1 with memory in the background at start-up, so that no "
                                   "store pays first-touch page faults (the L1 memory is committed at once)")
    l1_adopt: bool = _opt(True, "warm restart: at start, adopt the L1 segment a stopped or killed server left (same "
                                "name, size and page size) and serve its chunks again; a clean stop then keeps "
                                "the segment and its journal (docs/warm-restart.md)")
    l1_discard: bool = _opt(False, "start with an empty L1 this time even if the old one could be adopted (its "
                                   "segment is removed and its memory freed)")
    shm_dir: str = _opt("/dev/shm", "tmpfs directory of the L1 segment; a tmpfs mounted with huge=within_size "
                                    "gives L1 huge pages (docs/operations.md)")
    shm_name: str = _opt("", "shared-memory segment name in --shm-dir (default kvtier-<port>)")
    shm_mode: str = _opt("600", "octal permission bits of the shared-memory segment")
    http_host: str = _opt("127.0.0.1", "admin HTTP address")
    http_port: int = _opt(8080, "admin HTTP port (0 disables the admin API)")
    admin_token: str = _opt("", "bearer token for the admin API and non-loopback binds", secret=True)
    log_level: str = _opt("info", "log level", choices=["debug", "info", "warning", "error"])
    l1_tenant_quotas: str = _opt("", "per-tenant L1 quotas: NAME=GUARANTEED[:MAXIMUM],... each in bytes (512MiB) or "
                                     "a share of L1 in percent; `*` names every other tenant (docs/tenants.md; empty: "
                                     "no quotas)")
    hint_max_retain_s: float = _opt(3600.0, "longest a request's `retain_s` hint keeps its chunks (0: retain_s is "
                                            "ignored; docs/hints.md)")
    hint_max_sessions: int = _opt(4096, "live sessions (request hint `session`) kept at once; a store naming one "
                                        "more is stored but not kept")
    hint_session_idle_s: float = _opt(600.0, "seconds without a store after which a session ends by itself")
    l2_path: str = _opt("", "directory of the L2 filesystem tier (empty: no L2)")
    l2_size_gb: float = _opt(10.0, "L2 capacity in GiB (chunk files, headers included)")
    l2_odirect: bool = _opt(False, "open L2 files with O_DIRECT (aligned buffers; buffered if the filesystem refuses it)")
    l2_queue_depth: int = _opt(1024, "chunks the L2 write-behind queue holds before L2 copies are dropped")
    l2_eviction_policy: str = _opt("lru", "eviction policy of the L2 tier", choices=sorted(POLICIES))
    l2_tenant_quotas: str = _opt("", "per-tenant L2 quotas, NAME=GUARANTEED[:MAXIMUM],... in bytes or percent of "
                                     "--l2-size-gb (empty: none; docs/l2.md, \"Tenants\")")
    remote_url: str = _opt("", "Redis >= 7 / Valkey >= 8 remote tier shared by nodes: redis://[user:password@]"
                                "host:port[/db], rediss:// for TLS, redis+cluster://host:port,host:port,... "
                                "(rediss+cluster:// for TLS) for a Cluster (empty: no remote tier)", secret=True)
    remote_prefix: str = _opt("kvtier", "first part of every remote key; nodes share chunks under one prefix")
    remote_ttl_s: float = _opt(86400.0, "seconds a remote chunk lives after it is written (0: no TTL; the store's "
                                        "maxmemory policy then must be allkeys-*)")
    remote_timeout_ms: int = _opt(200, "floor of every remote call's timeout in ms; a transfer gets 4x its time at "
                                       "the measured bandwidth when that is longer")
    remote_connect_timeout_ms: int = _opt(1000, "floor of a remote connection's setup timeout in ms (TCP, TLS, AUTH: "
                                               "several round trips when cold)")
    remote_queue_depth: int = _opt(256, "chunks the remote write-behind queue holds before remote copies are dropped")
    remote_breaker_threshold: int = _opt(5, "consecutive failed calls (timeouts, lost connections) to one remote node "
                                            "that open its circuit breaker")
    remote_breaker_reset_s: float = _opt(5.0, "seconds an open breaker waits before a PING probes its node; while "
                                              "open, the node's reads are misses and its writes are dropped")
    remote_tls_ca_file: str = _opt("", "PEM file of the CA certificates that sign the remote store's certificate "
                                       "(rediss:// only; empty: the system's CAs)")
    remote_tls_cert_file: str = _opt("", "PEM client certificate presented to the remote store (rediss:// only, "
                                         "for a store with tls-auth-clients; with --remote-tls-key-file)")
    remote_tls_key_file: str = _opt("", "PEM private key of --remote-tls-cert-file")
    remote_password_file: str = _opt("", "file holding the remote store's password (e.g. a mounted Kubernetes "
                                         "Secret), instead of one in --remote-url: read again when it changes and "
                                         "given to every open connection, without a restart")
    remote_read_from: str = _opt("primary", "where the remote tier reads chunks: a replica's reads that find a "
                                            "chunk missing or damaged are confirmed on the primary (a replica "
                                            "may lag); writes and deletes always go to the primary",
                                 choices=list(READ_FROM))
    remote_az: str = _opt("", "this node's availability zone, for --remote-read-from az_affinity (replicas in "
                              "this zone first)")
    remote_tenants: str = _opt("", "tenants (comma-separated) whose remote keys get their own prefix "
                                   "<prefix>:t:<tenant> without a quota; those the tenant quota tables name get "
                                   "one too (docs/remote.md, \"Tenants\")")
    extra_tiers: str = _opt("", "lower tiers after L2 and the remote tier, comma-separated: module:factory or "
                                "module:factory=ARG, each a factory(ARG, metrics) -> LowerTier (docs/architecture.md, "
                                "\"Adding a tier\"; empty: none)")
    events_endpoint: str = _opt("", "publish what the cache stores and removes on this ZeroMQ PUB address "
                                    "(tcp://host:port or ipc://path; vLLM's KV-event framing, docs/events.md; "
                                    "empty: no feed). Unauthenticated: it shows chunk keys and the stored "
                                    "prompts' token ids to whoever connects")
    events_replay_endpoint: str = _opt("", "ZeroMQ ROUTER address where feed consumers ask for missed batches "
                                           "or a snapshot (docs/events.md; empty: none)")
    events_buffer_batches: int = _opt(10_000, "event batches the feed keeps for replay")
    events_queue_depth: int = _opt(100_000, "events waiting for the feed's thread before new ones are dropped "
                                            "(counted; consumers are told in the next batch)")
    gpu_pin_piece_mb: int = _opt(256, "GPU engines: L1 is page-locked (cudaHostRegister) in pieces of this many "
                                      "MiB; no DMA entry crosses a piece")
    gpu_op_timeout_s: float = _opt(10.0, "GPU engines: seconds a copy may take (event wait included) before its "
                                         "copier counts as hung and is restarted")
    gpu_watchdog_s: float = _opt(5.0, "GPU engines: seconds without a copier heartbeat before it is restarted")
    gpu_max_copiers: int = _opt(8, "GPU engines: copier processes (one per GPU in use) running or starting at "
                                   "once; a registration naming one GPU more is refused as no_copier")
    host_copies: bool = _opt(True, "CPU engines: accept their workers' registrations so that the server copies "
                                   "a store's blocks out of the worker's memory (process_vm_readv; same user, "
                                   "same PID namespace); off: every CPU worker copies by itself")
    gpu_fake_engine: bool = _opt(False, "accept registrations of the CPU stand-in GPU engine (tests only: it "
                                        "copies from a shared-memory file the client names)")

    @property
    def l2_bytes(self) -> int:
        return int(self.l2_size_gb * (1 << 30))

    @property
    def l1_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30))

    @property
    def page_size(self) -> int:
        return self.page_size_kb * 1024

    @property
    def segment_name(self) -> str:
        return self.shm_name or f"kvtier-{self.port}"

    @property
    def endpoints(self) -> list[str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        out = [f"tcp://{host}:{self.port}"]
        if self.ipc_path:
            out.append(f"ipc://{self.ipc_path}")
        return out

    def validate(self) -> None:
        if self.l1_bytes < self.page_size:
            raise ValueError("--l1-size-gb must hold at least one page")
        if not 0 < self.port < 65536:
            raise ValueError("--port must be in 1..65535")
        if self.chunk_size <= 0 or self.page_size_kb <= 0:
            raise ValueError("--chunk-size and --page-size-kb must be positive")
        if self.eviction_policy not in POLICIES or self.l2_eviction_policy not in POLICIES:
            raise ValueError(f"--eviction-policy and --l2-eviction-policy must be one of {sorted(POLICIES)}")
        if self.host not in LOOPBACK_HOSTS and not self.admin_token:
            raise ValueError(
                f"--host {self.host} is not loopback: set --admin-token (or KVTIER_ADMIN_TOKEN) so clients authenticate"
            )
        if self.http_port and self.http_host not in LOOPBACK_HOSTS and not self.admin_token:
            raise ValueError(
                f"--http-host {self.http_host} is not loopback: set --admin-token (or KVTIER_ADMIN_TOKEN) first"
            )
        int(self.shm_mode, 8)
        tmpfs_options(self.shm_dir)
        if (self.gpu_pin_piece_mb <= 0 or self.gpu_op_timeout_s <= 0 or self.gpu_watchdog_s <= 0
                or self.gpu_max_copiers <= 0):
            raise ValueError("--gpu-pin-piece-mb, --gpu-op-timeout-s, --gpu-watchdog-s and --gpu-max-copiers must "
                             "be positive")
        try:
            QuotaTable.parse(self.l1_tenant_quotas).limits(self.l1_bytes // self.page_size * self.page_size)
        except ValueError as exc:
            raise ValueError(f"--l1-tenant-quotas: {exc}") from None
        if self.hint_max_retain_s < 0 or self.hint_max_sessions < 0 or self.hint_session_idle_s <= 0:
            raise ValueError("--hint-max-retain-s and --hint-max-sessions must be >= 0, --hint-session-idle-s "
                             "positive")
        if self.l2_path and (self.l2_bytes <= 0 or self.l2_queue_depth <= 0):
            raise ValueError("--l2-size-gb and --l2-queue-depth must be positive when --l2-path is set")
        if self.l2_path:
            self.l2_quota_table()
        if self.remote_url:
            self._validate_remote()
        self._validate_events()

    def _validate_events(self) -> None:
        for name, value in (("--events-endpoint", self.events_endpoint),
                            ("--events-replay-endpoint", self.events_replay_endpoint)):
            if value and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} must be a tcp:// or ipc:// ZeroMQ address")
        if self.events_replay_endpoint and not self.events_endpoint:
            raise ValueError("--events-replay-endpoint needs --events-endpoint")
        if self.events_buffer_batches <= 0 or self.events_queue_depth <= 0:
            raise ValueError("--events-buffer-batches and --events-queue-depth must be positive")

    def _validate_remote(self) -> None:
        parse_remote_url(self.remote_url)
        if not _PREFIX_RE.fullmatch(self.remote_prefix):
            raise ValueError("--remote-prefix must be 1-64 of A-Z a-z 0-9 _ - . (it is matched by SCAN patterns)")
        if self.remote_ttl_s < 0 or (0 < self.remote_ttl_s < 0.001):
            raise ValueError("--remote-ttl-s must be 0 (no TTL) or at least 0.001")
        if self.remote_timeout_ms <= 0 or self.remote_connect_timeout_ms <= 0 or self.remote_queue_depth <= 0:
            raise ValueError("--remote-timeout-ms, --remote-connect-timeout-ms and --remote-queue-depth must be "
                             "positive")
        if self.remote_breaker_threshold < 1 or self.remote_breaker_reset_s <= 0:
            raise ValueError("--remote-breaker-threshold must be at least 1 and --remote-breaker-reset-s positive")
        self.remote_access.validate(parse_remote_url(self.remote_url))
        self.remote_tenant_names()

    def remote_tenant_names(self) -> tuple[str, ...]:
        """The tenants whose remote keys have their own prefix (tiers/remote/tenancy.py): those the quota tables
        name, then --remote-tenants'; ValueError naming the flag for a bad table or name."""
        return tenant_names(self.remote_prefix, {"--l1-tenant-quotas": self.l1_tenant_quotas,
                                                 "--l2-tenant-quotas": self.l2_tenant_quotas},
                            self.remote_tenants)

    @property
    def remote_access(self) -> RemoteAccess:
        return RemoteAccess(self.remote_tls_ca_file, self.remote_tls_cert_file, self.remote_tls_key_file,
                            self.remote_password_file, self.remote_read_from, self.remote_az)

    def l2_quota_table(self) -> QuotaTable | None:
        """--l2-tenant-quotas parsed and checked against --l2-size-gb (ValueError naming the flag)."""
        if not self.l2_tenant_quotas.strip():
            return None
        try:
            table = QuotaTable.parse(self.l2_tenant_quotas)
            table.limits(self.l2_bytes)
        except ValueError as exc:
            raise ValueError(f"--l2-tenant-quotas: {exc}") from None
        return table

    def l2_options(self) -> FsOptions:
        """The disk tier's options (server/tiers/fs.py), from the --l2-* flags."""
        return FsOptions(self.l2_path, self.l2_bytes, self.l2_odirect, self.l2_eviction_policy, self.l2_queue_depth,
                         self.l2_quota_table())

    def remote_options(self) -> RemoteOptions:
        """The remote tier's options (server/tiers/remote/options.py), from the --remote-* flags."""
        return RemoteOptions(self.remote_url, self.remote_prefix, self.remote_ttl_s, self.remote_timeout_ms,
                             self.remote_connect_timeout_ms, self.remote_breaker_threshold,
                             self.remote_breaker_reset_s, self.remote_queue_depth, self.remote_access,
                             self.remote_tenant_names())


_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def env_name(name: str) -> str:
    return "KVTIER_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with any of the keys below (underscored names)")
    for f in dataclasses.fields(ServerConfig):
        kind = type(f.default)
        text = f.metadata["help"].replace("%", "%%")  # argparse %-formats help ("30% of L1")
        if kind is bool:
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                help=f"{text} (env {env_name(f.name)}=0/1, default {f.default!r})",
            )
            continue
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=kind,
            default=None,
            choices=f.metadata.get("choices"),
            help=f"{text} (env {env_name(f.name)}, default {f.default!r})",
        )


def from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServerConfig:
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        with open(args.config, "rb") as fh:
            values.update(_checked_file(tomllib.load(fh)))
    for f in dataclasses.fields(ServerConfig):
        kind = type(f.default)
        if env_name(f.name) in environ:
            try:
                values[f.name] = (_bool(environ[env_name(f.name)]) if kind is bool
                                  else kind(environ[env_name(f.name)]))
            except ValueError as exc:
                raise ValueError(f"{env_name(f.name)}: {exc}") from None
        if getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    config = ServerConfig(**values)
    config.validate()
    return config


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 0/1)")


def _checked_file(data: dict[str, Any]) -> dict[str, Any]:
    known = {f.name: f for f in dataclasses.fields(ServerConfig)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"unknown config key {key!r}")
        kind = type(known[name].default)
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise ValueError(f"config key {key!r} must be {kind.__name__}")
        out[name] = value
    return out
