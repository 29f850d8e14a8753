/* SPDX-License-Identifier: Apache-2.0 */
/* kvw_engine_metrics_text on the fake NIC: the families an operator
 * scrapes, with counts equal to what the test did (transfers, an orphan,
 * an abort), and the buffer protocol. Not RDMA: see tests/support; the
 * scrape of a live pair on rxe is python/tests/guest/test_metrics_on_rxe.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/engine_pair.h"
#include "support/fake_nic.h"

enum { WAIT_MS = 5000, TRANSFERS = 3, PAGES = 5 };

static engine_pair_t pair;

static int open_pair(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_DEBUG : KVW_LOG_ERROR);
    return pair_open(&pair, NULL) == KVW_OK ? 0 : -1;
}

static int close_pair(void **state)
{
    (void)state;
    pair_close(&pair);
    return 0;
}

/* The engine's whole text, sized by a first call (freed by the caller). */
static char *scrape(kvw_engine_t *e)
{
    size_t need = 0;
    assert_int_equal(kvw_engine_metrics_text(e, NULL, 0, &need), KVW_ERR_LIMIT);
    char *text = malloc(need);
    assert_non_null(text);
    size_t again = 0;
    assert_int_equal(kvw_engine_metrics_text(e, text, need, &again), KVW_OK);
    assert_int_equal(again, need);
    assert_int_equal(strlen(text) + 1, need);
    return text;
}

/* The value of the sample named name whose labels contain label (NULL:
 * any); fails the test when there is none. */
static uint64_t value_of(const char *text, const char *name, const char *label)
{
    char head[128];
    snprintf(head, sizeof(head), "\n%s{", name);
    for (const char *at = strstr(text, head); at; at = strstr(at + 1, head)) {
        const char *close = strchr(at, '}');
        assert_non_null(close);
        const char *eol = strchr(at + 1, '\n');
        if (label && !(strstr(at, label) && strstr(at, label) < close))
            continue;
        assert_true(close < eol);
        return strtoull(close + 2, NULL, 10);
    }
    fail_msg("no sample %s{%s} in:\n%s", name, label ? label : "", text);
    return 0;
}

/* Every "# TYPE" line, in order, as "name type\n" lines. */
static void families_of(const char *text, char *out, size_t size)
{
    size_t n = 0;
    out[0] = '\0';
    for (const char *at = strstr(text, "# TYPE "); at; at = strstr(at + 1, "# TYPE ")) {
        const char *eol = strchr(at, '\n');
        n += (size_t)snprintf(out + n, size - n, "%.*s\n", (int)(eol - at - 7), at + 7);
        assert_true(n < size);
    }
}

static const char *const expected_families = "kvwire_engine info\n"
                                             "kvwire_requests counter\n"
                                             "kvwire_request_failures counter\n"
                                             "kvwire_requests_in_flight gauge\n"
                                             "kvwire_request_bytes counter\n"
                                             "kvwire_transfer_seconds histogram\n"
                                             "kvwire_request_seconds histogram\n"
                                             "kvwire_posted_bytes counter\n"
                                             "kvwire_writes counter\n"
                                             "kvwire_doorbells counter\n"
                                             "kvwire_completions counter\n"
                                             "kvwire_completion_errors counter\n"
                                             "kvwire_poller_sleeps counter\n"
                                             "kvwire_caller_passes counter\n"
                                             "kvwire_replays counter\n"
                                             "kvwire_rail_posted_bytes counter\n"
                                             "kvwire_rail_writes counter\n"
                                             "kvwire_rail_lanes_failed counter\n"
                                             "kvwire_rail_lanes_rejoined counter\n"
                                             "kvwire_rail_lanes_out gauge\n"
                                             "kvwire_rail_probes counter\n"
                                             "kvwire_rail_link_mbps gauge\n"
                                             "kvwire_handshakes counter\n"
                                             "kvwire_requests_refused counter\n"
                                             "kvwire_reconnects counter\n"
                                             "kvwire_orphans counter\n"
                                             "kvwire_aborts counter\n"
                                             "kvwire_abort_confirmations counter\n";

