/* SPDX-License-Identifier: Apache-2.0 */
/* Requests parked between parts, and aborts prefill holds state for, on the
 * fake NIC (engine-level, not RDMA; see tests/support).
 *
 * A chunked or layer-wise request is handed over in parts; between them the
 * poller has posted all it has and parks the request ("starved"), on none
 * of its queues. Every way such a request can fail (decode's abort,
 * prefill's abort or destroy, prefill's transfer watchdog) must reach
 * decode as that room's failure, promptly, and leave the connection and
 * every other request on it alone.
 *
 * An ABORT for a room prefill has no request for may make prefill hold a
 * record of it (for a sender created later), but only within the orphan
 * caps a decode engine's requests are held to. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ctrl/zsock.h"
#include "engine/core.h"
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
    bool starved = r->tx.starved;
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

/* Every handle destroyed: both tables empty once the failures' records
 * expired (bootstrap_timeout_ms), and every request made ended. */
static void assert_nothing_left(void)
{
    uint64_t end = pair_now_ms() + pair.cfg.bootstrap_timeout_ms + WAIT_MS;
    while ((pair_table_size(pair.prefill) || pair_table_size(pair.decode)) && pair_now_ms() < end)
        pair_sleep_ms(10);
    assert_int_equal(pair_table_size(pair.prefill), 0);
    assert_int_equal(pair_table_size(pair.decode), 0);
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
    bool starved = r->tx.starved;
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

/* ------------------------------------------------- ABORTs for unknown rooms */

enum { CAP = 16, FLOOD = 20000, ORPHAN_TTL_MS = 1000 };

static const char rogue_id[KVW_IDENTITY_LEN] = "rogue-decode";

static int open_capped(void **state)
{
    (void)state;
    quiet_log();
    kvw_config_t cfg;
    pair_config(&cfg);
    cfg.max_orphans_per_peer = CAP;
    cfg.orphan_ttl_ms = ORPHAN_TTL_MS;
    cfg.bootstrap_timeout_ms = 30000; /* what an uncounted record was held for */
    cfg.peer_timeout_ms = LONG_MS;    /* the rogue below sends no heartbeats */
    return pair_open(&pair, &cfg) == KVW_OK ? 0 : -1;
}

/* A decode engine of our own on prefill's ROUTER: a HELLO with the pair's
 * layout and a made-up QP (nothing is ever written to it). */
static void rogue_hello(void *s)
{
    kvw_wire_region_t regions[2 * PAIR_LAYERS + 1];
    kvw_msg_t m = {.type = KVW_MSG_HELLO};
    m.u.hello.engine_id = 0x40605e;
    m.u.hello.num_qps = 1;
    m.u.hello.qps[0] = (kvw_qp_info_t){.qpn = 0xfff0f, .psn = 1, .mtu = 3, .link_layer = 2};
    m.u.hello.num_groups = 2;
    m.u.hello.groups[0] = (kvw_wire_group_t){KVW_GROUP_KV, PAIR_LAYERS, 2};
    m.u.hello.groups[1] = (kvw_wire_group_t){KVW_GROUP_AUX, 1, 1};
    m.u.hello.recv_credits = 16;
    m.u.hello.max_msg_sz = 1u << 20;
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS + 1; i++) {
        bool aux = i == 2 * PAIR_LAYERS;
        uint64_t item = aux ? PAIR_AUX_ITEM : PAIR_ITEM;
        regions[i] = (kvw_wire_region_t){
            0x10000000ull * (i + 1), item * (aux ? PAIR_AUX_ITEMS : PAIR_POOL), item, 0x100 + i};
    }
    m.u.hello.regions = regions;
    assert_int_equal(kvw__zsend(s, &m, 0), KVW_OK);
}

/* The rogue's HELLO_ACK, which must say the connection is made. What
 * prefill says about an older connection of the rogue's may come first
 * (its BYE to a connection the rogue closed, a PONG): skipped. */
static void rogue_await_ack(void *s)
{
    zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
    for (int skipped = 0;; skipped++) {
        kvw_msg_t m;
        assert_true(skipped < 100); /* a PONG each heartbeat, but not forever */
        assert_int_equal(zmq_poll(&item, 1, WAIT_MS), 1);
        assert_int_equal(kvw__zrecv(s, &m, 0, NULL, 0), KVW_OK);
        int type = m.type, status = m.status;
        kvw__wire_free(&m);
        if (type == KVW_MSG_BYE || type == KVW_MSG_PONG)
            continue;
        assert_int_equal(type, KVW_MSG_HELLO_ACK);
        assert_int_equal(status, KVW_OK);
        return;
    }
}

