/* SPDX-License-Identifier: Apache-2.0 */
/* Verified transfers (config verify, engine/verify.h) on the fake NIC and
 * the fake CUDA seam (tests/support: not RDMA, not a GPU). A request whose
 * bytes changed between prefill's memory and decode's check is Failed
 * with KVW_ERR_CORRUPT, never Success: a byte flipped in flight (the fake
 * NIC's flip_byte fault), one flipped in decode's memory after it landed
 * (the test hook, just before decode's digest), on host memory, through
 * the staging pool, and with the caller's own digests (GPU memory the NIC
 * reaches directly). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/crc32c.h"
#include "engine/verify.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

enum { WAIT_MS = 5000 };

static engine_pair_t pair;

static void quiet(void)
{
    /* KVW_TEST_LOG=1 shows the engines' own account of each test. */
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
}

static void verify_config(kvw_config_t *cfg, uint32_t verify)
{
    pair_config(cfg);
    cfg->verify = verify;
}

static int open_verified(void **state)
{
    (void)state;
    quiet();
    kvw_config_t cfg;
    verify_config(&cfg, 1);
    return pair_open(&pair, &cfg) == KVW_OK ? 0 : -1;
}

/* Both sides' KV regions in fake GPU memory without GPUDirect RDMA:
 * every KV byte goes through the staging pools. */
static int open_staged(void **state)
{
    (void)state;
    quiet();
    kvw_config_t cfg;
    verify_config(&cfg, 1);
    return pair_open_staged(&pair, &cfg, NULL, true, true, NULL) == KVW_OK ? 0 : -1;
}

/* Fake GPU memory with GPUDirect RDMA: registered directly (dma-buf), so
 * kvwire leaves the digests to the caller. */
static int open_direct_gpu(void **state)
{
    (void)state;
    quiet();
    kvw_config_t cfg;
    verify_config(&cfg, 1);
    fake_cuda_config_t cuda = {.gdr = 1};
    return pair_open_staged(&pair, &cfg, NULL, true, true, &cuda) == KVW_OK ? 0 : -1;
}

static int close_pair(void **state)
{
    (void)state;
    kvw__verify_hook = NULL;
    fake_nic_set_faults(NULL);
    pair_close(&pair);
    return 0;
}

static void start(pair_room_t *pr, uint64_t room, size_t n, uint32_t slot)
{
    pair_pick(pr, room, n, room * 7919u + 1, slot);
    assert_int_equal(pair_create(&pair, pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr->r, pr->dst, pr->n, pr->aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr->s, pr->n, pr->aux_src), KVW_OK);
}

static void send_now(pair_room_t *pr)
{
    assert_int_equal(kvw_sender_send(pr->s, pr->src, pr->n), KVW_OK);
}

