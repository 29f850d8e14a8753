/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer harness for the prefill engine's control handlers, black-box:
 * a real prefill engine on the fake NIC (tests/support/fake_nic.h),
 * registered at a real bootstrap service, and two ZeroMQ DEALERs that play
 * decode engines:
 *   - "main": a fixed 12-byte identity, a live peer when each input starts;
 *   - "other": another 12-byte identity that never said HELLO (records
 *     flagged FUZZ_OTHER), for the unknown-peer paths.
 *
 * Sync: after the input's frames main sends a valid HELLO (a reconnect:
 * prefill replaces whatever connection the input left, live or dead) and
 * then claims SYNC_ROOM with a token unique to the input. A sender owns
 * that room and its first claim was taken at start-up, so prefill refuses
 * this one with a REQUEST_FAILED echoing the token; it serves one
 * connection in order, so that answer proves every frame before it was
 * handled, and the next input starts from a live peer. No answer within
 * FUZZ_SYNC_MS is a hang: abort(). ASan/UBSan reports and crashes in the
 * engine's threads end the process, which libFuzzer reports with the
 * input. Frames from "other" are not ordered with main's: they may be
 * handled a little after the sync.
 *
 * An engine admits KVW_MAX_PEERS connections over its life (dead ones
 * included) and every accepted HELLO takes one: past REBUILD_AFTER the
 * engine is replaced by a fresh one. */
#include "fuzz/fuzz_common.h"

#include <zmq.h>

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define SYNC_ROOM 0x5959000000000000ull

enum { REBUILD_AFTER = 200 };

static const uint8_t main_id[12] = "fuzz-decode1";
static const uint8_t other_id[12] = "fuzz-other-2";

static struct {
    void *zctx, *main, *other;
    kvw_bootstrap_t *bootstrap;
    kvw_engine_t *engine;
    kvw_sender_t *sync_sender;
    kvw_config_t cfg;
    fuzz_memory_t mem;
    unsigned accepted; /* HELLO_ACKs with status OK seen by this engine */
    uint32_t token;    /* of the last claim of SYNC_ROOM; never reused */
    int32_t last_ack;  /* status of the last HELLO_ACK main got */
} g;

/* Short bootstrap timeouts: requests from fuzzed REQUESTs that no sender
 * claims are failed and dropped quickly instead of piling up. */
static void make_config(void)
{
    fuzz_engine_config(&g.cfg);
    g.cfg.bootstrap_timeout_ms = 300;
    g.cfg.transfer_timeout_ms = 1000;
    g.cfg.heartbeat_ms = 200;
    g.cfg.peer_timeout_ms = 3000;
}

static void *dealer(const uint8_t id[12])
{
    return fuzz_dealer(g.zctx, id, 12, kvw_engine_endpoint(g.engine), "prefill");
}

/* Accepted handshakes of either identity take a connection slot. */
static void note(void *sock, const kvw_msg_t *m)
{
    g.accepted += m->type == KVW_MSG_HELLO_ACK && m->status == KVW_OK;
    if (sock == g.main && m->type == KVW_MSG_HELLO_ACK)
        g.last_ack = m->status;
}

/* Frames left from the last input (a BYE for a connection it killed,
 * REQUEST_FAILED from timers). */
static void drain(void *sock)
{
    kvw_msg_t m;
    while (fuzz_recv_msg(sock, 0, NULL, NULL, &m)) {
        note(sock, &m);
        kvw__wire_free(&m);
    }
}

/* Reconnect main, then claim SYNC_ROOM with a new token. */
static void send_sync(void)
{
    kvw_wire_region_t regions[FUZZ_REGIONS];
    kvw_msg_t hello;
    fuzz_hello(&hello, KVW_MSG_HELLO, 0xdec0de, regions);
    fuzz_send_msg(g.main, NULL, 0, &hello);
    kvw_msg_t req = {.type = KVW_MSG_REQUEST};
    req.u.request.room = SYNC_ROOM;
    req.u.request.token = ++g.token;
    req.u.request.aux_index = KVW_NO_AUX;
    req.u.request.num_state_lists = FUZZ_STATE_GROUPS; /* each empty */
    fuzz_send_msg(g.main, NULL, 0, &req);
}

/* Whether m (noted) answers the last sync claim. */
static bool sync_answer(const kvw_msg_t *m, void *arg)
{
    (void)arg;
    note(g.main, m);
    return m->type == KVW_MSG_REQUEST_FAILED && m->u.failed.room == SYNC_ROOM &&
           m->u.failed.token == g.token;
}

/* Wait for the answer to the last sync claim. */
static bool await_sync(void)
{
    return fuzz_await(g.main, FUZZ_SYNC_MS, sync_answer, NULL);
}

/* The first claim of SYNC_ROOM is accepted (no answer); a second one is
 * refused, which checks the sync works before any input runs. */
static void first_claims(void)
{
    send_sync();
    send_sync();
    if (!await_sync())
        fuzz_die("harness: prefill does not answer a second claim (last HELLO_ACK: %s)",
                 kvw_strerror((kvw_status_t)g.last_ack));
}

static void open_engine(void)
{
    kvw_engine_params_t p;
    fuzz_engine_params(&p, KVW_ROLE_PREFILL, "fake0", &g.mem, &g.cfg);
    p.bootstrap_addr = kvw_bootstrap_addr(g.bootstrap);
    kvw_status_t st = kvw_engine_create(&p, &g.engine);
    if (!st)
        st = kvw_sender_create(g.engine, SYNC_ROOM, &g.sync_sender);
    if (st)
        fuzz_die("harness: prefill engine: %s", kvw_strerror(st));
    g.main = dealer(main_id);
    g.other = dealer(other_id);
    g.accepted = 0;
    first_claims();
}

static void close_engine(void)
{
    zmq_close(g.main);
    zmq_close(g.other);
    kvw_sender_destroy(g.sync_sender);
    kvw_engine_destroy(g.engine);
    g.sync_sender = NULL;
    g.engine = NULL;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fuzz_engine_setup(&g.mem);
    make_config();
    fuzz_open_service(&g.zctx, &g.bootstrap);
    open_engine();
    /* Left to process exit on purpose: libFuzzer ends with exit(), and
     * tearing engines down from an atexit handler would race it. */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    drain(g.main);
    drain(g.other);
    if (g.accepted >= REBUILD_AFTER) {
        close_engine();
        open_engine();
    }
    fuzz_record_t recs[FUZZ_MAX_RECORDS];
    size_t n = fuzz_split(data, size, recs);
    fuzz_send_records(g.main, NULL, 0, recs, n, FUZZ_SEND_MAIN);
    fuzz_send_records(g.other, NULL, 0, recs, n, FUZZ_SEND_OTHER);
    send_sync();
    if (!await_sync())
        fuzz_die("prefill did not answer within %d ms: control thread hung (last HELLO_ACK: %s)",
                 FUZZ_SYNC_MS, kvw_strerror((kvw_status_t)g.last_ack));
    return 0;
}
