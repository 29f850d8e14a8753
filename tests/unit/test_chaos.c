/* Randomized fault schedules against the whole engine on the fake NIC (not
 * RDMA). Each schedule is derived from one seed and printed when it breaks
 * an invariant, so it can be rerun alone:
 *
 *     build/unit/test_chaos SEED            one schedule
 *     KVW_CHAOS_SCHEDULES=N build/unit/test_chaos   N schedules from seed 1
 *     KVW_CHAOS_FIRST=S ...                 start at seed S
 *
 * Invariants checked on every schedule:
 *   I1 decode Success means every byte of the request is right;
 *   I2 prefill Success means the same (its writes all landed);
 *   I3 decode pages of a Failed request never change after Failed;
 *   I4 without a connection-level fault, only the rooms a schedule aborted
 *      or gave bad pages fail: no room fails because of another;
 *   I5 every request ends on both sides in bounded time (no hang);
 *   I6 prefill's counters balance: posted = completed + flushed;
 *   I7 the fake NIC's WRs balance and no verbs object is left behind
 *      (accepted = succeeded + errored + flushed, zero live objects,
 *      no CQ overrun); leaks are ASan's. */
#include "ctrl/zsock.h"
#include "engine/engine.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_ROOMS = 6, END_MS = 6000 };

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t next(rng_t *r)
{
    r->s += 0x9e3779b97f4a7c15ull;
    uint64_t z = r->s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t below(rng_t *r, uint32_t n)
{
    return (uint32_t)(next(r) % n);
}

/* What one schedule does; everything comes from the seed. */
typedef struct schedule {
    uint64_t seed;
    kvw_config_t cfg;
    uint32_t rooms, pages;
    fake_nic_faults_t nic;
    bool nic_faults;      /* fail a post or a WR: breaks the connection */
    uint32_t drop_pct;    /* % of control messages lost: may break it */
    const char *kill_nic; /* this fake device dies mid-transfer */
    int silent_side;      /* 1: prefill, 2: decode stops sending control messages */
    /* 0 none, 1 decode aborts, 2 prefill aborts, 3 prefill destroys,
     * 4 decode destroys (which waits for the abort's barrier) */
    int abort_side[MAX_ROOMS];
    uint32_t abort_ms[MAX_ROOMS];
    int bad_side[MAX_ROOMS]; /* 0 none, 1 decode page out of range, 2 prefill */
} schedule_t;

static void make_schedule(uint64_t seed, schedule_t *sc)
{
    rng_t r = {seed * 0x2545f4914f6cdd1dull + 1};
    memset(sc, 0, sizeof(*sc));
    sc->seed = seed;
    pair_config(&sc->cfg);
    sc->cfg.rq_depth = 16u << below(&r, 2);
    sc->cfg.chain_max = 2u << below(&r, 3);
    sc->cfg.signal_every = 1u + below(&r, 8);
    sc->cfg.heartbeat_ms = 40;
    /* Liveness bounds tight enough to run fast, loose enough that a loaded
     * machine does not starve a control thread past them. */
    sc->cfg.peer_timeout_ms = 600;
    sc->cfg.transfer_timeout_ms = 2000;
    sc->rooms = 1 + below(&r, MAX_ROOMS);
    sc->pages = 1 + below(&r, PAIR_POOL / sc->rooms);
    uint32_t kind = below(&r, 10);
    if (kind == 1) { /* a post fails part-way through a chain */
        sc->nic_faults = true;
        sc->nic.fail_post_call = 1 + below(&r, 6);
        sc->nic.fail_post_wr = below(&r, sc->cfg.chain_max);
    } else if (kind == 2) { /* a WR completes with an error */
        static const enum ibv_wc_status st[] = {IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR,
                                                IBV_WC_LOC_PROT_ERR, IBV_WC_REM_OP_ERR};
        sc->nic_faults = true;
        sc->nic.error_wr = 1 + below(&r, 40 + sc->rooms * sc->pages * 4);
        sc->nic.error_status = st[below(&r, 4)];
    } else if (kind == 3) {
        sc->drop_pct = 1 + below(&r, 30);
    } else if (kind == 4) {
        /* Decode's NIC: writes towards it fail (retry exceeded). A dead
         * local NIC would only hang prefill's writes until the transfer
         * timeout: slow, and the same path as a silent connection. */
        sc->kill_nic = "fake1";
    } else if (kind == 5) {
        sc->silent_side = 1 + (int)below(&r, 2);
    }
    if (below(&r, 2)) { /* completions delayed, with jitter */
        sc->nic.delay_us = below(&r, 3000);
        sc->nic.delay_jitter_us = below(&r, 2000);
        sc->nic.seed = seed;
    }
    for (uint32_t i = 0; i < sc->rooms; i++) {
        uint32_t a = below(&r, 10);
        sc->abort_side[i] = a < 4 ? (int)a + 1 : 0;
        sc->abort_ms[i] = below(&r, 6);
        sc->bad_side[i] = below(&r, 10) == 0 ? 1 + (int)below(&r, 2) : 0;
        if (sc->bad_side[i])
            sc->abort_side[i] = 0;
    }
    /* Drawn last, so the draws above stay what they were for each seed:
     * connections of 1-3 QPs, striped, with the faults above. */
    sc->cfg.qps_per_peer = 1 + below(&r, 3);
}

static bool connection_fault(const schedule_t *sc)
{
    return sc->nic_faults || sc->drop_pct || sc->kill_nic || sc->silent_side;
}

/* Lost control messages, decided per message from the schedule's seed;
 * or a whole side falling silent (prefill sends only through its router). */
static _Atomic uint64_t drop_state;
static _Atomic uint32_t drop_pct;
static _Atomic int silent_side;
static void *_Atomic prefill_router;
static bool drop_some(void *sock, const kvw_msg_t *m)
{
    (void)m;
    int silent = atomic_load(&silent_side);
    if (silent)
        return (sock == atomic_load(&prefill_router)) == (silent == 1);
    uint64_t x = atomic_fetch_add(&drop_state, 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
    return (x >> 40) % 100 < atomic_load(&drop_pct);
}

typedef struct room_run {
    pair_room_t pr;
    uint8_t *snap;    /* decode pages when Failed was first seen */
    kvw_poll_t d, s;  /* final states */
    bool expect_fail; /* aborted or bad pages by the schedule */
    bool acted;
} room_run_t;

static int violations;
/* What the schedules did, so a run that tested nothing shows it. */
static struct {
    uint64_t rooms, decode_ok, decode_failed, both_ok, with_fault[6], qps[3];
} tally;

#define VIOLATION(sc, ...)                                                                         \
    do {                                                                                           \
        violations++;                                                                              \
        printf("chaos: seed %" PRIu64 ": ", (sc)->seed);                                           \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
    } while (0)

static void start_room(engine_pair_t *p, const schedule_t *sc, room_run_t *rr, uint32_t i)
{
    pair_pick(&rr->pr, sc->seed * 100 + i, sc->pages, sc->seed * 31 + i, i);
    rr->expect_fail = sc->abort_side[i] || sc->bad_side[i];
    if (pair_create(p, &rr->pr) != KVW_OK) {
        VIOLATION(sc, "room %u: create failed", i);
        return;
    }
    uint64_t dst_saved = rr->pr.dst[0];
    if (sc->bad_side[i] == 1)
        rr->pr.dst[0] = PAIR_POOL + 1;
    kvw_receiver_init(rr->pr.r, rr->pr.dst, rr->pr.n, rr->pr.aux_dst);
    rr->pr.dst[0] = dst_saved; /* the canary check watches the real pages */
    kvw_sender_init(rr->pr.s, rr->pr.n, rr->pr.aux_src);
}

static void send_room(const schedule_t *sc, room_run_t *rr, uint32_t i)
{
    uint64_t src_saved = rr->pr.src[0];
    if (sc->bad_side[i] == 2)
        rr->pr.src[0] = PAIR_POOL + 2;
    kvw_sender_send(rr->pr.s, rr->pr.src, rr->pr.n);
    rr->pr.src[0] = src_saved;
}

static void act(engine_pair_t *p, const schedule_t *sc, room_run_t *rr, uint32_t i)
{
    rr->acted = true;
    if (sc->abort_side[i] == 1) {
        kvw_receiver_abort(rr->pr.r);
    } else if (sc->abort_side[i] == 2) {
        kvw_sender_abort(rr->pr.s);
    } else if (sc->abort_side[i] == 3) {
        kvw_sender_destroy(rr->pr.s);
        rr->pr.s = NULL;
    } else if (sc->abort_side[i] == 4) {
        kvw_receiver_destroy(rr->pr.r);
        rr->pr.r = NULL;
        /* Once destroy returns nothing may land: watch the pages from here. */
        if (!rr->snap) {
            rr->snap = malloc(pair_snapshot_size(&rr->pr));
            pair_snapshot(p, &rr->pr, rr->snap);
        }
    }
}

static bool ended(kvw_poll_t s)
{
    return s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED;
}

/* Poll every room until all ended on both sides; snapshot decode pages the
 * moment Failed is first seen. */
static void drive(engine_pair_t *p, const schedule_t *sc, room_run_t *rooms)
{
    uint64_t t0 = pair_now_ms(), end = t0 + END_MS;
    bool killed = false;
    for (;;) {
        uint64_t now = pair_now_ms();
        bool all = true;
        for (uint32_t i = 0; i < sc->rooms; i++) {
            room_run_t *rr = &rooms[i];
            if (!rr->acted && sc->abort_side[i] && now - t0 >= sc->abort_ms[i])
                act(p, sc, rr, i);
            kvw_poll_t d = rr->pr.r ? kvw_receiver_poll(rr->pr.r) : KVW_POLL_FAILED;
            if (d == KVW_POLL_FAILED && !rr->snap) {
                rr->snap = malloc(pair_snapshot_size(&rr->pr));
                pair_snapshot(p, &rr->pr, rr->snap);
            }
            kvw_poll_t s = rr->pr.s ? kvw_sender_poll(rr->pr.s) : KVW_POLL_FAILED;
            rr->d = d;
            rr->s = s;
            all = all && ended(d) && ended(s);
        }
        if (sc->kill_nic && !killed && now - t0 >= 2) {
            fake_nic_kill_device(sc->kill_nic);
            killed = true;
        }
        if (sc->silent_side && now - t0 >= 2 && !atomic_load(&silent_side))
            atomic_store(&silent_side, sc->silent_side);
        if (all)
            return;
        if (now > end) {
            for (uint32_t i = 0; i < sc->rooms; i++)
                if (!ended(rooms[i].d) || !ended(rooms[i].s))
                    VIOLATION(sc, "I5 room %u still %s (decode) / %s (prefill) after %d ms", i,
                              kvw_poll_name(rooms[i].d), kvw_poll_name(rooms[i].s), END_MS);
            return;
        }
        pair_sleep_ms(1);
    }
}

static void count_room(const room_run_t *rr)
{
    tally.rooms++;
    tally.decode_ok += rr->d == KVW_POLL_SUCCESS;
    tally.decode_failed += rr->d == KVW_POLL_FAILED;
    tally.both_ok += rr->d == KVW_POLL_SUCCESS && rr->s == KVW_POLL_SUCCESS;
}

static void check_room(engine_pair_t *p, const schedule_t *sc, room_run_t *rr, uint32_t i)
{
    count_room(rr);
    size_t wrong = pair_wrong_bytes(p, &rr->pr);
    if (rr->d == KVW_POLL_SUCCESS && wrong)
        VIOLATION(sc, "I1 room %u: decode Success with %zu wrong bytes", i, wrong);
    if (rr->s == KVW_POLL_SUCCESS && rr->pr.s && wrong && rr->d != KVW_POLL_FAILED)
        VIOLATION(sc, "I2 room %u: prefill Success with %zu wrong bytes", i, wrong);
    if (rr->s == KVW_POLL_SUCCESS && rr->pr.s && wrong && rr->d == KVW_POLL_FAILED &&
        !(rr->snap && pair_snapshot_equal(p, &rr->pr, rr->snap)))
        VIOLATION(sc, "I2 room %u: prefill Success, decode Failed, bytes partly written", i);
    if (rr->snap && !pair_snapshot_equal(p, &rr->pr, rr->snap))
        VIOLATION(sc, "I3 room %u: decode pages changed after Failed", i);
    if (!connection_fault(sc) && !rr->expect_fail &&
        (rr->d != KVW_POLL_SUCCESS || rr->s != KVW_POLL_SUCCESS)) {
        const char *why = "";
        if (rr->pr.r)
            kvw_receiver_failure(rr->pr.r, &why);
        VIOLATION(sc, "I4 room %u failed without a fault of its own or of the connection: %s", i,
                  why);
    }
}

static void check_counters(engine_pair_t *p, const schedule_t *sc)
{
    kvw_counters_t c = {0};
    for (int k = 0; k < 200; k++) {
        kvw_engine_counters(p->prefill, &c);
        if (c.wrs_posted == c.wrs_completed + c.wrs_flushed)
            return;
        pair_sleep_ms(5);
    }
    VIOLATION(sc, "I6 prefill posted %" PRIu64 " WRs, completed %" PRIu64 " + flushed %" PRIu64,
              c.wrs_posted, c.wrs_completed, c.wrs_flushed);
}

static void check_nic(const schedule_t *sc, const fake_nic_stats_t *st)
{
    if (st->wrs_accepted != st->wrs_succeeded + st->wrs_errored + st->wrs_flushed)
        VIOLATION(sc,
                  "I7 NIC accepted %" PRIu64 " WRs, succeeded %" PRIu64 " errored %" PRIu64
                  " flushed %" PRIu64,
                  st->wrs_accepted, st->wrs_succeeded, st->wrs_errored, st->wrs_flushed);
    if (st->cq_overruns || st->live_qps || st->live_cqs || st->live_mrs || st->live_pds ||
        st->live_channels || st->live_contexts)
        VIOLATION(sc, "I7 NIC: %" PRIu64 " CQ overruns; left behind %u QPs %u CQs %u MRs",
                  st->cq_overruns, st->live_qps, st->live_cqs, st->live_mrs);
}

static void run_schedule(uint64_t seed)
{
    schedule_t sc;
    make_schedule(seed, &sc);
    tally.with_fault[0] += !connection_fault(&sc);
    tally.with_fault[1] += sc.nic.fail_post_call != 0;
    tally.with_fault[2] += sc.nic.error_wr != 0;
    tally.with_fault[3] += sc.drop_pct != 0;
    tally.with_fault[4] += sc.kill_nic != NULL;
    tally.with_fault[5] += sc.silent_side != 0;
    tally.qps[sc.cfg.qps_per_peer - 1]++;
    engine_pair_t p;
    fake_nic_stats_t final;
    if (pair_open(&p, &sc.cfg) != KVW_OK) {
        VIOLATION(&sc, "engines did not start");
        pair_close(&p);
        return;
    }
    p.final_stats = &final;
    room_run_t rooms[MAX_ROOMS];
    memset(rooms, 0, sizeof(rooms));
    for (uint32_t i = 0; i < sc.rooms; i++)
        start_room(&p, &sc, &rooms[i], i);
    for (uint32_t i = 0; i < sc.rooms; i++)
        if (kvw_sender_poll(rooms[i].pr.s) != KVW_POLL_FAILED)
            while (kvw_sender_poll(rooms[i].pr.s) == KVW_POLL_BOOTSTRAPPING)
                pair_sleep_ms(1); /* decode's requests first: the transfers overlap */
    fake_nic_set_faults(&sc.nic);
    atomic_store(&drop_state, seed);
    atomic_store(&drop_pct, sc.drop_pct);
    atomic_store(&silent_side, 0);
    atomic_store(&prefill_router, p.prefill->router);
    if (sc.drop_pct || sc.silent_side)
        atomic_store(&kvw__zdrop_hook, drop_some);
    for (uint32_t i = 0; i < sc.rooms; i++)
        send_room(&sc, &rooms[i], i);
    drive(&p, &sc, rooms);
    atomic_store(&kvw__zdrop_hook, NULL);
    fake_nic_quiesce(2000);
    pair_sleep_ms(sc.nic.delay_us / 1000 + 2); /* a late write would land by now */
    for (uint32_t i = 0; i < sc.rooms; i++)
        check_room(&p, &sc, &rooms[i], i);
    check_counters(&p, &sc);
    for (uint32_t i = 0; i < sc.rooms; i++) {
        pair_destroy_room(&rooms[i].pr);
        free(rooms[i].snap);
    }
    pair_close(&p);
    check_nic(&sc, &final);
}

/* Faults make the engines log errors by design: keep them unless asked. */
static void quiet(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    (void)msg;
}

int main(int argc, char **argv)
{
    if (getenv("KVW_TEST_LOG"))
        kvw_set_log_handler(NULL, NULL, KVW_LOG_INFO);
    else
        kvw_set_log_handler(quiet, NULL, KVW_LOG_ERROR);
    if (argc > 1) {
        uint64_t seed = strtoull(argv[1], NULL, 10);
        run_schedule(seed);
        printf("chaos: seed %" PRIu64 ": %d invariant violations\n", seed, violations);
        return violations != 0;
    }
    const char *n_env = getenv("KVW_CHAOS_SCHEDULES"), *first_env = getenv("KVW_CHAOS_FIRST");
    uint64_t n = n_env ? strtoull(n_env, NULL, 10) : 2000;
    uint64_t first = first_env ? strtoull(first_env, NULL, 10) : 1;
    uint64_t t0 = pair_now_ms();
    for (uint64_t seed = first; seed < first + n; seed++)
        run_schedule(seed);
    printf("chaos: %" PRIu64 " schedules: %" PRIu64 " without a connection fault, %" PRIu64
           " failed posts, %" PRIu64 " error completions, %" PRIu64 " with lost control "
           "messages, %" PRIu64 " dead NICs, %" PRIu64 " silent peers\n",
           n, tally.with_fault[0], tally.with_fault[1], tally.with_fault[2], tally.with_fault[3],
           tally.with_fault[4], tally.with_fault[5]);
    printf("chaos: %" PRIu64 " rooms: decode Success %" PRIu64 " (both sides %" PRIu64
           "), decode Failed %" PRIu64 "\n",
           tally.rooms, tally.decode_ok, tally.both_ok, tally.decode_failed);
    printf("chaos: connections of 1, 2, 3 QPs: %" PRIu64 ", %" PRIu64 ", %" PRIu64 " schedules\n",
           tally.qps[0], tally.qps[1], tally.qps[2]);
    printf("chaos: %" PRIu64 " fault schedules on the fake NIC (not RDMA) in %.1f s, seeds "
           "%" PRIu64 "..%" PRIu64 ": %d invariant violations\n",
           n, (double)(pair_now_ms() - t0) / 1000.0, first, first + n - 1, violations);
    return violations != 0;
}
