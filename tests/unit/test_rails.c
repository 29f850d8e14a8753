/* SPDX-License-Identifier: Apache-2.0 */
/* Rails: an engine on several devices (KVW_DEVICES), on the fake NIC (not
 * RDMA). Each side's regions are registered on every rail with that
 * rail's PD, so a write built with another rail's keys fails on the fake
 * NIC as on a real one: every byte landing is the proof that each lane
 * used its own rail's lkeys and the peer rail's rkeys. The WRs each rail
 * carried are counted (kvw_engine_rails). */
#include <arpa/inet.h>
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"
#include "ctrl/zsock.h"
#include "verbs/device.h"

enum { WAIT_MS = 20000, ROOMS = 4, PAGES = 12 };

static engine_pair_t pair;
static bool opened; /* pair_open ran: the teardown closes it, even after a failed assertion */

static void quiet_log(void)
{
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
}

/* Both sides' configs with these rails and QPs per rail, and a transfer
 * and a peer timeout (0: the test pair's). */
static void open_rails_timeouts(const char *prefill_devs, const char *decode_devs, uint32_t qps,
                                uint32_t transfer_timeout_ms, uint32_t peer_timeout_ms)
{
    kvw_config_t pc, dc;
    pair_config(&pc);
    pc.qps_per_peer = qps;
    if (transfer_timeout_ms)
        pc.transfer_timeout_ms = transfer_timeout_ms;
    if (peer_timeout_ms)
        pc.peer_timeout_ms = peer_timeout_ms;
    dc = pc;
    snprintf(pc.devices, sizeof(pc.devices), "%s", prefill_devs);
    snprintf(dc.devices, sizeof(dc.devices), "%s", decode_devs);
    quiet_log();
    pair_set_nic_devices(4);
    opened = true;
    assert_int_equal(pair_open2(&pair, &pc, &dc), KVW_OK);
}

static void open_rails_timeout(const char *prefill_devs, const char *decode_devs, uint32_t qps,
                               uint32_t transfer_timeout_ms)
{
    open_rails_timeouts(prefill_devs, decode_devs, qps, transfer_timeout_ms, 0);
}

static void open_rails(const char *prefill_devs, const char *decode_devs, uint32_t qps)
{
    open_rails_timeout(prefill_devs, decode_devs, qps, 0);
}

static int close_rails(void **state)
{
    (void)state;
    atomic_store(&kvw__zdrop_hook, NULL);
    if (opened)
        pair_close(&pair);
    opened = false;
    pair_set_nic_devices(0);
    pair_set_down_at_open(NULL, NULL);
    return 0;
}

/* ROOMS requests at once, each checked byte for byte. */
static void transfer_rooms(void)
{
    pair_room_t rooms[ROOMS];
    for (uint32_t i = 0; i < ROOMS; i++) {
        pair_pick(&rooms[i], 10 + i, PAGES, 7919u * (i + 1), i);
        assert_int_equal(pair_create(&pair, &rooms[i]), KVW_OK);
        assert_int_equal(kvw_receiver_init(rooms[i].r, rooms[i].dst, rooms[i].n, rooms[i].aux_dst),
                         KVW_OK);
        assert_int_equal(kvw_sender_init(rooms[i].s, rooms[i].n, rooms[i].aux_src), KVW_OK);
    }
    for (uint32_t i = 0; i < ROOMS; i++)
        assert_int_equal(kvw_sender_send(rooms[i].s, rooms[i].src, rooms[i].n), KVW_OK);
    for (uint32_t i = 0; i < ROOMS; i++) {
        const char *why = "";
        if (pair_wait_receiver(&rooms[i], WAIT_MS) != KVW_POLL_SUCCESS)
            kvw_receiver_failure(rooms[i].r, &why);
        assert_string_equal(why, "");
        assert_int_equal(pair_wait_sender(&rooms[i], WAIT_MS), KVW_POLL_SUCCESS);
        assert_int_equal(pair_wrong_bytes(&pair, &rooms[i]), 0);
        pair_destroy_room(&rooms[i]);
    }
}

/* Prefill's rails, with their WR counts; returns how many. */
static uint32_t prefill_rails(kvw_rail_t *rails)
{
    return kvw_engine_rails(pair.prefill, rails, KVW_MAX_RAILS);
}

/* The rail counts add up to the engine's WR count. */
static void assert_rails_sum(const kvw_rail_t *rails, uint32_t n)
{
    kvw_counters_t c;
    kvw_engine_counters(pair.prefill, &c);
    uint64_t wrs = 0, bytes = 0;
    for (uint32_t r = 0; r < n; r++) {
        wrs += rails[r].wrs_posted;
        bytes += rails[r].bytes_posted;
    }
    assert_int_equal(wrs, c.wrs_posted);
    assert_int_equal(bytes, c.bytes_posted);
}

/* Two rails on each side: a lane on each rail pair (fake0 <-> fake1,
 * fake2 <-> fake3); every request is striped over both, its last writes
 * carry an immediate on each, and every byte lands. */
static void test_two_rails_each_side(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_string_equal(rails[0].device, "fake0");
    assert_string_equal(rails[1].device, "fake2");
    print_message("WRs per rail: %s %llu, %s %llu\n", rails[0].device,
                  (unsigned long long)rails[0].wrs_posted, rails[1].device,
                  (unsigned long long)rails[1].wrs_posted);
    assert_true(rails[0].wrs_posted > 0);
    assert_true(rails[1].wrs_posted > 0);
    assert_rails_sum(rails, 2);
    /* Equal links: equal turns, so neither rail carries more than twice
     * the other (chains alternate; a request's tail may fall on either). */
    assert_true(rails[0].wrs_posted <= 2 * rails[1].wrs_posted + 16);
    assert_true(rails[1].wrs_posted <= 2 * rails[0].wrs_posted + 16);
    kvw_rail_t drails[KVW_MAX_RAILS];
    assert_int_equal(kvw_engine_rails(pair.decode, drails, KVW_MAX_RAILS), 2);
    assert_string_equal(drails[1].device, "fake3");
}

/* Two QPs per rail: four lanes, two per rail pair. */
static void test_two_rails_two_qps(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 2);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_true(rails[0].wrs_posted > 0 && rails[1].wrs_posted > 0);
    assert_rails_sum(rails, 2);
}

/* Prefill has one rail, decode two: prefill's one device writes to both
 * of decode's, each lane with the rkeys of its decode rail. */
static void test_decode_rails_only(void **state)
{
    (void)state;
    open_rails("fake0", "fake1,fake3", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 1);
    assert_true(rails[0].wrs_posted > 0);
    assert_rails_sum(rails, 1);
}

/* Prefill has two rails, decode one: the rails both share is one, so
 * every write goes on prefill's first rail and none on its second. */
