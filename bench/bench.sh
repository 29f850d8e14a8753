#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# kvwire vs perftest, run inside the test bed by `make bench`.
# For each size, REPS interleaved reps of: ib_write_bw (rxe0 -> rxe0, -n
# iteration mode) then kvwire-bench moving the same number of bytes in
# WRs of the same size, also rxe0 -> rxe0 (prefill and decode engines on the
# same device; the steadier topology). Reports the median of the per-rep
# ratios kvwire/perftest and the raw values. Rules:
# the test bed notes in README "Benchmarks" (noisy guest: ratios, interleaved, median).
#   2k   fragmented KV pages, one 2 KiB page per WR, vs ib_write_bw -s 2048
#        and vs ib_write_bw -s 2048 --post_list 32 (message rate)
#   64k  contiguous blocks, 32 x 2 KiB pages per run = one 64 KiB WR
#   1m   contiguous blocks, 512 x 2 KiB pages per run = one 1 MiB WR
#   lat  ib_write_lat -s 8 vs one 1-layer, 8-byte-item request (p50)
#   layer  layer-wise streaming vs send at end: a simulated forward pass (32
#        layers, LAYER_MS ms each), time from the last layer ready to
#        decode's Success, REPS interleaved pairs (kvwire-bench --layer-ms);
#        then the latency critical path (one 8 B request, send() -> decode's
#        Success), its raw-verbs floor (kvw-rawlat, the same request shape
#        with no kvwire code) and both latency targets side by side
#   idle  prefill and decode processes connected and idle: CPU per process
#        as % of a core (KVW_BENCH_IDLE_S, 30 s)
#   storm  KVW_BENCH_STORM_ENGINES (64) decode engines connect to one prefill
#        at once (bench/kvw-storm, rxe0 -> rxe1): time to connected, failures,
#        per-connection throughput spread
#   verify  the end-to-end check of the bytes (KVW_VERIFY=1, CRC32C on both
#        sides) against the same run without it, 64 KiB and 1 MiB workloads,
#        interleaved (which goes first alternates by rep): GB/s and CPU-s/GB
#        of both sides, on / off
# Each ratio is reported as its median with the interquartile range and a
# ~95% confidence interval of the median (order statistics), and a verdict
# against its target: met (the whole interval on the right side), missed
# (the whole interval on the wrong side), or not separable at this REPS.
# Usage: bench.sh BUILD_DIR     env: KVW_BENCH_REPS (9), KVW_BENCH_SIZES ("2k 64k 1m lat
#        layer tp idle storm verify"), LAYER_MS (20); REPS and SIZES also work when run by hand
set -u
build=${1:-build}
# KVW_BENCH_*: the test bed passes only KVW_* variables into the guest.
reps=${KVW_BENCH_REPS:-${REPS:-9}}
sizes=${KVW_BENCH_SIZES:-${SIZES:-"2k 64k 1m lat layer tp idle storm verify"}}
dev=${KVW_TB_DEV0:?run inside tests/tools/kvw-testbed} ip=${KVW_TB_IP0}
gid=${KVW_TB_GID_INDEX0:-1}
work=$(mktemp -d)
raw=$work/raw.tsv # size rep metric value
trap 'rm -rf "$work"' EXIT
: >"$raw"
fails=0

note() { printf '%s\n' "$*" >&2; }
rec() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$raw"; }

# perftest BYTES_PER_SEC of `ib_write_bw ARGS` (server and client on $dev).
# perftest's MB is reported from MsgRate (exact) when precise enough.
pt_bw() { # size iters extra...
    size=$1 iters=$2
    shift 2
    ib_write_bw -d "$dev" -x "$gid" -F -n "$iters" -s "$size" "$@" >"$work/srv.out" 2>&1 &
    spid=$!
    sleep 1.5
    ok=1
    for _ in 1 2 3; do
        if ib_write_bw -d "$dev" -x "$gid" -F -n "$iters" -s "$size" "$@" "$ip" \
            >"$work/cli.out" 2>&1; then
            ok=0
            break
        fi
        sleep 1
    done
    wait "$spid" 2>/dev/null
    if [ $ok -ne 0 ]; then
        note "ib_write_bw -s $size $* failed:"
        tail -5 "$work/cli.out" >&2
        echo 0
        return
    fi
    # "#bytes #iterations BW-peak BW-average[MB/sec] MsgRate[Mpps]"
    awk -v s="$size" '$1 == s && NF >= 5 { bw = $4; mr = $5 }
        END { b = mr * 1e6 * s; m = bw * 1048576; d = bw * 1e6
              # MsgRate has 6 decimals: trust it when it has >= 4 digits,
              # else take BW avg in perftest MB (2^20 B).
              if (mr >= 0.001) printf "%.0f\n", b; else printf "%.0f\n", m }' "$work/cli.out"
}

