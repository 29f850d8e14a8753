#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# A rail whose link goes down mid-transfer and comes back, on real rxe
# (kvw-testbed --devices 4: two veth pairs). Prefill runs on rxe0+rxe2,
# decode on rxe1+rxe3 (KVW_DEVICES), separate processes
# (tools/kvw-xfer), so rail 0 is the pair rxe0/rxe1 and rail 1 the
# pair rxe2/rxe3, each on its own veth pair. Once prefill's writes are on
# the wire, tests/tools/kvw-tb-link takes rail 1's veth (KVW_TB_NETDEV2)
# down for FLAP_S seconds and brings it back, while requests keep coming.
# A second run takes the link down before decode connects, so that
# the connection is made during the outage (on rail 0 alone: prefill
# leaves rail 1's lane out at the handshake) and rail 1 joins it later.
# A third takes it down before either engine is created: both open rail 1
# down (a node starting with a NIC out) and its lanes join once it is up.
# Pass: no request failed on either side, decode found no byte wrong, and
# rail 1's lane came back into the connection (kvw_engine_rail_health).
# Printed: prefill's summary lines (WRs per rail), the library's warnings
# (the lanes it failed over), the rooms that ended while the link was down
# and after, and the time the rxe ports took to come back.
# Usage: rail_flap_scenarios.sh BUILD_DIR   (KVW_FLAP_LOGS=DIR keeps both
# sides' full logs and the link tool's there)
set -u
. "$(dirname "$0")/common.sh"
link=$(dirname "$0")/../tools/kvw-tb-link

echo "[==========] a rail's link down and back, on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
if [ "${KVW_TB_NDEV:-1}" -lt 4 ] || [ -z "${KVW_TB_NETDEV2:-}" ]; then
    echo "[  SKIPPED ] needs four rxe devices on two veth pairs of the test bed's own" \
        "(kvw-testbed --devices 4, hostrxe or vm mode)"
    exit 0
fi
dev2=$KVW_TB_DEV2 dev3=$KVW_TB_DEV3

# Rooms of decode's log ("... [at W ms]", Success or FAILED) that ended in
# [from, to) wall-clock ms.
rooms_between() { # FROM TO
    sed -n 's/^room [0-9]*: .*\[.*at \([0-9]*\) ms\]$/\1/p' "$work/flap-d.log" |
        awk -v a="$1" -v b="$2" '$1 >= a && $1 < b { n++ } END { print n + 0 }'
}

# The figure after "$2" in the first line of $1 matching $3 (a number).
figure() { # FILE WORD-BEFORE PATTERN
    grep -m1 -E "$3" "$1" | sed -n "s/.*$2 \([0-9][0-9]*\).*/\1/p"
}

# The rail came back: prefill's rail 1 shows a lane rejoined and none out
# (kvw-xfer's "prefill: rail 1 ...: lanes failed N, rejoined N, out now N;
# P probes; recovery last X ms"), and carried writes.
check_recovery() {
    line=$(grep -m1 -E '^prefill: rail 1 .*rejoined' "$work/flap-p.log")
    echo "    recovery| ${line:-no rail health printed}"
    rejoined=$(echo "$line" | sed -n 's/.*rejoined \([0-9]*\),.*/\1/p')
    out=$(echo "$line" | sed -n 's/.*out now \([0-9]*\);.*/\1/p')
    if [ "${rejoined:-0}" -lt 1 ] || [ "${out:-1}" -ne 0 ]; then
        echo "    rail 1 did not come back into the connection"
        return 1
    fi
    return 0
}
# Waits (up to 30 s) until the link tool printed its "down" line: both
# ports of rail 1 read DOWN.
wait_link_down() {
    n=0
    until grep -q ' down \[at' "$work/link.log" 2>/dev/null || [ $n -ge 300 ]; do
        sleep 0.1
        n=$((n + 1))
    done
}

