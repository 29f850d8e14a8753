/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-xfer: one side (prefill or decode) of a real KV-cache transfer through
 * the public API, with deterministic random contents so decode can verify
 * every byte. Used by `make demo`, the integration tests and the benchmark.
 *
 *   kvw-xfer prefill --ip IP [--dev NAME] (--bootstrap ADDR | --embed-bootstrap FILE) ...
 *   kvw-xfer decode  --ip IP [--dev NAME] (--bootstrap ADDR | --bootstrap-file FILE) ...
 *
 * Both sides derive each room's source and destination pages from --seed,
 * so they must be given the same layout and workload options.
 *
 * Fault mode (tests/integration/fault_scenarios.sh): any of --abort-room,
 * --bad-room, --canary-ms, --expect-failed, --may-fail, --ready-file,
 * --deadline-s or --keep-going injects a fault and/or states which rooms
 * must end Failed; each side then reports every failed room with its status,
 * reason and timing, and exits non-zero unless every room ended as
 * expected. Rooms are named by their number (decoder index * 1000000 +
 * request index), as in the "room N:" lines.
 *
 * Prefill restart (--keep-going on decode, --first-room on prefill): decode
 * keeps its engine and starts its next waves after a wave failed; a new
 * prefill process, registered under the same rank, serves those rooms.
 *
 * Soak (--cycles on decode, tests/integration/soak_scenarios.sh): each
 * cycle is a new decode engine that connects, runs one room, verifies it
 * and is destroyed; every --kill-every'th cycle is instead a forked decode
 * process killed with SIGKILL once its room's first bytes landed. Prefill
 * serves them all (--requests = cycles). --sync-file/--sync-at pause decode
 * between cycles so a script can measure the prefill process.
 *
 * Idle (--idle-s, both sides): after the transfers stay connected S
 * seconds and print each thread's CPU over that window. */
#include "kvwire.h"
#include "kvw-tools.h"

#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef enum { SIDE_DECODE = 0, SIDE_PREFILL = 1 } side_t;

/* Fault injection and expectations; all off by default. */
typedef struct faults {
    bool on;            /* any option below given: per-room verdicts */
    int64_t abort_room; /* -1: none */
    side_t abort_side;
    uint32_t abort_after_ms; /* after the room is under way (see usage) */
    const char *abort_sync;  /* decode writes it when room K's bytes land */
    const char *hold_rest;   /* prefill holds room K's second half until decode wrote it */
    int64_t bad_room;        /* -1: none */
    side_t bad_side;
    uint32_t canary_ms;                   /* decode: watch failed rooms' pages this long */
    const char *expect_failed, *may_fail; /* room lists: "all" or "A,B,C-D" */
    const char *ready_file;
    const char *hold_start; /* decode: FILE.up once its engine exists; FILE before any request */
    uint32_t deadline_s;
    bool keep_going; /* decode: start the next waves after a failure */
} faults_t;

typedef struct opts {
    bool prefill;
    const char *dev, *ip, *bootstrap, *bootstrap_file, *embed_file;
    uint32_t rank, layers, requests, pages, inflight, decoders, decoder_index;
    uint32_t first_room; /* prefill: serve request indexes from here on */
    uint64_t item, pool, aux_item, aux_items, contig, dst_contig, seed;
    uint32_t idle_check_s;
    uint32_t idle_s;                 /* --idle-s: connected idle window, both sides */
    uint32_t cycles, kill_every;     /* decode soak: engines created and destroyed */
    const char *sync_file, *sync_at; /* decode soak: pause points for the script */
    bool json, quiet;
    faults_t f;
} opts_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static double t_start; /* now_s() when the process started */

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
static void pick_pages(uint64_t *out, uint32_t count, uint64_t pool, uint64_t contig, uint64_t seed,
                       uint32_t slot)
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

/* Fault mode fills decode's pool with this byte, so it can see which
 * destination bytes a request has written, and whether any change after
 * the request reported Failed. */
#define CANARY_BYTE 0xA5
static const uint64_t canary_word = 0xA5A5A5A5A5A5A5A5ull;

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
        else /* fault mode: a canary, to see what a request wrote */
            memset(m->kv[i].addr, o->f.on ? CANARY_BYTE : 0, len);
    }
    if (o->aux_item) {
        uint64_t len = o->aux_items * o->aux_item;
        m->aux = calloc(1, sizeof(kvw_region_t));
        m->aux[0] = (kvw_region_t){aligned_alloc(4096, len), len, o->aux_item};
        for (uint64_t p = 0; p < o->aux_items; p++)
            if (o->prefill)
                fill_item((uint8_t *)m->aux[0].addr + p * o->aux_item, o->aux_item, o->seed,
                          1u << 20, p);
        if (!o->prefill && o->f.on)
            memset(m->aux[0].addr, CANARY_BYTE, len);
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
        .struct_size = sizeof(kvw_engine_params_t),
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
    static bool said; /* a soak creates hundreds of engines: say it once */
    if (o->cycles && said)
        return e;
    said = true;
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

/* ------------------------------------------------- fault mode: common */

/* Milliseconds of CLOCK_REALTIME: comparable across processes, so a script
 * can measure from a `kill -9` (date +%s%3N) or from the peer's lines. */
static long long wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A room list: "all", or comma-separated room numbers and ranges A-B. */
static bool list_valid(const char *list)
{
    if (strcmp(list, "all") == 0)
        return true;
    const char *p = list;
    for (;;) {
        char *end;
        if (*p < '0' || *p > '9')
            return false;
        strtoull(p, &end, 10);
        if (*end == '-') {
            if (end[1] < '0' || end[1] > '9')
                return false;
            strtoull(end + 1, &end, 10);
        }
        if (*end == '\0')
            return true;
        if (*end != ',')
            return false;
        p = end + 1;
    }
}

static bool in_list(const char *list, uint64_t room)
{
    if (!list)
        return false;
    if (strcmp(list, "all") == 0)
        return true;
    for (const char *p = list; *p;) {
        char *end;
        uint64_t a = strtoull(p, &end, 10), b = a;
        if (*end == '-')
            b = strtoull(end + 1, &end, 10);
        if (room >= a && room <= b)
            return true;
        p = *end == ',' ? end + 1 : end;
    }
    return false;
}

typedef enum { WANT_SUCCESS, WANT_FAILED, WANT_EITHER } want_t;

static want_t room_want(const faults_t *f, uint64_t room)
{
    if (in_list(f->expect_failed, room))
        return WANT_FAILED;
    return in_list(f->may_fail, room) ? WANT_EITHER : WANT_SUCCESS;
}

/* --bad-room: the page index handed over in place of a valid one. */
static uint64_t out_of_range_page(const opts_t *o)
{
    return o->pool + 7;
}

/* Is a fault injected into this room (on either side)? */
static bool injected(const faults_t *f, uint64_t room)
{
    return (int64_t)room == f->abort_room || (int64_t)room == f->bad_room;
}

/* One request as this process sees it. Times are now_s() values, 0 when
 * the event has not happened. */
typedef struct room_state {
    room_plan_t plan;
    uint64_t planned_wrs; /* prefill: expected_wrs() */
    double t_handed;      /* decode: receiver created (init follows); prefill: send() */
    double t_under_way;   /* prefill: seen Transferring; decode: first bytes seen landed */
    double t_fault;       /* abort or bad input, by this process */
    double t_end;         /* seen Success or Failed */
    double t_next_look;   /* next scan for landed bytes / look for --abort-sync */
    double t_synced;      /* prefill: --abort-sync file seen */
    long long wall_end;
    const char *fault_what; /* "abort", "bad input" */
    kvw_poll_t state;
    bool started, ended;
    size_t held; /* prefill, --hold-rest: pages of the room not handed over yet */
    /* decode, --canary-ms: the room's destination bytes as they were at Failed */
    uint8_t *snap;
    double watch_until, next_check;
    uint64_t written_at_failed, changed_items;
    double changed_after_ms;
} room_state_t;

static void note_state(room_state_t *rs, kvw_poll_t s)
{
    rs->state = s;
    if (!rs->ended && (s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED)) {
        rs->ended = true;
        rs->t_end = now_s();
        rs->wall_end = wall_ms();
    }
}

/* "room 3: abort on decode side: KVW_OK (...) [at 1712345678901 ms]" */
static void note_fault(room_state_t *rs, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void note_fault(room_state_t *rs, const char *what, const char *fmt, ...)
{
    rs->t_fault = now_s();
    rs->fault_what = what;
    long long wall = wall_ms();
    va_list ap;
    va_start(ap, fmt);
    printf("room %" PRIu64 ": ", rs->plan.room);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" [at %lld ms]\n", wall);
}

/* "room 3: FAILED after 41 ms: KVW_ERR_ABORTED: reason [since abort, at W ms]":
 * measured from this process's fault on the room if any, else from its
 * hand-over (decode: init, prefill: send); W is the wall clock at Failed. */
static void print_failed(const room_state_t *rs, kvw_status_t st, const char *why)
{
    double from = rs->t_fault ? rs->t_fault : rs->t_handed;
    printf("room %" PRIu64 ": FAILED after %.0f ms: %s: %s [since %s, at %lld ms]\n", rs->plan.room,
           (rs->t_end - from) * 1e3, kvw_status_name(st), why ? why : "",
           rs->t_fault ? rs->fault_what : "hand-over", rs->wall_end);
}

/* Compare a room's end with --expect-failed / --may-fail; say what is wrong. */
static bool as_expected(const faults_t *f, const room_state_t *rs)
{
    want_t w = room_want(f, rs->plan.room);
    const char *got = !rs->started                    ? "was never started"
                      : !rs->ended                    ? "did not end"
                      : rs->state == KVW_POLL_SUCCESS ? "ended Success"
                                                      : "ended Failed";
    bool ok = w == WANT_EITHER   ? rs->ended || !rs->started
              : w == WANT_FAILED ? rs->ended && rs->state == KVW_POLL_FAILED
                                 : rs->ended && rs->state == KVW_POLL_SUCCESS;
    if (!ok)
        printf("room %" PRIu64 ": NOT AS EXPECTED: should end %s, %s\n", rs->plan.room,
               w == WANT_FAILED ? "Failed" : "Success", got);
    return ok;
}

/* Write a marker file ("ready WALLCLOCK_MS") for the script or the peer
 * process; written aside and renamed, so it appears whole. */
static void write_marker(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    bool ok = f && fprintf(f, "ready %lld\n", wall_ms()) > 0;
    ok = f && fclose(f) == 0 && ok && rename(tmp, path) == 0;
    if (ok)
        printf("marker %s written\n", path);
    else
        fprintf(stderr, "kvw-xfer: cannot write %s: %s\n", path, strerror(errno));
}

/* --deadline-s: report the rooms still open and leave at once, without
 * destroying anything (that could wait on the very thing that hangs). */
static void check_deadline(const opts_t *o, double t0, const room_state_t *rs, uint32_t n)
{
    if (!o->f.deadline_s || now_s() - t0 < o->f.deadline_s)
        return;
    for (uint32_t i = 0; i < n; i++)
        if (rs[i].started && !rs[i].ended)
            printf("room %" PRIu64 ": NOT ENDED at the deadline (%s)\n", rs[i].plan.room,
                   kvw_poll_name(rs[i].state));
    printf("%s: deadline of %u s passed, giving up\n", o->prefill ? "prefill" : "decode",
           o->f.deadline_s);
    fflush(stdout);
    _exit(3);
}

/* Backstop for a hang outside the poll loops (e.g. in teardown). */
static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "kvw-xfer: deadline passed (hang outside the poll loop)\n";
    ssize_t n = write(STDOUT_FILENO, msg, sizeof(msg) - 1);
    (void)n; /* nothing better to do: leaving anyway */
    _exit(3);
}