static void assert_landed(const pair_room_t *pr)
{
    const char *why = "";
    if (pair_wait_receiver(pr, WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_receiver_failure(pr->r, &why);
    assert_string_equal(why, "");
    assert_int_equal(pair_wait_sender(pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, pr), 0);
}

/* Decode Failed with KVW_ERR_CORRUPT naming the room and both digests;
 * prefill, every write of which completed, a Success. */
static void assert_corrupt(const pair_room_t *pr)
{
    assert_int_equal(pair_wait_receiver(pr, WAIT_MS), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(pr->r, &why), KVW_ERR_CORRUPT);
    assert_non_null(strstr(why, "differ from what prefill sent"));
    assert_non_null(strstr(why, "prefill's digest 0x"));
    assert_non_null(strstr(why, "decode's 0x"));
    assert_int_equal(pair_wait_sender(pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_string_equal(kvw_status_name(KVW_ERR_CORRUPT), "KVW_ERR_CORRUPT");
}

/* ---- host memory ----------------------------------------------------------- */

static void test_clean_transfers_succeed(void **state)
{
    (void)state;
    pair_room_t rooms[4];
    for (uint32_t i = 0; i < 4; i++)
        start(&rooms[i], 100 + i, 9 + i, i);
    for (uint32_t i = 0; i < 4; i++)
        send_now(&rooms[i]);
    for (uint32_t i = 0; i < 4; i++) {
        assert_landed(&rooms[i]);
        pair_destroy_room(&rooms[i]);
    }
}

/* Parts handed over layer by layer: each is summed as it is posted. */
static void test_layer_parts_succeed(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 7, 10, 0);
    for (uint32_t l = 0; l < PAIR_LAYERS; l++) {
        kvw_part_t part = {pr.src, 6, 0, l, l + 1};
        assert_int_equal(kvw_sender_send_part(pr.s, &part), KVW_OK);
        kvw_part_t rest = {pr.src + 6, 4, 6, l, l + 1};
        assert_int_equal(kvw_sender_send_part(pr.s, &rest), KVW_OK);
    }
    assert_landed(&pr);
    pair_destroy_room(&pr);
}

static void test_flip_in_flight_fails(void **state)
{
    (void)state;
    fake_nic_set_faults(&(fake_nic_faults_t){.flip_byte = 1000});
    pair_room_t pr;
    start(&pr, 11, 12, 0);
    send_now(&pr);
    assert_corrupt(&pr);
    assert_int_equal(pair_wrong_bytes(&pair, &pr), 1); /* the one byte flipped */
    pair_destroy_room(&pr);
    /* The connection goes on: the next request is clean. */
    fake_nic_set_faults(NULL);
    start(&pr, 12, 12, 1);
    send_now(&pr);
    assert_landed(&pr);
    pair_destroy_room(&pr);
}

/* The aux item is covered too: its write is the request's last. */
static void test_flip_in_aux_fails(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 13, 4, 0);
    assert_int_not_equal(pr.aux_dst, KVW_NO_AUX);
    /* The KV bytes come first, then the aux item's. */
    uint64_t kv = (uint64_t)2 * PAIR_LAYERS * pr.n * PAIR_ITEM;
    fake_nic_set_faults(&(fake_nic_faults_t){.flip_byte = kv + 3});
    send_now(&pr);
    assert_corrupt(&pr);
    pair_destroy_room(&pr);
}

static uint64_t flip_room = UINT64_MAX;
static uint8_t *flip_at;
static atomic_int flips;

/* Decode memory changing after the data landed, before decode's check (a
 * stray kernel, a bad DIMM): the hook runs just before decode's digest. */
static void flip_after_landing(uint64_t room)
{
    if (room != flip_room)
        return;
    *flip_at ^= 0x01;
    atomic_fetch_add(&flips, 1);
}

static void test_flip_after_landing_fails(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 21, 8, 0);
    flip_room = pr.room;
    flip_at = pair.dst[1] + pr.dst[3] * PAIR_ITEM + 17;
    atomic_store(&flips, 0);
    kvw__verify_hook = flip_after_landing;
    send_now(&pr);
    assert_corrupt(&pr);
    assert_int_equal(atomic_load(&flips), 1);
    pair_destroy_room(&pr);
}

/* The sender destroyed the moment it succeeded (as sglang clears it):
 * the engine keeps the request until its DIGEST went out. */
static void test_sender_destroyed_at_success(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 25, 8, 0);
    send_now(&pr);
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    kvw_sender_destroy(pr.s);
    pr.s = NULL;
    const char *why = "";
    if (pair_wait_receiver(&pr, WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_receiver_failure(pr.r, &why);
    assert_string_equal(why, "");
    assert_int_equal(pair_wrong_bytes(&pair, &pr), 0);
    pair_destroy_room(&pr);
    /* The tombstone leaves once the DIGEST went. */
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (pair_table_size(pair.prefill) && pair_now_ms() < end)
        pair_sleep_ms(5);
    assert_int_equal(pair_table_size(pair.prefill), 0);
}

/* Both sides must agree: decode without the check, prefill with it. */
static void test_one_sided_refused(void **state)
{
    (void)state;
    quiet();
    kvw_config_t cfg, dcfg;
    verify_config(&cfg, 1);
    verify_config(&dcfg, 0);
    assert_int_equal(pair_open2(&pair, &cfg, &dcfg), KVW_OK);
    pair_room_t pr;
    start(&pr, 31, 4, 0);
    assert_int_equal(pair_wait_receiver(&pr, WAIT_MS), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(pr.r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "KVW_VERIFY"));
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(pr.s, NULL), KVW_ERR_MISMATCH);
    /* Not the caller's digests here: kvwire reads host memory. */
    assert_int_equal(kvw_sender_set_digest(pr.s, 1), KVW_ERR_STATE);
    assert_int_equal(kvw_receiver_verify(pr.r, 1), KVW_ERR_STATE);
    assert_int_equal(kvw_receiver_landed(pr.r), 0);
    pair_destroy_room(&pr);
}

/* ---- staged ---------------------------------------------------------------- */

static void test_staged_clean_succeeds(void **state)
{
    (void)state;
    pair_room_t rooms[2];
    for (uint32_t i = 0; i < 2; i++)
        start(&rooms[i], 40 + i, 10, i);
    for (uint32_t i = 0; i < 2; i++)
        send_now(&rooms[i]);
    for (uint32_t i = 0; i < 2; i++) {
        assert_landed(&rooms[i]);
        pair_destroy_room(&rooms[i]);
    }
}

/* The flip lands in decode's staging pool and is copied to the GPU with
 * the rest: decode's digest of the slots catches it. */
static void test_staged_flip_fails(void **state)
{
    (void)state;
    fake_nic_set_faults(&(fake_nic_faults_t){.flip_byte = 777});
    pair_room_t pr;
    start(&pr, 50, 10, 0);
    send_now(&pr);
    assert_corrupt(&pr);
    assert_int_equal(pair_wrong_bytes(&pair, &pr), 1);
    pair_destroy_room(&pr);
}

/* ---- the caller's digests (GPU memory the NIC reaches directly) ---------- */

/* The caller's digest: any function of the bytes, the same on both sides
 * (here, CRC32C of every KV page of the request in order, then the aux
 * item). */
static uint64_t caller_digest(uint8_t *const *kv, const uint64_t *pages, size_t n,
                              const uint8_t *aux, uint32_t aux_index)
{
    uint32_t crc = 0;
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        for (size_t k = 0; k < n; k++)
            crc = kvw__crc32c(crc, kv[i] + pages[k] * PAIR_ITEM, PAIR_ITEM);
    if (aux_index != KVW_NO_AUX)
        crc = kvw__crc32c(crc, aux + (uint64_t)aux_index * PAIR_AUX_ITEM, PAIR_AUX_ITEM);
    return crc;
}

static uint64_t prefill_digest(const pair_room_t *pr)
{
    return caller_digest(pair.src, pr->src, pr->n, pair.src_aux, pr->aux_src);
}

static uint64_t decode_digest(const pair_room_t *pr)
{
    return caller_digest(pair.dst, pr->dst, pr->n, pair.dst_aux, pr->aux_dst);
}

/* Decode's caller: wait until the request landed. */
static void wait_landed(const pair_room_t *pr)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (!kvw_receiver_landed(pr->r) && pair_now_ms() < end) {
        kvw_poll_t st = kvw_receiver_poll(pr->r);
        assert_true(st != KVW_POLL_FAILED && st != KVW_POLL_SUCCESS);
        pair_sleep_ms(1);
    }
    assert_int_equal(kvw_receiver_landed(pr->r), 1);
    assert_int_equal(kvw_receiver_poll(pr->r), KVW_POLL_TRANSFERRING); /* not before the check */
}

