#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Soak and idle scenarios on real rxe (run inside the test bed, real RDMA):
#  - soak: one prefill process serves KVW_SOAK_CYCLES decode cycles (new
#    engine, connect, one room with every byte verified, destroy); every
#    tenth cycle a forked decode process is killed with SIGKILL mid-transfer
#    instead. The prefill's fds, threads (/proc/PID/fd, /proc/PID/task) and
#    VmRSS are sampled after a warm-up and at the end, with no decode engine
#    alive either time, printed, and must not grow (RSS: by at most 8 MiB).
#  - idle: a prefill and a decode engine stay connected KVW_IDLE_S seconds
#    (default 60) after their transfers; each prints its threads' CPU and
#    wake-ups from /proc and fails if the process woke more than 25 times a
#    second (a count: the CPU share is printed here and measured by make
#    bench, never asserted, since a loaded machine moves it).
#  - stream: two decode processes stream KVW_STREAM_REQUESTS (40) 12.6 MB
#    requests each, back to back, from one prefill (about a minute here).
# Usage: soak_scenarios.sh BUILD_DIR [soak] [idle] [stream]
#        (default: soak and idle)
set -u
. "$(dirname "$0")/common.sh"

cycles=${KVW_SOAK_CYCLES:-300}
idle_s=${KVW_IDLE_S:-60}
stream_requests=${KVW_STREAM_REQUESTS:-40}
kill_every=10
warm=20
rss_slack_kib=8192
# 1 MiB rooms (4 layers x 16 pages x 8 KiB, K and V): ~40 ms on the wire in
# the guest, so a kill after the first bytes lands mid-transfer.
layout="--layers 4 --item 8192 --pool 64 --pages 16 --contig 4 --dst-contig 4 --seed 21"

# "FDS THREADS RSS_KIB" of a process.
sample() {
    echo "$(ls "/proc/$1/fd" | wc -l) $(ls "/proc/$1/task" | wc -l)" \
        "$(awk '/^VmRSS:/ {print $2}' "/proc/$1/status")"
}

# wait_for FILE PID SECONDS: until FILE exists; false if PID exits or time runs out.
wait_for() {
    n=0
    while [ ! -e "$1" ]; do
        kill -0 "$2" 2>/dev/null || return 1
        [ $n -ge $(($3 * 10)) ] && return 1
        sleep 0.1
        n=$((n + 1))
    done
}

# measure PID COUNT: after COUNT cycles decode paused (no engine of its own
# alive); give prefill a moment to reclaim the closed connection, sample it,
# let decode go on. Leaves the sample in $got.
measure() {
    got=""
    wait_for "$work/sync.$2" "$dpid" 300 || return 1
    sleep 2
    got=$(sample "$1")
    touch "$work/sync.$2.ack"
}

