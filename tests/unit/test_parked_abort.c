/* Requests parked between parts, on the fake NIC (engine-level, not RDMA;
 * see tests/support).
 *
 * A chunked or layer-wise request is handed over in parts; between them the
 * poller has posted all it has and parks the request ("starved"), on none
 * of its queues. Every way such a request can fail (decode's abort,
 * prefill's abort or destroy, prefill's transfer watchdog) must reach
 * decode as that room's failure, promptly, and leave the connection and
 * every other request on it alone. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/engine.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

enum {
    WAIT_MS = 5000,
    LONG_MS = 10000, /* peer and transfer timeouts a prompt answer must beat */
    PROMPT_MS = 3000,
    GRACE_MS = 200, /* the canary watch after Failed */
    HALF = 4,       /* pages per part: each request is sent in two */
};

static engine_pair_t pair;

static void quiet_log(void)
{
    /* KVW_TEST_LOG=1 shows the engines' own account of each test. */
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
}

/* Timeouts long enough that only a prompt answer passes: the connection
 * is killed only after LONG_MS of an unconfirmed abort, and a write never
 * completing fails only after LONG_MS. */
static void long_config(kvw_config_t *cfg)
{
    pair_config(cfg);
    cfg->peer_timeout_ms = LONG_MS;
    cfg->transfer_timeout_ms = LONG_MS;
    cfg->bootstrap_timeout_ms = 1500; /* how long failed senders' records stay */
}

static int open_long(void **state)
{
    (void)state;
    quiet_log();
    kvw_config_t cfg;
    long_config(&cfg);
    return pair_open(&pair, &cfg) == KVW_OK ? 0 : -1;
}

static int close_pair(void **state)
{
    (void)state;
    pair_close(&pair);
    return 0;
}

