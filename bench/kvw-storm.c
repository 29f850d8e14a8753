/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-storm: a handshake storm on real RDMA. One process holds a bootstrap
 * service, one prefill engine (--dev0/--ip0) and N decode engines
 * (--dev1/--ip1), each decode engine with its own memory, threads, control
 * socket and QPs: as N decode processes would connect, minus the process
 * boundary. Every prefill sender is created and sent first; then every
 * decode engine creates its receiver at the same moment, so N handshakes
 * reach prefill at once, and each request moves --pages pages of --item
 * bytes in each of 2 regions. Decode checks every byte.
 *
 * Prints, one line each: time from the storm's start to each connection's
 * request going out (decode's metrics start_ns: the moment it connected),
 * p50, p99 and max; requests failed (goal 0) and their first reasons;
 * per-connection throughput (bytes / decode's transfer_us): min, p50, max
 * and max/min; wrong bytes. Exit 0 when every request succeeded with every
 * byte right. Used by bench/bench.sh ("storm").
 *
 * Usage: kvw-storm --dev0 D --ip0 IP --dev1 D --ip1 IP [--engines N (64)]
 *                  [--pages P (16)] [--item BYTES (16384)] [--timeout-ms MS (120000)] */
#include "kvwire.h"

#include "kvw-tools.h"

#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    const char *dev0, *ip0, *dev1, *ip1;
    unsigned engines, pages;
    size_t item;
    unsigned timeout_ms;
} opts_t;

typedef struct {
    kvw_engine_t *engine;
    uint8_t *mem; /* K then V, pages * item each */
    kvw_region_t kv[2];
    kvw_sender_t *s;
    kvw_receiver_t *r;
    kvw_poll_t final;
    kvw_req_metrics_t m;
} conn_t;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint8_t pattern(size_t region, size_t off)
{
    return (uint8_t)(region * 131u + off * 7u + (off >> 12) + 1u);
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t pct(const uint64_t *sorted, unsigned n, unsigned p)
{
    unsigned i = (unsigned)(((uint64_t)n * p + 99) / 100);
    return sorted[i ? i - 1 : 0];
}

static int engine(const opts_t *o, kvw_role_t role, const char *dev, const char *ip, const char *bs,
                  kvw_region_t *kv, const kvw_config_t *cfg, kvw_engine_t **e)
{
    kvw_engine_params_t p;
    kvw_engine_params_init(&p);
    p.role = role;
    p.device = dev;
    p.local_ip = ip;
    p.bootstrap_addr = role == KVW_ROLE_PREFILL ? bs : NULL;
    p.num_layers = 1;
    p.kv_regions = kv;
    p.config = cfg;
    (void)o;
    kvw_status_t st = kvw_engine_create(&p, e);
    if (st)
        fprintf(stderr, "kvw-storm: %s engine on %s: %s\n", role ? "decode" : "prefill", dev,
                kvw_strerror(st));
    return st ? -1 : 0;
}

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvw-storm --dev0 D --ip0 IP --dev1 D --ip1 IP [--engines N] [--pages P]\n"
           "                 [--item BYTES] [--timeout-ms MS]\n"
           "A handshake storm on real RDMA: one prefill engine (dev0/ip0) and N decode\n"
           "engines (dev1/ip1) in one process, every decode engine's request at once.\n"
           "Numbers are decimal, or hex after 0x.\n"
           "  --engines N       decode engines (64)\n"
           "  --pages P         pages a request, in each of 2 regions (16)\n"
           "  --item BYTES      bytes a page, a multiple of 8 (16384)\n"
           "  --timeout-ms MS   how long the storm may take (120000)\n"
           "  -h, --help        this help\n"
           "  -V, --version     the kvwire version\n"
           "Exit status: 0 every request succeeded with every byte right; 1 otherwise, or\n"
           "a bad command line.\n");
    exit(0);
}

