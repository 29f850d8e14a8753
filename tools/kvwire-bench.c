/* SPDX-License-Identifier: Apache-2.0 */
/* kvwire-bench: throughput, message rate and latency of KV-cache transfers
 * through the public API. One invocation runs both sides: after parsing it
 * forks; the child is the prefill engine (--dev0/--ip0, with an embedded
 * bootstrap service whose address goes to the parent through a pipe), the
 * parent the decode engine (--dev1/--ip1), which drives the requests,
 * measures, verifies the bytes and prints the report.
 *
 *   kvwire-bench --ip0 IP [--dev0 NAME] [--ip1 IP] [--dev1 NAME]
 *                [--workload contiguous|fragmented] [--contig C]
 *                [--layers L] [--kv-heads H] [--head-dim D] [--dtype-bytes B]
 *                [--page-tokens T] [--item BYTES] [--tokens N]
 *                [--requests N] [--warmup N] [--inflight N] [--seed S]
 *                [--verify N|all] [--poll-us US] [--json] [--quiet] [--decode-tp D]
 *                [--prefill-tp P] [--landing-mib MB]
 *
 * Item (bytes per page per layer, K or V) = kv_heads*head_dim*dtype_bytes*
 * page_tokens unless --item; pages per request = ceil(tokens/page_tokens).
 *
 * Head slicing (--decode-tp D, 1 by default): prefill runs TP 1 and holds
 * all kv_heads heads, decode is rank 0 of TP D and holds heads [0,
 * kv_heads / D): both describe their heads (token-major pages), decode's
 * item is 1/D of prefill's, and each write gathers token slices. The
 * figures (bytes, GB/s) are decode's bytes; compare with --decode-tp 1 and
 * --kv-heads kv_heads / D, the same bytes at equal TP.
 * --prefill-tp P (1 by default; needs --decode-tp 1): the prefill process
 * runs P engines, ranks 0..P-1, each holding kv_heads / P heads, and
 * decode (all heads) receives each request from all P with one receiver
 * (kvw_receiver_create_ranks): a strided destination. By default each
 * rank's heads land contiguously in decode's landing buffer and decode
 * copies them into the rows (path (b), as many writes as equal TP);
 * --landing-mib 0 turns the buffer off: one write per token row (path
 * (a)). --landing-mib MB sets decode's KVW_LANDING_MIB (default: the
 * library's, 64, or the environment's). Compare with --prefill-tp 1, the
 * same bytes at equal TP.
 * contiguous: each request's pages are one run on both sides (one WR per
 * K/V layer). fragmented: runs of 1..2C-1 pages (mean C) placed in random
 * order on each side (one WR per run per K/V layer).
 *
 * Timing: warmup requests run to completion first; the measured window is
 * from the first measured kvw_receiver_init() to the last Success, with
 * --inflight requests kept in flight (a new one starts as one finishes).
 * Latency is per request, receiver init -> Success as seen by decode's
 * polling (--poll-us between polls; 0 = sched_yield). CPU-s/GB is each
 * process's getrusage (all threads) over its window / GB moved. Prefill's
 * window is from all warmup senders Success to all senders Success.
 *
 * Layer-wise mode (--layer-ms MS): one process, both engines; a simulated
 * forward pass makes each layer ready MS ms after the previous one, and
 * each request is sent either at the end (send() once every layer is
 * ready) or streamed (send_part() per layer as it becomes ready), the two
 * interleaved for --requests reps. Reported: time from the last layer
 * ready to decode's Success (the part of time-to-first-token the transfer
 * adds), median per mode, and their ratio streamed / at end. Then as many
 * whole-path requests (prefill's pages handed over first, decode's init ->
 * Success, with where the time went) and one ZeroMQ round trip, the
 * yardstick for decode's request hop.
 *
 * Verification: each request gets its own destination pages when the pool
 * fits --max-pool-mb; then every byte of the first --verify requests
 * (default all) is checked after the window. Otherwise destination pages
 * are reused and the first --verify requests are checked as they finish. */
#include "kvwire.h"
#include "kvw-tools.h"

#include <stddef.h>

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

typedef struct opts {
    const char *dev0, *ip0, *dev1, *ip1;
    bool fragmented, json, quiet;
    /* Two hosts: --server (prefill, waits on ip0:port) or --client (decode,
     * connects to the server's host:port). */
    bool server;
    const char *client; /* the server's IP[:PORT] */
    char server_ip[INET_ADDRSTRLEN];
    uint16_t port;
    uint64_t layers, kv_heads, head_dim, dtype, page_tokens, item, tokens, contig;
    uint64_t decode_tp, src_item; /* head slicing: decode's share; prefill's item */
    uint64_t prefill_tp;          /* prefill engines (ranks), each kv_heads / prefill_tp heads */
    uint64_t requests, warmup, inflight, seed, verify, poll_us, max_pool_mb, layer_ms;
    uint64_t landing_mib; /* decode's KVW_LANDING_MIB; UINT64_MAX: the library's */
    /* derived */
    uint64_t pages, total, dst_windows, src_windows, pool;
} opts_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void die(const char *side, const char *what, kvw_status_t st, const char *why)
{
    fprintf(stderr, "\nkvwire-bench %s: %s: %s (%s)%s%s\n", side, what, kvw_strerror(st),
            kvw_status_name(st), why ? ": " : "", why ? why : "");
    exit(1);
}

/* ------------------------------------------------ deterministic contents */

/* ------------------------------------------------------------ workload */

/* A request's pages as runs: same run lengths on both sides, each side's
 * runs placed in its own random order inside the request's window. */
typedef struct req_plan {
    uint64_t room;
    uint64_t *src, *dst;
    uint64_t runs; /* runs contiguous on both sides (what the library plans) */
} req_plan_t;

