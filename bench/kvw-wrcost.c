/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-wrcost: what the library spends per RDMA work request on the host, no
 * RDMA needed, measured on the real code path. A hand-built prefill engine
 * (no threads, no device) with one connected peer whose verbs are a null
 * device: post_send only counts the chain's WRs and notes the wr_id of each
 * signaled one; poll_cq hands those back as successful completions. Requests
 * go through the public sender API (create, init, send) and decode's request
 * through kvw__sender_accept_request_locked, as the control thread does, so
 * they are planned by sender.c; the poller's own functions (poller.h: one
 * pass, or its post and poll halves) then build, link, post and retire them.
 * Default workload: 1000-page, 32-layer (K and V, 2 KiB items) fragmented
 * requests whose pages are contiguous for 4 pages at a time.
 *
 *   kvw-wrcost [--pages N] [--layers L] [--contig C] [--requests R]
 *              [--max-wr-insns N] [--valgrind PATH]
 *       re-runs itself under callgrind, collecting only inside
 *       wrcost_transfer() (hand the requests over, poller passes until every
 *       one succeeded, destroy the senders), and prints the library's
 *       instructions per WR: everything collected minus the null device's
 *       own instructions. Exits 1 over the target (default 45).
 *   kvw-wrcost --rate [--reps N] [...]
 *       the null-device rates on this core: WRs posted per second (time in
 *       the poller's post half) and completions retired per second (time in
 *       its poll half), median of N runs (default 7).
 *   kvw-wrcost --run [...]   one transfer, what callgrind executes. */
#include "kvwire.h"
#include "kvw-tools.h"

#include "engine/core.h"
#include "engine/poller.h"
#include "verbs/device.h"

#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

enum { ITEM_LEN = 2048 };

typedef struct wopts {
    uint64_t pages, layers, contig, requests, target, reps;
    const char *valgrind;
} wopts_t;

/* ------------------------------------------------------- the null device */

/* Completions owed: the wr_id of every signaled WR posted and not polled. */
static struct {
    uint64_t *ring;
    uint64_t mask, head, tail;
    uint64_t wrs, posts, polls;
} g_null;

/* Accept the chain: count its WRs, owe a completion for each signaled one. */
__attribute__((noinline)) static int null_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr,
                                                    struct ibv_send_wr **bad)
{
    (void)qp;
    (void)bad;
    for (; wr; wr = wr->next) {
        g_null.wrs++;
        if (wr->send_flags & IBV_SEND_SIGNALED)
            g_null.ring[g_null.tail++ & g_null.mask] = wr->wr_id;
    }
    g_null.posts++;
    return 0;
}

__attribute__((noinline)) static int null_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    (void)cq;
    int k = 0;
    for (; k < n && g_null.head != g_null.tail; k++)
        wc[k] = (struct ibv_wc){.wr_id = g_null.ring[g_null.head++ & g_null.mask],
                                .status = IBV_WC_SUCCESS,
                                .opcode = IBV_WC_RDMA_WRITE};
    g_null.polls++;
    return k;
}

/* ------------------------------------------------- the hand-built engine */

typedef struct harness {
    kvw_engine_t *e;
    kvw_peer_t *p;
    kvw_dev_t dev;
    kvw_qp_t qp;
    kvw_verbs_ops_t ops;
    kvw_peer_t *_Atomic slot;
    uint64_t *src, *dst; /* the request's source and destination pages */
    uint64_t pages;
    kvw_sender_t **senders;
    uint64_t next_room;
} harness_t;

static void die(const char *what)
{
    fprintf(stderr, "kvw-wrcost: %s\n", what);
    exit(2);
}

/* An engine as engine.c leaves it for the poller, minus threads and device:
 * config defaults (KVW_* env applies), the classic K/V layout, one peer
 * connected with decode's regions paired to ours. */
