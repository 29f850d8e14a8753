#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The tools' command lines, host only (no RDMA device needed): every bad
# input issue 31 lists, and the conventions of docs/tools.md. Each check
# runs a tool and compares its exit status and the message it printed:
#   --help / -h: the help on stdout (not starting with the SPDX line), exit 0
#   --version / -V: "TOOL (kvwire) X.Y.Z" (include/kvwire.h's), exit 0
#   a bad command line: one message on stderr naming the option and the
#   value, then "Try 'TOOL --help'", nothing on stdout, exit 1
# Usage: tests/tools/tool_args.sh BUILD_DIR
set -u
build=${1:-build}
fail=0
out=$(mktemp) && err=$(mktemp) || exit 1
trap 'rm -f "$out" "$err"' EXIT

version=$(sed -n 's/^#define KVW_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9][0-9]*\)$/\2/p' \
    include/kvwire.h | paste -sd.)

bad() { # WHAT: report a failed check
    echo "[  FAILED  ] $1"
    sed 's/^/    stdout| /' "$out"
    sed 's/^/    stderr| /' "$err"
    fail=1
}

# usage_error TOOL_PATH MESSAGE ARGS...: exit 1, MESSAGE on stderr, the
# pointer to --help after it, stdout empty.
usage_error() {
    tool=$1 msg=$2
    shift 2
    "$tool" "$@" >"$out" 2>"$err"
    rc=$?
    name=$(basename "$tool")
    if [ $rc -ne 1 ] || ! grep -qF -- "$msg" "$err" || [ -s "$out" ] ||
        ! grep -qF "Try '$name --help' for more information." "$err"; then
        bad "$name $*: want exit 1 and '$msg' on stderr, got exit $rc"
    else
        echo "[       OK ] $name $*: $(head -1 "$err")"
    fi
}

# The conventions every installed tool, and the bench tools, follow.
for name in kvwire-info kvw-bootstrap kvw-keygen kvwire-bench kvw-xfer kvw-rxe \
    kvw-heads kvw-rawlat kvw-storm kvw-wrcost; do
    tool=$build/$name
    [ "$name" = kvw-rxe ] && tool=tools/kvw-rxe
    for h in --help -h; do
        "$tool" $h >"$out" 2>"$err"
        rc=$?
        if [ $rc -ne 0 ] || [ -s "$err" ] || ! grep -q . "$out" || head -1 "$out" | grep -q SPDX; then
            bad "$name $h: want the help on stdout, exit 0 (got exit $rc)"
        fi
    done
    for v in --version -V; do
        "$tool" $v >"$out" 2>"$err"
        rc=$?
        if [ $rc -ne 0 ] || [ "$(cat "$out")" != "$name (kvwire) $version" ]; then
            bad "$name $v: want '$name (kvwire) $version', exit 0 (got exit $rc)"
        fi
    done
    usage_error "$tool" "" --no-such-option
done
echo "[       OK ] --help, -h, --version, -V and an unknown option, in every tool"

# Numbers: whole string, decimal (or 0x hex), no sign, in range.
nan="not a number (decimal, or hex after 0x; no sign, suffix or exponent)"
bench=$build/kvwire-bench xfer=$build/kvw-xfer
usage_error "$bench" "invalid --layers '10x': $nan" --ip0 127.0.0.1 --layers 10x
usage_error "$bench" "invalid --tokens '1e3': $nan" --ip0 127.0.0.1 --tokens 1e3
usage_error "$bench" "invalid --requests '-1': $nan" --ip0 127.0.0.1 --requests -1
usage_error "$bench" "invalid --requests '+5': $nan" --ip0 127.0.0.1 --requests +5
usage_error "$bench" "invalid --requests ' 5': $nan" --ip0 127.0.0.1 --requests " 5"
usage_error "$bench" "invalid --layers '0': out of range (1 to 65535)" --ip0 127.0.0.1 --layers 0
usage_error "$bench" "invalid --seed '18446744073709551616': out of range" \
    --ip0 127.0.0.1 --seed 18446744073709551616