static void shuffle(uint64_t *a, uint64_t n, uint64_t seed)
{
    for (uint64_t i = n; i > 1; i--) {
        uint64_t j = mix(seed + i) % i, t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

static void plan_req(const opts_t *o, uint64_t k, req_plan_t *rp)
{
    uint64_t n = o->pages, rs = mix(o->seed ^ (k * 0x9e3779b97f4a7c15ull));
    rp->room = 0x6b7677000000ull + k; /* "kvw" + k */
    rp->src = malloc(n * sizeof(uint64_t));
    rp->dst = malloc(n * sizeof(uint64_t));
    uint64_t src_base = (k % o->src_windows) * n, dst_base = (k % o->dst_windows) * n;
    if (!o->fragmented) {
        for (uint64_t i = 0; i < n; i++) {
            rp->src[i] = src_base + i;
            rp->dst[i] = dst_base + i;
        }
    } else {
        /* run lengths 1..2C-1 (mean C) */
        uint64_t *len = malloc(n * sizeof(uint64_t)), nr = 0;
        for (uint64_t left = n, x = rs; left; nr++) {
            x = mix(x + 1);
            uint64_t l = o->contig <= 1 ? 1 : 1 + x % (2 * o->contig - 1);
            len[nr] = l < left ? l : left;
            left -= len[nr];
        }
        uint64_t *order = malloc(nr * sizeof(uint64_t)), *off = malloc(nr * sizeof(uint64_t));
        for (int side = 0; side < 2; side++) {
            for (uint64_t i = 0; i < nr; i++)
                order[i] = i;
            shuffle(order, nr, rs + 7 + (uint64_t)side * 1000003);
            for (uint64_t i = 0, pos = 0; i < nr; i++) { /* place runs in shuffled order */
                off[order[i]] = pos;
                pos += len[order[i]];
            }
            uint64_t *out = side ? rp->dst : rp->src, base = side ? dst_base : src_base;
            for (uint64_t r = 0, i = 0; r < nr; r++)
                for (uint64_t j = 0; j < len[r]; j++)
                    out[i++] = base + off[r] + j;
        }
        free(len);
        free(order);
        free(off);
    }
    rp->runs = 0;
    for (uint64_t i = 0; i < n; i++)
        rp->runs += i == 0 || rp->src[i] != rp->src[i - 1] + 1 || rp->dst[i] != rp->dst[i - 1] + 1;
}

static void free_req(req_plan_t *rp)
{
    free(rp->src);
    free(rp->dst);
    rp->src = rp->dst = NULL;
}

/* ------------------------------------------------------------- memory */

typedef struct memory {
    kvw_region_t *kv;
    uint64_t n;
} memory_t;

/* Prefill rank k's contents: its own seed (rank 0 keeps the plain one). */
static uint64_t rank_seed(const opts_t *o, uint64_t k)
{
    return o->seed + k * 7919;
}

static void alloc_memory(const opts_t *o, memory_t *m, bool prefill, uint64_t rank)
{
    m->n = 2 * o->layers;
    m->kv = calloc(m->n, sizeof(kvw_region_t));
    uint64_t pages = prefill ? o->src_windows * o->pages : o->dst_windows * o->pages;
    uint64_t item = prefill ? o->src_item : o->item;
    uint64_t len = pages * item;
    for (uint64_t r = 0; r < m->n; r++) {
        void *p = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
        if (!p)
            die(prefill ? "prefill" : "decode", "allocating KV memory", KVW_ERR_NO_MEMORY, NULL);
        if (prefill) {
            uint64_t *w = p;
            for (uint64_t pg = 0; pg < pages; pg++)
                for (uint64_t i = 0; i < item / 8; i++)
                    w[pg * (item / 8) + i] = content(rank_seed(o, rank), r, pg, i);
        } else {
            memset(p, 0, len);
        }
        m->kv[r] = (kvw_region_t){p, len, item};
    }
}

static void free_memory(memory_t *m)
{
    for (uint64_t r = 0; r < m->n; r++)
        free(m->kv[r].addr);
    free(m->kv);
}

static kvw_engine_t *make_engine(const opts_t *o, const memory_t *m, bool prefill,
                                 const char *bootstrap, uint64_t rank)
{
    /* Head slicing: prefill rank k holds the k-th 1/P of the heads, decode
     * the first 1/D. */
    uint64_t pheads = o->kv_heads / o->prefill_tp;
    kvw_group_heads_t heads = {(uint32_t)o->kv_heads,
                               (uint32_t)(prefill ? rank * pheads : 0),
                               (uint32_t)(prefill ? pheads : o->kv_heads / o->decode_tp),
                               (uint32_t)(o->head_dim * o->dtype),
                               (uint32_t)o->page_tokens,
                               KVW_PAGE_NHD};
    kvw_engine_params_t p = {
        .struct_size = sizeof(kvw_engine_params_t),
        .group_heads = o->decode_tp > 1 || o->prefill_tp > 1 ? &heads : NULL,
        .role = prefill ? KVW_ROLE_PREFILL : KVW_ROLE_DECODE,
        .engine_rank = (uint32_t)rank,
        .device = prefill ? o->dev0 : o->dev1,
        .local_ip = prefill ? o->ip0 : o->ip1,
        .bootstrap_addr = bootstrap,
        .num_layers = (uint32_t)o->layers,
        .kv_regions = m->kv,
    };
    kvw_config_t cfg;
    if (!prefill && o->landing_mib != UINT64_MAX) {
        if (kvw_config_init(&cfg))
            die("decode", "reading the config", KVW_ERR_INVALID, NULL);
        cfg.landing_mib = (uint32_t)o->landing_mib;
        p.config = &cfg;
    }
    kvw_engine_t *e;
    kvw_status_t st = kvw_engine_create(&p, &e);
    if (st)
        die(prefill ? "prefill" : "decode", "creating the engine", st, NULL);
    return e;
}

/* Prefill's word of decode's word j in a page: the same word unless heads
 * are sliced, then the same bytes of the same token's row, which is
 * decode_tp times longer at prefill. */
static uint64_t src_word(const opts_t *o, uint64_t j)
{
    if (o->decode_tp == 1)
        return j;
    uint64_t row = o->item / o->page_tokens, off = j * 8;
    return (off / row * row * o->decode_tp + off % row) / 8;
}

/* Bytes wrong in request rp's destination pages. */
static uint64_t verify_req(const opts_t *o, const memory_t *m, const req_plan_t *rp)
{
    uint64_t bad = 0, words = o->item / 8;
    uint64_t row = o->item / o->page_tokens, srow = row / o->prefill_tp;
    for (uint64_t r = 0; r < m->n; r++)
        for (uint64_t i = 0; i < o->pages; i++) {
            const uint64_t *w =
                (const uint64_t *)((const uint8_t *)m->kv[r].addr + rp->dst[i] * o->item);
            for (uint64_t j = 0; j < words; j++) {
                if (o->prefill_tp == 1) {
                    bad += w[j] != content(o->seed, r, rp->src[i], src_word(o, j));
                    continue;
                }
                /* Several prefill ranks: word j's token row, and in it whose
                 * slice, at which word of that rank's row. */
                uint64_t off = j * 8, t = off / row, in = off % row, k = in / srow;
                bad += w[j] != content(rank_seed(o, k), r, rp->src[i], (t * srow + in % srow) / 8);
            }
        }
    return bad * 8;
}

/* ------------------------------------------------------------- prefill */

typedef struct prefill_result {
    int rc;
    double cpu_s, wall_s;
    uint64_t wrs, chains, bytes, completions, errors, cq_sleeps, failed;
    /* WRs and bytes since the engine started (warmup included): checked
     * against the plan. The window's counts above start when prefill sees
     * the warmup done, by which time the next request may be posting. */
    uint64_t wrs_total, bytes_total;
    char why[160];
} prefill_result_t;

/* Engine counters summed over the prefill ranks. */
static void counters_sum(kvw_engine_t *const *e, uint64_t n, kvw_counters_t *out)
{
    *out = (kvw_counters_t){0};
    for (uint64_t k = 0; k < n; k++) {
        kvw_counters_t c;
        kvw_engine_counters(e[k], &c);
        out->wrs_posted += c.wrs_posted;
        out->chains_posted += c.chains_posted;
        out->bytes_posted += c.bytes_posted;
        out->completions += c.completions;
        out->errors += c.errors;
        out->cq_sleeps += c.cq_sleeps;
    }
}

/* ---------------------------------------------------------------- link */

/* How the two sides talk outside kvwire: pipes to a forked prefill on one
 * host, or a ZeroMQ REQ (decode, --client) / REP (prefill, --server)
 * pair between two hosts, as ib_write_bw's server and client exchange
 * over TCP. Prefill publishes its bootstrap address (or why it could not
 * start), then, once decode said it is done, its result. */
typedef struct link {
    int addr_fd, result_fd, done_fd; /* pipes; -1 between hosts */
    pid_t child;                     /* the forked prefill, or -1 */
    void *zctx, *zsock;              /* between hosts */
} link_t;

#define DEFAULT_PORT 18520 /* beside perftest's 18515 */
#define LINK_MAGIC "kvwire-bench/1"
#define LINK_WAIT_MS (120 * 1000) /* the client waits this long for each answer */

/* The workload a client sends its server: the options both sides must
 * agree on. Checked on arrival like a command line (num_opts, derive). */
typedef struct wire_opts {
    char magic[16];
    uint64_t fragmented;
    uint64_t nums[32];
} wire_opts_t;

static void link_send(const link_t *l, const void *buf, size_t len)
{
    if (zmq_send(l->zsock, buf, len, 0) < 0) {
        fprintf(stderr, "kvwire-bench: sending to the client: %s\n", zmq_strerror(zmq_errno()));
        exit(1);
    }
}

/* Prefill: "OK ADDR" (its bootstrap service), or "ERR WHY". */
static void link_publish(const link_t *l, const char *addr)
{
    if (l->zsock) {
        char msg[160];
        snprintf(msg, sizeof(msg), "OK %s", addr);
        link_send(l, msg, strlen(msg) + 1);
        return;
    }
    if (write(l->addr_fd, addr, strlen(addr) + 1) < 0)
        exit(1);
    close(l->addr_fd);
}

/* Prefill: hand over the result once decode is done, then return (the
 * engines may go). */
static void link_finish(const link_t *l, prefill_result_t *res)
{
    char b;
    if (l->zsock) {
        char done[8];
        if (zmq_recv(l->zsock, done, sizeof(done), 0) < 0)
            res->rc = 1;
        link_send(l, res, sizeof(*res));
        return;
    }
    if (write(l->result_fd, res, sizeof(*res)) != (ssize_t)sizeof(*res))
        res->rc = 1;
    close(l->result_fd);
    /* Keep the engines up until decode has seen every request land. */
    while (read(l->done_fd, &b, 1) < 0 && errno == EINTR)
        ;
}

static int run_prefill(const opts_t *o, const link_t *l)
{
    prefill_result_t res = {0};
    uint64_t np = o->prefill_tp;
    memory_t *m = calloc(np, sizeof(*m));
    kvw_engine_t **e = calloc(np, sizeof(*e));
    char bind[96];
    snprintf(bind, sizeof(bind), "%s:0", o->ip0);
    kvw_bootstrap_t *bs;
    kvw_bootstrap_params_t bp;
    kvw_bootstrap_params_init(&bp);
    bp.bind_addr = bind;
    kvw_status_t st = kvw_bootstrap_create(&bp, &bs);
    if (st)
        die("prefill", "starting the embedded bootstrap service", st, NULL);
    for (uint64_t k = 0; k < np; k++) {
        alloc_memory(o, &m[k], true, k);
        e[k] = make_engine(o, &m[k], true, kvw_bootstrap_addr(bs), k);
    }
    link_publish(l, kvw_bootstrap_addr(bs));

    /* Request k's sender on rank j: s[k * np + j]. */
    kvw_sender_t **s = calloc(o->total * np, sizeof(*s));
    for (uint64_t k = 0; k < o->total; k++) {
        req_plan_t rp;
        plan_req(o, k, &rp);
        for (uint64_t j = 0; j < np && !st; j++) {
            kvw_sender_t **x = &s[k * np + j];
            st = kvw_sender_create(e[j], rp.room, x);
            if (!st)
                st = kvw_sender_init(*x, o->pages, KVW_NO_AUX);
            if (!st)
                st = kvw_sender_send(*x, rp.src, o->pages);
        }
        free_req(&rp);
        if (st)
            die("prefill", "starting a sender", st, NULL);
    }
    kvw_counters_t c0 = {0}, c1;
    double t0 = 0, cpu0 = 0;
    uint64_t next = 0; /* senders below this are done */
    bool started = o->warmup == 0;
    if (started) {
        t0 = now_s();
        cpu0 = cpu_s();
        counters_sum(e, np, &c0);
    }
    while (next < o->total * np) {
        kvw_poll_t p = kvw_sender_poll(s[next]);
        if (p == KVW_POLL_FAILED) {
            const char *why = "";
            kvw_status_t fst = kvw_sender_failure(s[next], &why);
            snprintf(res.why, sizeof(res.why), "room %" PRIu64 " rank %" PRIu64 ": %s: %s",
                     next / np, next % np, kvw_strerror(fst), why);
            res.failed++;
        }
        if (p == KVW_POLL_SUCCESS || p == KVW_POLL_FAILED) {
            next++;
            if (!started && next == o->warmup * np) {
                started = true;
                t0 = now_s();
                cpu0 = cpu_s();
                counters_sum(e, np, &c0);
            }
            continue;
        }
        usleep(o->poll_us > 200 ? (useconds_t)o->poll_us : 200);
    }
    res.wall_s = now_s() - t0;
    res.cpu_s = cpu_s() - cpu0;
    counters_sum(e, np, &c1);
    res.wrs = c1.wrs_posted - c0.wrs_posted;
    res.chains = c1.chains_posted - c0.chains_posted;
    res.bytes = c1.bytes_posted - c0.bytes_posted;
    res.completions = c1.completions - c0.completions;
    res.errors = c1.errors;
    res.wrs_total = c1.wrs_posted;
    res.bytes_total = c1.bytes_posted;
    res.cq_sleeps = c1.cq_sleeps - c0.cq_sleeps;
    res.rc = res.failed != 0;
    for (uint64_t k = 0; k < o->total * np; k++)
        kvw_sender_destroy(s[k]);
    free(s);
    link_finish(l, &res);
    for (uint64_t k = 0; k < np; k++) {
        kvw_engine_destroy(e[k]);
        free_memory(&m[k]);
    }
    kvw_bootstrap_destroy(bs);
    free(e);
    free(m);
    return res.rc;
}

/* -------------------------------------------------------------- decode */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *sorted, uint64_t n, double p)
{
    if (!n)
        return 0;
    uint64_t i = (uint64_t)ceil(p * (double)n) - 1;
    return sorted[i < n ? i : n - 1];
}

typedef struct slot {
    kvw_receiver_t *rx;
    req_plan_t rp;
    uint64_t k;
    double start;
    bool busy;
} slot_t;

/* A request's receiver: from prefill rank 0, or from every rank. */
static kvw_status_t create_receiver(const opts_t *o, kvw_engine_t *e, const char *bootstrap,
                                    uint64_t room, kvw_receiver_t **rx)
{
    if (o->prefill_tp == 1)
        return kvw_receiver_create(e, bootstrap, 0, room, rx);
    kvw_prefill_rank_t ranks[KVW_MAX_PREFILL_RANKS];
    for (uint64_t k = 0; k < o->prefill_tp; k++)
        ranks[k] = (kvw_prefill_rank_t){.bootstrap_addr = bootstrap, .rank = (uint32_t)k};
    kvw_receiver_params_t rp = {.struct_size = sizeof(rp),
                                .room = room,
                                .num_ranks = (uint32_t)o->prefill_tp,
                                .ranks = ranks};
    return kvw_receiver_create_ranks(e, &rp, rx);
}

/* Run requests [from, to) keeping o->inflight in flight. */
static void run_phase(const opts_t *o, kvw_engine_t *e, const char *bootstrap, const memory_t *m,
                      uint64_t from, uint64_t to, double *lat, uint64_t *bad, uint64_t *verified,
                      double t_start)
{
    slot_t *sl = calloc(o->inflight, sizeof(slot_t));
    uint64_t next = from, done = from;
    double last_progress = now_s();
    bool measured = from >= o->warmup;
    while (done < to) {
        bool progress = false;
        for (uint64_t j = 0; j < o->inflight; j++) {
            slot_t *x = &sl[j];
            if (!x->busy && next < to) {
                x->k = next++;
                plan_req(o, x->k, &x->rp);
                kvw_status_t st = create_receiver(o, e, bootstrap, x->rp.room, &x->rx);
                x->start = now_s();
                if (!st)
                    st = kvw_receiver_init(x->rx, x->rp.dst, o->pages, KVW_NO_AUX);
                if (st)
                    die("decode", "starting a receiver", st, NULL);
                x->busy = true;
                progress = true;
            }
            if (!x->busy)
                continue;
            kvw_poll_t p = kvw_receiver_poll(x->rx);
            if (p != KVW_POLL_SUCCESS && p != KVW_POLL_FAILED)
                continue;
            double t = now_s();
            if (p == KVW_POLL_FAILED) {
                const char *why = "";
                kvw_status_t st = kvw_receiver_failure(x->rx, &why);
                die("decode", "a request failed", st, why);
            }
            lat[x->k] = t - x->start;
            /* Destination pages reused by later requests: check now. */
            if (o->dst_windows < o->total && *verified < o->verify) {
                *bad += verify_req(o, m, &x->rp);
                (*verified)++;
            }
            kvw_receiver_destroy(x->rx);
            free_req(&x->rp);
            x->busy = false;
            done++;
            progress = true;
        }
        if (!o->quiet && now_s() - last_progress > 0.5) {
            last_progress = now_s();
            double dt = last_progress - t_start;
            uint64_t mdone = measured ? done - o->warmup : 0;
            fprintf(stderr, "\r[kvwire-bench] %s %" PRIu64 "/%" PRIu64 " requests, %.2f MB/s   ",
                    measured ? "measuring" : "warming up", measured ? mdone : done,
                    measured ? o->requests : o->warmup,
                    measured && dt > 0 ? (double)mdone * (double)o->pages * (double)o->item * 2.0 *
                                             (double)o->layers / dt / 1e6
                                       : 0.0);
        }
        if (!progress) {
            if (o->poll_us)
                usleep((useconds_t)o->poll_us);
            else
                sched_yield();
        }
    }
    free(sl);
}

/* Decode: prefill's bootstrap address into buf; -1 (said why) if none. */
static int link_address(const link_t *l, char *buf, size_t size)
{
    ssize_t got = 0;
    if (l->zsock) {
        int n = zmq_recv(l->zsock, buf, size - 1, 0);
        if (n < 0) {
            fprintf(stderr, "kvwire-bench: no answer from the server: %s\n",
                    zmq_strerror(zmq_errno()));
            return -1;
        }
        buf[(size_t)n < size - 1 ? (size_t)n : size - 1] = '\0';
        if (strncmp(buf, "OK ", 3) != 0) {
            fprintf(stderr, "kvwire-bench: the server refused: %.*s\n", 200,
                    strncmp(buf, "ERR ", 4) ? "(a malformed answer)" : buf + 4);
            return -1;
        }
        memmove(buf, buf + 3, strlen(buf + 3) + 1);
        return 0;
    }
    while (got < (ssize_t)size - 1) {
        ssize_t n = read(l->addr_fd, buf + got, size - 1 - (size_t)got);
        if (n <= 0)
            break;
        got += n;
        if (memchr(buf, '\0', (size_t)got))
            break;
    }
    buf[got] = '\0';
    close(l->addr_fd);
    if (!got || !buf[0]) {
        fprintf(stderr, "kvwire-bench: the prefill process failed before publishing its "
                        "bootstrap address\n");
        waitpid(l->child, NULL, 0);
        return -1;
    }
    return 0;
}

/* Decode, done: tell prefill and take its result (rc 1 if none came). */
static void link_result(const link_t *l, prefill_result_t *pr)
{
    *pr = (prefill_result_t){.rc = 1};
    prefill_result_t got;
    ssize_t n;
    int status = 0;
    if (l->zsock) {
        n = zmq_send(l->zsock, "done", 5, 0) < 0 ? -1 : zmq_recv(l->zsock, &got, sizeof(got), 0);
    } else {
        n = read(l->result_fd, &got, sizeof(got));
        close(l->result_fd);
        close(l->done_fd); /* prefill may tear down now */
        waitpid(l->child, &status, 0);
    }
    if (n != (ssize_t)sizeof(got)) {
        fprintf(stderr, "kvwire-bench: no result from the prefill %s\n",
                l->zsock ? "server" : "process");
        return;
    }
    got.why[sizeof(got.why) - 1] = '\0'; /* from the network: a string, whatever came */
    *pr = got;
    if (!WIFEXITED(status) || WEXITSTATUS(status) || pr->rc != 0)
        pr->rc = 1;
}

static int run_decode(const opts_t *o, const link_t *l)
{
    char bootstrap[128] = "";
    if (link_address(l, bootstrap, sizeof(bootstrap)))
        return 1;
    memory_t m;
    alloc_memory(o, &m, false, 0);
    kvw_engine_t *e = make_engine(o, &m, false, NULL, 0);
    double *lat = calloc(o->total, sizeof(double));
    uint64_t bad = 0, verified = 0;
    if (o->warmup)
        run_phase(o, e, bootstrap, &m, 0, o->warmup, lat, &bad, &verified, now_s());
    double t0 = now_s(), cpu0 = cpu_s();
    run_phase(o, e, bootstrap, &m, o->warmup, o->total, lat, &bad, &verified, t0);
    double dt = now_s() - t0, cpu = cpu_s() - cpu0;
    if (!o->quiet)
        fprintf(stderr, "\r%70s\r", "");

    /* Every request had its own destination pages: verify after the window. */
    if (o->dst_windows >= o->total)
        for (uint64_t k = 0; k < o->total && verified < o->verify; k++, verified++) {
            req_plan_t rp;
            plan_req(o, k, &rp);
            bad += verify_req(o, &m, &rp);
            free_req(&rp);
        }

    prefill_result_t pr;
    link_result(l, &pr);

    /* Expected WRs of every request, warmup included (max message well
     * above these sizes: no splits). */
    uint64_t runs = 0;
    for (uint64_t k = 0; k < o->total; k++) {
        req_plan_t rp;
        plan_req(o, k, &rp);
        runs += rp.runs;
        free_req(&rp);
    }
    /* Sliced: gather writes, as many as the device's entries allow: the
     * plan's count is what was posted. */
    uint64_t want_wrs = o->decode_tp > 1 || o->prefill_tp > 1 ? pr.wrs_total : 2 * o->layers * runs;
    double all_bytes =
        (double)o->total * (double)o->pages * (double)o->item * 2.0 * (double)o->layers;
    double bytes =
        (double)o->requests * (double)o->pages * (double)o->item * 2.0 * (double)o->layers;
    qsort(lat + o->warmup, o->requests, sizeof(double), cmp_double);
    double p50 = pct(lat + o->warmup, o->requests, 0.50) * 1e3;
    double p99 = pct(lat + o->warmup, o->requests, 0.99) * 1e3;
    double gbps = bytes / dt / 1e9, reqs = (double)o->requests / dt, wrs = (double)pr.wrs / dt;
    double msg = pr.wrs ? (double)pr.bytes / (double)pr.wrs : 0;
    double chains_per_req = (double)pr.chains / (double)o->requests;
    double dcpu_gb = cpu / (bytes / 1e9), pcpu_gb = pr.cpu_s / (bytes / 1e9);
    int rc = pr.rc || bad != 0 || pr.wrs_total != want_wrs ||
             (uint64_t)pr.bytes_total != (uint64_t)all_bytes;

    if (!o->quiet) {
        printf("kvwire-bench: %s, %" PRIu64 " layers x K/V x %" PRIu64 " pages x %" PRIu64
               " B items (%s%s -> %s%s)\n",
               o->fragmented ? "fragmented" : "contiguous", o->layers, o->pages, o->item,
               o->dev0 ? o->dev0 : "", o->ip0, o->dev1 ? o->dev1 : "", o->ip1);
        printf("  %-26s %" PRIu64 " measured (+%" PRIu64 " warmup), %" PRIu64 " in flight\n",
               "requests", o->requests, o->warmup, o->inflight);
        printf("  %-26s %.3f MB in %.3f s\n", "moved", bytes / 1e6, dt);
        printf("  %-26s %.4f GB/s (%.2f MB/s)\n", "throughput", gbps, gbps * 1e3);
        printf("  %-26s %.2f\n", "requests/s", reqs);
        printf("  %-26s %.0f (%.0f B/WR; %" PRIu64 " WRs in the window; %" PRIu64
               " in all, planned %" PRIu64 ")\n",
               "WRs/s", wrs, msg, pr.wrs, pr.wrs_total, want_wrs);
        printf("  %-26s %.1f (prefill TP %" PRIu64 ", decode TP %" PRIu64 ")\n", "WRs/request",
               (double)pr.wrs_total / (double)o->total, o->prefill_tp, o->decode_tp);
        printf("  %-26s %.2f (%.1f WRs/chain)\n", "chains (doorbells)/request", chains_per_req,
               pr.chains ? (double)pr.wrs / (double)pr.chains : 0.0);
        printf("  %-26s p50 %.3f ms, p99 %.3f ms\n", "latency init->Success", p50, p99);
        printf("  %-26s prefill %.2f, decode %.2f (%.3f / %.3f CPU-s over %.3f / %.3f s)\n",
               "CPU-s per GB", pcpu_gb, dcpu_gb, pr.cpu_s, cpu, pr.wall_s, dt);
        printf("  %-26s %" PRIu64 " requests, %" PRIu64 " bytes wrong%s\n", "verified", verified,
               bad, o->dst_windows >= o->total ? " (checked after the window)" : "");
        if (pr.why[0])
            printf("  prefill failure: %s\n", pr.why);
        if (pr.wrs_total != want_wrs)
            printf("  WRs posted (%" PRIu64 ") differ from the plan (%" PRIu64 ")\n", pr.wrs_total,
                   want_wrs);
        printf("  result: %s\n", rc ? "FAILED" : "ok");
    }
    if (o->json)
        printf("{\"workload\":\"%s\",\"layers\":%" PRIu64 ",\"pages\":%" PRIu64 ",\"item\":%" PRIu64
               ",\"contig\":%" PRIu64 ",\"requests\":%" PRIu64 ",\"inflight\":%" PRIu64
               ",\"bytes\":%.0f,\"seconds\":%.6f,\"GBps\":%.6f,"
               "\"MBps\":%.3f,\"req_per_s\":%.3f,\"wrs\":%" PRIu64 ",\"wrs_planned\":%" PRIu64
               ",\"wrs_per_req\":%.1f,\"wrs_per_s\":%.1f,\"bytes_per_wr\":%.1f,\"chains\":%" PRIu64
               ",\"chains_per_req\":%.3f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,"
               "\"prefill_cpu_s\":%.4f,\"decode_cpu_s\":%.4f,\"prefill_cpu_s_per_GB\":%.3f,"
               "\"decode_cpu_s_per_GB\":%.3f,\"prefill_cq_sleeps\":%" PRIu64
               ",\"verified\":%" PRIu64 ",\"bad_bytes\":%" PRIu64 ",\"ok\":%s}\n",
               o->fragmented ? "fragmented" : "contiguous", o->layers, o->pages, o->item, o->contig,
               o->requests, o->inflight, bytes, dt, gbps, gbps * 1e3, reqs, pr.wrs_total, want_wrs,
               (double)pr.wrs_total / (double)o->total, wrs, msg, pr.chains, chains_per_req, p50,
               p99, pr.cpu_s, cpu, pcpu_gb, dcpu_gb, pr.cq_sleeps, verified, bad,
               rc ? "false" : "true");
    free(lat);
    kvw_engine_destroy(e);
    free_memory(&m);
    return rc;
}

/* ---------------------------------------------------------------- main */

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvwire-bench --ip0 IP [--dev0 NAME] [--ip1 IP] [--dev1 NAME] [OPTION]...\n"
           "  or:  kvwire-bench --server --ip0 IP [--dev0 NAME] [--port PORT]\n"
           "  or:  kvwire-bench --client HOST[:PORT] --ip1 IP [--dev1 NAME] [OPTION]...\n"
           "Throughput, message rate and latency of KV-cache transfers through kvwire's\n"
           "public API, every byte verified. One host: prefill (dev0/ip0) and decode\n"
           "(dev1/ip1) run in two processes. Two hosts, as ib_write_bw: the server runs\n"
           "prefill and waits on ip0:PORT; the client runs decode with the workload\n"
           "options, which it sends to the server, and prints the report; the server\n"
           "exits after one run. Numbers are decimal, or hex after 0x.\n"
           "\n"
           "  two hosts: --server | --client HOST[:PORT]; --port PORT (%u)\n"
           "  workload: --workload contiguous|fragmented (contiguous) --contig C (4)\n"
           "  model:    --layers L (32) --kv-heads H (8) --head-dim D (128) --dtype-bytes B (2)\n"
           "            --page-tokens T (1) | --item BYTES;  --tokens N per request (1024)\n"
           "  run:      --requests N (16) --warmup N (2) --inflight N (4) --seed S (1)\n"
           "            --verify N|all (all) --poll-us US (50; 0 = yield) --max-pool-mb MB (512)\n"
           "  output:   --json (one JSON line) --quiet (no table, no progress)\n"
           "  layer-wise streaming vs send at end: --layer-ms MS (compute per layer; one host)\n"
           "  head slicing: --decode-tp D (1): prefill TP 1, decode rank 0 of TP D\n"
           "                --prefill-tp P (1): P prefill ranks, decode TP 1 takes from all\n"
           "                --landing-mib MB (library default 64): decode's landing buffer;\n"
           "                0: a write per token row instead of landing and a 2D copy\n"
           "  -h, --help     this help\n"
           "  -V, --version  the kvwire version\n"
           "\n"
           "Exit status: 0 every request succeeded with every byte right and the WRs\n"
           "planned; 1 otherwise, or a bad command line.\n",
           (unsigned)DEFAULT_PORT);
    exit(0);
}