# flap NAME FLAP_S WHEN ARGS...: one transfer on two rails per engine, rail
# 1's link down for FLAP_S seconds: WHEN "mid" once writes are on the wire,
# "before" once both engines exist but before decode connects (kvw-xfer
# --hold-start), so that the connection is made during the outage,
# "create" before either engine is created.
flap() {
    name=$1 secs=$2 when=$3
    shift 3
    echo "[ RUN      ] $name: prefill $dev0+$dev2, decode $dev1+$dev3," \
        "$KVW_TB_NETDEV2 down ${secs} s ($when): $*"
    rm -f "$work/bs" "$work/ready" "$work/link.log" "$work/go" "$work/go.up"
    rc=0
    hold=
    [ "$when" = before ] && hold="--hold-start $work/go"
    if [ "$when" = create ]; then
        "$link" flap "$KVW_TB_NETDEV2" "$secs" >"$work/link.log" 2>&1 &
        lpid=$!
        wait_link_down
    fi
    # Fault mode (--ready-file, --deadline-s): failed rooms are printed with
    # their reason and the time they ended, and a hang ends at the deadline.
    # --may-fail all: a request the library refuses to replay (the safety
    # rule, docs/topology.md) is counted here, not by kvw-xfer's verdict.
    # Prefill takes every request at once and decode asks for them in waves
    # of --inflight: in the slow guest the last waves may come after the
    # 30 s bootstrap timeout, hence a longer one (a harness matter, not a
    # rail's). 60 s was not enough once, on a host loaded by other builds:
    # a run with three lane failures (rxe NAKed two writes as invalid after
    # the rejoin) reached its last 16 rooms 60.2 s in, prefill had given them
    # up and exited, and decode could not connect for them.
    KVW_LOG_LEVEL=info KVW_BOOTSTRAP_TIMEOUT_MS=150000 KVW_DEVICES="$dev0,$dev2" "$xfer" prefill --dev "$dev0" --ip "$ip0" \
        --embed-bootstrap "$work/bs" --decoders 1 --ready-file "$work/ready" \
        --deadline-s 240 --may-fail all "$@" >"$work/flap-p.log" 2>&1 &
    ppid=$!
    KVW_BOOTSTRAP_TIMEOUT_MS=150000 KVW_DEVICES="$dev1,$dev3" "$xfer" decode --dev "$dev1" --ip "$ip1" \
        --bootstrap-file "$work/bs" --decoder-index 0 --deadline-s 240 --may-fail all \
        --keep-going $hold "$@" >"$work/flap-d.log" 2>&1 &
    dpid=$!
    if [ "$when" = before ]; then
        # Both engines exist with every rail up; decode connects with its
        # first request, once the link is down.
        n=0
        until [ -e "$work/go.up" ] || [ $n -ge 600 ]; do
            sleep 0.1
            n=$((n + 1))
        done
        "$link" flap "$KVW_TB_NETDEV2" "$secs" >"$work/link.log" 2>&1 &
        lpid=$!
        wait_link_down
        touch "$work/go"
    fi
    n=0
    until [ -e "$work/ready" ] || [ $n -ge 600 ]; do
        sleep 0.1
        n=$((n + 1))
    done
    if [ "$when" != mid ]; then
        wait "$lpid" || rc=1
    else
        sleep 1 # every rail carrying writes
        "$link" flap "$KVW_TB_NETDEV2" "$secs" >"$work/link.log" 2>&1 || rc=1
    fi
    t_down=$(sed -n 's/.* down \[at \([0-9]*\) ms\].*/\1/p' "$work/link.log")
    t_up=$(sed -n 's/.* up \[at \([0-9]*\) ms\].*/\1/p' "$work/link.log")
    wait "$dpid" || rc=1
    # Prefill's exit status also says its WRs went beyond the plan, which a
    # replay does by design: its figures are checked below instead.
    wait "$ppid" || true
    [ -e "$work/ready" ] || echo "    prefill never had writes on the wire"

    sed 's/^/    link| /' "$work/link.log"
    grep -E '^prefill: [0-9]+ ok|^prefill: rail|^prefill: [0-9]+ WRs posted|^room .*FAILED|deadline' \
        "$work/flap-p.log" | sed 's/^/    prefill| /'
    grep -E '^decode: [0-9]+/|^room .*FAILED|deadline' "$work/flap-d.log" | sed 's/^/    decode| /'
    grep -h 'kvwire \(WARN\|ERROR\)\|next probe in\|probing it now' "$work/flap-p.log" |
        sed 's/^/    prefill log| /'
    grep -h 'kvwire \(WARN\|ERROR\)' "$work/flap-d.log" | sed 's/^/    decode log| /'

    p_ok=$(figure "$work/flap-p.log" 'prefill:' '^prefill: [0-9]+ ok')
    p_failed=$(figure "$work/flap-p.log" 'ok,' '^prefill: [0-9]+ ok')
    d_ok=$(figure "$work/flap-d.log" 'decode:' '^decode: [0-9]+/')
    d_total=$(grep -m1 -E '^decode: [0-9]+/' "$work/flap-d.log" | sed -n 's|^decode: [0-9]*/\([0-9]*\).*|\1|p')
    wrong=$(grep -m1 -E '^decode: [0-9]+/' "$work/flap-d.log" | sed -n 's/.*, \([0-9]*\) bytes wrong.*/\1/p')
    refused=$(grep -c 'FAILED.*not replayed\|FAILED.*replayed too often' "$work/flap-p.log")
    echo "    figures: prefill ${p_ok:-?} ok ${p_failed:-?} failed; decode ${d_ok:-?}/${d_total:-?} ok;" \
        "${wrong:-?} bytes wrong; $refused refused by the safety rule;" \
        "rooms ended while down $(rooms_between "${t_down:-0}" "${t_up:-0}"), after $(rooms_between "${t_up:-0}" 99999999999999)"
    check_recovery || rc=1
    # The connection was made during the outage: prefill left rail 1's
    # lane out at the handshake (else this run tested the mid-transfer case).
    if [ "$when" = before ] && ! grep -q 'could not be connected' "$work/flap-p.log"; then
        echo "    the connection was not made while the link was down"
        rc=1
    fi
    if [ "$when" = create ] && { ! grep -q 'opened as a rail' "$work/flap-p.log" ||
        ! grep -q 'opened as a rail' "$work/flap-d.log"; }; then
        echo "    an engine was not created while the link was down"
        rc=1
    fi
    # rxe now and then NAKs a write as a "remote invalid request" (its
    # retransmission after loss in this guest; seen on a rail that never
    # went down, and in runs without any flap). While rail 1 is out, rail 0
    # is the connection's only lane, so that one error fails the requests
    # in flight on it by design (no rail left: docs/topology.md); decode
    # reconnects for the rest. Such a run does not count against the
    # outage's goal of 0 when that single error is all that failed: every
    # failed room on both sides names it, and prefill saw one such error.
    nak_events=$(grep -c 'completed with remote invalid request error.*request(s) failed' "$work/flap-p.log")
    p_nak=$(grep -c '^room .*FAILED.*remote invalid request' "$work/flap-p.log")
    d_failed=$(grep -c '^room .*FAILED' "$work/flap-d.log")
    d_nak=$(grep -c '^room .*FAILED.*remote invalid request' "$work/flap-d.log")
    expected=${d_total:-0}
    if [ "$nak_events" -eq 1 ] && [ "${p_failed:-0}" -gt 0 ] && [ "$p_nak" -eq "$p_failed" ] &&
        [ "$d_nak" -eq "$d_failed" ] && [ "$d_failed" -eq "$p_failed" ]; then
        echo "    rxe NAKed one write on rail 0 as a remote invalid request while it was the only" \
            "lane: $p_failed requests in flight on it failed (not the outage's; reported, not counted)"
        p_failed=0
        expected=$((${d_total:-0} - d_failed))
    fi
    # Goal 0 failed: a request whose final immediate was on the lane when
    # the link went down is asked about (REPLAY_ASK), not refused.
    if [ "${p_failed:-1}" -ne 0 ] || [ -z "${d_ok:-}" ] || [ "$d_ok" != "$expected" ]; then
        echo "    requests failed (goal 0)"
        rc=1
    fi
    if [ "${wrong:-1}" -ne 0 ]; then
        echo "    bytes wrong (goal 0)"
        rc=1
    fi
    [ -z "${KVW_FLAP_LOGS:-}" ] || cp "$work"/flap-p.log "$work"/flap-d.log "$work"/link.log "$KVW_FLAP_LOGS"/
    result "$name" $rc
}

flap "rail 1 down 1.5 s, 16 layers x 8 KiB items, 120 requests, 4 in flight" 1.5 mid \
    --layers 16 --item 8192 --pool 256 --pages 32 --requests 120 --inflight 4 \
    --contig 4 --dst-contig 3 --aux-item 256 --aux-items 8 --seed 31
flap "rail 1 down 4 s from before the connection, 120 requests, 4 in flight" 4 before \
    --layers 16 --item 8192 --pool 256 --pages 32 --requests 120 --inflight 4 \
    --contig 4 --dst-contig 3 --aux-item 256 --aux-items 8 --seed 37
flap "rail 1 down 5 s from before the engines exist, 120 requests, 4 in flight" 5 create \
    --layers 16 --item 8192 --pool 256 --pages 32 --requests 120 --inflight 4 \
    --contig 4 --dst-contig 3 --aux-item 256 --aux-items 8 --seed 41

echo "[==========] rail flap: $passed passed, $failed failed"
rm -rf "$work"
[ "$failed" -eq 0 ]