static void test_prefill_rails_only(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1", 1);
    transfer_rooms();
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_true(rails[0].wrs_posted > 0);
    assert_int_equal(rails[1].wrs_posted, 0);
    assert_rails_sum(rails, 2);
}

/* ---- failover ---------------------------------------------------------- */

/* ROOMS requests created and initialised on both sides, decode's requests
 * at prefill (the connection is up): nothing sent yet. */
static void start_rooms(pair_room_t *rooms)
{
    for (uint32_t i = 0; i < ROOMS; i++) {
        pair_pick(&rooms[i], 20 + i, PAGES, 104729u * (i + 1), i);
        assert_int_equal(pair_create(&pair, &rooms[i]), KVW_OK);
        assert_int_equal(kvw_receiver_init(rooms[i].r, rooms[i].dst, rooms[i].n, rooms[i].aux_dst),
                         KVW_OK);
        assert_int_equal(kvw_sender_init(rooms[i].s, rooms[i].n, rooms[i].aux_src), KVW_OK);
    }
    for (uint32_t i = 0; i < ROOMS; i++)
        assert_int_equal(pair_wait_sender_ready(&rooms[i], WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
}

static void send_rooms(pair_room_t *rooms)
{
    for (uint32_t i = 0; i < ROOMS; i++)
        assert_int_equal(kvw_sender_send(rooms[i].s, rooms[i].src, rooms[i].n), KVW_OK);
}

static void assert_all_landed(pair_room_t *rooms)
{
    for (uint32_t i = 0; i < ROOMS; i++) {
        const char *why = "";
        if (pair_wait_receiver(&rooms[i], WAIT_MS) != KVW_POLL_SUCCESS)
            kvw_receiver_failure(rooms[i].r, &why);
        assert_string_equal(why, "");
        assert_int_equal(pair_wait_sender(&rooms[i], WAIT_MS), KVW_POLL_SUCCESS);
        assert_int_equal(pair_wrong_bytes(&pair, &rooms[i]), 0);
        pair_destroy_room(&rooms[i]);
    }
}

/* Prefill's connection (there is one). */
static kvw_peer_t *prefill_peer(void)
{
    kvw_peer_t *p = kvw__peer_at(pair.prefill, 0);
    assert_non_null(p);
    assert_int_equal(p->nlanes, 2);
    return p;
}

static uint64_t counter(_Atomic uint64_t *c)
{
    return atomic_load(c);
}

/* Waits (bounded: ms) until *c is at least n; true if it got there. */
static bool wait_counter(_Atomic uint64_t *c, uint64_t n, int ms)
{
    for (int i = 0; i < ms && counter(c) < n; i++)
        pair_sleep_ms(1);
    return counter(c) >= n;
}

/* Two rails each side; the QP of prefill's lane on its second rail
 * fails on its 3rd WR (decode's NIC refuses it: remote access error, so
 * nothing from there on landed). Every request still succeeds with every
 * byte: those that used the lane start over on the first rail, and decode
 * counts only the immediates of their latest attempt. */
static void test_lane_error_fails_over(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    start_rooms(rooms);
    kvw_peer_t *p = prefill_peer();
    assert_int_equal(p->lanes[1].rail, 1);
    fake_nic_faults_t f = {.fault_qp_num = p->lanes[1].qp->qp->qp_num, .error_wr = 3};
    fake_nic_set_faults(&f);
    send_rooms(rooms);
    assert_all_landed(rooms);
    fake_nic_set_faults(NULL);
    kvw_engine_counters_t *c = &pair.prefill->counters;
    print_message("lanes failed %llu, requests replayed %llu, refused %llu\n",
                  (unsigned long long)counter(&c->lanes_failed),
                  (unsigned long long)counter(&c->replays),
                  (unsigned long long)counter(&c->replay_refused));
    assert_int_equal(counter(&c->lanes_failed), 1);
    assert_true(counter(&c->replays) >= 1);
    assert_int_equal(counter(&c->replay_refused), 0);
    /* The connection lives on, on its first rail: another request goes. */
    transfer_rooms();
}

/* A port of prefill's second rail goes down before anything is sent: the
 * rail's lanes are failed over before they carry a write, and every
 * request goes on the first rail. */
static void test_rail_port_down(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    start_rooms(rooms);
    kvw_peer_t *p = prefill_peer();
    /* The port stays down (its probes find it so): no rejoin meanwhile. */
    assert_int_equal(fake_nic_kill_device("fake2"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ERR), 0);
    for (int i = 0; i < 2000 && !atomic_load(&p->lanes[1].health.down_due); i++)
        pair_sleep_ms(1);
    assert_true(atomic_load(&p->lanes[1].health.down_due));
    send_rooms(rooms);
    assert_all_landed(rooms);
    kvw_rail_t rails[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(rails), 2);
    assert_int_equal(rails[1].wrs_posted, 0);
    assert_true(rails[0].wrs_posted > 0);
    assert_int_equal(counter(&pair.prefill->counters.lanes_failed), 1);
    assert_int_equal(counter(&pair.prefill->counters.replay_refused), 0);
}

/* ROOMS requests sent, then decode's second device dies: each ends the
 * same way on both sides; one that succeeds has every byte, one that fails
 * leaves its pages unchanged afterwards. Returns how many succeeded. */
static uint32_t send_then_kill_decode_rail(void)
{
    pair_room_t rooms[ROOMS];
    start_rooms(rooms);
    send_rooms(rooms);
    assert_int_equal(fake_nic_kill_device("fake3"), 0);
    uint32_t ok = 0;
    for (uint32_t i = 0; i < ROOMS; i++) {
        kvw_poll_t d = pair_wait_receiver(&rooms[i], WAIT_MS);
        kvw_poll_t s = pair_wait_sender(&rooms[i], WAIT_MS);
        assert_true(d == KVW_POLL_SUCCESS || d == KVW_POLL_FAILED);
        assert_int_equal(d, s);
        if (d == KVW_POLL_SUCCESS) {
            assert_int_equal(pair_wrong_bytes(&pair, &rooms[i]), 0);
            ok++;
        } else {
            uint8_t *snap = malloc(pair_snapshot_size(&rooms[i]));
            assert_non_null(snap);
            pair_snapshot(&pair, &rooms[i], snap);
            fake_nic_quiesce(WAIT_MS);
            assert_true(pair_snapshot_equal(&pair, &rooms[i], snap));
            free(snap);
        }
        pair_destroy_room(&rooms[i]);
    }
    return ok;
}

/* Decode's second device dies mid-transfer: prefill's writes to it run
 * out of retries (a timeout: writes before it may have landed unseen).
 * Every request ends the same way on both sides, with every byte: one
 * whose final immediate went on the dead rail is asked about (decode may
 * have completed it) and replayed or ended as landed. A request that
 * failed anyway would have to leave its pages unchanged afterwards. */
static void test_rail_dies_mid_transfer(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    uint32_t ok = send_then_kill_decode_rail();
    kvw_engine_counters_t *c = &pair.prefill->counters;
    print_message("%u of %u ok; lanes failed %llu, replayed %llu, asked decode %llu (it had "
                  "%llu), refused %llu\n",
                  ok, ROOMS, (unsigned long long)counter(&c->lanes_failed),
                  (unsigned long long)counter(&c->replays),
                  (unsigned long long)counter(&c->replay_asks),
                  (unsigned long long)counter(&c->replay_done),
                  (unsigned long long)counter(&c->replay_refused));
    /* A request whose final immediate was on the dead rail is asked about
     * (REPLAY_ASK), then replayed or ended as landed: none fails. */
    assert_int_equal(counter(&c->replay_refused), 0);
    assert_int_equal(ok, ROOMS);
    /* The first rail carries new requests. */
    transfer_rooms();
}

/* Every request landed and decode reported Success, but prefill has not
 * heard the ACKs (late by 500 ms): the set-up of the ask round trip. */
static void land_unacked(pair_room_t *rooms)
{
    start_rooms(rooms);
    fake_nic_faults_t f = {.ack_delay_us = 500000};
    fake_nic_set_faults(&f);
    send_rooms(rooms);
    for (uint32_t i = 0; i < ROOMS; i++)
        assert_int_equal(pair_wait_receiver(&rooms[i], WAIT_MS), KVW_POLL_SUCCESS);
}

static void take_prefill_rail_down(void)
{
    assert_int_equal(fake_nic_kill_device("fake2"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ERR), 0);
}

static void print_asks(void)
{
    kvw_engine_counters_t *c = &pair.prefill->counters;
    print_message(
        "asked decode %llu, it had %llu; replayed %llu, refused %llu\n",
        (unsigned long long)counter(&c->replay_asks), (unsigned long long)counter(&c->replay_done),
        (unsigned long long)counter(&c->replays), (unsigned long long)counter(&c->replay_refused));
}

/* Prefill's requests after an ask decode could not answer usefully: each
 * ends Success (it never used the failed lane) or Failed with `reason`;
 * returns how many failed. */
static uint32_t senders_failed_with(pair_room_t *rooms, const char *reason)
{
    uint32_t failed = 0;
    for (uint32_t i = 0; i < ROOMS; i++) {
        kvw_poll_t s = pair_wait_sender(&rooms[i], WAIT_MS);
        assert_true(s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED);
        if (s == KVW_POLL_FAILED) {
            const char *why = "";
            kvw_sender_failure(rooms[i].s, &why);
            if (!strstr(why, reason))
                print_message("room %u failed: %s\n", i, why);
            assert_non_null(strstr(why, reason));
            failed++;
        }
        pair_destroy_room(&rooms[i]);
    }
    return failed;
}

/* After the port went down: every request prefill asked decode about
 * failed with `reason`, none ended as landed and none was replayed. */
static void assert_asked_and_failed(pair_room_t *rooms, const char *reason)
{
    uint32_t failed = senders_failed_with(rooms, reason);
    fake_nic_set_faults(NULL);
    print_asks();
    kvw_engine_counters_t *c = &pair.prefill->counters;
    assert_true(counter(&c->replay_asks) >= 1);
    assert_int_equal(failed, counter(&c->replay_asks));
    assert_int_equal(counter(&c->replay_done), 0);
    assert_int_equal(counter(&c->replays), 0);
}

/* Decode had every request already when prefill's second rail's port
 * goes down. The requests' final immediates were on the failed lane, so
 * prefill asks decode (REPLAY_ASK), which says it has them: they end
 * Success on prefill too, nothing replayed into pages decode may have
 * reused. */
static void test_decode_had_it(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    land_unacked(rooms);
    take_prefill_rail_down();
    for (uint32_t i = 0; i < ROOMS; i++) {
        const char *why = "";
        if (pair_wait_sender(&rooms[i], WAIT_MS) != KVW_POLL_SUCCESS)
            kvw_sender_failure(rooms[i].s, &why);
        assert_string_equal(why, "");
        assert_int_equal(pair_wrong_bytes(&pair, &rooms[i]), 0);
        pair_destroy_room(&rooms[i]);
    }
    fake_nic_set_faults(NULL);
    print_asks();
    kvw_engine_counters_t *c = &pair.prefill->counters;
    assert_true(counter(&c->replay_done) >= 1);
    assert_int_equal(counter(&c->replay_done), counter(&c->replay_asks));
    assert_int_equal(counter(&c->replay_refused), 0);
}

/* As above, but decode's application destroyed its receivers after
 * Success (it may reuse the pages): decode answers that it no longer has
 * them, and each request asked about fails on prefill rather than being
 * replayed into pages that are no longer its own. */
static void test_decode_forgot_it(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    land_unacked(rooms);
    for (uint32_t i = 0; i < ROOMS; i++) {
        kvw_receiver_destroy(rooms[i].r);
        rooms[i].r = NULL;
    }
    take_prefill_rail_down();
    assert_asked_and_failed(rooms, "decode no longer has the request");
}

/* Decode's answers are lost: prefill waits out its 5 s for each request
 * asked about, then fails it (the abort barrier as any failure); none is
 * replayed without an answer. The connection lives on. (The transfer
 * timeout, longer than the wait as by default, must not end them first.) */
static bool drop_answers(void *sock, const kvw_msg_t *m)
{
    (void)sock;
    return m->type == KVW_MSG_REPLAY_ANSWER;
}

static void test_decode_answer_lost(void **state)
{
    (void)state;
    open_rails_timeout("fake0,fake2", "fake1,fake3", 1, 15000);
    pair_room_t rooms[ROOMS];
    land_unacked(rooms);
    atomic_store(&kvw__zdrop_hook, drop_answers);
    take_prefill_rail_down();
    assert_asked_and_failed(rooms, "decode did not say in time");
    atomic_store(&kvw__zdrop_hook, NULL);
    transfer_rooms();
}

/* Decode counts a request's immediates per attempt: once one of a later
 * epoch arrives, those of earlier ones no longer count, and late ones of
 * an earlier epoch are ignored. Driven by hand from prefill's QP
 * (unsignaled, so prefill's poller never sees a completion it did not
 * post): epoch 0 says 2 lanes and one arrives; epoch 1 says 2 lanes, and
 * a late epoch-0 one between its two must not complete the request. */
static void test_decode_counts_per_epoch(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t a;
    pair_pick(&a, 30, 4, 17, 0);
    assert_int_equal(pair_create(&pair, &a), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(&a, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
    kvw_peer_t *p = prefill_peer();
    uint32_t token = ((kvw_req_t *)a.r)->token;
    uint32_t two = 1u << KVW_WIRE_IMM_COUNT_SHIFT;
    const uint32_t imms[] = {token | two, token | 1u << KVW_WIRE_IMM_EPOCH_SHIFT | two, token | two,
                             token | 1u << KVW_WIRE_IMM_EPOCH_SHIFT | two};
    for (size_t i = 0; i < 4; i++) {
        const kvw_lane_t *l = &p->lanes[i % 2];
        struct ibv_send_wr wr = {
            .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
            .imm_data = htonl(imms[i]),
            .wr.rdma = {.remote_addr = l->regions[0].remote_addr, .rkey = l->regions[0].rkey}};
        struct ibv_send_wr *bad = NULL;
        assert_int_equal(fake_nic_ops.post_send(l->qp->qp, &wr, &bad), 0);
        fake_nic_quiesce(WAIT_MS);
        pair_sleep_ms(50);
        if (i < 3) /* epoch 0 had one of two, epoch 1 one of two: the late epoch-0 one counts not */
            assert_int_equal(kvw_receiver_poll(a.r), KVW_POLL_TRANSFERRING);
    }
    assert_int_equal(pair_wait_receiver(&a, WAIT_MS), KVW_POLL_SUCCESS);
    kvw_sender_abort(a.s);
    pair_destroy_room(&a);
}

/* Both of decode's devices die: no rail is left, every request fails on
 * both sides. */
static void test_every_rail_fails(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    start_rooms(rooms);
    assert_int_equal(fake_nic_kill_device("fake1"), 0);
    assert_int_equal(fake_nic_kill_device("fake3"), 0);
    /* The first room's writes may fail the connection before the others
     * are sent: a send to a sender already Failed is refused. */
    for (uint32_t i = 0; i < ROOMS; i++) {
        kvw_status_t st = kvw_sender_send(rooms[i].s, rooms[i].src, rooms[i].n);
        assert_true(st == KVW_OK ||
                    (st == KVW_ERR_STATE && kvw_sender_poll(rooms[i].s) == KVW_POLL_FAILED));
    }
    for (uint32_t i = 0; i < ROOMS; i++) {
        assert_int_equal(pair_wait_sender(&rooms[i], WAIT_MS), KVW_POLL_FAILED);
        assert_int_equal(pair_wait_receiver(&rooms[i], WAIT_MS), KVW_POLL_FAILED);
        pair_destroy_room(&rooms[i]);
    }
}

/* ---- a rail that comes back --------------------------------------------- */

/* One engine's health of rail r. */
static kvw_rail_health_t health_of(const kvw_engine_t *e, uint32_t r)
{
    kvw_rail_health_t h[KVW_MAX_RAILS];
    assert_true(kvw_engine_rail_health(e, h, KVW_MAX_RAILS) > r);
    return h[r];
}

/* Waits (bounded) until engine e's rail r shows at least (or, with
 * at_most, at most) n of what `field` (offset into kvw_rail_health_t, a
 * uint32_t) counts; true if it did. */
static bool wait_engine_health(const kvw_engine_t *e, uint32_t r, size_t field, uint32_t n,
                               bool at_most)
{
    for (int i = 0; i < WAIT_MS; i++) {
        kvw_rail_health_t h = health_of(e, r);
        uint32_t v;
        memcpy(&v, (const char *)&h + field, sizeof(v));
        if (at_most ? v <= n : v >= n)
            return true;
        pair_sleep_ms(1);
    }
    return false;
}

static bool wait_health(uint32_t r, size_t field, uint32_t n)
{
    return wait_engine_health(pair.prefill, r, field, n, false);
}

static void print_health(const char *when)
{
    kvw_rail_health_t h = health_of(pair.prefill, 1);
    kvw_engine_counters_t *c = &pair.prefill->counters;
    print_message("%s: rail 1 lanes failed %u, rejoined %u, out %u, probes %u (%llu failed), "
                  "recovery %llu us\n",
                  when, h.lanes_failed, h.lanes_rejoined, h.lanes_out, h.probes,
                  (unsigned long long)counter(&c->lane_probes_failed),
                  (unsigned long long)h.recovery_us_last);
}

/* After a rejoin: nothing out on either side, and the rail carries writes
 * again (more than the one probe write) with every byte landing. */
static void assert_rail_back(const kvw_rail_t *before)
{
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, lanes_rejoined), 1));
    kvw_rail_health_t h = health_of(pair.prefill, 1);
    assert_int_equal(h.lanes_out, 0);
    assert_true(h.recovery_us_last > 0);
    assert_true(h.recovery_us_max >= h.recovery_us_last);
    /* Decode's poller takes its end back once LANE_READY went out. */
    assert_true(
        wait_engine_health(pair.decode, 1, offsetof(kvw_rail_health_t, lanes_out), 0, true));
    assert_true(health_of(pair.decode, 1).lanes_rejoined >= 1); /* once per reset asked for */
    transfer_rooms();
    kvw_rail_t after[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(after), 2);
    assert_true(after[1].wrs_posted > before[1].wrs_posted + 1);
    assert_rails_sum(after, 2);
}

/* Prefill's second device loses its link (port DOWN, a port-down event):
 * its lane fails over and is paused. Probes find the port down and back
 * off (100 ms, then 200 ms, ...); once it is up the lane is reset on both
 * sides, a zero-length write proves the path, and the lane carries writes
 * again, every byte landing. */
static void test_rail_comes_back(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    assert_int_equal(fake_nic_kill_device("fake2"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ERR), 0);
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, lanes_out), 1));
    kvw_rail_t down[KVW_MAX_RAILS];
    transfer_rooms();
    assert_int_equal(prefill_rails(down), 2);
    /* Two probes, each finding the port down: the lane stays out. */
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, probes), 2));
    print_health("port down");
    assert_int_equal(health_of(pair.prefill, 1).lanes_rejoined, 0);
    assert_true(counter(&pair.prefill->counters.lane_probes_failed) >= 2);
    kvw_rail_t still[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(still), 2);
    assert_int_equal(still[1].wrs_posted, down[1].wrs_posted); /* nothing on it meanwhile */
    assert_int_equal(fake_nic_revive_device("fake2"), 0);
    assert_rail_back(down);
    print_health("port up");
    assert_int_equal(health_of(pair.prefill, 1).lanes_failed, 1);
}