static void engine_setup(harness_t *h, const wopts_t *o)
{
    kvw_engine_t *e = calloc(1, sizeof(*e));
    kvw_peer_t *p = calloc(1, sizeof(*p));
    if (!e || !p || kvw_config_init(&e->cfg))
        die("engine setup failed");
    e->role = KVW_ROLE_PREFILL;
    e->ops = &kvw__prefill_ops;
    e->control_wake_fd = eventfd(0, EFD_NONBLOCK);
    e->poller_wake_fd = eventfd(0, EFD_NONBLOCK);
    pthread_mutex_init(&e->lock, NULL);
    if (e->control_wake_fd < 0 || e->poller_wake_fd < 0 ||
        kvw__layout_classic(&e->layout, (uint32_t)o->layers, 0))
        die("engine setup failed");
    e->local_max[KVW_LAYOUT_KV] = o->pages;
    h->ops.post_send = null_post_send;
    h->ops.poll_cq = null_poll_cq;
    h->dev.ops = &h->ops;
    h->dev.max_msg_sz = 1u << 30;
    e->dev = e->rail[0].dev = &h->dev;
    e->nrails = 1;
    uint32_t nreg = e->layout.num_regions;
    p->regions = calloc(nreg, sizeof(*p->regions));
    if (!p->regions)
        die("no memory");
    for (uint32_t i = 0; i < nreg; i++)
        p->regions[i] = (kvw_plan_region_t){.local_addr = 0x100000000ull * (i + 1),
                                            .remote_addr = 0x8000000000ull + 0x100000000ull * i,
                                            .item_len = ITEM_LEN,
                                            .lkey = 100 + i,
                                            .rkey = 200 + i};
    p->engine = e;
    p->nlanes = 1;
    p->nroutes = 1;
    p->rails.nsched = 1; /* the one lane's turn (sched[0] = 0) */
    p->lanes[0].qp = &h->qp;
    p->lanes[0].regions = p->regions;
    h->qp.qp = (struct ibv_qp *)h; /* the null device never looks at them */
    h->qp.cq = (struct ibv_cq *)h;
    p->max_msg_sz = h->dev.max_msg_sz;
    p->remote_max[KVW_LAYOUT_KV] = o->pages;
    atomic_init(&p->state, PEER_CONNECTED);
    atomic_init(&p->lanes[0].imm_limit, UINT64_MAX); /* receives for every immediate */
    atomic_init(&h->slot, p);
    e->peers = &h->slot;
    e->peer_slots = 1;
    atomic_init(&e->num_peers, 1);
    h->e = e;
    h->p = p;
    uint64_t ring = 1;
    while (ring < e->cfg.sq_depth)
        ring <<= 1;
    g_null.ring = calloc(ring, sizeof(uint64_t));
    g_null.mask = ring - 1;
    h->pages = o->pages;
    h->src = malloc(o->pages * sizeof(uint64_t));
    h->dst = malloc(o->pages * sizeof(uint64_t));
    h->senders = calloc(o->requests, sizeof(*h->senders));
    if (!g_null.ring || !h->src || !h->dst || !h->senders)
        die("no memory");
    shuffled_chunk_pages(h->src, o->pages, o->contig, 1);
    shuffled_chunk_pages(h->dst, o->pages, o->contig, 2);
}

static void engine_teardown(harness_t *h)
{
    kvw_engine_t *e = h->e;
    if (h->p->lanes[0].txq_ready)
        kvw__txq_fini(&h->p->lanes[0].txq);
    while (e->reqs)
        kvw__req_drop_locked(e->reqs);
    kvw__reqtab_fini(e);
    kvw__layout_free(&e->layout);
    close(e->control_wake_fd);
    close(e->poller_wake_fd);
    pthread_mutex_destroy(&e->lock);
    free(h->p->regions);
    free(h->p);
    free(e);
    free(g_null.ring);
    free(h->src);
    free(h->dst);
    free(h->senders);
}

/* One request as an application and decode make it: the sender's pages, and
 * decode's REQUEST (as the control thread accepts it); the sender plans it
 * and hands it to the poller. */
static kvw_sender_t *hand_over(harness_t *h)
{
    kvw_engine_t *e = h->e;
    kvw_sender_t *s;
    uint64_t room = h->next_room++;
    if (kvw_sender_create(e, room, &s) || kvw_sender_init(s, h->pages, KVW_NO_AUX))
        die("sender create/init failed");
    kvw_msg_t m = {.type = KVW_MSG_REQUEST};
    m.u.request.room = room;
    m.u.request.token = (uint32_t)room;
    m.u.request.aux_index = KVW_NO_AUX;
    m.u.request.num_pages = (uint32_t)h->pages;
    m.u.request.pages = h->dst;
    char why[KVW_WIRE_REASON_MAX];
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = kvw__sender_accept_request_locked((kvw_req_t *)s, h->p, &m, why, sizeof(why));
    pthread_mutex_unlock(&e->lock);
    if (st || kvw_sender_send(s, h->src, h->pages))
        die("handing the request over failed");
    return s;
}