/* The numeric options: their getopt code, where they go and their range.
 * A client's workload is checked against the same table on the server. */
typedef struct num_opt {
    int code;
    const char *name;
    size_t off;
    uint64_t min, max;
} num_opt_t;

#define NUM(code, name, field, min, max)                                                           \
    {                                                                                              \
        code, "--" name, offsetof(opts_t, field), min, max                                         \
    }
static const num_opt_t num_opts[] = {
    NUM('c', "contig", contig, 1, 1u << 20),
    NUM('L', "layers", layers, 1, 65535),
    NUM('H', "kv-heads", kv_heads, 1, 65536),
    NUM('k', "head-dim", head_dim, 1, 65536),
    NUM('b', "dtype-bytes", dtype, 1, 16),
    NUM('T', "page-tokens", page_tokens, 1, 1u << 20),
    NUM('S', "item", item, 0, 1u << 30),
    NUM('t', "tokens", tokens, 1, 1u << 24),
    NUM('n', "requests", requests, 1, 10000000),
    NUM('W', "warmup", warmup, 0, 1000000),
    NUM('f', "inflight", inflight, 1, 65536),
    NUM('s', "seed", seed, 0, UINT64_MAX),
    NUM('v', "verify", verify, 0, UINT64_MAX), /* or "all" */
    NUM('p', "poll-us", poll_us, 0, 1000000),
    NUM('M', "max-pool-mb", max_pool_mb, 1, 1u << 20),
    NUM('Y', "layer-ms", layer_ms, 0, 60000),
    NUM('X', "decode-tp", decode_tp, 1, 64),
    NUM('P', "prefill-tp", prefill_tp, 1, KVW_MAX_PREFILL_RANKS),
    NUM('G', "landing-mib", landing_mib, 0, 1u << 20), /* UINT64_MAX: unset */
};
#define NUM_OPTS (sizeof(num_opts) / sizeof(num_opts[0]))
_Static_assert(NUM_OPTS <= 32, "wire_opts_t.nums holds 32");

