#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Run one libFuzzer harness and say how many inputs it ran.
#
#   tests/fuzz/run-fuzz.sh BIN SEEDS WORK time SECONDS [MIN_RUNS]
#       fuzz for SECONDS; new inputs go to WORK (kept between runs). With
#       MIN_RUNS, fuzz until at least that many inputs ran (SECONDS then
#       only bounds each further round).
#   tests/fuzz/run-fuzz.sh BIN SEEDS WORK short RUNS
#       deterministic pass (-seed=1) of RUNS inputs from the seeds alone;
#       WORK is emptied first.
#
# Exit status: 0 when libFuzzer found nothing; libFuzzer's own (crash, leak,
# timeout) otherwise, with its log on stderr and the input under WORK/../.
set -eu

bin=$1 seeds=$2 work=$3 mode=$4 amount=$5 min_runs=${6:-0}
name=$(basename "$bin")
artifacts=$(dirname "$work")/artifacts
log=$(dirname "$work")/$name.log
mkdir -p "$work" "$artifacts"

# -timeout: a single input running this long is a hang (the harnesses'
# own sync deadline is shorter). -rss_limit_mb: the engine harnesses hold
# engines and ZeroMQ contexts; ASan's shadow makes them look big.
common="-timeout=30 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=$artifacts/$name-"

run() {
    if ! "$bin" $common "$@" >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "$name: FAILED (log: $log, input under $artifacts/)" >&2
        exit 1
    fi
}

executed() {
    sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1
}

rate() {
    sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1
}

case $mode in
short)
    rm -rf "$work" && mkdir -p "$work"
    run -seed=1 -runs="$amount" "$work" "$seeds"
    echo "$name: $(executed) inputs (deterministic, -seed=1), no crash, hang or sanitizer report"
    ;;
time)
    total=0 rounds=0
    while :; do
        run -max_total_time="$amount" "$work" "$seeds"
        total=$((total + $(executed)))
        rounds=$((rounds + 1))
        echo "$name: round $rounds: $(executed) inputs at $(rate)/s"
        [ "$total" -ge "$min_runs" ] && break
    done
    echo "$name: $total inputs in $rounds round(s) of ${amount}s, no crash, hang or sanitizer report"
    ;;
*)
    echo "run-fuzz.sh: unknown mode $mode" >&2
    exit 2
    ;;
esac
