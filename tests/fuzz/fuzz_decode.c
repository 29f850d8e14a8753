/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the decode engine's control handlers, black-box.
 * Decode dials out, so the harness plays a prefill engine: a ZeroMQ ROUTER
 * registered as rank 0 at a real bootstrap service, which a real decode
 * engine on the fake NIC looks up and connects to.
 *
 * Each input: the harness creates a receiver (a new room, one page) and
 * serves decode until decode's REQUEST for it arrives (answering the
 * lookup-driven HELLO with a valid HELLO_ACK when decode reconnects, and
 * PINGs with PONG). Then it sends the input's records (fuzz_common.h) to
 * decode's identity, followed by a REQUEST_FAILED for the room. Decode
 * handles one connection in order, so once the receiver reports Failed
 * every frame before it was handled: either the sync failed it, or a frame
 * killed the connection, which fails it too. No Failed within
 * FUZZ_SYNC_MS is a hang: abort(). ASan/UBSan reports and crashes in the
 * engine's threads end the process, which libFuzzer reports with the
 * input.
 *
 * Most malformed frames make decode drop the connection, so many inputs
 * start with a fresh lookup and handshake: slower than the prefill
 * harness, by design of the protocol. Connections are counted and the
 * engine is replaced by a fresh one past REBUILD_AFTER (an engine has a
 * bounded number of connection slots). */
#include "fuzz/fuzz_common.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum {
    REBUILD_AFTER = 200,
    REFRESH_MS = 500, /* re-register well within the service's lease */
    SETUP_TRIES = 3,
};

static struct {
    void *zctx, *router, *registrar;
    char endpoint[KVW_WIRE_ENDPOINT_MAX];
    kvw_bootstrap_t *bootstrap;
    kvw_engine_t *engine;
    kvw_config_t cfg;
    fuzz_memory_t mem;
    kvw_receiver_t *r;
    uint64_t room, registered_ms;
    uint32_t token; /* decode's token for room */
    uint8_t id[256];
    size_t id_len; /* decode's identity on the connection that sent the REQUEST */
    unsigned hellos;
} g;

/* Generous liveness limits: the harness answers PINGs only while it runs
 * an input, and must not have decode give up on it between inputs. */
static void make_config(void)
{
    fuzz_engine_config(&g.cfg);
    g.cfg.bootstrap_timeout_ms = 3000;
    g.cfg.transfer_timeout_ms = 10000;
    g.cfg.heartbeat_ms = 500;
    g.cfg.peer_timeout_ms = 10000;
}

/* Socket-level registration, as a prefill engine's would be: REGISTER
 * rank 0 -> our ROUTER; the service's ACK is read (and ignored) later. */
static void register_rank(void)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_REGISTER};
    m.u.bs.rank = 0;
    m.u.bs.engine_id = 0xfeed;
    snprintf(m.u.bs.endpoint, sizeof(m.u.bs.endpoint), "%s", g.endpoint);
    kvw_msg_t ack;
    while (fuzz_recv_msg(g.registrar, 0, NULL, NULL, &ack))
        kvw__wire_free(&ack);
    fuzz_send_msg(g.registrar, NULL, 0, &m);
    g.registered_ms = fuzz_now_ms();
}

static void open_service(void)
{
    fuzz_open_service(&g.zctx, &g.bootstrap);
    g.router = fuzz_socket(g.zctx, ZMQ_ROUTER);
    size_t len = sizeof(g.endpoint);
    if (zmq_bind(g.router, "tcp://127.0.0.1:*") ||
        zmq_getsockopt(g.router, ZMQ_LAST_ENDPOINT, g.endpoint, &len))
        fuzz_die("harness: cannot bind the fake prefill: %s", zmq_strerror(zmq_errno()));
    g.registrar = fuzz_service_dealer(g.zctx, g.bootstrap);
    register_rank();
    kvw_msg_t ack;
    if (!fuzz_recv_msg(g.registrar, FUZZ_SYNC_MS, NULL, NULL, &ack) ||
        ack.type != KVW_MSG_BS_REGISTER_ACK || ack.status != KVW_OK)
        fuzz_die("harness: the bootstrap service did not accept the fake prefill");
}

static void open_engine(void)
{
    kvw_engine_params_t p;
    fuzz_engine_params(&p, KVW_ROLE_DECODE, "fake1", &g.mem, &g.cfg);
    kvw_status_t st = kvw_engine_create(&p, &g.engine);
    if (st)
        fuzz_die("harness: decode engine: %s", kvw_strerror(st));
    g.hellos = 0;
}

static void answer_hello(const uint8_t *id, size_t id_len)
{
    kvw_wire_region_t regions[FUZZ_REGIONS];
    kvw_msg_t ack;
    fuzz_hello(&ack, KVW_MSG_HELLO_ACK, 0xfeed, regions);
    fuzz_send_msg(g.router, id, id_len, &ack);
    g.hellos++;
}

/* Play prefill for one message from decode. Returns true when it is
 * decode's REQUEST for the current room. */
