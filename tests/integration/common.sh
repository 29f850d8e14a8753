# SPDX-License-Identifier: Apache-2.0
# Shared by the integration scenario scripts (sourced, not run): the build
# directory, the kvw-xfer tool, a scratch directory, the test bed's devices
# and the pass/fail tally with its result line. Reads the caller's $1 (the
# build directory, default build).
build=${1:-build}
xfer=$build/kvw-xfer
work=$(mktemp -d)
failed=0
passed=0

dev0=$KVW_TB_DEV0 ip0=$KVW_TB_IP0
dev1=${KVW_TB_DEV1:-$KVW_TB_DEV0} ip1=${KVW_TB_IP1:-$KVW_TB_IP0}

result() { # name rc
    if [ "$2" -eq 0 ]; then
        echo "[       OK ] $1"
        passed=$((passed + 1))
    else
        echo "[  FAILED  ] $1 (rc $2)"
        failed=$((failed + 1))
    fi
}

# Start a standalone bootstrap service (kvw-bootstrap ARGS... IP) in the
# background; sets bspid and bs (its "ip:port"), empty if it did not start.
start_bootstrap() {
    "$build/kvw-bootstrap" "$@" >"$work/bs.log" 2>&1 &
    bspid=$!
    n=0
    until grep -q '^bootstrap ' "$work/bs.log" || [ $n -ge 200 ]; do
        sleep 0.05
        n=$((n + 1))
    done
    bs=$(sed -n 's/^bootstrap //p' "$work/bs.log")
}
