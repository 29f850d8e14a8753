#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Failure scenarios on real rxe, separate prefill and decode processes
# (tools/kvw-xfer in fault mode): a peer killed with SIGKILL mid-transfer,
# a killed prefill restarted under the same rank serving the same decode
# engine again, aborts on either side (decode watching that nothing lands
# after Failed), and requests on a connection that survive another
# request's abort or out-of-range pages. Each side judges its own rooms
# (exit status); this script adds the measurements that need both sides or
# the kill time: every time is printed, and checked against a bound.
# Runs inside the test bed. Usage: fault_scenarios.sh BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"

# Bounds (ms). A killed peer is noticed when its control connection closes
# (well under a second on a fast machine); the guest is 20-50x slower.
KILL_BOUND_MS=3000
PROMPT_BOUND_MS=3000
# A restarted prefill: from its start to decode's first request served by
# it (engine start, registration, decode's lookup retry, handshake, 8 MB).
RESTART_BOUND_MS=10000
# A silent peer (SIGSTOP: connection open, no answers): the default
# KVW_PEER_TIMEOUT_MS of 2 s, plus a control tick and the guest's slowness,
# counted from its last sign of life: the stop, or a request that landed
# after it (the NIC, rxe's kernel threads here, still delivers what the
# stopped process had posted, and data arriving counts as life).
# Twice the timeout: a loaded guest must not fail it, and it still tells
# heartbeat detection from the requests' own 30 s deadlines.
SILENT_BOUND_MS=4000

# Kill scenarios: 4 requests of 8 MB in flight per decode engine (~30 MB/s
# in the guest, so a wave takes seconds and the kill lands mid-transfer).
KILL_WORK="--layers 8 --item 16384 --pool 128 --pages 32 --requests 4 --inflight 4
    --contig 4 --dst-contig 2 --aux-item 256 --aux-items 8 --seed 21"
# kill -9 of a decode engine: twice the wave, all in flight, so the wave
# cannot end in the second or so a loaded guest takes to notice A's first
# bytes and kill it.
KILL_DECODE_WORK="$KILL_WORK --requests 8 --inflight 8 --pool 256"
# A silent peer is detected in ~2 s: 8 requests of 8 MB, all in flight, so
# the wave cannot end before the SIGSTOP.
SILENT_WORK="--layers 8 --item 16384 --pool 256 --pages 32 --requests 8 --inflight 8
    --contig 4 --dst-contig 2 --aux-item 256 --aux-items 8 --seed 22"
# Abort scenarios: 6 requests of 8 MB, 3 in flight, one page per WR (1025
# WRs a request, more than the send queue holds, so prefill still has
# writes to post when the abort comes).
ABORT_WORK="--layers 8 --item 8192 --pool 256 --pages 64 --requests 6 --inflight 3
    --contig 2 --dst-contig 1 --aux-item 256 --aux-items 8 --seed 31"
# Bystander scenarios: 8 requests of 4 MB, 4 in flight.
BYSTANDER_WORK="--layers 8 --item 4096 --pool 256 --pages 64 --requests 8 --inflight 4
    --contig 2 --dst-contig 1 --aux-item 128 --aux-items 8 --seed 41"

now_ms() { date +%s%3N; }

# need MESSAGE: an expectation of this scenario does not hold
need() {
    echo "    NOT OK: $1"
    rc=1
}

# within MS LIMIT WHAT: print a measured time, check it against its bound
within() {
    if [ -z "$1" ]; then
        need "$3: not measured"
    elif [ "$1" -gt "$2" ]; then
        need "$3: $1 ms (bound $2 ms)"
    else
        echo "    $3: $1 ms (bound $2 ms)"
    fi
}

# wall LOG ROOM WHAT: wall clock (ms) of the first "room ROOM: WHAT... [... at W ms]"
wall() {
    sed -n "s/^room $2: $3.*\[.*at \([0-9]*\) ms\]\$/\1/p" "$1" | head -n 1
}

# last_failed LOG: wall clock (ms) of the latest FAILED line
last_failed() {
    sed -n 's/^room [0-9]*: FAILED.*\[.*at \([0-9]*\) ms\]$/\1/p' "$1" | sort -n | tail -n 1
}

# last_landed LOG: wall ms of the last request that ended verified, if any
last_landed() {
    sed -n 's/^room [0-9]*: .*every byte verified \[at \([0-9]*\) ms\]$/\1/p' "$1" |
        sort -n | tail -n 1
}