/* Decode's second device dies mid-transfer (retry exhaustion on prefill's
 * lane). Its port reads up on prefill's side, so probes reset the lane on
 * both sides, and the probe write finds nobody: the lane is paused again,
 * for longer. Once decode's device is back, the next probe brings the lane
 * back. */
static void test_rail_comes_back_after_peer(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    assert_int_equal(send_then_kill_decode_rail(), ROOMS);
    /* At least one whole try: reset on both sides, the probe write lost. */
    wait_counter(&pair.prefill->counters.lane_probes_failed, 1, WAIT_MS);
    print_health("decode's device down");
    assert_true(counter(&pair.prefill->counters.lane_probes_failed) >= 1);
    assert_int_equal(health_of(pair.prefill, 1).lanes_rejoined, 0);
    kvw_rail_t before[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(before), 2);
    assert_int_equal(fake_nic_revive_device("fake3"), 0);
    assert_rail_back(before);
    print_health("decode's device back");
}

/* The port of `dead` (prefill's fake2 or decode's fake3) comes up again
 * (IBV_EVENT_PORT_ACTIVE) while its lane waits out a cooldown grown by
 * three failed probes (800 ms, then 1.6 s): the lane is probed at once
 * rather than when the cooldown ends. Prefill sees its own port's event;
 * decode's is relayed to prefill as LANE_UP, since prefill's port never
 * went down. Counted: the cooldown cut short (lane_probes_early). */
