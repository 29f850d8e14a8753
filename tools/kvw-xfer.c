/* kvw-xfer: one side (prefill or decode) of a real KV-cache transfer through
 * the public API, with deterministic random contents so decode can verify
 * every byte. Used by `make demo`, the integration tests and the benchmark.
 *
 *   kvw-xfer prefill --ip IP [--dev NAME] (--bootstrap ADDR | --embed-bootstrap FILE) ...
 *   kvw-xfer decode  --ip IP [--dev NAME] (--bootstrap ADDR | --bootstrap-file FILE) ...
 *
 * Both sides derive each room's source and destination pages from --seed,
 * so they must be given the same layout and workload options. */
#include "kvwire.h"
#include "kvw-tools.h"

#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

typedef struct opts {
    bool prefill;
    const char *dev, *ip, *bootstrap, *bootstrap_file, *embed_file;
    uint32_t rank, layers, requests, pages, inflight, decoders, decoder_index;
    uint64_t item, pool, aux_item, aux_items, contig, dst_contig, seed;
    uint32_t idle_check_s;
    bool json, quiet;
} opts_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static void die(const char *what, kvw_status_t st)
{
    fprintf(stderr, "kvw-xfer: %s: %s (%s)\n", what, kvw_strerror(st), kvw_status_name(st));
    exit(1);
}

/* ------------------------------------------------ deterministic contents */

static void fill_item(uint8_t *item, uint64_t len, uint64_t seed, uint32_t region, uint64_t page)
{
    for (uint64_t w = 0; w < len / 8; w++) {
        uint64_t v = content(seed, region, page, w);
        memcpy(item + w * 8, &v, 8);
    }
}

static uint64_t check_item(const uint8_t *item, uint64_t len, uint64_t seed, uint32_t region,
                           uint64_t page)
{
    uint64_t bad = 0;
    for (uint64_t w = 0; w < len / 8; w++) {
        uint64_t v = content(seed, region, page, w), got;
        memcpy(&got, item + w * 8, 8);
        bad += got != v;
    }
    return bad * 8;
}

/* ------------------------------------------------------------ workload */

/* Pages of `count` chosen from a pool: the pool is cut into chunks of
 * `contig` pages whose order is shuffled, so runs are contiguous for up to
 * `contig` pages and random between. Slot picks a disjoint window so
 * requests in flight together never share destination pages. */
static void pick_pages(uint64_t *out, uint32_t count, uint64_t pool, uint64_t contig,
                       uint64_t seed, uint32_t slot)
{
    uint64_t base = (uint64_t)slot * ((count + contig - 1) / contig) * contig;
    shuffled_chunk_pages(out, count, contig, seed);
    for (uint32_t i = 0; i < count; i++)
        out[i] = (base + out[i]) % pool;
}

typedef struct room_plan {
    uint64_t room;
    uint64_t *src, *dst;
    uint32_t aux_src, aux_dst;
} room_plan_t;

static void plan_room(const opts_t *o, uint32_t decoder, uint32_t k, room_plan_t *rp)
{
    rp->room = (uint64_t)decoder * 1000000u + k;
    rp->src = malloc(o->pages * sizeof(uint64_t));
    rp->dst = malloc(o->pages * sizeof(uint64_t));
    uint64_t rs = mix(o->seed ^ rp->room);
    /* Source pages: any request may read any page; destination pages of
     * requests in flight together must not overlap. */
    uint64_t src_window = (o->pages + o->contig - 1) / o->contig * o->contig;
    pick_pages(rp->src, o->pages, o->pool, o->contig, rs, k % (uint32_t)(o->pool / src_window));
    pick_pages(rp->dst, o->pages, o->pool, o->dst_contig, rs + 1, k % o->inflight);
    rp->aux_src = o->aux_item ? (uint32_t)(rp->room % o->aux_items) : KVW_NO_AUX;
    rp->aux_dst = o->aux_item ? (uint32_t)(k % o->inflight % o->aux_items) : KVW_NO_AUX;
}

static void free_room(room_plan_t *rp)
{
    free(rp->src);
    free(rp->dst);
}

/* WRs the library should post for a room: one per (src,dst)-contiguous run
 * per K and V layer, plus one per aux region (no split below 8 MiB). */
static uint64_t expected_wrs(const opts_t *o, const room_plan_t *rp)
{
    uint64_t runs = 0;
    for (uint32_t i = 0; i < o->pages; i++)
        runs += i == 0 || rp->src[i] != rp->src[i - 1] + 1 || rp->dst[i] != rp->dst[i - 1] + 1;
    uint64_t n = 2ull * o->layers * runs + (o->aux_item ? 1 : 0);
    return n ? n : 1;
}