/* Then compute its digest (xor `spoil`: a wrong one) and hand it over. */
static void verify_landed(const pair_room_t *pr, uint64_t spoil)
{
    uint64_t digest = decode_digest(pr) ^ spoil;
    assert_int_equal(kvw_receiver_verify(pr->r, digest), KVW_OK);
    assert_int_equal(kvw_receiver_verify(pr->r, digest), KVW_ERR_STATE); /* once */
}

static void verify_when_landed(const pair_room_t *pr, uint64_t spoil)
{
    wait_landed(pr);
    verify_landed(pr, spoil);
}

static void test_caller_digest_right_succeeds(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 60, 8, 0);
    assert_int_equal(kvw_receiver_verify(pr.r, 0), KVW_ERR_STATE); /* not landed yet */
    send_now(&pr);
    assert_int_equal(kvw_sender_set_digest(pr.s, prefill_digest(&pr)), KVW_OK);
    assert_int_equal(kvw_sender_set_digest(pr.s, 0), KVW_ERR_STATE); /* once */
    verify_when_landed(&pr, 0);
    assert_landed(&pr);
    pair_destroy_room(&pr);
}

/* The caller's digest given after prefill's Success: the DIGEST waits. */
static void test_caller_digest_late_succeeds(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 61, 8, 0);
    send_now(&pr);
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    verify_when_landed(&pr, 0);
    pair_sleep_ms(20);
    assert_int_equal(kvw_receiver_poll(pr.r), KVW_POLL_TRANSFERRING); /* prefill's still owed */
    assert_int_equal(kvw_sender_set_digest(pr.s, prefill_digest(&pr)), KVW_OK);
    assert_landed(&pr);
    pair_destroy_room(&pr);
}