/* Connected on two rails (the log to `log` from then on, at info; NULL:
 * the quiet log), then `dead` loses its link (port-down event) and
 * prefill's probes fail three times (cooldowns 200, 400, 800 ms).
 * Returns when the third failed (pair_now_ms). */
static uint64_t down_until_three_probes_failed(const char *dead, kvw_log_fn log)
{
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    if (log)
        kvw_set_log_handler(log, NULL, KVW_LOG_INFO);
    assert_int_equal(fake_nic_kill_device(dead), 0);
    assert_int_equal(fake_nic_raise_port_event(dead, IBV_EVENT_PORT_ERR), 0);
    assert_true(wait_counter(&pair.prefill->counters.lane_probes_failed, 3, 4 * WAIT_MS));
    return pair_now_ms();
}

static void port_up_probes_now(const char *dead)
{
    uint64_t paused_at = down_until_three_probes_failed(dead, NULL);
    kvw_rail_t down[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(down), 2);
    print_health("port down, three probes failed");
    assert_int_equal(fake_nic_revive_device(dead), 0);
    assert_int_equal(fake_nic_raise_port_event(dead, IBV_EVENT_PORT_ACTIVE), 0);
    uint64_t late_ms = pair_now_ms() - paused_at;
    assert_rail_back(down);
    print_health("port up");
    uint64_t early = counter(&pair.prefill->counters.lane_probes_early);
    print_message("cooldowns cut short: %llu (this thread raised the event %llu ms after the "
                  "third failed probe)\n",
                  (unsigned long long)early, (unsigned long long)late_ms);
    /* Only a test thread stalled for most of the 800 ms cooldown could see
     * the scheduled probe come first. */
    if (late_ms < 400)
        assert_int_equal(early, 1);
    assert_int_equal(health_of(pair.prefill, 1).lanes_failed, 1);
}