# diff_ms A B: B - A, empty if either is missing
diff_ms() {
    if [ -n "$1" ] && [ -n "$2" ]; then echo $(($2 - $1)); fi
}

# start_prefill LOG ARGS...: prefill on device 0, embedded bootstrap; sets ppid
start_prefill() {
    log=$1
    shift
    rm -f "$work/bs"
    # shellcheck disable=SC2086
    "$xfer" prefill --dev "$dev0" --ip "$ip0" --embed-bootstrap "$work/bs" "$@" >"$log" 2>&1 &
    ppid=$!
}

# start_decode LOG DEV IP ARGS...: sets dpid
start_decode() {
    log=$1 d=$2 i=$3
    shift 3
    "$xfer" decode --dev "$d" --ip "$i" --bootstrap-file "$work/bs" "$@" >"$log" 2>&1 &
    dpid=$!
}

# wait_file FILE SECONDS
wait_file() {
    n=0
    while [ ! -s "$1" ]; do
        [ $n -ge $(($2 * 20)) ] && return 1
        sleep 0.05
        n=$((n + 1))
    done
}

# show LOG LABEL: the lines worth reading
SHOW='FAILED|NOT |verdict|canary|abort|out-of-range|WRs posted|requests ok|prefill: [0-9]'
SHOW="$SHOW|deadline|not started|ERROR|keep-going"
show() {
    grep -E "$SHOW" "$1" | sed "s/^/    $2| /"
}

# ---------------------------------------------------------------- kill -9

# kill_decode TOPO DEV IP: decode engine A is killed mid-transfer while B
# (same prefill) transfers too; prefill fails A's requests in bounded time,
# B completes, a restarted engine C (new process, same workload) completes.
kill_decode() {
    name="kill -9 decode mid-transfer: prefill fails its requests, others unaffected ($1)"
    echo "[ RUN      ] $name: $dev0 ($ip0) -> $2 ($3)"
    rc=0
    rm -f "$work/ready"
    # shellcheck disable=SC2086
    start_prefill "$work/p.log" --decoders 3 --may-fail 0-7 --deadline-s 90 $KILL_DECODE_WORK
    # shellcheck disable=SC2086
    start_decode "$work/a.log" "$2" "$3" --decoder-index 0 --ready-file "$work/ready" \
        --deadline-s 60 $KILL_DECODE_WORK
    apid=$dpid
    # shellcheck disable=SC2086
    start_decode "$work/b.log" "$2" "$3" --decoder-index 1 --deadline-s 60 $KILL_DECODE_WORK
    bpid=$dpid
    if wait_file "$work/ready" 40; then
        tkill=$(now_ms)
        kill -9 "$apid"
        landed=$(sed -n 's/^ready \([0-9]*\)$/\1/p' "$work/ready")
        echo "    decode A killed $(diff_ms "$landed" "$tkill") ms after its first bytes landed"
    else
        need "decode A never had bytes landing"
        kill -9 "$apid"
        tkill=""
    fi
    wait "$apid" 2>/dev/null
    # shellcheck disable=SC2086
    start_decode "$work/c.log" "$2" "$3" --decoder-index 2 --deadline-s 60 $KILL_DECODE_WORK
    cpid=$dpid
    wait "$bpid" || need "decode B (same prefill, alive) did not complete every request"
    wait "$cpid" || need "restarted decode C did not complete every request"
    wait "$ppid" ||
        need "prefill did not end as expected (A's requests Failed, B's and C's Success)"
    show "$work/p.log" prefill
    show "$work/b.log" "decode B"
    show "$work/c.log" "decode C"
    grep -q '^room [0-7]: FAILED' "$work/p.log" ||
        need "no request of A failed at prefill (killed too late?)"
    within "$(diff_ms "$tkill" "$(last_failed "$work/p.log")")" $KILL_BOUND_MS \
        "prefill failed A's last request after the kill"
    result "$name" $rc
}

