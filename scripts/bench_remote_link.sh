#!/usr/bin/env bash
# The remote tier's break-even on a throttled link (issue 15, check 4c). A manual bench, run as root (network
# namespaces, tc); not a CI test.
#
#   bash scripts/bench_remote_link.sh [RATE]     # RATE: the throttled link's tbf rate (default 1gbit)
#
# A network namespace with a veth pair (host 10.213.0.1 <-> namespace 10.213.0.2) and a redis-server inside it;
# then two phases, "throttled" (tc tbf RATE on both ends of the pair; netem does not exist on this kernel) and
# "unthrottled" (no qdisc). Each phase starts two kvtier servers on the host with --remote-url at that Redis
# and a prefix of their own: node A stores a warm-up prompt and a test prompt of Llama-3.1-8B-shaped chunks
# (KV_BYTES_PER_TOKEN 128 KiB x 256 tokens = 32 MiB a chunk); node B reads the warm-up prompt from the remote
# tier (so that B has measured the tier's read bandwidth), then looks up the test prompt: the reply carries
# `bw` and `rtt`, and LookupResult.tokens_faster_than(KV bytes/token x PREFILL_TOKENS_PER_S, the prefill rate)
# decides what the vLLM connector would load. B then loads the hit anyway, to show its time against the
# prefill time of the same tokens. One table at the end; the namespace, Redis and servers go on exit (trap).
#
# Env: PREFILL_TOKENS_PER_S (default 2000), KV_BYTES_PER_TOKEN (131072), PY (the python with kvtier; default
# .venv/bin/python), REDIS_SERVER (default redis-server), REDIS_PORT (6379).
set -euo pipefail

RATE="${1:-1gbit}"
PREFILL="${PREFILL_TOKENS_PER_S:-2000}"
PER_TOKEN="${KV_BYTES_PER_TOKEN:-131072}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
SERVER="${REDIS_SERVER:-redis-server}"
PORT="${REDIS_PORT:-6379}"
NS="kvtier-link-$$"
HOST_IF="kvl$$h"
NS_IF="kvl$$n"
HOST_IP=10.213.0.1
NS_IP=10.213.0.2
WORK="$(mktemp -d /tmp/kvtier-link.XXXXXX)"

log() { echo "[bench_remote_link] $*" >&2; }

[[ "$(id -u)" == 0 ]] || { log "run as root (ip netns, tc)"; exit 1; }
command -v "$SERVER" >/dev/null || { log "$SERVER not found (bash scripts/redis_env.sh install)"; exit 1; }
[[ -x "$PY" ]] || { log "no python at $PY (bash scripts/dev_env.sh, or set PY)"; exit 1; }