# kv_env: KVW_* settings for this run only (e.g. KVW_VERIFY=1; empty: none);
# kv_pfx: the metrics' prefix (kv: kv_GBps ...).
kv_env='' kv_pfx=kv
kv() { # tag rep args... -> prints GB/s etc into raw, returns json line in $work/kv.json
    tag=$1 rep=$2
    shift 2
    # shellcheck disable=SC2086
    if ! env $kv_env "$build/kvwire-bench" --dev0 "$dev" --ip0 "$ip" --dev1 "$dev" --ip1 "$ip" --quiet \
        --json "$@" >"$work/kv.json" 2>"$work/kv.err"; then
        note "kvwire-bench $* FAILED:"
        cat "$work/kv.json" "$work/kv.err" >&2
        fails=$((fails + 1))
        return 1
    fi
    j=$(tail -1 "$work/kv.json")
    for k in GBps req_per_s wrs_per_s bytes_per_wr chains_per_req p50_ms p99_ms \
        prefill_cpu_s_per_GB decode_cpu_s_per_GB prefill_cq_sleeps; do
        v=$(printf '%s\n' "$j" | sed -n "s/.*\"$k\":\([-0-9.e+]*\).*/\1/p")
        rec "$tag" "$rep" "${kv_pfx}_$k" "$v"
    done
}

k2k="--workload fragmented --contig 1 --item 2048 --layers 4 --tokens 64 --requests 8 --warmup 1 --inflight 4"
k64k="--workload contiguous --item 2048 --layers 4 --tokens 32 --requests 16 --warmup 2 --inflight 4"
k1m="--workload contiguous --item 2048 --layers 2 --tokens 512 --requests 4 --warmup 1 --inflight 2"
klat="--workload contiguous --item 8 --layers 1 --tokens 1 --requests 40 --warmup 5 --inflight 1 --poll-us 0"

note "== kvwire bench: $dev ($ip) -> itself, $reps reps, sizes: $sizes"
t_start=$(date +%s)
rep=1
while [ $rep -le "$reps" ]; do
    for s in $sizes; do
        case $s in
        2k)
            rec 2k $rep pt_bw "$(pt_bw 2048 4096)"
            rec 2k $rep pt_bw_pl32 "$(pt_bw 2048 4096 --post_list 32)"
            # shellcheck disable=SC2086
            kv 2k $rep $k2k
            ;;
        64k)
            rec 64k $rep pt_bw "$(pt_bw 65536 128)"
            # shellcheck disable=SC2086
            kv 64k $rep $k64k
            ;;
        1m)
            rec 1m $rep pt_bw "$(pt_bw 1048576 16)"
            # shellcheck disable=SC2086
            kv 1m $rep $k1m
            ;;
        lat)
            ib_write_lat -d "$dev" -x "$gid" -F -n 500 -s 8 >"$work/srv.out" 2>&1 &
            spid=$!
            sleep 1.5
            ib_write_lat -d "$dev" -x "$gid" -F -n 500 -s 8 "$ip" >"$work/cli.out" 2>&1
            wait "$spid" 2>/dev/null
            # "#bytes #iter t_min t_max t_typical t_avg t_stdev 99% 99.9%"
            rec lat $rep pt_lat_us "$(awk '$1 == 8 && NF >= 8 { print $5 }' "$work/cli.out")"
            # shellcheck disable=SC2086
            kv lat $rep $klat
            ;;
        verify)
            # The same runs with the check off (kv_*) and on (kvv_*); the
            # first of the pair alternates, so drift does not favour one.
            for w in v64k v1m; do
                [ $w = v64k ] && args=$k64k || args=$k1m
                for on in $((rep % 2)) $(((rep + 1) % 2)); do
                    [ "$on" = 1 ] && kv_pfx=kvv || kv_pfx=kv
                    kv_env="KVW_VERIFY=$on"
                    # shellcheck disable=SC2086
                    kv $w $rep $args
                done
            done
            kv_env='' kv_pfx=kv
            ;;
        esac
        note "   rep $rep $s done ($(($(date +%s) - t_start)) s)"
    done
    rep=$((rep + 1))
done