# kill_prefill: prefill killed mid-transfer; decode's requests fail in
# bounded time and decode exits (no hang).
kill_prefill() {
    name="kill -9 prefill mid-transfer: decode fails its requests in bounded time"
    echo "[ RUN      ] $name: $dev0 ($ip0) -> $dev1 ($ip1)"
    rc=0
    rm -f "$work/ready"
    # shellcheck disable=SC2086
    start_prefill "$work/p.log" --deadline-s 60 $KILL_WORK
    # shellcheck disable=SC2086
    start_decode "$work/d.log" "$dev1" "$ip1" --ready-file "$work/ready" --may-fail all \
        --deadline-s 30 $KILL_WORK
    if wait_file "$work/ready" 40; then
        tkill=$(now_ms)
        kill -9 "$ppid"
    else
        need "decode never had bytes landing"
        kill -9 "$ppid"
        tkill=""
    fi
    wait "$ppid" 2>/dev/null
    wait "$dpid" ||
        need "decode did not end cleanly (a request neither Success-verified nor Failed, or a hang)"
    tend=$(now_ms)
    show "$work/d.log" decode
    grep -q '^room [0-9]*: FAILED' "$work/d.log" || need "no request failed (killed too late?)"
    within "$(diff_ms "$tkill" "$(last_failed "$work/d.log")")" $KILL_BOUND_MS \
        "decode failed its last request after the kill"
    echo "    decode exited $(diff_ms "$tkill" "$tend") ms after the kill"
    result "$name" $rc
}

# restart_prefill: a standalone bootstrap service outlives prefill P1, which
# is killed mid-transfer; one decode engine D (one process throughout, with
# --keep-going) fails its first wave in bounded time and goes on with its
# second wave, whose rooms a new prefill P2 (same rank, same bootstrap,
# --first-room) serves: D's engine has to look rank 0 up again and connect
# to P2, and every byte must verify.
restart_prefill() {
    name="kill -9 prefill mid-transfer, a restarted prefill serves the same decode engine"
    echo "[ RUN      ] $name: $dev0 ($ip0) -> $dev1 ($ip1)"
    rc=0
    rm -f "$work/ready" "$work/bs"
    start_bootstrap "$ip0"
    printf '%s\n' "$bs" >"$work/bs"
    [ -n "$bs" ] || need "the bootstrap service did not start"
    echo "    bootstrap service (pid $bspid) at $bs"
    # P1 serves rooms 0-3 (D's first wave), P2 rooms 4-7 (D's second).
    # shellcheck disable=SC2086
    "$xfer" prefill --dev "$dev0" --ip "$ip0" --bootstrap "$bs" --deadline-s 60 $KILL_WORK \
        >"$work/p1.log" 2>&1 &
    p1pid=$!
    # shellcheck disable=SC2086
    start_decode "$work/d.log" "$dev1" "$ip1" --ready-file "$work/ready" --may-fail 0-3 \
        --keep-going --deadline-s 20 $KILL_WORK --requests 8
    tkill=""
    if wait_file "$work/ready" 40; then
        tkill=$(now_ms)
        kill -9 "$p1pid"
    else
        need "decode never had bytes landing"
        kill -9 "$p1pid"
    fi
    wait "$p1pid" 2>/dev/null
    # P2 once D has given its first wave up (D prints its rooms when the
    # wave has ended; bounded below) and started its second, so D's new
    # lookup of rank 0 races P2's start and registration.
    n=0
    until grep -q '^decode: room [0-3] failed without an injected fault' "$work/d.log" ||
        [ $n -ge 200 ]; do
        sleep 0.05
        n=$((n + 1))
    done
    tp2=$(now_ms)
    # shellcheck disable=SC2086
    "$xfer" prefill --dev "$dev0" --ip "$ip0" --bootstrap "$bs" --first-room 4 --deadline-s 20 \
        $KILL_WORK >"$work/p2.log" 2>&1 &
    p2pid=$!
    wait "$dpid" || need "decode D did not end as expected (first wave Failed or Success, \
second wave Success with every byte verified)"
    wait "$p2pid" || need "restarted prefill P2 did not serve every room of D's second wave"
    kill "$bspid"
    wait "$bspid" 2>/dev/null
    show "$work/d.log" "decode D"
    show "$work/p2.log" "prefill P2"
    grep -q '^room [0-3]: FAILED' "$work/d.log" ||
        need "no request of D's first wave failed (killed too late?)"
    within "$(diff_ms "$tkill" "$(sed -n 's/^room [0-3]: FAILED.*\[.*at \([0-9]*\) ms\]$/\1/p' \
        "$work/d.log" | sort -n | tail -n 1)")" $KILL_BOUND_MS \
        "decode failed its last first-wave request after the kill"
    resumed=$(sed -n 's/^decode: room .*(--keep-going) \[at \([0-9]*\) ms\]$/\1/p' "$work/d.log")
    echo "    decode D (pid $dpid, one engine throughout) started its second wave" \
        "$(diff_ms "$tkill" "$resumed") ms after the kill, prefill P2 $(diff_ms "$tkill" "$tp2") ms"
    first_ok=$(sed -n 's/^room [4-7]: .*every byte verified \[at \([0-9]*\) ms\]$/\1/p' \
        "$work/d.log" | sort -n | head -n 1)
    within "$(diff_ms "$tp2" "$first_ok")" $RESTART_BOUND_MS \
        "decode's first request served by P2 succeeded after P2 started"
    result "$name" $rc
}

