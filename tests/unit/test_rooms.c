/* SPDX-License-Identifier: Apache-2.0 */
/* Control-plane benchmark: 10,000 rooms in flight at once against one
 * prefill engine, and the CPU its control thread (and decode's, and both
 * pollers) spent per request, measured from /proc/self/task.
 *
 * "In flight" here means: all 10,000 senders and receivers exist and are
 * initialised at the same moment, and prefill has matched decode's request
 * for every one of them (every sender is WaitingForInput) before any data
 * is handed over; then every sender sends and all 10,000 transfers run
 * together. So both control threads carry 10,000 live requests at once.
 *
 * The pair's pool is 64 pages, so rooms share pages: room i writes one
 * page to destination page i % 64, always from the same source page (and
 * one aux item, likewise), so every room sharing a destination carries the
 * same bytes and each room's bytes can be checked after all ended. Every
 * room must end Success on both sides, decode's requests_ok must count
 * all of them and prefill must have posted exactly their bytes.
 *
 * On the fake NIC (tests/support/fake_nic.h): engine-level, not RDMA.
 * KVW_ROOMS sets the number of rooms (default 10000). */
#include "support/engine_pair.h"

#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmocka.h>

enum { WAIT_MS = 120000, MAX_TIDS = 8 };

/* Engine threads by name: each engine has one control and one poller
 * thread, and each ZeroMQ context (both engines', the bootstrap
 * service's) an I/O thread that does the sockets' actual work. */
typedef struct tids {
    int control[MAX_TIDS], poller[MAX_TIDS], io[MAX_TIDS];
    int ncontrol, npoller, nio;
} tids_t;

static bool read_line(const char *path, char *buf, size_t size)
{
    FILE *f = fopen(path, "r");
    bool ok = f && fgets(buf, (int)size, f);
    if (f)
        fclose(f);
    return ok;
}

static tids_t engine_threads(void)
{
    tids_t t = {0};
    DIR *d = opendir("/proc/self/task");
    struct dirent *de;
    while (d && (de = readdir(d))) {
        char path[300], comm[64];
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", de->d_name);
        if (de->d_name[0] == '.' || !read_line(path, comm, sizeof(comm)))
            continue;
        if (strcmp(comm, "kvw-control\n") == 0 && t.ncontrol < MAX_TIDS)
            t.control[t.ncontrol++] = atoi(de->d_name);
        if (strcmp(comm, "kvw-poller\n") == 0 && t.npoller < MAX_TIDS)
            t.poller[t.npoller++] = atoi(de->d_name);
        if (strncmp(comm, "ZMQbg/IO/", 9) == 0 && t.nio < MAX_TIDS)
            t.io[t.nio++] = atoi(de->d_name);
    }
    if (d)
        closedir(d);
    return t;
}

/* CPU seconds of one thread (tid > 0) or of the whole process (0). A
 * thread's comes from schedstat (nanoseconds on the CPU), as a control
 * thread spends only a few clock ticks per thousand requests; stat's
 * utime + stime (ticks) where the kernel has no schedstat. */
static double cpu_s(int tid)
{
    char path[128], line[1024];
    if (!tid) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
               ru.ru_stime.tv_usec / 1e6;
    }
    unsigned long long ns, ut = 0, st = 0;
    snprintf(path, sizeof(path), "/proc/self/task/%d/schedstat", tid);
    if (read_line(path, line, sizeof(line)) && sscanf(line, "%llu", &ns) == 1)
        return (double)ns / 1e9;
    snprintf(path, sizeof(path), "/proc/self/task/%d/stat", tid);
    char *p = read_line(path, line, sizeof(line)) ? strrchr(line, ')') : NULL;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The one tid of `b` that is not in `a`. */
static int newcomer(const int *a, int na, const int *b, int nb)
{
    for (int i = 0; i < nb; i++) {
        bool old = false;
        for (int j = 0; j < na; j++)
            old |= a[j] == b[i];
        if (!old)
            return b[i];
    }
    return 0;
}

static int other(const int *v, int n, int not_this)
{
    for (int i = 0; i < n; i++)
        if (v[i] != not_this)
            return v[i];
    return 0;
}

typedef struct who {
    int control[2], poller[2]; /* [0] prefill, [1] decode */
} who_t;

/* Both engines name their threads alike. Replace the decode engine: its
 * new threads are decode's, the ones that stayed are prefill's. */
static who_t find_threads(engine_pair_t *p)
{
    tids_t before = engine_threads();
    kvw_engine_destroy(p->decode);
    assert_int_equal(pair_add_decode(p, &p->decode), KVW_OK);
    tids_t after = engine_threads();
    assert_int_equal(after.ncontrol, 2);
    assert_int_equal(after.npoller, 2);
    who_t w;
    w.control[1] = newcomer(before.control, before.ncontrol, after.control, after.ncontrol);
    w.poller[1] = newcomer(before.poller, before.npoller, after.poller, after.npoller);
    w.control[0] = other(after.control, 2, w.control[1]);
    w.poller[0] = other(after.poller, 2, w.poller[1]);
    assert_true(w.control[0] && w.control[1] && w.poller[0] && w.poller[1]);
    return w;
}

