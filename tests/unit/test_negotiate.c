/* SPDX-License-Identifier: Apache-2.0 */
/* The wire's negotiation (wire 12, docs/control-plane.md "Versions and
 * capabilities") between two engines on the fake NIC (tests/support: not
 * RDMA). Each test narrows what one engine offers (its versions, its
 * capabilities) before the first request connects it, to play another
 * build: the connection speaks the highest version both speak and uses
 * only the capabilities both have, and is refused, with a reason naming
 * both ranges, only when no version is common. The real 1.4.0 is the rxe
 * test's (tests/integration/compat_scenarios.sh). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core.h"
#include "support/engine_pair.h"

enum { WAIT_MS = 5000 };

static engine_pair_t pair;

static int open_pair(kvw_wire_offer_t prefill, kvw_wire_offer_t decode, uint32_t verify)
{
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    kvw_config_t cfg;
    pair_config(&cfg);
    cfg.verify = verify;
    if (pair_open(&pair, &cfg))
        return -1;
    /* Before any request: no connection has read them yet. */
    pair.prefill->wire = prefill;
    pair.decode->wire = decode;
    return 0;
}

static int close_pair(void **state)
{
    (void)state;
    pair_close(&pair);
    return 0;
}

static void start(pair_room_t *pr, uint64_t room)
{
    pair_pick(pr, room, 6, room * 7919u + 1, 0);
    assert_int_equal(pair_create(&pair, pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr->r, pr->dst, pr->n, pr->aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr->s, pr->n, pr->aux_src), KVW_OK);
}

/* One request lands byte for byte. */
static void transfer(uint64_t room)
{
    pair_room_t pr;
    start(&pr, room);
    assert_int_equal(kvw_sender_send(pr.s, pr.src, pr.n), KVW_OK);
    const char *why = "";
    if (pair_wait_receiver(&pr, WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_receiver_failure(pr.r, &why);
    assert_string_equal(why, "");
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, &pr), 0);
    pair_destroy_room(&pr);
}

/* What each side's (only) connection agreed. */
static void assert_agreed(uint16_t version, uint32_t caps)
{
    kvw_engine_t *sides[2] = {pair.prefill, pair.decode};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(atomic_load(&sides[i]->num_peers), 1);
        const kvw_peer_t *p = kvw__peer_at(sides[i], 0);
        assert_non_null(p);
        assert_int_equal(p->wire_version, version);
        assert_int_equal(p->wire_caps, caps);
    }
}

/* The request's receiver Failed with st, its reason holding want. */
static void assert_receiver_failed(const pair_room_t *pr, kvw_status_t st, const char *want)
{
    assert_int_equal(pair_wait_receiver(pr, WAIT_MS), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(pr->r, &why), st);
    if (!strstr(why, want))
        fail_msg("reason \"%s\" does not say \"%s\"", why, want);
}

static const kvw_wire_offer_t NEW = {KVW_WIRE_VERSION_MIN, KVW_WIRE_VERSION, KVW_WIRE_CAPS_ALL};

/* Two engines of this build: the newest version, every capability. */
static void test_both_new(void **state)
{
    (void)state;
    assert_int_equal(open_pair(NEW, NEW, 0), 0);
    transfer(1);
    assert_agreed(KVW_WIRE_VERSION, KVW_WIRE_CAPS_ALL);
}

/* Ranges that overlap in part: the highest version both speak, whichever
 * side speaks more. Decode opens in the format of its oldest version. */
static void test_partial_overlap_prefill_older(void **state)
{
    (void)state;
    assert_int_equal(open_pair((kvw_wire_offer_t){11, 11, KVW_WIRE_CAPS_ALL}, NEW, 0), 0);
    transfer(2);
    assert_agreed(11, KVW_WIRE_CAPS_ALL);
}

static void test_partial_overlap_decode_older(void **state)
{
    (void)state;
    assert_int_equal(open_pair((kvw_wire_offer_t){12, 12, KVW_WIRE_CAPS_ALL},
                               (kvw_wire_offer_t){11, 12, KVW_WIRE_CAPS_ALL}, 0),
                     0);
    transfer(3);
    assert_agreed(12, KVW_WIRE_CAPS_ALL);
}

