/* SPDX-License-Identifier: Apache-2.0 */
/* The device's asynchronous events reach the engine: a QP the device
 * declares fatal fails its connection's requests on both sides at once,
 * with the event named (not after 7 ACK timeouts of retries), and a port
 * that goes down fails every connection; afterwards new requests
 * reconnect and land. On the fake NIC, which raises the events as a
 * device would (not RDMA; see tests/support). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

enum { WAIT_MS = 5000 };

static engine_pair_t pair;

static int open_pair(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR + 1);
    kvw_config_t cfg;
    pair_config(&cfg);
    cfg.peer_timeout_ms = 20000; /* heartbeats cannot be what fails them */
    cfg.heartbeat_ms = 1000;
    cfg.transfer_timeout_ms = 20000;
    return pair_open(&pair, &cfg) == KVW_OK ? 0 : -1;
}

static int close_pair(void **state)
{
    (void)state;
    pair_close(&pair);
    return 0;
}

static void start(pair_room_t *pr, uint64_t room, uint32_t slot)
{
    pair_pick(pr, room, 8, room * 31 + 1, slot);
    assert_int_equal(pair_create(&pair, pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr->r, pr->dst, pr->n, pr->aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr->s, pr->n, pr->aux_src), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(pr, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
}

static void assert_landed(pair_room_t *pr)
{
    assert_int_equal(kvw_sender_send(pr->s, pr->src, pr->n), KVW_OK);
    assert_int_equal(pair_wait_receiver(pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, pr), 0);
}

/* Both sides fail within a bound far below any timeout, and decode's
 * reason names the event. */
static void assert_failed_by(pair_room_t *pr, const char *what, size_t canary_bytes)
{
    uint64_t t0 = pair_now_ms();
    assert_int_equal(pair_wait_receiver(pr, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(pair_wait_sender(pr, WAIT_MS), KVW_POLL_FAILED);
    print_message("failed on both sides %llu ms after the event\n",
                  (unsigned long long)(pair_now_ms() - t0));
    const char *why = "";
    kvw_sender_failure(pr->s, &why);
    const char *dwhy = "";
    kvw_receiver_failure(pr->r, &dwhy);
    print_message("prefill: %s\ndecode: %s\n", why, dwhy);
    assert_non_null(strstr(why, what) ? why : strstr(dwhy, what));
    /* Nothing was sent, so nothing may have landed. */
    assert_int_equal(pair_wrong_bytes(&pair, pr), canary_bytes);
}

static uint32_t prefill_qpn(void)
{
    kvw_peer_t *p = kvw__peer_at(pair.prefill, 0);
    assert_non_null(p);
    return p->lanes[0].qp->qp->qp_num;
}

static void test_qp_fatal_fails_its_connection(void **state)
{
    (void)state;
    pair_room_t a, b;
    start(&a, 1, 0);
    size_t canary = pair_wrong_bytes(&pair, &a);
    assert_int_equal(fake_nic_raise_qp_event(prefill_qpn(), IBV_EVENT_QP_FATAL), 0);
    assert_failed_by(&a, "catastrophic error", canary); /* libibverbs' name for QP_FATAL */
    start(&b, 2, 1);                                    /* a new connection */
    assert_landed(&b);
    pair_destroy_room(&a);
    pair_destroy_room(&b);
}

static void test_port_down_fails_every_connection(void **state)
{
    (void)state;
    pair_room_t a, b;
    start(&a, 1, 0);
    size_t canary = pair_wrong_bytes(&pair, &a);
    assert_int_equal(fake_nic_raise_port_event("fake1", IBV_EVENT_PORT_ERR), 0);
    assert_failed_by(&a, "went down", canary);
    assert_int_equal(fake_nic_raise_port_event("fake1", IBV_EVENT_PORT_ACTIVE), 0);
    start(&b, 2, 1);
    assert_landed(&b);
    pair_destroy_room(&a);
    pair_destroy_room(&b);
}

/* Another port's events, and events that ask nothing, change nothing. */
static void test_harmless_events_ignored(void **state)
{
    (void)state;
    pair_room_t a;
    start(&a, 1, 0);
    assert_int_equal(fake_nic_raise_port_event("fake0", IBV_EVENT_GID_CHANGE), 0);
    assert_int_equal(fake_nic_raise_qp_event(prefill_qpn(), IBV_EVENT_COMM_EST), 0);
    pair_sleep_ms(50);
    assert_landed(&a);
    pair_destroy_room(&a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_qp_fatal_fails_its_connection, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_port_down_fails_every_connection, open_pair,
                                        close_pair),
        cmocka_unit_test_setup_teardown(test_harmless_events_ignored, open_pair, close_pair),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