static void test_port_up_probes_now(void **state)
{
    (void)state;
    port_up_probes_now("fake2");
}

static void test_decode_port_up_says_so(void **state)
{
    (void)state;
    port_up_probes_now("fake3");
}

/* What a counting log handler passes on: errors, and all with KVW_TEST_LOG. */
static void pass_on(kvw_log_level_t level, const char *msg)
{
    if (level == KVW_LOG_ERROR || getenv("KVW_TEST_LOG"))
        fprintf(stderr, "kvwire: %s\n", msg);
}

/* The cooldowns prefill's log announced ("next probe in N ms"), in order. */
static _Atomic uint32_t cooldowns[16];
static atomic_uint ncooldowns;

static void record_cooldowns(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    const char *at = strstr(msg, "next probe in ");
    unsigned ms;
    if (at && sscanf(at, "next probe in %u ms", &ms) == 1) {
        unsigned i = atomic_fetch_add(&ncooldowns, 1);
        if (i < 16)
            atomic_store(&cooldowns[i], ms);
    }
    pass_on(level, msg);
}

/* A port event that comes too soon (the port reads up, the lane does not
 * work yet; here: the event with the link still down) brings one try
 * forward, which fails: the cooldown is not grown for it, and the
 * schedule goes on as before. A later event with the link up brings the
 * lane back. */
static void test_port_up_too_soon(void **state)
{
    (void)state;
    atomic_store(&ncooldowns, 0);
    uint64_t paused_at = down_until_three_probes_failed("fake2", record_cooldowns);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ACTIVE), 0);
    wait_counter(&pair.prefill->counters.lane_probes_failed, 4, WAIT_MS);
    uint64_t late_ms = pair_now_ms() - paused_at;
    assert_true(atomic_load(&ncooldowns) >= 4);
    print_message("cooldowns: %u, %u, %u, then after the early try %u ms (event %llu ms after "
                  "the third failure)\n",
                  atomic_load(&cooldowns[0]), atomic_load(&cooldowns[1]),
                  atomic_load(&cooldowns[2]), atomic_load(&cooldowns[3]),
                  (unsigned long long)late_ms);
    assert_int_equal(atomic_load(&cooldowns[0]), 200);
    assert_int_equal(atomic_load(&cooldowns[1]), 400);
    assert_int_equal(atomic_load(&cooldowns[2]), 800);
    if (late_ms < 400) { /* else the scheduled try may have come first */
        assert_int_equal(counter(&pair.prefill->counters.lane_probes_early), 1);
        assert_int_equal(atomic_load(&cooldowns[3]), 800);
    }
    kvw_rail_t down[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(down), 2);
    assert_int_equal(fake_nic_revive_device("fake2"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ACTIVE), 0);
    assert_rail_back(down);
    print_health("port up");
}

static atomic_uint probe_posts_failed; /* log lines saying so */

static void count_probe_post_failures(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (strstr(msg, "posting the probe write failed"))
        atomic_fetch_add(&probe_posts_failed, 1);
    pass_on(level, msg);
}

/* The probe write's post fails (ibv_post_send refuses it, e.g. ENOMEM):
 * the lane is paused again, for longer, like a probe that found the port
 * down, and the next probe brings it back; nothing else is touched. */
static void test_probe_post_fails(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    atomic_store(&probe_posts_failed, 0);
    kvw_set_log_handler(count_probe_post_failures, NULL, KVW_LOG_WARN);
    kvw_peer_t *p = prefill_peer();
    fake_nic_faults_t f = {
        .fault_qp_num = p->lanes[1].qp->qp->qp_num, .fail_post_call = 1, .fail_post_rc = ENOMEM};
    assert_int_equal(fake_nic_kill_device("fake2"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake2", IBV_EVENT_PORT_ERR), 0);
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, lanes_out), 1));
    fake_nic_set_faults(&f); /* the lane's next post is its probe's */
    kvw_rail_t down[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(down), 2);
    assert_int_equal(fake_nic_revive_device("fake2"), 0);
    assert_rail_back(down);
    print_health("probe post failed once");
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.fatal_errors, 0);
    /* The post that failed was a probe's, and it was tried again. */
    assert_int_equal(atomic_load(&probe_posts_failed), 1);
    assert_true(counter(&pair.prefill->counters.lane_probes_failed) >= 1);
    assert_true(health_of(pair.prefill, 1).probes >= 2);
    assert_int_equal(health_of(pair.prefill, 1).lanes_failed, 1);
    assert_int_equal(counter(&pair.prefill->counters.replay_refused), 0);
    fake_nic_set_faults(NULL);
}