soak() {
    name="soak: $cycles decode connect/transfer/disconnect cycles (every ${kill_every}th killed) against one prefill"
    echo "[ RUN      ] $name"
    total=$((cycles + 1)) # the last cycle only lets prefill finish after the end sample
    kills=$(seq $((kill_every - 1)) $kill_every $((total - 1)) | paste -sd, -)
    rm -f "$work/bs" "$work"/sync.*
    # Prefill creates all its senders up front, so the last ones wait for
    # their decode engine for the whole soak; max_peers 4 proves that dead
    # connections' slots come back.
    # shellcheck disable=SC2086
    KVW_BOOTSTRAP_TIMEOUT_MS=900000 KVW_MAX_PEERS=4 "$xfer" prefill --dev "$dev0" --ip "$ip0" \
        --embed-bootstrap "$work/bs" $layout --requests $total --inflight 1 --quiet \
        --may-fail "$kills" >"$work/soak-p.log" 2>&1 &
    ppid=$!
    # shellcheck disable=SC2086
    "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" $layout --quiet \
        --cycles $total --kill-every $kill_every --sync-file "$work/sync" \
        --sync-at "$warm,$cycles" >"$work/soak-d.log" 2>&1 &
    dpid=$!
    t0=$(date +%s)
    rc=0
    measure $ppid $warm || rc=1
    before=$got
    measure $ppid "$cycles" || rc=1
    after=$got
    wait $dpid || rc=1
    wait $ppid || rc=1
    took=$(($(date +%s) - t0))
    grep -E '^(decode|prefill):|kvwire\[[0-9.]*\] ERROR|NOT AS EXPECTED' "$work/soak-d.log" "$work/soak-p.log" |
        sed 's#^[^:]*/soak-\(.\)\.log:#    \1| #'
    # A room prefill failed though its decode engine was not killed: why.
    for r in $(sed -n 's/^room \([0-9]*\): NOT AS EXPECTED.*/\1/p' "$work/soak-p.log"); do
        grep "^room $r: FAILED" "$work/soak-p.log" | sed 's/^/    p| /'
        grep "^room $r: " "$work/soak-d.log" | sed 's/^/    d| /'
    done
    # A room decode failed in a clean cycle (no process was killed): why, on
    # both sides (the doomed processes print no room lines).
    for r in $(sed -n 's/^room \([0-9]*\): FAILED.*/\1/p' "$work/soak-d.log"); do
        grep "^room $r: " "$work/soak-d.log" | sed 's/^/    d| /'
        grep "^room $r: " "$work/soak-p.log" | sed 's/^/    p| /'
    done
    pfail=$(sed -n 's/^room \([0-9]*\): FAILED.*/\1/p' "$work/soak-p.log" |
        awk -v k=$kill_every '$1 % k == k - 1' | wc -l)
    echo "    prefill: $pfail of the $(echo "$kills" | tr , '\n' | wc -l) killed decode processes' rooms failed there (the rest had landed)"
    echo "    soak took $took s"
    if [ -n "$before" ] && [ -n "$after" ]; then
        # shellcheck disable=SC2086 # split the two samples into fields
        set -- $before $after
        echo "    prefill process after $warm cycles: $1 fds, $2 threads, VmRSS $3 KiB"
        echo "    prefill process after $cycles cycles: $4 fds, $5 threads, VmRSS $6 KiB"
        [ "$4" -le "$1" ] || { echo "    fds grew"; rc=1; }
        [ "$5" -le "$2" ] || { echo "    threads grew"; rc=1; }
        [ "$6" -le $(($3 + rss_slack_kib)) ] || { echo "    VmRSS grew by more than $rss_slack_kib KiB"; rc=1; }
    else
        echo "    no samples (a process died early):"
        tail -n 5 "$work/soak-d.log" "$work/soak-p.log" | sed 's/^/    /'
        kill -9 $dpid $ppid 2>/dev/null
    fi
    result "$name" $rc
}

# The bootstrap service runs in its own process here (not embedded in
# prefill), so each measured process holds one engine and nothing else.
idle() {
    name="idle: prefill and decode connected for $idle_s s wake at most 25 times a second each"
    echo "[ RUN      ] $name"
    rm -f "$work/bs"
    start_bootstrap "$ip0"
    small="--layers 2 --item 4096 --pool 16 --pages 4 --requests 2 --inflight 1 --idle-s $idle_s"
    # shellcheck disable=SC2086
    "$xfer" prefill --dev "$dev0" --ip "$ip0" --bootstrap "$bs" $small >"$work/idle-p.log" 2>&1 &
    ppid=$!
    # shellcheck disable=SC2086
    "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap "$bs" $small --quiet \
        >"$work/idle-d.log" 2>&1
    rc=$?
    wait $ppid || rc=1
    kill $bspid
    wait $bspid
    grep -h ' idle' "$work/idle-p.log" "$work/idle-d.log" | sed 's/^/    /'
    result "$name" $rc
}

