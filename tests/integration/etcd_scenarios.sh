#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The etcd registry (KVW_REGISTRY) on real rxe: separate prefill and
# decode processes (tests/tools/kvw-xfer) whose decode engines find prefill
# only through a three-member etcd cluster on loopback (tests/etcd/
# etcd-cluster.sh, Debian's etcd-server from the host's read-only /, data
# in the guest's scratch directory): decode is given a bootstrap address
# nothing listens on. Transfers, then a follower and then the leader
# killed while transfers run and a second decode engine starts after the
# kill (0 failed requests); a prefill killed (its key gone, decode told
# why) and started again. Skipped (passing) in a build without the etcd
# backend. Runs inside the test bed.
# Usage: etcd_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
ctl=$(cd "$(dirname "$0")/../etcd" && pwd -P)/etcd-cluster.sh

echo "[==========] etcd registry scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
if [ ! -e "$build/etcd-1.stamp" ]; then
    echo "[  SKIPPED ] kvwire is built without the etcd registry (ETCD=0)"
    exit 0
fi
edir=$work/etcd
if ! eps=$("$ctl" start "$edir"); then
    tail -5 "$edir"/m*.log
    result "etcd cluster on loopback" 1
    exit 1
fi
trap '"$ctl" stop "$edir"' EXIT
export KVW_REGISTRY="etcd://$eps/rxe"
echo "    etcd cluster: $eps"

# scenario NAME KILL(none|follower|leader) ARGS...: prefill with two decode
# engines; the second starts after KILL.
scenario() {
    name=$1 kill=$2
    shift 2
    echo "[ RUN      ] $name"
    rm -f "$work/bs"
    "$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" --decoders 2 "$@" \
        >"$work/prefill.log" 2>&1 &
    ppid=$!
    n=0
    until [ -s "$work/bs" ] || [ $n -ge 600 ]; do # registered in etcd by then
        sleep 0.1
        n=$((n + 1))
    done
    rm -f "$work/ready0"
    "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap 127.0.0.1:9 --decoder-index 0 "$@" \
        --ready-file "$work/ready0" >"$work/decode0.log" 2>&1 &
    d0=$!
    rc=0
    if [ "$kill" != none ]; then
        # Kill once decode 0's first bytes landed (it found the rank through
        # etcd and is connected): its other requests still run, however
        # fast the guest is (a fixed sleep outlasted the run on an idle one).
        n=0
        until [ -e "$work/ready0" ] || ! kill -0 "$d0" 2>/dev/null || [ $n -ge 600 ]; do
            sleep 0.05
            n=$((n + 1))
        done
        if ! kill -0 "$d0" 2>/dev/null; then
            echo "    decode 0 ended before the kill: nothing ran across it"
            rc=1
        fi
        "$ctl" kill "$kill" "$edir" >/dev/null || rc=1
        echo "    etcd $kill killed while decode 0 ran"
    fi
    "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap 127.0.0.1:9 --decoder-index 1 "$@" \
        >"$work/decode1.log" 2>&1 &
    d1=$!
    wait "$d0" || rc=1
    wait "$d1" || rc=1
    wait "$ppid" || rc=1
    for f in "$work/prefill.log" "$work"/decode*.log; do
        grep -E 'FAILED|failed|decode:|kvwire (ERROR|WARN)' "$f" | sed "s#^#    $(basename "$f" .log)| #"
    done
    if [ "$kill" != none ]; then "$ctl" revive "$edir" || rc=1; fi
    result "$name" $rc
}

args="--layers 8 --item 2048 --pool 128 --pages 24 --requests 48 --inflight 2 --contig 5 \
--dst-contig 2 --aux-item 128 --aux-items 4"
# shellcheck disable=SC2086
scenario "ranks found through etcd only" none $args --seed 31
# shellcheck disable=SC2086
scenario "an etcd follower killed mid-run" follower $args --seed 32
# shellcheck disable=SC2086
scenario "the etcd leader killed mid-run" leader $args --seed 33

# A prefill killed (SIGKILL: no revoke) after serving decode 0: its key
# goes when its lease (3 s here) runs out, a new decode engine's request
# for the rank fails with the reason; a prefill started again (another
# port) is found by the next decode engine.
echo "[ RUN      ] a prefill killed, then started again on a new port"
rc=0
rm -f "$work/bs"
# shellcheck disable=SC2086
KVW_BOOTSTRAP_REFRESH_MS=1000 "$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap \
    "$work/bs" --decoders 2 $args --seed 34 >"$work/prefill.log" 2>&1 &
ppid=$!
n=0
until [ -s "$work/bs" ] || [ $n -ge 600 ]; do
    sleep 0.1
    n=$((n + 1))
done
# shellcheck disable=SC2086
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap 127.0.0.1:9 --decoder-index 0 $args \
    --seed 34 >"$work/decode0.log" 2>&1 || rc=1
grep -E 'decode:' "$work/decode0.log" | sed 's/^/    decode0| /'
kill -KILL $ppid
wait $ppid 2>/dev/null
t0=$(date +%s)
n=0
while ETCDCTL_API=3 etcdctl --endpoints "$eps" get /rxe/rank/0 | grep -q . && [ $n -lt 300 ]; do
    sleep 0.1
    n=$((n + 1))
done
if ETCDCTL_API=3 etcdctl --endpoints "$eps" get /rxe/rank/0 | grep -q .; then
    echo "    rank 0's key is still there 30 s after the kill"
    rc=1
else
    echo "    rank 0's key went $(($(date +%s) - t0)) s after the kill (lease 3 s)"
fi
# shellcheck disable=SC2086
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap 127.0.0.1:9 --decoder-index 1 $args \
    --requests 1 --seed 34 >"$work/decode1.log" 2>&1 && rc=1
if grep -q 'is not registered at etcd://' "$work/decode1.log"; then
    grep -m1 'is not registered' "$work/decode1.log" | sed 's/^/    decode1| /'
else
    tail -3 "$work/decode1.log" | sed 's/^/    decode1 (no reason)| /'
    rc=1
fi
rm -f "$work/bs"
# shellcheck disable=SC2086
"$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" --decoders 1 $args \
    --seed 35 >"$work/prefill2.log" 2>&1 &
ppid=$!
n=0
until [ -s "$work/bs" ] || [ $n -ge 600 ]; do
    sleep 0.1
    n=$((n + 1))
done
# shellcheck disable=SC2086
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap 127.0.0.1:9 --decoder-index 0 $args \
    --seed 35 >"$work/decode2.log" 2>&1 || rc=1
wait $ppid || rc=1
grep -E 'decode:' "$work/decode2.log" | sed 's/^/    decode2| /'
result "a prefill killed, then started again on a new port" $rc

echo "[==========] etcd scenarios: $passed passed, $failed failed"
rm -rf "$work"
[ "$failed" -eq 0 ]
