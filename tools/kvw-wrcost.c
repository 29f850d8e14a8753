/* kvw-wrcost: instructions the library spends per RDMA work request, on the
 * host, no RDMA needed. Plans, builds and posts fragmented KV-cache requests
 * (default 1000 pages, 32 layers, runs of 4 pages) through the same internal
 * calls the poller makes (kvw__plan_runs/count/next, kvw__txq_room/add/flush/
 * retire) into a fake device whose post_send only counts WRs.
 *
 *   kvw-wrcost [--pages N] [--layers L] [--contig C] [--requests R]
 *              [--max-wr-insns N] [--valgrind PATH]
 *       re-runs itself under callgrind (collecting only inside
 *       wrcost_request(), the harness function that plans+builds+posts) and
 *       prints the library's instructions per WR; exits 1 over the target.
 *   kvw-wrcost --run ...    the workload only (what callgrind executes).
 *
 * Instructions per WR = (inclusive Ir of wrcost_request - self Ir of the
 * fake post_send) / WRs. wrcost_request's own loop is the same loop as
 * build_writes()/post_peer() in src/engine/poller.c, so it is counted as
 * library code; the breakdown also shows the kvw__* functions alone. */
#include "kvwire.h"
#include "kvw-tools.h"

#include "engine/txq.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "verbs/ops.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct wopts {
    uint64_t pages, layers, contig, requests, target;
    const char *valgrind;
} wopts_t;

static uint64_t g_fake_wrs, g_fake_posts;

/* The fake device: count the chain's WRs and accept it. */
__attribute__((noinline)) static int wrcost_fake_post_send(struct ibv_qp *qp,
                                                           struct ibv_send_wr *wr,
                                                           struct ibv_send_wr **bad)
{
    (void)qp;
    (void)bad;
    for (; wr; wr = wr->next)
        g_fake_wrs++;
    g_fake_posts++;
    return 0;
}

typedef struct harness {
    kvw_txq_t q;
    kvw_plan_region_t *regions;
    const uint64_t *src, *dst;
    kvw_run_t *runs;
    uint64_t pages;
    uint32_t layers;
    kvw_layout_t layout; /* the classic K/V layout */
} harness_t;

/* Plan, build and post one request exactly as request.c (sender start) and
 * poller.c (post_peer/build_writes) do; completions are simulated by
 * retiring everything posted when the send queue runs out of credits.
 * Returns the WRs built. Callgrind collects only inside this function. */
__attribute__((noinline)) uint64_t wrcost_request(harness_t *h, uint32_t token);
__attribute__((noinline)) uint64_t wrcost_request(harness_t *h, uint32_t token)
{
    kvw_plan_t p = {0};
    p.num_runs = kvw__plan_runs(h->src, h->dst, h->pages, h->runs);
    p.runs = h->runs;
    p.regions = h->regions;
    p.kv_slots = h->layout.kv_slots;
    p.kv_per_layer = h->layout.kv_per_layer;
    p.layer_end = h->layers;
    p.max_msg = 1ull << 30;
    uint64_t total = kvw__plan_count(&p), built = 0;
    kvw_plan_cursor_t cur = {0};
    kvw_txq_t *q = &h->q;
    while (built < total) {
        uint32_t room = kvw__txq_room(q);
        if (!room) {
            if (q->pending) {
                if (kvw__txq_flush(q))
                    return 0;
            } else {
                kvw__txq_retire(q, q->posted - 1); /* the CQ would report this */
            }
            continue;
        }
        kvw_write_t w;
        for (uint32_t b = 0; b < room && built < total && kvw__plan_next(&p, &cur, &w); b++) {
            int last = built + 1 == total;
            kvw__txq_add(q, &w, last, token);
            built++;
        }
    }
    if (q->pending && kvw__txq_flush(q))
        return 0;
    return built;
}

static uint64_t run_workload(const wopts_t *o, uint64_t *chains_p)
{
    static kvw_verbs_ops_t ops;
    ops.post_send = wrcost_fake_post_send;
    harness_t h = {.pages = o->pages, .layers = (uint32_t)o->layers};
    if (kvw__layout_classic(&h.layout, h.layers, 0)) {
        fprintf(stderr, "kvw-wrcost: no memory for the layout\n");
        exit(1);
    }
    uint64_t *src = malloc(o->pages * sizeof(uint64_t));
    uint64_t *dst = malloc(o->pages * sizeof(uint64_t));
    h.runs = malloc(o->pages * sizeof(kvw_run_t));
    h.regions = calloc(2 * o->layers, sizeof(kvw_plan_region_t));
    for (uint64_t i = 0; i < 2 * o->layers; i++)
        h.regions[i] = (kvw_plan_region_t){.local_addr = 0x100000000ull * (i + 1),
                                           .remote_addr = 0x8000000000ull + 0x100000000ull * i,
                                           .item_len = 2048,
                                           .lkey = (uint32_t)(100 + i),
                                           .rkey = (uint32_t)(200 + i)};
    shuffled_chunk_pages(src, o->pages, o->contig, 1);
    shuffled_chunk_pages(dst, o->pages, o->contig, 2);
    h.src = src;
    h.dst = dst;
    /* Real defaults: 512-deep send queue, 64-WR chains, signal every 32. */
    if (kvw__txq_init(&h.q, &ops, (struct ibv_qp *)&h, 512, 64, 32)) {
        fprintf(stderr, "kvw-wrcost: txq init failed\n");
        exit(1);
    }
    uint64_t wrs = 0;
    for (uint64_t r = 0; r < o->requests; r++)
        wrs += wrcost_request(&h, (uint32_t)r);
    if (wrs != g_fake_wrs || h.q.wrs_posted != wrs) {
        fprintf(stderr, "kvw-wrcost: built %" PRIu64 " WRs, fake device saw %" PRIu64 "\n", wrs,
                g_fake_wrs);
        exit(1);
    }
    *chains_p = g_fake_posts;
    kvw__txq_fini(&h.q);
    free(src);
    free(dst);
    free(h.runs);
    free(h.regions);
    kvw__layout_free(&h.layout);
    return wrs;
}

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
 * "N (p%)  file:fn [obj]"; one function may appear under several files when
 * inlined headers are attributed separately: summed). *total_p gets PROGRAM
 * TOTALS, i.e. everything collected inside wrcost_request() inclusive. */
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