/* -------------------------------------------------------------- engine */

typedef struct memory {
    kvw_region_t *kv, *aux;
} memory_t;

static void alloc_memory(const opts_t *o, memory_t *m)
{
    m->aux = NULL;
    m->kv = calloc(2 * o->layers, sizeof(kvw_region_t));
    for (uint32_t i = 0; i < 2 * o->layers; i++) {
        uint64_t len = o->pool * o->item;
        m->kv[i] = (kvw_region_t){aligned_alloc(4096, len), len, o->item};
        if (!m->kv[i].addr)
            die("allocating KV memory", KVW_ERR_NO_MEMORY);
        if (o->prefill)
            for (uint64_t p = 0; p < o->pool; p++)
                fill_item((uint8_t *)m->kv[i].addr + p * o->item, o->item, o->seed, i, p);
        else
            memset(m->kv[i].addr, 0, len);
    }
    if (o->aux_item) {
        uint64_t len = o->aux_items * o->aux_item;
        m->aux = calloc(1, sizeof(kvw_region_t));
        m->aux[0] = (kvw_region_t){aligned_alloc(4096, len), len, o->aux_item};
        for (uint64_t p = 0; p < o->aux_items; p++)
            if (o->prefill)
                fill_item((uint8_t *)m->aux[0].addr + p * o->aux_item, o->aux_item, o->seed,
                          1u << 20, p);
    }
}

static void free_memory(const opts_t *o, memory_t *m)
{
    for (uint32_t i = 0; i < 2 * o->layers; i++)
        free(m->kv[i].addr);
    free(m->kv);
    if (m->aux)
        free(m->aux[0].addr);
    free(m->aux);
}

static kvw_engine_t *make_engine(const opts_t *o, const memory_t *m, const char *bootstrap)
{
    kvw_engine_params_t p = {
        .role = o->prefill ? KVW_ROLE_PREFILL : KVW_ROLE_DECODE,
        .engine_rank = o->rank,
        .device = o->dev,
        .local_ip = o->ip,
        .bootstrap_addr = bootstrap,
        .num_layers = o->layers,
        .kv_regions = m->kv,
        .num_aux = o->aux_item ? 1 : 0,
        .aux_regions = m->aux,
    };
    kvw_engine_t *e;
    kvw_status_t st = kvw_engine_create(&p, &e);
    if (st)
        die("creating the engine", st);
    printf("%s engine on %s (GID index %d)%s%s\n", o->prefill ? "prefill" : "decode",
           kvw_engine_device_name(e), kvw_engine_gid_index(e), o->prefill ? ", control " : "",
           o->prefill ? kvw_engine_endpoint(e) : "");
    return e;
}

static void read_bootstrap_file(const char *path, char *buf, size_t size)
{
    double deadline = now_s() + 60;
    while (now_s() < deadline) {
        FILE *f = fopen(path, "r");
        if (f) {
            bool ok = fgets(buf, (int)size, f) && strlen(buf) > 1;
            fclose(f);
            if (ok) {
                buf[strcspn(buf, "\n")] = '\0';
                return;
            }
        }
        usleep(50000);
    }
    fprintf(stderr, "kvw-xfer: no bootstrap address in %s after 60 s\n", path);
    exit(1);
}

/* ------------------------------------------------------------- prefill */

/* CPU seconds used by this process's thread named `name`. */
static double thread_cpu_s(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    double total = -1;
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char path[300], comm[64] = "", stat[1024];
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (!fgets(comm, sizeof(comm), f))
            comm[0] = '\0';
        fclose(f);
        comm[strcspn(comm, "\n")] = '\0';
        if (strcmp(comm, name) != 0)
            continue;
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", de->d_name);
        f = fopen(path, "r");
        if (f && fgets(stat, sizeof(stat), f)) {
            char *p = strrchr(stat, ')'); /* fields after comm: state is field 3 */
            unsigned long ut = 0, st = 0;
            if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut,
                            &st) == 2)
                total = (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
        }
        if (f)
            fclose(f);
    }
    if (d)
        closedir(d);
    return total;
}