echo
echo "== raw values (bytes/s for pt_bw*, us for pt_lat_us, kvwire JSON fields)"
sort -k1,1 -k3,3 -k2,2n "$raw" | awk -F'\t' '{ printf "  %-4s rep %s  %-26s %s\n", $1, $2, $3, $4 }'

echo
echo "== kvwire / perftest, median of per-rep ratios ($reps reps, interleaved, rxe0 -> rxe0)"
awk -F'\t' '
    { v[$1, $2, $3] = $4; sz[$1] = 1; if ($2 > maxrep) maxrep = $2 }
    function med(a, n,   i, j, t) {
        for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
        return n ? (n % 2 ? a[(n+1)/2] : (a[n/2] + a[n/2+1]) / 2) : -1
    }
    # target: ">= 0.97" or "<= 1.2" (or "-"); lo, hi: the interval of the median
    function verdict(target, lo, hi,   t) {
        if (target !~ /^[<>]= [0-9.]+/) return ""
        t = substr(target, 4) + 0
        if (substr(target, 1, 1) == ">") return lo >= t ? "met" : hi < t ? "missed" : "not separable"
        return hi <= t ? "met" : lo > t ? "missed" : "not separable"
    }
    # value of each rep: num * numscale / den (inv: den / num, for "2 busy cores / bw")
    function ratio(s, num, numscale, den, what, target,   r, n, x, y, m, j, k, h, q1, q3) {
        n = 0
        for (r = 1; r <= maxrep; r++) {
            x = v[s, r, num]; y = v[s, r, den]
            if (x !~ /^[0-9.e+-]+$/ || y !~ /^[0-9.e+-]+$/ || y + 0 == 0) continue # "inf", failed runs
            a[++n] = x * numscale / y
        }
        if (!n) { printf "| %-4s | %-44s | n/a | | | %s | |\n", s, what, target; return }
        m = med(a, n) # sorts a
        h = 0.98 * sqrt(n); j = int(n / 2 - h); k = int(1 + n / 2 + h + 0.999)
        if (j < 1) j = 1; if (k > n) k = n
        q1 = a[int((n + 3) / 4)]; q3 = a[n + 1 - int((n + 3) / 4)]
        printf "| %-4s | %-44s | %.2fx | %.2f-%.2f | %.2f-%.2f | %s | %s |\n", s, what, m, q1, q3,
               a[j], a[k], target, verdict(target, a[j], a[k])
        delete a
    }
    END {
        print "| size | comparison | median | IQR | ~95% CI of median | target | verdict |"
        print "|---|---|---|---|---|---|---|"
        if (("2k") in sz) {
            ratio("2k", "kv_GBps", 1e9, "pt_bw", "2 KiB fragmented vs ib_write_bw", "-")
            ratio("2k", "kv_GBps", 1e9, "pt_bw_pl32", "2 KiB fragmented vs --post_list 32", ">= 0.95")
        }
        if (("64k") in sz) ratio("64k", "kv_GBps", 1e9, "pt_bw", "64 KiB contiguous vs ib_write_bw", ">= 0.97")
        if (("1m") in sz) ratio("1m", "kv_GBps", 1e9, "pt_bw", "1 MiB contiguous vs ib_write_bw", ">= 0.97")
        # CPU: perftest busy-polls one core per side for its whole run, so
        # its CPU-s per GB is 2 / (GB/s); kvwire reports both sides measured.
        for (r = 1; r <= maxrep; r++) for (s in sz)
            if (v[s, r, "pt_bw"] + 0 > 0 && v[s, r, "kv_prefill_cpu_s_per_GB"] != "") {
                v[s, r, "kv_cpu_both"] = v[s, r, "kv_prefill_cpu_s_per_GB"] + v[s, r, "kv_decode_cpu_s_per_GB"]
                v[s, r, "pt_cpu_both"] = 2 / (v[s, r, "pt_bw"] / 1e9)
            }
        if (("1m") in sz) ratio("1m", "kv_cpu_both", 1, "pt_cpu_both", "CPU-s/GB both sides vs ib_write_bw (2 cores)", "<= 1")
        if (("lat") in sz) ratio("lat", "kv_p50_ms", 1000, "pt_lat_us", "8 B request p50 / ib_write_lat typical", "<= 1.2")
        # Verified transfers: the check on over the same run off (no
        # target: its cost, reported).
        for (r = 1; r <= maxrep; r++) for (s in sz)
            if (s ~ /^v/ && v[s, r, "kvv_prefill_cpu_s_per_GB"] != "" && v[s, r, "kv_prefill_cpu_s_per_GB"] != "") {
                v[s, r, "kvv_cpu_both"] = v[s, r, "kvv_prefill_cpu_s_per_GB"] + v[s, r, "kvv_decode_cpu_s_per_GB"]
                v[s, r, "kv_cpu_both"] = v[s, r, "kv_prefill_cpu_s_per_GB"] + v[s, r, "kv_decode_cpu_s_per_GB"]
            }
        for (w = 0; w < 2; w++) {
            s = w ? "v1m" : "v64k"
            if (!((s) in sz)) continue
            ratio(s, "kvv_GBps", 1, "kv_GBps", (w ? "1 MiB" : "64 KiB") " GB/s, verify on / off", "-")
            ratio(s, "kvv_cpu_both", 1, "kv_cpu_both", (w ? "1 MiB" : "64 KiB") " CPU-s/GB both sides, on / off", "-")
        }
    }' "$raw"