/* ------------------------------------------------------------- prefill */

/* ------------------------------------------------ idle window (--idle-s) */

enum { MAX_THREADS = 64, IDLE_LINGER_S = 2 };
/* Wake-ups per second a connected idle process may take, all its threads
 * together: the poller's 1 s channel timeout, the control thread's idle
 * heartbeats (every idle_heartbeat_ms) and ZeroMQ's I/O thread come to a
 * few; the bound leaves ample headroom and, unlike a CPU share, does not
 * move with the machine's load. */
#define IDLE_LIMIT_WAKES 25.0

typedef struct thread_ticks {
    int tid;
    char comm[32];
    unsigned long long ticks; /* utime + stime, clock ticks */
    unsigned long long waits; /* context switches: about one per wake-up */
} thread_ticks_t;

/* utime + stime from a /proc stat line; the comm field may hold spaces,
 * so parse after its closing parenthesis. */
static unsigned long long stat_ticks(const char *path)
{
    char line[1024];
    unsigned long long ut = 0, st = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char *p = fgets(line, sizeof(line), f) ? strrchr(line, ')') : NULL;
    fclose(f);
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return 0;
    return ut + st;
}

/* Voluntary + involuntary context switches of a thread (its status file). */
static unsigned long long thread_switches(const char *tid)
{
    char path[300], line[256];
    unsigned long long n = 0, v;
    snprintf(path, sizeof(path), "/proc/self/task/%s/status", tid);
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof(line), f))
        if ((sscanf(line, "voluntary_ctxt_switches: %llu", &v) == 1 ||
             sscanf(line, "nonvoluntary_ctxt_switches: %llu", &v) == 1))
            n += v;
    if (f)
        fclose(f);
    return n;
}

/* Every thread of this process with its name and CPU ticks; how many. */
static int snapshot_threads(thread_ticks_t *t, int max)
{
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    int n = 0;
    while (d && n < max && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char path[300];
        t[n] = (thread_ticks_t){.tid = atoi(de->d_name)};
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
        FILE *f = fopen(path, "r");
        if (f && !fgets(t[n].comm, sizeof(t[n].comm), f))
            t[n].comm[0] = '\0';
        if (f)
            fclose(f);
        t[n].comm[strcspn(t[n].comm, "\n")] = '\0';
        snprintf(path, sizeof(path), "/proc/self/task/%s/stat", de->d_name);
        t[n].ticks = stat_ticks(path);
        t[n].waits = thread_switches(de->d_name);
        n++;
    }
    if (d)
        closedir(d);
    return n;
}

/* CPU ticks and context switches of this process's threads named `name`
 * (an engine's poller: one per engine); false when there is none. */
static bool named_usage(const char *name, unsigned long long *ticks, unsigned long long *waits)
{
    thread_ticks_t t[MAX_THREADS];
    int n = snapshot_threads(t, MAX_THREADS);
    bool found = false;
    *ticks = *waits = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(t[i].comm, name) != 0)
            continue;
        found = true;
        *ticks += t[i].ticks;
        *waits += t[i].waits;
    }
    return found;
}

enum { IDLE_POLLER_WAKES = 5 };

/* An idle poller sleeps on the completion channel with a 1 s timeout, so it
 * wakes about once a second. Asserted on the count (a loaded machine
 * cannot break it), with 5x headroom; its CPU share is only printed (make
 * bench measures idle CPU). */
static int idle_check(const opts_t *o)
{
    unsigned long long c0, w0, c1, w1;
    bool found = named_usage("kvw-poller", &c0, &w0);
    double t0 = now_s();
    sleep(o->idle_check_s);
    double dt = now_s() - t0;
    found = named_usage("kvw-poller", &c1, &w1) && found;
    double used = (double)(c1 - c0) / (double)sysconf(_SC_CLK_TCK);
    double wakes = (double)(w1 - w0) / dt;
    printf("idle poller: %.1f wake-ups/s over %.1f s (limit %d); %.3f CPU-s = %.2f%% of a core "
           "(not asserted)\n",
           wakes, dt, IDLE_POLLER_WAKES, used, 100 * used / dt);
    return found && wakes <= IDLE_POLLER_WAKES ? 0 : 1;
}

/* One sleep, not a polling loop: in the slow test-bed guest even ten
 * wake-ups a second would show in the idle figures. */
