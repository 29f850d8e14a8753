#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The handshake storm on the fake NIC (not RDMA; tests/unit/test_storm.c)
# twice: decode engines finding prefill through the built-in bootstrap
# service, then through a three-member etcd cluster on loopback
# (KVW_REGISTRY; tests/etcd/etcd-cluster.sh), where every decode engine
# reads the ranks at creation and holds a watch. Prints each storm's line
# (time to connected p50/p99/max, requests failed: 0 is the goal). For
# make bench; KVW_STORM_ENGINES decode engines (256).
# Usage: tests/etcd/storm.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: tests/etcd/storm.sh BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd -P)
export KVW_STORM_ENGINES=${KVW_STORM_ENGINES:-256}
ulimit -n 8192 2>/dev/null || true # every engine holds descriptors; N of them in one process
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvw-etcd-storm.XXXXXX")
trap '"$here/etcd-cluster.sh" stop "$dir" || true; rm -rf "$dir"' EXIT

echo "== storm (fake NIC): $KVW_STORM_ENGINES decode engines, built-in bootstrap"
"$build/unit/test_storm" 2>&1 | grep -E '^storm|FAILED|failed:'
eps=$("$here/etcd-cluster.sh" start "$dir")
echo "== storm (fake NIC): $KVW_STORM_ENGINES decode engines, ranks through etcd ($eps)"
t0=$(date +%s%N)
KVW_REGISTRY="etcd://$eps/storm" "$build/unit/test_storm" 2>&1 | grep -E '^storm|FAILED|failed:'
echo "   (whole run with $KVW_STORM_ENGINES engine creations reading the ranks from etcd: $((($(date +%s%N) - t0) / 1000000)) ms)"
