#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The test bed's hostrxe mode and tools/kvw-rxe, exercised for real inside
# the vm guest (its kernel has rdma_rxe, and its network is ours to disturb):
# a nested `kvw-testbed --mode hostrxe` runs a verified transfer, fails,
# is interrupted, and is killed outright; kvw-rxe brings an rxe device up and
# down on a guest interface. After each, the guest's interfaces, addresses,
# routes, rules, RDMA links, sysctls and modules must be as before.
# Usage: testbed_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
tb=tests/tools/kvw-testbed
rxe=tools/kvw-rxe

echo "[==========] test bed modes and kvw-rxe (test bed mode ${KVW_TB_MODE:-?})"
if [ "${KVW_TB_MODE:-}" != vm ]; then
    # Only the guest's network is ours to change (and a hostrxe run holds
    # the lock a nested one would wait on).
    echo "[  SKIPPED ] hostrxe and kvw-rxe scenarios run only inside the vm guest"
    exit 0
fi

# Everything a run must leave as it found it (IPv6 duplicate address
# detection finishing meanwhile on the guest's own links is not a change).
snapshot() {
    ip -o link show
    ip -o addr show | sed 's/ tentative//'
    ip -4 route show table all
    ip -6 route show table all | grep -v '^local fe80::'

    ip -4 rule show
    ip -6 rule show
    rdma link show
    ls /sys/class/infiniband
    for f in rp_filter accept_local arp_ignore; do
        echo "all.$f=$(cat /proc/sys/net/ipv4/conf/all/$f)"
    done
    cut -d' ' -f1 /proc/modules | sort
}

# same_as_before NAME: compare with $work/before, show the difference.
same_as_before() {
    snapshot >"$work/after" 2>&1
    if diff -u "$work/before" "$work/after" >"$work/diff"; then
        echo "    host state unchanged (links, addresses, routes, rules, rdma links, sysctls, modules)"
        return 0
    fi
    echo "    host state changed after $1:"
    sed 's/^/    | /' "$work/diff" | head -n 40
    return 1
}

# A laptop's network: a strict rp_filter, and the local table consulted
# first (pref 0; the guest moved it to 100 for its own rxe0/rxe1, whose
# traffic does not flow meanwhile). hostrxe must relax the one and move the
# other for the run only.
old_rpf=$(cat /proc/sys/net/ipv4/conf/all/rp_filter)
echo 1 >/proc/sys/net/ipv4/conf/all/rp_filter
ip -4 rule add pref 0 lookup local
snapshot >"$work/before" 2>&1

# Nested runs use their own names and subnets: the guest's rxe0..rxe3,
# 192.0.2.x and 198.51.100.x belong to the outer (vm) test bed.
export KVW_TESTBED_SUBNET=203.0.113 KVW_TESTBED_SUBNET2=198.18.0 KVW_TESTBED_DEVNAME=tbrxe

# The command of the nested run: environment as in vm mode, then prefill on
# device 0 -> decode on device 1, every byte verified by decode.
cat >"$work/inner.sh" <<'EOF'
#!/bin/sh
xfer=$1
echo "inner: mode=$KVW_TB_MODE ndev=$KVW_TB_NDEV $KVW_TB_DEV0 $KVW_TB_IP0 gid $KVW_TB_GID_INDEX0, $KVW_TB_DEV1 $KVW_TB_IP1 gid $KVW_TB_GID_INDEX1"
[ "$KVW_TB_MODE" = hostrxe ] && [ "$KVW_TB_NDEV" = 2 ] &&
    [ "$KVW_TB_DEV0" = tbrxe0 ] && [ "$KVW_TB_IP0" = 203.0.113.1 ] && [ "$KVW_TB_GID_INDEX0" = 1 ] &&
    [ "$KVW_TB_DEV1" = tbrxe1 ] && [ "$KVW_TB_IP1" = 203.0.113.2 ] && [ "$KVW_TB_GID_INDEX1" = 1 ] ||
    { echo "inner: unexpected environment"; exit 90; }
