/* SPDX-License-Identifier: Apache-2.0 */
/* The bootstrap service and prefill's registrar (src/ctrl/bootstrap.c),
 * over ZeroMQ on 127.0.0.1: rank ownership and leases, unregistration,
 * unknown ranks, malformed framing, and a restarted service repopulated by
 * the registrar's refreshes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "ctrl/bootstrap.h"
#include "support/engine_pair.h"

enum { ANSWER_MS = 1000, SHORT_LEASE_MS = 200 };

#define ENGINE_A 0xaaaa000000000001ull
#define ENGINE_B 0xbbbb000000000002ull

/* ------------------------------------------------------------ helpers */

static char log_buf[16384];

static void capture_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    size_t used = strlen(log_buf);
    snprintf(log_buf + used, sizeof(log_buf) - used, "%s\n", msg);
}

static int count_lines(const char *needle)
{
    int n = 0;
    for (const char *p = log_buf; (p = strstr(p, needle)) != NULL; p++)
        n++;
    return n;
}

typedef struct fixture {
    kvw_bootstrap_t *bs;
    void *zctx, *client; /* a plain DEALER to the service */
    /* The test's registrar: teardown destroys it if a failed assertion
     * left it open, since zmq_ctx_term waits for every socket of the
     * context forever (a failure must not become a hang). */
    kvw_registrar_t *reg;
} fixture_t;

static fixture_t fx;

static void *dealer_to(const char *addr)
{
    char ep[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(addr, ep, sizeof(ep));
    void *s = kvw__zsocket(fx.zctx, ZMQ_DEALER, 1000);
    assert_non_null(s);
    assert_int_equal(zmq_connect(s, ep), 0);
    return s;
}

static void open_service(uint32_t lease_ms)
{
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    kvw_bootstrap_params_t p = {.struct_size = sizeof(kvw_bootstrap_params_t),
                                .bind_addr = "127.0.0.1:0",
                                .config = &cfg,
                                .lease_ms = lease_ms};
    assert_int_equal(kvw_bootstrap_create(&p, &fx.bs), KVW_OK);
    fx.client = dealer_to(kvw_bootstrap_addr(fx.bs));
}

static int setup(void **state)
{
    (void)state;
    log_buf[0] = '\0';
    kvw_set_log_handler(capture_log, NULL, KVW_LOG_INFO);
    memset(&fx, 0, sizeof(fx));
    fx.zctx = zmq_ctx_new();
    return fx.zctx ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    if (fx.reg)
        kvw__registrar_destroy(fx.reg, false);
    if (fx.client)
        zmq_close(fx.client);
    kvw_bootstrap_destroy(fx.bs);
    zmq_ctx_term(fx.zctx);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

/* The next message on s within ANSWER_MS, or KVW_ERR_TIMEOUT. */
static kvw_status_t answer(void *s, kvw_msg_t *m)
{
    zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&item, 1, ANSWER_MS) <= 0)
        return KVW_ERR_TIMEOUT;
    char why[KVW_WIRE_REASON_MAX];
    return kvw__zrecv(s, m, ZMQ_DONTWAIT, why, sizeof(why));
}

static kvw_status_t do_register(uint32_t rank, const char *ep, uint64_t id)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_REGISTER};
    m.u.bs.rank = rank;
    m.u.bs.engine_id = id;
    snprintf(m.u.bs.endpoint, sizeof(m.u.bs.endpoint), "%s", ep);
    assert_int_equal(kvw__zsend(fx.client, &m, 0), KVW_OK);
    kvw_msg_t ack;
    assert_int_equal(answer(fx.client, &ack), KVW_OK);
    assert_int_equal(ack.type, KVW_MSG_BS_REGISTER_ACK);
    assert_int_equal(ack.u.bs.rank, rank);
    return (kvw_status_t)ack.status;
}

static void do_unregister(uint32_t rank, uint64_t id)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_UNREGISTER};
    m.u.bs.rank = rank;
    m.u.bs.engine_id = id;
    assert_int_equal(kvw__zsend(fx.client, &m, 0), KVW_OK);
}

