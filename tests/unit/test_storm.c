/* SPDX-License-Identifier: Apache-2.0 */
/* A handshake storm on the fake NIC (not RDMA): N decode engines (N =
 * KVW_STORM_ENGINES, 1024 by default), each its own engine with its own
 * threads, sockets and QPs, connect to one prefill engine at the same
 * moment and each transfers one request. Counts only: every engine
 * connects, no request fails, every byte lands, no handshake is served
 * twice (prefill killing a connection because its decode engine
 * reconnected"), and prefill never refuses one. The times (to connected,
 * from the storm's start to decode's request going out: p50, p99, max;
 * connected to done) are printed, not judged: the
 * fake NIC and a loaded 2-core machine say nothing about real speed.
 * The rxe figures come from bench/kvw-storm (make bench). */
#include "support/engine_pair.h"
#include "support/fake_nic.h"

#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

enum { WAIT_MS = 120000, PAGES = 4 };

static engine_pair_t pair;
static atomic_int reconnects, refusals, timeouts;

static void count_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    if (strstr(msg, "reconnected"))
        atomic_fetch_add(&reconnects, 1);
    if (strstr(msg, "rejected") || strstr(msg, "refused"))
        atomic_fetch_add(&refusals, 1);
    if (strstr(msg, "within"))
        atomic_fetch_add(&timeouts, 1);
    if (level <= KVW_LOG_ERROR)
        fprintf(stderr, "  [log] %s\n", msg);
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

/* The storm's config: test-sized queues, but the default liveness and
 * handshake timeouts (the claim is that a storm stays within them). */
static void storm_config(kvw_config_t *cfg, unsigned n)
{
    kvw_config_t d;
    kvw_config_init(&d);
    pair_config(cfg);
    cfg->bootstrap_timeout_ms = d.bootstrap_timeout_ms;
    cfg->transfer_timeout_ms = d.transfer_timeout_ms;
    cfg->heartbeat_ms = d.heartbeat_ms;
    cfg->peer_timeout_ms = d.peer_timeout_ms;
    cfg->idle_heartbeat_ms = d.idle_heartbeat_ms;
    cfg->max_peers = n + 4;
    /* One process hosting every engine (about 4 threads each: 4000+ for
     * 1024 on 2 cores) starves prefill's control thread of CPU for longer
     * than the default 2 s liveness limit, which decode would then take for
     * a dead prefill: that is this test's machine, not a handshake timeout.
     * KVW_STORM_PEER_TIMEOUT_MS (20000 here) widens liveness only; the
     * handshake deadline stays bootstrap_timeout_ms's default. */
    const char *pt = getenv("KVW_STORM_PEER_TIMEOUT_MS");
    cfg->peer_timeout_ms = pt ? (uint32_t)strtoul(pt, NULL, 10) : 20000;
    cfg->heartbeat_ms = cfg->peer_timeout_ms / 4;
}

typedef struct storm {
    unsigned n;
    kvw_engine_t **decode;
    pair_room_t *rooms;
    uint64_t *connected_ms, *done_ms;
    kvw_poll_t *final;
    uint64_t t0_ns;
    uint64_t engines_ms; /* creating decode engines 1..n-1 */
} storm_t;

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* When decode connected: its request went out then (metrics start_ns). */
static void connected_times(storm_t *s)
{
    for (unsigned i = 0; i < s->n; i++) {
        kvw_req_metrics_t m = {0};
        kvw_receiver_metrics(s->rooms[i].r, &m);
        s->connected_ms[i] = m.start_ns > s->t0_ns ? (m.start_ns - s->t0_ns) / 1000000 + 1 : 0;
    }
}

static void storm_open(storm_t *s)
{
    kvw_config_t cfg;
    storm_config(&cfg, s->n);
    s->decode = calloc(s->n, sizeof(*s->decode));
    s->rooms = calloc(s->n, sizeof(*s->rooms));
    s->connected_ms = calloc(s->n, sizeof(uint64_t));
    s->done_ms = calloc(s->n, sizeof(uint64_t));
    s->final = calloc(s->n, sizeof(*s->final));
    assert_true(s->decode && s->rooms && s->connected_ms && s->done_ms && s->final);
    assert_int_equal(pair_open(&pair, &cfg), KVW_OK);
    s->decode[0] = pair.decode;
    uint64_t t0 = pair_now_ms();
    for (unsigned i = 1; i < s->n; i++)
        assert_int_equal(pair_add_decode(&pair, &s->decode[i]), KVW_OK);
    s->engines_ms = pair_now_ms() - t0;
    /* Every room writes the same bytes to the same decode pages (the
     * engines share them): landing twice is harmless, and every room's
     * bytes can be checked. Senders first, sent: only the handshakes wait. */
    for (unsigned i = 0; i < s->n; i++) {
        pair_room_t *pr = &s->rooms[i];
        pair_pick(pr, i + 1, PAGES, 7, 0);
        assert_int_equal(kvw_sender_create(pair.prefill, pr->room, &pr->s), KVW_OK);
        assert_int_equal(kvw_sender_init(pr->s, pr->n, pr->aux_src), KVW_OK);
        assert_int_equal(kvw_sender_send(pr->s, pr->src, pr->n), KVW_OK);
    }
}