# The kernel's network counters the control plane's TCP depends on: packets
# the backlog dropped (softnet_stat, column 2, summed over CPUs), TCP
# retransmitted segments and retransmission timeouts.
net_counters() {
    drops=0
    while read -r _ d _; do drops=$((drops + 0x$d)); done </proc/net/softnet_stat
    retrans=$(awk '/^Tcp:/ { if (!h) { for (i = 1; i <= NF; i++) c[$i] = i; h = 1 } else print $c["RetransSegs"] }' /proc/net/snmp)
    rto=$(awk '/^TcpExt:/ { if (!h) { for (i = 1; i <= NF; i++) c[$i] = i; h = 1 } else print $c["TCPTimeouts"] }' /proc/net/netstat)
    echo "${drops:-?} ${retrans:-?} ${rto:-?}"
}

# Two decode processes stream back-to-back 12.6 MB requests (one in flight
# each) from one prefill process for about a minute: the acceptance run in
# which each decode declared the live prefill "silent for 2000 ms" 10-13 s
# in. Every room must succeed with every byte checked, and no connection
# may be declared dead.
stream() {
    n=$stream_requests
    name="stream: 2 decode processes x $n back-to-back 12.6 MB requests from one prefill"
    echo "[ RUN      ] $name"
    rm -f "$work/bs"
    big="--layers 16 --item 16384 --pool 64 --pages 24 --contig 24 --dst-contig 24 --seed 31"
    net0=$(net_counters)
    t0=$(date +%s)
    # Prefill creates every sender up front, so the last ones wait for
    # their request for the whole stream: no bootstrap timeout on its side.
    # shellcheck disable=SC2086
    KVW_BOOTSTRAP_TIMEOUT_MS=900000 \
        "$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" --decoders 2 \
        --requests "$n" --inflight 1 --quiet $big >"$work/stream-p.log" 2>&1 &
    ppid=$!
    pids=""
    for k in 0 1; do
        # shellcheck disable=SC2086
        "$xfer" decode --dev "$dev1" --ip "$ip1" --bootstrap-file "$work/bs" \
            --decoder-index $k --requests "$n" --inflight 1 --quiet $big \
            >"$work/stream-d$k.log" 2>&1 &
        pids="$pids $!"
    done
    rc=0
    for p in $pids; do wait "$p" || rc=1; done
    wait $ppid || rc=1
    echo "    streamed for $(($(date +%s) - t0)) s"
    # shellcheck disable=SC2086
    set -- $net0 $(net_counters)
    echo "    network meanwhile: $(($4 - $1)) packets dropped by the backlog, $(($5 - $2)) TCP" \
        "segments retransmitted, $(($6 - $3)) TCP retransmission timeouts"
    for f in "$work"/stream-*.log; do
        grep -E '^(decode|prefill):|FAILED|silent|kvwire (WARN|ERROR)' "$f" | head -n 40 |
            sed "s#^#    $(basename "$f" .log)| #"
    done
    if grep -q 'silent for' "$work"/stream-*.log; then
        echo "    a live peer was declared silent"
        rc=1
    fi
    if [ $rc -ne 0 ] && [ -n "${KVW_STREAM_LOGS:-}" ]; then
        mkdir -p "$KVW_STREAM_LOGS" && cp "$work"/stream-*.log "$KVW_STREAM_LOGS/"
    fi
    result "$name" $rc
}

echo "[==========] soak and idle scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
[ $# -gt 0 ] && shift
# stream is not in the default set: on the test bed's rxe (guest kernel
# 6.1) about one run in three ends with one request's RDMA write NAKed
# "remote invalid request" and decode's QP in error, before and after this
# change alike (see docs/testing.md, Known problems); make stream runs it.
[ $# -gt 0 ] || set -- soak idle
for s in "$@"; do
    case $s in
    soak | idle | stream) $s ;;
    *) echo "unknown scenario $s (want soak, idle or stream)" && failed=$((failed + 1)) ;;
    esac
done
rm -rf "$work"
echo "[==========] soak and idle scenarios: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
