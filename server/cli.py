"""The `kvtier` command. This is the composition root: it wires the admin API into the daemon and
dispatches client-side tools (bench, status) lazily, so the daemon's modules never import them."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import asdict

from kvtier.server import config as server_config

# Subcommands implemented outside the daemon: (group, name) or (name,) -> (module, help). Each module offers
# add_arguments(parser) and run(args) -> int.
TOOLS = {
    ("bench", "trace"): ("kvtier.server.bench.trace", "replay eviction traces against LRU and Belady's optimum"),
    ("bench", "datapath"): ("kvtier.server.bench.datapath", "copy path vs raw memcpy of the same bytes"),
    ("bench", "lookup"): ("kvtier.server.bench.lookup", "lookup round trip vs a bare ZeroMQ+msgpack echo"),
    ("bench", "node"): ("kvtier.server.bench.node", "one daemon driven by N engine-like client processes vs a bare "
                        "ZeroMQ+msgpack echo; the daemon's CPU per op and its saturation point"),
    ("bench", "l2"): ("kvtier.server.bench.l2", "L2 tier write/read vs raw file I/O; L2 promotion vs L1 hit"),
    ("bench", "adopt"): ("kvtier.server.bench.adopt", "warm restart of a full L1: time to ready and first hit; "
                         "the journal's cost on the store path"),
    ("bench", "remote"): ("kvtier.server.bench.remote",
                          "remote tier GET/SET vs the raw glide client; L1 hits and stores with Redis stopped"),
    ("bench", "remote-rtt"): ("kvtier.server.bench.remote_rtt",
                              "remote tier reads vs a raw pipelined glide client at added round trips (a proxy)"),
    ("status",): ("kvtier.admin_api.status_cli", "summarise a running server's admin /status"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Per-node KV-cache server for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    server = sub.add_parser("server", help="run the KV-cache daemon", description="Run the KV-cache daemon.")
    server_config.add_arguments(server)
    segments = sub.add_parser(
        "segments", help="list the kvtier segments in a shared-memory directory; remove those no server holds",
        description="List the kvtier L1 segments in --shm-dir (a stopped or killed server keeps its segment "
                    "for the next start: docs/warm-restart.md) with their size, journal, the memory they hold "
                    "and whether a live server holds them; --remove-unused removes those no live server holds.")
    segments.add_argument("--shm-dir", default=server_config.ServerConfig.shm_dir,
                          help="shared-memory directory (default %(default)s)")
    segments.add_argument("--remove-unused", action="store_true",
                          help="remove every segment (and its journal) that no live server holds")
    segments.add_argument("--json", action="store_true", help="print JSON instead of a table")
    groups: dict[str, argparse._SubParsersAction] = {}
    for names, (module, help_text) in TOOLS.items():
        if len(names) == 1:  # a top-level command: `kvtier status`
            tool = sub.add_parser(names[0], help=help_text, description=help_text)
            tool.set_defaults(tool_module=module)
            _load(module).add_arguments(tool)
            continue
        group, name = names
        if group not in groups:
            groups[group] = sub.add_parser(group, help=f"{group} tools").add_subparsers(dest="tool", required=True)
        tool = groups[group].add_parser(name, help=help_text, description=help_text)
        tool.set_defaults(tool_module=module)
        _load(module).add_arguments(tool)
    return parser


def _load(module: str):  # noqa: ANN202 - a module object
    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "server":
        return _run_server(args)
    if args.command == "segments":
        return _segments(args)
    return int(_load(args.tool_module).run(args) or 0)


def _run_server(args: argparse.Namespace) -> int:
    try:
        config = server_config.from_args(args)
    except (ValueError, OSError) as exc:
        print(f"kvtier server: {exc}", file=sys.stderr)
        return 2
    from kvtier.server import daemon
    from kvtier.server.feed import FeedUnavailable
    from kvtier.shm.segment import NoSpace, SegmentInUse, SegmentMismatch

    services = []
    if config.http_port:
        from kvtier.admin_api.service import AdminService

        services.append(AdminService)
    try:
        return daemon.run(config, services)
    except (SegmentInUse, SegmentMismatch, NoSpace, FeedUnavailable) as exc:
        print(f"kvtier server: {exc}", file=sys.stderr)
        return 2


def _segments(args: argparse.Namespace) -> int:
    from kvtier.shm.segment import list_segments, remove_unused

    try:
        found = remove_unused(args.shm_dir) if args.remove_unused else list_segments(args.shm_dir)
    except OSError as exc:
        print(f"kvtier segments: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(f) for f in found]))
        return 0
    mib = 1 << 20
    print(f"{'segment':40} {'size MiB':>9} {'journal MiB':>12} {'held MiB':>9}  owner")
    for f in found:
        owner = "removed" if args.remove_unused else "live server" if f.live else "none (unused)"
        print(f"{f.name:40} {f.size / mib:9.1f} {f.journal / mib:12.1f} {f.held / mib:9.1f}  {owner}")
    unused = [f for f in found if not f.live]
    print(f"{len(unused)} {'removed' if args.remove_unused else 'unused'}, holding "
          f"{sum(f.held for f in unused) / mib:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