/* An engine is created while one of its rails' link is down (a node
 * starting with a NIC out, `dead`: prefill's fake2 or decode's fake3): it
 * starts on its live rail, the connection comes up there and carries every
 * request, and the lane on the down rail joins once its link is up (its
 * port-up event). */
static void create_with_rail_down(const char *dead)
{
    pair_set_down_at_open(dead, NULL);
    open_rails("fake0,fake2", "fake1,fake3", 1);
    kvw_engine_t *owner = strcmp(dead, "fake2") == 0 ? pair.prefill : pair.decode;
    assert_true(owner->rail[1].dev->down_at_open);
    transfer_rooms();
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, lanes_out), 1));
    kvw_rail_t down[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(down), 2);
    print_health("created with a rail down");
    assert_int_equal(counter(&pair.prefill->counters.replay_refused), 0);
    assert_int_equal(fake_nic_revive_device(dead), 0);
    assert_int_equal(fake_nic_raise_port_event(dead, IBV_EVENT_PORT_ACTIVE), 0);
    assert_rail_back(down);
    print_health("link up");
}

static void test_create_with_prefill_rail_down(void **state)
{
    (void)state;
    create_with_rail_down("fake2");
}

static void test_create_with_decode_rail_down(void **state)
{
    (void)state;
    create_with_rail_down("fake3");
}

/* Every rail down at creation, or the one device named: refused, by name. */
static void test_create_with_every_rail_down(void **state)
{
    (void)state;
    pair_set_down_at_open("fake0", "fake2");
    kvw_config_t pc;
    pair_config(&pc);
    snprintf(pc.devices, sizeof(pc.devices), "fake0,fake2");
    quiet_log();
    pair_set_nic_devices(4);
    opened = true;
    assert_int_equal(pair_open(&pair, &pc), KVW_ERR_NO_DEVICE);
    assert_null(pair.prefill);
    close_rails(NULL);
    pair_set_down_at_open("fake0", NULL);
    pair_set_nic_devices(4);
    opened = true;
    assert_int_equal(pair_open(&pair, NULL), KVW_ERR_NO_DEVICE); /* fake0 alone */
    assert_null(pair.prefill);
}

/* A connection made while a rail's link is down comes up on the other
 * rail; the lane that could not be connected is probed back once the
 * link is up, and then carries writes. `dead`: the device whose link is
 * down, prefill's (its port is not up at the handshake: that lane is
 * failed over before any write) or decode's (decode cannot connect its
 * end; prefill learns it from its first writes there, which run out of
 * retries, and replays or asks). */
static void connect_during_outage(const char *dead)
{
    open_rails("fake0,fake2", "fake1,fake3", 1);
    assert_int_equal(fake_nic_kill_device(dead), 0);
    transfer_rooms(); /* connects, and every request succeeds */
    kvw_rail_t down[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(down), 2);
    assert_true(wait_health(1, offsetof(kvw_rail_health_t, lanes_out), 1));
    print_health("connected during the outage");
    assert_int_equal(counter(&pair.prefill->counters.replay_refused), 0);
    assert_int_equal(fake_nic_revive_device(dead), 0);
    assert_rail_back(down);
    print_health("link back");
    assert_int_equal(health_of(pair.prefill, 1).lanes_failed, 1);
}

static void test_connect_during_prefill_outage(void **state)
{
    (void)state;
    connect_during_outage("fake2");
    /* Its lane never carried a write before it came back. */
    assert_int_equal(counter(&pair.prefill->counters.replays), 0);
}

static void test_connect_during_decode_outage(void **state)
{
    (void)state;
    connect_during_outage("fake3");
}

/* Decode's second port goes down while prefill's writes on that rail are
 * on the wire but go nowhere (stalled: no ACK, no error yet, as before the
 * retries run out). Decode says so (LANE_DOWN): prefill fails the lane
 * over at once, its QP flushes, and every request succeeds on the first
 * rail. Without the message the stalled writes would wait for their
 * retries, and here (a stall never times out) the requests would fail at
 * the transfer timeout. */
static void test_decode_says_its_end_is_down(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    pair_room_t rooms[ROOMS];
    start_rooms(rooms);
    kvw_peer_t *p = prefill_peer();
    fake_nic_faults_t f = {.stall_qp_num = p->lanes[1].qp->qp->qp_num};
    fake_nic_set_faults(&f);
    send_rooms(rooms);
    assert_int_equal(fake_nic_kill_device("fake3"), 0);
    assert_int_equal(fake_nic_raise_port_event("fake3", IBV_EVENT_PORT_ERR), 0);
    assert_all_landed(rooms);
    fake_nic_set_faults(NULL);
    print_health("decode's port down");
    assert_int_equal(counter(&pair.prefill->counters.lanes_failed), 1);
    assert_int_equal(counter(&pair.prefill->counters.replay_refused), 0);
    transfer_rooms();
}

/* A malformed KVW_DEVICES refuses the engine. */
static void test_bad_device_lists(void **state)
{
    (void)state;
    static const char *bad[] = {"fake0,fake0", "fake0,fake1,fake2,fake3,fake4", "nosuch0,fake1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvw_config_t pc;
        pair_config(&pc);
        snprintf(pc.devices, sizeof(pc.devices), "%s", bad[i]);
        pair_set_nic_devices(8);
        opened = true;
        assert_int_not_equal(pair_open(&pair, &pc), KVW_OK);
        assert_null(pair.prefill);
        close_rails(NULL);
    }
}

/* ---- a lane's lifetimes ------------------------------------------------- */

/* r's lanes with writes of it, read under the poller's pass lock. */
static uint32_t lanes_of(pair_room_t *pr)
{
    kvw_req_t *r = (kvw_req_t *)pr->s;
    pthread_mutex_lock(&pair.prefill->pass_lock);
    uint32_t m = r->tx.lane_mask;
    pthread_mutex_unlock(&pair.prefill->pass_lock);
    return m;
}

static bool parked(pair_room_t *pr)
{
    kvw_req_t *r = (kvw_req_t *)pr->s;
    pthread_mutex_lock(&pair.prefill->lock);
    bool starved = r->tx.starved;
    pthread_mutex_unlock(&pair.prefill->lock);
    return starved;
}

/* Decode's application reuses pr's pages (every KV item and the aux
 * item) once its receiver reported Success: they hold `byte` from now. */
