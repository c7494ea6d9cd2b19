"""Server configuration: one dataclass is the single source of every flag, KVTIER_* variable and TOML key.

Precedence: command-line flag > environment variable > `--config` TOML file > built-in default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any

from kvtier.server.eviction import DEFAULT_POLICY, POLICIES
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
    shm_dir: str = _opt("/dev/shm", "tmpfs directory of the L1 segment; a tmpfs mounted with huge=within_size "
                                    "gives L1 huge pages (docs/operations.md)")
    shm_name: str = _opt("", "shared-memory segment name in --shm-dir (default kvtier-<port>)")
    shm_mode: str = _opt("600", "octal permission bits of the shared-memory segment")
    http_host: str = _opt("127.0.0.1", "admin HTTP address")
    http_port: int = _opt(8080, "admin HTTP port (0 disables the admin API)")
    admin_token: str = _opt("", "bearer token for the admin API and non-loopback binds", secret=True)
    log_level: str = _opt("info", "log level", choices=["debug", "info", "warning", "error"])
    l2_path: str = _opt("", "directory of the L2 filesystem tier (empty: no L2)")
    l2_size_gb: float = _opt(10.0, "L2 capacity in GiB (chunk files, headers included)")
    l2_odirect: bool = _opt(False, "open L2 files with O_DIRECT (aligned buffers; buffered if the filesystem refuses it)")
    l2_queue_depth: int = _opt(1024, "chunks the L2 write-behind queue holds before L2 copies are dropped")
    l2_eviction_policy: str = _opt("lru", "eviction policy of the L2 tier", choices=sorted(POLICIES))
    gpu_pin_piece_mb: int = _opt(256, "GPU engines: L1 is page-locked (cudaHostRegister) in pieces of this many "
                                      "MiB; no DMA entry crosses a piece")
    gpu_op_timeout_s: float = _opt(10.0, "GPU engines: seconds a copy may take (event wait included) before its "
                                         "copier counts as hung and is restarted")
    gpu_watchdog_s: float = _opt(5.0, "GPU engines: seconds without a copier heartbeat before it is restarted")
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
        if self.gpu_pin_piece_mb <= 0 or self.gpu_op_timeout_s <= 0 or self.gpu_watchdog_s <= 0:
            raise ValueError("--gpu-pin-piece-mb, --gpu-op-timeout-s and --gpu-watchdog-s must be positive")
        if self.l2_path and (self.l2_bytes <= 0 or self.l2_queue_depth <= 0):
            raise ValueError("--l2-size-gb and --l2-queue-depth must be positive when --l2-path is set")


def env_name(name: str) -> str:
    return "KVTIER_" + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with any of the keys below (underscored names)")
    for f in dataclasses.fields(ServerConfig):
        kind = type(f.default)
        if kind is bool:
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                help=f"{f.metadata['help']} (env {env_name(f.name)}=0/1, default {f.default!r})",
            )
            continue
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=kind,
            default=None,
            choices=f.metadata.get("choices"),
            help=f"{f.metadata['help']} (env {env_name(f.name)}, default {f.default!r})",
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