static uint64_t *num_field(opts_t *o, const num_opt_t *n)
{
    return (uint64_t *)(void *)((char *)o + n->off);
}

static const num_opt_t *num_opt(int code)
{
    for (size_t i = 0; i < NUM_OPTS; i++)
        if (num_opts[i].code == code)
            return &num_opts[i];
    return NULL;
}

static void defaults(opts_t *o)
{
    *o = (opts_t){.layers = 32,
                  .kv_heads = 8,
                  .head_dim = 128,
                  .dtype = 2,
                  .page_tokens = 1,
                  .tokens = 1024,
                  .contig = 4,
                  .requests = 16,
                  .warmup = 2,
                  .inflight = 4,
                  .seed = 1,
                  .verify = UINT64_MAX,
                  .decode_tp = 1,
                  .prefill_tp = 1,
                  .poll_us = 50,
                  .max_pool_mb = 512,
                  .landing_mib = UINT64_MAX,
                  .port = DEFAULT_PORT};
}

/* The options together, and what follows from them; NULL or what is wrong. */
static const char *derive(opts_t *o, char *buf, size_t size)
{
    if (o->decode_tp > 1 && (o->kv_heads % o->decode_tp || o->item))
        return "--decode-tp must divide --kv-heads (and needs no --item)";
    if (o->prefill_tp > 1 &&
        (o->kv_heads % o->prefill_tp || o->decode_tp > 1 || o->item || o->layer_ms))
        return "--prefill-tp must divide --kv-heads (and needs --decode-tp 1, no --item, no "
               "--layer-ms)";
    if (!o->item)
        o->item = o->kv_heads / o->decode_tp * o->head_dim * o->dtype * o->page_tokens;
    o->src_item = o->item * o->decode_tp / o->prefill_tp;
    if (!o->item || o->item % 8 || o->item > (1u << 30)) {
        snprintf(buf, size, "item size %" PRIu64 " must be a positive multiple of 8, at most 1 GiB",
                 o->item);
        return buf;
    }
    o->pages = (o->tokens + o->page_tokens - 1) / o->page_tokens;
    o->total = o->requests + o->warmup;
    if (o->inflight > o->total)
        o->inflight = o->total;
    /* Destination windows: one per request when it fits, else one per slot. */
    double per_window_mb = (double)o->pages * (double)o->item * 2.0 * (double)o->layers / 1e6;
    o->dst_windows =
        per_window_mb * (double)o->total <= (double)o->max_pool_mb ? o->total : o->inflight;
    o->src_windows = o->total < 5 ? o->total : 5;
    if (per_window_mb *
            (double)(o->dst_windows > o->src_windows ? o->dst_windows : o->src_windows) >
        (double)o->max_pool_mb * 2) {
        snprintf(buf, size, "%.0f MB per request x %" PRIu64 " in flight exceeds --max-pool-mb",
                 per_window_mb, o->inflight);
        return buf;
    }
    return NULL;
}