static void reuse_pages(pair_room_t *pr, uint8_t byte)
{
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        for (size_t k = 0; k < pr->n; k++)
            memset(pair.dst[i] + pr->dst[k] * PAIR_ITEM, byte, PAIR_ITEM);
    memset(pair.dst_aux + pr->aux_dst * PAIR_AUX_ITEM, byte, PAIR_AUX_ITEM);
}

/* Bytes of pr's reused pages that no longer hold `byte`. */
static size_t reused_bytes_changed(pair_room_t *pr, uint8_t byte)
{
    size_t changed = 0;
    for (uint32_t i = 0; i < 2 * PAIR_LAYERS; i++)
        for (size_t k = 0; k < pr->n; k++)
            for (size_t b = 0; b < PAIR_ITEM; b++)
                changed += fake_nic_peek(pair.dst[i] + pr->dst[k] * PAIR_ITEM + b) != byte;
    for (size_t b = 0; b < PAIR_AUX_ITEM; b++)
        changed += fake_nic_peek(pair.dst_aux + pr->aux_dst * PAIR_AUX_ITEM + b) != byte;
    return changed;
}

static void rail_down(const char *dev)
{
    assert_int_equal(fake_nic_kill_device(dev), 0);
    assert_int_equal(fake_nic_raise_port_event(dev, IBV_EVENT_PORT_ERR), 0);
}

static void rail_up(const char *dev)
{
    assert_int_equal(fake_nic_revive_device(dev), 0);
    assert_int_equal(fake_nic_raise_port_event(dev, IBV_EVENT_PORT_ACTIVE), 0);
}

enum { REUSED = 0x5a, LATE_ACK_US = 6000000 };

/* A flapping rail must not replay a request into pages decode reused.
 * Room A's first part lands on both lanes and A parks between parts;
 * lane 1's rail fails (A's writes there all landed: left alone); A's final
 * part goes while lane 1 is out, so its immediates are fixed without it;
 * decode counts them, reports Success, and its application reuses the
 * pages at once. Prefill hears A's last ACKs late (6 s), so A is still in
 * flight when lane 1 rejoins and fails again. That second failure is of a
 * later life of lane 1: A owes it nothing (no write of it in that life, no
 * immediate), so A is neither replayed nor asked about, ends Success, and
 * its reused pages never change. */
