#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Compatibility with the previous minor release on real rxe: its kvw-xfer,
# built from this repository's history by scripts/build-prev-release.sh
# (make integration runs it first, on the host), against today's, both
# ways: old prefill -> new decode and new prefill -> old decode. Decode
# checks every byte of every request; the new side's log must say the
# connection fell back to the old release's wire version (it speaks
# exactly one). Then two new engines, which must negotiate up to the
# newest. Runs inside the test bed.
# Usage: compat_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
old=$build/compat/kvw-xfer
new=$xfer
wire_new=$(sed -n 's/^#define KVW_WIRE_VERSION \([0-9]*\).*/\1/p' src/ctrl/wire.h)
wire_old=$(sed -n 's/^#define KVW_WIRE_VERSION_MIN \([0-9]*\).*/\1/p' src/ctrl/wire.h)

echo "[==========] compatibility with the previous release on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
if [ ! -x "$old" ]; then
    # Never a silent skip: without the old release there is no test.
    echo "[  FAILED  ] no previous release at $old: scripts/build-prev-release.sh $build builds it" \
        "from this repository's history (make integration runs it; a shallow clone lacks it)"
    exit 1
fi
old_version=$(cat "$build/compat/version")

# pair NAME PREFILL_TOOL DECODE_TOOL WIRE: one prefill and one decode process,
# every byte checked by decode; the new side(s) must log the agreed WIRE.
pair() {
    name=$1 ptool=$2 dtool=$3 wire=$4
    echo "[ RUN      ] $name"
    rm -f "$work/bs"
    set -- --layers 8 --item 2048 --pool 128 --pages 24 --requests 6 --inflight 3 \
        --contig 5 --dst-contig 2 --aux-item 128 --aux-items 4 --seed 29
    KVW_LOG_LEVEL=info "$ptool" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" \
        "$@" >"$work/prefill.log" 2>&1 &
    ppid=$!
    KVW_LOG_LEVEL=info "$dtool" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" \
        "$@" >"$work/decode.log" 2>&1
    rc=$?
    wait "$ppid" || rc=1
    for side in prefill decode; do
        grep -E 'FAILED|ERROR|connected|verified|rooms' "$work/$side.log" | sed "s/^/    $side| /"
    done
    # The new side says what the connection speaks: "wire W, capabilities".
    [ "$ptool" = "$new" ] && { grep -q "connected as peer .*wire $wire," "$work/prefill.log" || {
        echo "    prefill did not log wire $wire"
        rc=1
    }; }
    [ "$dtool" = "$new" ] && { grep -q "connected to prefill .*wire $wire," "$work/decode.log" || {
        echo "    decode did not log wire $wire"
        rc=1
    }; }
    result "$name" $rc
}

pair "old prefill ($old_version) -> new decode: wire $wire_old" "$old" "$new" "$wire_old"
pair "new prefill -> old decode ($old_version): wire $wire_old" "$new" "$old" "$wire_old"
pair "new prefill -> new decode: negotiated up to wire $wire_new" "$new" "$new" "$wire_new"

rm -rf "$work"
echo "[==========] compatibility scenarios: $passed passed, $failed failed"
[ $failed -eq 0 ]
