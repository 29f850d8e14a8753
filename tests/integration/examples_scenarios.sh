#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The C example programs (examples/, built into BUILD_DIR/examples/) on real
# rxe, inside the test bed: examples/transfer.c with both engines on one
# device and across the two. Usage: examples_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"

# example NAME ARGS...: run build/examples/transfer, show its output.
example() {
    name=$1
    shift
    echo "[ RUN      ] $name: $build/examples/transfer $*"
    "$build/examples/transfer" "$@" >"$work/example.log" 2>&1
    rc=$?
    sed 's/^/    /' "$work/example.log"
    result "$name" $rc
}

echo "[==========] C examples on real RDMA (test bed mode ${KVW_TB_MODE:-?}: $dev0 $ip0, $dev1 $ip1)"
example "examples/transfer.c, $dev0 -> $dev1, devices named" "$ip0" "$ip1" "$dev0" "$dev1"
example "examples/transfer.c, $dev0 -> $dev0, devices found from the IP" "$ip0" "$ip0"

rm -rf "$work"
echo "[==========] examples scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