usage_error "$bench" "invalid --layers '0x': not a hex number" --ip0 127.0.0.1 --layers 0x
# "010" is ten layers, not eight (octal): 1024 pages x 2 KiB x K/V x 10
# layers is 42 MB a request (8 layers would be 34), over a 1 MB pool.
usage_error "$bench" "42 MB per request x 4 in flight exceeds --max-pool-mb" \
    --ip0 127.0.0.1 --layers 010 --max-pool-mb 1
usage_error "$bench" "42 MB per request" --ip0 127.0.0.1 --layers 0xa --max-pool-mb 1
usage_error "$xfer" "invalid --pages '-5': $nan" decode --ip 127.0.0.1 --bootstrap x --pages -5
usage_error "$xfer" "invalid --layers '10x': $nan" decode --ip 127.0.0.1 --bootstrap x --layers 10x
usage_error "$xfer" "invalid --requests '1e3': $nan" decode --ip 127.0.0.1 --bootstrap x \
    --requests 1e3
usage_error "$xfer" "invalid --requests '-1': $nan" decode --ip 127.0.0.1 --bootstrap x \
    --requests -1
usage_error "$xfer" "invalid --rank '64': out of range (0 to 63)" decode --ip 127.0.0.1 \
    --bootstrap x --rank 64
usage_error "$xfer" "invalid side 'both': prefill or decode" both --ip 127.0.0.1
usage_error "$xfer" "invalid room list '1,x': " decode --ip 127.0.0.1 --bootstrap x \
    --expect-failed 1,x
usage_error "$build/kvw-storm" "invalid --engines '1e3': $nan" --engines 1e3
usage_error "$build/kvw-heads" "invalid --layers '-1': $nan" --layers -1
usage_error "$build/kvw-rawlat" "invalid --size '4097': out of range (1 to 4096)" --size 4097
usage_error "$build/kvw-wrcost" "invalid --pages '10x': $nan" --pages 10x

# Addresses.
usage_error "$build/kvw-bootstrap" \
    "invalid address '127.0.0.1:99999': the port is not a number from 0 to 65535" 127.0.0.1:99999
usage_error "$build/kvw-bootstrap" "invalid address '127.0.0.1:-1'" 127.0.0.1:-1
usage_error "$build/kvw-bootstrap" "invalid address 'banana': not an IPv4 address" banana
usage_error "$build/kvw-bootstrap" "missing IP[:PORT]"
usage_error "$build/kvwire-info" "invalid --ip 'banana': not an IPv4 address (a.b.c.d)" --ip banana
usage_error "$xfer" "invalid --ip 'banana': not an IPv4 address" decode --ip banana --bootstrap x
usage_error "$bench" "invalid --ip0 'banana': not an IPv4 address" --ip0 banana
usage_error "$bench" "invalid --client '127.0.0.1:99999': the port is not a number from 0 to 65535" \
    --client 127.0.0.1:99999 --ip1 127.0.0.1
usage_error "$bench" "--server or --client, not both" --server --client 127.0.0.1 --ip0 127.0.0.1
usage_error "$build/kvw-keygen" "missing FILE"
usage_error tools/kvw-rxe "unknown command 'frob'" frob

