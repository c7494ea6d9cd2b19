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


LABELS = {"l2": "L2"}  # display labels; any other tier shows under its name
# What AttachedTier reports for every tier (`<name>_<field>`), shown in the same two lines for each.
COMMON = ("enabled", "entries", "used_bytes", "capacity_bytes", "queue_depth", "inflight", "written",
          "dropped_writes", "cleared_writes", "corrupt_chunks", "evictions", "promoted", "promoting",
          "promoting_bytes", "promotion_failures", "promotions_expired", "promotions_stuck", "clear_failures",
          "read_bytes_per_s", "write_bytes_per_s")
TENANT_FACTS = ("tenant_quotas", "tenants")  # a tier's tenants (the L2 tier's): its own table below it


def _fact(key: str, value: Any) -> str:
    name = key.replace("_", " ")
    if isinstance(value, list):
        return f"{name}: {', '.join(map(str, value)) or 'none'}"
    if isinstance(value, bool):
        return f"{name} {'yes' if value else 'no'}"
    return f"{value:.3g} {name}" if isinstance(value, float) else f"{value} {name}"


def render_tier(tier: dict[str, Any]) -> list[str]:
    """One lower tier of /status `tiers`, the same way for any tier (so a new tier shows without a CLI change):
    its label, text facts (a URL, a path), usage and bandwidth, the counts every tier has, then its own facts
    (fields beyond COMMON, prefix dropped)."""
    name = str(tier.get("name", "?"))
    own = {k.removeprefix(name + "_"): v for k, v in tier.items() if k != "name"}

    def rate(key: str) -> str:
        bw = own.get(key, 0.0)
        return f"{human_bytes(bw)}/s" if bw else "not measured"

    cap, used = own.get("capacity_bytes", 0), own.get("used_bytes", 0)
    of = f"{human_bytes(cap)} ({100 * used / cap:.0f}%)" if cap else "no limit"
    facts = {k: v for k, v in own.items() if k not in COMMON and k not in TENANT_FACTS}
    texts = [str(v) for v in facts.values() if isinstance(v, str)]
    rest = [_fact(k, v) for k, v in facts.items() if not isinstance(v, str)]
    usage = (f"{human_bytes(used)} used of {of}, {own.get('entries', 0)} chunks; read {rate('read_bytes_per_s')}, "
             f"write {rate('write_bytes_per_s')}")
    return [
        "  ".join([LABELS.get(name, name), *texts, usage]),
        f"    {own.get('written', 0)} written, {own.get('queue_depth', 0)} queued writes, "
        f"{own.get('dropped_writes', 0)} dropped, {own.get('promoted', 0)} promoted ({own.get('promoting', 0)} in "
        f"flight), {own.get('corrupt_chunks', 0)} corrupt",
        *([f"    {', '.join(rest)}"] if rest else []),
        *render_tenants(own, LABELS.get(name, name)),
    ]


def render_tiers(status: dict[str, Any]) -> list[str]:
    """Every lower tier of /status `tiers`, in lookup order ("L2  off" where there is none, as before `tiers`;
    a server older than `tiers`: its `l2` key)."""
    tiers = status.get("tiers")
    if tiers is None:
        l2 = status.get("l2", {})
        tiers = [{"name": "l2", **l2}] if l2.get("l2_enabled") else []
    lines = [] if any(t.get("name") == "l2" for t in tiers) else ["L2  off"]
    for tier in tiers:
        lines += render_tier(tier)
    return lines


def _by_reason(counts: dict[str, int]) -> str:
    """`12 (quota 10, capacity 2)`: the total and its non-zero reasons, largest first."""
    nonzero = sorted(((n, r) for r, n in counts.items() if n), reverse=True)
    total = sum(n for n, _ in nonzero)
    return f"{total} ({', '.join(f'{r} {n}' for n, r in nonzero)})" if total else "0"


def render_tenants(facts: dict[str, Any], tier: str = "L1") -> list[str]:
    """A tier's tenants table (`tenant_quotas` and `tenants`: /status `l1`, or a lower tier's own facts), when
    it has a quota table (docs/tenants.md); the hit ratio where the rows count tokens (L1's)."""
    if not facts.get("tenant_quotas"):
        return []
    tenants = facts.get("tenants", [])
    hits = any("requested_tokens" in t for t in tenants)
    rows = []
    for t in tenants:
        asked = t.get("requested_tokens", 0)
        ratio = [f"{100 * t.get('hit_tokens', 0) / asked:.1f} %" if asked else "-"] if hits else []
        rows.append([str(t.get("tenant", "?"))[:32], human_bytes(t.get("used_bytes", 0)),
                     human_bytes(t.get("guaranteed_bytes", 0)), human_bytes(t.get("max_bytes", 0)),
                     str(t.get("entries", 0)), *ratio, _by_reason(t.get("evictions", {})),
                     _by_reason(t.get("refused", {}))])
    headers = ["TENANT", "USED", "GUARANTEED", "MAX", "CHUNKS", *(["HIT RATIO"] if hits else []), "EVICTIONS",
               "REFUSED"]
    return ["", f"Tenants in {tier} ({facts['tenant_quotas']})", table(headers, rows, {1, 2, 3, 4, 5} if hits
                                                                         else {1, 2, 3, 4})]


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
        *render_tenants(l1),
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