ip -4 rule show | sed 's/^/inner: rule /'
d=$(mktemp -d)
L="--layers 8 --item 2048 --pool 64 --pages 16 --requests 4 --inflight 2 --contig 3 --dst-contig 2 --seed 31"
# shellcheck disable=SC2086
"$xfer" prefill --dev "$KVW_TB_DEV0" --ip "$KVW_TB_IP0" --embed-bootstrap "$d/bs" $L >"$d/p.log" 2>&1 &
p=$!
# shellcheck disable=SC2086
"$xfer" decode --dev "$KVW_TB_DEV1" --ip "$KVW_TB_IP1" --bootstrap-file "$d/bs" $L --deadline-s 120 >"$d/d.log" 2>&1
rc=$?
wait $p || rc=1
grep -E '^(prefill|decode):|FAILED|ERROR' "$d/p.log" "$d/d.log" | sed 's/^/inner: /'
exit $rc
EOF
chmod +x "$work/inner.sh"

echo "[ RUN      ] hostrxe: two rxe devices on a private veth pair, prefill -> decode, bytes verified"
"$tb" --mode hostrxe --devices 2 --timeout 300 -- "$work/inner.sh" "$xfer" >"$work/tb.log" 2>&1
rc=$?
sed 's/^/    /' "$work/tb.log"
head -n 1 "$work/tb.log" | grep -q '^\[testbed\] mode: hostrxe (' || { echo "    first line does not name the mode"; rc=1; }
grep -q 'every byte verified\|0 bytes wrong' "$work/tb.log" || { echo "    no verified transfer in the output"; rc=1; }
same_as_before "the run" || rc=1
result "hostrxe transfer, host state restored" $rc

# Four devices: the environment, then on the second pair (devices 2 and 3)
# a verified transfer, its veth down and up (tests/tools/kvw-tb-link, which
# must restore the pair's policy route) and a verified transfer again.
cat >"$work/inner4.sh" <<'EOF'
#!/bin/sh
xfer=$1
echo "inner: mode=$KVW_TB_MODE ndev=$KVW_TB_NDEV $KVW_TB_DEV2 $KVW_TB_IP2 on $KVW_TB_NETDEV2, $KVW_TB_DEV3 $KVW_TB_IP3 on $KVW_TB_NETDEV3"
[ "$KVW_TB_MODE" = hostrxe ] && [ "$KVW_TB_NDEV" = 4 ] &&
    [ "$KVW_TB_DEV0" = tbrxe0 ] && [ "$KVW_TB_IP0" = 203.0.113.1 ] && [ "$KVW_TB_NETDEV0" = kvw-tbrxe0 ] &&
    [ "$KVW_TB_DEV1" = tbrxe1 ] && [ "$KVW_TB_IP1" = 203.0.113.2 ] && [ "$KVW_TB_NETDEV1" = kvw-tbrxe1 ] &&
    [ "$KVW_TB_DEV2" = tbrxe2 ] && [ "$KVW_TB_IP2" = 198.18.0.1 ] && [ "$KVW_TB_GID_INDEX2" = 1 ] &&
    [ "$KVW_TB_NETDEV2" = kvw-tbrxe2 ] &&
    [ "$KVW_TB_DEV3" = tbrxe3 ] && [ "$KVW_TB_IP3" = 198.18.0.2 ] && [ "$KVW_TB_GID_INDEX3" = 1 ] &&
    [ "$KVW_TB_NETDEV3" = kvw-tbrxe3 ] ||
    { echo "inner: unexpected environment"; exit 90; }