# kvwire-info with no RDMA device (a host without /sys/class/infiniband
# entries, as this project's build machines; elsewhere the test bed's
# tools_scenarios.sh covers --check).
if [ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    "$build/kvwire-info" >"$out" 2>"$err"
    rc=$?
    if [ $rc -ne 1 ] || ! grep -q "^kvwire-info: no RDMA device found" "$err"; then
        bad "kvwire-info with no RDMA device: want exit 1 and 'no RDMA device found' (got $rc)"
    else
        echo "[       OK ] kvwire-info with no RDMA device: $(cat "$err")"
    fi
    "$build/kvwire-info" --check >"$out" 2>"$err"
    rc=$?
    if [ $rc -ne 1 ] || ! grep -q '^  \[FAIL\] none found' "$out" ||
        ! grep -q '^kvwire-info --check: FAILED' "$out"; then
        bad "kvwire-info --check with no RDMA device: want exit 1 and [FAIL] none found (got $rc)"
    else
        echo "[       OK ] kvwire-info --check with no RDMA device: $(grep FAIL "$out" | head -1)"
    fi
else
    echo "[  SKIPPED ] kvwire-info with no RDMA device: this host has some"
fi
# A device that is not there, on any host.
"$build/kvwire-info" --check --dev kvw_no_such_dev >"$out" 2>"$err"
rc=$?
if [ $rc -ne 1 ] || ! grep -q '^  \[FAIL\] no RDMA device named kvw_no_such_dev$' "$out"; then
    bad "kvwire-info --check --dev kvw_no_such_dev: want exit 1 and its [FAIL] (got $rc)"
else
    echo "[       OK ] kvwire-info --check --dev kvw_no_such_dev: $(grep "\[FAIL\]" "$out")"
fi

# --check's memlock verdict: a limit below the engine's landing buffer
# (KVW_LANDING_MIB, 64 MiB) fails without CAP_IPC_LOCK (which lifts the
# limit; dropped here with util-linux's setpriv when we are root).
if command -v setpriv >/dev/null 2>&1; then
    (ulimit -l 64 && setpriv --inh-caps=-ipc_lock \
        --bounding-set=-ipc_lock "$build/kvwire-info" --check) >"$out" 2>"$err"
    rc=$?
    if [ $rc -ne 1 ] ||
        ! grep -q '^  \[FAIL\] memlock limit: 65536 bytes, below the 67108864 an engine pins' "$out"; then
        bad "kvwire-info --check under ulimit -l 64: want exit 1 and the memlock [FAIL] (got $rc)"
    else
        echo "[       OK ] kvwire-info --check under ulimit -l 64: $(grep memlock "$out")"
    fi
fi

# kvwire-bench --server checks a client's workload as a command line: a
# message that is not a kvwire-bench client's, or a number out of its range,
# is answered "ERR why" and the server exits 1, before any RDMA is touched
# (so this runs on 127.0.0.1). python3-zmq plays the client.
py=${PYTHON:-/usr/bin/python3}
if "$py" -c 'import zmq' 2>/dev/null; then
    for case in garbage layers0; do
        port=$((18600 + $$ % 1000))
        "$build/kvwire-bench" --server --ip0 127.0.0.1 --port $port >"$out" 2>"$err" &
        spid=$!
        reply=$("$py" - "$port" "$case" <<'PY'
import struct, sys, zmq
port, case = int(sys.argv[1]), sys.argv[2]
s = zmq.Context().socket(zmq.REQ)
s.setsockopt(zmq.RCVTIMEO, 10000)
s.setsockopt(zmq.LINGER, 0)
s.connect(f"tcp://127.0.0.1:{port}")
if case == "garbage":
    msg = b"hello"
else:  # wire_opts_t: magic[16], fragmented, nums[32] in num_opts' order
    nums = [4, 0] + [1] * 30  # --contig 4, --layers 0
    msg = b"kvwire-bench/1".ljust(16, b"\0") + struct.pack("<Q32Q", 0, *nums)
s.send(msg)
print(s.recv().rstrip(b"\0").decode())
PY
)
        wait $spid
        rc=$?
        case $case in
        garbage) want="not a kvwire-bench client (or another version)" ;;
        layers0) want="--layers 0 out of range (1 to 65535)" ;;
        esac
        if [ $rc -ne 1 ] || [ "$reply" != "ERR $want" ] ||
            ! grep -qF "kvwire-bench server: refused the client: $want" "$err"; then
            bad "kvwire-bench --server, client sending $case: want 'ERR $want' and exit 1 (got '$reply', exit $rc)"
        else
            echo "[       OK ] kvwire-bench --server refuses a client sending $case: $reply"
        fi
    done
fi

# A man page for every installed tool (make man, help2man), with its
# name, synopsis and the version.
for name in kvwire-info kvw-bootstrap kvw-keygen kvwire-bench kvw-xfer kvw-rxe; do
    page=$build/man/$name.1
    if [ ! -f "$page" ] || ! grep -q "^$name \\\\- " "$page" || ! grep -q '^\.SH SYNOPSIS' "$page" ||
        ! grep -q "^\.TH .* \"kvwire\" \"User Commands\"" "$page"; then
        : >"$out"
        : >"$err"
        bad "$page: missing, or without its NAME or SYNOPSIS"
    fi
done
echo "[       OK ] a man page for every installed tool"

[ $fail -eq 0 ] && echo "tool_args: PASS" || echo "tool_args: FAILED"
exit $fail