/* Both handles, decode's request at prefill. */
static void start(pair_room_t *pr, uint64_t room, uint32_t slot)
{
    pair_pick(pr, room, 2 * HALF, room * 7919u + 1, slot);
    assert_int_equal(pair_create(&pair, pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr->r, pr->dst, pr->n, pr->aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr->s, pr->n, pr->aux_src), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(pr, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
}

static bool parked(const pair_room_t *pr)
{
    kvw_req_t *r = (kvw_req_t *)pr->s;
    pthread_mutex_lock(&pair.prefill->lock);
    bool starved = r->starved;
    pthread_mutex_unlock(&pair.prefill->lock);
    return starved;
}

/* The first half handed over, posted and landed: the poller parks the
 * request until the second half, which only the test can give. */
static void send_first_half(pair_room_t *pr)
{
    assert_int_equal(kvw_sender_send(pr->s, pr->src, HALF), KVW_OK);
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (!parked(pr) && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_true(parked(pr));
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    assert_int_equal(kvw_sender_poll(pr->s), KVW_POLL_TRANSFERRING);
}

static void send_second_half(pair_room_t *pr)
{
    assert_int_equal(kvw_sender_send(pr->s, pr->src + HALF, pr->n - HALF), KVW_OK);
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

/* Every page decode may hand to another request once a receiver failed:
 * the whole destination regions, aux included. */
typedef struct canary {
    uint8_t *kv[2 * PAIR_LAYERS], *aux;
} canary_t;

static void canary_take(canary_t *c)
{
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++) {
        c->kv[i] = malloc(PAIR_ITEM * PAIR_POOL);
        assert_non_null(c->kv[i]);
        memcpy(c->kv[i], pair.dst[i], PAIR_ITEM * PAIR_POOL);
    }
    c->aux = malloc(PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
    assert_non_null(c->aux);
    memcpy(c->aux, pair.dst_aux, PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
}

/* Unchanged after the grace period, and free. */
static void canary_check(canary_t *c)
{
    pair_sleep_ms(GRACE_MS);
    fake_nic_quiesce(WAIT_MS);
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++) {
        assert_memory_equal(c->kv[i], pair.dst[i], PAIR_ITEM * PAIR_POOL);
        free(c->kv[i]);
    }
    assert_memory_equal(c->aux, pair.dst_aux, PAIR_AUX_ITEM * PAIR_AUX_ITEMS);
    free(c->aux);
}

/* Wait for decode's Failed (at most PROMPT_MS), taking the canary the
 * moment poll first says so; returns how long it took. */
static uint64_t wait_failed_prompt(const pair_room_t *pr, canary_t *c)
{
    uint64_t t0 = pair_now_ms(), end = t0 + PROMPT_MS;
    while (kvw_receiver_poll(pr->r) != KVW_POLL_FAILED && pair_now_ms() < end)
        pair_sleep_ms(1);
    uint64_t took = pair_now_ms() - t0;
    assert_int_equal(kvw_receiver_poll(pr->r), KVW_POLL_FAILED);
    canary_take(c);
    assert_true(took < PROMPT_MS);
    return took;
}

/* Decode's connection to prefill: its serial names it for good. */
static uint32_t connection_serial(void)
{
    assert_int_equal(atomic_load(&pair.decode->num_peers), 1);
    kvw_peer_t *p = kvw__peer_at(pair.decode, 0);
    assert_non_null(p);
    assert_int_equal(atomic_load(&p->state), PEER_CONNECTED);
    return p->serial;
}

/* The connection a test started with is still up and serves a new
 * request. */
static void assert_connection_kept(uint32_t serial)
{
    assert_int_equal(connection_serial(), serial);
    pair_room_t c;
    start(&c, 99, 2);
    assert_int_equal(kvw_sender_send(c.s, c.src, c.n), KVW_OK);
    assert_landed(&c);
    pair_destroy_room(&c);
    assert_int_equal(connection_serial(), serial);
}

static size_t table_size(kvw_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    size_t n = e->num_reqs;
    pthread_mutex_unlock(&e->lock);
    return n;
}

/* Every handle destroyed: both tables empty once the failures' records
 * expired (bootstrap_timeout_ms), and every request made ended. */
static void assert_nothing_left(void)
{
    uint64_t end = pair_now_ms() + pair.cfg.bootstrap_timeout_ms + WAIT_MS;
    while ((table_size(pair.prefill) || table_size(pair.decode)) && pair_now_ms() < end)
        pair_sleep_ms(10);
    assert_int_equal(table_size(pair.prefill), 0);
    assert_int_equal(table_size(pair.decode), 0);
    kvw_engine_t *both[2] = {pair.prefill, pair.decode};
    for (int i = 0; i < 2; i++) {
        const kvw_engine_counters_t *k = &both[i]->counters;
        assert_int_equal(atomic_load(&k->created), atomic_load(&k->ok) + atomic_load(&k->failed));
    }
}

/* Decode gives up a request parked between parts: prefill confirms at
 * once (nothing of it is in flight), long before decode would kill the
 * connection for want of an answer; the other parked request on the
 * connection lands whole afterwards. */
static void test_decode_aborts_parked(void **state)
{
    (void)state;
    pair_room_t a, b;
    start(&a, 1, 0);
    start(&b, 2, 1);
    uint32_t serial = connection_serial();
    send_first_half(&a);
    send_first_half(&b);
    assert_int_equal(kvw_receiver_abort(a.r), KVW_OK);
    canary_t c;
    uint64_t took = wait_failed_prompt(&a, &c);
    print_message("decode's abort confirmed after %llu ms\n", (unsigned long long)took);
    assert_int_equal(kvw_receiver_failure(a.r, NULL), KVW_ERR_ABORTED);
    canary_check(&c);
    assert_int_equal(pair_wait_sender(&a, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(a.s, NULL), KVW_ERR_ABORTED);
    send_second_half(&b);
    assert_landed(&b);
    pair_destroy_room(&a);
    pair_destroy_room(&b);
    assert_connection_kept(serial);
    assert_nothing_left();
}

/* Prefill gives up (abort) or drops (destroy) a parked request: decode
 * hears it at once, not at its transfer timeout. */
static void prefill_fails_parked(bool destroy)
{
    pair_room_t a, b;
    start(&a, 1, 0);
    start(&b, 2, 1);
    uint32_t serial = connection_serial();
    send_first_half(&a);
    send_first_half(&b);
    if (destroy) {
        kvw_sender_destroy(a.s);
        a.s = NULL;
    } else {
        assert_int_equal(kvw_sender_abort(a.s), KVW_OK);
    }
    canary_t c;
    uint64_t took = wait_failed_prompt(&a, &c);
    print_message("prefill's %s reached decode after %llu ms\n", destroy ? "destroy" : "abort",
                  (unsigned long long)took);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(a.r, &why), KVW_ERR_ABORTED);
    assert_non_null(strstr(why, "prefill: "));
    canary_check(&c);
    send_second_half(&b);
    assert_landed(&b);
    pair_destroy_room(&a);
    pair_destroy_room(&b);
    assert_connection_kept(serial);
    assert_nothing_left();
}

static void test_prefill_aborts_parked(void **state)
{
    (void)state;
    prefill_fails_parked(false);
}

static void test_prefill_destroys_parked(void **state)
{
    (void)state;
    prefill_fails_parked(true);
}

/* The race no schedule here can force: the request fails while the poller
 * posts its last part (on the active queue, so the failure hands nothing
 * back), and the poller then goes to park it. Played with the pass lock
 * held, so the poller is ours: the park is refused, and the request still
 * reaches decode as failed. */
static void test_failed_request_never_parked(void **state)
{
    (void)state;
    pair_room_t a;
    start(&a, 1, 0);
    send_first_half(&a);
    kvw_engine_t *e = pair.prefill;
    kvw_req_t *r = (kvw_req_t *)a.s;
    pthread_mutex_lock(&e->pass_lock);
    assert_int_equal(kvw_sender_abort(a.s), KVW_OK);
    pthread_mutex_lock(&e->lock);
    bool parked_again = kvw__sender_starve_locked(r);
    bool starved = r->starved;
    pthread_mutex_unlock(&e->lock);
    pthread_mutex_unlock(&e->pass_lock);
    assert_false(parked_again);
    assert_false(starved);
    canary_t c;
    wait_failed_prompt(&a, &c);
    canary_check(&c);
    pair_destroy_room(&a);
    assert_nothing_left();
}

/* Prefill's transfer watchdog finds a request parked past
 * transfer_timeout_ms: what is late is prefill's next part, not the
 * connection. That request fails on both sides; another one on the
 * connection, waiting for its data meanwhile, lands afterwards. */
static void test_parked_past_transfer_timeout(void **state)
{
    (void)state;
    pair_close(&pair);
    kvw_config_t cfg, dcfg;
    long_config(&cfg);
    cfg.transfer_timeout_ms = 300;
    long_config(&dcfg); /* decode's own clock would give up only after LONG_MS */
    assert_int_equal(pair_open2(&pair, &cfg, &dcfg), KVW_OK);
    pair_room_t a, b;
    start(&a, 1, 0);
    start(&b, 2, 1);
    uint32_t serial = connection_serial();
    send_first_half(&a);
    canary_t c;
    wait_failed_prompt(&a, &c);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(a.r, &why), KVW_ERR_TIMEOUT);
    print_message("decode says: %s\n", why);
    assert_non_null(strstr(why, "prefill: "));
    canary_check(&c);
    assert_int_equal(pair_wait_sender(&a, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(a.s, NULL), KVW_ERR_TIMEOUT);
    assert_int_equal(kvw_sender_send(b.s, b.src, b.n), KVW_OK);
    assert_landed(&b);
    pair_destroy_room(&a);
    pair_destroy_room(&b);
    assert_connection_kept(serial);
    assert_nothing_left();
}

int main(int argc, char **argv)
{
    /* An argument runs only the tests whose name contains it. */
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_decode_aborts_parked, open_long, close_pair),
        cmocka_unit_test_setup_teardown(test_prefill_aborts_parked, open_long, close_pair),
        cmocka_unit_test_setup_teardown(test_prefill_destroys_parked, open_long, close_pair),
        cmocka_unit_test_setup_teardown(test_failed_request_never_parked, open_long, close_pair),
        cmocka_unit_test_setup_teardown(test_parked_past_transfer_timeout, open_long, close_pair),
    };
    return cmocka_run_group_tests_name("parked requests and aborts (fake NIC, not RDMA)", tests,
                                       NULL, NULL);
}