static uint64_t counter(_Atomic uint64_t *c)
{
    return atomic_load_explicit(c, memory_order_relaxed);
}

static void check_done(const harness_t *h, uint64_t requests)
{
    kvw_engine_t *e = h->e;
    uint64_t want = requests * h->pages * 2 * (uint64_t)e->layout.kv_layers * ITEM_LEN;
    if (counter(&e->counters.ok) != requests || counter(&e->counters.bytes) != want ||
        counter(&e->counters.wrs) != g_null.wrs ||
        counter(&e->counters.wrs_completed) != g_null.wrs)
        die("the transfer did not complete as planned");
}

/* Everything callgrind counts: hand the requests over, run poller passes
 * until all succeeded, destroy the senders. Returns the WRs posted. */
__attribute__((noinline)) uint64_t wrcost_transfer(harness_t *h, uint64_t requests);
__attribute__((noinline)) uint64_t wrcost_transfer(harness_t *h, uint64_t requests)
{
    kvw_engine_t *e = h->e;
    uint64_t wrs0 = g_null.wrs, ok0 = counter(&e->counters.ok);
    for (uint64_t i = 0; i < requests; i++)
        h->senders[i] = hand_over(h);
    while (counter(&e->counters.ok) - ok0 < requests)
        if (!kvw__poller_run_once(e))
            die("the poller made no progress");
    for (uint64_t i = 0; i < requests; i++)
        kvw_sender_destroy(h->senders[i]);
    return g_null.wrs - wrs0;
}

/* ------------------------------------------------------------ the rates */

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

typedef struct rate {
    double wrs_per_s, cqes_per_s, retired_per_s;
} rate_t;

/* One run: hand every request over (one untimed pass takes them in), then
 * alternate the poller's post and poll halves, timing each. */
static rate_t rate_run(harness_t *h, uint64_t requests)
{
    kvw_engine_t *e = h->e;
    uint64_t ok0 = counter(&e->counters.ok), post_ns = 0, poll_ns = 0, wrs = 0, cqes = 0,
             retired = 0;
    for (uint64_t i = 0; i < requests; i++)
        h->senders[i] = hand_over(h);
    kvw__poller_run_once(e);
    while (counter(&e->counters.ok) - ok0 < requests) {
        uint64_t t0 = now_ns();
        int posted = kvw__poller_post_peer(e, h->p);
        uint64_t t1 = now_ns(), done0 = counter(&e->counters.wrs_completed);
        int polled = kvw__poller_poll_peer(e, h->p);
        uint64_t t2 = now_ns();
        if (!posted && !polled)
            die("the poller made no progress");
        post_ns += t1 - t0;
        poll_ns += t2 - t1;
        wrs += (uint64_t)posted;
        cqes += (uint64_t)polled;
        retired += counter(&e->counters.wrs_completed) - done0;
    }
    for (uint64_t i = 0; i < requests; i++)
        kvw_sender_destroy(h->senders[i]);
    return (rate_t){wrs * 1e9 / (double)post_ns, cqes * 1e9 / (double)poll_ns,
                    retired * 1e9 / (double)poll_ns};
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, uint64_t n)
{
    qsort(v, n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int rates(const wopts_t *o)
{
    harness_t h = {0};
    engine_setup(&h, o);
    rate_run(&h, o->requests); /* warm-up: caches, page faults, the txq */
    double w[64], c[64], r[64];
    uint64_t n = o->reps < 64 ? o->reps : 64;
    for (uint64_t i = 0; i < n; i++) {
        rate_t x = rate_run(&h, o->requests);
        w[i] = x.wrs_per_s;
        c[i] = x.cqes_per_s;
        r[i] = x.retired_per_s;
    }
    check_done(&h, o->requests * (n + 1));
    double wm = median(w, n), wlo = w[0], whi = w[n - 1];
    printf("null device, one core: %.1f M WR/s posted (median of %" PRIu64
           " runs, %.1f-%.1f; target >= 20): %s\n",
           wm / 1e6, n, wlo / 1e6, whi / 1e6, wm >= 20e6 ? "OK" : "UNDER TARGET");
    printf("null device, one core: %.1f M completions/s retired (%.0f M WR/s retired), median of "
           "%" PRIu64 " runs\n",
           median(c, n) / 1e6, median(r, n) / 1e6, n);
    printf("  (%" PRIu64 " requests x %" PRIu64 " pages x %" PRIu64 " layers K+V per run, runs "
           "of %" PRIu64 " pages; sq_depth %u, chain_max %u, signal_every %u)\n",
           o->requests, o->pages, o->layers, o->contig, h.e->cfg.sq_depth, h.e->cfg.chain_max,
           h.e->cfg.signal_every);
    engine_teardown(&h);
    return wm >= 20e6 ? 0 : 1;
}

/* ------------------------------------------------------ callgrind driver */

static uint64_t parse_num(const char *s)
{
    uint64_t v = 0;
    for (; *s; s++)
        if (*s >= '0' && *s <= '9')
            v = v * 10 + (uint64_t)(*s - '0');
        else if (*s != ',')
            break;
    return v;
}

typedef struct fcost {
    char name[96];
    uint64_t ir;
} fcost_t;

/* Self cost per function from `callgrind_annotate --auto=no` (lines
 * "N (p%)  file:fn [obj]"; a function seen under several files, inlined
 * from headers, is summed). *total_p gets PROGRAM TOTALS: everything
 * collected inside wrcost_transfer(), inclusive. */
static int annotate(const char *file, fcost_t *out, int max, uint64_t *total_p)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "callgrind_annotate --auto=no --threshold=100 %s 2>&1", file);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    char line[1024];
    int n = 0;
    *total_p = 0;
    while (fgets(line, sizeof(line), f)) {
        char *s = line;
        while (*s == ' ')
            s++;
        if (*s < '0' || *s > '9')
            continue;
        if (strstr(s, "PROGRAM TOTALS")) {
            *total_p = parse_num(s);
            continue;
        }
        char *colon = strstr(s, ":");
        if (!colon)
            continue;
        char *fn = colon + 1;
        int len = (int)strcspn(fn, " \n[");
        int i = 0;
        while (i < n && (strncmp(out[i].name, fn, (size_t)len) != 0 || out[i].name[len]))
            i++;
        if (i == n) {
            if (n >= max)
                continue;
            snprintf(out[n].name, sizeof(out[n].name), "%.*s", len, fn);
            out[n++].ir = 0;
        }
        out[i].ir += parse_num(s);
    }
    pclose(f);
    return n;
}