static void test_caller_digest_wrong_fails(void **state)
{
    (void)state;
    pair_room_t pr;
    start(&pr, 62, 8, 0);
    send_now(&pr);
    assert_int_equal(kvw_sender_set_digest(pr.s, prefill_digest(&pr)), KVW_OK);
    verify_when_landed(&pr, 0x100);
    assert_corrupt(&pr);
    pair_destroy_room(&pr);
}

/* A byte flipped in flight into directly registered memory: the caller's
 * digest of its pages differs from prefill's. */
static void test_caller_digest_flip_fails(void **state)
{
    (void)state;
    fake_nic_set_faults(&(fake_nic_faults_t){.flip_byte = 300});
    pair_room_t pr;
    start(&pr, 63, 8, 0);
    send_now(&pr);
    assert_int_equal(kvw_sender_set_digest(pr.s, prefill_digest(&pr)), KVW_OK);
    verify_when_landed(&pr, 0);
    assert_corrupt(&pr);
    pair_destroy_room(&pr);
}

/* A fan-out sender (one prefill rank, two decode engines, as MLA with
 * decode TP > prefill TP): one caller digest serves both requests. */
static void test_caller_digest_fanout_succeeds(void **state)
{
    (void)state;
    kvw_engine_t *second = NULL;
    assert_int_equal(pair_add_decode(&pair, &second), KVW_OK);
    pair_room_t pr[2];
    pair_pick(&pr[0], 70, 6, 70 * 7919u + 1, 0);
    assert_int_equal(kvw_sender_create_fanout(pair.prefill, 70, 2, &pr[0].s), KVW_OK);
    pr[1] = pr[0];
    kvw_engine_t *decode[2] = {pair.decode, second};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(
            kvw_receiver_create(decode[i], kvw_bootstrap_addr(pair.bootstrap), 0, 70, &pr[i].r),
            KVW_OK);
        assert_int_equal(kvw_receiver_init(pr[i].r, pr[i].dst, pr[i].n, pr[i].aux_dst), KVW_OK);
    }
    assert_int_equal(kvw_sender_init(pr[0].s, pr[0].n, pr[0].aux_src), KVW_OK);
    send_now(&pr[0]);
    assert_int_equal(kvw_sender_set_digest(pr[0].s, prefill_digest(&pr[0])), KVW_OK);
    assert_int_equal(kvw_sender_set_digest(pr[0].s, 1), KVW_ERR_STATE); /* once */
    /* Both requests write the same pages (pr[1] = pr[0], the engines share
     * decode's memory): read them only once both landed. */
    for (int i = 0; i < 2; i++)
        wait_landed(&pr[i]);
    for (int i = 0; i < 2; i++)
        verify_landed(&pr[i], 0);
    for (int i = 0; i < 2; i++)
        assert_landed(&pr[i]);
    for (int i = 0; i < 2; i++)
        kvw_receiver_destroy(pr[i].r);
    kvw_sender_destroy(pr[0].s);
    kvw_engine_destroy(second);
}

int main(int argc, char **argv)
{
    /* An argument runs only the tests whose name contains it. */
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_clean_transfers_succeed, open_verified, close_pair),
        cmocka_unit_test_setup_teardown(test_layer_parts_succeed, open_verified, close_pair),
        cmocka_unit_test_setup_teardown(test_flip_in_flight_fails, open_verified, close_pair),
        cmocka_unit_test_setup_teardown(test_flip_in_aux_fails, open_verified, close_pair),
        cmocka_unit_test_setup_teardown(test_flip_after_landing_fails, open_verified, close_pair),
        cmocka_unit_test_setup_teardown(test_sender_destroyed_at_success, open_verified,
                                        close_pair),
        cmocka_unit_test_teardown(test_one_sided_refused, close_pair),
        cmocka_unit_test_setup_teardown(test_staged_clean_succeeds, open_staged, close_pair),
        cmocka_unit_test_setup_teardown(test_staged_flip_fails, open_staged, close_pair),
        cmocka_unit_test_setup_teardown(test_caller_digest_right_succeeds, open_direct_gpu,
                                        close_pair),
        cmocka_unit_test_setup_teardown(test_caller_digest_late_succeeds, open_direct_gpu,
                                        close_pair),
        cmocka_unit_test_setup_teardown(test_caller_digest_wrong_fails, open_direct_gpu,
                                        close_pair),
        cmocka_unit_test_setup_teardown(test_caller_digest_flip_fails, open_direct_gpu, close_pair),
        cmocka_unit_test_setup_teardown(test_caller_digest_fanout_succeeds, open_direct_gpu,
                                        close_pair),
    };
    return cmocka_run_group_tests_name("verify", tests, NULL, NULL);
}
