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
