#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The main job, run inside the test bed by `make demo`: a standalone
# bootstrap service, a prefill engine on device 0 and a decode engine on
# device 1 move a model-shaped KV cache (32 layers, K and V, 2 KiB pages,
# plus an aux buffer) for 8 requests; decode verifies every byte and prints
# per-request and total throughput.
# Usage: demo.sh BUILD_DIR
set -eu
build=${1:-build}
work=$(mktemp -d)
trap 'kill $bs_pid 2>/dev/null; rm -rf "$work"' EXIT

dev0=$KVW_TB_DEV0 ip0=$KVW_TB_IP0
dev1=${KVW_TB_DEV1:-$KVW_TB_DEV0} ip1=${KVW_TB_IP1:-$KVW_TB_IP0}
layout="--layers 32 --item 2048 --pool 512 --aux-item 512 --aux-items 8"
work_args="--requests 8 --pages 64 --inflight 4 --contig 8 --dst-contig 5 --seed 2026"

echo "== kvwire demo: prefill on $dev0 ($ip0) -> decode on $dev1 ($ip1), test bed mode ${KVW_TB_MODE:-?}"
"$build/kvw-bootstrap" "$ip0:0" >"$work/bs.out" &
bs_pid=$!
while ! grep -q '^bootstrap ' "$work/bs.out" 2>/dev/null; do sleep 0.1; done
bootstrap=$(sed -n 's/^bootstrap //p' "$work/bs.out")
echo "== bootstrap service (tools/kvw-bootstrap) at $bootstrap"

# shellcheck disable=SC2086
"$build/kvw-xfer" prefill --dev "$dev0" --ip "$ip0" --bootstrap "$bootstrap" $layout $work_args \
    | sed 's/^/prefill| /' &
prefill_pid=$!
# shellcheck disable=SC2086
"$build/kvw-xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap "$bootstrap" $layout $work_args \
    | sed 's/^/decode | /'
wait $prefill_pid
echo "== demo done: every byte verified by decode"