static bool serve(const uint8_t *id, size_t id_len, const kvw_msg_t *m)
{
    switch (m->type) {
    case KVW_MSG_HELLO:
        answer_hello(id, id_len);
        return false;
    case KVW_MSG_PING: {
        kvw_msg_t pong = {.type = KVW_MSG_PONG};
        pong.u.ping.engine_id = 0xfeed;
        fuzz_send_msg(g.router, id, id_len, &pong);
        return false;
    }
    case KVW_MSG_ABORT: { /* nothing was written: confirm at once */
        kvw_msg_t f = {.type = KVW_MSG_REQUEST_FAILED, .status = KVW_ERR_ABORTED};
        f.u.failed.room = m->u.failed.room;
        f.u.failed.token = m->u.failed.token;
        snprintf(f.u.failed.reason, sizeof(f.u.failed.reason), "aborted");
        fuzz_send_msg(g.router, id, id_len, &f);
        return false;
    }
    case KVW_MSG_REQUEST:
        return m->u.request.room == g.room;
    default:
        return false;
    }
}

/* Serve decode for up to wait_ms; true once the current room's REQUEST
 * arrived (its token and sender's identity saved). */
static bool serve_until_request(int wait_ms)
{
    uint8_t id[256];
    size_t id_len = 0;
    kvw_msg_t m;
    uint64_t end = fuzz_now_ms() + (uint64_t)wait_ms;
    for (uint64_t now; (now = fuzz_now_ms()) < end;) {
        if (!fuzz_recv_msg(g.router, (int)(end - now), id, &id_len, &m))
            return false;
        bool mine = serve(id, id_len, &m);
        if (mine) {
            g.token = m.u.request.token;
            memcpy(g.id, id, id_len);
            g.id_len = id_len;
        }
        kvw__wire_free(&m);
        if (mine)
            return true;
    }
    return false;
}

/* A receiver whose REQUEST prefill (the harness) holds. A receiver can
 * fail during set-up (its connection died of a frame still in flight): a
 * new one is tried. */
static void start_request(void)
{
    static const uint64_t page = 0;
    for (int i = 0; i < SETUP_TRIES; i++) {
        g.room++;
        char bs[KVW_WIRE_ENDPOINT_MAX];
        snprintf(bs, sizeof(bs), "%s", kvw_bootstrap_addr(g.bootstrap));
        kvw_status_t st = kvw_receiver_create(g.engine, bs, 0, g.room, &g.r);
        if (!st)
            st = kvw_receiver_init(g.r, &page, 1, KVW_NO_AUX);
        if (st)
            fuzz_die("harness: receiver for room %llu: %s", (unsigned long long)g.room,
                     kvw_strerror(st));
        if (serve_until_request(FUZZ_SYNC_MS))
            return;
        const char *failure = "";
        char why[KVW_WIRE_REASON_MAX];
        kvw_receiver_failure(g.r, &failure);
        snprintf(why, sizeof(why), "%s", failure ? failure : ""); /* outlives the receiver */
        kvw_receiver_destroy(g.r);
        g.r = NULL;
        if (i + 1 == SETUP_TRIES)
            fuzz_die("decode sent no REQUEST within %d ms (%d tries; last: %s): hung", FUZZ_SYNC_MS,
                     SETUP_TRIES, why);
    }
}

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

/* Until the receiver reports Failed, keep answering decode (its PINGs). */
static void await_failed(void)
{
    uint64_t end = fuzz_now_ms() + FUZZ_SYNC_MS;
    uint8_t id[256];
    size_t id_len;
    kvw_msg_t m;
    while (kvw_receiver_poll(g.r) != KVW_POLL_FAILED) {
        if (fuzz_now_ms() > end)
            fuzz_die("decode did not handle the input within %d ms: control thread hung",
                     FUZZ_SYNC_MS);
        if (fuzz_recv_msg(g.router, 0, id, &id_len, &m)) {
            serve(id, id_len, &m);
            kvw__wire_free(&m);
        } else {
            sleep_us(50);
        }
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_engine_setup(&g.mem);
    make_config();
    open_service();
    open_engine();
    /* Left to process exit on purpose: libFuzzer ends with exit(), and
     * tearing engines down from an atexit handler would race it. */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g.hellos >= REBUILD_AFTER) {
        kvw_engine_destroy(g.engine);
        open_engine();
    }
    if (fuzz_now_ms() - g.registered_ms > REFRESH_MS)
        register_rank();
    start_request();
    fuzz_record_t recs[FUZZ_MAX_RECORDS];
    size_t n = fuzz_split(data, size, recs);
    fuzz_send_records(g.router, g.id, g.id_len, recs, n, FUZZ_SEND_ALL);
    kvw_msg_t f = {.type = KVW_MSG_REQUEST_FAILED, .status = KVW_ERR_PEER};
    f.u.failed.room = g.room;
    f.u.failed.token = g.token;
    snprintf(f.u.failed.reason, sizeof(f.u.failed.reason), "fuzz sync");
    fuzz_send_msg(g.router, g.id, g.id_len, &f);
    await_failed();
    kvw_receiver_destroy(g.r);
    g.r = NULL;
    return 0;
}
