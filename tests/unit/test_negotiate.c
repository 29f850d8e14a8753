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

/* An engine of the classic layout (one layer: K, V) whose 4-token pages
 * hold 2 heads of 32 bytes, describing them (prefill, rank 1) or learning
 * them from prefill (decode, attention TP rank 0 of 1). */
static kvw_engine_t *heads_engine(kvw_role_t role, uint8_t *mem[2])
{
    enum { ITEM = 4 * 2 * 32, POOL = 8 };
    kvw_region_t kv[2];
    for (int i = 0; i < 2; i++) {
        mem[i] = calloc(POOL, ITEM);
        assert_non_null(mem[i]);
        kv[i] = (kvw_region_t){mem[i], POOL * ITEM, ITEM};
    }
    bool prefill = role == KVW_ROLE_PREFILL;
    kvw_group_heads_t heads = prefill ? (kvw_group_heads_t){2, 0, 2, 32, 4, KVW_PAGE_NHD}
                                      : (kvw_group_heads_t){0, 0, 0, 0, 4, KVW_PAGE_NHD};
    kvw_engine_params_t p = {.struct_size = sizeof(p),
                             .role = role,
                             .device = prefill ? "fake0" : "fake1",
                             .local_ip = "127.0.0.1",
                             .bootstrap_addr = prefill ? kvw_bootstrap_addr(pair.bootstrap) : NULL,
                             .config = &pair.cfg,
                             .engine_rank = 1,
                             .num_layers = 1,
                             .kv_regions = kv,
                             .group_heads = &heads,
                             .attn_tp_size = prefill ? 0 : 1};
    kvw_engine_t *e = NULL;
    assert_int_equal(kvw_engine_create(&p, &e), KVW_OK);
    return e;
}

/* A decode engine learning its heads from prefill (1.5, capability 0x20)
 * and a prefill that lacks the capability (1.4.x: wire 11 and its
 * capabilities only), describing its heads: prefill reads decode's
 * learning group as undescribed and refuses the handshake, saying so;
 * decode learns nothing. */
static void test_learning_decode_old_prefill_refused(void **state)
{
    (void)state;
    assert_int_equal(open_pair(NEW, NEW, 0), 0);
    uint8_t *pm[2], *dm[2];
    kvw_engine_t *prefill = heads_engine(KVW_ROLE_PREFILL, pm);
    kvw_engine_t *decode = heads_engine(KVW_ROLE_DECODE, dm);
    prefill->wire = (kvw_wire_offer_t){11, 11, KVW_WIRE_CAPS_V11}; /* before any connection */
    kvw_receiver_t *r;
    uint64_t page = 1;
    assert_int_equal(kvw_receiver_create(decode, kvw_bootstrap_addr(pair.bootstrap), 1, 9, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, &page, 1, KVW_NO_AUX), KVW_OK);
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (kvw_receiver_poll(r) != KVW_POLL_FAILED && pair_now_ms() < end)
        pair_sleep_ms(1);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "kv group 0: peer does not describe its heads, ours does"));
    pthread_mutex_lock(&decode->lock);
    assert_int_equal(decode->layout.groups[0].heads.total, 0);
    pthread_mutex_unlock(&decode->lock);
    kvw_receiver_destroy(r);
    kvw_engine_destroy(decode);
    kvw_engine_destroy(prefill);
    for (int i = 0; i < 2; i++) {
        free(pm[i]);
        free(dm[i]);
    }
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
        cmocka_unit_test_teardown(test_learning_decode_old_prefill_refused, close_pair),
    };
    return cmocka_run_group_tests_name("negotiate", tests, NULL, NULL);
}