static int is_null_device(const char *fn)
{
    return strcmp(fn, "null_post_send") == 0 || strcmp(fn, "null_poll_cq") == 0;
}

static int run_callgrind(const wopts_t *o, const char *self, const char *out)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "%s --tool=callgrind --callgrind-out-file=%s --collect-atstart=no "
             "--toggle-collect=wrcost_transfer -q %s --run --pages %" PRIu64 " --layers %" PRIu64
             " --contig %" PRIu64 " --requests %" PRIu64 " >/dev/null",
             o->valgrind, out, self, o->pages, o->layers, o->contig, o->requests);
    if (system(cmd) == 0)
        return 0;
    fprintf(stderr, "kvw-wrcost: `%s` failed (is valgrind installed? Debian package: valgrind)\n",
            cmd);
    return 2;
}

static int report(const wopts_t *o, const fcost_t *c, int n, uint64_t total, uint64_t wrs,
                  uint64_t chains)
{
    uint64_t null = 0;
    for (int i = 0; i < n; i++)
        null += is_null_device(c[i].name) ? c[i].ir : 0;
    printf("workload: %" PRIu64 " request(s) x %" PRIu64 " pages x %" PRIu64
           " layers (K+V, %u B items), runs of %" PRIu64 " pages: %" PRIu64 " WRs in %" PRIu64
           " chains (%.1f WRs/doorbell)\n",
           o->requests, o->pages, o->layers, ITEM_LEN, o->contig, wrs, chains,
           (double)wrs / (double)chains);
    printf("callgrind Ir (self) inside wrcost_transfer(), %" PRIu64 " in all:\n", total);
    for (int i = 0; i < n; i++)
        if (c[i].ir * 1000 >= total || is_null_device(c[i].name)) /* >= 0.1% */
            printf("  %12" PRIu64 "  %6.2f/WR  %s%s\n", c[i].ir, (double)c[i].ir / (double)wrs,
                   c[i].name, is_null_device(c[i].name) ? "  (null device, excluded)" : "");
    double per_wr = (double)(total - null) / (double)wrs;
    int ok = per_wr <= (double)o->target;
    printf("library instructions per WR (sender API, planning, the poller's build/link/post and "
           "retire): %.1f (target <= %" PRIu64 "): %s\n",
           per_wr, o->target, ok ? "OK" : "OVER TARGET");
    return ok ? 0 : 1;
}