cleanup() {
    if [[ -f "$WORK/redis.pid" ]]; then
        kill "$(cat "$WORK/redis.pid")" 2>/dev/null || true
        sleep 0.3
    fi
    ip netns del "$NS" 2>/dev/null || true  # the veth pair goes with it
    ip link del "$HOST_IF" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$NS"
ip link add "$HOST_IF" type veth peer name "$NS_IF"
ip link set "$NS_IF" netns "$NS"
ip addr add "$HOST_IP/24" dev "$HOST_IF"
ip link set "$HOST_IF" up
ip netns exec "$NS" ip addr add "$NS_IP/24" dev "$NS_IF"
ip netns exec "$NS" ip link set "$NS_IF" up
ip netns exec "$NS" ip link set lo up
ip netns exec "$NS" "$SERVER" --bind "$NS_IP" --port "$PORT" --protected-mode no --save '' --appendonly no \
    --daemonize yes --dir "$WORK" --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log"
for _ in $(seq 100); do
    [[ "$(redis-cli -h "$NS_IP" -p "$PORT" ping 2>/dev/null)" == PONG ]] && break
    sleep 0.1
done
[[ "$(redis-cli -h "$NS_IP" -p "$PORT" ping)" == PONG ]] || { log "redis-server in $NS does not answer"; exit 1; }
URL="redis://$NS_IP:$PORT"

shape() {  # $1: a tbf rate, or "" for none
    local dev
    for dev in "$HOST_IF" "ns:$NS_IF"; do
        local run=() name="$dev"
        if [[ "$dev" == ns:* ]]; then run=(ip netns exec "$NS"); name="${dev#ns:}"; fi
        "${run[@]}" tc qdisc del dev "$name" root 2>/dev/null || true
        if [[ -n "$1" ]]; then
            "${run[@]}" tc qdisc add dev "$name" root tbf rate "$1" burst 256kb latency 50ms
        fi
    done
}

phase() {  # $1: the phase's name; one JSON line
    cd "$REPO"
    "$PY" - "$URL" "$1" "$PREFILL" "$PER_TOKEN" <<'PYEOF'
import json, sys, time, uuid

import numpy as np
from kvtier.connector.client import ClientConfig, KVTierClient
from kvtier.server.bench import common as bc
from kvtier.server.keys import Namespace
from kvtier.server.tiers.remote.tier import RemoteTier

url, link, prefill, per_token = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
ns = Namespace(model="meta-llama/Llama-3.1-8B", dtype="bfloat16", num_layers=32, kv_heads=8, head_size=128,
               block_size=16, layout="NHD", chunk_size=256)
size = per_token * ns.chunk_size
WARM, TEST = 2, 4  # chunks of the warm-up prompt and of the test prompt
rng = np.random.default_rng(7)
warm, test = (rng.integers(0, 1 << 31, n * ns.chunk_size, dtype=np.int64) for n in (WARM, TEST))
payload = rng.integers(0, 256, size, dtype=np.uint8)
prefix = f"kvtier-link-{uuid.uuid4().hex[:8]}"
extra = ["--remote-url", url, "--remote-prefix", prefix]
servers = [bc.start_server(1.0, extra), bc.start_server(1.0, extra)]


def connect(server):
    c = KVTierClient(ClientConfig(url=server.url, strict=True, request_timeout_s=120.0))
    c.connect()
    return c


def settled(c, tokens):
    deadline = time.monotonic() + 60
    while (found := c.lookup(ns, tokens)).pending:
        assert time.monotonic() < deadline, "lookup stayed pending"
        time.sleep(0.01)
    return found


try:
    a, b = connect(servers[0]), connect(servers[1])
    t0 = time.perf_counter()
    for tokens in (warm, test):
        res = a.store(ns, tokens, lambda _c: size, lambda _ch, span: span.write(0, payload))
        assert res.stored == len(tokens) // ns.chunk_size, res
    deadline = time.monotonic() + 300
    while not ((s := a.stats())["remote_inflight"] == 0 and s["remote_queue_depth"] == 0
               and s["remote_written"] == WARM + TEST):
        assert time.monotonic() < deadline, f"A's remote writes did not drain: {s}"
        time.sleep(0.02)
    write_s = time.perf_counter() - t0
    found = settled(b, warm)
    assert found.tiers == ["remote"] * WARM, found.tiers
    assert b.retrieve_chunks(ns, found.hits, lambda _rc: None) == WARM * ns.chunk_size // ns.block_size
    t0 = time.perf_counter()
    found = settled(b, test)
    assert found.tiers == ["remote"] * TEST, found.tiers
    kept = found.tokens_faster_than(per_token * prefill, prefill)
    loaded = b.retrieve_chunks(ns, found.hits, lambda _rc: None) * ns.block_size
    load_s = time.perf_counter() - t0
    print(json.dumps({"link": link, "read_MBps": found.bandwidth["remote"] / 1e6,
                      "rtt_ms": found.rtt.get("remote", 0.0) * 1e3, "write_MBps": (WARM + TEST) * size / write_s / 1e6,
                      "break_even_MBps": per_token * prefill / 1e6, "hit_tokens": found.tokens, "kept_tokens": kept,
                      "loaded_tokens": loaded, "load_s": load_s, "prefill_s": found.tokens / prefill}))
    a.close()
    b.close()
finally:
    for s in servers:
        s.stop()
    tier = RemoteTier(url, prefix=prefix)
    tier.clear(None)
    tier.close()
PYEOF
}

log "throttled: tbf $RATE on both ends of the veth pair"
shape "$RATE"
phase "tbf $RATE" >"$WORK/rows.jsonl"
log "unthrottled: no qdisc"
shape ""
phase "unthrottled" >>"$WORK/rows.jsonl"

"$PY" - "$WORK/rows.jsonl" <<'PYEOF'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
r0 = rows[0]
print(f"remote tier break-even: {r0['hit_tokens']} tokens of Llama-3.1-8B-shaped KV (128 KiB/token, 32 MiB chunks) "
      f"from the remote tier; prefill at {r0['hit_tokens'] / r0['prefill_s']:.0f} tokens/s -> break-even "
      f"{r0['break_even_MBps']:.0f} MB/s")
head = ("link", "write MB/s", "read MB/s", "rtt ms", "hit tok", "kept tok", "decision", "load s", "prefill s")
print("  ".join(f"{h:>12}" for h in head))
for r in rows:
    decision = "take" if r["kept_tokens"] == r["hit_tokens"] else "skip" if r["kept_tokens"] == 0 else "partial"
    cells = (r["link"], f"{r['write_MBps']:.0f}", f"{r['read_MBps']:.0f}", f"{r['rtt_ms']:.2f}", r["hit_tokens"],
             r["kept_tokens"], decision, f"{r['load_s']:.2f}", f"{r['prefill_s']:.2f}")
    print("  ".join(f"{c:>12}" for c in cells))
PYEOF