static uint64_t cost_of(const fcost_t *c, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcmp(c[i].name, name) == 0)
            return c[i].ir;
    return 0;
}

static int measure(const wopts_t *o, char **argv)
{
    uint64_t chains;
    uint64_t wrs = run_workload(o, &chains);
    char out[] = "/tmp/kvw-wrcost.XXXXXX";
    int fd = mkstemp(out);
    if (fd < 0)
        return 1;
    close(fd);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "%s --tool=callgrind --callgrind-out-file=%s --collect-atstart=no "
             "--toggle-collect=wrcost_request -q %s --run --pages %" PRIu64
             " --layers %" PRIu64 " --contig %" PRIu64 " --requests %" PRIu64 " >/dev/null",
             o->valgrind, out, argv[0], o->pages, o->layers, o->contig, o->requests);
    if (system(cmd) != 0) {
        fprintf(stderr, "kvw-wrcost: `%s` failed (is valgrind installed? Debian package: "
                        "valgrind)\n", cmd);
        unlink(out);
        return 2;
    }
    fcost_t self[256];
    uint64_t total;
    int ns = annotate(out, self, 256, &total);
    if (getenv("KVW_WRCOST_KEEP"))
        printf("callgrind data kept in %s\n", out);
    else
        unlink(out);
    uint64_t fake = cost_of(self, ns, "wrcost_fake_post_send");
    if (ns <= 0 || !total) {
        fprintf(stderr, "kvw-wrcost: could not read callgrind_annotate output\n");
        return 2;
    }
    uint64_t lib = total - fake, kvw_only = 0;
    printf("workload: %" PRIu64 " request(s) x %" PRIu64 " pages x %" PRIu64
           " layers (K+V), runs of %" PRIu64 " pages: %" PRIu64 " WRs in %" PRIu64
           " chains (%.1f WRs/doorbell)\n",
           o->requests, o->pages, o->layers, o->contig, wrs, chains, (double)wrs / chains);
    printf("callgrind Ir (self) inside wrcost_request(), %" PRIu64 " in all:\n", total);
    for (int i = 0; i < ns; i++) {
        printf("  %12" PRIu64 "  %6.1f/WR  %s%s\n", self[i].ir, (double)self[i].ir / wrs,
               self[i].name,
               strcmp(self[i].name, "wrcost_fake_post_send") == 0 ? "  (fake device, excluded)"
               : strcmp(self[i].name, "wrcost_request") == 0
                   ? "  (harness = poller.c build_writes loop, counted)"
                   : "");
        if (strncmp(self[i].name, "kvw__", 5) == 0)
            kvw_only += self[i].ir;
    }
    double per_wr = (double)lib / wrs;
    printf("kvw__* functions alone: %.1f instructions per WR\n", (double)kvw_only / wrs);
    printf("library instructions per WR: %.1f (target <= %" PRIu64 "): %s\n", per_wr, o->target,
           per_wr <= (double)o->target ? "OK" : "OVER TARGET");
    return per_wr <= (double)o->target ? 0 : 1;
}

int main(int argc, char **argv)
{
    wopts_t o = {.pages = 1000, .layers = 32, .contig = 4, .requests = 4, .target = 100,
                 .valgrind = "valgrind"};
    int run_only = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--run") == 0) {
            run_only = 1;
            continue;
        }
        if (!v)
            goto usage;
        i++;
        if (strcmp(a, "--pages") == 0)
            o.pages = strtoull(v, NULL, 0);
        else if (strcmp(a, "--layers") == 0)
            o.layers = strtoull(v, NULL, 0);
        else if (strcmp(a, "--contig") == 0)
            o.contig = strtoull(v, NULL, 0);
        else if (strcmp(a, "--requests") == 0)
            o.requests = strtoull(v, NULL, 0);
        else if (strcmp(a, "--max-wr-insns") == 0)
            o.target = strtoull(v, NULL, 0);
        else if (strcmp(a, "--valgrind") == 0)
            o.valgrind = v;
        else
            goto usage;
    }
    if (!o.pages || !o.layers || !o.contig || !o.requests)
        goto usage;
    if (run_only) {
        uint64_t chains, wrs = run_workload(&o, &chains);
        printf("%" PRIu64 " WRs, %" PRIu64 " chains\n", wrs, chains);
        return 0;
    }
    return measure(&o, argv);
usage:
    fprintf(stderr, "usage: kvw-wrcost [--run] [--pages N] [--layers L] [--contig C] "
                    "[--requests R] [--max-wr-insns N] [--valgrind PATH]\n");
    return 2;
}