static int idle_check(const opts_t *o)
{
    double c0 = thread_cpu_s("kvw-poller"), t0 = now_s();
    sleep(o->idle_check_s);
    double used = thread_cpu_s("kvw-poller") - c0, frac = used / (now_s() - t0);
    printf("idle poller: %.3f CPU-s over %.1f s = %.2f%% of a core (limit 1%%)\n", used,
           now_s() - t0, 100 * frac);
    return c0 >= 0 && frac < 0.01 ? 0 : 1;
}

static int run_prefill(const opts_t *o)
{
    memory_t m;
    alloc_memory(o, &m);
    kvw_bootstrap_t *bs = NULL;
    const char *bootstrap = o->bootstrap;
    if (o->embed_file) {
        char addr[96];
        snprintf(addr, sizeof(addr), "%s:0", o->ip);
        kvw_status_t st = kvw_bootstrap_create(addr, &bs);
        if (st)
            die("starting the embedded bootstrap service", st);
        bootstrap = kvw_bootstrap_addr(bs);
    }
    kvw_engine_t *e = make_engine(o, &m, bootstrap);
    if (o->embed_file) { /* publish only once the rank is registered */
        FILE *f = fopen(o->embed_file, "w");
        fprintf(f, "%s\n", bootstrap);
        fclose(f);
        printf("bootstrap service embedded at %s\n", bootstrap);
    }
    uint32_t total = o->requests * o->decoders;
    kvw_sender_t **senders = calloc(total, sizeof(*senders));
    uint64_t want_wrs = 0;
    for (uint32_t d = 0, i = 0; d < o->decoders; d++)
        for (uint32_t k = 0; k < o->requests; k++, i++) {
            room_plan_t rp;
            plan_room(o, d, k, &rp);
            want_wrs += expected_wrs(o, &rp);
            kvw_status_t st = kvw_sender_create(e, rp.room, &senders[i]);
            if (!st)
                st = kvw_sender_init(senders[i], o->pages, rp.aux_src);
            if (!st)
                st = kvw_sender_send(senders[i], rp.src, o->pages);
            free_room(&rp);
            if (st)
                die("starting a sender", st);
        }
    uint32_t ok = 0, failed = 0;
    while (ok + failed < total) {
        ok = failed = 0;
        for (uint32_t i = 0; i < total; i++) {
            kvw_poll_t s = kvw_sender_poll(senders[i]);
            ok += s == KVW_POLL_SUCCESS;
            failed += s == KVW_POLL_FAILED;
        }
        usleep(1000);
    }
    for (uint32_t i = 0; i < total; i++) {
        const char *why = NULL;
        kvw_status_t st = kvw_sender_failure(senders[i], &why);
        if (st)
            printf("room %u failed: %s: %s\n", i, kvw_strerror(st), why);
        kvw_sender_destroy(senders[i]);
    }
    kvw_counters_t c;
    kvw_engine_counters(e, &c);
    printf("prefill: %u ok, %u failed; %" PRIu64 " bytes, %" PRIu64 " WRs (planned %" PRIu64
           "), %" PRIu64 " chains, %" PRIu64 " completions, %" PRIu64 " errors\n",
           ok, failed, c.bytes_posted, c.wrs_posted, want_wrs, c.chains_posted, c.completions,
           c.errors);
    int rc = failed || c.wrs_posted != want_wrs;
    if (!failed && c.wrs_posted != want_wrs)
        printf("prefill: WR count differs from the plan\n");
    if (o->idle_check_s)
        rc |= idle_check(o);
    free(senders);
    kvw_engine_destroy(e);
    kvw_bootstrap_destroy(bs);
    free_memory(o, &m);
    return rc;
}

/* -------------------------------------------------------------- decode */