static int measure(const wopts_t *o, const char *self)
{
    harness_t h = {0};
    engine_setup(&h, o);
    uint64_t wrs = wrcost_transfer(&h, o->requests), chains = g_null.posts;
    check_done(&h, o->requests);
    engine_teardown(&h);
    char out[] = "/tmp/kvw-wrcost.XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0)
        return 2;
    close(fd);
    int rc = run_callgrind(o, self, out);
    fcost_t c[256];
    uint64_t total = 0;
    int n = rc ? 0 : annotate(out, c, 256, &total);
    if (getenv("KVW_WRCOST_KEEP"))
        printf("callgrind data kept in %s\n", out);
    else
        unlink(out);
    if (rc)
        return rc;
    if (n <= 0 || !total) {
        fprintf(stderr, "kvw-wrcost: could not read callgrind_annotate output\n");
        return 2;
    }
    return report(o, c, n, total, wrs, chains);
}

static int run_once(const wopts_t *o)
{
    harness_t h = {0};
    engine_setup(&h, o);
    uint64_t wrs = wrcost_transfer(&h, o->requests);
    check_done(&h, o->requests);
    printf("%" PRIu64 " WRs, %" PRIu64 " chains\n", wrs, g_null.posts);
    engine_teardown(&h);
    return 0;
}

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvw-wrcost [--run | --rate [--reps N]] [--pages N] [--layers L]\n"
           "                  [--contig C] [--requests R] [--max-wr-insns N] [--valgrind PATH]\n"
           "Library instructions per work request on a null device, host only, under\n"
           "callgrind (fails over --max-wr-insns); --run: one pass without callgrind;\n"
           "--rate: the null device's WRs per second on one core, best of --reps.\n"
           "Numbers are decimal, or hex after 0x.\n"
           "  --pages N (1000) --layers L (32) --contig C (4) --requests R (4; --rate 32)\n"
           "  --max-wr-insns N (45) --reps N (7) --valgrind PATH (valgrind)\n"
           "  -h, --help     this help\n"
           "  -V, --version  the kvwire version\n"
           "Exit status: 0 measured (within the target); 1 over the target, or a bad\n"
           "command line; 2 the measurement failed.\n");
    exit(0);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-wrcost";
    wopts_t o = {
        .pages = 1000, .layers = 32, .contig = 4, .target = 45, .reps = 7, .valgrind = "valgrind"};
    int mode = 0; /* 0 callgrind, 1 --run, 2 --rate */
    static const struct option lo[] = {
        {"run", 0, 0, 'r'},    {"rate", 0, 0, 'R'},         {"pages", 1, 0, 'p'},
        {"layers", 1, 0, 'L'}, {"contig", 1, 0, 'c'},       {"requests", 1, 0, 'n'},
        {"reps", 1, 0, 'e'},   {"max-wr-insns", 1, 0, 'm'}, {"valgrind", 1, 0, 'g'},
        {"help", 0, 0, 'h'},   {"version", 0, 0, 'V'},      {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "hV", lo, NULL)) != -1) {
        if (c == 'r' || c == 'R')
            mode = c == 'r' ? 1 : 2;
        else if (c == 'p')
            o.pages = kvw_tool_u64("--pages", optarg, 1, KVW_WIRE_MAX_PAGES);
        else if (c == 'L')
            o.layers = kvw_tool_u64("--layers", optarg, 1, 65535);
        else if (c == 'c')
            o.contig = kvw_tool_u64("--contig", optarg, 1, KVW_WIRE_MAX_PAGES);
        else if (c == 'n')
            o.requests = kvw_tool_u64("--requests", optarg, 1, 1000000);
        else if (c == 'e')
            o.reps = kvw_tool_u64("--reps", optarg, 1, 1000);
        else if (c == 'm')
            o.target = kvw_tool_u64("--max-wr-insns", optarg, 1, 1000000);
        else if (c == 'g')
            o.valgrind = optarg;
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
    if (!o.requests) /* the rate runs longer: 512,000 WRs a run */
        o.requests = mode == 2 ? 32 : 4;
    if (mode == 1)
        return run_once(&o);
    if (mode == 2)
        return rates(&o);
    return measure(&o, argv[0]);
}