# silent_prefill: prefill stopped (SIGSTOP) mid-transfer, as a hung host
# looks: its TCP connection stays open, so only heartbeats can tell. With
# the default settings decode must fail its requests within
# KVW_PEER_TIMEOUT_MS (2 s) plus one control tick.
silent_prefill() {
    name="silent prefill (SIGSTOP) mid-transfer: decode fails its requests by heartbeat"
    echo "[ RUN      ] $name: $dev0 ($ip0) -> $dev1 ($ip1)"
    rc=0
    rm -f "$work/ready"
    # shellcheck disable=SC2086
    start_prefill "$work/p.log" --deadline-s 60 $SILENT_WORK
    # shellcheck disable=SC2086
    start_decode "$work/d.log" "$dev1" "$ip1" --ready-file "$work/ready" --may-fail all \
        --deadline-s 30 $SILENT_WORK
    tstop=""
    if wait_file "$work/ready" 40; then
        tstop=$(now_ms)
        kill -STOP "$ppid"
    else
        need "decode never had bytes landing"
    fi
    wait "$dpid" ||
        need "decode did not end cleanly (a request neither Success-verified nor Failed, or a hang)"
    kill -CONT "$ppid" 2>/dev/null
    kill -9 "$ppid" 2>/dev/null
    wait "$ppid" 2>/dev/null
    show "$work/d.log" decode
    grep -q '^room [0-9]*: FAILED' "$work/d.log" || need "no request failed (stopped too late?)"
    tlife=$tstop
    tland=$(last_landed "$work/d.log")
    if [ -n "$tstop" ] && [ -n "$tland" ] && [ "$tland" -gt "$tstop" ]; then
        echo "    a request landed $((tland - tstop)) ms after the stop (posted before it)"
        tlife=$tland
    fi
    within "$(diff_ms "$tlife" "$(last_failed "$work/d.log")")" $SILENT_BOUND_MS \
        "decode failed its last request after prefill's last sign of life"
    result "$name" $rc
}

# ------------------------------------------------------------------ abort

# pair NAME DEV IP ARGS...: prefill and one decode with the same options;
# both must end as expected. Logs in $work/p.log and $work/d.log.
pair() {
    pd=$2 pi=$3
    name=$1
    shift 3
    echo "[ RUN      ] $name: $dev0 ($ip0) -> $pd ($pi): $*"
    rc=0
    rm -f "$work/sync"
    start_prefill "$work/p.log" --deadline-s 60 "$@"
    start_decode "$work/d.log" "$pd" "$pi" --deadline-s 60 "$@"
    wait "$dpid" || need "decode did not end as expected"
    wait "$ppid" || need "prefill did not end as expected"
    show "$work/p.log" prefill
    show "$work/d.log" decode
}

# mid_transfer DECODE_LOG ROOM: the aborted room had bytes written when it
# Failed (else the abort did not test what it claims)
mid_transfer() {
    n=$(sed -n "s/^room $2: canary: \([0-9]*\) of [0-9]* items written at Failed.*/\1/p" "$1")
    if [ -z "$n" ] || [ "$n" -eq 0 ]; then
        need "room $2 had no bytes written when it Failed: not aborted mid-transfer"
    fi
}

# status_is LOG ROOM PATTERN WHAT
status_is() {
    grep -q "^room $2: FAILED after [0-9]* ms: $3" "$1" || need "$4"
}

abort_decode() {
    # shellcheck disable=SC2086
    pair "decode aborts a request mid-transfer, nothing lands after Failed" "$dev1" "$ip1" \
        $ABORT_WORK --abort-room 1 --abort-side decode --abort-after-ms 100 \
        --hold-rest "$work/sync" --expect-failed 1 --canary-ms 2000
    status_is "$work/d.log" 1 KVW_ERR_ABORTED "decode's room 1 is not KVW_ERR_ABORTED"
    mid_transfer "$work/d.log" 1
    within "$(diff_ms "$(wall "$work/d.log" 1 abort)" "$(wall "$work/p.log" 1 FAILED)")" \
        $PROMPT_BOUND_MS "prefill's sender Failed after decode's abort"
    result "$name" $rc
}