ip -4 rule show | sed 's/^/inner: rule /'
d=$(mktemp -d)
L="--layers 4 --item 2048 --pool 64 --pages 8 --requests 2 --inflight 2 --seed 33"
pair23() {
    rm -f "$d/bs"
    # shellcheck disable=SC2086
    "$xfer" prefill --dev "$KVW_TB_DEV2" --ip "$KVW_TB_IP2" --embed-bootstrap "$d/bs" $L >"$d/p.log" 2>&1 &
    p=$!
    # shellcheck disable=SC2086
    "$xfer" decode --dev "$KVW_TB_DEV3" --ip "$KVW_TB_IP3" --bootstrap-file "$d/bs" $L --deadline-s 60 >"$d/d.log" 2>&1
    r=$?
    wait $p || r=1
    grep -E '^decode:|FAILED|ERROR' "$d/p.log" "$d/d.log" | sed "s/^/inner: $1: /"
    return $r
}
pair23 before || exit 1
tests/tools/kvw-tb-link flap "$KVW_TB_NETDEV2" 0.5 | sed 's/^/inner: /'
pair23 "after the flap" || exit 1
EOF
chmod +x "$work/inner4.sh"

echo "[ RUN      ] hostrxe: four rxe devices on two private veth pairs, one pair's link down and up, bytes verified"
"$tb" --mode hostrxe --devices 4 --timeout 300 -- "$work/inner4.sh" "$xfer" >"$work/tb.log" 2>&1
rc=$?
sed 's/^/    /' "$work/tb.log"
head -n 1 "$work/tb.log" | grep -q 'on veth pairs kvw-tbrxe0/kvw-tbrxe1 and kvw-tbrxe2/kvw-tbrxe3' ||
    { echo "    first line does not name both veth pairs"; rc=1; }
[ "$(grep -c '0 bytes wrong' "$work/tb.log")" -eq 2 ] || { echo "    not two verified transfers"; rc=1; }
grep -q 'kvw-tb-link: kvw-tbrxe2 up .*1 route(s) restored): tbrxe2 ACTIVE after [0-9]* ms, tbrxe3 ACTIVE' "$work/tb.log" ||
    { echo "    the link did not come back with its route"; rc=1; }
same_as_before "the run" || rc=1
result "hostrxe four devices, link flap, host state restored" $rc

echo "[ RUN      ] hostrxe: the command fails (one device): its exit code, state restored"
"$tb" --mode hostrxe --devices 1 -- sh -c 'echo "inner: $KVW_TB_DEV0 $KVW_TB_IP0 gid $KVW_TB_GID_INDEX0"; ibv_devices | grep -q tbrxe0 && exit 7' \
    >"$work/tb.log" 2>&1
rc=$?
sed 's/^/    /' "$work/tb.log"
if [ $rc -eq 7 ]; then rc=0; else echo "    exit $rc, expected 7"; rc=1; fi
same_as_before "a failing command" || rc=1
result "hostrxe failing command" $rc

echo "[ RUN      ] hostrxe: interrupted (SIGTERM) while the command runs: undone"
"$tb" --mode hostrxe --devices 2 -- sleep 120 >"$work/tb.log" 2>&1 &
tbpid=$!
n=0
while ! grep -q '^\[testbed\] mode:' "$work/tb.log" && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
kill -TERM $tbpid
wait $tbpid
rc=$?
sed 's/^/    /' "$work/tb.log"
if [ $rc -eq 143 ]; then rc=0; else echo "    exit $rc, expected 143"; rc=1; fi
same_as_before "SIGTERM" || rc=1
result "hostrxe interrupted" $rc

