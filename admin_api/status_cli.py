"""`kvtier status`: a terminal summary of a server's GET /status (stdlib only: urllib for HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8080"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"admin API base URL (default {DEFAULT_URL})")
    parser.add_argument("--json", action="store_true", help="print the raw /status JSON")
    parser.add_argument("--timeout", type=float, default=5.0, help="HTTP timeout in seconds (default 5)")


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:  # noqa: S310 - operator's URL
            status = json.load(response)
    except urllib.error.HTTPError as exc:
        print(f"kvtier status: {url} answered HTTP {exc.code}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"kvtier status: cannot read {url}: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        print(render(status))
    return 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    s = int(s)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {s}s"
    return f"{minutes}m {s}s" if minutes else f"{s}s"


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=False))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def render_l2(l2: dict[str, Any]) -> list[str]:
    if not l2.get("l2_enabled"):
        return ["L2  off"]
    cap, used = l2.get("l2_capacity_bytes", 0), l2.get("l2_used_bytes", 0)
    pct = f" ({100 * used / cap:.0f}%)" if cap else ""

    def rate(key: str) -> str:
        bw = l2.get(key, 0.0)
        return f"{human_bytes(bw)}/s" if bw else "not measured"

    return [
        f"L2  {human_bytes(used)} used of {human_bytes(cap)}{pct}, {l2.get('l2_entries', 0)} chunks; "
        f"read {rate('l2_read_bytes_per_s')}, write {rate('l2_write_bytes_per_s')}",
        f"    {l2.get('l2_queue_depth', 0)} queued writes, {l2.get('l2_dropped_writes', 0)} dropped, "
        f"{l2.get('l2_promoted', 0)} promoted ({l2.get('l2_promoting', 0)} in flight), "
        f"{l2.get('l2_corrupt_chunks', 0)} corrupt removed",
    ]


def render_remote(remote: dict[str, Any]) -> list[str]:
    cap, used = remote.get("remote_capacity_bytes", 0), remote.get("remote_used_bytes", 0)
    of = f"{human_bytes(cap)} ({100 * used / cap:.0f}%)" if cap else "no limit"
    breakers, paused = remote.get("remote_breakers_open", []), remote.get("remote_writes_paused", [])
    return [
        f"remote  {remote.get('remote_url', '?')}  rtt {1e3 * remote.get('remote_rtt_s', 0.0):.2f} ms",
        f"    {human_bytes(used)} used of {of} (whole store), {remote.get('remote_entries', 0)} chunks known; "
        f"{remote.get('remote_written', 0)} written, {remote.get('remote_existing_writes', 0)} existing, "
        f"{remote.get('remote_skipped_writes', 0)} skipped",
        f"    {remote.get('remote_missing_chunks', 0)} missing, {remote.get('remote_corrupt_chunks', 0)} corrupt, "
        f"{remote.get('remote_timeouts', 0)} timeouts, {remote.get('remote_errors', 0)} errors, "
        f"{remote.get('remote_rejected_calls', 0)} rejected calls",
        f"    breakers open: {', '.join(breakers) or 'none'}; writes paused: {', '.join(paused) or 'none'}",
    ]


def render_tier(tier: dict[str, Any]) -> list[str]:
    """Any other tier: its name and its numeric fields (prefix dropped), so a new tier shows without a CLI change."""
    name = str(tier.get("name", "?"))
    fields = [f"{k.removeprefix(name + '_')} {v}" for k, v in tier.items()
              if isinstance(v, int | float) and not isinstance(v, bool)]
    return [f"{name}  {', '.join(fields) or 'no numeric fields'}"]


RENDERERS = {"l2": render_l2, "remote": render_remote}


def render_tiers(status: dict[str, Any]) -> list[str]:
    """Every lower tier of /status `tiers`, in lookup order ("L2  off" where there is none, as before `tiers`;
    a server older than `tiers`: its `l2` key)."""
    tiers = status.get("tiers")
    if tiers is None:
        return render_l2(status.get("l2", {}))
    lines = [] if any(t.get("name") == "l2" for t in tiers) else render_l2({})
    for tier in tiers:
        lines += RENDERERS.get(tier.get("name", ""), render_tier)(tier)
    return lines


def render(status: dict[str, Any]) -> str:
    l1 = status.get("l1", {})
    cap, used = l1.get("capacity_bytes", 0), l1.get("used_bytes", 0)
    pct = f" ({100 * used / cap:.1f} %)" if cap else ""
    out = [
        f"kvtier {status.get('version', '?')}  up {human_seconds(status.get('uptime_s', 0))}  "
        f"policy {status.get('policy', '?')}  log level {status.get('log_level', '?')}",
        f"endpoints: {', '.join(status.get('endpoints', []))}",
        "",
        f"L1  {human_bytes(used)} used of {human_bytes(cap)}{pct}  (segment {human_bytes(l1.get('segment_bytes', 0))}, "
        f"pages of {human_bytes(l1.get('page_size', 0))})",
        f"    {l1.get('entries', 0)} chunks, {human_bytes(l1.get('pinned_bytes', 0))} pinned, "
        f"{l1.get('leases', 0)} leases, {l1.get('reservations', 0)} open writes",
        *render_tiers(status),
        "",
    ]
    namespaces = status.get("namespaces", [])
    rows = [[ns.get("fingerprint", "")[:12], str(ns.get("model", ""))[:40], str(ns.get("dtype", "")),
             f"{ns.get('tp_rank', 0)}/{ns.get('tp_size', 1)}", str(ns.get("entries", 0)),
             human_bytes(ns.get("bytes", 0)), human_bytes(ns.get("pinned_bytes", 0))] for ns in namespaces]
    out.append(f"Namespaces ({len(namespaces)})")
    if rows:
        out.append(table(["NAMESPACE", "MODEL", "DTYPE", "TP", "CHUNKS", "BYTES", "PINNED"], rows, {4, 5, 6}))
    clients = status.get("clients", [])
    out += ["", f"Clients ({len(clients)})"]
    if clients:
        rows = [[str(c.get("instance", ""))[:48], str(c.get("pid", "")), str(c.get("state", "")),
                 f"{c.get('last_seen_s_ago', 0):.1f}s ago", str(c.get("leases", 0)), str(c.get("reservations", 0)),
                 human_bytes(c.get("held_back_bytes", 0))]
                for c in clients]
        out.append(table(["INSTANCE", "PID", "STATE", "LAST SEEN", "LEASES", "WRITES", "HELD BACK"], rows,
                         {1, 3, 4, 5, 6}))
    return "\n".join(out)