# Prefill cannot see when a room's writes start (it may serve other rooms
# of the wave first), so decode tells it through --abort-sync: prefill
# aborts 100 ms after decode saw the room's first bytes land.
abort_prefill() {
    # shellcheck disable=SC2086
    pair "prefill aborts a request mid-transfer, decode told after its writes drained" \
        "$dev1" "$ip1" $ABORT_WORK --abort-room 1 --abort-side prefill --abort-after-ms 30 \
        --abort-sync "$work/sync" --hold-rest "$work/sync" --expect-failed 1 --canary-ms 2000
    status_is "$work/p.log" 1 KVW_ERR_ABORTED "prefill's room 1 is not KVW_ERR_ABORTED"
    mid_transfer "$work/d.log" 1
    grep -q '^room 1: FAILED after [0-9]* ms: [A-Z_]*: prefill: ' "$work/d.log" ||
        need "decode's room 1 reason does not start with \"prefill: \""
    within "$(diff_ms "$(wall "$work/p.log" 1 abort)" "$(wall "$work/d.log" 1 FAILED)")" \
        $PROMPT_BOUND_MS "decode's receiver Failed after prefill's abort"
    result "$name" $rc
}

# ------------------------------------------------------------- bystanders

# Room 1 aborted by one side (prefill: see abort_prefill), room 2 given an
# out-of-range page by the other side, both in the first wave; the other
# rooms on the same connection (the rest of that wave, and the next wave)
# must end Success, every byte verified.
bystander_1() {
    # shellcheck disable=SC2086
    pair "bystanders survive decode's abort and prefill's out-of-range source page" \
        "$dev0" "$ip0" $BYSTANDER_WORK --abort-room 1 --abort-side decode --abort-after-ms 50 \
        --hold-rest "$work/sync" --bad-room 2 --bad-side prefill --expect-failed 1,2 \
        --canary-ms 500
    status_is "$work/p.log" 2 KVW_ERR_OUT_OF_RANGE "prefill's room 2 is not KVW_ERR_OUT_OF_RANGE"
    mid_transfer "$work/d.log" 1
    grep -q '^room 2: FAILED after [0-9]* ms: [A-Z_]*: prefill: ' "$work/d.log" ||
        need "decode's room 2 reason does not start with \"prefill: \""
    within "$(sed -n 's/^room 2: FAILED after \([0-9]*\) ms.*/\1/p' "$work/d.log")" \
        $PROMPT_BOUND_MS "decode's receiver for prefill's bad room Failed after its init"
    within "$(diff_ms "$(wall "$work/d.log" 1 abort)" "$(wall "$work/p.log" 1 FAILED)")" \
        $PROMPT_BOUND_MS "prefill's sender Failed after decode's abort"
    result "$name" $rc
}

bystander_2() {
    # shellcheck disable=SC2086
    pair "bystanders survive prefill's abort and decode's out-of-range destination page" \
        "$dev0" "$ip0" $BYSTANDER_WORK --abort-room 1 --abort-side prefill --abort-after-ms 50 \
        --abort-sync "$work/sync" --hold-rest "$work/sync" --bad-room 2 --bad-side decode \
        --expect-failed 1,2 \
        --canary-ms 500
    status_is "$work/d.log" 2 KVW_ERR_OUT_OF_RANGE "decode's room 2 is not KVW_ERR_OUT_OF_RANGE"
    mid_transfer "$work/d.log" 1
    within "$(diff_ms "$(wall "$work/d.log" 2 out-of-range)" "$(wall "$work/p.log" 2 FAILED)")" \
        $PROMPT_BOUND_MS "prefill's sender Failed after decode's bad init"
    within "$(diff_ms "$(wall "$work/p.log" 1 abort)" "$(wall "$work/d.log" 1 FAILED)")" \
        $PROMPT_BOUND_MS "decode's receiver Failed after prefill's abort"
    result "$name" $rc
}

echo "[==========] fault scenarios on real RDMA (test bed mode ${KVW_TB_MODE:-?})"
if [ $# -gt 1 ]; then # fault_scenarios.sh BUILD NAME...: only those
    shift
    for s in "$@"; do $s; done
else
    kill_decode same "$dev0" "$ip0"
    kill_decode cross "$dev1" "$ip1"
    kill_prefill
    restart_prefill
    silent_prefill
    abort_decode
    abort_prefill
    bystander_1
    bystander_2
fi
rm -rf "$work"
echo "[==========] fault scenarios: $passed passed, $failed failed"
[ $failed -eq 0 ]