static void test_flap_no_replay_after_success(void **state)
{
    (void)state;
    /* Seconds with heartbeats as the only sign of life from an idle decode
     * (its receiver is gone, the ACKs late): a loaded machine must not make
     * a silent peer of it. */
    open_rails_timeouts("fake0,fake2", "fake1,fake3", 1, 4 * LATE_ACK_US / 1000,
                        LATE_ACK_US / 1000);
    pair_room_t a;
    pair_pick(&a, 40, PAGES, 7727, 0);
    assert_int_equal(pair_create(&pair, &a), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(&a, WAIT_MS), KVW_POLL_WAITING_FOR_INPUT);
    assert_int_equal(kvw_sender_send(a.s, a.src, a.n / 2), KVW_OK);
    for (int i = 0; i < WAIT_MS && !parked(&a); i++)
        pair_sleep_ms(1);
    assert_true(parked(&a));
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    assert_int_equal(lanes_of(&a), 3); /* the first part went on both lanes */

    kvw_engine_counters_t *c = &pair.prefill->counters;
    rail_down("fake2");
    assert_true(wait_counter(&c->lanes_failed, 1, WAIT_MS));
    fake_nic_faults_t late = {.ack_delay_us = LATE_ACK_US};
    fake_nic_set_faults(&late);
    assert_int_equal(kvw_sender_send(a.s, a.src + a.n / 2, a.n - a.n / 2), KVW_OK);
    assert_int_equal(pair_wait_receiver(&a, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(&pair, &a), 0);
    kvw_receiver_destroy(a.r);
    a.r = NULL;
    reuse_pages(&a, REUSED);
    fake_nic_set_faults(NULL); /* A's ACKs stay late; the probe's are not */

    rail_up("fake2");
    assert_true(wait_counter(&c->lanes_rejoined, 1, WAIT_MS));
    /* The set-up holds only while prefill has not heard A's last ACKs. */
    assert_int_equal(kvw_sender_poll(a.s), KVW_POLL_TRANSFERRING);
    rail_down("fake2");
    assert_true(wait_counter(&c->lanes_failed, 2, WAIT_MS));

    const char *why = "";
    char reason[KVW_WIRE_REASON_MAX] = "";
    if (pair_wait_sender(&a, 2 * WAIT_MS) != KVW_POLL_SUCCESS)
        kvw_sender_failure(a.s, &why);
    snprintf(reason, sizeof(reason), "%s", why);
    pair_destroy_room(&a);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    size_t changed = reused_bytes_changed(&a, REUSED);
    print_message("lanes failed %llu, rejoined %llu; replayed %llu, asked %llu; reused bytes "
                  "overwritten %zu\n",
                  (unsigned long long)counter(&c->lanes_failed),
                  (unsigned long long)counter(&c->lanes_rejoined),
                  (unsigned long long)counter(&c->replays),
                  (unsigned long long)counter(&c->replay_asks), changed);
    assert_int_equal(changed, 0);
    assert_int_equal(counter(&c->replays), 0);
    assert_string_equal(reason, "");
}

/* The PSN prefill's lane 1 has in its current life (reset by each probe). */
static uint32_t prefill_lane_psn(void)
{
    return prefill_peer()->lanes[1].qp->psn;
}

/* Lane 1 fails (prefill's second port down) and comes back: a new life. */
static void flap_lane_once(void)
{
    kvw_engine_counters_t *c = &pair.prefill->counters;
    uint64_t failed = counter(&c->lanes_failed), back = counter(&c->lanes_rejoined);
    rail_down("fake2");
    assert_true(wait_counter(&c->lanes_failed, failed + 1, WAIT_MS));
    rail_up("fake2");
    assert_true(wait_counter(&c->lanes_rejoined, back + 1, WAIT_MS));
}

/* A LANE_DOWN decode sent in lane 1's first life, delayed on the way: the
 * drop hook puts it on decode's socket (from decode's control thread,
 * the socket's own) in front of decode's next PING. */
static _Atomic uint32_t late_down_psn;
static atomic_bool late_down_sent;

static bool send_late_down(void *sock, const kvw_msg_t *m)
{
    if (m->type != KVW_MSG_PING || atomic_exchange(&late_down_sent, true))
        return false;
    kvw_msg_t down = {.type = KVW_MSG_LANE_DOWN};
    down.u.lane.qp = 1;
    down.u.lane.peer_psn = atomic_load(&late_down_psn);
    assert_int_equal(kvw__zsend_raw(sock, &down, 0), KVW_OK);
    return false; /* the PING follows it */
}

/* A LANE_DOWN of an earlier life of the lane (it names the PSN prefill
 * had then) reaches prefill after the lane came back: dropped, counted,
 * and the lane carries writes on. (Wire 10's LANE_DOWN named no life: it
 * knocked the live lane out again.) */
static void test_late_lane_down_dropped(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    uint32_t first_life = prefill_lane_psn();
    flap_lane_once();
    assert_int_not_equal(prefill_lane_psn(), first_life);
    kvw_rail_t before[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(before), 2);
    uint64_t drops = counter(&pair.prefill->drops);
    atomic_store(&late_down_psn, first_life);
    atomic_store(&late_down_sent, false);
    atomic_store(&kvw__zdrop_hook, send_late_down);
    assert_true(wait_counter(&pair.prefill->drops, drops + 1, WAIT_MS));
    atomic_store(&kvw__zdrop_hook, NULL);
    assert_true(atomic_load(&late_down_sent));
    transfer_rooms();
    kvw_rail_t after[KVW_MAX_RAILS];
    assert_int_equal(prefill_rails(after), 2);
    assert_int_equal(counter(&pair.prefill->counters.lanes_failed), 1);
    assert_true(after[1].wrs_posted > before[1].wrs_posted);
}

/* Only the first LANE_RESET reaches decode: prefill's later tries time
 * out, so decode's lane stays as the failed reconnect left it. */
static _Atomic uint32_t resets_seen;

static bool pass_first_reset(void *sock, const kvw_msg_t *m)
{
    (void)sock;
    return m->type == KVW_MSG_LANE_RESET && atomic_fetch_add(&resets_seen, 1) > 0;
}

enum { RECVS_TAKEN = 5 };

/* Decode's reconnect of lane 1 (prefill asked for its reset) posts its
 * receives and the post fails part-way, after RECVS_TAKEN of them: those
 * flush once the QP is in ERR and are counted in this life, so the count
 * the next reset waits for reaches exactly rq_depth. (It was forced to
 * rq_depth at the failure, and the flushes came on top: the next life
 * started RECVS_TAKEN ahead, taking completions of the old one for its
 * own.) The lane comes back on the next try. */
static void test_recv_post_fails_part_way(void **state)
{
    (void)state;
    open_rails("fake0,fake2", "fake1,fake3", 1);
    transfer_rooms();
    kvw_peer_t *dp = kvw__peer_at(pair.decode, 0);
    assert_non_null(dp);
    kvw_lane_t *dl = &dp->lanes[1];
    uint32_t depth = pair.decode->cfg.rq_depth;
    assert_true(depth > RECVS_TAKEN);
    kvw_engine_counters_t *c = &pair.prefill->counters;
    rail_down("fake2");
    assert_true(wait_counter(&c->lanes_failed, 1, WAIT_MS));
    fake_nic_faults_t f = {
        .fault_qp_num = dl->qp->qp->qp_num, .fail_recv_call = 1, .fail_recv_wr = RECVS_TAKEN};
    fake_nic_set_faults(&f);
    atomic_store(&resets_seen, 0);
    atomic_store(&kvw__zdrop_hook, pass_first_reset);
    rail_up("fake2");
    /* The failed reconnect says LANE_DOWN: prefill's try fails at once. */
    assert_true(wait_counter(&c->lane_probes_failed, 1, WAIT_MS));
    for (int i = 0; i < WAIT_MS && atomic_load(&dl->health.rq_flushed) < depth; i++)
        pair_sleep_ms(1);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    pair_sleep_ms(50);
    uint32_t flushed = atomic_load(&dl->health.rq_flushed);
    print_message("receives counted flushed after the failed reconnect: %u (depth %u)\n", flushed,
                  depth);
    assert_int_equal(flushed, depth);
    atomic_store(&kvw__zdrop_hook, NULL);
    fake_nic_set_faults(NULL);
    assert_true(wait_counter(&c->lanes_rejoined, 1, 4 * WAIT_MS));
    transfer_rooms();
}

/* Link speeds from ibv_query_port's codes. */
static void test_link_mbps(void **state)
{
    (void)state;
    assert_int_equal(kvw__link_mbps(1, 1), 2500);     /* SDR 1x */
    assert_int_equal(kvw__link_mbps(32, 2), 100000);  /* EDR 4x */
    assert_int_equal(kvw__link_mbps(64, 2), 200000);  /* HDR 4x */
    assert_int_equal(kvw__link_mbps(128, 2), 400000); /* NDR 4x */
    assert_int_equal(kvw__link_mbps(0, 2), 0);        /* unknown */
    assert_int_equal(kvw__link_mbps(32, 3), 0);
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_two_rails_each_side, close_rails),
        cmocka_unit_test_teardown(test_two_rails_two_qps, close_rails),
        cmocka_unit_test_teardown(test_decode_rails_only, close_rails),
        cmocka_unit_test_teardown(test_prefill_rails_only, close_rails),
        cmocka_unit_test_teardown(test_lane_error_fails_over, close_rails),
        cmocka_unit_test_teardown(test_rail_port_down, close_rails),
        cmocka_unit_test_teardown(test_decode_says_its_end_is_down, close_rails),
        cmocka_unit_test_teardown(test_rail_dies_mid_transfer, close_rails),
        cmocka_unit_test_teardown(test_every_rail_fails, close_rails),
        cmocka_unit_test_teardown(test_decode_counts_per_epoch, close_rails),
        cmocka_unit_test_teardown(test_decode_had_it, close_rails),
        cmocka_unit_test_teardown(test_decode_forgot_it, close_rails),
        cmocka_unit_test_teardown(test_decode_answer_lost, close_rails),
        cmocka_unit_test_teardown(test_rail_comes_back, close_rails),
        cmocka_unit_test_teardown(test_rail_comes_back_after_peer, close_rails),
        cmocka_unit_test_teardown(test_port_up_probes_now, close_rails),
        cmocka_unit_test_teardown(test_probe_post_fails, close_rails),
        cmocka_unit_test_teardown(test_decode_port_up_says_so, close_rails),
        cmocka_unit_test_teardown(test_port_up_too_soon, close_rails),
        cmocka_unit_test_teardown(test_create_with_prefill_rail_down, close_rails),
        cmocka_unit_test_teardown(test_create_with_decode_rail_down, close_rails),
        cmocka_unit_test_teardown(test_create_with_every_rail_down, close_rails),
        cmocka_unit_test_teardown(test_connect_during_prefill_outage, close_rails),
        cmocka_unit_test_teardown(test_connect_during_decode_outage, close_rails),
        cmocka_unit_test_teardown(test_flap_no_replay_after_success, close_rails),
        cmocka_unit_test_teardown(test_late_lane_down_dropped, close_rails),
        cmocka_unit_test_teardown(test_recv_post_fails_part_way, close_rails),
        cmocka_unit_test_teardown(test_bad_device_lists, close_rails),
        cmocka_unit_test(test_link_mbps),
    };
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
