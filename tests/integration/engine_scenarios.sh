#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Transfer-engine integration scenarios on real rxe: separate prefill and
# decode processes (tools/kvw-xfer), every byte checked by decode, WRs posted
# checked against the plan by prefill. Runs inside the test bed.
# Usage: engine_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"

# scenario NAME "PREFILL_DEV PREFILL_IP" "DECODE_DEV DECODE_IP" DECODERS ARGS...
scenario() {
    name=$1 pdev=$2 pip=$3 ddev=$4 dip=$5 ndec=$6
    shift 6
    echo "[ RUN      ] $name: $pdev ($pip) -> $ddev ($dip), $ndec decode engine(s): $*"
    rm -f "$work/bs"
    "$xfer" prefill --dev "$pdev" --ip "$pip" --embed-bootstrap "$work/bs" --decoders "$ndec" \
        "$@" >"$work/prefill.log" 2>&1 &
    ppid=$!
    pids=""
    k=0
    # "auto": no device name, so the engine finds it from the IP (librdmacm)
    if [ "$ddev" = auto ]; then devopt=""; else devopt="--dev $ddev"; fi
    while [ $k -lt "$ndec" ]; do
        # shellcheck disable=SC2086
        "$xfer" decode $devopt --ip "$dip" --bootstrap-file "$work/bs" \
            --decoder-index $k "$@" >"$work/decode$k.log" 2>&1 &
        pids="$pids $!"
        k=$((k + 1))
    done
    rc=0
    for p in $pids; do wait "$p" || rc=1; done
    wait "$ppid" || rc=1
    sed 's/^/    prefill| /' "$work/prefill.log" | grep -v '^    prefill| room' || true
    for f in "$work"/decode*.log; do
        grep -E 'FAILED|decode:|kvwire\[[0-9.]*\] ERROR' "$f" | sed "s#^#    $(basename "$f" .log)| #"
    done
    rm -f "$work"/decode*.log
    result "$name" $rc
}

echo "[==========] engine scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
for topo in same cross; do
    if [ $topo = same ]; then d=$dev0 dip_=$ip0; else d=$dev1 dip_=$ip1; fi
    scenario "llama-like 32 layers x 2 KiB items, fragmented, aux, 4 in flight ($topo)" \
        "$dev0" "$ip0" "$d" "$dip_" 1 \
        --layers 32 --item 2048 --pool 256 --pages 48 --requests 8 --inflight 4 \
        --contig 4 --dst-contig 3 --aux-item 256 --aux-items 8 --seed 11
    scenario "32 layers x 16 KiB items, contiguous runs of 16 ($topo)" \
        "$dev0" "$ip0" "$d" "$dip_" 1 \
        --layers 32 --item 16384 --pool 64 --pages 16 --requests 4 --inflight 2 \
        --contig 16 --dst-contig 16 --seed 12
done
scenario "many rooms in flight: 32 small requests at once, one page each side random" \
    "$dev0" "$ip0" "$dev1" "$ip1" 1 \
    --layers 4 --item 4096 --pool 512 --pages 8 --requests 64 --inflight 32 \
    --contig 1 --dst-contig 1 --aux-item 64 --aux-items 32 --seed 13
scenario "two decode engines against one prefill, decode device found from its IP" \
    "$dev0" "$ip0" auto "$ip1" 2 \
    --layers 8 --item 2048 --pool 128 --pages 24 --requests 6 --inflight 3 \
    --contig 5 --dst-contig 2 --aux-item 128 --aux-items 4 --seed 14

echo "[ RUN      ] idle prefill poller wakes at most 5 times a second over 10 s"
rm -f "$work/bs"
"$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" --layers 2 --pool 16 \
    --pages 4 --requests 1 --idle-check 10 >"$work/idle.log" 2>&1 &
ppid=$!
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" --layers 2 --pool 16 \
    --pages 4 --requests 1 >/dev/null 2>&1
rc=$?
wait $ppid || rc=1
grep -E 'idle poller' "$work/idle.log" | sed 's/^/    /'
result "idle poller" $rc

echo "[ RUN      ] layout mismatch is refused with a clear error, nothing posted"
rm -f "$work/bs"
KVW_BOOTSTRAP_TIMEOUT_MS=4000 "$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" \
    --layers 2 --item 2048 --pool 16 --pages 4 --requests 1 >"$work/mm-p.log" 2>&1 &
ppid=$!
"$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" --layers 2 --item 4096 \
    --pool 16 --pages 4 --requests 1 >"$work/mm-d.log" 2>&1
drc=$?
wait $ppid
prc=$?
grep -E 'FAILED' "$work/mm-d.log" | sed 's/^/    decode| /'
grep -E 'prefill:' "$work/mm-p.log" | sed 's/^/    prefill| /'
rc=1
if [ $drc -ne 0 ] && [ $prc -ne 0 ] && grep -q 'item length' "$work/mm-d.log" &&
    grep -q ' 0 WRs' "$work/mm-p.log"; then rc=0; fi
result "layout mismatch" $rc

echo "[ RUN      ] dead prefill: decode fails within a bounded time, no hang"
rm -f "$work/bs"
"$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" --layers 2 --pool 16 \
    --pages 4 --requests 1 >/dev/null 2>&1 &
ppid=$!
start=$(date +%s)
# Rooms 2 and 3 (one in flight) each wait out the bootstrap timeout: 10 s,
# so that a hang, not two 30 s defaults back to back, is what the 60 s
# bound catches.
KVW_PEER_TIMEOUT_MS=3000 KVW_TRANSFER_TIMEOUT_MS=20000 KVW_BOOTSTRAP_TIMEOUT_MS=10000 \
    "$xfer" decode --dev "$dev1" --ip "$ip1" \
    --bootstrap-file "$work/bs" --layers 2 --pool 16 --pages 4 --requests 3 --inflight 1 \
    >"$work/dead.log" 2>&1
drc=$?
wait $ppid
took=$(( $(date +%s) - start ))
grep -E 'FAILED|decode:' "$work/dead.log" | sed 's/^/    decode| /'
echo "    decode gave up after ${took} s"
rc=1
if [ $drc -ne 0 ] && grep -q '1/3 requests ok' "$work/dead.log" && [ "$took" -lt 60 ]; then rc=0; fi
result "dead prefill" $rc

echo "[ RUN      ] kvwire-info on rxe (text and --json)"
"$build/kvwire-info" --ip "$ip0" && "$build/kvwire-info" --json >"$work/info.json"
result "kvwire-info" $?

rm -rf "$work"
echo "[==========] engine scenarios: $passed passed, $failed failed"
[ $failed -eq 0 ]
