#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Rails on real rxe: one prefill and one decode engine, each on both of the
# test bed's devices (KVW_DEVICES), separate processes (tools/kvw-xfer).
# Prefill's rail 0 (rxe0) pairs with decode's rail 0 (rxe1) and its rail 1
# (rxe1) with decode's rail 1 (rxe0), so both rails cross the veth pair.
# Decode checks every byte; prefill checks the WRs against the plan and
# prints the WRs each rail carried: both must have carried some.
# Usage: rails_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"

echo "[==========] rails on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
if [ "$dev0" = "$dev1" ]; then
    echo "[  SKIPPED ] rails need two devices (kvw-testbed --devices 2)"
    exit 0
fi

# rails NAME QPS ARGS...: one transfer over two rails per engine.
rails() {
    name=$1 qps=$2
    shift 2
    echo "[ RUN      ] $name: prefill $dev0+$dev1, decode $dev1+$dev0, $qps QP(s) per rail: $*"
    rm -f "$work/bs"
    KVW_DEVICES="$dev0,$dev1" KVW_QPS_PER_PEER=$qps "$xfer" prefill --dev "$dev0" --ip "$ip0" \
        --embed-bootstrap "$work/bs" --decoders 1 "$@" >"$work/rails-p.log" 2>&1 &
    ppid=$!
    KVW_DEVICES="$dev1,$dev0" KVW_QPS_PER_PEER=$qps "$xfer" decode --dev "$dev1" --ip "$ip1" \
        --bootstrap-file "$work/bs" --decoder-index 0 "$@" >"$work/rails-d.log" 2>&1
    rc=$?
    wait "$ppid" || rc=1
    sed 's/^/    prefill| /' "$work/rails-p.log" | grep -v '^    prefill| room' || true
    grep -E 'FAILED|decode:|kvwire\[[0-9.]*\] ERROR' "$work/rails-d.log" | sed 's/^/    decode| /'
    used=$(grep -cE '^prefill: rail [01] .*: [1-9][0-9]* WRs' "$work/rails-p.log")
    if [ "$used" -ne 2 ]; then
        echo "    expected WRs on both rails, $used rail(s) carried some"
        rc=1
    fi
    result "$name" $rc
}

rails "two rails, 32 layers x 16 KiB items, 4 in flight" 1 \
    --layers 32 --item 16384 --pool 256 --pages 32 --requests 8 --inflight 4 \
    --contig 4 --dst-contig 3 --aux-item 256 --aux-items 8 --seed 21
rails "two rails, two QPs each, small fragmented requests" 2 \
    --layers 8 --item 4096 --pool 256 --pages 16 --requests 16 --inflight 8 \
    --contig 1 --dst-contig 2 --aux-item 64 --aux-items 16 --seed 22

echo "[==========] rails: $passed passed, $failed failed"
rm -rf "$work"
[ "$failed" -eq 0 ]
