#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Control-plane authentication on real rxe: a cluster key from kvw-keygen,
# given to separate prefill and decode processes (tools/kvw-xfer) through
# KVW_CLUSTER_KEY_FILE. With the key on both sides every byte verifies;
# decode without it, or with another key, and a prefill without it at a
# keyed standalone bootstrap service, fail with a clear error and nothing
# is written. Runs inside the test bed.
# Usage: auth_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"

key=$work/cluster.key
other=$work/other.key
small="--layers 4 --item 2048 --pool 64 --pages 16 --requests 4 --inflight 2 --contig 3 \
--dst-contig 2 --aux-item 128 --aux-items 4 --seed 21"

echo "[==========] control-plane authentication on real RDMA (test bed mode ${KVW_TB_MODE:-?})"

echo "[ RUN      ] kvw-keygen writes a 0600 key file and refuses to overwrite it"
rc=0
"$build/kvw-keygen" "$key" >"$work/keygen.log" 2>&1 || rc=1
"$build/kvw-keygen" "$other" >/dev/null 2>&1 || rc=1
mode=$(stat -c %a "$key" 2>/dev/null)
[ "$mode" = 600 ] || rc=1
before=$(cat "$key")
if "$build/kvw-keygen" "$key" >"$work/keygen2.log" 2>&1; then rc=1; fi
[ "$before" = "$(cat "$key")" ] || rc=1
grep -q 'KVW_CLUSTER_KEY_FILE' "$work/keygen.log" || rc=1
echo "    mode $mode; second run: $(head -n 1 "$work/keygen2.log")"
result "kvw-keygen" $rc

# pair NAME PREFILL_KEYFILE DECODE_KEYFILE (empty: none) ARGS...: runs both
# sides with an embedded bootstrap; sets prc and drc.
pair() {
    pkey=$1 dkey=$2
    shift 2
    rm -f "$work/bs"
    KVW_CLUSTER_KEY_FILE=$pkey "$xfer" prefill --dev "$dev0" --ip "$ip0" \
        --embed-bootstrap "$work/bs" "$@" >"$work/p.log" 2>&1 &
    ppid=$!
    KVW_CLUSTER_KEY_FILE=$dkey "$xfer" decode --dev "$dev1" --ip "$ip1" \
        --bootstrap-file "$work/bs" "$@" >"$work/d.log" 2>&1
    drc=$?
    wait $ppid
    prc=$?
}

echo "[ RUN      ] the key on both sides: every byte verified, over CURVE"
# shellcheck disable=SC2086
pair "$key" "$key" $small
grep -E 'decode:|prefill:' "$work/d.log" "$work/p.log" | sed 's/^.*\/\([pd]\).log:/    \1| /'
rc=0
[ $drc -eq 0 ] && [ $prc -eq 0 ] && grep -q '4/4 requests ok' "$work/d.log" &&
    grep -q ' 0 bytes wrong' "$work/d.log" || rc=1
result "key on both sides" $rc

for case in none other; do
    if [ $case = none ]; then dkey="" what="decode without the key"; else
        dkey=$other what="decode with another cluster's key"; fi
    echo "[ RUN      ] $what: refused, a clear error, nothing written"
    start=$(date +%s)
    export KVW_BOOTSTRAP_TIMEOUT_MS=5000 # both sides give up in bounded time
    # shellcheck disable=SC2086
    pair "$key" "$dkey" $small --requests 1
    unset KVW_BOOTSTRAP_TIMEOUT_MS
    took=$(($(date +%s) - start))
    grep -E 'FAILED|kvw-xfer|kvwire\[[0-9.]*\] ERROR' "$work/d.log" | head -n 3 | sed 's/^/    decode| /'
    grep -E 'prefill:' "$work/p.log" | sed 's/^/    prefill| /'
    echo "    both gave up after ${took} s"
    rc=1
    if [ $drc -ne 0 ] && [ $prc -ne 0 ] && grep -q 'FAILED' "$work/d.log" &&
        grep -q ' 0 WRs' "$work/p.log" && [ "$took" -lt 60 ]; then rc=0; fi
    result "$what" $rc
done

echo "[ RUN      ] a prefill without the key cannot register at a keyed standalone bootstrap"
start_bootstrap --key-file "$key" "$ip0"
KVW_BOOTSTRAP_TIMEOUT_MS=3000 "$xfer" prefill --dev "$dev0" --ip "$ip0" --bootstrap "$bs" \
    --layers 2 --pool 16 --pages 4 --requests 1 >"$work/p.log" 2>&1
prc=$?
# and one with the key can, at the same service
KVW_CLUSTER_KEY_FILE=$key KVW_BOOTSTRAP_TIMEOUT_MS=3000 "$xfer" prefill --dev "$dev0" \
    --ip "$ip0" --bootstrap "$bs" --layers 2 --pool 16 --pages 4 --requests 1 >"$work/p2.log" 2>&1 &
p2pid=$!
KVW_CLUSTER_KEY_FILE=$key "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap "$bs" \
    --layers 2 --pool 16 --pages 4 --requests 1 >"$work/d.log" 2>&1
drc=$?
wait $p2pid
p2rc=$?
kill "$bspid"
wait "$bspid" 2>/dev/null
grep -E 'cannot register|kvw-xfer' "$work/p.log" | head -n 2 | sed 's/^/    prefill| /'
grep -E 'decode:' "$work/d.log" | sed 's/^/    keyed decode| /'
rc=1
if [ $prc -ne 0 ] && grep -q 'cannot register rank 0' "$work/p.log" && [ $drc -eq 0 ] &&
    [ $p2rc -eq 0 ]; then rc=0; fi
result "prefill without the key at a keyed bootstrap" $rc

rm -rf "$work"
echo "[==========] authentication scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
