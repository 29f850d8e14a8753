/* SPDX-License-Identifier: Apache-2.0 */
/* Sized outputs (include/kvwire.h, kvw_engine_counters_ex): the library
 * fills min(size, its own sizeof) bytes of the caller's struct and writes
 * nothing beyond; the older entry points fill their first release's
 * fields only. A program built against an older header (a smaller struct)
 * and one built against a newer (a larger one) are played here with
 * buffers of those sizes around canary bytes. Engines on the fake NIC
 * (tests/support: not RDMA). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/engine_pair.h"

enum { WAIT_MS = 5000, CANARY = 0x5a, BIG = 256 };

static engine_pair_t pair;
static pair_room_t room;

/* One transfer, so every count has something in it. */
static int open_pair(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    if (pair_open(&pair, NULL))
        return -1;
    pair_pick(&room, 1, 5, 17, 0);
    if (pair_create(&pair, &room) || kvw_receiver_init(room.r, room.dst, room.n, room.aux_dst) ||
        kvw_sender_init(room.s, room.n, room.aux_src) || kvw_sender_send(room.s, room.src, room.n))
        return -1;
    return pair_wait_receiver(&room, WAIT_MS) == KVW_POLL_SUCCESS &&
                   pair_wait_sender(&room, WAIT_MS) == KVW_POLL_SUCCESS
               ? 0
               : -1;
}

static int close_pair(void **state)
{
    (void)state;
    pair_destroy_room(&room);
    pair_close(&pair);
    return 0;
}

static size_t canaries_from(const uint8_t *buf, size_t from)
{
    size_t n = 0;
    for (size_t i = from; i < BIG; i++)
        n += buf[i] == CANARY;
    return n;
}

/* A caller's struct of `size` bytes in a buffer of canaries. */
static kvw_status_t counters_into(uint8_t *buf, size_t size)
{
    memset(buf, CANARY, BIG);
    return kvw_engine_counters_ex(pair.prefill, (kvw_counters_t *)buf, size);
}

static void test_counters_sizes(void **state)
{
    (void)state;
    _Alignas(8) uint8_t buf[BIG];
    kvw_counters_t full;
    memset(&full, 0, sizeof(full));
    assert_int_equal(kvw_engine_counters_ex(pair.prefill, &full, sizeof(full)), KVW_OK);
    assert_true(full.wrs_posted > 0);
    assert_int_equal(full.requests_ok, 1);
    assert_int_equal(full.handshakes, 1); /* appended in 1.5: the one connection */
    assert_int_equal(full.handshakes_refused, 0);

    /* 1.0's struct (a program built then): those bytes, nothing after. */
    assert_int_equal(counters_into(buf, KVW_COUNTERS_SIZE_1_0), KVW_OK);
    assert_memory_equal(buf, &full, offsetof(kvw_counters_t, cq_sleeps));
    assert_int_equal(canaries_from(buf, KVW_COUNTERS_SIZE_1_0), BIG - KVW_COUNTERS_SIZE_1_0);

    /* A newer struct than this library's: its own size filled, the
     * caller's fields beyond it left as they were. */
    assert_int_equal(counters_into(buf, BIG), KVW_OK);
    assert_int_equal(canaries_from(buf, sizeof(kvw_counters_t)), BIG - sizeof(kvw_counters_t));
    kvw_counters_t got;
    memcpy(&got, buf, sizeof(got));
    assert_int_equal(got.handshakes, 1);
    assert_int_equal(got.requests_ok, 1);

    /* The 1.0 entry point fills 1.0's fields only. */
    memset(buf, CANARY, BIG);
    kvw_engine_counters(pair.prefill, (kvw_counters_t *)buf);
    assert_int_equal(canaries_from(buf, KVW_COUNTERS_SIZE_1_0), BIG - KVW_COUNTERS_SIZE_1_0);

    /* Below the first release's size, or NULL: refused, nothing written. */
    assert_int_equal(counters_into(buf, KVW_COUNTERS_SIZE_1_0 - 8), KVW_ERR_INVALID);
    assert_int_equal(canaries_from(buf, 0), BIG);
    assert_int_equal(kvw_engine_counters_ex(NULL, &full, sizeof(full)), KVW_ERR_INVALID);
    assert_int_equal(kvw_engine_counters_ex(pair.prefill, NULL, sizeof(full)), KVW_ERR_INVALID);
}

static void test_metrics_sizes(void **state)
{
    (void)state;
    kvw_req_metrics_t old_way, full;
    assert_int_equal(kvw_sender_metrics(room.s, &old_way), KVW_OK);
    assert_int_equal(kvw_sender_metrics_ex(room.s, &full, sizeof(full)), KVW_OK);
    assert_memory_equal(&old_way, &full, sizeof(full));
    assert_true(full.writes > 0 && full.bytes > 0);
    _Alignas(8) uint8_t buf[BIG];
    memset(buf, CANARY, BIG);
    assert_int_equal(kvw_receiver_metrics_ex(room.r, (kvw_req_metrics_t *)buf, BIG), KVW_OK);
    assert_int_equal(canaries_from(buf, sizeof(kvw_req_metrics_t)),
                     BIG - sizeof(kvw_req_metrics_t));
    kvw_req_metrics_t got;
    memcpy(&got, buf, sizeof(got));
    assert_int_equal(got.bytes, full.bytes);
    assert_true(got.end_ns >= got.start_ns && got.start_ns > 0);
    memset(buf, CANARY, BIG);
    assert_int_equal(kvw_receiver_metrics_ex(room.r, (kvw_req_metrics_t *)buf, 16),
                     KVW_ERR_INVALID);
    assert_int_equal(canaries_from(buf, 0), BIG);
    assert_int_equal(kvw_sender_metrics_ex(NULL, &full, sizeof(full)), KVW_ERR_INVALID);
    assert_int_equal(kvw_sender_metrics_ex(room.s, NULL, sizeof(full)), KVW_ERR_INVALID);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_counters_sizes),
        cmocka_unit_test(test_metrics_sizes),
    };
    return cmocka_run_group_tests_name("outputs", tests, open_pair, close_pair);
}