static void sleep_s(double s)
{
    for (double left = s, until = now_s() + s; left > 0; left = until - now_s()) {
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* Stay connected S seconds doing nothing, then print every thread's CPU
 * (from /proc, % of one core) and wake-ups, and the process's; fails when
 * the process woke more than IDLE_LIMIT_WAKES times a second. CPU is
 * printed, not asserted: make bench reports it as a measurement.
 * Afterwards linger a little before the caller tears down, so that the
 * peer's own window (started within a moment of ours) ends before our
 * disconnect could cost it anything. */
static int idle_window(const opts_t *o)
{
    const char *side = o->prefill ? "prefill" : "decode";
    thread_ticks_t a[MAX_THREADS], b[MAX_THREADS];
    double hz = (double)sysconf(_SC_CLK_TCK);
    int na = snapshot_threads(a, MAX_THREADS);
    unsigned long long pa = stat_ticks("/proc/self/stat");
    double t0 = now_s();
    printf("%s: idle for %u s with the peer connected\n", side, o->idle_s);
    sleep_s(o->idle_s);
    int nb = snapshot_threads(b, MAX_THREADS);
    unsigned long long pb = stat_ticks("/proc/self/stat");
    double dt = now_s() - t0;
    for (int i = 0; i < nb; i++) {
        thread_ticks_t before = {0};
        for (int j = 0; j < na; j++)
            before = a[j].tid == b[i].tid ? a[j] : before;
        double used = (double)(b[i].ticks - before.ticks) / hz;
        printf("%s idle: thread %-14s (tid %5d): %6.2f CPU-s = %6.3f%% of a core, "
               "%5.1f wake-ups/s\n",
               side, b[i].comm, b[i].tid, used, 100 * used / dt,
               (double)(b[i].waits - before.waits) / dt);
    }
    unsigned long long waits = 0;
    for (int i = 0; i < nb; i++) {
        unsigned long long before = 0;
        for (int j = 0; j < na; j++)
            before = a[j].tid == b[i].tid ? a[j].waits : before;
        waits += b[i].waits - before;
    }
    double total = (double)(pb - pa) / hz, pct = 100 * total / dt, wakes = (double)waits / dt;
    bool ok = wakes <= IDLE_LIMIT_WAKES;
    printf("%s idle: process total %.2f CPU-s over %.1f s = %.3f%% of a core, %.1f wake-ups/s "
           "(limit %.0f): %s\n",
           side, total, dt, pct, wakes, IDLE_LIMIT_WAKES, ok ? "ok" : "TOO MANY");
    sleep_s(IDLE_LINGER_S);
    return !ok;
}

/* Create, init and send one room. --bad-room on prefill hands send() an
 * out-of-range source page, which it must refuse. */
static kvw_sender_t *start_sender(const opts_t *o, kvw_engine_t *e, room_state_t *rs)
{
    const room_plan_t *rp = &rs->plan;
    kvw_sender_t *s;
    kvw_status_t st = kvw_sender_create(e, rp->room, &s);
    if (!st)
        st = kvw_sender_init(s, o->pages, rp->aux_src);
    if (st)
        die("starting a sender", st);
    bool bad = o->f.bad_side == SIDE_PREFILL && (int64_t)rp->room == o->f.bad_room;
    uint64_t *src = rp->src, bad_src[o->pages];
    if (bad) {
        memcpy(bad_src, rp->src, sizeof(bad_src));
        bad_src[o->pages / 2] = out_of_range_page(o);
        src = bad_src;
    }
    rs->t_handed = now_s();
    rs->started = true;
    /* --hold-rest: the first half now, the rest once the room was aborted
     * (by decode, which writes the file, or by prefill itself), so the
     * abort always meets a transfer that has not finished. */
    bool hold = o->f.hold_rest && (int64_t)rp->room == o->f.abort_room && !bad;
    rs->held = hold ? o->pages - o->pages / 2 : 0;
    st = kvw_sender_send(s, src, o->pages - rs->held);
    if (bad)
        note_fault(rs, "bad input",
                   "out-of-range source page %" PRIu64 " (pool %" PRIu64
                   ") given to kvw_sender_send: %s",
                   out_of_range_page(o), o->pool, kvw_status_name(st));
    else if (st)
        die("starting a sender", st);
    return s;
}

/* When prefill's abort clock for a room starts: once it turned Transferring
 * (decode's request arrived; the library may still serve other rooms first),
 * or with --abort-sync once decode wrote that its first bytes landed. */
static double prefill_abort_clock(const opts_t *o, room_state_t *rs)
{
    double now = now_s();
    if (!o->f.abort_sync)
        return rs->t_under_way;
    if (!rs->t_synced && now >= rs->t_next_look) {
        rs->t_next_look = now + 0.005;
        if (access(o->f.abort_sync, F_OK) == 0)
            rs->t_synced = now;
    }
    return rs->t_synced;
}

/* --abort-room on prefill: abort --abort-after-ms after the clock above. */
static void prefill_abort_hook(const opts_t *o, kvw_sender_t *s, room_state_t *rs)
{
    if (o->f.abort_side != SIDE_PREFILL || (int64_t)rs->plan.room != o->f.abort_room ||
        rs->t_fault || rs->ended)
        return;
    double t0 = prefill_abort_clock(o, rs);
    if (!t0 || now_s() - t0 < o->f.abort_after_ms / 1e3)
        return;
    double waited_ms = (now_s() - t0) * 1e3;
    kvw_status_t st = kvw_sender_abort(s);
    note_fault(rs, "abort", "abort on prefill side, %.0f ms after %s: %s", waited_ms,
               o->f.abort_sync ? "decode saw its first bytes land" : "it turned Transferring",
               kvw_status_name(st));
}

/* --hold-rest: hand over the held pages once the room was aborted: decode
 * wrote the file, or (--abort-side prefill) this process aborted it. The
 * request has Failed by then, or does so at once: the call's status is
 * only reported. */
static void release_held(const opts_t *o, kvw_sender_t *s, room_state_t *rs)
{
    double now = now_s();
    if (!rs->held || now < rs->t_next_look)
        return;
    bool aborted =
        o->f.abort_side == SIDE_PREFILL ? rs->t_fault != 0 : access(o->f.hold_rest, F_OK) == 0;
    if (!aborted)
        return;
    rs->t_next_look = now + 0.005;
    size_t first = o->pages - rs->held;
    kvw_status_t st = kvw_sender_send(s, rs->plan.src + first, rs->held);
    rs->held = 0;
    printf("room %" PRIu64 ": the held %zu page(s) handed over after the abort: %s\n",
           rs->plan.room, o->pages - first, kvw_status_name(st));
}

/* Poll every sender until all ended, running the fault-mode hooks. */
static void wait_senders(const opts_t *o, kvw_engine_t *e, kvw_sender_t **s, room_state_t *rs,
                         uint32_t total)
{
    bool ready = !o->f.ready_file;
    for (uint32_t ended = 0; ended < total;) {
        ended = 0;
        bool transferring = false;
        for (uint32_t i = 0; i < total; i++) {
            note_state(&rs[i], kvw_sender_poll(s[i]));
            if (rs[i].state == KVW_POLL_TRANSFERRING && !rs[i].t_under_way)
                rs[i].t_under_way = now_s();
            transferring |= rs[i].state == KVW_POLL_TRANSFERRING;
            prefill_abort_hook(o, s[i], &rs[i]);
            release_held(o, s[i], &rs[i]);
            ended += rs[i].ended;
        }
        if (!ready && transferring) { /* ready: writes are on the wire */
            kvw_counters_t c;
            kvw_engine_counters(e, &c);
            if (c.wrs_posted) {
                write_marker(o->f.ready_file);
                ready = true;
            }
        }
        check_deadline(o, t_start, rs, total);
        usleep(1000);
    }
}

/* Fault mode: WRs posted must lie between the plan of the rooms that
 * succeeded (each posts all of its plan) and the plan of all rooms. */
static bool prefill_wrs_ok(kvw_engine_t *e, const room_state_t *rs, uint32_t total)
{
    uint64_t want_ok = 0, want_all = 0;
    for (uint32_t i = 0; i < total; i++) {
        want_all += rs[i].planned_wrs;
        want_ok += rs[i].state == KVW_POLL_SUCCESS ? rs[i].planned_wrs : 0;
    }
    kvw_counters_t c;
    kvw_engine_counters(e, &c);
    for (double until = now_s() + 1; /* let flushed WRs of failed rooms retire */
         c.wrs_posted != c.wrs_completed + c.wrs_flushed && now_s() < until;) {
        usleep(10000);
        kvw_engine_counters(e, &c);
    }
    bool ok = c.wrs_posted >= want_ok && c.wrs_posted <= want_all;
    printf("prefill: %" PRIu64 " WRs posted (%s: plan %" PRIu64 " for the rooms that succeeded, "
           "%" PRIu64 " for all); %" PRIu64 " completed + %" PRIu64 " flushed%s\n",
           c.wrs_posted, ok ? "within the plan" : "OUTSIDE THE PLAN", want_ok, want_all,
           c.wrs_completed, c.wrs_flushed,
           c.wrs_posted == c.wrs_completed + c.wrs_flushed ? "" : " (does not add up)");
    return ok;
}

/* The most lanes a connection of e may have: qps_per_peer on each rail. */
static uint32_t engine_lanes(const kvw_engine_t *e)
{
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    uint32_t n = cfg.qps_per_peer * kvw_engine_rails(e, NULL, 0);
    return n > 16 ? 16 : n ? n : 1;
}

/* Several rails (KVW_DEVICES): the WRs and bytes each carried, and how
 * their lanes fared (failed, rejoined, the time to recover). Returns the
 * lanes that failed. */
static uint32_t print_rails(const kvw_engine_t *e)
{
    kvw_rail_t rails[8];
    kvw_rail_health_t h[8];
    uint32_t n = kvw_engine_rails(e, rails, 8), failed = 0;
    kvw_engine_rail_health(e, h, 8);
    for (uint32_t r = 0; n > 1 && r < n && r < 8; r++) {
        printf("prefill: rail %u %s (GID %d, %u Mb/s): %" PRIu64 " WRs, %" PRIu64 " bytes\n", r,
               rails[r].device, rails[r].gid_index, rails[r].link_mbps, rails[r].wrs_posted,
               rails[r].bytes_posted);
        printf("prefill: rail %u %s: lanes failed %u, rejoined %u, out now %u; %u probes; "
               "recovery last %.1f ms, longest %.1f ms\n",
               r, rails[r].device, h[r].lanes_failed, h[r].lanes_rejoined, h[r].lanes_out,
               h[r].probes, h[r].recovery_us_last / 1e3, h[r].recovery_us_max / 1e3);
        failed += h[r].lanes_failed;
    }
    return failed;
}

/* Per-room lines, the summary line and the exit status. */
static int report_prefill(const opts_t *o, kvw_engine_t *e, kvw_sender_t **s, room_state_t *rs,
                          uint32_t total)
{
    uint32_t ok = 0, failed = 0, unexpected = 0;
    uint64_t want_wrs = 0;
    for (uint32_t i = 0; i < total; i++) {
        const char *why = NULL;
        kvw_status_t st = kvw_sender_failure(s[i], &why);
        ok += rs[i].state == KVW_POLL_SUCCESS;
        failed += rs[i].state == KVW_POLL_FAILED;
        want_wrs += rs[i].planned_wrs;
        if (st && o->f.on)
            print_failed(&rs[i], st, why);
        else if (st)
            printf("room %u failed: %s: %s\n", i, kvw_strerror(st), why);
        if (o->f.on)
            unexpected += !as_expected(&o->f, &rs[i]);
        kvw_sender_destroy(s[i]);
    }
    kvw_counters_t c;
    kvw_engine_counters(e, &c);
    printf("prefill: %u ok, %u failed; %" PRIu64 " bytes, %" PRIu64 " WRs (planned %" PRIu64
           "), %" PRIu64 " chains, %" PRIu64 " completions, %" PRIu64 " errors\n",
           ok, failed, c.bytes_posted, c.wrs_posted, want_wrs, c.chains_posted, c.completions,
           c.errors);
    uint32_t lanes_failed = print_rails(e);
    if (o->f.on) {
        bool wrs_ok = prefill_wrs_ok(e, rs, total);
        printf("prefill: verdict: %s\n",
               !unexpected && wrs_ok ? "every room ended as expected" : "NOT AS EXPECTED");
        return unexpected || !wrs_ok;
    }
    /* Several lanes (QPs per peer, rails): a request that used k of them
     * ends with a zero-length immediate on each of the other k - 1. */
    uint64_t extra = (uint64_t)total * (engine_lanes(e) - 1);
    /* A lane that failed: requests on it start over (their writes again),
     * and its rejoin sends one probe write: no upper bound then. */
    bool wrs_ok = c.wrs_posted >= want_wrs && (lanes_failed || c.wrs_posted <= want_wrs + extra);
    if (!failed && !wrs_ok)
        printf("prefill: WR count differs from the plan (%" PRIu64 " to %" PRIu64 ")\n", want_wrs,
               want_wrs + extra);
    return failed || !wrs_ok;
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
        kvw_bootstrap_params_t bp;
        kvw_bootstrap_params_init(&bp);
        bp.bind_addr = addr;
        kvw_status_t st = kvw_bootstrap_create(&bp, &bs);
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
    room_state_t *rs = calloc(total, sizeof(*rs));
    for (uint32_t d = 0, i = 0; d < o->decoders; d++)
        for (uint32_t k = 0; k < o->requests; k++, i++) {
            plan_room(o, d, o->first_room + k, &rs[i].plan);
            rs[i].planned_wrs = expected_wrs(o, &rs[i].plan);
            senders[i] = start_sender(o, e, &rs[i]);
        }
    wait_senders(o, e, senders, rs, total);
    int rc = report_prefill(o, e, senders, rs, total);
    if (o->idle_check_s)
        rc |= idle_check(o);
    if (o->idle_s)
        rc |= idle_window(o);
    for (uint32_t i = 0; i < total; i++)
        free_room(&rs[i].plan);
    free(rs);
    free(senders);
    kvw_engine_destroy(e);
    kvw_bootstrap_destroy(bs);
    free_memory(o, &m);
    return rc;
}

/* ------------------------------------------------ decode: canary watch */

/* Destination items of a room: 2L per page (K layers, V layers), then aux. */
static uint64_t room_items(const opts_t *o)
{
    return 2ull * o->layers * o->pages + (o->aux_item ? 1 : 0);
}

static uint8_t *room_item(const opts_t *o, const memory_t *m, const room_plan_t *rp, uint64_t i,
                          uint64_t *len_p)
{
    if (i >= 2ull * o->layers * o->pages) {
        *len_p = o->aux_item;
        return (uint8_t *)m->aux[0].addr + rp->aux_dst * o->aux_item;
    }
    *len_p = o->item;
    return (uint8_t *)m->kv[i / o->pages].addr + rp->dst[i % o->pages] * o->item;
}

/* Items whose first word is no longer the canary, counting up to `enough`. */
static uint64_t items_begun(const opts_t *o, const memory_t *m, const room_plan_t *rp,
                            uint64_t enough)
{
    uint64_t n = 0, len, w;
    for (uint64_t i = 0; i < room_items(o) && n < enough; i++) {
        memcpy(&w, room_item(o, m, rp, i, &len), 8);
        n += w != canary_word;
    }
    return n;
}

static bool item_written(const uint8_t *p, uint64_t len)
{
    for (uint64_t off = 0; off < len; off += 8) {
        uint64_t w;
        memcpy(&w, p + off, 8);
        if (w != canary_word)
            return true;
    }
    return false;
}

/* At Failed: copy the room's destination bytes, to watch for --canary-ms. */
static void canary_snapshot(const opts_t *o, const memory_t *m, room_state_t *rs)
{
    uint64_t off = 0, len = 0;
    rs->snap = malloc(2ull * o->layers * o->pages * o->item + o->aux_item);
    if (!rs->snap)
        die("allocating a canary snapshot", KVW_ERR_NO_MEMORY);
    for (uint64_t i = 0; i < room_items(o); i++, off += len) {
        const uint8_t *p = room_item(o, m, &rs->plan, i, &len);
        memcpy(rs->snap + off, p, len);
        rs->written_at_failed += item_written(p, len);
    }
    rs->watch_until = rs->t_end + o->f.canary_ms / 1e3;
    rs->next_check = now_s() + 0.05;
}

/* Every ~50 ms until watch_until: has any byte changed since the snapshot? */
static void canary_check(const opts_t *o, const memory_t *m, room_state_t *rs)
{
    double now = now_s();
    if (!rs->snap || now < rs->next_check)
        return;
    uint64_t off = 0, len;
    for (uint64_t i = 0; i < room_items(o); i++, off += len) {
        const uint8_t *p = room_item(o, m, &rs->plan, i, &len);
        rs->changed_items += memcmp(p, rs->snap + off, len) != 0;
    }
    if (rs->changed_items)
        rs->changed_after_ms = (now - rs->t_end) * 1e3;
    if (rs->changed_items || now >= rs->watch_until) {
        free(rs->snap);
        rs->snap = NULL;
    }
    rs->next_check = now + 0.05;
}

static bool report_canary(const opts_t *o, const room_state_t *rs)
{
    printf("room %" PRIu64 ": canary: %" PRIu64 " of %" PRIu64 " items written at Failed; ",
           rs->plan.room, rs->written_at_failed, room_items(o));
    if (rs->changed_items)
        printf("BYTES LANDED AFTER FAILED: %" PRIu64 " items changed, seen %.0f ms after Failed\n",
               rs->changed_items, rs->changed_after_ms);
    else
        printf("nothing changed in the %u ms after Failed\n", o->f.canary_ms);
    return rs->changed_items == 0;
}

/* ------------------------------------------------------- decode: hooks */

typedef struct decode_run {
    const opts_t *o;
    const memory_t *m;
    kvw_engine_t *e;
    char bootstrap[128];
    double *lat;
    uint64_t bad_total;
    uint32_t failed, not_started, unexpected, canary_bad;
    bool ready, synced, stop;  /* markers written; no new waves */
    bool kept_going;           /* --keep-going: said so after a failure */
    uint32_t kills, kills_mid; /* --cycles: processes killed, of them after bytes landed */
} decode_run_t;

/* Has the room's data started to land (rate-limited scan of first words)? */
static bool room_under_way(const opts_t *o, const memory_t *m, room_state_t *rs)
{
    double now = now_s();
    if (rs->t_under_way || rs->state != KVW_POLL_TRANSFERRING || now < rs->t_next_look)
        return rs->t_under_way != 0;
    rs->t_next_look = now + 0.005;
    if (items_begun(o, m, &rs->plan, 1))
        rs->t_under_way = now;
    return rs->t_under_way != 0;
}

/* --abort-room on decode: abort once the room's first bytes have landed and
 * --abort-after-ms passed, if it has not ended. */
static void decode_abort_hook(const opts_t *o, const memory_t *m, kvw_receiver_t *rx,
                              room_state_t *rs)
{
    if (o->f.abort_side != SIDE_DECODE || (int64_t)rs->plan.room != o->f.abort_room ||
        rs->t_fault || rs->ended || !room_under_way(o, m, rs) ||
        now_s() - rs->t_under_way < o->f.abort_after_ms / 1e3)
        return;
    double under_way_ms = (now_s() - rs->t_under_way) * 1e3;
    uint64_t begun = items_begun(o, m, &rs->plan, UINT64_MAX);
    kvw_status_t st = kvw_receiver_abort(rx);
    if (o->f.hold_rest)
        write_marker(o->f.hold_rest); /* prefill may hand over the rest now */
    note_fault(rs, "abort",
               "abort on decode side, %.0f ms after its first bytes landed (%" PRIu64 " of %" PRIu64
               " items begun): %s",
               under_way_ms, begun, room_items(o), kvw_status_name(st));
}

/* --ready-file on decode: written once bytes of a request have landed;
 * --abort-sync: once bytes of the --abort-room have. */
static void decode_marker_hooks(decode_run_t *d, room_state_t *rs, uint32_t n)
{
    const opts_t *o = d->o;
    for (uint32_t j = 0; j < n && (!d->ready || !d->synced); j++) {
        bool abort_room = (int64_t)rs[j].plan.room == o->f.abort_room;
        if ((d->ready && !abort_room) || !room_under_way(o, d->m, &rs[j]))
            continue;
        if (!d->ready) {
            write_marker(o->f.ready_file);
            d->ready = true;
        }
        if (!d->synced && abort_room) {
            write_marker(o->f.abort_sync);
            d->synced = true;
        }
    }
}

/* ------------------------------------------------------ decode: waves */

static uint64_t verify_room(const opts_t *o, const memory_t *m, const room_plan_t *rp)
{
    uint64_t bad = 0;
    for (uint32_t r = 0; r < 2 * o->layers; r++)
        for (uint32_t i = 0; i < o->pages; i++)
            bad += check_item((uint8_t *)m->kv[r].addr + rp->dst[i] * o->item, o->item, o->seed, r,
                              rp->src[i]);
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

/* Create and init one receiver. --bad-room on decode hands init() an
 * out-of-range destination page, which it must refuse. */
static kvw_receiver_t *start_receiver(decode_run_t *d, room_state_t *rs)
{
    const opts_t *o = d->o;
    const room_plan_t *rp = &rs->plan;
    kvw_receiver_t *rx;
    kvw_status_t st = kvw_receiver_create(d->e, d->bootstrap, o->rank, rp->room, &rx);
    rs->t_handed = now_s();
    rs->started = true;
    bool bad = o->f.bad_side == SIDE_DECODE && (int64_t)rp->room == o->f.bad_room;
    if (!st && bad) {
        uint64_t dst[o->pages];
        memcpy(dst, rp->dst, sizeof(dst));
        dst[o->pages / 2] = out_of_range_page(o);
        st = kvw_receiver_init(rx, dst, o->pages, rp->aux_dst);
        note_fault(rs, "bad input",
                   "out-of-range destination page %" PRIu64 " (pool %" PRIu64
                   ") given to kvw_receiver_init: %s",
                   out_of_range_page(o), o->pool, kvw_status_name(st));
        return rx;
    }
    if (!st)
        st = kvw_receiver_init(rx, rp->dst, o->pages, rp->aux_dst);
    if (st)
        die("starting a receiver", st);
    return rx;
}

/* Poll a wave until every room ended and every canary watch is over. */
static void wait_receivers(decode_run_t *d, kvw_receiver_t **rx, room_state_t *rs, uint32_t n)
{
    const opts_t *o = d->o;
    for (uint32_t done = 0; done < n;) {
        done = 0;
        for (uint32_t j = 0; j < n; j++) {
            note_state(&rs[j], kvw_receiver_poll(rx[j]));
            if (o->f.canary_ms && rs[j].state == KVW_POLL_FAILED && !rs[j].watch_until)
                canary_snapshot(o, d->m, &rs[j]);
            canary_check(o, d->m, &rs[j]);
            decode_abort_hook(o, d->m, rx[j], &rs[j]);
            done += rs[j].ended && !rs[j].snap;
        }
        decode_marker_hooks(d, rs, n);
        check_deadline(o, t_start, rs, n);
        if (done < n)
            usleep(200);
    }
}

static void report_receiver(decode_run_t *d, kvw_receiver_t *rx, room_state_t *rs, double lat)
{
    const opts_t *o = d->o;
    uint64_t room_bytes = (uint64_t)o->pages * o->item * 2 * o->layers + o->aux_item;
    const char *why = "";
    kvw_status_t st = kvw_receiver_failure(rx, &why);
    uint64_t bad = st ? 0 : verify_room(o, d->m, &rs->plan);
    d->bad_total += bad;
    d->failed += st != KVW_OK;
    if (st && o->f.on) {
        print_failed(rs, st, why);
        if (o->f.canary_ms)
            d->canary_bad += !report_canary(o, rs);
    } else if (st) {
        printf("room %" PRIu64 ": FAILED: %s: %s\n", rs->plan.room, kvw_strerror(st), why);
    } else if (!o->quiet) {
        printf("room %" PRIu64 ": %u pages, %.2f MB in %.1f ms (%.1f MB/s), %s", rs->plan.room,
               o->pages, room_bytes / 1e6, lat * 1e3, room_bytes / lat / 1e6,
               bad ? "BYTES WRONG" : "every byte verified");
        if (o->f.on) /* when: to compare with a restart, a stop, a kill */
            printf(" [at %lld ms]", rs->wall_end);
        printf("\n");
    }
    if (o->f.on) {
        d->unexpected += !as_expected(&o->f, rs);
        if (st && !injected(&o->f, rs->plan.room) && o->f.keep_going && !d->kept_going) {
            d->kept_going = true;
            printf("decode: room %" PRIu64 " failed without an injected fault: the next waves "
                   "are started all the same (--keep-going) [at %lld ms]\n",
                   rs->plan.room, wall_ms());
        } else if (st && !injected(&o->f, rs->plan.room) && !o->f.keep_going && !d->stop) {
            d->stop = true; /* like a scheduler that stops routing to a dead prefill */
            printf("decode: room %" PRIu64 " failed without an injected fault: "
                   "no further requests are started\n",
                   rs->plan.room);
        }
    }
}

/* One wave of up to --inflight requests at once. */
static void run_wave(decode_run_t *d, uint32_t first, uint32_t n)
{
    kvw_receiver_t *rx[n];
    room_state_t *rs = calloc(n, sizeof(*rs));
    for (uint32_t j = 0; j < n; j++) {
        plan_room(d->o, d->o->decoder_index, first + j, &rs[j].plan);
        rx[j] = start_receiver(d, &rs[j]);
    }
    wait_receivers(d, rx, rs, n);
    for (uint32_t j = 0; j < n; j++) {
        d->lat[first + j] = rs[j].t_end - rs[j].t_handed;
        report_receiver(d, rx[j], &rs[j], d->lat[first + j]);
        kvw_receiver_destroy(rx[j]);
        free_room(&rs[j].plan);
    }
    free(rs);
}

/* Fault mode: rooms never started (after an unexpected failure) are judged
 * too; --may-fail covers them. */
static void skip_wave(decode_run_t *d, uint32_t first, uint32_t n)
{
    for (uint32_t j = 0; j < n; j++) {
        room_state_t rs = {.plan.room = (uint64_t)d->o->decoder_index * 1000000u + first + j};
        d->not_started++;
        d->unexpected += !as_expected(&d->o->f, &rs);
    }
}

static int decode_summary(const decode_run_t *d, double dt, double cpu)
{
    const opts_t *o = d->o;
    uint64_t room_bytes = (uint64_t)o->pages * o->item * 2 * o->layers + o->aux_item;
    uint32_t ok = o->requests - d->failed - d->not_started;
    double *lat = d->lat;
    qsort(lat, o->requests, sizeof(double), cmp_double);
    double total_bytes = (double)room_bytes * ok;
    printf("decode: %u/%u requests ok, %.2f MB in %.3f s = %.2f MB/s, %.1f req/s, "
           "latency p50 %.1f ms p99 %.1f ms, %.1f CPU-s/GB, %" PRIu64 " bytes wrong\n",
           ok, o->requests, total_bytes / 1e6, dt, total_bytes / dt / 1e6, o->requests / dt,
           lat[o->requests / 2] * 1e3, lat[(o->requests * 99) / 100] * 1e3,
           total_bytes ? cpu / (total_bytes / 1e9) : 0.0, d->bad_total);
    if (o->json)
        printf("{\"requests\":%u,\"failed\":%u,\"bytes\":%.0f,\"seconds\":%.6f,\"MBps\":%.3f,"
               "\"req_per_s\":%.3f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"cpu_s_per_GB\":%.3f,"
               "\"bad_bytes\":%" PRIu64 "}\n",
               o->requests, o->requests - ok, total_bytes, dt, total_bytes / dt / 1e6,
               o->requests / dt, lat[o->requests / 2] * 1e3, lat[(o->requests * 99) / 100] * 1e3,
               total_bytes ? cpu / (total_bytes / 1e9) : 0.0, d->bad_total);
    if (!o->f.on)
        return d->failed || d->bad_total;
    if (d->not_started)
        printf("decode: %u requests not started\n", d->not_started);
    bool ok_all = !d->unexpected && !d->bad_total && !d->canary_bad;
    printf("decode: verdict: %s%s\n",
           ok_all ? "every room ended as expected, the rooms that succeeded verified"
                  : "NOT AS EXPECTED",
           !o->f.canary_ms ? ""
           : d->canary_bad ? "; BYTES LANDED AFTER FAILED"
                           : "; nothing landed after Failed");
    return !ok_all;
}

/* --hold-start: the engine exists (FILE.up); the script sets its fault up
 * and writes FILE, and only then does the first request connect. */
static void hold_start(const char *file)
{
    char up[4200];
    snprintf(up, sizeof(up), "%s.up", file);
    write_marker(up);
    for (double until = now_s() + 60; access(file, F_OK) != 0 && now_s() < until;)
        usleep(20000);
    printf("decode: %s %s\n", file,
           access(file, F_OK) == 0 ? "seen: starting" : "not seen in 60 s: starting anyway");
}

static int run_decode(const opts_t *o)
{
    memory_t m;
    alloc_memory(o, &m);
    decode_run_t d = {.o = o, .m = &m, .ready = !o->f.ready_file, .synced = !o->f.abort_sync};
    if (o->bootstrap_file)
        read_bootstrap_file(o->bootstrap_file, d.bootstrap, sizeof(d.bootstrap));
    else
        snprintf(d.bootstrap, sizeof(d.bootstrap), "%s", o->bootstrap);
    d.e = make_engine(o, &m, NULL);
    if (o->f.hold_start)
        hold_start(o->f.hold_start);
    d.lat = calloc(o->requests, sizeof(double));
    double t0 = now_s(), c0 = cpu_s();
    for (uint32_t wave = 0; wave < o->requests; wave += o->inflight) {
        uint32_t n = o->requests - wave < o->inflight ? o->requests - wave : o->inflight;
        if (d.stop)
            skip_wave(&d, wave, n);
        else
            run_wave(&d, wave, n);
    }
    int rc = decode_summary(&d, now_s() - t0, cpu_s() - c0);
    if (o->idle_s)
        rc |= idle_window(o);
    free(d.lat);
    kvw_engine_destroy(d.e);
    free_memory(o, &m);
    return rc;
}

/* ------------------------------------------------------ decode: soak */

/* Descriptors, threads and resident memory of a process (/proc). */
typedef struct proc_usage {
    int fds, threads;
    long rss_kib;
} proc_usage_t;

static int count_entries(const char *path)
{
    DIR *d = opendir(path);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        n += de->d_name[0] != '.';
    if (d)
        closedir(d);
    return d ? n : -1;
}

static proc_usage_t self_usage(void)
{
    proc_usage_t u = {count_entries("/proc/self/fd"), count_entries("/proc/self/task"), 0};
    char line[256];
    FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            u.rss_kib = strtol(line + 6, NULL, 10);
    if (f)
        fclose(f);
    return u;
}

/* A fresh start for each cycle's room: a stale copy of the right bytes
 * from an earlier cycle must not pass verification. */
static void clear_memory(const opts_t *o, const memory_t *m)
{
    for (uint32_t i = 0; i < 2 * o->layers; i++)
        memset(m->kv[i].addr, o->f.on ? CANARY_BYTE : 0, m->kv[i].len);
    if (m->aux)
        memset(m->aux[0].addr, o->f.on ? CANARY_BYTE : 0, m->aux[0].len);
}

/* One clean cycle: a new engine connects, runs room k, verifies it and is
 * destroyed (its connection closes at prefill). */
static void clean_cycle(decode_run_t *d, uint32_t k)
{
    clear_memory(d->o, d->m);
    d->e = make_engine(d->o, d->m, NULL);
    run_wave(d, k, 1);
    kvw_engine_destroy(d->e);
    d->e = NULL;
}

/* The doomed child: its own engine and receiver for room k; says 'L' on
 * the pipe once the room's first bytes landed ('E' if the room ended or
 * the engine failed first), then waits for its SIGKILL. */
static _Noreturn void doomed_child(decode_run_t *d, uint32_t k, int fd)
{
    const opts_t *o = d->o;
    room_state_t rs = {0};
    plan_room(o, o->decoder_index, k, &rs.plan);
    for (uint64_t i = 0; i < room_items(o); i++) { /* canary: to see first bytes */
        /* Two statements: room_item sets len, and the order in which a
         * call's arguments are evaluated is unspecified (one build read
         * len first, memset 8 MiB and the child died of SIGSEGV). */
        uint64_t len;
        uint8_t *item = room_item(o, d->m, &rs.plan, i, &len);
        memset(item, CANARY_BYTE, len);
    }
    kvw_engine_t *e = make_engine(o, d->m, NULL);
    kvw_receiver_t *rx;
    kvw_status_t st = kvw_receiver_create(e, d->bootstrap, o->rank, rs.plan.room, &rx);
    if (!st)
        st = kvw_receiver_init(rx, rs.plan.dst, o->pages, rs.plan.aux_dst);
    char say = 'E';
    for (double until = now_s() + 60; !st && now_s() < until; usleep(200)) {
        kvw_poll_t s = kvw_receiver_poll(rx);
        if (s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED)
            break;
        if (items_begun(o, d->m, &rs.plan, 1)) {
            say = 'L';
            break;
        }
    }
    if (write(fd, &say, 1) != 1)
        _exit(1);
    for (;;)
        pause();
}

/* A killed cycle: a separate decode process (forked while this one holds
 * no engine) gets room k under way and is killed with SIGKILL, as a
 * crashed decode process would leave prefill: its QP and control
 * connection vanish mid-transfer. */
static void kill_cycle(decode_run_t *d, uint32_t k)
{
    int pfd[2];
    if (pipe(pfd))
        die("pipe", KVW_ERR_INVALID);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0)
        die("fork", KVW_ERR_NO_MEMORY);
    if (pid == 0) {
        close(pfd[0]);
        doomed_child(d, k, pfd[1]);
    }
    close(pfd[1]);
    struct pollfd pf = {pfd[0], POLLIN, 0};
    char said = '?';
    if (poll(&pf, 1, 60000) == 1 && read(pfd[0], &said, 1) != 1)
        said = '?';
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    close(pfd[0]);
    d->kills++;
    d->kills_mid += said == 'L';
    /* A child that said nothing died by itself (or hung 60 s): the cycle
     * tested no kill, and its room's sender at prefill waits for a request
     * that never comes. That is a failure of the run, not a pass. */
    if (said != 'L' && said != 'E') {
        d->unexpected++;
        printf("cycle %u: NOT AS EXPECTED: the doomed decode process %d said nothing (%s %d)\n", k,
               (int)pid, WIFSIGNALED(status) ? "signal" : "exit status",
               WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    }
    if (!d->o->quiet)
        printf("cycle %u: decode process %d killed with SIGKILL %s\n", k, (int)pid,
               said == 'L' ? "after its room's first bytes landed"
                           : "before its room got under way (its room ended or failed first)");
}

/* --sync-at: after `done` cycles (no engine alive here), write
 * SYNC_FILE.done and wait for the script's SYNC_FILE.done.ack. */
static void sync_point(const opts_t *o, uint32_t done)
{
    char path[4096], ack[4200];
    snprintf(path, sizeof(path), "%s.%u", o->sync_file, done);
    snprintf(ack, sizeof(ack), "%s.ack", path);
    proc_usage_t u = self_usage();
    printf("decode: after %u cycles: %d fds, %d threads, VmRSS %ld KiB (this process)\n", done,
           u.fds, u.threads, u.rss_kib);
    write_marker(path);
    for (double until = now_s() + 120; access(ack, F_OK) != 0 && now_s() < until;)
        usleep(20000);
}

static int run_cycles(const opts_t *o)
{
    memory_t m;
    alloc_memory(o, &m);
    decode_run_t d = {.o = o, .m = &m, .ready = true, .synced = true};
    if (o->bootstrap_file)
        read_bootstrap_file(o->bootstrap_file, d.bootstrap, sizeof(d.bootstrap));
    else
        snprintf(d.bootstrap, sizeof(d.bootstrap), "%s", o->bootstrap);
    d.lat = calloc(o->cycles, sizeof(double));
    double t0 = now_s(), c0 = cpu_s();
    for (uint32_t k = 0; k < o->cycles; k++) {
        if (o->kill_every && k % o->kill_every == o->kill_every - 1)
            kill_cycle(&d, k);
        else
            clean_cycle(&d, k);
        if (o->sync_file && in_list(o->sync_at, k + 1))
            sync_point(o, k + 1);
    }
    double dt = now_s() - t0;
    uint32_t clean = o->cycles - d.kills, ok = clean - d.failed;
    printf("decode: %u cycles in %.1f s (%.0f ms each): %u/%u clean cycles ok, every byte "
           "checked, %" PRIu64 " bytes wrong; %u decode processes killed (%u after their "
           "first bytes landed); %.1f CPU-s in this process\n",
           o->cycles, dt, dt * 1e3 / o->cycles, ok, clean, d.bad_total, d.kills, d.kills_mid,
           cpu_s() - c0);
    free(d.lat);
    free_memory(o, &m);
    return d.failed || d.bad_total || d.unexpected;
}

/* ---------------------------------------------------------------- main */

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvw-xfer prefill|decode --ip IP [--dev NAME] [--rank R] [OPTION]...\n"
           "  or:  kvw-xfer --help | --version\n"
           "Move KV cache between two hosts (or processes) through kvwire's public API:\n"
           "one side runs prefill, the other decode, with the same layout and work options;\n"
           "decode checks every byte it receives. Numbers are decimal, or hex after 0x.\n"
           "  prefill: --bootstrap ADDR | --embed-bootstrap FILE   [--idle-check SECONDS]\n"
           "  decode:  --bootstrap ADDR | --bootstrap-file FILE    [--decoder-index D]\n"
           "  layout:  --layers L (32) --item BYTES (2048) --pool PAGES (256)\n"
           "           --aux-item BYTES (0: none) --aux-items N (16)\n"
           "  work:    --requests N (8) --pages N (32) --inflight N (4) --decoders D (1)\n"
           "           --contig C (4) --dst-contig C (3) --seed S (1) [--json] [--quiet]\n"
           "  faults (rooms by number: decoder index * 1000000 + request index; LIST is\n"
           "  \"all\" or rooms and ranges, e.g. 1,4-6; give both sides the same options):\n"
           "    --abort-room K [--abort-side prefill|decode (decode)] [--abort-after-ms T (100)]\n"
           "        [--abort-sync FILE]: that side aborts room K T ms after it got under way,\n"
           "        if it has not ended. Decode: its first bytes landed. Prefill: it turned\n"
           "        Transferring, or with --abort-sync (same host), decode wrote FILE on\n"
           "        seeing its first bytes land (prefill may serve other rooms first)\n"
           "    --hold-rest FILE: prefill sends room K's first half of pages, the rest once\n"
           "        the room was aborted: by decode, which writes FILE then (same host), or\n"
           "        with --abort-side prefill by prefill itself (FILE unused)\n"
           "    --bad-room K [--bad-side prefill|decode (decode)]\n"
           "        that side hands room K an out-of-range page (receiver_init / sender_send)\n"
           "    --expect-failed LIST   these rooms must end Failed, all others Success\n"
           "    --may-fail LIST        these rooms may end either way (a peer gets killed)\n"
           "    --canary-ms MS         decode: pool filled with a canary; the pages of every\n"
           "                           room that ends Failed must not change for MS ms after\n"
           "    --ready-file F         write F once data is moving (prefill: WRs posted;\n"
           "                           decode: bytes of a request landed)\n"
           "    --hold-start F         decode: write F.up once the engine exists, then wait\n"
           "                           (up to 60 s) for F before the first request, which\n"
           "                           makes the connection (a fault set up in between)\n"
           "    --deadline-s S         S s after start, list the rooms not ended and exit 3\n"
           "                           (S + 10 s at the latest, whatever hangs)\n"
           "    --keep-going           decode: a failed room does not stop the run: the next\n"
           "                           waves are started on the same engine (a restarted\n"
           "                           prefill serves them); Success lines end [at W ms]\n"
           "    --first-room K         prefill: serve request indexes K..K+N-1 of each\n"
           "                           decoder (a restarted prefill serving decode's later\n"
           "                           waves); not a fault by itself\n"
           "  soak (decode): --cycles N [--kill-every K (0)] [--sync-file F --sync-at LIST]\n"
           "        N cycles, each a new engine that runs room k (k = 0..N-1; prefill serves\n"
           "        --requests N), verifies it and is destroyed; every K-th cycle a forked\n"
           "        decode process is killed with SIGKILL once its room's first bytes landed\n"
           "        (give prefill --may-fail for those rooms). After the cycle counts in\n"
           "        LIST, write F.COUNT and wait for F.COUNT.ack (the script measures)\n"
           "  idle (both): --idle-s S  after the transfers stay connected S s, then print\n"
           "        each thread's CPU %% of a core and wake-ups/s over the window; fails\n"
           "        above 25 wake-ups/s\n"
           "  Any fault option switches to fault mode: failed rooms are printed as\n"
           "  \"room K: FAILED after MS ms: STATUS: reason [since WHAT, at WALLCLOCK ms]\" and\n"
           "  the exit status says whether every room ended as expected.\n"
           "\n"
           "Exit status: 0 every room ended as expected and every byte matched; 1 a bad\n"
           "command line, or a transfer failed or delivered wrong bytes; 3 --deadline-s\n"
           "passed with rooms not ended.\n");
    exit(0);
}

static side_t parse_side(const char *s)
{
    if (strcmp(s, "prefill") == 0)
        return SIDE_PREFILL;
    if (strcmp(s, "decode") != 0)
        kvw_tool_usage_error("invalid side '%s': prefill or decode", s);
    return SIDE_DECODE;
}

static const char *parse_list(const char *s)
{
    if (!list_valid(s)) {
        kvw_tool_usage_error("invalid room list '%s': \"all\", or rooms and ranges such as 1,4-6",
                             s);
    }
    return s;
}

enum { /* long options without a short letter */
       OPT_ABORT_ROOM = 256,
       OPT_ABORT_SIDE,
       OPT_ABORT_AFTER,
       OPT_BAD_ROOM,
       OPT_BAD_SIDE,
       OPT_CANARY,
       OPT_EXPECT_FAILED,
       OPT_MAY_FAIL,
       OPT_READY_FILE,
       OPT_DEADLINE,
       OPT_ABORT_SYNC,
       OPT_HOLD_REST,
       OPT_HOLD_START,
       OPT_KEEP_GOING,
       OPT_FIRST_ROOM,
       OPT_IDLE_S,
       OPT_CYCLES,
       OPT_KILL_EVERY,
       OPT_SYNC_FILE,
       OPT_SYNC_AT,
};

/* The fault options; false if c is not one of them. */
static bool parse_fault_opt(int c, const char *arg, faults_t *f)
{
    switch (c) {
    case OPT_ABORT_ROOM:
        f->abort_room = (int64_t)kvw_tool_u64("--abort-room", arg, 0, INT64_MAX);
        break;
    case OPT_ABORT_SIDE:
        f->abort_side = parse_side(arg);
        break;
    case OPT_ABORT_AFTER:
        f->abort_after_ms = kvw_tool_u32("--abort-after-ms", arg, 0, UINT32_MAX);
        break;
    case OPT_BAD_ROOM:
        f->bad_room = (int64_t)kvw_tool_u64("--bad-room", arg, 0, INT64_MAX);
        break;
    case OPT_BAD_SIDE:
        f->bad_side = parse_side(arg);
        break;
    case OPT_CANARY:
        f->canary_ms = kvw_tool_u32("--canary-ms", arg, 0, UINT32_MAX);
        break;
    case OPT_EXPECT_FAILED:
        f->expect_failed = parse_list(arg);
        break;
    case OPT_MAY_FAIL:
        f->may_fail = parse_list(arg);
        break;
    case OPT_READY_FILE:
        f->ready_file = arg;
        break;
    case OPT_DEADLINE:
        f->deadline_s = kvw_tool_u32("--deadline-s", arg, 0, 86400);
        break;
    case OPT_ABORT_SYNC:
        f->abort_sync = arg;
        break;
    case OPT_HOLD_REST:
        f->hold_rest = arg;
        break;
    case OPT_HOLD_START:
        f->hold_start = arg;
        break;
    case OPT_KEEP_GOING:
        f->keep_going = true;
        break;
    default:
        return false;
    }
    f->on = true;
    return true;
}

/* The soak options belong to decode, and only with --cycles (one room per
 * cycle, so --inflight 1); --idle-s does not mix with them. */
static bool soak_opts_ok(opts_t *o)
{
    if (!o->cycles)
        return !o->kill_every && !o->sync_file && !o->sync_at;
    o->requests = o->inflight = 1;
    return !o->prefill && !o->idle_s && o->cycles <= 1000000 && !o->f.keep_going &&
           o->f.abort_room < 0 && o->f.bad_room < 0 && (!o->sync_file == !o->sync_at);
}

/* What is wrong with a parsed command line as a whole, or NULL. */
static const char *opts_problem(opts_t *o)
{
    if (!o->ip)
        return "--ip is required";
    if (!o->bootstrap && !(o->prefill ? o->embed_file : o->bootstrap_file))
        return o->prefill ? "--bootstrap ADDR or --embed-bootstrap FILE is required"
                          : "--bootstrap ADDR or --bootstrap-file FILE is required";
    if (o->item % 8 || o->aux_item % 8)
        return "--item and --aux-item must be multiples of 8";
    if (o->f.keep_going && o->prefill)
        return "--keep-going is decode's";
    if (o->first_room && !o->prefill)
        return "--first-room is prefill's";
    if (o->first_room + (uint64_t)o->requests > 1000000)
        return "--first-room + --requests must stay below 1000000";
    if (!soak_opts_ok(o))
        return "--cycles is decode's, without --idle-s, --keep-going, --abort-room or "
               "--bad-room; --kill-every, --sync-file and --sync-at need it, and --sync-file "
               "and --sync-at go together";
    return NULL;
}

static void parse(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.layers = 32,
                  .item = 2048,
                  .pool = 256,
                  .aux_items = 16,
                  .requests = 8,
                  .pages = 32,
                  .inflight = 4,
                  .decoders = 1,
                  .contig = 4,
                  .dst_contig = 3,
                  .seed = 1,
                  .f = {.abort_room = -1, .bad_room = -1, .abort_after_ms = 100}};
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")))
        usage();
    if (argc >= 2 && (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")))
        kvw_tool_version();
    if (argc < 2)
        kvw_tool_usage_error("missing the side: prefill or decode");
    o->prefill = strcmp(argv[1], "prefill") == 0;
    if (!o->prefill && strcmp(argv[1], "decode") != 0)
        kvw_tool_usage_error("invalid side '%s': prefill or decode", argv[1]);
    static const struct option longopts[] = {{"dev", 1, 0, 'd'},
                                             {"ip", 1, 0, 'i'},
                                             {"bootstrap", 1, 0, 'b'},
                                             {"bootstrap-file", 1, 0, 'B'},
                                             {"embed-bootstrap", 1, 0, 'E'},
                                             {"rank", 1, 0, 'r'},
                                             {"layers", 1, 0, 'L'},
                                             {"item", 1, 0, 'I'},
                                             {"pool", 1, 0, 'P'},
                                             {"aux-item", 1, 0, 'a'},
                                             {"aux-items", 1, 0, 'A'},
                                             {"requests", 1, 0, 'n'},
                                             {"pages", 1, 0, 'p'},
                                             {"inflight", 1, 0, 'f'},
                                             {"decoders", 1, 0, 'D'},
                                             {"decoder-index", 1, 0, 'x'},
                                             {"contig", 1, 0, 'c'},
                                             {"dst-contig", 1, 0, 'C'},
                                             {"seed", 1, 0, 's'},
                                             {"idle-check", 1, 0, 'z'},
                                             {"json", 0, 0, 'j'},
                                             {"quiet", 0, 0, 'q'},
                                             {"abort-room", 1, 0, OPT_ABORT_ROOM},
                                             {"abort-side", 1, 0, OPT_ABORT_SIDE},
                                             {"abort-after-ms", 1, 0, OPT_ABORT_AFTER},
                                             {"bad-room", 1, 0, OPT_BAD_ROOM},
                                             {"bad-side", 1, 0, OPT_BAD_SIDE},
                                             {"canary-ms", 1, 0, OPT_CANARY},
                                             {"expect-failed", 1, 0, OPT_EXPECT_FAILED},
                                             {"may-fail", 1, 0, OPT_MAY_FAIL},
                                             {"ready-file", 1, 0, OPT_READY_FILE},
                                             {"deadline-s", 1, 0, OPT_DEADLINE},
                                             {"abort-sync", 1, 0, OPT_ABORT_SYNC},
                                             {"hold-rest", 1, 0, OPT_HOLD_REST},
                                             {"hold-start", 1, 0, OPT_HOLD_START},
                                             {"keep-going", 0, 0, OPT_KEEP_GOING},
                                             {"first-room", 1, 0, OPT_FIRST_ROOM},
                                             {"idle-s", 1, 0, OPT_IDLE_S},
                                             {"cycles", 1, 0, OPT_CYCLES},
                                             {"kill-every", 1, 0, OPT_KILL_EVERY},
                                             {"sync-file", 1, 0, OPT_SYNC_FILE},
                                             {"sync-at", 1, 0, OPT_SYNC_AT},
                                             {"help", 0, 0, 'h'},
                                             {"version", 0, 0, 'V'},
                                             {0, 0, 0, 0}};
    int c;
    optind = 2;
    while ((c = getopt_long(argc, argv, "hV", longopts, NULL)) != -1) {
        if (parse_fault_opt(c, optarg, &o->f))
            continue;
        switch (c) {
        case 'd':
            o->dev = optarg;
            break;
        case 'i':
            o->ip = kvw_tool_ipv4("--ip", optarg);
            break;
        case 'b':
            o->bootstrap = optarg;
            break;
        case 'B':
            o->bootstrap_file = optarg;
            break;
        case 'E':
            o->embed_file = optarg;
            break;
        case 'r':
            o->rank = kvw_tool_u32("--rank", optarg, 0, KVW_MAX_PREFILL_RANKS - 1);
            break;
        case 'L':
            o->layers = kvw_tool_u32("--layers", optarg, 1, 65535);
            break;
        case 'I':
            o->item = kvw_tool_u64("--item", optarg, 8, 1u << 30);
            break;
        case 'P':
            o->pool = kvw_tool_u64("--pool", optarg, 1, UINT32_MAX);
            break;
        case 'a':
            o->aux_item = kvw_tool_u64("--aux-item", optarg, 0, 1u << 30);
            break;
        case 'A':
            o->aux_items = kvw_tool_u64("--aux-items", optarg, 1, UINT32_MAX);
            break;
        case 'n':
            o->requests = kvw_tool_u32("--requests", optarg, 1, 1000000);
            break;
        case 'p':
            o->pages = kvw_tool_u32("--pages", optarg, 1, UINT32_MAX);
            break;
        case 'f':
            o->inflight = kvw_tool_u32("--inflight", optarg, 1, 65536);
            break;
        case 'D':
            o->decoders = kvw_tool_u32("--decoders", optarg, 1, 4096);
            break;
        case 'x':
            o->decoder_index = kvw_tool_u32("--decoder-index", optarg, 0, 4095);
            break;
        case 'c':
            o->contig = kvw_tool_u64("--contig", optarg, 1, UINT32_MAX);
            break;
        case 'C':
            o->dst_contig = kvw_tool_u64("--dst-contig", optarg, 1, UINT32_MAX);
            break;
        case 's':
            o->seed = kvw_tool_u64("--seed", optarg, 0, UINT64_MAX);
            break;
        case 'z':
            o->idle_check_s = kvw_tool_u32("--idle-check", optarg, 0, 86400);
            break;
        case 'j':
            o->json = true;
            break;
        case 'q':
            o->quiet = true;
            break;
        case OPT_FIRST_ROOM:
            o->first_room = kvw_tool_u32("--first-room", optarg, 0, 999999);
            break;
        case OPT_IDLE_S:
            o->idle_s = kvw_tool_u32("--idle-s", optarg, 0, 86400);
            break;
        case OPT_CYCLES:
            o->cycles = kvw_tool_u32("--cycles", optarg, 1, 1000000);
            break;
        case OPT_KILL_EVERY:
            o->kill_every = kvw_tool_u32("--kill-every", optarg, 0, 1000000);
            break;
        case OPT_SYNC_FILE:
            o->sync_file = optarg;
            break;
        case OPT_SYNC_AT:
            o->sync_at = parse_list(optarg);
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
    const char *problem = opts_problem(o);
    if (problem)
        kvw_tool_usage_error("%s", problem);
    if (o->inflight > o->requests)
        o->inflight = o->requests;
    /* Destination windows of requests in flight together must fit apart. */
    uint64_t dst_window = (o->pages + o->dst_contig - 1) / o->dst_contig * o->dst_contig;
    uint64_t src_window = (o->pages + o->contig - 1) / o->contig * o->contig;
    if (dst_window * o->inflight > o->pool || src_window > o->pool ||
        (o->aux_item && o->inflight > o->aux_items)) {
        kvw_tool_usage_error("--pool %" PRIu64 " (and --aux-items) too small for --inflight %u "
                             "requests of --pages %u",
                             o->pool, o->inflight, o->pages);
    }
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-xfer";
    t_start = now_s();
    opts_t o;
    parse(argc, argv, &o);
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (o.f.deadline_s) { /* the poll loops check it; this catches a hang elsewhere */
        signal(SIGALRM, on_alarm);
        alarm(o.f.deadline_s + 10);
    }
    if (o.cycles)
        return run_cycles(&o);
    return o.prefill ? run_prefill(&o) : run_decode(&o);
}
