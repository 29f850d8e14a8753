#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The etcd registry's tests (make etcd-check, in make check): starts a
# three-member etcd cluster on loopback from Debian's etcd-server
# (tests/etcd/etcd-cluster.sh: its own directory, free ports), runs
# test_etcd's scenarios against it, then turns etcd's authentication on
# and runs the authenticated ones. Every member is killed at the end,
# whatever happened.
# Usage: tests/etcd/run.sh BUILD_DIR
set -euo pipefail
build=${1:?usage: tests/etcd/run.sh BUILD_DIR}
here=$(cd "$(dirname "$0")" && pwd -P)
ctl=$here/etcd-cluster.sh
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvw-etcd.XXXXXX")
cleanup() {
    "$ctl" stop "$dir" || true
    rm -rf "$dir"
}
trap cleanup EXIT

eps=$("$ctl" start "$dir")
echo "etcd cluster: $eps (in $dir)"
export KVW_TEST_ETCD_ENDPOINTS=$eps KVW_TEST_ETCD_DIR=$dir KVW_TEST_ETCD_CTL=$ctl
# A guard against a hang (a bug), not a speed limit: each group takes
# about a minute.
guard=${KVW_TEST_ETCD_TIMEOUT:-900}
timeout -k 10 "$guard" "$build/etcd/test_etcd" cluster

export KVW_TEST_ETCD_USER=kvw-test KVW_TEST_ETCD_PASSWORD="pw-$RANDOM$RANDOM"
export KVW_TEST_ETCD_PREFIX=/kvw-auth
"$ctl" auth "$dir" "$KVW_TEST_ETCD_USER" "$KVW_TEST_ETCD_PASSWORD" "$KVW_TEST_ETCD_PREFIX"
timeout -k 10 "$guard" "$build/etcd/test_etcd" auth
