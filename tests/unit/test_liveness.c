/* SPDX-License-Identifier: Apache-2.0 */
/* Live peers are never declared dead: the three situations in which a
 * healthy prefill was judged "silent" on rxe, reproduced on the fake NIC
 * (not RDMA; see tests/support) with the control plane's timing made
 * adverse on purpose:
 *   - a new request on a connection idle for longer than peer_timeout_ms
 *     (idle pings come every idle_heartbeat_ms, above it by default);
 *   - a decode streaming back-to-back requests while prefill's control
 *     answers are late (its control thread was inside a long post; here
 *     its PONGs are dropped outright) although the data path delivers;
 *   - a first request while prefill's control socket is flooded with
 *     garbage.
 * Each test streams or waits for several peer_timeout_ms and asserts on
 * outcomes (states and bytes), not on timing. KVW_STREAM_MS lengthens the
 * streaming test (e.g. to minutes). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include <cmocka.h>

#include "ctrl/wire.h"
#include "ctrl/zsock.h"
#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

enum { WAIT_MS = 5000 };

static engine_pair_t pair;

/* Idle pings every 2 s, a busy connection dead after 400 ms of silence. */
static void liveness_config(kvw_config_t *cfg)
{
    pair_config(cfg);
    cfg->heartbeat_ms = 50;
    cfg->peer_timeout_ms = 400;
    cfg->idle_heartbeat_ms = 2000;
}

static int open_pair(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    kvw_config_t cfg;
    liveness_config(&cfg);
    return pair_open(&pair, &cfg) == KVW_OK ? 0 : -1;
}

static int close_pair(void **state)
{
    (void)state;
    atomic_store(&kvw__zdrop_hook, NULL);
    pair_close(&pair);
    return 0;
}

/* One whole request, both sides Success, every byte checked. Prefill's
 * engine sends hold_ms after decode's request reached it (as a prefill
 * computing the prompt would), so decode's control thread has ticks of
 * its own while the request is under way. */