static void *rogue_socket(void *zctx)
{
    void *s = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_ROUTING_ID, rogue_id, KVW_IDENTITY_LEN);
    assert_int_equal(zmq_connect(s, kvw_engine_endpoint(pair.prefill)), 0);
    return s;
}

static void *rogue_connect(void *zctx)
{
    void *s = rogue_socket(zctx);
    rogue_hello(s);
    rogue_await_ack(s);
    return s;
}

/* Read what prefill sent the rogue (answers it may drop when we lag);
 * true once a PONG came: everything sent before our PING was served. */
static bool rogue_drain(void *s, uint64_t *answered_room)
{
    kvw_msg_t m;
    bool pong = false;
    while (kvw__zrecv(s, &m, ZMQ_DONTWAIT, NULL, 0) == KVW_OK) {
        pong |= m.type == KVW_MSG_PONG;
        if (m.type == KVW_MSG_REQUEST_FAILED && answered_room && m.u.failed.room == *answered_room)
            *answered_room = 0;
        kvw__wire_free(&m);
    }
    return pong;
}

static void rogue_sync(void *s, uint64_t *answered_room)
{
    kvw_msg_t ping = {.type = KVW_MSG_PING};
    assert_int_equal(kvw__zsend(s, &ping, 0), KVW_OK);
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (!rogue_drain(s, answered_room) && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_true(pair_now_ms() < end);
}

static void rogue_abort(void *s, uint64_t room)
{
    kvw_msg_t m = {.type = KVW_MSG_ABORT, .status = KVW_ERR_ABORTED};
    m.u.failed.room = room;
    m.u.failed.token = (uint32_t)room & KVW_WIRE_TOKEN_MASK;
    snprintf(m.u.failed.reason, sizeof(m.u.failed.reason), "flood");
    assert_int_equal(kvw__zsend(s, &m, 0), KVW_OK);
}

static void rogue_request(void *s, uint64_t room)
{
    uint64_t pages[4] = {0, 1, 2, 3};
    kvw_msg_t m = {.type = KVW_MSG_REQUEST};
    m.u.request.room = room;
    m.u.request.token = (uint32_t)room & KVW_WIRE_TOKEN_MASK;
    m.u.request.aux_index = KVW_NO_AUX;
    m.u.request.num_pages = 4;
    m.u.request.pages = pages;
    assert_int_equal(kvw__zsend(s, &m, 0), KVW_OK);
}

typedef struct held {
    size_t reqs;      /* prefill's table */
    uint32_t orphans; /* the rogue's count against the caps */
    uint64_t orphan_bytes;
} held_t;

static held_t held_now(void)
{
    kvw_engine_t *e = pair.prefill;
    held_t h = {0};
    pthread_mutex_lock(&e->lock);
    h.reqs = e->tab.num_reqs;
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && p->live && memcmp(p->id, rogue_id, KVW_IDENTITY_LEN) == 0) {
            h.orphans = p->orphans;
            h.orphan_bytes = p->orphan_bytes;
        }
    }
    pthread_mutex_unlock(&e->lock);
    return h;
}

static void assert_within_caps(const char *what)
{
    held_t h = held_now();
    print_message("%s: prefill holds %zu request(s), %u counted against the rogue's caps\n", what,
                  h.reqs, h.orphans);
    assert_true(h.orphans <= CAP);
    assert_true(h.reqs <= CAP);
    assert_true(h.orphan_bytes <= ((uint64_t)pair.cfg.max_orphan_mib_per_peer << 20));
}

/* Held records expire with the orphans' TTL and give the caps back; what
 * stays is the senders' own (`senders` of them). */
static void assert_caps_given_back(size_t senders)
{
    uint64_t end = pair_now_ms() + ORPHAN_TTL_MS + WAIT_MS;
    while ((held_now().reqs > senders || held_now().orphans) && pair_now_ms() < end)
        pair_sleep_ms(10);
    held_t h = held_now();
    assert_int_equal(h.reqs, senders);
    assert_int_equal(h.orphans, 0);
    assert_int_equal(h.orphan_bytes, 0);
}

/* ABORTs for rooms prefill never saw: each is answered, what prefill holds
 * for them stays within max_orphans_per_peer, and a sender created after
 * an ABORT it holds fails at once (the ABORT raced ahead of it). */