static uint64_t verify_room(const opts_t *o, const memory_t *m, const room_plan_t *rp)
{
    uint64_t bad = 0;
    for (uint32_t r = 0; r < 2 * o->layers; r++)
        for (uint32_t i = 0; i < o->pages; i++)
            bad += check_item((uint8_t *)m->kv[r].addr + rp->dst[i] * o->item, o->item, o->seed,
                              r, rp->src[i]);
    if (o->aux_item)
        bad += check_item((uint8_t *)m->aux[0].addr + rp->aux_dst * o->aux_item, o->aux_item,
                          o->seed, 1u << 20, rp->aux_src);
    return bad;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int run_decode(const opts_t *o)
{
    memory_t m;
    alloc_memory(o, &m);
    char bootstrap[128];
    if (o->bootstrap_file)
        read_bootstrap_file(o->bootstrap_file, bootstrap, sizeof(bootstrap));
    else
        snprintf(bootstrap, sizeof(bootstrap), "%s", o->bootstrap);
    kvw_engine_t *e = make_engine(o, &m, NULL);
    uint64_t room_bytes = (uint64_t)o->pages * o->item * 2 * o->layers + o->aux_item;
    double *lat = calloc(o->requests, sizeof(double));
    uint64_t bad_total = 0;
    uint32_t failed = 0;
    double t0 = now_s(), c0 = cpu_s();
    for (uint32_t wave = 0; wave < o->requests; wave += o->inflight) {
        uint32_t n = o->requests - wave < o->inflight ? o->requests - wave : o->inflight;
        kvw_receiver_t *rx[n];
        room_plan_t rp[n];
        double start[n];
        for (uint32_t j = 0; j < n; j++) {
            plan_room(o, o->decoder_index, wave + j, &rp[j]);
            kvw_status_t st = kvw_receiver_create(e, bootstrap, o->rank, rp[j].room, &rx[j]);
            start[j] = now_s();
            if (!st)
                st = kvw_receiver_init(rx[j], rp[j].dst, o->pages, rp[j].aux_dst);
            if (st)
                die("starting a receiver", st);
        }
        for (uint32_t done = 0; done < n;) {
            done = 0;
            for (uint32_t j = 0; j < n; j++) {
                kvw_poll_t s = kvw_receiver_poll(rx[j]);
                if ((s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED) && lat[wave + j] == 0)
                    lat[wave + j] = now_s() - start[j];
                done += s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED;
            }
            if (done < n)
                usleep(200);
        }
        for (uint32_t j = 0; j < n; j++) {
            const char *why = "";
            kvw_status_t st = kvw_receiver_failure(rx[j], &why);
            uint64_t bad = st ? 0 : verify_room(o, &m, &rp[j]);
            bad_total += bad;
            failed += st != KVW_OK;
            if (st)
                printf("room %" PRIu64 ": FAILED: %s: %s\n", rp[j].room, kvw_strerror(st), why);
            else if (!o->quiet)
                printf("room %" PRIu64 ": %u pages, %.2f MB in %.1f ms (%.1f MB/s), %s\n",
                       rp[j].room, o->pages, room_bytes / 1e6, lat[wave + j] * 1e3,
                       room_bytes / lat[wave + j] / 1e6,
                       bad ? "BYTES WRONG" : "every byte verified");
            kvw_receiver_destroy(rx[j]);
            free_room(&rp[j]);
        }
    }
    double dt = now_s() - t0, cpu = cpu_s() - c0;
    qsort(lat, o->requests, sizeof(double), cmp_double);
    double total_bytes = (double)room_bytes * (o->requests - failed);
    printf("decode: %u/%u requests ok, %.2f MB in %.3f s = %.2f MB/s, %.1f req/s, "
           "latency p50 %.1f ms p99 %.1f ms, %.1f CPU-s/GB, %" PRIu64 " bytes wrong\n",
           o->requests - failed, o->requests, total_bytes / 1e6, dt, total_bytes / dt / 1e6,
           o->requests / dt, lat[o->requests / 2] * 1e3, lat[(o->requests * 99) / 100] * 1e3,
           total_bytes ? cpu / (total_bytes / 1e9) : 0.0, bad_total);
    if (o->json)
        printf("{\"requests\":%u,\"failed\":%u,\"bytes\":%.0f,\"seconds\":%.6f,\"MBps\":%.3f,"
               "\"req_per_s\":%.3f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"cpu_s_per_GB\":%.3f,"
               "\"bad_bytes\":%" PRIu64 "}\n",
               o->requests, failed, total_bytes, dt, total_bytes / dt / 1e6, o->requests / dt,
               lat[o->requests / 2] * 1e3, lat[(o->requests * 99) / 100] * 1e3,
               total_bytes ? cpu / (total_bytes / 1e9) : 0.0, bad_total);
    free(lat);
    kvw_engine_destroy(e);
    free_memory(o, &m);
    return failed || bad_total;
}

/* ---------------------------------------------------------------- main */

static void usage(void)
{
    fprintf(stderr,
            "usage: kvw-xfer prefill|decode --ip IP [--dev NAME] [--rank R]\n"
            "  prefill: --bootstrap ADDR | --embed-bootstrap FILE   [--idle-check SECONDS]\n"
            "  decode:  --bootstrap ADDR | --bootstrap-file FILE    [--decoder-index D]\n"
            "  layout:  --layers L (32) --item BYTES (2048) --pool PAGES (256)\n"
            "           --aux-item BYTES (0: none) --aux-items N (16)\n"
            "  work:    --requests N (8) --pages N (32) --inflight N (4) --decoders D (1)\n"
            "           --contig C (4) --dst-contig C (3) --seed S (1) [--json] [--quiet]\n");
    exit(2);
}

static void parse(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.layers = 32, .item = 2048, .pool = 256, .aux_items = 16, .requests = 8,
                  .pages = 32, .inflight = 4, .decoders = 1, .contig = 4, .dst_contig = 3,
                  .seed = 1};
    if (argc < 2)
        usage();
    o->prefill = strcmp(argv[1], "prefill") == 0;
    if (!o->prefill && strcmp(argv[1], "decode") != 0)
        usage();
    static const struct option longopts[] = {
        {"dev", 1, 0, 'd'},        {"ip", 1, 0, 'i'},          {"bootstrap", 1, 0, 'b'},
        {"bootstrap-file", 1, 0, 'B'}, {"embed-bootstrap", 1, 0, 'E'}, {"rank", 1, 0, 'r'},
        {"layers", 1, 0, 'L'},     {"item", 1, 0, 'I'},        {"pool", 1, 0, 'P'},
        {"aux-item", 1, 0, 'a'},   {"aux-items", 1, 0, 'A'},   {"requests", 1, 0, 'n'},
        {"pages", 1, 0, 'p'},      {"inflight", 1, 0, 'f'},    {"decoders", 1, 0, 'D'},
        {"decoder-index", 1, 0, 'x'}, {"contig", 1, 0, 'c'},   {"dst-contig", 1, 0, 'C'},
        {"seed", 1, 0, 's'},       {"idle-check", 1, 0, 'z'},  {"json", 0, 0, 'j'},
        {"quiet", 0, 0, 'q'},      {0, 0, 0, 0}};
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        unsigned long long v = optarg ? strtoull(optarg, NULL, 0) : 0;
        switch (c) {
        case 'd': o->dev = optarg; break;
        case 'i': o->ip = optarg; break;
        case 'b': o->bootstrap = optarg; break;
        case 'B': o->bootstrap_file = optarg; break;
        case 'E': o->embed_file = optarg; break;
        case 'r': o->rank = (uint32_t)v; break;
        case 'L': o->layers = (uint32_t)v; break;
        case 'I': o->item = v; break;
        case 'P': o->pool = v; break;
        case 'a': o->aux_item = v; break;
        case 'A': o->aux_items = v; break;
        case 'n': o->requests = (uint32_t)v; break;
        case 'p': o->pages = (uint32_t)v; break;
        case 'f': o->inflight = (uint32_t)v; break;
        case 'D': o->decoders = (uint32_t)v; break;
        case 'x': o->decoder_index = (uint32_t)v; break;
        case 'c': o->contig = v; break;
        case 'C': o->dst_contig = v; break;
        case 's': o->seed = v; break;
        case 'z': o->idle_check_s = (uint32_t)v; break;
        case 'j': o->json = true; break;
        case 'q': o->quiet = true; break;
        default: usage();
        }
    }
    bool have_bs = o->bootstrap || (o->prefill ? o->embed_file != NULL : o->bootstrap_file != NULL);
    if (!o->ip || !have_bs || !o->layers || !o->item || o->item % 8 || !o->requests ||
        !o->pages || !o->inflight || !o->contig || !o->dst_contig || o->aux_item % 8 ||
        (o->aux_item && !o->aux_items))
        usage();
    if (o->inflight > o->requests)
        o->inflight = o->requests;
    /* Destination windows of requests in flight together must fit apart. */
    uint64_t dst_window = (o->pages + o->dst_contig - 1) / o->dst_contig * o->dst_contig;
    uint64_t src_window = (o->pages + o->contig - 1) / o->contig * o->contig;
    if (dst_window * o->inflight > o->pool || src_window > o->pool ||
        (o->aux_item && o->inflight > o->aux_items)) {
        fprintf(stderr, "kvw-xfer: --pool %" PRIu64 " (and --aux-items) too small for "
                "--inflight %u requests of --pages %u\n", o->pool, o->inflight, o->pages);
        exit(2);
    }
}

int main(int argc, char **argv)
{
    opts_t o;
    parse(argc, argv, &o);
    setvbuf(stdout, NULL, _IOLBF, 0);
    return o.prefill ? run_prefill(&o) : run_decode(&o);
}