static void transfer_after(uint64_t room, size_t n, uint32_t slot, int hold_ms)
{
    pair_room_t pr;
    pair_pick(&pr, room, n, room * 7919u + 1, slot);
    assert_int_equal(pair_create(&pair, &pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr.r, pr.dst, pr.n, pr.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr.s, pr.n, pr.aux_src), KVW_OK);
    if (hold_ms) {
        assert_int_equal(pair_wait_sender_ready(&pr, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
        pair_sleep_ms(hold_ms);
    }
    assert_int_equal(kvw_sender_send(pr.s, pr.src, pr.n), KVW_OK);
    const char *why = "";
    if (pair_wait_receiver(&pr, WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_receiver_failure(pr.r, &why);
    assert_string_equal(why, "");
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, &pr), 0);
    pair_destroy_room(&pr);
}

static void transfer(uint64_t room, size_t n, uint32_t slot)
{
    transfer_after(room, n, slot, 0);
}

static uint64_t failed_count(kvw_engine_t *e)
{
    kvw_counters_t c;
    kvw_engine_counters(e, &c);
    return c.requests_failed;
}

/* A connection idle for 1 s (over twice peer_timeout_ms, before the next
 * idle ping) takes a new request that prefill holds for 1.2 s (past the
 * idle ping's time, so decode's control thread ticks while it is busy).
 * The last PONG is older than the busy limit then; before the fix that
 * tick declared prefill silent and failed the request. */
static void test_request_after_idle(void **state)
{
    (void)state;
    transfer(1, 8, 0);
    pair_sleep_ms(1000);
    transfer_after(2, 8, 1, 1200);
    pair_sleep_ms(1300); /* and once more, across an idle ping */
    transfer_after(3, 8, 0, 1200);
    assert_int_equal(failed_count(pair.decode), 0);
    assert_int_equal(failed_count(pair.prefill), 0);
}

/* Prefill's control messages to decode are lost (PONGs only: nothing else
 * flows that way while requests succeed), while its writes keep landing:
 * the immediates prove it lives. Before the fix decode killed the
 * connection peer_timeout_ms after the last PONG, mid-stream. */
static void *silenced_router;
static bool drop_pongs(void *sock, const kvw_msg_t *m)
{
    return sock == silenced_router && m->type == KVW_MSG_PONG;
}

static void test_stream_with_pongs_lost(void **state)
{
    (void)state;
    const char *env = getenv("KVW_STREAM_MS");
    uint64_t stream_ms = env ? strtoull(env, NULL, 10) : 2500;
    transfer(1, 8, 0); /* connected */
    silenced_router = pair.prefill->router;
    atomic_store(&kvw__zdrop_hook, drop_pongs);
    uint64_t end = pair_now_ms() + stream_ms, room = 2, n = 0;
    fake_nic_faults_t slow = {.delay_us = 2000, .delay_jitter_us = 2000, .seed = 7};
    fake_nic_set_faults(&slow); /* each request takes a few ms, as on a wire */
    while (pair_now_ms() < end) {
        transfer(room, 16, (uint32_t)(room & 1));
        room++;
        n++;
    }
    fake_nic_set_faults(NULL);
    atomic_store(&kvw__zdrop_hook, NULL);
    print_message("streamed %llu requests over %llu ms (%llu x peer_timeout_ms) without a PONG\n",
                  (unsigned long long)n, (unsigned long long)stream_ms,
                  (unsigned long long)(stream_ms / pair.cfg.peer_timeout_ms));
    assert_true(stream_ms >= 4 * pair.cfg.peer_timeout_ms);
    assert_int_equal(failed_count(pair.decode), 0);
}

/* A client floods prefill's ROUTER with garbage (undecodable bodies, stray
 * frames) from its own thread while decode's first request connects and
 * lands, and several after it. */
typedef struct flood {
    const char *endpoint;
    atomic_bool stop;
    uint64_t sent;
} flood_t;

/* Raw TCP: connect, write bytes that are no ZMTP greeting, close; again. */
static void *tcp_flood_main(void *arg)
{
    flood_t *f = arg;
    const char *hp = strstr(f->endpoint, "://");
    char host[64];
    snprintf(host, sizeof(host), "%s", hp ? hp + 3 : f->endpoint);
    char *colon = strrchr(host, ':');
    if (!colon)
        return NULL;
    *colon = 0;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    inet_pton(AF_INET, host, &sa.sin_addr);
    char junk[4096];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (char)(i * 131u + 7u);
    while (!atomic_load(&f->stop)) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
            write(fd, junk, sizeof(junk)) > 0)
            f->sent++;
        if (fd >= 0)
            close(fd);
    }
    return NULL;
}

static void *flood_main(void *arg)
{
    flood_t *f = arg;
    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_DEALER);
    int linger = 0, hwm = 100000;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_connect(sock, f->endpoint);
    static const char junk[] = "garbage, not a kvwire message";
    while (!atomic_load(&f->stop)) {
        if (zmq_send(sock, junk, sizeof(junk), ZMQ_DONTWAIT) > 0)
            f->sent++;
        else
            pair_sleep_ms(1);
    }
    zmq_close(sock);
    zmq_ctx_term(zctx);
    return NULL;
}

static void flood_during_requests(void *(*flooder)(void *))
{
    flood_t f = {.endpoint = kvw_engine_endpoint(pair.prefill)};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, flooder, &f), 0);
    pair_sleep_ms(200); /* the flood is on before decode connects */
    uint64_t end = pair_now_ms() + 4 * pair.cfg.peer_timeout_ms, room = 1;
    do
        transfer(room, 8, (uint32_t)(room & 1));
    while (++room < 4 || pair_now_ms() < end);
    atomic_store(&f.stop, true);
    pthread_join(t, NULL);
    print_message("%llu garbage messages sent during %llu requests\n", (unsigned long long)f.sent,
                  (unsigned long long)(room - 1));
    assert_true(f.sent > 0);
    assert_int_equal(failed_count(pair.decode), 0);
}

static void test_first_request_under_flood(void **state)
{
    (void)state;
    flood_during_requests(flood_main);
}

static void test_first_request_under_tcp_flood(void **state)
{
    (void)state;
    flood_during_requests(tcp_flood_main);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_request_after_idle, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_stream_with_pongs_lost, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_first_request_under_flood, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_first_request_under_tcp_flood, open_pair, close_pair),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