static void test_abort_flood_unknown_rooms(void **state)
{
    (void)state;
    void *zctx = zmq_ctx_new();
    void *s = rogue_connect(zctx);
    uint64_t first = 1000, answered = first;
    for (uint64_t i = 0; i < FLOOD; i++) {
        rogue_abort(s, first + i);
        if (i % 256 == 0)
            rogue_drain(s, &answered);
    }
    rogue_sync(s, &answered);
    assert_int_equal(answered, 0); /* the first ABORT got its REQUEST_FAILED */
    assert_within_caps("after the ABORT flood");
    assert_caps_given_back(0);
    /* With room under the caps, the record is kept: a sender created after
     * the ABORT fails at once. */
    uint64_t late_room = first + FLOOD;
    rogue_abort(s, late_room);
    rogue_sync(s, NULL);
    kvw_sender_t *late;
    assert_int_equal(kvw_sender_create(pair.prefill, late_room, &late), KVW_OK);
    assert_int_equal(kvw_sender_poll(late), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(late, NULL), KVW_ERR_ABORTED);
    assert_caps_given_back(1); /* adopted: the sender's own now */
    kvw_sender_destroy(late);
    zmq_close(s);
    zmq_ctx_term(zctx);
}

/* REQUEST then ABORT, room after room: the aborted requests stay counted
 * while prefill holds them, so new ones are refused past the caps. */
static void test_request_abort_flood(void **state)
{
    (void)state;
    void *zctx = zmq_ctx_new();
    void *s = rogue_connect(zctx);
    for (uint64_t i = 0; i < FLOOD / 4; i++) {
        rogue_request(s, 5000 + i);
        rogue_abort(s, 5000 + i);
        if (i % 128 == 0)
            rogue_drain(s, NULL);
    }
    rogue_sync(s, NULL);
    assert_within_caps("after REQUEST + ABORT pairs");
    assert_caps_given_back(0);
    zmq_close(s);
    zmq_ctx_term(zctx);
}

/* A REQUEST sent right behind its HELLO, before HELLO_ACK, belongs to the
 * connection that HELLO makes: prefill queues handshakes, and once handled
 * this REQUEST before the queued HELLO (as from an unknown peer) and lost
 * it. Held, it counts once against the rogue's orphan cap (no sender has
 * its room). The same after a BYE: a HELLO with the closing connection's
 * QPs makes a new connection, not a resend answered with the closing one. */
static void test_request_right_behind_hello(void **state)
{
    (void)state;
    void *zctx = zmq_ctx_new();
    void *s = rogue_socket(zctx);
    rogue_hello(s);
    rogue_request(s, 7000);
    rogue_await_ack(s);
    rogue_sync(s, NULL);
    assert_int_equal(held_now().orphans, 1);

    kvw_msg_t bye = {.type = KVW_MSG_BYE, .status = KVW_ERR_PEER};
    assert_int_equal(kvw__zsend(s, &bye, 0), KVW_OK);
    rogue_hello(s); /* the same QPs as the connection just closed */
    rogue_request(s, 7001);
    rogue_await_ack(s);
    rogue_sync(s, NULL);
    assert_int_equal(held_now().orphans, 1); /* 7001 on the new connection */
    zmq_close(s);
    zmq_ctx_term(zctx);
}

/* ------------------------------------- a fan-out sender's requests, raw */

/* A second rogue decode engine: its own routing identity, so its own
 * connection on prefill. */
static void *rogue2_connect(void *zctx)
{
    void *s = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(s, ZMQ_ROUTING_ID, "rogue-decod2", KVW_IDENTITY_LEN);
    assert_int_equal(zmq_connect(s, kvw_engine_endpoint(pair.prefill)), 0);
    rogue_hello(s);
    rogue_await_ack(s);
    return s;
}

static void rogue_request_token(void *s, uint64_t room, uint32_t token)
{
    uint64_t pages[4] = {0, 1, 2, 3};
    kvw_msg_t m = {.type = KVW_MSG_REQUEST};
    m.u.request.room = room;
    m.u.request.token = token;
    m.u.request.aux_index = KVW_NO_AUX;
    m.u.request.num_pages = 4;
    m.u.request.pages = pages;
    assert_int_equal(kvw__zsend(s, &m, 0), KVW_OK);
}

/* Prefill's answer to the rogue's request (room, token): the status of its
 * REQUEST_FAILED, or KVW_OK if none came before a PING's PONG. */