# The null-device rate (kvw-wrcost --rate) is measured by make bench on
# the host before the guest boots: it is about this machine's core, which
# the emulated one is not.
echo "== null device, host core (make bench ran kvw-wrcost --rate before the guest):"
sed 's/^/  /' "$build/nullrate.txt" 2>/dev/null || echo "  not measured (run $build/kvw-wrcost --rate on the host)"
echo "== real path, host (make bench ran kvw-wrcost under callgrind before the guest):"
if grep -q "instructions per WR" "$build/wrcost.txt" 2>/dev/null; then
    grep "instructions per WR" "$build/wrcost.txt" | sed 's/^/  /'
else
    echo "  not measured (make wrcost; needs valgrind):"
    tail -2 "$build/wrcost.txt" 2>/dev/null | sed 's/^/    /'
fi
echo
echo "== kvwire CPU-s per GB (median over reps) and doorbells"
awk -F'\t' '
    $3 ~ /^kv_(prefill_cpu_s_per_GB|decode_cpu_s_per_GB|chains_per_req|bytes_per_wr|wrs_per_s|p50_ms|p99_ms)$/ { k = $1 " " $3; n[k]++; x[k, n[k]] = $4; keys[k] = 1 }
    END {
        for (k in keys) {
            m = n[k]
            for (i = 1; i <= m; i++) a[i] = x[k, i]
            for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
            printf "  %-34s %s\n", k, m % 2 ? a[(m+1)/2] : (a[m/2] + a[m/2+1]) / 2
        }
    }' "$raw" | sort