static void parse(int argc, char **argv, opts_t *o)
{
    defaults(o);
    static const struct option lo[] = {{"dev0", 1, 0, 'd'},        {"ip0", 1, 0, 'i'},
                                       {"dev1", 1, 0, 'D'},        {"ip1", 1, 0, 'I'},
                                       {"workload", 1, 0, 'w'},    {"contig", 1, 0, 'c'},
                                       {"layers", 1, 0, 'L'},      {"kv-heads", 1, 0, 'H'},
                                       {"head-dim", 1, 0, 'k'},    {"dtype-bytes", 1, 0, 'b'},
                                       {"page-tokens", 1, 0, 'T'}, {"item", 1, 0, 'S'},
                                       {"tokens", 1, 0, 't'},      {"requests", 1, 0, 'n'},
                                       {"warmup", 1, 0, 'W'},      {"inflight", 1, 0, 'f'},
                                       {"seed", 1, 0, 's'},        {"verify", 1, 0, 'v'},
                                       {"poll-us", 1, 0, 'p'},     {"max-pool-mb", 1, 0, 'M'},
                                       {"json", 0, 0, 'j'},        {"quiet", 0, 0, 'q'},
                                       {"help", 0, 0, 'h'},        {"layer-ms", 1, 0, 'Y'},
                                       {"decode-tp", 1, 0, 'X'},   {"prefill-tp", 1, 0, 'P'},
                                       {"landing-mib", 1, 0, 'G'}, {"server", 0, 0, 'R'},
                                       {"client", 1, 0, 'C'},      {"port", 1, 0, 'O'},
                                       {"version", 0, 0, 'V'},     {0, 0, 0, 0}};
    int c;
    bool port_set = false;
    while ((c = getopt_long(argc, argv, "hV", lo, NULL)) != -1) {
        const num_opt_t *n = num_opt(c);
        if (n && c == 'v' && !strcmp(optarg, "all"))
            o->verify = UINT64_MAX;
        else if (n)
            *num_field(o, n) = kvw_tool_u64(n->name, optarg, n->min, n->max);
        else if (c == 'd')
            o->dev0 = optarg;
        else if (c == 'i')
            o->ip0 = kvw_tool_ipv4("--ip0", optarg);
        else if (c == 'D')
            o->dev1 = optarg;
        else if (c == 'I')
            o->ip1 = kvw_tool_ipv4("--ip1", optarg);
        else if (c == 'w' && (!strcmp(optarg, "fragmented") || !strcmp(optarg, "contiguous")))
            o->fragmented = strcmp(optarg, "fragmented") == 0;
        else if (c == 'w')
            kvw_tool_usage_error("invalid --workload '%s': contiguous or fragmented", optarg);
        else if (c == 'j')
            o->json = true;
        else if (c == 'q')
            o->quiet = true;
        else if (c == 'R')
            o->server = true;
        else if (c == 'C')
            o->client = optarg;
        else if (c == 'O') {
            o->port = (uint16_t)kvw_tool_u64("--port", optarg, 1, 65535);
            port_set = true;
        } else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
    if (o->server && o->client)
        kvw_tool_usage_error("--server or --client, not both");
    if (o->client) {
        uint16_t port = 0;
        const char *why;
        if (kvw_parse_ipv4_port(o->client, o->server_ip, sizeof(o->server_ip), &port, &why))
            kvw_tool_usage_error("invalid --client '%s': %s", o->client, why);
        if (!port && strchr(o->client, ':'))
            kvw_tool_usage_error("invalid --client '%s': the port must be 1 to 65535", o->client);
        if (port && port_set && port != o->port)
            kvw_tool_usage_error("--client's port and --port differ");
        if (port)
            o->port = port;
        if (!o->ip1)
            kvw_tool_usage_error("--client needs --ip1, decode's address on this host");
        o->ip0 = o->server_ip; /* for the report */
    } else if (!o->ip0) {
        kvw_tool_usage_error("--ip0 is required");
    }
    if ((o->server || o->client) && o->layer_ms)
        kvw_tool_usage_error("--layer-ms runs both engines in one process: not with --%s",
                             o->server ? "server" : "client");
    if (!o->ip1)
        o->ip1 = o->ip0;
    if (!o->dev1 && !o->client)
        o->dev1 = o->dev0;
    char buf[160];
    const char *problem = derive(o, buf, sizeof(buf));
    if (problem)
        kvw_tool_usage_error("%s", problem);
}

/* ---------------------------------------------------- two hosts (link) */

/* The client's workload, for the wire. */
static void wire_pack(const opts_t *o, wire_opts_t *w)
{
    memset(w, 0, sizeof(*w));
    memcpy(w->magic, LINK_MAGIC, sizeof(LINK_MAGIC));
    w->fragmented = o->fragmented;
    for (size_t i = 0; i < NUM_OPTS; i++)
        w->nums[i] = *num_field((opts_t *)o, &num_opts[i]);
}

/* The server's opts from a client's message (len bytes): every field
 * checked as its option would be; NULL, or what is wrong. The derived
 * fields follow from them (derive), as on the client. */
static const char *wire_unpack(const void *msg, int len, opts_t *o, char *buf, size_t size)
{
    wire_opts_t w;
    if (len != (int)sizeof(w))
        return "not a kvwire-bench client (or another version)";
    memcpy(&w, msg, sizeof(w));
    if (memcmp(w.magic, LINK_MAGIC, sizeof(LINK_MAGIC)) || w.fragmented > 1)
        return "not a kvwire-bench client (or another version)";
    o->fragmented = w.fragmented;
    for (size_t i = 0; i < NUM_OPTS; i++) {
        const num_opt_t *n = &num_opts[i];
        uint64_t v = w.nums[i];
        bool unset = v == UINT64_MAX && (n->code == 'v' || n->code == 'G');
        if (!unset && (v < n->min || v > n->max)) {
            snprintf(buf, size, "%s %" PRIu64 " out of range (%" PRIu64 " to %" PRIu64 ")", n->name,
                     v, n->min, n->max);
            return buf;
        }
        *num_field(o, n) = v;
    }
    if (o->layer_ms)
        return "--layer-ms runs in one process";
    /* The landing buffer is decode's: the server's engines do not use it. */
    return derive(o, buf, size);
}

static void link_close(link_t *l)
{
    int linger = 1000;
    zmq_setsockopt(l->zsock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(l->zsock);
    zmq_ctx_term(l->zctx);
}

/* --server: wait for one client on ip0:port, run prefill with its
 * workload, exit. */
static int run_server(opts_t *o)
{
    link_t l = {-1, -1, -1, -1, zmq_ctx_new(), NULL};
    l.zsock = zmq_socket(l.zctx, ZMQ_REP);
    char ep[96];
    snprintf(ep, sizeof(ep), "tcp://%s:%u", o->ip0, (unsigned)o->port);
    if (zmq_bind(l.zsock, ep)) {
        fprintf(stderr, "kvwire-bench: cannot listen on %s: %s\n", ep, zmq_strerror(zmq_errno()));
        return 1;
    }
    printf("kvwire-bench server: waiting for a client on %s:%u\n", o->ip0, (unsigned)o->port);
    char msg[sizeof(wire_opts_t) + 1], buf[160];
    int len = zmq_recv(l.zsock, msg, sizeof(msg), 0);
    const char *problem = len < 0 ? "receive failed" : wire_unpack(msg, len, o, buf, sizeof(buf));
    if (problem) {
        char err[200];
        snprintf(err, sizeof(err), "ERR %s", problem);
        if (len >= 0)
            link_send(&l, err, strlen(err) + 1);
        fprintf(stderr, "kvwire-bench server: refused the client: %s\n", problem);
        link_close(&l);
        return 1;
    }
    printf("kvwire-bench server: a client: %s, %" PRIu64 " layers x K/V x %" PRIu64
           " pages x %" PRIu64 " B items, %" PRIu64 " requests (+%" PRIu64 " warmup)\n",
           o->fragmented ? "fragmented" : "contiguous", o->layers, o->pages, o->src_item,
           o->requests, o->warmup);
    int rc = run_prefill(o, &l);
    link_close(&l);
    printf("kvwire-bench server: %s\n", rc ? "FAILED (the client's report says why)" : "done");
    return rc;
}

/* --client: send the workload to the server, run decode, report. */
static int run_client(const opts_t *o)
{
    link_t l = {-1, -1, -1, -1, zmq_ctx_new(), NULL};
    l.zsock = zmq_socket(l.zctx, ZMQ_REQ);
    int wait_ms = LINK_WAIT_MS;
    zmq_setsockopt(l.zsock, ZMQ_RCVTIMEO, &wait_ms, sizeof(wait_ms));
    char ep[96];
    snprintf(ep, sizeof(ep), "tcp://%s:%u", o->server_ip, (unsigned)o->port);
    wire_opts_t w;
    wire_pack(o, &w);
    if (zmq_connect(l.zsock, ep) || zmq_send(l.zsock, &w, sizeof(w), 0) < 0) {
        fprintf(stderr, "kvwire-bench: cannot reach the server at %s: %s\n", ep,
                zmq_strerror(zmq_errno()));
        link_close(&l);
        return 1;
    }
    int rc = run_decode(o, &l);
    link_close(&l);
    return rc;
}

/* ------------------------------------------------------ layer-wise mode */

static void sleep_ms(uint64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

/* Where one request's tail went, in seconds: the last layer ready ->
 * prefill's first post of it (hand-off to the poller) -> decode's last
 * immediate (the wire, and decode's poller noticing) -> the caller seeing
 * Success. */
typedef struct tail_split {
    double to_post, to_landed, to_seen;
} tail_split_t;

/* The end of a timed request: wait for decode's Success, then prefill's,
 * split the time from t0 at prefill's first post and decode's last
 * immediate, check every byte and free both sides. Returns seconds from t0
 * to decode's Success as the caller saw it. */
static double finish_timed(const opts_t *o, const memory_t *dm, req_plan_t *rp, kvw_sender_t *s,
                           kvw_receiver_t *r, double t0, const char *mode, tail_split_t *split)
{
    kvw_poll_t ps;
    while ((ps = kvw_receiver_poll(r)) != KVW_POLL_SUCCESS && ps != KVW_POLL_FAILED)
        sched_yield();
    double seen = now_s();
    if (ps != KVW_POLL_SUCCESS) {
        const char *why = "";
        die(mode, "the request failed", kvw_receiver_failure(r, &why), why);
    }
    kvw_req_metrics_t sm, rm;
    kvw_receiver_metrics(r, &rm);
    while (kvw_sender_poll(s) == KVW_POLL_TRANSFERRING)
        sched_yield();
    kvw_sender_metrics(s, &sm);
    double posted = (double)sm.start_ns / 1e9, landed = (double)rm.end_ns / 1e9;
    *split = (tail_split_t){posted - t0, landed - posted, seen - landed};
    if (verify_req(o, dm, rp))
        die(mode, "wrong bytes at decode", KVW_ERR_TRANSFER, NULL);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    free_req(rp);
    return seen - t0;
}

/* One request: the forward pass, then (or meanwhile) the transfer. Returns
 * seconds from the last layer ready to decode's Success, and in *split
 * where they went. */
static double layered_request(const opts_t *o, kvw_engine_t *pe, kvw_engine_t *de, const char *bs,
                              const memory_t *dm, uint64_t k, bool streamed, tail_split_t *split)
{
    req_plan_t rp;
    plan_req(o, k, &rp);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    kvw_status_t st = kvw_receiver_create(de, bs, 0, rp.room, &r);
    if (!st)
        st = kvw_receiver_init(r, rp.dst, o->pages, KVW_NO_AUX);
    if (!st)
        st = kvw_sender_create(pe, rp.room, &s);
    if (!st)
        st = kvw_sender_init(s, o->pages, KVW_NO_AUX);
    if (st)
        die("layer-wise", "starting a request", st, NULL);
    while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING) /* decode's request is there */
        sched_yield();
    for (uint64_t l = 0; l < o->layers; l++) {
        sleep_ms(o->layer_ms); /* layer l is being computed */
        kvw_part_t p = {rp.src, o->pages, 0, (uint32_t)l, (uint32_t)l + 1};
        if (streamed && (st = kvw_sender_send_part(s, &p)))
            die("layer-wise", "send_part", st, NULL);
    }
    double ready = now_s();
    if (!streamed && (st = kvw_sender_send(s, rp.src, o->pages)))
        die("layer-wise", "send", st, NULL);
    return finish_timed(o, dm, &rp, s, r, ready, "layer-wise", split);
}

/* The whole path (b), for one request: prefill's pages were handed over
 * first (its sender waits for decode's request), and the receiver was
 * created beforehand, as engines do at admission; timed from decode's
 * init to its Success. Split: init -> prefill's first post (the request
 * hop: decode's control thread, ZeroMQ, prefill's control thread), first
 * post -> decode's last immediate, -> the caller sees Success. */
static double whole_request(const opts_t *o, kvw_engine_t *pe, kvw_engine_t *de, const char *bs,
                            const memory_t *dm, uint64_t k, tail_split_t *split)
{
    req_plan_t rp;
    plan_req(o, k, &rp);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    kvw_status_t st = kvw_receiver_create(de, bs, 0, rp.room, &r);
    if (!st)
        st = kvw_sender_create(pe, rp.room, &s);
    if (!st)
        st = kvw_sender_init(s, o->pages, KVW_NO_AUX);
    if (!st)
        st = kvw_sender_send(s, rp.src, o->pages);
    if (st)
        die("whole path", "starting a request", st, NULL);
    sleep_ms(o->layer_ms); /* every thread settles, as between requests */
    double t0 = now_s();
    if ((st = kvw_receiver_init(r, rp.dst, o->pages, KVW_NO_AUX)))
        die("whole path", "receiver init", st, NULL);
    return finish_timed(o, dm, &rp, s, r, t0, "whole path", split);
}

static double median(double *v, uint64_t n)
{
    qsort(v, n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* ---- one ZeroMQ round trip, the yardstick for decode's request hop ---- */

typedef struct echo_arg {
    void *rep;
    int n;
} echo_arg_t;

static void *echo_main(void *arg)
{
    echo_arg_t *a = arg;
    char buf[64];
    for (int i = 0; i < a->n; i++) {
        int len = zmq_recv(a->rep, buf, sizeof(buf), 0);
        if (len < 0 || zmq_send(a->rep, buf, (size_t)len, 0) < 0)
            break;
    }
    return NULL;
}

/* Median seconds of n 64-byte REQ -> REP -> REQ round trips over TCP on ip,
 * through ZeroMQ's I/O threads as kvwire's control messages go; 0 if it
 * could not be measured. */
static double zmq_round_trip(const char *ip, int n)
{
    void *ctx = zmq_ctx_new(), *rep = zmq_socket(ctx, ZMQ_REP), *req = zmq_socket(ctx, ZMQ_REQ);
    char bind[96], ep[128];
    size_t len = sizeof(ep);
    double *rtt = calloc((size_t)n, sizeof(double)), med = 0;
    snprintf(bind, sizeof(bind), "tcp://%s:*", ip);
    echo_arg_t a = {rep, n};
    pthread_t t;
    if (!rtt || zmq_bind(rep, bind) || zmq_getsockopt(rep, ZMQ_LAST_ENDPOINT, ep, &len) ||
        zmq_connect(req, ep) || pthread_create(&t, NULL, echo_main, &a)) {
        free(rtt);
        return 0;
    }
    char msg[64] = {0};
    int done = 0;
    for (; done < n; done++) {
        double t0 = now_s();
        if (zmq_send(req, msg, sizeof(msg), 0) < 0 || zmq_recv(req, msg, sizeof(msg), 0) < 0)
            break;
        rtt[done] = now_s() - t0;
    }
    if (done == n)
        med = median(rtt, (uint64_t)n);
    int linger = 0;
    zmq_setsockopt(req, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(req);
    if (done == n)
        pthread_join(t, NULL);
    else
        pthread_detach(t);
    zmq_close(rep);
    zmq_ctx_term(ctx);
    free(rtt);
    return med;
}

static int run_layerwise(const opts_t *o)
{
    memory_t pm, dm;
    alloc_memory(o, &pm, true, 0);
    alloc_memory(o, &dm, false, 0);
    char bind[96];
    snprintf(bind, sizeof(bind), "%s:0", o->ip0);
    kvw_bootstrap_t *bs;
    kvw_bootstrap_params_t bp;
    kvw_bootstrap_params_init(&bp);
    bp.bind_addr = bind;
    kvw_status_t st = kvw_bootstrap_create(&bp, &bs);
    if (st)
        die("layer-wise", "starting the bootstrap service", st, NULL);
    kvw_engine_t *pe = make_engine(o, &pm, true, kvw_bootstrap_addr(bs), 0);
    kvw_engine_t *de = make_engine(o, &dm, false, NULL, 0);
    uint64_t n = o->requests;
    double *at_end = calloc(n, sizeof(double)), *streamed = calloc(n, sizeof(double));
    double *to_post = calloc(n, sizeof(double)), *to_landed = calloc(n, sizeof(double));
    double *to_seen = calloc(n, sizeof(double));
    tail_split_t sa, sb;
    layered_request(o, pe, de, kvw_bootstrap_addr(bs), &dm, 0, false, &sa); /* connect, warm up */
    for (uint64_t i = 0; i < n; i++) { /* interleaved, alternating which goes first */
        bool stream_first = i % 2;
        double a =
            layered_request(o, pe, de, kvw_bootstrap_addr(bs), &dm, 1 + 2 * i, stream_first, &sa);
        double b =
            layered_request(o, pe, de, kvw_bootstrap_addr(bs), &dm, 2 + 2 * i, !stream_first, &sb);
        streamed[i] = stream_first ? a : b;
        at_end[i] = stream_first ? b : a;
        const tail_split_t *end = stream_first ? &sb : &sa; /* the send-at-end request's */
        to_post[i] = end->to_post;
        to_landed[i] = end->to_landed;
        to_seen[i] = end->to_seen;
        if (!o->quiet)
            printf("rep %" PRIu64
                   ": last layer ready -> Success: at end %.2f ms, streamed %.2f ms\n",
                   i, at_end[i] * 1e3, streamed[i] * 1e3);
    }
    double me = median(at_end, n), ms = median(streamed, n);
    double p99 = at_end[n - 1 - (n - 1) / 100]; /* sorted by median() */
    printf("send at end, median split: send() -> first post %.1f us, first post -> decode's "
           "last immediate %.1f us, immediate -> caller sees Success %.1f us; p99 / p50 %.2f\n",
           median(to_post, n) * 1e6, median(to_landed, n) * 1e6, median(to_seen, n) * 1e6,
           me > 0 ? p99 / me : 0);
    double bytes = (double)o->pages * (double)o->item * 2.0 * (double)o->layers;
    printf("layer-wise: %" PRIu64 " layers x %" PRIu64 " pages x 2 x %" PRIu64
           " B (%.2f MB) per request, %" PRIu64 " ms compute per layer, %" PRIu64
           " reps: last layer ready -> decode Success, median: at end %.2f ms, streamed %.2f ms, "
           "ratio streamed/at end %.3f\n",
           o->layers, o->pages, o->item, bytes / 1e6, o->layer_ms, n, me * 1e3, ms * 1e3,
           me > 0 ? ms / me : 0);
    if (o->json)
        printf("{\"mode\":\"layerwise\",\"layers\":%" PRIu64 ",\"layer_ms\":%" PRIu64
               ",\"at_end_ms\":%.3f,\"streamed_ms\":%.3f,\"ratio\":%.4f}\n",
               o->layers, o->layer_ms, me * 1e3, ms * 1e3, me > 0 ? ms / me : 0);
    double *whole = calloc(n, sizeof(double));
    for (uint64_t i = 0; i < n; i++) {
        tail_split_t w;
        whole[i] = whole_request(o, pe, de, kvw_bootstrap_addr(bs), &dm, 2 * n + 1 + i, &w);
        to_post[i] = w.to_post;
        to_landed[i] = w.to_landed;
        to_seen[i] = w.to_seen;
    }
    double mw = median(whole, n), w99 = whole[n - 1 - (n - 1) / 100];
    printf("whole path: decode init -> Success median %.2f ms, p99 / p50 %.2f; split: init -> "
           "prefill's first post (the request hop) %.1f us, first post -> decode's last "
           "immediate %.1f us, immediate -> caller sees Success %.1f us\n",
           mw * 1e3, mw > 0 ? w99 / mw : 0, median(to_post, n) * 1e6, median(to_landed, n) * 1e6,
           median(to_seen, n) * 1e6);
    free(whole);
    free(at_end);
    free(streamed);
    free(to_post);
    free(to_landed);
    free(to_seen);
    double rtt = zmq_round_trip(o->ip0, 201);
    printf("ZeroMQ round trip (64 B, REQ/REP over TCP on %s), median of 201: %.1f us\n", o->ip0,
           rtt * 1e6);
    kvw_engine_destroy(de);
    kvw_engine_destroy(pe);
    kvw_bootstrap_destroy(bs);
    free_memory(&pm);
    free_memory(&dm);
    return 0;
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvwire-bench";
    opts_t o;
    parse(argc, argv, &o);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (o.server)
        return run_server(&o);
    if (o.client)
        return run_client(&o);
    if (o.layer_ms)
        return run_layerwise(&o);
    int addr_pipe[2], result_pipe[2], done_pipe[2];
    if (pipe(addr_pipe) || pipe(result_pipe) || pipe(done_pipe)) {
        perror("kvwire-bench: pipe");
        return 1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        perror("kvwire-bench: fork");
        return 1;
    }
    if (pid == 0) {
        close(addr_pipe[0]);
        close(result_pipe[0]);
        close(done_pipe[1]);
        link_t l = {addr_pipe[1], result_pipe[1], done_pipe[0], -1, NULL, NULL};
        _exit(run_prefill(&o, &l));
    }
    close(addr_pipe[1]);
    close(result_pipe[1]);
    close(done_pipe[0]);
    link_t l = {addr_pipe[0], result_pipe[0], done_pipe[1], pid, NULL, NULL};
    return run_decode(&o, &l);
}