typedef struct cpu {
    double control[2], poller[2], process;
    /* ZeroMQ starts a context's I/O thread with its first socket, so the
     * set is taken afresh each time: a thread new since the first
     * snapshot counts from zero. */
    int io_tid[MAX_TIDS], nio;
    double io[MAX_TIDS];
} cpu_t;

static cpu_t cpu_now(const who_t *w)
{
    cpu_t c = {.process = cpu_s(0)};
    tids_t t = engine_threads();
    for (c.nio = 0; c.nio < t.nio; c.nio++) {
        c.io_tid[c.nio] = t.io[c.nio];
        c.io[c.nio] = cpu_s(t.io[c.nio]);
    }
    for (int i = 0; i < 2; i++) {
        c.control[i] = cpu_s(w->control[i]);
        c.poller[i] = cpu_s(w->poller[i]);
    }
    return c;
}

/* Room i: one page and one aux item, each always from the same source for
 * the same destination (see the top of the file). */
static void plan(pair_room_t *pr, uint32_t i)
{
    memset(pr, 0, sizeof(*pr));
    pr->room = 1000000u + i;
    pr->n = 1;
    pr->dst[0] = i % PAIR_POOL;
    pr->src[0] = (pr->dst[0] * 7 + 3) % PAIR_POOL;
    pr->aux_dst = i % PAIR_AUX_ITEMS;
    pr->aux_src = (pr->aux_dst * 3 + 1) % PAIR_AUX_ITEMS;
}

static bool all_senders(const pair_room_t *r, uint32_t n, kvw_poll_t want)
{
    for (uint32_t i = 0; i < n; i++)
        if (kvw_sender_poll(r[i].s) != want)
            return false;
    return true;
}

static bool all_ended(const pair_room_t *r, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvw_poll_t s = kvw_sender_poll(r[i].s), d = kvw_receiver_poll(r[i].r);
        if ((s != KVW_POLL_SUCCESS && s != KVW_POLL_FAILED) ||
            (d != KVW_POLL_SUCCESS && d != KVW_POLL_FAILED))
            return false;
    }
    return true;
}

/* Poll until done(), at most WAIT_MS; true if it got there. */
static bool wait_until(bool (*done)(const pair_room_t *, uint32_t), const pair_room_t *r,
                       uint32_t n)
{
    for (uint64_t end = pair_now_ms() + WAIT_MS; !done(r, n);) {
        if (pair_now_ms() > end)
            return false;
        pair_sleep_ms(5);
    }
    return true;
}

/* Done when every room is matched at prefill, or as soon as one failed. */
static bool matched_or_failed(const pair_room_t *r, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (kvw_receiver_poll(r[i].r) == KVW_POLL_FAILED)
            return true;
    return all_senders(r, n, KVW_POLL_WAITING_FOR_INPUT);
}

/* Every room of r[0..n) matched at prefill; else say why the first failed. */
static void expect_matched(const pair_room_t *r, uint32_t n)
{
    assert_true(wait_until(matched_or_failed, r, n));
    for (uint32_t i = 0; i < n; i++) {
        const char *why = "";
        kvw_status_t st = kvw_receiver_failure(r[i].r, &why);
        if (st)
            fail_msg("room %llu failed before any data: %s: %s", (unsigned long long)r[i].room,
                     kvw_status_name(st), why);
    }
    assert_true(all_senders(r, n, KVW_POLL_WAITING_FOR_INPUT));
}

/* Receivers initialised per burst before waiting for prefill to match
 * them; by default all at once: 10,000 requests queue on decode's control
 * socket (its send queue holds our own messages, KVW_ZSOCK_SEND_HWM) while
 * prefill reads them 256 at a time. KVW_ROOMS_BURST sets a smaller burst. */
static uint32_t burst_size(void)
{
    const char *env = getenv("KVW_ROOMS_BURST");
    return env ? (uint32_t)strtoul(env, NULL, 10) : UINT32_MAX;
}

static engine_pair_t pair;

/* Every room created and initialised on both sides, then matched at
 * prefill: the rooms are in flight. */
static void open_rooms(pair_room_t *r, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        plan(&r[i], i);
        assert_int_equal(kvw_sender_create(pair.prefill, r[i].room, &r[i].s), KVW_OK);
        assert_int_equal(kvw_sender_init(r[i].s, 1, r[i].aux_src), KVW_OK);
    }
    uint32_t burst = burst_size();
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(kvw_receiver_create(pair.decode, kvw_bootstrap_addr(pair.bootstrap), 0,
                                             r[i].room, &r[i].r),
                         KVW_OK);
        assert_int_equal(kvw_receiver_init(r[i].r, r[i].dst, 1, r[i].aux_dst), KVW_OK);
        uint32_t first = i / burst * burst;
        if (i + 1 == n || (i + 1) % burst == 0)
            expect_matched(r + first, i + 1 - first);
    }
    expect_matched(r, n);
}