echo "[ RUN      ] hostrxe: killed outright (SIGKILL); the next run undoes what it left"
"$tb" --mode hostrxe --devices 2 -- sleep 120 >"$work/tb.log" 2>&1 &
tbpid=$!
n=0
while ! grep -q '^\[testbed\] mode:' "$work/tb.log" && [ $n -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
children=$(ps -o pid= --ppid $tbpid)
for c in $children; do children="$children $(ps -o pid= --ppid "$c")"; done
kill -KILL $tbpid
wait $tbpid 2>/dev/null
for c in $children; do kill -KILL "$c" 2>/dev/null; done
rc=0
if rdma link show | grep -q tbrxe0; then echo "    killed run left tbrxe0 behind (as expected)"; else echo "    tbrxe0 vanished?"; rc=1; fi
"$tb" --mode hostrxe --devices 1 -- true >"$work/tb2.log" 2>&1 || rc=1
sed 's/^/    /' "$work/tb2.log"
grep -q 'undoing what a killed hostrxe run left behind' "$work/tb2.log" || { echo "    the next run did not undo"; rc=1; }
same_as_before "SIGKILL and the next run" || rc=1
result "hostrxe killed, undone by the next run" $rc

echo "[ RUN      ] kvw-rxe up/status/down on a guest interface, and its errors"
rc=0
ip link add kvwt0 type veth peer name kvwt1 && ip link set kvwt0 up && ip link set kvwt1 up &&
    ip addr add 203.0.113.1/24 dev kvwt0 || rc=1
snapshot >"$work/before" 2>&1
# expect_fail CODE TEXT CMD...: CMD exits CODE and says TEXT.
expect_fail() {
    code=$1 text=$2
    shift 2
    "$@" >"$work/err.log" 2>&1
    got=$?
    sed 's/^/    | /' "$work/err.log"
    if [ $got -ne "$code" ] || ! grep -q "$text" "$work/err.log"; then
        echo "    expected exit $code and '$text' from: $*"
        rc=1
    fi
}
expect_fail 3 "no IPv4 address" "$rxe" up kvwt1
expect_fail 3 "no interface 'kvwt9'" "$rxe" up kvwt9
expect_fail 3 "not root" setpriv --reuid=65534 --regid=65534 --clear-groups "$rxe" up kvwt0
expect_fail 1 "unknown command" "$rxe" frob
out=$("$rxe" up kvwt0 2>"$work/up.err")
st=$?
sed 's/^/    | /' "$work/up.err"
echo "    up: $out"
[ $st -eq 0 ] && [ "${out%% *}" = rxe_kvwt0 ] && echo "$out" | grep -q ' ip 203.0.113.1 gid_index [0-9]' || {
    echo "    kvw-rxe up failed or printed something else"
    rc=1
}
gid=${out##* }
"$rxe" status | sed 's/^/    status| /'
"$rxe" status | grep -q "^rxe_kvwt0 netdev kvwt0 state ACTIVE ip 203.0.113.1 gid_index $gid" || rc=1
expect_fail 1 "already has an RDMA device" "$rxe" up kvwt0
# A verified transfer on the new device (to itself), kvwire picking the GID.
rm -f "$work/bs"
L="--layers 2 --item 4096 --pool 16 --pages 4 --requests 2 --seed 32"
# shellcheck disable=SC2086
"$xfer" prefill --dev rxe_kvwt0 --ip 203.0.113.1 --embed-bootstrap "$work/bs" $L >"$work/p.log" 2>&1 &
p=$!
# shellcheck disable=SC2086
"$xfer" decode --dev rxe_kvwt0 --ip 203.0.113.1 --bootstrap-file "$work/bs" $L --deadline-s 60 >"$work/d.log" 2>&1 || rc=1
wait $p || rc=1
grep -E 'engine on|^decode:|FAILED|ERROR' "$work/d.log" | sed 's/^/    decode| /'
grep -q "engine on rxe_kvwt0 (GID index $gid)" "$work/d.log" || { echo "    kvwire did not use GID index $gid"; rc=1; }
"$rxe" down kvwt0 2>&1 | sed 's/^/    | /'
expect_fail 1 "no rxe device" "$rxe" down rxe_kvwt0
same_as_before "kvw-rxe up and down" || rc=1
ip link del kvwt0
result "kvw-rxe" $rc

echo "$old_rpf" >/proc/sys/net/ipv4/conf/all/rp_filter
ip -4 rule del pref 0 lookup local
rm -rf "$work"
echo "[==========] test bed scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
