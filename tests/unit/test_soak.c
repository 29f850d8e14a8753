/* SPDX-License-Identifier: Apache-2.0 */
/* Soak: one prefill engine lives while decode engines come and go, as in a
 * cluster over weeks. Every cycle a new decode engine connects, transfers a
 * room (bytes verified) and goes away; every tenth dies mid-request (its
 * device killed, as a crashed process leaves it). With max_peers = 4 the
 * prefill must reclaim every dead connection's slot or it would refuse the
 * fifth engine. File descriptors, threads and live heap are printed and
 * must stay flat.
 *
 * On the fake NIC (tests/support/fake_nic.h): engine-level, not RDMA. The
 * same soak on real rxe runs in tests/integration/soak_scenarios.sh.
 * KVW_SOAK_CYCLES sets the number of cycles (default 10000). */
#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HAVE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define HAVE_ASAN 1
#endif
#ifdef HAVE_ASAN
/* From the sanitizer runtime (sanitizer/allocator_interface.h, which gcc
 * does not ship): bytes the program has allocated and not freed. */
size_t __sanitizer_get_current_allocated_bytes(void);
#endif

enum { WAIT_MS = 10000, WARM_CYCLES = 200, KILL_EVERY = 10 };

typedef struct usage {
    int fds, threads;
    long rss_kib;
    size_t heap; /* live heap bytes (ASan builds), else 0 */
} usage_t;

static int count_dir(const char *path)
{
    DIR *d = opendir(path);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

static usage_t usage_now(void)
{
    usage_t u = {count_dir("/proc/self/fd"), count_dir("/proc/self/task"), 0, 0};
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (f) {
        if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
            resident = 0;
        fclose(f);
    }
    u.rss_kib = resident * (sysconf(_SC_PAGESIZE) / 1024);
#ifdef HAVE_ASAN
    u.heap = __sanitizer_get_current_allocated_bytes();
#endif
    return u;
}

static void print_usage(const char *when, unsigned cycle, const usage_t *u)
{
    print_message("soak %-6s cycle %6u: %3d fds, %2d threads, RSS %6ld KiB, live heap %7zu KiB\n",
                  when, cycle, u->fds, u->threads, u->rss_kib, u->heap / 1024);
}

static engine_pair_t pair;

/* A clean cycle: the room lands, then both handles and the engine go. */
static void clean_cycle(pair_room_t *a)
{
    assert_int_equal(kvw_sender_send(a->s, a->src, a->n), KVW_OK);
    assert_int_equal(pair_wait_receiver(a, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(a, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, a), 0);
}

/* The decode process dies with the request in flight: prefill's writes
 * fail, its connection must die and its slot come back. */
static void kill_cycle(pair_room_t *a)
{
    assert_int_equal(pair_wait_sender_ready(a, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
    fake_nic_kill_device("fake1");
    assert_int_equal(kvw_sender_send(a->s, a->src, a->n), KVW_OK);
    assert_int_equal(pair_wait_sender(a, WAIT_MS), KVW_POLL_FAILED);
}

static void one_cycle(unsigned i)
{
    bool kill = i % KILL_EVERY == KILL_EVERY - 1;
    pair_room_t a;
    pair_pick(&a, i + 1, 4, i, 0);
    assert_int_equal(pair_create(&pair, &a), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    if (kill)
        kill_cycle(&a);
    else
        clean_cycle(&a);
    pair_destroy_room(&a);
    kvw_engine_destroy(pair.decode);
    pair.decode = NULL;
    if (kill)
        fake_nic_revive_device("fake1");
    assert_int_equal(pair_add_decode(&pair, &pair.decode), KVW_OK);
}

/* Dead connections are reclaimed by the control thread shortly after they
 * drain; wait for it rather than race it. */
static uint32_t wait_prefill_peers(uint32_t at_most)
{
    uint32_t n = 0;
    for (int i = 0; i < 500; i++) {
        n = atomic_load(&pair.prefill->num_peers);
        if (n <= at_most)
            break;
        pair_sleep_ms(10);
    }
    return n;
}

static void test_soak(void **state)
{
    (void)state;
    const char *env = getenv("KVW_SOAK_CYCLES");
    unsigned cycles = env ? (unsigned)strtoul(env, NULL, 10) : 10000;
    kvw_config_t cfg;
    pair_config(&cfg);
    cfg.max_peers = 4; /* without reclaim, the fifth decode engine is refused */
    assert_int_equal(pair_open(&pair, &cfg), KVW_OK);
    usage_t warm = {0}, u;
    uint64_t t0 = pair_now_ms();
    for (unsigned i = 0; i < cycles; i++) {
        one_cycle(i);
        if (i + 1 == WARM_CYCLES || (i + 1) % 2000 == 0 || i + 1 == cycles) {
            wait_prefill_peers(1);
            u = usage_now();
            print_usage(i + 1 == WARM_CYCLES ? "warm" : "", i + 1, &u);
            if (i + 1 == WARM_CYCLES)
                warm = u;
        }
    }
    uint64_t ms = pair_now_ms() - t0;
    print_message("soak: %u decode connect/transfer/disconnect cycles (%u killed) in %.1f s, "
                  "%.2f ms each; prefill holds %u connection slot(s), %zu request(s)\n",
                  cycles, cycles / KILL_EVERY, ms / 1000.0, (double)ms / (cycles ? cycles : 1),
                  wait_prefill_peers(1), pair_table_size(pair.prefill));
    assert_true(wait_prefill_peers(1) <= 1); /* only the current decode engine */
    if (cycles > WARM_CYCLES) {
        /* Flat: no descriptor, thread or heap growth with the cycles. */
        assert_true(u.fds <= warm.fds);
        assert_true(u.threads <= warm.threads);
        assert_true(u.heap <= warm.heap + (1u << 20));
    }
    pair_close(&pair);
}

int main(void)
{
    /* 10,000 connections dying are 30,000 warnings: KVW_TEST_LOG=1 shows them. */
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_soak)};
    return cmocka_run_group_tests_name("soak on the fake NIC (not RDMA)", tests, NULL, NULL);
}