/* Every receiver at once, then watch them all. */
static uint64_t storm_run(storm_t *s)
{
    const char *bs = kvw_bootstrap_addr(pair.bootstrap);
    uint64_t t0 = pair_now_ms(), t0_ns = mono_ns();
    for (unsigned i = 0; i < s->n; i++) {
        pair_room_t *pr = &s->rooms[i];
        assert_int_equal(kvw_receiver_create(s->decode[i], bs, 0, pr->room, &pr->r), KVW_OK);
        assert_int_equal(kvw_receiver_init(pr->r, pr->dst, pr->n, pr->aux_dst), KVW_OK);
    }
    uint64_t created = pair_now_ms() - t0;
    s->t0_ns = t0_ns;
    unsigned left = s->n;
    while (left && pair_now_ms() - t0 < WAIT_MS) {
        for (unsigned i = 0; i < s->n; i++) {
            if (s->done_ms[i])
                continue;
            kvw_poll_t st = kvw_receiver_poll(s->rooms[i].r);
            uint64_t t = pair_now_ms() - t0 + 1; /* 1-based: 0 means not yet */
            if (st == KVW_POLL_SUCCESS || st == KVW_POLL_FAILED) {
                s->done_ms[i] = t;
                s->final[i] = st;
                left--;
            }
        }
        pair_sleep_ms(1);
    }
    return created;
}

static void storm_report(const storm_t *s, uint64_t created_ms)
{
    uint64_t *c = calloc(s->n, sizeof(uint64_t)), *x = calloc(s->n, sizeof(uint64_t));
    assert_true(c && x);
    unsigned connected = 0, ok = 0, failed = 0;
    size_t wrong = 0;
    for (unsigned i = 0; i < s->n; i++) {
        if (s->connected_ms[i])
            c[connected++] = s->connected_ms[i] - 1;
        if (s->done_ms[i] && s->connected_ms[i])
            x[ok] = s->done_ms[i] - s->connected_ms[i];
        ok += s->final[i] == KVW_POLL_SUCCESS;
        failed += s->done_ms[i] && s->final[i] == KVW_POLL_FAILED;
        if (s->final[i] == KVW_POLL_SUCCESS)
            wrong += pair_wrong_bytes(&pair, &s->rooms[i]);
    }
    for (unsigned i = 0, shown = 0; i < s->n && shown < 3; i++) {
        const char *rr = NULL, *sr = NULL;
        if (s->final[i] != KVW_POLL_FAILED)
            continue;
        kvw_receiver_failure(s->rooms[i].r, &rr);
        kvw_sender_failure(s->rooms[i].s, &sr);
        print_message("  room %llu failed: decode '%s', prefill '%s'\n",
                      (unsigned long long)s->rooms[i].room, rr ? rr : "-", sr ? sr : "-");
        shown++;
    }
    qsort(c, connected, sizeof(*c), cmp_u64);
    qsort(x, ok, sizeof(*x), cmp_u64);
    /* Where decode's lookups happen: with KVW_REGISTRY each decode engine
     * reads the ranks once at creation (a watch keeps them); with the
     * bootstrap service each receiver asks it while the storm connects. */
    bool registry = getenv("KVW_REGISTRY") != NULL;
    uint64_t lookup_ms = registry ? s->engines_ms : (connected ? c[connected - 1] : 0);
    unsigned lookups = registry ? s->n - 1 : connected;
    print_message("storm lookups (%s): %u in %llu ms, %.0f per second\n",
                  registry ? "registry reads at engine creation" : "bootstrap service, receivers",
                  lookups, (unsigned long long)lookup_ms,
                  lookup_ms ? lookups * 1000.0 / (double)lookup_ms : 0.0);
    print_message("storm (fake NIC, not RDMA): %u decode engines, receivers created in %llu ms; "
                  "connected %u, p50 %llu ms, p99 %llu ms, max %llu ms; requests ok %u, failed "
                  "%u, unfinished %u; connected->done p50 %llu ms, max %llu ms; wrong bytes %zu; "
                  "duplicate handshakes %d, refusals %d, timeouts %d\n",
                  s->n, (unsigned long long)created_ms, connected,
                  (unsigned long long)(connected ? pct(c, connected, 50) : 0),
                  (unsigned long long)(connected ? pct(c, connected, 99) : 0),
                  (unsigned long long)(connected ? c[connected - 1] : 0), ok, failed,
                  s->n - ok - failed, (unsigned long long)(ok ? pct(x, ok, 50) : 0),
                  (unsigned long long)(ok ? x[ok - 1] : 0), wrong, atomic_load(&reconnects),
                  atomic_load(&refusals), atomic_load(&timeouts));
    assert_int_equal(connected, s->n);
    assert_int_equal(ok, s->n);
    assert_int_equal(failed, 0);
    assert_int_equal(wrong, 0);
    assert_int_equal(atomic_load(&reconnects), 0);
    assert_int_equal(atomic_load(&refusals), 0);
    assert_int_equal(atomic_load(&timeouts), 0);
    free(c);
    free(x);
}

static void storm_close(storm_t *s)
{
    for (unsigned i = 0; i < s->n; i++)
        pair_destroy_room(&s->rooms[i]);
    for (unsigned i = 1; i < s->n; i++)
        kvw_engine_destroy(s->decode[i]);
    pair_close(&pair);
    free(s->decode);
    free(s->rooms);
    free(s->connected_ms);
    free(s->done_ms);
    free(s->final);
}

static void test_storm(void **state)
{
    (void)state;
    const char *env = getenv("KVW_STORM_ENGINES");
    storm_t s = {.n = env ? (unsigned)strtoul(env, NULL, 10) : 1024};
    assert_true(s.n >= 1);
    storm_open(&s);
    uint64_t created = storm_run(&s);
    connected_times(&s);
    storm_report(&s, created);
    storm_close(&s);
}

int main(void)
{
    kvw_set_log_handler(count_log, NULL, KVW_LOG_WARN);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_storm)};
    return cmocka_run_group_tests_name("handshake storm on the fake NIC (not RDMA)", tests, NULL,
                                       NULL);
}
