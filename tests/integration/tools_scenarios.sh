#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The operator tools on real rxe, inside the test bed: kvwire-info --check
# (the self-test before the first transfer) passing on the test bed's
# devices and failing, with its reason and exit 1, when a check is made to
# fail for real (a port down through tests/tools/kvw-tb-link; the memlock
# limit lowered with ulimit -l and CAP_IPC_LOCK dropped); and kvwire-bench's
# two-host mode (--server / --client, as ib_write_bw's) between two devices,
# and its one-host mode.
# Usage: tools_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
info=$build/kvwire-info bench=$build/kvwire-bench
link=$(dirname "$0")/../tools/kvw-tb-link

echo "[==========] tool scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?})"

# check_out NAME WANT_RC PATTERN... : run before, the output in $work/check.log,
# the exit status in $crc; every PATTERN (grep -E) must be in the output.
check_out() {
    name=$1 want=$2
    shift 2
    rc=0
    sed 's/^/    /' "$work/check.log"
    [ "$crc" -eq "$want" ] || { echo "    exit $crc, want $want"; rc=1; }
    for pat in "$@"; do
        grep -qE -- "$pat" "$work/check.log" || { echo "    missing: $pat"; rc=1; }
    done
    result "$name" $rc
}

echo "[ RUN      ] kvwire-info --check on $dev0 ($ip0)"
"$info" --check --dev "$dev0" --ip "$ip0" >"$work/check.log" 2>&1
crc=$?
check_out "kvwire-info --check passes on $dev0" 0 \
    "^  \[ OK \] port 1: ACTIVE, Ethernet \(RoCE\)$" \
    "^  \[ OK \] GID index [0-9]+ \(::ffff:$ip0, RoCEv2 on [^)]*\): RoCE v2 on the interface's IPv4 address \(--ip $ip0\)" \
    "^  \[ OK \] MTU [0-9]+" \
    "^  \[ OK \] loopback RDMA write: 64 KiB written from QP 0x[0-9a-f]+ to QP 0x[0-9a-f]+ on GID [0-9]+, bytes match$" \
    "^  \[ OK \] memlock limit" \
    "^kvwire-info --check: ok \(0 failed"

# The GID --check reports is the one an engine uses (both open the device
# with the library's kvw__dev_open): kvw-xfer's "engine on" line names it.
gid=$(sed -n 's/^  \[ OK \] GID index \([0-9]*\) .*/\1/p' "$work/check.log")
echo "[ RUN      ] a transfer from $dev0 uses the GID --check named ($gid)"
rm -f "$work/bs"
L="--layers 2 --item 4096 --pool 16 --pages 4 --requests 2 --seed 41"
# shellcheck disable=SC2086
"$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" $L >"$work/check.log" 2>&1 &
p=$!
# shellcheck disable=SC2086
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" $L --deadline-s 120 \
    >"$work/d.log" 2>&1
crc=$?
wait $p || crc=1
check_out "kvwire-info --check's GID is the transfer's" 0 "engine on $dev0 \(GID index $gid\)"

echo "[ RUN      ] kvwire-info --check on every device"
"$info" --check >"$work/check.log" 2>&1
crc=$?
check_out "kvwire-info --check passes on every device" 0 "^$dev1:$" "^kvwire-info --check: ok"

echo "[ RUN      ] kvwire-info --check under ulimit -l 64, without CAP_IPC_LOCK"
if command -v setpriv >/dev/null 2>&1; then
    (ulimit -l 64 && setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock \
        "$info" --check --dev "$dev0") >"$work/check.log" 2>&1
    crc=$?
    check_out "kvwire-info --check fails on a low memlock limit" 1 \
        "^  \[FAIL\] memlock limit: 65536 bytes, below the 67108864 an engine pins" \
        "^  \[FAIL\] loopback RDMA write: ibv_reg_mr of 64 KiB: Cannot allocate memory" \
        "^kvwire-info --check: FAILED \(2 failed"
else
    echo "[  SKIPPED ] no setpriv (util-linux) to drop CAP_IPC_LOCK"
fi

if [ "${KVW_TB_NDEV:-1}" -ge 4 ] && [ -n "${KVW_TB_NETDEV2:-}" ]; then
    echo "[ RUN      ] kvwire-info --check with $KVW_TB_DEV2's link down (kvw-tb-link)"
    "$link" flap "$KVW_TB_NETDEV2" 15 >"$work/link.log" 2>&1 &
    lpid=$!
    n=0
    until grep -q ' down \[at' "$work/link.log" 2>/dev/null || [ $n -ge 300 ]; do
        sleep 0.1
        n=$((n + 1))
    done
    "$info" --check --dev "$KVW_TB_DEV2" >"$work/check.log" 2>&1
    crc=$?
    wait $lpid || echo "    kvw-tb-link: $(cat "$work/link.log")"
    check_out "kvwire-info --check fails on a port that is down" 1 \
        "^  \[FAIL\] port 1: down, not ACTIVE: bring its link/netdev up$" \
        "^kvwire-info --check: FAILED \(1 failed"
else
    echo "[  SKIPPED ] port down: needs the test bed's 4 devices (KVW_TB_NETDEV2)"
fi

# kvwire-bench across two devices as across two hosts: the server (prefill)
# waits on ip0, the client (decode) connects, sends the workload, runs it,
# verifies every byte and reports; the server exits after the run.
echo "[ RUN      ] kvwire-bench --server on $dev0 ($ip0), --client on $dev1 ($ip1)"
port=18530
"$bench" --server --dev0 "$dev0" --ip0 "$ip0" --port $port >"$work/server.log" 2>&1 &
spid=$!
n=0
until grep -q 'waiting for a client' "$work/server.log" 2>/dev/null || [ $n -ge 300 ]; do
    sleep 0.1
    n=$((n + 1))
done
"$bench" --client "$ip0:$port" --dev1 "$dev1" --ip1 "$ip1" --layers 4 --tokens 64 \
    --requests 6 --warmup 1 --inflight 2 --workload fragmented --quiet --json \
    >"$work/check.log" 2>&1
crc=$?
wait $spid
src=$?
sed 's/^/    server| /' "$work/server.log"
[ $src -eq 0 ] || { echo "    server exit $src"; crc=1; }
check_out "kvwire-bench two hosts (server/client)" 0 \
    '"workload":"fragmented","layers":4,"pages":64' '"requests":6' '"bad_bytes":0,"ok":true'

# The one-host mode on the same link (prefill forked, pipes between them).
echo "[ RUN      ] kvwire-bench on one host: $dev0 ($ip0) -> $dev1 ($ip1)"
"$bench" --dev0 "$dev0" --ip0 "$ip0" --dev1 "$dev1" --ip1 "$ip1" --layers 4 --tokens 64 \
    --requests 6 --warmup 1 --inflight 2 --quiet --json >"$work/check.log" 2>&1
crc=$?
check_out "kvwire-bench one host" 0 '"workload":"contiguous","layers":4,"pages":64' \
    '"bad_bytes":0,"ok":true'

rm -rf "$work"
echo "[==========] tool scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