static void check_rooms(const pair_room_t *r, uint32_t n)
{
    size_t wrong = 0;
    uint32_t ok = 0;
    for (uint32_t i = 0; i < n; i++) {
        ok += kvw_sender_poll(r[i].s) == KVW_POLL_SUCCESS &&
              kvw_receiver_poll(r[i].r) == KVW_POLL_SUCCESS;
        wrong += pair_wrong_bytes(&pair, &r[i]);
    }
    kvw_counters_t pc, dc;
    kvw_engine_counters(pair.prefill, &pc);
    kvw_engine_counters(pair.decode, &dc);
    uint64_t room_bytes = 2 * PAIR_LAYERS * PAIR_ITEM + PAIR_AUX_ITEM;
    print_message("rooms: %u/%u ended Success on both sides, %zu bytes wrong; prefill posted "
                  "%llu bytes in %llu WRs (%llu doorbells), decode counted %llu ok\n",
                  ok, n, wrong, (unsigned long long)pc.bytes_posted,
                  (unsigned long long)pc.wrs_posted, (unsigned long long)pc.chains_posted,
                  (unsigned long long)dc.requests_ok);
    assert_int_equal(ok, n);
    assert_int_equal(wrong, 0);
    assert_int_equal(dc.requests_ok, n);
    assert_int_equal(pc.requests_ok, n);
    assert_int_equal(pc.bytes_posted, (uint64_t)n * room_bytes);
}

static double io_used(const cpu_t *a, const cpu_t *b)
{
    double used = 0;
    for (int i = 0; i < b->nio; i++) {
        double before = 0;
        for (int j = 0; j < a->nio; j++)
            before = a->io_tid[j] == b->io_tid[i] ? a->io[j] : before;
        used += b->io[i] - before;
    }
    return used;
}

static void print_cpu(uint32_t n, const cpu_t *a, const cpu_t *b, double secs)
{
    double io = io_used(a, b);
    static const char *side[2] = {"prefill", "decode"};
    for (int i = 0; i < 2; i++) {
        double ctl = b->control[i] - a->control[i], pol = b->poller[i] - a->poller[i];
        print_message("rooms: %-7s kvw-control %.3f CPU-s = %.1f us per request; "
                      "kvw-poller %.3f CPU-s = %.1f us per request\n",
                      side[i], ctl, ctl * 1e6 / n, pol, pol * 1e6 / n);
    }
    print_message("rooms: ZeroMQ I/O threads (%d: both engines' and the bootstrap's) %.3f "
                  "CPU-s = %.1f us per request\n",
                  b->nio, io, io * 1e6 / n);
    print_message("rooms: whole process (both engines, ZeroMQ, fake NIC, this test's polling) "
                  "%.2f CPU-s in %.2f s wall (ASan+UBSan build)\n",
                  b->process - a->process, secs);
}

static void test_rooms_in_flight(void **state)
{
    (void)state;
    const char *env = getenv("KVW_ROOMS");
    uint32_t n = env ? (uint32_t)strtoul(env, NULL, 10) : 10000;
    kvw_config_t cfg;
    kvw_config_init(&cfg); /* real-sized queues, so the control plane, not credits, is measured */
    /* Generous limits: under ASan on a shared machine a burst of 10,000
     * requests must not read as a silent peer or a late transfer. */
    cfg.bootstrap_timeout_ms = WAIT_MS;
    cfg.transfer_timeout_ms = WAIT_MS;
    cfg.peer_timeout_ms = 20000;
    assert_int_equal(pair_open(&pair, &cfg), KVW_OK);
    who_t w = find_threads(&pair);
    pair_room_t *r = calloc(n, sizeof(*r));
    assert_non_null(r);

    uint64_t t0 = pair_now_ms();
    cpu_t c0 = cpu_now(&w);
    open_rooms(r, n);
    uint64_t t1 = pair_now_ms();
    print_message("rooms: %u rooms in flight (created and initialised on both sides, every "
                  "request matched at prefill, no data handed over yet; receivers initialised "
                  "in bursts of %u) after %.2f s\n",
                  n, burst_size() < n ? burst_size() : n, (t1 - t0) / 1000.0);
    for (uint32_t i = 0; i < n; i++)
        assert_int_equal(kvw_sender_send(r[i].s, r[i].src, 1), KVW_OK);
    assert_true(wait_until(all_ended, r, n));
    cpu_t c1 = cpu_now(&w);
    uint64_t t2 = pair_now_ms();
    print_message("rooms: all %u sent and ended %.2f s later; %.2f s in all\n", n,
                  (t2 - t1) / 1000.0, (t2 - t0) / 1000.0);
    print_cpu(n, &c0, &c1, (t2 - t0) / 1000.0);
    check_rooms(r, n);
    for (uint32_t i = 0; i < n; i++)
        pair_destroy_room(&r[i]);
    free(r);
    pair_close(&pair);
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_rooms_in_flight)};
    return cmocka_run_group_tests_name("10,000 rooms in flight on the fake NIC (not RDMA)", tests,
                                       NULL, NULL);
}
