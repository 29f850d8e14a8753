#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A three-member etcd cluster on loopback for the registry tests, from
# Debian's etcd-server: its own data directories under DIR, free ports
# picked at start, every member killed by `stop` (and by the driver's
# trap). Nothing outside DIR is touched.
#
#   etcd-cluster.sh start DIR       start m0..m2; prints the client URLs
#   etcd-cluster.sh endpoints DIR   "127.0.0.1:p0,127.0.0.1:p1,127.0.0.1:p2"
#   etcd-cluster.sh kill leader|follower DIR
#                                   SIGKILL one member (the leader, or one
#                                   that is not); prints its index
#   etcd-cluster.sh kill-member N DIR  SIGKILL member N
#   etcd-cluster.sh revive DIR      start again every member not running
#   etcd-cluster.sh auth DIR USER PASSWORD PREFIX
#                                   a root user, USER with read-write on
#                                   PREFIX only, and authentication on
#   etcd-cluster.sh stop DIR        kill every member
set -euo pipefail

MEMBERS=3

die() {
    echo "etcd-cluster: $*" >&2
    exit 1
}

free_ports() { # N free TCP ports on 127.0.0.1
    python3 -c '
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

client_port() { cat "$DIR/m$1.client"; }
peer_port() { cat "$DIR/m$1.peer"; }

cluster_spec() {
    local i spec=""
    for ((i = 0; i < MEMBERS; i++)); do
        spec+="${spec:+,}m$i=http://127.0.0.1:$(peer_port "$i")"
    done
    echo "$spec"
}

running() { # member index
    local pid
    [[ -f $DIR/m$1.pid ]] || return 1
    pid=$(cat "$DIR/m$1.pid")
    # A killed member whose parent has gone may linger as a zombie.
    [[ -r /proc/$pid/status ]] && ! grep -qs '^State:[[:space:]]*Z' "/proc/$pid/status" &&
        [[ -r /proc/$pid/status ]]
}

start_member() { # index, cluster state (new/existing)
    local i=$1
    # Fast elections: a killed leader is replaced within about a second.
    # Auth tokens (once auth is on) last 1 s: clients must log in again.
    etcd --name "m$i" --data-dir "$DIR/m$i" \
        --listen-client-urls "http://127.0.0.1:$(client_port "$i")" \
        --advertise-client-urls "http://127.0.0.1:$(client_port "$i")" \
        --listen-peer-urls "http://127.0.0.1:$(peer_port "$i")" \
        --initial-advertise-peer-urls "http://127.0.0.1:$(peer_port "$i")" \
        --initial-cluster "$(cluster_spec)" --initial-cluster-state "$2" \
        --initial-cluster-token "kvw-test-$$" \
        --heartbeat-interval 100 --election-timeout 1000 \
        --auth-token-ttl 1 \
        >>"$DIR/m$i.log" 2>&1 &
    echo $! >"$DIR/m$i.pid"
}

endpoints() {
    local i eps=""
    for ((i = 0; i < MEMBERS; i++)); do
        eps+="${eps:+,}127.0.0.1:$(client_port "$i")"
    done
    echo "$eps"
}

ctl() { ETCDCTL_API=3 etcdctl --dial-timeout 2s --command-timeout 5s --endpoints "$(endpoints)" "$@"; }

wait_healthy() {
    local out deadline=$((SECONDS + 30))
    # Bounded by the clock, not a count: one etcdctl call may take seconds.
    while ((SECONDS < deadline)); do
        if out=$(ctl endpoint health 2>&1); then
            return 0
        fi
        # With authentication on, a member that answers "user name is
        # empty" committed the health check's proposal far enough: it is up.
        if ! grep -v -e 'is healthy' -e 'user name is empty' -e '^Error: unhealthy cluster' \
            <<<"$out" | grep -q .; then
            return 0
        fi
        sleep 0.2
    done
    ctl endpoint health >&2 || true
    die "the cluster in $DIR did not become healthy within 30 s (logs: $DIR/m*.log)"
}

is_leader() { # index: etcdctl's simple status, field 5 is IS LEADER
    ETCDCTL_API=3 etcdctl --dial-timeout 2s --endpoints "127.0.0.1:$(client_port "$1")" \
        endpoint status 2>/dev/null | awk -F', ' '{print $5}' | grep -qx true
}

cmd=${1:-}
DIR=${2:-}
[[ -n $cmd && -n $DIR ]] || die "usage: etcd-cluster.sh start|endpoints|kill|revive|auth|stop DIR ..."
case $cmd in
start)
    command -v etcd >/dev/null || die "etcd not found: install the Debian package etcd-server"
    command -v etcdctl >/dev/null || die "etcdctl not found: install the Debian package etcd-client"
    mkdir -p "$DIR"
    read -r -a ports <<<"$(free_ports $((2 * MEMBERS)))"
    for ((i = 0; i < MEMBERS; i++)); do
        echo "${ports[$((2 * i))]}" >"$DIR/m$i.client"
        echo "${ports[$((2 * i + 1))]}" >"$DIR/m$i.peer"
    done
    for ((i = 0; i < MEMBERS; i++)); do start_member "$i" new; done
    wait_healthy
    endpoints
    ;;
endpoints) endpoints ;;
kill)
    which=$DIR
    DIR=${3:?}
    for ((i = 0; i < MEMBERS; i++)); do
        running "$i" || continue
        role=follower
        if is_leader "$i"; then role=leader; fi
        if [[ $role == "$which" ]]; then
            kill -KILL "$(cat "$DIR/m$i.pid")"
            wait "$(cat "$DIR/m$i.pid")" 2>/dev/null || true
            echo "$i"
            exit 0
        fi
    done
    die "no running $which"
    ;;
kill-member)
    i=$DIR
    DIR=${3:?}
    running "$i" || die "member $i is not running"
    kill -KILL "$(cat "$DIR/m$i.pid")"
    # SIGKILL is delivered asynchronously: until the member is gone, a
    # revive right after this would take it for running and not start it.
    for ((t = 0; t < 100; t++)); do
        running "$i" || exit 0
        sleep 0.05
    done
    die "member $i still runs 5 s after SIGKILL"
    ;;
revive)
    for ((i = 0; i < MEMBERS; i++)); do
        running "$i" || start_member "$i" existing
    done
    wait_healthy
    ;;
auth)
    user=${3:?} password=${4:?} prefix=${5:?}
    ctl user add "root:root-$$" >/dev/null
    ctl user grant-role root root >/dev/null
    ctl user add "$user:$password" >/dev/null
    ctl role add kvw-rw >/dev/null
    ctl role grant-permission --prefix=true kvw-rw readwrite "$prefix/" >/dev/null
    ctl user grant-role "$user" kvw-rw >/dev/null
    ctl auth enable >/dev/null
    ;;
stop)
    for ((i = 0; i < MEMBERS; i++)); do
        if running "$i"; then kill -KILL "$(cat "$DIR/m$i.pid")" 2>/dev/null || true; fi
    done
    ;;
*) die "unknown command $cmd" ;;
esac