/* LOOKUP on s: the status, the endpoint in ep (when OK). */
static kvw_status_t lookup_on(void *s, uint32_t rank, char *ep, size_t ep_size)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_LOOKUP};
    m.u.bs.rank = rank;
    assert_int_equal(kvw__zsend(s, &m, 0), KVW_OK);
    kvw_msg_t reply;
    kvw_status_t st = answer(s, &reply);
    if (st)
        return st;
    assert_int_equal(reply.type, KVW_MSG_BS_LOOKUP_REPLY);
    assert_int_equal(reply.u.bs.rank, rank);
    if (reply.status == KVW_OK)
        snprintf(ep, ep_size, "%s", reply.u.bs.endpoint);
    return (kvw_status_t)reply.status;
}

static kvw_status_t lookup(uint32_t rank, char *ep, size_t ep_size)
{
    return lookup_on(fx.client, rank, ep, ep_size);
}

static void assert_owner_endpoint(uint32_t rank, const char *want)
{
    char ep[KVW_WIRE_ENDPOINT_MAX] = "";
    assert_int_equal(lookup(rank, ep, sizeof(ep)), KVW_OK);
    assert_string_equal(ep, want);
}

/* -------------------------------------------------------------- service */

static void test_register_and_lookup(void **state)
{
    (void)state;
    open_service(0);
    assert_int_equal(do_register(3, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    assert_owner_endpoint(3, "tcp://10.0.0.1:5000");
    assert_non_null(strstr(log_buf, "aaaa000000000001"));
}

static void test_unknown_rank_answered_at_once(void **state)
{
    (void)state;
    open_service(0);
    char ep[KVW_WIRE_ENDPOINT_MAX];
    uint64_t t0 = pair_now_ms();
    assert_int_equal(lookup(7, ep, sizeof(ep)), KVW_ERR_NOT_FOUND);
    assert_true(pair_now_ms() - t0 < 500);
    assert_int_equal(lookup(4096, ep, sizeof(ep)), KVW_ERR_OUT_OF_RANGE);
    assert_int_equal(do_register(1u << 20, "tcp://10.0.0.1:1", ENGINE_A), KVW_ERR_OUT_OF_RANGE);
    assert_int_equal(do_register(0, "", ENGINE_A), KVW_ERR_INVALID);
}

/* The owner refreshes (and may move); another engine is refused while the
 * lease lives, with one line naming both. */
static void test_owner_refreshes_others_refused(void **state)
{
    (void)state;
    open_service(0);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5001", ENGINE_A), KVW_OK);
    assert_owner_endpoint(0, "tcp://10.0.0.1:5001");
    assert_int_equal(do_register(0, "tcp://10.0.0.2:6000", ENGINE_B), KVW_ERR_EXISTS);
    assert_int_equal(do_register(0, "tcp://10.0.0.2:6000", ENGINE_B), KVW_ERR_EXISTS);
    assert_owner_endpoint(0, "tcp://10.0.0.1:5001");
    /* one line per claimer, not one per refused refresh */
    assert_int_equal(count_lines("refused engine bbbb000000000002"), 1);
    assert_non_null(strstr(log_buf, "held by engine aaaa000000000001 at tcp://10.0.0.1:5001"));
}

/* An owner gone without unregistering: its rank is free once its lease
 * ran out, and a lookup then says so. */
static void test_lease_expiry(void **state)
{
    (void)state;
    open_service(SHORT_LEASE_MS);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    assert_int_equal(do_register(1, "tcp://10.0.0.1:5001", ENGINE_A), KVW_OK);
    pair_sleep_ms(SHORT_LEASE_MS / 2);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK); /* refresh */
    pair_sleep_ms(SHORT_LEASE_MS * 3 / 4);
    assert_owner_endpoint(0, "tcp://10.0.0.1:5000"); /* refreshed: still live */
    char ep[KVW_WIRE_ENDPOINT_MAX];
    assert_int_equal(lookup(1, ep, sizeof(ep)), KVW_ERR_NOT_FOUND); /* not refreshed */
    pair_sleep_ms(SHORT_LEASE_MS);
    assert_int_equal(do_register(0, "tcp://10.0.0.2:6000", ENGINE_B), KVW_OK);
    assert_owner_endpoint(0, "tcp://10.0.0.2:6000");
    assert_non_null(strstr(log_buf, "takes over from engine aaaa000000000001"));
}

static void test_unregister(void **state)
{
    (void)state;
    open_service(0);
    assert_int_equal(do_register(5, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    do_unregister(5, ENGINE_B); /* not the owner: ignored */
    assert_owner_endpoint(5, "tcp://10.0.0.1:5000");
    assert_non_null(strstr(log_buf, "ignored UNREGISTER of rank 5 from engine bbbb000000000002"));
    do_unregister(5, ENGINE_A);
    char ep[KVW_WIRE_ENDPOINT_MAX];
    assert_int_equal(lookup(5, ep, sizeof(ep)), KVW_ERR_NOT_FOUND);
    assert_int_equal(do_register(5, "tcp://10.0.0.2:6000", ENGINE_B), KVW_OK); /* at once */
    do_unregister(9999, ENGINE_A);                                             /* harmless */
    assert_owner_endpoint(5, "tcp://10.0.0.2:6000");
}

static void send_frames(void *s, int n, const void *frame, size_t len)
{
    for (int i = 0; i < n; i++)
        assert_true(zmq_send(s, frame, len, i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
}

/* Whole messages or nothing: 2- and 3-frame bodies (3 and 4 frames at the
 * ROUTER), a REQ-style empty delimiter, garbage and a wrong type are each
 * dropped whole, so the next valid LOOKUP on the same connection gets its
 * own answer. At most one log line a second says how many. */
static void test_bad_framing_dropped_whole(void **state)
{
    (void)state;
    open_service(0);
    assert_int_equal(do_register(2, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    kvw_msg_t m = {.type = KVW_MSG_BS_LOOKUP};
    m.u.bs.rank = 2;
    uint8_t body[64];
    size_t len = 0;
    assert_int_equal(kvw__wire_encode(&m, body, sizeof(body), &len), KVW_OK);
    for (int round = 0; round < 20; round++) {
        send_frames(fx.client, 2, body, len);
        send_frames(fx.client, 3, body, len);
        assert_true(zmq_send(fx.client, "", 0, ZMQ_SNDMORE) == 0); /* REQ envelope */
        send_frames(fx.client, 1, body, len);
        send_frames(fx.client, 1, "garbage", 7);
    }
    kvw_msg_t pong = {.type = KVW_MSG_PONG};
    assert_int_equal(kvw__zsend(fx.client, &pong, 0), KVW_OK);
    /* Also from a second connection, interleaved with nothing left over. */
    void *other = dealer_to(kvw_bootstrap_addr(fx.bs));
    send_frames(other, 3, body, len);
    char ep[KVW_WIRE_ENDPOINT_MAX] = "";
    assert_int_equal(lookup_on(other, 2, ep, sizeof(ep)), KVW_OK);
    assert_string_equal(ep, "tcp://10.0.0.1:5000");
    zmq_close(other);
    assert_owner_endpoint(2, "tcp://10.0.0.1:5000");
    zmq_pollitem_t item = {fx.client, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&item, 1, 100), 0); /* no stray answers to dropped ones */
    /* 82 drops in well under a second: one line at the first, the other
     * 81 counted for the next (here: at shutdown). */
    assert_int_equal(count_lines("bootstrap: dropped"), 1);
    kvw_bootstrap_destroy(fx.bs);
    fx.bs = NULL;
    assert_int_equal(count_lines("bootstrap: dropped"), 2);
    assert_non_null(strstr(log_buf, "bootstrap: dropped 81 malformed"));
}

/* ------------------------------------------------------------ registrar */

static kvw_registrar_t *registrar(uint64_t id, const char *ep, uint32_t refresh_ms)
{
    assert_int_equal(kvw__registrar_create(fx.zctx, NULL, kvw_bootstrap_addr(fx.bs), 0, ep, id,
                                           refresh_ms, &fx.reg),
                     KVW_OK);
    return fx.reg;
}

/* The test is done with its registrar (unregister: say UNREGISTER). */
static void registrar_done(bool unregister)
{
    kvw__registrar_destroy(fx.reg, unregister);
    fx.reg = NULL;
}

/* Drive r as the control thread would, until rank 0 resolves to want or
 * timeout_ms. Returns the ms it took, or -1. */
static long drive_until_found(kvw_registrar_t *r, const char *want, int timeout_ms)
{
    uint64_t t0 = pair_now_ms();
    while (pair_now_ms() - t0 < (uint64_t)timeout_ms) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        uint64_t next = kvw__registrar_tick(r, now);
        assert_true(next > now);
        zmq_pollitem_t item = {kvw__registrar_socket(r), 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 20) > 0)
            kvw__registrar_on_readable(r);
        char ep[KVW_WIRE_ENDPOINT_MAX] = "";
        if (lookup(0, ep, sizeof(ep)) == KVW_OK && strcmp(ep, want) == 0)
            return (long)(pair_now_ms() - t0);
    }
    return -1;
}

/* The service goes away and comes back on the same port: the registrar's
 * refreshes put the rank back without anyone's help. */
static void test_registrar_repopulates_restarted_service(void **state)
{
    (void)state;
    open_service(0);
    char addr[KVW_WIRE_ENDPOINT_MAX];
    snprintf(addr, sizeof(addr), "%s", kvw_bootstrap_addr(fx.bs));
    kvw_registrar_t *r = registrar(ENGINE_A, "tcp://10.0.0.1:5000", 100);
    assert_int_equal(kvw__registrar_register(r, ANSWER_MS), KVW_OK);
    assert_int_equal(kvw__registrar_status(r), KVW_OK);
    assert_owner_endpoint(0, "tcp://10.0.0.1:5000");

    zmq_close(fx.client);
    fx.client = NULL;
    kvw_bootstrap_destroy(fx.bs);
    fx.bs = NULL;
    kvw_config_t cfg;
    kvw_config_init(&cfg);
    kvw_bootstrap_params_t p = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = addr, .config = &cfg};
    assert_int_equal(kvw_bootstrap_create(&p, &fx.bs), KVW_OK);
    fx.client = dealer_to(addr);
    long took = drive_until_found(r, "tcp://10.0.0.1:5000", 3000);
    print_message("restarted service repopulated after %ld ms (refresh 100 ms)\n", took);
    assert_true(took >= 0);
    registrar_done(true);
}

/* A restarted prefill (new engine id) whose dead predecessor still holds
 * the rank: the blocking registration waits the lease out. A live holder
 * is refused with KVW_ERR_EXISTS. */
static void test_registrar_waits_out_a_dead_owner(void **state)
{
    (void)state;
    open_service(SHORT_LEASE_MS);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK); /* then "dies" */
    kvw_registrar_t *r = registrar(ENGINE_B, "tcp://10.0.0.2:6000", 50);
    uint64_t t0 = pair_now_ms();
    assert_int_equal(kvw__registrar_register(r, 3000), KVW_OK);
    uint64_t took = pair_now_ms() - t0;
    print_message("took over a dead owner's rank after %llu ms (lease %d ms)\n",
                  (unsigned long long)took, SHORT_LEASE_MS);
    assert_true(took < 3000 - 500); /* the lease, not the register call's 3 s timeout */
    assert_owner_endpoint(0, "tcp://10.0.0.2:6000");
    registrar_done(false);
}

static void test_registrar_refused_by_live_owner(void **state)
{
    (void)state;
    open_service(0);
    assert_int_equal(do_register(0, "tcp://10.0.0.1:5000", ENGINE_A), KVW_OK);
    kvw_registrar_t *r = registrar(ENGINE_B, "tcp://10.0.0.2:6000", 50);
    assert_int_equal(kvw__registrar_register(r, ANSWER_MS), KVW_ERR_EXISTS);
    assert_non_null(strstr(log_buf, "another live engine holds it"));
    /* The refusal is logged once by the registrar however often it ticks. */
    log_buf[0] = '\0';
    for (int i = 0; i < 5; i++) {
        uint64_t now = pair_now_ms() * 1000000ull;
        kvw__registrar_tick(r, now + (uint64_t)i * 100000000ull);
        pair_sleep_ms(30);
        kvw__registrar_on_readable(r);
    }
    assert_int_equal(kvw__registrar_status(r), KVW_ERR_EXISTS);
    assert_int_equal(count_lines("refused rank 0 for this engine"), 0); /* same as before */
    assert_owner_endpoint(0, "tcp://10.0.0.1:5000");
    registrar_done(false);
}

static void test_registrar_unregisters_on_destroy(void **state)
{
    (void)state;
    open_service(0);
    kvw_registrar_t *r = registrar(ENGINE_A, "tcp://10.0.0.1:5000", 100);
    assert_int_equal(kvw__registrar_register(r, ANSWER_MS), KVW_OK);
    registrar_done(true);
    char ep[KVW_WIRE_ENDPOINT_MAX];
    uint64_t t0 = pair_now_ms();
    while (lookup(0, ep, sizeof(ep)) == KVW_OK && pair_now_ms() - t0 < 1000)
        pair_sleep_ms(5);
    assert_int_equal(lookup(0, ep, sizeof(ep)), KVW_ERR_NOT_FOUND);
    /* and a successor takes the rank at once */
    assert_int_equal(do_register(0, "tcp://10.0.0.2:6000", ENGINE_B), KVW_OK);
}

/* No service at all: the blocking registration says so in bounded time. */
static void test_registrar_unreachable(void **state)
{
    (void)state;
    assert_int_equal(kvw__registrar_create(fx.zctx, NULL, "127.0.0.1:1", 0, "tcp://10.0.0.1:5000",
                                           ENGINE_A, 100, &fx.reg),
                     KVW_OK);
    kvw_registrar_t *r = fx.reg;
    uint64_t t0 = pair_now_ms();
    assert_int_equal(kvw__registrar_register(r, 300), KVW_ERR_TIMEOUT);
    assert_true(pair_now_ms() - t0 < 3000); /* bounded: the 300 ms timeout, not a hang */
    assert_non_null(strstr(log_buf, "cannot register rank 0 with bootstrap 127.0.0.1:1"));
    registrar_done(true); /* UNREGISTER cannot go: bounded linger */
}

/* Sized params: an older caller's (only bind_addr) gets the defaults; an
 * unset size or a missing address is refused, logged. */
static void test_params_sized(void **state)
{
    (void)state;
    kvw_bootstrap_params_t p;
    kvw_bootstrap_params_init(&p);
    assert_int_equal(p.struct_size, sizeof(p));
    p.bind_addr = "127.0.0.1:0";
    p.lease_ms = 1; /* past the older size below: must not be read */
    p.struct_size = offsetof(kvw_bootstrap_params_t, bind_addr) + sizeof(p.bind_addr);
    assert_int_equal(kvw_bootstrap_create(&p, &fx.bs), KVW_OK);
    assert_non_null(kvw_bootstrap_addr(fx.bs));
    kvw_bootstrap_destroy(fx.bs);
    fx.bs = NULL;
    p.struct_size = 0;
    kvw_bootstrap_t *b = NULL;
    assert_int_equal(kvw_bootstrap_create(&p, &b), KVW_ERR_INVALID);
    assert_non_null(strstr(log_buf, "bootstrap params: struct_size 0"));
    kvw_bootstrap_params_init(&p);
    assert_int_equal(kvw_bootstrap_create(&p, &b), KVW_ERR_INVALID);
    assert_non_null(strstr(log_buf, "bind_addr is required"));
    assert_null(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_register_and_lookup, setup, teardown),
        cmocka_unit_test_setup_teardown(test_params_sized, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_rank_answered_at_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_owner_refreshes_others_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lease_expiry, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unregister, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_framing_dropped_whole, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registrar_repopulates_restarted_service, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_registrar_waits_out_a_dead_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registrar_refused_by_live_owner, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registrar_unregisters_on_destroy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_registrar_unreachable, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