/* No common version: refused, and the reason names both ranges (decode
 * opening at 11 to a prefill of 12 alone, and at 12 to one of 11 alone). */
static void test_no_overlap_refused(void **state)
{
    (void)state;
    assert_int_equal(open_pair((kvw_wire_offer_t){12, 12, KVW_WIRE_CAPS_ALL},
                               (kvw_wire_offer_t){11, 11, KVW_WIRE_CAPS_ALL}, 0),
                     0);
    pair_room_t pr;
    start(&pr, 4);
    assert_receiver_failed(&pr, KVW_ERR_MISMATCH,
                           "no common wire version: prefill speaks 12..12, decode 11..11");
    pair_destroy_room(&pr);
    /* Counted as refused on both sides, nothing transferred. */
    kvw_counters_t c = {0};
    assert_int_equal(kvw_engine_counters_ex(pair.prefill, &c, sizeof(c)), KVW_OK);
    assert_int_equal(c.requests_ok, 0);
    assert_int_equal(c.handshakes, 0);
    assert_true(c.handshakes_refused >= 1);
    assert_int_equal(kvw_engine_counters_ex(pair.decode, &c, sizeof(c)), KVW_OK);
    assert_int_equal(c.handshakes, 0);
    assert_true(c.handshakes_refused >= 1);
}

static void test_no_overlap_refused_decode_newer(void **state)
{
    (void)state;
    assert_int_equal(open_pair((kvw_wire_offer_t){11, 11, KVW_WIRE_CAPS_ALL},
                               (kvw_wire_offer_t){12, 12, KVW_WIRE_CAPS_ALL}, 0),
                     0);
    pair_room_t pr;
    start(&pr, 5);
    assert_receiver_failed(&pr, KVW_ERR_MISMATCH,
                           "no common wire version: prefill speaks 11..11, decode 12..12");
    pair_destroy_room(&pr);
}

/* A capability one side lacks is not used: a prefill without verify
 * connects and serves requests, and a request that needs verify (decode's
 * KVW_VERIFY=1) is Failed at decode, naming it, and never sent (prefill's
 * sender never hears of it). */
static void test_capability_lacking_not_used(void **state)
{
    (void)state;
    uint32_t caps = KVW_WIRE_CAPS_ALL & ~KVW_WIRE_CAP_VERIFY;
    assert_int_equal(open_pair((kvw_wire_offer_t){11, 12, caps}, NEW, 1), 0);
    pair_room_t pr;
    start(&pr, 6);
    assert_receiver_failed(&pr, KVW_ERR_UNSUPPORTED, "needs verify, which prefill rank 0");
    assert_agreed(KVW_WIRE_VERSION, caps);
    assert_int_equal(kvw_sender_poll(pr.s), KVW_POLL_BOOTSTRAPPING);
    pair_destroy_room(&pr);
}

/* The same connection without verify on either side: it transfers. */
static void test_capability_lacking_connection_works(void **state)
{
    (void)state;
    uint32_t caps = KVW_WIRE_CAPS_ALL & ~(KVW_WIRE_CAP_VERIFY | KVW_WIRE_CAP_CLOSING);
    assert_int_equal(open_pair(NEW, (kvw_wire_offer_t){11, 12, caps}, 0), 0);
    transfer(7);
    transfer(8);
    assert_agreed(KVW_WIRE_VERSION, caps);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_both_new, close_pair),
        cmocka_unit_test_teardown(test_partial_overlap_prefill_older, close_pair),
        cmocka_unit_test_teardown(test_partial_overlap_decode_older, close_pair),
        cmocka_unit_test_teardown(test_no_overlap_refused, close_pair),
        cmocka_unit_test_teardown(test_no_overlap_refused_decode_newer, close_pair),
        cmocka_unit_test_teardown(test_capability_lacking_not_used, close_pair),
        cmocka_unit_test_teardown(test_capability_lacking_connection_works, close_pair),
    };
    return cmocka_run_group_tests_name("negotiate", tests, NULL, NULL);
}