# The latency targets in one place: (a) the critical path against the
# raw-verbs floor and against ib_write_lat; (b) the whole path (decode's
# init -> Success, the lat workload) against (a) plus one ZeroMQ round trip
# measured in the same boot. Medians; values the run lacks print as n/a.
latency_summary() {
    crit_ms=$(sed -n 's/.*median: at end \([0-9.]*\) ms.*/\1/p' "$work/crit.out" | tail -1)
    rtt_us=$(sed -n 's/^ZeroMQ round trip.*: \([0-9.]*\) us$/\1/p' "$work/crit.out" | tail -1)
    floor_us=$(sed -n 's/.*receive completion median \([0-9.]*\) us.*/\1/p' "$work/raw.out")
    med() { awk -F'\t' -v s="$1" -v k="$2" '$1 == s && $3 == k && $4 + 0 > 0 { print $4 }' "$raw" |
        sort -n | awk '{ a[NR] = $1 } END { if (NR) print NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
    lat_us=$(med lat pt_lat_us)
    whole_ms=$(sed -n 's/^whole path: decode init -> Success median \([0-9.]*\) ms.*/\1/p' "$work/crit.out")
    procs_ms=$(med lat kv_p50_ms)
    echo "== latency against its targets (medians of this run)"
    awk -v c="$crit_ms" -v f="$floor_us" -v l="$lat_us" -v w="$whole_ms" -v r="$rtt_us" -v p="$procs_ms" '
        function show(x, fmt) { return x == "" ? "n/a" : sprintf(fmt, x) }
        function ratio(a, b) { return a == "" || b == "" || b + 0 == 0 ? "n/a" : sprintf("%.2fx", a / b) }
        BEGIN {
            cu = c == "" ? "" : c * 1000            # (a) in us
            ar = c == "" || r == "" ? "" : c + r / 1000 # (a) + one round trip, ms
            printf "  (a) critical path, send() -> Success: %s; raw-verbs floor, same shape: %s -> %s\n",
                show(cu, "%.1f us"), show(f, "%.1f us"), ratio(cu, f)
            printf "      against ib_write_lat (8 B, hot loop): %s -> %s (target <= 1.2x ib_write_lat + payload time)\n",
                show(l, "%.1f us"), ratio(cu, l)
            printf "  (b) whole path, decode init -> Success: %s; (a) + one ZeroMQ round trip: %s -> %s (target <= 1)\n",
                show(w, "%.2f ms"), show(ar, "%.2f ms"), ratio(w, ar)
            printf "      the same in two processes (the lat workload, p50, its own critical path not split): %s -> %s\n",
                show(p, "%.2f ms"), ratio(p, ar)
        }'
}

case " $sizes " in *" layer "*)
    echo
    echo "== layer-wise streaming vs send at end ($dev, ${KVW_TB_DEV1:-$dev})"
    if ! "$build/kvwire-bench" --dev0 "$dev" --ip0 "$ip" --dev1 "${KVW_TB_DEV1:-$dev}" \
        --ip1 "${KVW_TB_IP1:-$ip}" --layer-ms "${LAYER_MS:-20}" --layers 32 --item 16384 \
        --tokens 16 --requests "$reps"; then
        fails=$((fails + 1))
    fi
    # The latency critical path: decode's request already at prefill, one
    # 8-byte item, from prefill's send() to decode's Success ("at end").
    echo "== critical path: one 8 B request, prefill send() -> decode Success (at end, median)"
    if ! "$build/kvwire-bench" --dev0 "$dev" --ip0 "$ip" --dev1 "$dev" --ip1 "$ip" \
        --layer-ms 1 --layers 1 --item 8 --tokens 1 --requests 21 --quiet | tee "$work/crit.out"; then
        fails=$((fails + 1))
    fi
    # Its yardstick: the same request shape (K and V writes, the immediate on
    # the last) in raw verbs, posted after the same 1 ms of idle and
    # busy-polled on one thread: what the device itself takes.
    echo "== raw-verbs floor for that request (kvw-rawlat: no kvwire code)"
    if ! "$build/kvw-rawlat" --dev "$dev" --gid-index "$gid" --writes 2 --idle-us 1000 \
        --iters 201 | tee "$work/raw.out"; then
        fails=$((fails + 1))
    fi
    latency_summary
    ;;
esac
# Head slicing, prefill TP != decode TP (docs/head-slicing.md): a
# Llama-like layout (8 KV heads of 128 x 2 B, K and V, 4 layers, 512 tokens,
# fragmented pages in runs of 4 on average), pages of 16 and 64 tokens.
# 2:1 (two prefill ranks of 4 heads into decode's 8) twice: landed in
# decode's landing buffer and copied into the rows (path (b), the default)
# and with --landing-mib 0 (path (a), one write per token row), each
# against 1:1 with 8 heads, and (b) against (a); 1:2 (decode rank 0 of TP 2
# takes 4 of prefill's 8 heads: gather writes) against 1:1 with 4 heads:
# the same decode bytes each time. Interleaved reps; the median of the
# per-rep MB/s ratios, and WRs per request.
tp_run() { # tag page rep args...
    tag=$1 page=$2 rep=$3
    shift 3
    if "$build/kvwire-bench" --dev0 "$dev" --ip0 "$ip" --workload fragmented --contig 4 \
        --layers 4 --tokens 512 --page-tokens "$page" --requests "${KVW_BENCH_TP_REQUESTS:-6}" \
        --warmup 1 --inflight 2 --json --quiet "$@" >"$work/tp.json" 2>"$work/tp.err"; then
        mb=$(sed -n 's/.*"MBps":\([0-9.]*\).*/\1/p' "$work/tp.json")
        wr=$(sed -n 's/.*"wrs_per_req":\([0-9.]*\).*/\1/p' "$work/tp.json")
        printf '%s\t%s\t%s\t%s\n' "$tag $page" "$rep" "$mb" "$wr" >>"$work/tp.tsv"
    else
        note "kvwire-bench $tag, $page-token pages, failed:"
        tail -3 "$work/tp.err" >&2
        fails=$((fails + 1))
    fi
}
case " $sizes " in *" tp "*)
    echo
    echo "== head slicing: prefill TP : decode TP vs equal TP ($reps reps, interleaved, $dev -> itself)"
    : >"$work/tp.tsv"
    for rep in $(seq 1 "$reps"); do
        for page in 16 64; do
            tp_run eq8 "$page" "$rep" --kv-heads 8
            tp_run 2:1 "$page" "$rep" --kv-heads 8 --prefill-tp 2
            tp_run 2:1a "$page" "$rep" --kv-heads 8 --prefill-tp 2 --landing-mib 0
            tp_run eq4 "$page" "$rep" --kv-heads 4
            tp_run 1:2 "$page" "$rep" --kv-heads 8 --decode-tp 2
        done
    done
    awk -F'\t' '
        { split($1, t, " "); mb[t[1], t[2], $2] = $3; wr[t[1], t[2]] = $4 }
        function med(a, m,   i, j, x) {
            for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { x = a[j]; a[j] = a[j-1]; a[j-1] = x }
            return m % 2 ? a[(m+1)/2] : (a[m/2] + a[m/2+1]) / 2
        }
        function row(tag, eq, page, label,   r, m, a, all) {
            m = 0; all = ""
            for (r = 1; r <= reps; r++)
                if (mb[tag, page, r] > 0 && mb[eq, page, r] > 0) {
                    a[++m] = mb[tag, page, r] / mb[eq, page, r]
                    all = all sprintf("%s%.2f", m > 1 ? " " : "", a[m])
                }
            printf "| %s | %s | %s / %s | %s | %s |\n", label, page, wr[tag, page], wr[eq, page],
                m ? sprintf("%.2fx", med(a, m)) : "n/a", all
        }
        END {
            print "| P:D | page tokens | WRs/request, sliced / equal TP | MB/s ratio, median | per rep |"
            print "|---|---|---|---|---|"
            for (p = 16; p <= 64; p *= 4) {
                row("2:1", "eq8", p, "2:1 (b) land + 2D copy")
                row("2:1a", "eq8", p, "2:1 (a) a write per row")
                row("2:1", "2:1a", p, "2:1 (b) / (a)")
                row("1:2", "eq4", p, "1:2 gather")
            }
        }' reps="$reps" "$work/tp.tsv"
    ;;
