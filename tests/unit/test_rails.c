/* SPDX-License-Identifier: Apache-2.0 */
/* Rails: an engine on several devices (KVW_DEVICES), on the fake NIC (not
 * RDMA). Each side's regions are registered on every rail with that
 * rail's PD, so a write built with another rail's keys fails on the fake
 * NIC as on a real one: every byte landing is the proof that each lane
 * used its own rail's lkeys and the peer rail's rkeys. The WRs each rail
 * carried are counted (kvw_engine_rails). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/engine.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"
#include "verbs/device.h"

enum { WAIT_MS = 20000, ROOMS = 4, PAGES = 12 };

static engine_pair_t pair;
static bool opened; /* pair_open ran: the teardown closes it, even after a failed assertion */

static void quiet_log(void)
{
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
}

/* Both sides' configs with these rails and QPs per rail. */
static void open_rails(const char *prefill_devs, const char *decode_devs, uint32_t qps)
{
    kvw_config_t pc, dc;
    pair_config(&pc);
    pc.qps_per_peer = qps;
    dc = pc;
    snprintf(pc.devices, sizeof(pc.devices), "%s", prefill_devs);
    snprintf(dc.devices, sizeof(dc.devices), "%s", decode_devs);
    quiet_log();
    pair_set_nic_devices(4);
    opened = true;
    assert_int_equal(pair_open2(&pair, &pc, &dc), KVW_OK);
}

static int close_rails(void **state)
{
    (void)state;
    if (opened)
        pair_close(&pair);
    opened = false;
    pair_set_nic_devices(0);
    return 0;
}

/* ROOMS requests at once, each checked byte for byte. */
static void transfer_rooms(void)
{
    pair_room_t rooms[ROOMS];
    for (uint32_t i = 0; i < ROOMS; i++) {
        pair_pick(&rooms[i], 10 + i, PAGES, 7919u * (i + 1), i);
        assert_int_equal(pair_create(&pair, &rooms[i]), KVW_OK);
        assert_int_equal(kvw_receiver_init(rooms[i].r, rooms[i].dst, rooms[i].n, rooms[i].aux_dst),
                         KVW_OK);
        assert_int_equal(kvw_sender_init(rooms[i].s, rooms[i].n, rooms[i].aux_src), KVW_OK);
    }
    for (uint32_t i = 0; i < ROOMS; i++)
        assert_int_equal(kvw_sender_send(rooms[i].s, rooms[i].src, rooms[i].n), KVW_OK);
    for (uint32_t i = 0; i < ROOMS; i++) {
        const char *why = "";
        if (pair_wait_receiver(&rooms[i], WAIT_MS) != KVW_POLL_SUCCESS)
            kvw_receiver_failure(rooms[i].r, &why);
        assert_string_equal(why, "");
        assert_int_equal(pair_wait_sender(&rooms[i], WAIT_MS), KVW_POLL_SUCCESS);
        assert_int_equal(pair_wrong_bytes(&pair, &rooms[i]), 0);
        pair_destroy_room(&rooms[i]);
    }
}

/* Prefill's rails, with their WR counts; returns how many. */
static uint32_t prefill_rails(kvw_rail_t *rails)
{
    return kvw_engine_rails(pair.prefill, rails, KVW_MAX_RAILS);
}

/* The rail counts add up to the engine's WR count. */
static void assert_rails_sum(const kvw_rail_t *rails, uint32_t n)
{
    kvw_counters_t c;
    kvw_engine_counters(pair.prefill, &c);
    uint64_t wrs = 0, bytes = 0;
    for (uint32_t r = 0; r < n; r++) {
        wrs += rails[r].wrs_posted;
        bytes += rails[r].bytes_posted;
    }
    assert_int_equal(wrs, c.wrs_posted);
    assert_int_equal(bytes, c.bytes_posted);
}

/* Two rails on each side: a lane on each rail pair (fake0 <-> fake1,
 * fake2 <-> fake3); every request is striped over both, its last writes
 * carry an immediate on each, and every byte lands. */
static void test_two_rails_each_side(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_string_equal(rails[0].device, "fake0");
    assert_string_equal(rails[1].device, "fake2");
    print_message("WRs per rail: %s %llu, %s %llu\n", rails[0].device,
                  (unsigned long long)rails[0].wrs_posted, rails[1].device,
                  (unsigned long long)rails[1].wrs_posted);
    assert_true(rails[0].wrs_posted > 0);
    assert_true(rails[1].wrs_posted > 0);
    assert_rails_sum(rails, 2);
    /* Equal links: equal turns, so neither rail carries more than twice
     * the other (chains alternate; a request's tail may fall on either). */
    assert_true(rails[0].wrs_posted <= 2 * rails[1].wrs_posted + 16);
    assert_true(rails[1].wrs_posted <= 2 * rails[0].wrs_posted + 16);
    kvw_rail_t drails[KVW_MAX_RAILS];
    assert_int_equal(kvw_engine_rails(pair.decode, drails, KVW_MAX_RAILS), 2);
    assert_string_equal(drails[1].device, "fake3");
}

/* Two QPs per rail: four lanes, two per rail pair. */
static void test_two_rails_two_qps(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 2);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_true(rails[0].wrs_posted > 0 && rails[1].wrs_posted > 0);
    assert_rails_sum(rails, 2);
}

/* Prefill has one rail, decode two: prefill's one device writes to both
 * of decode's, each lane with the rkeys of its decode rail. */
static void test_decode_rails_only(void **state)
{
    (void)state;
    open_rails("fake0", "fake1,fake3", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 1);
    assert_true(rails[0].wrs_posted > 0);
    assert_rails_sum(rails, 1);
}

/* Prefill has two rails, decode one: the rails both share is one, so
 * every write goes on prefill's first rail and none on its second. */
static void test_prefill_rails_only(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_true(rails[0].wrs_posted > 0);
    assert_int_equal(rails[1].wrs_posted, 0);
    assert_rails_sum(rails, 2);
}

/* A malformed KVW_DEVICES refuses the engine. */
static void test_bad_device_lists(void **state)
{
    (void)state;
    static const char *bad[] = {"fake0,fake0", "fake0,fake1,fake2,fake3,fake4", "nosuch0,fake1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvw_config_t pc;
        pair_config(&pc);
        snprintf(pc.devices, sizeof(pc.devices), "%s", bad[i]);
        pair_set_nic_devices(8);
        opened = true;
        assert_int_not_equal(pair_open(&pair, &pc), KVW_OK);
        assert_null(pair.prefill);
        close_rails(NULL);
    }
}

/* Link speeds from ibv_query_port's codes. */
static void test_link_mbps(void **state)
{
    (void)state;
    assert_int_equal(kvw__link_mbps(1, 1), 2500);     /* SDR 1x */
    assert_int_equal(kvw__link_mbps(32, 2), 100000);  /* EDR 4x */
    assert_int_equal(kvw__link_mbps(64, 2), 200000);  /* HDR 4x */
    assert_int_equal(kvw__link_mbps(128, 2), 400000); /* NDR 4x */
    assert_int_equal(kvw__link_mbps(0, 2), 0);        /* unknown */
    assert_int_equal(kvw__link_mbps(32, 3), 0);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_two_rails_each_side, close_rails),
        cmocka_unit_test_teardown(test_two_rails_two_qps, close_rails),
        cmocka_unit_test_teardown(test_decode_rails_only, close_rails),
        cmocka_unit_test_teardown(test_prefill_rails_only, close_rails),
        cmocka_unit_test_teardown(test_bad_device_lists, close_rails),
        cmocka_unit_test(test_link_mbps),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