static kvw_status_t rogue_refusal(void *s, uint64_t room, uint32_t token)
{
    kvw_msg_t ping = {.type = KVW_MSG_PING}, m;
    assert_int_equal(kvw__zsend(s, &ping, 0), KVW_OK);
    kvw_status_t got = KVW_OK;
    uint64_t end = pair_now_ms() + WAIT_MS;
    for (bool pong = false; !pong && pair_now_ms() < end;) {
        zmq_pollitem_t item = {s, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, 10) != 1 || kvw__zrecv(s, &m, 0, NULL, 0) != KVW_OK)
            continue;
        pong = m.type == KVW_MSG_PONG;
        if (m.type == KVW_MSG_REQUEST_FAILED && m.u.failed.room == room &&
            m.u.failed.token == token)
            got = (kvw_status_t)m.status;
        kvw__wire_free(&m);
    }
    assert_true(pair_now_ms() < end);
    return got;
}

/* A fan-out sender serving two decode receivers, against raw decode
 * engines: a decode engine's second request for the room (another token)
 * is refused with KVW_ERR_EXISTS, its exact resend dropped, a third decode
 * engine's request refused with KVW_ERR_LIMIT; the claims stand. Requests
 * that came before the sender are adopted: none stays held against the
 * orphan caps. */
static void test_fanout_claims(void **state)
{
    (void)state;
    void *zctx = zmq_ctx_new();
    void *a = rogue_connect(zctx), *b = rogue2_connect(zctx);
    kvw_sender_t *s;
    assert_int_equal(kvw_sender_create_fanout(pair.prefill, 8000, 2, &s), KVW_OK);
    rogue_request_token(a, 8000, 11);
    assert_int_equal(rogue_refusal(a, 8000, 11), KVW_OK); /* claimed */
    rogue_request_token(a, 8000, 12);
    assert_int_equal(rogue_refusal(a, 8000, 12), KVW_ERR_EXISTS);
    rogue_request_token(a, 8000, 11);
    assert_int_equal(rogue_refusal(a, 8000, 11), KVW_OK); /* a resend: dropped */
    rogue_request_token(b, 8000, 21);
    assert_int_equal(rogue_refusal(b, 8000, 21), KVW_OK); /* the second receiver */
    assert_int_equal(kvw_sender_poll(s), KVW_POLL_WAITING_FOR_INPUT);
    kvw_receiver_t *r; /* a third decode engine: the pair's own */
    assert_int_equal(
        kvw_receiver_create(pair.decode, kvw_bootstrap_addr(pair.bootstrap), 0, 8000, &r), KVW_OK);
    uint64_t dst[4] = {0, 1, 2, 3};
    assert_int_equal(kvw_receiver_init(r, dst, 4, KVW_NO_AUX), KVW_OK);
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (kvw_receiver_poll(r) != KVW_POLL_FAILED && pair_now_ms() < end)
        pair_sleep_ms(1);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_LIMIT);
    assert_non_null(strstr(why, "serves 2 decode receivers, all claimed"));
    kvw_receiver_destroy(r);
    /* Before the sender: one record per decode engine, adopted by it. */
    rogue_request_token(a, 8100, 31);
    rogue_request_token(b, 8100, 41);
    rogue_sync(a, NULL);
    rogue_sync(b, NULL);
    held_t before = held_now();
    assert_int_equal(before.orphans, 1); /* the first rogue's, against its caps */
    kvw_sender_t *s2;
    assert_int_equal(kvw_sender_create_fanout(pair.prefill, 8100, 2, &s2), KVW_OK);
    assert_int_equal(held_now().orphans, 0);
    assert_int_equal(held_now().reqs, before.reqs); /* both adopted, none made */
    assert_int_equal(kvw_sender_poll(s2), KVW_POLL_WAITING_FOR_INPUT);
    kvw_sender_destroy(s);
    kvw_sender_destroy(s2);
    zmq_close(a);
    zmq_close(b);
    zmq_ctx_term(zctx);
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
        cmocka_unit_test_setup_teardown(test_abort_flood_unknown_rooms, open_capped, close_pair),
        cmocka_unit_test_setup_teardown(test_request_abort_flood, open_capped, close_pair),
        cmocka_unit_test_setup_teardown(test_request_right_behind_hello, open_capped, close_pair),
        cmocka_unit_test_setup_teardown(test_fanout_claims, open_capped, close_pair),
    };
    return cmocka_run_group_tests_name("parked requests and aborts (fake NIC, not RDMA)", tests,
                                       NULL, NULL);
}