esac
# Idle cost, measured (make check asserts only wake-up counts): a prefill
# and a decode process connected and idle, each one's CPU as % of a core.
case " $sizes " in *" idle "*)
    echo
    echo "== idle: prefill and decode connected, ${KVW_BENCH_IDLE_S:-30} s, CPU per process"
    KVW_IDLE_S=${KVW_BENCH_IDLE_S:-30} tests/integration/soak_scenarios.sh "$build" idle \
        >"$work/idle.out" 2>&1 || fails=$((fails + 1))
    grep -E 'idle: process total' "$work/idle.out" || tail -n 5 "$work/idle.out"
    ;;
esac
# Handshake storm (docs/topology.md): N decode engines (KVW_BENCH_STORM_ENGINES,
# 64) in one process on rxe1 connect to one prefill on rxe0 at the same moment,
# each transferring one request; time to connected (p50/p99/max), requests
# failed, per-connection throughput spread. A count of failures, no target.
case " $sizes " in *" storm "*)
    echo
    n=${KVW_BENCH_STORM_ENGINES:-64}
    echo "== storm: $n decode engines connect to one prefill at once"
    "$build/kvw-storm" --dev0 "$dev" --ip0 "$ip" --dev1 "${KVW_TB_DEV1:-$dev}" \
        --ip1 "${KVW_TB_IP1:-$ip}" --engines "$n" || fails=$((fails + 1))
    # The same storm with every decode engine finding prefill through etcd
    # (KVW_REGISTRY; a three-member cluster on loopback, tests/etcd): each
    # engine reads the ranks at creation and watches them.
    if [ -e "$build/etcd-1.stamp" ]; then
        echo "== storm through etcd: the same, ranks from a three-member etcd cluster on loopback"
        if eps=$(tests/etcd/etcd-cluster.sh start "$work/etcd"); then
            # Each engine's registry holds a few descriptors more (its watch,
            # curl's wake-up pair): N engines in one process need more than 1024.
            (ulimit -n 8192 2>/dev/null || true
             KVW_REGISTRY="etcd://$eps/storm" exec "$build/kvw-storm" --dev0 "$dev" --ip0 "$ip" \
                --dev1 "${KVW_TB_DEV1:-$dev}" --ip1 "${KVW_TB_IP1:-$ip}" --engines "$n") ||
                fails=$((fails + 1))
            tests/etcd/etcd-cluster.sh stop "$work/etcd"
        else
            fails=$((fails + 1))
        fi
    fi
    ;;
esac
echo "== bench done in $(($(date +%s) - t_start)) s, $fails kvwire run(s) failed"
[ $fails -eq 0 ]