static int parse(int argc, char **argv, opts_t *o)
{
    static const struct option opts[] = {
        {"dev0", required_argument, NULL, 'a'},
        {"ip0", required_argument, NULL, 'b'},
        {"dev1", required_argument, NULL, 'c'},
        {"ip1", required_argument, NULL, 'd'},
        {"engines", required_argument, NULL, 'n'},
        {"pages", required_argument, NULL, 'p'},
        {"item", required_argument, NULL, 'i'},
        {"timeout-ms", required_argument, NULL, 't'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    *o = (opts_t){.engines = 64, .pages = 16, .item = 16384, .timeout_ms = 120000};
    int c;
    while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
        switch (c) {
        case 'a':
            o->dev0 = optarg;
            break;
        case 'b':
            o->ip0 = kvw_tool_ipv4("--ip0", optarg);
            break;
        case 'c':
            o->dev1 = optarg;
            break;
        case 'd':
            o->ip1 = kvw_tool_ipv4("--ip1", optarg);
            break;
        case 'n':
            o->engines = kvw_tool_u32("--engines", optarg, 1, 4096);
            break;
        case 'p':
            o->pages = kvw_tool_u32("--pages", optarg, 1, 1u << 20);
            break;
        case 'i':
            o->item = kvw_tool_u64("--item", optarg, 8, 1u << 30);
            break;
        case 't':
            o->timeout_ms = kvw_tool_u32("--timeout-ms", optarg, 1, 3600000);
            break;
        case 'h':
            usage();
        case 'V':
            kvw_tool_version();
        default:
            kvw_tool_bad_option();
        }
    }
    if (optind != argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
    if (!o->dev0 || !o->ip0 || !o->dev1 || !o->ip1)
        kvw_tool_usage_error("--dev0, --ip0, --dev1 and --ip1 are required");
    if (o->item % 8)
        kvw_tool_usage_error("invalid --item '%lu': not a multiple of 8", (unsigned long)o->item);
    return 0;
}

/* Every receiver at once; then wait for all of them. */
static uint64_t storm(const opts_t *o, conn_t *c, const char *bs, const uint64_t *pages)
{
    uint64_t t0 = now_ns();
    for (unsigned i = 0; i < o->engines; i++) {
        if (kvw_receiver_create(c[i].engine, bs, 0, i + 1, &c[i].r) ||
            kvw_receiver_init(c[i].r, pages, o->pages, KVW_NO_AUX))
            fprintf(stderr, "kvw-storm: receiver %u could not be created\n", i);
    }
    uint64_t end = t0 + (uint64_t)o->timeout_ms * 1000000ull;
    for (unsigned left = o->engines; left && now_ns() < end;) {
        left = 0;
        for (unsigned i = 0; i < o->engines; i++) {
            kvw_poll_t st = c[i].r ? kvw_receiver_poll(c[i].r) : KVW_POLL_FAILED;
            c[i].final = st;
            left += st != KVW_POLL_SUCCESS && st != KVW_POLL_FAILED;
        }
        usleep(1000);
    }
    return t0;
}

static void report(const opts_t *o, conn_t *c, uint64_t t0, uint64_t engines_ns)
{
    uint64_t *conn = calloc(o->engines, sizeof(uint64_t)), *bw = calloc(o->engines, 8);
    unsigned nconn = 0, ok = 0, failed = 0, shown = 0;
    size_t wrong = 0, len = o->pages * o->item;
    for (unsigned i = 0; i < o->engines; i++) {
        if (c[i].r)
            kvw_receiver_metrics(c[i].r, &c[i].m);
        if (c[i].m.start_ns > t0)
            conn[nconn++] = (c[i].m.start_ns - t0) / 1000000;
        if (c[i].final == KVW_POLL_SUCCESS) {
            for (size_t r = 0; r < 2; r++)
                for (size_t b = 0; b < len; b++)
                    wrong += c[i].mem[r * len + b] != pattern(r, b);
            if (c[i].m.transfer_us)
                bw[ok] = c[i].m.bytes * 1000000ull / c[i].m.transfer_us;
            ok++;
        } else {
            const char *why = NULL;
            failed++;
            if (c[i].r)
                kvw_receiver_failure(c[i].r, &why);
            if (shown++ < 3)
                printf("storm: room %u ended %d: %s\n", i + 1, (int)c[i].final, why ? why : "-");
        }
    }
    qsort(conn, nconn, sizeof(*conn), cmp_u64);
    qsort(bw, ok, sizeof(*bw), cmp_u64);
    printf("storm: %u decode engines -> 1 prefill, %zu KiB per request\n", o->engines,
           2 * len / 1024);
    if (nconn)
        printf("storm: time to connected: p50 %" PRIu64 " ms, p99 %" PRIu64 " ms, max %" PRIu64
               " ms (%u of %u connected)\n",
               pct(conn, nconn, 50), pct(conn, nconn, 99), conn[nconn - 1], nconn, o->engines);
    /* Where decode's lookups happen: with KVW_REGISTRY each decode engine
     * reads the ranks once at creation (a watch keeps them); with the
     * bootstrap service each receiver asks it while the storm connects. */
    bool registry = getenv("KVW_REGISTRY") != NULL;
    uint64_t lookup_ms = registry ? engines_ns / 1000000 : (nconn ? conn[nconn - 1] : 0);
    unsigned lookups = registry ? o->engines : nconn;
    printf("storm: lookups (%s): %u in %" PRIu64 " ms, %.0f per second\n",
           registry ? "registry reads at engine creation" : "bootstrap service, receivers", lookups,
           lookup_ms, lookup_ms ? lookups * 1000.0 / (double)lookup_ms : 0.0);
    printf("storm: requests failed %u of %u, wrong bytes %zu\n", failed, o->engines, wrong);
    if (ok && bw[0])
        printf("storm: per-connection throughput MB/s: min %.1f, p50 %.1f, max %.1f, max/min "
               "%.2f\n",
               bw[0] / 1e6, pct(bw, ok, 50) / 1e6, bw[ok - 1] / 1e6, (double)bw[ok - 1] / bw[0]);
    free(conn);
    free(bw);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-storm";
    opts_t o;
    parse(argc, argv, &o);
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    if (cfg.max_peers < o.engines + 4)
        cfg.max_peers = o.engines + 4;
    size_t len = o.pages * o.item;
    kvw_bootstrap_params_t bp;
    kvw_bootstrap_params_init(&bp);
    char bind[64];
    snprintf(bind, sizeof(bind), "%s:0", o.ip0);
    bp.bind_addr = bind;
    kvw_bootstrap_t *bs = NULL;
    if (kvw_bootstrap_create(&bp, &bs)) {
        fprintf(stderr, "kvw-storm: bootstrap service on %s failed\n", bind);
        return 1;
    }
    uint8_t *src = malloc(2 * len);
    conn_t *c = calloc(o.engines, sizeof(*c));
    uint64_t *pages = calloc(o.pages, sizeof(uint64_t));
    for (size_t r = 0; r < 2; r++)
        for (size_t b = 0; b < len; b++)
            src[r * len + b] = pattern(r, b);
    for (unsigned p = 0; p < o.pages; p++)
        pages[p] = p;
    kvw_region_t skv[2] = {{src, len, o.item}, {src + len, len, o.item}};
    kvw_engine_t *prefill = NULL;
    if (engine(&o, KVW_ROLE_PREFILL, o.dev0, o.ip0, kvw_bootstrap_addr(bs), skv, &cfg, &prefill))
        return 1;
    uint64_t engines_ns = 0; /* decode engines' creation, senders excluded */
    for (unsigned i = 0; i < o.engines; i++) {
        c[i].mem = calloc(2, len);
        c[i].kv[0] = (kvw_region_t){c[i].mem, len, o.item};
        c[i].kv[1] = (kvw_region_t){c[i].mem + len, len, o.item};
        uint64_t e0 = now_ns();
        if (engine(&o, KVW_ROLE_DECODE, o.dev1, o.ip1, NULL, c[i].kv, &cfg, &c[i].engine))
            return 1;
        engines_ns += now_ns() - e0;
        if (kvw_sender_create(prefill, i + 1, &c[i].s) ||
            kvw_sender_init(c[i].s, o.pages, KVW_NO_AUX) ||
            kvw_sender_send(c[i].s, pages, o.pages)) {
            fprintf(stderr, "kvw-storm: sender %u failed\n", i);
            return 1;
        }
    }
    uint64_t t0 = storm(&o, c, kvw_bootstrap_addr(bs), pages);
    report(&o, c, t0, engines_ns);
    int rc = 0;
    for (unsigned i = 0; i < o.engines; i++)
        rc |= c[i].final != KVW_POLL_SUCCESS;
    for (unsigned i = 0; i < o.engines; i++) {
        kvw_receiver_destroy(c[i].r);
        kvw_sender_destroy(c[i].s);
        kvw_engine_destroy(c[i].engine);
        free(c[i].mem);
    }
    kvw_engine_destroy(prefill);
    kvw_bootstrap_destroy(bs);
    free(src);
    free(c);
    free(pages);
    return rc;
}