static void transfer(uint64_t room, uint64_t *bytes_p)
{
    pair_room_t pr;
    pair_pick(&pr, room, PAGES, room, 0);
    assert_int_equal(pair_create(&pair, &pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr.r, pr.dst, pr.n, pr.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr.s, pr.n, pr.aux_src), KVW_OK);
    assert_int_equal(kvw_sender_send(pr.s, pr.src, pr.n), KVW_OK);
    assert_int_equal(pair_wait_receiver(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(pr.s, &m), KVW_OK);
    *bytes_p += m.bytes;
    pair_destroy_room(&pr);
}

/* Decode asks first (prefill holds an orphan), then gives the room up
 * while prefill waits for input: prefill confirms, both end Failed. */
static void orphan_then_abort(uint64_t room)
{
    pair_room_t pr;
    pair_pick(&pr, room, PAGES, room, 1);
    assert_int_equal(
        kvw_receiver_create(pair.decode, kvw_bootstrap_addr(pair.bootstrap), 0, room, &pr.r),
        KVW_OK);
    assert_int_equal(kvw_receiver_init(pr.r, pr.dst, pr.n, pr.aux_dst), KVW_OK);
    for (int i = 0; i < WAIT_MS && pair_table_size(pair.prefill) == 0; i++)
        pair_sleep_ms(1);
    assert_int_equal(pair_table_size(pair.prefill), 1);
    assert_int_equal(kvw_sender_create(pair.prefill, room, &pr.s), KVW_OK);
    assert_int_equal(kvw_sender_init(pr.s, pr.n, pr.aux_src), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(&pr, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
    assert_int_equal(kvw_receiver_abort(pr.r), KVW_OK);
    assert_int_equal(pair_wait_receiver(&pr, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(pr.r, NULL), KVW_ERR_ABORTED);
    pair_destroy_room(&pr);
}

static void assert_side(const char *text, uint64_t bytes, bool prefill)
{
    char families[2048];
    families_of(text, families, sizeof(families));
    assert_string_equal(families, expected_families);
    assert_non_null(strstr(text, prefill ? "role=\"prefill\",rank=\"0\"" : "role=\"decode\""));
    assert_int_equal(value_of(text, "kvwire_requests_total", "outcome=\"success\""), TRANSFERS);
    assert_int_equal(value_of(text, "kvwire_requests_total", "outcome=\"failed\""), 1);
    assert_int_equal(value_of(text, "kvwire_request_failures_total", "cause=\"aborted\""), 1);
    assert_int_equal(value_of(text, "kvwire_request_failures_total", "cause=\"timeout\""), 0);
    assert_int_equal(value_of(text, "kvwire_requests_in_flight", NULL), 0);
    assert_int_equal(value_of(text, "kvwire_request_bytes_total", "outcome=\"success\""), bytes);
    assert_int_equal(value_of(text, "kvwire_transfer_seconds_count", NULL), TRANSFERS);
    assert_int_equal(value_of(text, "kvwire_transfer_seconds_bucket", "le=\"+Inf\""), TRANSFERS);
    assert_int_equal(value_of(text, "kvwire_request_seconds_count", NULL), TRANSFERS);
    assert_int_equal(value_of(text, "kvwire_handshakes_total", "result=\"accepted\""), 1);
    assert_int_equal(value_of(text, "kvwire_handshakes_total", "result=\"refused\""), 0);
    assert_int_equal(value_of(text, "kvwire_aborts_total", NULL), 1);
    assert_int_equal(value_of(text, "kvwire_abort_confirmations_total", NULL), 1);
    assert_int_equal(value_of(text, "kvwire_reconnects_total", NULL), 0);
    assert_int_equal(value_of(text, "kvwire_orphans_total", "event=\"held\""), prefill ? 1 : 0);
    assert_non_null(strstr(text, "rail=\"0\",device=\"fake"));
    size_t len = strlen(text);
    assert_true(len > 6 && strcmp(text + len - 6, "# EOF\n") == 0);
}

static void test_metrics_count_what_happened(void **state)
{
    (void)state;
    uint64_t bytes = 0;
    for (uint64_t room = 1; room <= TRANSFERS; room++)
        transfer(room, &bytes);
    orphan_then_abort(100);
    fake_nic_quiesce(WAIT_MS);
    char *p = scrape(pair.prefill), *d = scrape(pair.decode);
    assert_side(p, bytes, true);
    assert_side(d, bytes, false);
    /* Prefill's data path: what kvw_engine_counters says, and the rail's. */
    kvw_counters_t c;
    kvw_engine_counters(pair.prefill, &c);
    assert_true(c.wrs_posted > 0);
    assert_int_equal(value_of(p, "kvwire_writes_total", "state=\"posted\""), c.wrs_posted);
    assert_int_equal(value_of(p, "kvwire_writes_total", "state=\"completed\""), c.wrs_completed);
    assert_int_equal(value_of(p, "kvwire_doorbells_total", NULL), c.chains_posted);
    assert_int_equal(value_of(p, "kvwire_posted_bytes_total", NULL), bytes);
    assert_int_equal(value_of(p, "kvwire_rail_posted_bytes_total", "rail=\"0\""), bytes);
    assert_int_equal(value_of(p, "kvwire_rail_writes_total", "rail=\"0\""), c.wrs_posted);
    free(p);
    free(d);
}

static void test_metrics_buffer_protocol(void **state)
{
    (void)state;
    size_t need = 0, again = 0;
    assert_int_equal(kvw_engine_metrics_text(pair.prefill, NULL, 0, &need), KVW_ERR_LIMIT);
    assert_true(need > 1000);
    char *buf = malloc(need);
    assert_non_null(buf);
    /* One byte short: refused, and told the same size again. */
    assert_int_equal(kvw_engine_metrics_text(pair.prefill, buf, need - 1, &again), KVW_ERR_LIMIT);
    assert_int_equal(again, need);
    assert_int_equal(strlen(buf), need - 2); /* cut, still a string */
    assert_int_equal(kvw_engine_metrics_text(pair.prefill, buf, need, &again), KVW_OK);
    assert_int_equal(strlen(buf), need - 1);
    assert_int_equal(kvw_engine_metrics_text(NULL, buf, need, &again), KVW_ERR_INVALID);
    assert_int_equal(kvw_engine_metrics_text(pair.prefill, buf, need, NULL), KVW_ERR_INVALID);
    assert_int_equal(kvw_engine_metrics_text(pair.prefill, NULL, 10, &again), KVW_ERR_INVALID);
    free(buf);
}

/* Prefill restarts (its process exits; a new one takes rank 0): decode's
 * next request connects again, a reconnect. */
static void test_metrics_count_a_reconnect(void **state)
{
    (void)state;
    uint64_t bytes = 0;
    transfer(1, &bytes);
    assert_int_equal(pair_restart_prefill(&pair), KVW_OK);
    transfer(2, &bytes);
    char *d = scrape(pair.decode);
    assert_int_equal(value_of(d, "kvwire_reconnects_total", NULL), 1);
    assert_int_equal(value_of(d, "kvwire_handshakes_total", "result=\"accepted\""), 2);
    free(d);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_metrics_count_what_happened, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_metrics_buffer_protocol, open_pair, close_pair),
        cmocka_unit_test_setup_teardown(test_metrics_count_a_reconnect, open_pair, close_pair),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
