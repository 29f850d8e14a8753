/* SPDX-License-Identifier: Apache-2.0 */
/* Randomized fault schedules against the whole engine on the fake NIC (not
 * RDMA). Each schedule is derived from one seed and printed when it breaks
 * an invariant, so it can be rerun alone:
 *
 *     build/unit/test_chaos SEED            one schedule (and what it does)
 *     KVW_CHAOS_SCHEDULES=N build/unit/test_chaos   N schedules from seed 1
 *     KVW_CHAOS_FIRST=S ...                 start at seed S
 *     KVW_CHAOS_TIMES=1 ...                 each schedule's time on stderr
 *
 * A schedule draws: queue sizes and 1-3 QPs; one connection fault (failed
 * post, error completion, lost control messages, dead NIC, silent peer) or
 * none; delayed completions and late ACKs; GPU regions on either side or
 * both (fake CUDA, copied through the host staging pool, copies that take
 * time); per request its pages, a bad page, how it is sent (whole, in page
 * chunks, layer by layer, or both, with gaps between parts) and an abort
 * (decode abort, prefill abort, sender destroy, receiver destroy) at any
 * point of its life: before init, between parts, mid-transfer, once the
 * data landed (during decode's copy to its GPU when staged); and a peer
 * closing mid-schedule (a second decode engine leaving, or prefill closing
 * and a new one taking its rank, which must then serve a new request).
 *
 * Invariants checked on every schedule:
 *   I1 decode Success means every byte of the request is right;
 *   I2 prefill Success means the same (its writes all landed);
 *   I3 once a receiver is Failed (or its destroy returned), no page decode
 *      may reuse changes: its own pages and every page of the destination
 *      pool no live request owns (free pages, pages of requests that
 *      ended), snapshotted at that moment and compared after a grace
 *      period and again once the decode engines are gone;
 *   I4 without a connection-level fault (a closing peer is one, for the
 *      requests on that connection), only the rooms a schedule aborted or
 *      gave bad pages fail: no room fails because of another; and decode's
 *      connection to prefill stays up, the same one from start to end (an
 *      abort or a bad page never breaks it, whether or not another room
 *      is still in flight to notice);
 *   I5 every request ends on both sides in bounded time (no hang);
 *   I6 prefill's counters balance: posted = completed + flushed;
 *   I7 the fake NIC's WRs balance and no verbs object is left behind
 *      (accepted = succeeded + errored + flushed, zero live objects,
 *      no CQ overrun); leaks are ASan's;
 *   I8 where decode's dead device comes back ("rail down", back at 50 ms,
 *      with its port-up event)
 *      and the connection lives, every lane prefill failed over rejoins
 *      it (probed, reset on both sides, proven by a write) in bounded
 *      time; I3, I6 and I7 then also cover the rejoin's writes;
 *   I9 in "flap" schedules (a rail fails, rejoins and fails again, once or
 *      twice: decode's second device or prefill's, each time with its port
 *      events; parts spread out, so that requests are parked or hand over
 *      parts while the lane is out; often ACKs late by tens of ms, so that
 *      requests decode completed are still in flight at prefill across a
 *      rejoin and the next failure), decode's application reuses a room's
 *      pages the moment its receiver reports Success: they are checked
 *      then (I1), overwritten with a pattern of its own and, as any page
 *      no live request owns (I3), must never change afterwards.
 *
 *     KVW_CHAOS_FLAPS_ONLY=1 ...            only the schedules that flap */
#include "ctrl/zsock.h"
#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_cuda.h"
#include "support/fake_nic.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    MAX_ROOMS = 6,
    NEW_ROOM = MAX_ROOMS,  /* the room served by a restarted prefill */
    SLOTS = MAX_ROOMS + 1, /* rooms of a schedule, and that one */
    END_MS = 6000,
    REJOIN_MS = 6000, /* I8: typically 100-200 ms; one failed try costs 2 s */
    /* Each canary is compared this long after it was taken at the
     * earliest (and after the fake NIC quiesced): a late write would have
     * landed by then. Anything later still is caught by the last
     * comparison, once the decode engines are destroyed. */
    GRACE_MS = 20,
    MAX_CANARIES = 4 * SLOTS,
};

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

/* When a room's abort comes. */
enum {
    AT_EARLY,       /* abort_ms 0-5 ms after the sends began (the first draw) */
    AT_LATE,        /* any time in the first few hundred ms */
    AT_BEFORE_INIT, /* before the receiver's and the sender's init */
    AT_BETWEEN,     /* between two parts of the request */
    AT_LANDED,      /* once its data landed (during decode's copy to the GPU) */
    AT_KINDS
};
static const char *const at_names[AT_KINDS] = {"0-5 ms", "late (up to 400 ms)", "before init",
                                               "between parts", "after landing"};

/* What a room was doing when its abort came, as the test saw it. */
enum { PH_BEFORE_INIT, PH_BETWEEN, PH_MID, PH_COPY_IN, PH_LANDED, PH_ENDED, PH_KINDS };
static const char *const phase_names[PH_KINDS] = {"before init",    "between parts", "mid-transfer",
                                                  "during copy-in", "after landing", "after end"};

/* How a room's pages are handed over. */
enum { SEND_WHOLE, SEND_CHUNKS, SEND_LAYERS, SEND_CHUNKS_LAYERS, SEND_KINDS };

enum { CLOSE_NONE, CLOSE_DECODE, CLOSE_PREFILL };

/* What one schedule does; everything comes from the seed. */
typedef struct schedule {
    uint64_t seed;
    kvw_config_t cfg;
    uint32_t rooms, pages;
    fake_nic_faults_t nic;
    bool nic_faults;      /* fail a post or a WR: breaks the connection */
    uint32_t drop_pct;    /* % of control messages lost: may break it */
    const char *kill_nic; /* this fake device dies mid-transfer */
    /* Both engines on two rails (fake0+fake2, fake1+fake3: KVW_DEVICES);
     * rail_down: decode's second device is kill_nic, and prefill fails its
     * lanes over to the first rail. */
    bool rails, rail_down;
    /* rail_down, and decode's second device comes back at 50 ms: prefill
     * probes the lane back into the connection (rejoin) mid-schedule. */
    bool rail_back;
    int silent_side; /* 1: prefill, 2: decode stops sending control messages */
    /* 0 none, 1 decode aborts, 2 prefill aborts, 3 prefill destroys,
     * 4 decode destroys (which waits for the abort's barrier) */
    int abort_side[MAX_ROOMS];
    uint32_t abort_ms[MAX_ROOMS];
    int bad_side[MAX_ROOMS]; /* 0 none, 1 decode page out of range, 2 prefill */
    /* Drawn after the above, which keep their values for each seed
     * (abort_ms is redrawn only for an abort drawn to come later). */
    bool gpu_src, gpu_dst; /* KV regions on the fake GPU: staged */
    uint32_t copy_delay_us;
    int close; /* CLOSE_* at close_ms (or once everything else ended) */
    uint32_t close_ms;
    bool on_second[MAX_ROOMS]; /* decode side on the engine that leaves */
    int at[MAX_ROOMS];         /* AT_*: when the abort comes */
    uint32_t init_ms[MAX_ROOMS], landed_ms[MAX_ROOMS];
    int send[MAX_ROOMS]; /* SEND_* */
    uint32_t chunks[MAX_ROOMS];
    bool via_send[MAX_ROOMS];    /* page chunks through kvw_sender_send, not send_part */
    bool layer_major[MAX_ROOMS]; /* chunks x layers: every chunk of a layer, then the next */
    uint32_t gap_ms[MAX_ROOMS];  /* between parts */
    /* I9: the rail fails again this many times (0: no flap), each time
     * flap_gap_ms after prefill saw its lane rejoin, and comes back
     * flap_back_ms later; decode reuses pages at Success (reuse). */
    uint32_t flaps, flap_first_ms, flap_gap_ms, flap_back_ms;
    uint32_t flap_ack_us; /* ACKs late by this from the first failure on */
    bool reuse;
} schedule_t;

static uint32_t parts_of(const schedule_t *sc, uint32_t i)
{
    switch (sc->send[i]) {
    case SEND_CHUNKS:
        return sc->chunks[i];
    case SEND_LAYERS:
        return PAIR_LAYERS;
    case SEND_CHUNKS_LAYERS:
        return sc->chunks[i] * PAIR_LAYERS;
    default:
        return 1;
    }
}

static bool connection_fault(const schedule_t *sc)
{
    return sc->nic_faults || sc->drop_pct || sc->kill_nic || sc->silent_side;
}

/* I9's flaps, drawn after everything else (every earlier draw keeps its
 * value for each seed). In half of the "rail down" schedules decode's
 * second device flaps; in 3 of 4 schedules on two rails without a
 * connection fault, prefill's second device does (it dies at 2 ms as
 * decode's does in "rail down", but at 10-39 ms, once the first parts
 * landed, and with its port events). None with a closing peer (a
 * restarted prefill's counters are not the lane's). Either comes back at 50 ms, rejoins, and
 * fails again 0-14 ms after prefill saw the lane back, once or twice. The
 * rooms' parts are spread out over the flaps, and ACKs are late by 20-170 ms
 * in 3 of 4 (a transfer timeout of 2 s). */
static void draw_flaps(rng_t *r, schedule_t *sc)
{
    if (!sc->rails)
        return;
    uint32_t pick = below(r, 4), flaps = 1 + below(r, 2), gap = below(r, 15),
             back = 20 + below(r, 40), first = 10 + below(r, 30);
    uint32_t ack = below(r, 4) ? 20000 + below(r, 150000) : 0;
    if (sc->close || (sc->rail_down ? pick >= 2 : connection_fault(sc) || pick == 0))
        return;
    if (!sc->rail_down) {
        sc->rail_down = true;
        sc->kill_nic = "fake2";
    }
    sc->rail_back = true;
    sc->flaps = flaps;
    sc->flap_first_ms = first;
    sc->flap_gap_ms = gap;
    sc->flap_back_ms = back;
    sc->flap_ack_us = ack;
    sc->nic.ack_delay_us = 0; /* ACKs are late from the first failure on */
    sc->reuse = true;
    for (uint32_t i = 0; i < sc->rooms; i++) {
        if (sc->at[i] == AT_BETWEEN) /* its abort's time follows its parts */
            continue;
        sc->gap_ms[i] = 5 + below(r, 40);
        if (sc->pages >= 2 && below(r, 2)) { /* more parts, over the flaps */
            sc->send[i] = SEND_CHUNKS_LAYERS;
            sc->chunks[i] = sc->pages >= 3 ? 2 + below(r, 2) : 2;
        }
    }
}

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

    /* The larger space, drawn after all of the above. GPU regions: none,
     * prefill's, decode's or both, through a 1 MiB pool of 64 KiB chunks
     * (a request's part fits one chunk; decode's slots never run out). */
    uint32_t gpu = below(&r, 10);
    sc->gpu_src = gpu == 4 || gpu == 5 || gpu >= 8;
    sc->gpu_dst = gpu >= 6;
    /* Shorter than pair_config's: a sender whose decode gave up before
     * its request, with the ABORT lost to a broken connection, waits this
     * long (and a schedule with it); longer without faults (below). */
    sc->cfg.bootstrap_timeout_ms = 1000;
    sc->cfg.staging_mib = 1;
    sc->cfg.staging_chunk_kib = 64;
    sc->cfg.staging_lanes = 1 + below(&r, 2);
    /* Copies that take time: decode's copy to the GPU is a window (mostly
     * where decode stages; prefill copies a run per page, so slow copies
     * there only make a schedule slow). */
    uint32_t slow = below(&r, 4), delay = 150 + below(&r, 600);
    if (sc->gpu_dst ? slow != 0 : slow == 0)
        sc->copy_delay_us = delay;
    /* Late ACKs: prefill's completion comes after decode saw the data (and
     * may already have reported Success), within an ACK timeout. */
    if (below(&r, 4) == 0)
        sc->nic.ack_delay_us = 500 + below(&r, 19500);
    for (uint32_t i = 0; i < sc->rooms; i++) {
        uint32_t s = below(&r, 8);
        sc->send[i] = s < 3   ? SEND_WHOLE
                      : s < 5 ? SEND_CHUNKS
                      : s < 7 ? SEND_LAYERS
                              : SEND_CHUNKS_LAYERS;
        sc->chunks[i] = 2 + below(&r, sc->send[i] == SEND_CHUNKS ? 4 : 2);
        if (sc->chunks[i] > sc->pages)
            sc->chunks[i] = sc->pages;
        if (sc->send[i] == SEND_CHUNKS && sc->chunks[i] < 2)
            sc->send[i] = SEND_LAYERS; /* one page: layers are the parts */
        if (sc->send[i] == SEND_CHUNKS_LAYERS && sc->chunks[i] < 2)
            sc->send[i] = SEND_LAYERS;
        sc->via_send[i] = below(&r, 2);
        sc->layer_major[i] = below(&r, 2);
        sc->gap_ms[i] = below(&r, 3) ? 1 + below(&r, 10) : 0;
        uint32_t at = below(&r, 8);
        sc->at[i] = at < 2    ? AT_EARLY
                    : at < 4  ? AT_LATE
                    : at == 4 ? AT_BEFORE_INIT
                    : at == 5 ? AT_BETWEEN
                              : AT_LANDED;
        uint32_t late = below(&r, 400), frac = below(&r, 1000), pre = below(&r, 10);
        sc->landed_ms[i] = below(&r, 3) ? 0 : below(&r, 4);
        if (!sc->abort_side[i])
            sc->at[i] = AT_EARLY;
        if (sc->at[i] == AT_LATE) {
            sc->abort_ms[i] = late;
        } else if (sc->at[i] == AT_BEFORE_INIT) {
            sc->abort_ms[i] = pre;
            sc->init_ms[i] = pre + 1 + late % 20;
        } else if (sc->at[i] == AT_BETWEEN) {
            if (sc->send[i] == SEND_WHOLE)
                sc->send[i] = sc->pages >= 2 && sc->chunks[i] >= 2 ? SEND_CHUNKS : SEND_LAYERS;
            if (!sc->gap_ms[i])
                sc->gap_ms[i] = 2 + late % 9;
            uint32_t k = frac % (parts_of(sc, i) - 1); /* after part k, before part k + 1 */
            sc->abort_ms[i] = k * sc->gap_ms[i] + frac % sc->gap_ms[i];
        }
    }
    /* Closing peers, rarer: a decode engine leaving in 1 of 8 schedules, a
     * prefill restart in 1 of 32 (it costs decode's engine destroy a BYE
     * linger towards the dead engine, 200 ms). */
    uint32_t close = below(&r, 32);
    sc->close = close >= 28 ? CLOSE_DECODE : close == 27 ? CLOSE_PREFILL : CLOSE_NONE;
    sc->close_ms = below(&r, 300);
    bool any = false;
    for (uint32_t i = 0; i < sc->rooms; i++)
        any |= sc->on_second[i] = sc->close == CLOSE_DECODE && below(&r, 2);
    if (sc->close == CLOSE_DECODE && !any)
        sc->on_second[0] = true;
    /* Drawn last, so that every draw above keeps its value for each seed:
     * in 1 of 4 schedules without staged GPU regions (which an engine on
     * several rails refuses), both engines on two rails; in half of those
     * without another connection fault, "rail down": decode's second device
     * dies mid-transfer, prefill's writes to it run out of retries, and its
     * requests start over on the first rail (or fail where decode may
     * already have their final immediate). */
    if (!sc->gpu_src && !sc->gpu_dst && below(&r, 4) == 0) {
        sc->rails = true;
        if (!sc->nic_faults && !sc->drop_pct && !sc->kill_nic && !sc->silent_side && below(&r, 2)) {
            sc->rail_down = true;
            sc->kill_nic = "fake3";
            sc->rail_back = below(&r, 2);
        }
    }
    draw_flaps(&r, sc);
    /* Nothing breaks the connection: the handshake deadline then only
     * bounds a handshake that must succeed, and 1 s was too short once on
     * a loaded host ("not connected ... within 1000 ms" in a schedule
     * without any fault). Set last: the draws stay what they were. */
    if (!connection_fault(sc) && sc->close == CLOSE_NONE)
        sc->cfg.bootstrap_timeout_ms = 3000;
}

/* The room's own connection breaks or closes by the schedule. */
static bool room_connection_fault(const schedule_t *sc, uint32_t i)
{
    if (connection_fault(sc))
        return true;
    if (i == NEW_ROOM)
        return false;
    return sc->close == CLOSE_PREFILL || (sc->close == CLOSE_DECODE && sc->on_second[i]);
}

static void describe(const schedule_t *sc)
{
    static const char *const sides[] = {"-", "decode abort", "prefill abort", "sender destroy",
                                        "receiver destroy"};
    static const char *const sends[] = {"whole", "page chunks", "layers", "chunks x layers"};
    printf("chaos: seed %" PRIu64 ": %u rooms of %u pages, %u QPs, rq %u chain %u signal %u; "
           "fault: %s%s%s%s%s; NIC delay %u+%u us, late ACK %u us; GPU: %s%s, copy %u us; "
           "close: %s at %u ms\n",
           sc->seed, sc->rooms, sc->pages, sc->cfg.qps_per_peer, sc->cfg.rq_depth,
           sc->cfg.chain_max, sc->cfg.signal_every, !connection_fault(sc) ? "none" : "",
           sc->nic.fail_post_call ? "failed post" : "", sc->nic.error_wr ? "error completion" : "",
           sc->drop_pct ? "lost messages" : "",
           sc->rail_down     ? "rail down"
           : sc->kill_nic    ? "dead NIC"
           : sc->silent_side ? "silent peer"
                             : "",
           sc->nic.delay_us, sc->nic.delay_jitter_us, sc->nic.ack_delay_us,
           sc->gpu_src ? "prefill " : "", sc->gpu_dst ? "decode" : "", sc->copy_delay_us,
           sc->close == CLOSE_DECODE    ? "decode engine leaves"
           : sc->close == CLOSE_PREFILL ? "prefill restarts"
                                        : "none",
           sc->close_ms);
    if (sc->rails)
        printf("chaos:   two rails per engine (fake0+fake2, fake1+fake3)%s%s%s\n",
               !sc->rail_down                   ? ""
               : !strcmp(sc->kill_nic, "fake2") ? ", fake2 (prefill's second rail)"
                                                : ", fake3 (decode's second rail)",
               !sc->rail_down  ? ""
               : sc->flaps     ? " flaps"
               : sc->rail_back ? " dies at 2 ms, back at 50 ms"
                               : " dies at 2 ms",
               !sc->flaps       ? ""
               : sc->flaps == 1 ? " (down twice)"
                                : " (down three times)");
    if (sc->flaps)
        printf("chaos:   flap: down at %u ms, back %u ms later; down again %u ms after the lane "
               "rejoined; ACKs late by %u us from the first failure; decode reuses pages at "
               "Success\n",
               sc->flap_first_ms, sc->flap_back_ms, sc->flap_gap_ms, sc->flap_ack_us);
    for (uint32_t i = 0; i < sc->rooms; i++)
        printf("chaos:   room %u: %s, %u parts %u ms apart%s; %s at %s (%u ms)%s%s\n", i,
               sends[sc->send[i]], parts_of(sc, i), sc->gap_ms[i],
               sc->via_send[i] && sc->send[i] == SEND_CHUNKS ? " (kvw_sender_send)" : "",
               sides[sc->abort_side[i]], at_names[sc->at[i]], sc->abort_ms[i],
               sc->bad_side[i] == 1   ? ", bad decode page"
               : sc->bad_side[i] == 2 ? ", bad prefill page"
                                      : "",
               sc->on_second[i] ? ", on the decode engine that leaves" : "");
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
    bool used;                 /* a room of this schedule */
    _Atomic bool started;      /* its handles exist (NEW_ROOM: after the restart) */
    kvw_engine_t *dec;         /* the decode engine of its receiver */
    pthread_mutex_t rx, tx;    /* held while a thread uses pr.r / pr.s */
    _Atomic bool dec_ended;    /* decode side ended: its pages are no longer written */
    kvw_poll_t d, s;           /* states last seen, final at the end */
    kvw_poll_t d_gone, s_gone; /* the state when the handle was destroyed */
    bool r_gone, s_gone_set;   /* handle destroyed by the schedule */
    int canary;                /* taken when decode ended Failed (or its destroy returned) */
    bool expect_fail;          /* aborted or bad pages by the schedule */
    bool acted, inited;
    bool reused;             /* I9: decode's pages reused at Success (checked then) */
    size_t wrong_at_success; /* I9: wrong bytes when decode reported Success */
    uint32_t sent;           /* parts handed over */
    uint64_t landed_seen_ms; /* 1 + when the test first saw its data landed; 0: not yet */
    bool destroying;         /* a thread destroys its receiver */
    pthread_t destroyer;
} room_run_t;

/* A copy of decode's whole destination pool (all KV regions and the aux
 * items), and which pages and aux items of it no live request owns: those
 * nothing may write any more. */
typedef struct canary {
    uint8_t kv[2 * PAIR_LAYERS][PAIR_ITEM * PAIR_POOL];
    uint8_t aux[PAIR_AUX_ITEM * PAIR_AUX_ITEMS];
    uint64_t pages;
    uint32_t auxes;
    int room;
    const char *why;
    bool reported;
} canary_t;

typedef struct run {
    const schedule_t *sc;
    engine_pair_t p;
    room_run_t rooms[SLOTS];
    bool new_room; /* a restarted prefill serves NEW_ROOM */
    kvw_engine_t *second;
    pthread_mutex_t canary_lock;
    canary_t canaries[MAX_CANARIES];
    int ncanaries;
    uint64_t last_canary_ms;
    pthread_t closer;
    bool close_started, closer_thread;
    _Atomic bool close_done;
    kvw_status_t restart_status;
    uint64_t t0;
    bool killed, revived; /* sc->kill_nic's device, and (rail_back) back */
    /* I9: flaps done, the device down now, when it went down, prefill's
     * lanes_rejoined when it last came back, when a rejoin was seen since */
    uint32_t flaps_done;
    bool flap_down;
    uint64_t flap_down_ms, rejoins_at_back, rejoin_seen_ms;
    uint32_t flap_kills, flaps_in_flight; /* flap failures; those while a room had not ended */
} run_t;

static int violations;
/* What the schedules did, so a run shows what it covered. */
static struct {
    uint64_t rooms, decode_ok, decode_failed, both_ok, with_fault[7], qps[3], rails;
    uint64_t rail_back, lanes_rejoined, replay_asks;
    uint64_t flap_schedules, flap_fails, flap_fails_in_flight, reused_rooms;
    uint64_t gpu[4], copy_delay, late_ack, close[3], new_rooms, new_rooms_ok;
    uint64_t sends[SEND_KINDS], parts, gapped;
    uint64_t acts[5][PH_KINDS], canaries, free_pages;
} tally;

static bool schedule_reported;

#define VIOLATION(sc, ...)                                                                         \
    do {                                                                                           \
        violations++;                                                                              \
        if (!schedule_reported) {                                                                  \
            schedule_reported = true;                                                              \
            describe(sc);                                                                          \
        }                                                                                          \
        printf("chaos: seed %" PRIu64 ": ", (sc)->seed);                                           \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
    } while (0)

static void sleep_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static bool ended(kvw_poll_t s)
{
    return s == KVW_POLL_SUCCESS || s == KVW_POLL_FAILED;
}

/* ----------------------------------------------------------------- canary */

static uint64_t room_pages(const pair_room_t *pr)
{
    uint64_t m = 0;
    for (size_t k = 0; k < pr->n; k++)
        m |= 1ull << pr->dst[k];
    return m;
}

static uint32_t room_auxes(const pair_room_t *pr)
{
    return pr->aux_dst == KVW_NO_AUX ? 0 : 1u << pr->aux_dst;
}

/* A dead device comes back as a real one does: its link up, then its
 * port's IBV_EVENT_PORT_ACTIVE (decode relays it as LANE_UP). */
static void revive(const char *device)
{
    fake_nic_revive_device(device);
    fake_nic_raise_port_event(device, IBV_EVENT_PORT_ACTIVE);
}

/* A device's link goes down with its port's event (I9's flaps; prefill's
 * own device must raise it: its writes would only stall). */
static void kill_with_event(const char *device)
{
    fake_nic_kill_device(device);
    fake_nic_raise_port_event(device, IBV_EVENT_PORT_ERR);
}

/* I9: decode's application takes room i's pages back the moment its
 * receiver reports Success: checked now (I1), then overwritten with a
 * pattern no transfer writes, and watched as pages no live request owns
 * from now on (a canary, I3). Under the room's rx lock. */
static void reuse_at_success(run_t *x, uint32_t i)
{
    room_run_t *rr = &x->rooms[i];
    const pair_room_t *pr = &rr->pr;
    rr->wrong_at_success = pair_wrong_bytes(&x->p, pr);
    uint8_t pattern = (uint8_t)(0xa5 ^ i);
    for (uint32_t l = 0; l < 2 * PAIR_LAYERS; l++)
        for (size_t k = 0; k < pr->n; k++)
            memset(x->p.dst[l] + pr->dst[k] * PAIR_ITEM, pattern, PAIR_ITEM);
    if (pr->aux_dst != KVW_NO_AUX)
        memset(x->p.dst_aux + pr->aux_dst * PAIR_AUX_ITEM, pattern, PAIR_AUX_ITEM);
    rr->reused = true;
}

/* Snapshot every page no live request owns, for room (-1: none), now. */
static int take_canary(run_t *x, int room, const char *why)
{
    pthread_mutex_lock(&x->canary_lock);
    int at = -1;
    if (x->ncanaries < MAX_CANARIES) {
        at = x->ncanaries++;
        canary_t *c = &x->canaries[at];
        c->pages = ~0ull;
        c->auxes = (1u << PAIR_AUX_ITEMS) - 1;
        for (uint32_t j = 0; j < SLOTS; j++) {
            const room_run_t *o = &x->rooms[j];
            if (o->used && !atomic_load(&o->dec_ended)) {
                c->pages &= ~room_pages(&o->pr);
                c->auxes &= ~room_auxes(&o->pr);
            }
        }
        /* Only those pages: the others may be being written right now. */
        for (uint32_t pg = 0; pg < PAIR_POOL; pg++)
            for (uint32_t i = 0; (c->pages >> pg & 1) && i < 2 * PAIR_LAYERS; i++)
                memcpy(c->kv[i] + pg * PAIR_ITEM, x->p.dst[i] + pg * PAIR_ITEM, PAIR_ITEM);
        for (uint32_t a = 0; a < PAIR_AUX_ITEMS; a++)
            if (c->auxes >> a & 1)
                memcpy(c->aux + a * PAIR_AUX_ITEM, x->p.dst_aux + a * PAIR_AUX_ITEM, PAIR_AUX_ITEM);
        c->room = room;
        c->why = why;
        c->reported = false;
        x->last_canary_ms = pair_now_ms();
    }
    pthread_mutex_unlock(&x->canary_lock);
    return at;
}

/* Compare a canary: which of its pages (and aux items) changed. */
static void canary_diff(const run_t *x, const canary_t *c, uint64_t *pages, uint32_t *auxes)
{
    *pages = 0;
    *auxes = 0;
    for (uint32_t pg = 0; pg < PAIR_POOL; pg++)
        for (uint32_t i = 0; (c->pages >> pg & 1) && i < 2 * PAIR_LAYERS; i++)
            if (memcmp(c->kv[i] + pg * PAIR_ITEM, x->p.dst[i] + pg * PAIR_ITEM, PAIR_ITEM))
                *pages |= 1ull << pg;
    for (uint32_t a = 0; a < PAIR_AUX_ITEMS; a++)
        if ((c->auxes >> a & 1) &&
            memcmp(c->aux + a * PAIR_AUX_ITEM, x->p.dst_aux + a * PAIR_AUX_ITEM, PAIR_AUX_ITEM))
            *auxes |= 1u << a;
}

/* Whose pages changed, in words. */
static void owners(const run_t *x, uint64_t pages, uint32_t auxes, char *out, size_t size)
{
    size_t at = 0;
    out[0] = 0;
    for (uint32_t j = 0; j < SLOTS; j++) {
        const room_run_t *o = &x->rooms[j];
        uint64_t mine = pages & room_pages(&o->pr);
        uint32_t aux = auxes & room_auxes(&o->pr);
        if (!o->used || (!mine && !aux))
            continue;
        at += (size_t)snprintf(out + at, size - at, "%s%d pages%s of room %u", at ? ", " : "",
                               __builtin_popcountll(mine), aux ? " and its aux item" : "", j);
        pages &= ~room_pages(&o->pr);
        auxes &= ~room_auxes(&o->pr);
        if (at >= size)
            return;
    }
    if (pages || auxes)
        snprintf(out + at, size - at, "%s%d free pages, %d free aux items", at ? ", " : "",
                 __builtin_popcountll(pages), __builtin_popcount(auxes));
}

static void check_canaries(run_t *x, const char *when)
{
    for (int k = 0; k < x->ncanaries; k++) {
        canary_t *c = &x->canaries[k];
        uint64_t pages;
        uint32_t auxes;
        canary_diff(x, c, &pages, &auxes);
        if ((!pages && !auxes) || c->reported)
            continue;
        c->reported = true;
        char who[200];
        owners(x, pages, auxes, who, sizeof(who));
        if (c->room >= 0)
            VIOLATION(x->sc, "I3 pages decode may reuse changed after room %d's %s (seen %s): %s",
                      c->room, c->why, when, who);
        else
            VIOLATION(x->sc, "I3 pages decode may reuse changed after %s (seen %s): %s", c->why,
                      when, who);
    }
}

/* Whether room i's own pages still hold what its canary saw. */
static bool own_pages_kept(const run_t *x, uint32_t i)
{
    const room_run_t *rr = &x->rooms[i];
    if (rr->canary < 0)
        return false;
    uint64_t pages;
    uint32_t auxes;
    canary_diff(x, &x->canaries[rr->canary], &pages, &auxes);
    return !(pages & room_pages(&rr->pr)) && !(auxes & room_auxes(&rr->pr));
}

/* ------------------------------------------------------------------ rooms */

static kvw_status_t create_room(run_t *x, uint32_t i)
{
    room_run_t *rr = &x->rooms[i];
    kvw_status_t st = kvw_sender_create(x->p.prefill, rr->pr.room, &rr->pr.s);
    if (!st)
        st = kvw_receiver_create(rr->dec, kvw_bootstrap_addr(x->p.bootstrap), 0, rr->pr.room,
                                 &rr->pr.r);
    return st;
}

/* Both inits (the receiver's may be given a page out of range). The drive
 * loop does not wait for a thread destroying a handle: false, try again. */
static bool init_room(run_t *x, uint32_t i, bool wait)
{
    const schedule_t *sc = x->sc;
    room_run_t *rr = &x->rooms[i];
    int bad = i < MAX_ROOMS ? sc->bad_side[i] : 0;
    if (wait) {
        pthread_mutex_lock(&rr->rx);
        pthread_mutex_lock(&rr->tx);
    } else if (pthread_mutex_trylock(&rr->rx)) {
        return false;
    } else if (pthread_mutex_trylock(&rr->tx)) {
        pthread_mutex_unlock(&rr->rx);
        return false;
    }
    rr->inited = true;
    if (rr->pr.r) {
        /* A copy: other threads read the room's real pages meanwhile. */
        uint64_t dst[PAIR_POOL];
        memcpy(dst, rr->pr.dst, rr->pr.n * sizeof(dst[0]));
        if (bad == 1)
            dst[0] = PAIR_POOL + 1;
        kvw_receiver_init(rr->pr.r, dst, rr->pr.n, rr->pr.aux_dst);
    }
    if (rr->pr.s)
        kvw_sender_init(rr->pr.s, rr->pr.n, rr->pr.aux_src);
    pthread_mutex_unlock(&rr->tx);
    pthread_mutex_unlock(&rr->rx);
    return true;
}

/* Hand over part k of room i (tx held; its sender exists). */
static void send_part(run_t *x, uint32_t i, uint32_t k)
{
    const schedule_t *sc = x->sc;
    pair_room_t *pr = &x->rooms[i].pr;
    int mode = i < MAX_ROOMS ? sc->send[i] : SEND_WHOLE;
    uint32_t chunks = i < MAX_ROOMS ? sc->chunks[i] : 1;
    uint64_t src_saved = pr->src[0];
    if (i < MAX_ROOMS && sc->bad_side[i] == 2)
        pr->src[0] = PAIR_POOL + 2;
    if (mode == SEND_WHOLE) {
        kvw_sender_send(pr->s, pr->src, pr->n);
    } else {
        uint32_t chunk = k, layer = 0;
        if (mode == SEND_LAYERS) {
            chunks = 1;
            chunk = 0;
            layer = k;
        } else if (mode == SEND_CHUNKS_LAYERS) {
            bool major = sc->layer_major[i];
            chunk = major ? k % chunks : k / PAIR_LAYERS;
            layer = major ? k / chunks : k % PAIR_LAYERS;
        }
        size_t b = pr->n * chunk / chunks, e = pr->n * (chunk + 1) / chunks;
        if (mode == SEND_CHUNKS && sc->via_send[i]) {
            kvw_sender_send(pr->s, pr->src + b, e - b);
        } else {
            kvw_part_t part = {.pages = pr->src + b, .num_pages = e - b, .first_page = b};
            if (mode != SEND_CHUNKS) {
                part.layer_begin = layer;
                part.layer_end = layer + 1;
            }
            kvw_sender_send_part(pr->s, &part);
        }
    }
    pr->src[0] = src_saved;
}

/* What room i is doing now, as far as the test can see (for the tally). */
static int phase(const run_t *x, uint32_t i)
{
    const room_run_t *rr = &x->rooms[i];
    if (!rr->inited)
        return PH_BEFORE_INIT;
    if (ended(rr->d) && ended(rr->s))
        return PH_ENDED;
    if (rr->sent < parts_of(x->sc, i))
        return PH_BETWEEN;
    if (rr->landed_seen_ms && x->sc->gpu_dst && rr->d == KVW_POLL_TRANSFERRING)
        return PH_COPY_IN;
    if (rr->landed_seen_ms || rr->d == KVW_POLL_SUCCESS || rr->s == KVW_POLL_SUCCESS)
        return PH_LANDED;
    return PH_MID;
}

/* Destroy room i's receiver (rx held): record what it was, and snapshot
 * the pool the moment destroy returns. */
static void destroy_receiver_locked(run_t *x, uint32_t i, const char *why)
{
    room_run_t *rr = &x->rooms[i];
    if (!rr->pr.r)
        return;
    kvw_poll_t before = kvw_receiver_poll(rr->pr.r);
    kvw_receiver_destroy(rr->pr.r);
    rr->pr.r = NULL;
    rr->d_gone = before == KVW_POLL_SUCCESS ? KVW_POLL_SUCCESS : KVW_POLL_FAILED;
    rr->r_gone = true;
    atomic_store(&rr->dec_ended, true);
    int c = take_canary(x, (int)i, why);
    if (rr->canary < 0)
        rr->canary = c;
}

typedef struct destroy_arg {
    run_t *x;
    uint32_t i;
} destroy_arg_t;
static destroy_arg_t destroy_args[SLOTS];

static void *destroyer_main(void *arg)
{
    destroy_arg_t *a = arg;
    room_run_t *rr = &a->x->rooms[a->i];
    pthread_mutex_lock(&rr->rx);
    destroy_receiver_locked(a->x, a->i, "receiver destroy returned");
    pthread_mutex_unlock(&rr->rx);
    return NULL;
}

static void act(run_t *x, uint32_t i)
{
    const schedule_t *sc = x->sc;
    room_run_t *rr = &x->rooms[i];
    rr->acted = true;
    tally.acts[sc->abort_side[i]][phase(x, i)]++;
    if (sc->abort_side[i] == 1) {
        if (pthread_mutex_trylock(&rr->rx))
            return; /* its engine is leaving: that destroys it */
        if (rr->pr.r)
            kvw_receiver_abort(rr->pr.r);
        pthread_mutex_unlock(&rr->rx);
    } else if (sc->abort_side[i] == 2 || sc->abort_side[i] == 3) {
        if (pthread_mutex_trylock(&rr->tx))
            return; /* prefill is closing: that destroys it */
        if (rr->pr.s && sc->abort_side[i] == 2) {
            kvw_sender_abort(rr->pr.s);
        } else if (rr->pr.s) {
            rr->s_gone =
                kvw_sender_poll(rr->pr.s) == KVW_POLL_SUCCESS ? KVW_POLL_SUCCESS : KVW_POLL_FAILED;
            rr->s_gone_set = true;
            kvw_sender_destroy(rr->pr.s);
            rr->pr.s = NULL;
        }
        pthread_mutex_unlock(&rr->tx);
    } else if (sc->abort_side[i] == 4) {
        /* destroy waits for the abort's barrier: on a thread of its own,
         * so that every other room is still watched meanwhile */
        destroy_args[i] = (destroy_arg_t){x, i};
        rr->destroying =
            pthread_create(&rr->destroyer, NULL, destroyer_main, &destroy_args[i]) == 0;
        if (!rr->destroying) {
            pthread_mutex_lock(&rr->rx);
            destroy_receiver_locked(x, i, "receiver destroy returned");
            pthread_mutex_unlock(&rr->rx);
        }
    }
}

/* ----------------------------------------------------------------- closes */

/* A decode engine leaves: its receivers are destroyed (each waits for its
 * abort's barrier), then the engine, closing its connection. */
static void close_decode(run_t *x)
{
    for (uint32_t i = 0; i < x->sc->rooms; i++) {
        room_run_t *rr = &x->rooms[i];
        if (rr->dec != x->second)
            continue;
        pthread_mutex_lock(&rr->rx);
        destroy_receiver_locked(x, i, "decode engine left (receiver destroyed)");
        pthread_mutex_unlock(&rr->rx);
    }
    kvw_engine_destroy(x->second);
    x->second = NULL;
    take_canary(x, -1, "a decode engine left");
}

/* Prefill closes: its senders go, then the engine (its connections
 * close); a new engine takes its rank and serves one new room, on pages
 * no other room has, once decode found it. */
static void close_prefill(run_t *x)
{
    for (uint32_t i = 0; i < x->sc->rooms; i++) {
        room_run_t *rr = &x->rooms[i];
        pthread_mutex_lock(&rr->tx);
        if (rr->pr.s) {
            rr->s_gone =
                kvw_sender_poll(rr->pr.s) == KVW_POLL_SUCCESS ? KVW_POLL_SUCCESS : KVW_POLL_FAILED;
            rr->s_gone_set = true;
            kvw_sender_destroy(rr->pr.s);
            rr->pr.s = NULL;
        }
        pthread_mutex_unlock(&rr->tx);
    }
    atomic_store(&prefill_router, NULL);
    /* Lost or withheld control messages were the old connection's fault:
     * the new engine registers, and is found, without them. */
    atomic_store(&kvw__zdrop_hook, NULL);
    x->restart_status = pair_restart_prefill(&x->p);
    if (x->restart_status || !x->new_room)
        return;
    atomic_store(&prefill_router, x->p.prefill->router);
    room_run_t *rr = &x->rooms[NEW_ROOM];
    if (create_room(x, NEW_ROOM)) {
        x->restart_status = KVW_ERR_STATE;
        return;
    }
    init_room(x, NEW_ROOM, true);
    pthread_mutex_lock(&rr->tx);
    send_part(x, NEW_ROOM, 0);
    rr->sent = 1;
    pthread_mutex_unlock(&rr->tx);
    atomic_store(&rr->started, true);
}

static void *closer_main(void *arg)
{
    run_t *x = arg;
    if (x->sc->close == CLOSE_DECODE)
        close_decode(x);
    else
        close_prefill(x);
    atomic_store(&x->close_done, true);
    return NULL;
}

/* ------------------------------------------------------------------ drive */

/* One look at room i: inits, parts and the abort when due; its states,
 * and the canary the moment decode is seen Failed. */
static void step(run_t *x, uint32_t i, uint64_t el)
{
    const schedule_t *sc = x->sc;
    room_run_t *rr = &x->rooms[i];
    bool scheduled = i < MAX_ROOMS;
    uint32_t start = scheduled ? sc->init_ms[i] : 0, gap = scheduled ? sc->gap_ms[i] : 0;
    if (!rr->inited && el >= start)
        init_room(x, i, false);
    uint32_t parts = scheduled ? parts_of(sc, i) : 1;
    if (rr->inited && rr->sent < parts && el >= start + (uint64_t)rr->sent * gap &&
        !pthread_mutex_trylock(&rr->tx)) {
        if (rr->pr.s)
            send_part(x, i, rr->sent);
        rr->sent++;
        pthread_mutex_unlock(&rr->tx);
    }
    if (scheduled && !rr->acted && sc->abort_side[i]) {
        bool due = sc->at[i] == AT_LANDED
                       ? rr->landed_seen_ms && el + 1 >= rr->landed_seen_ms + sc->landed_ms[i]
                       : el >= sc->abort_ms[i];
        if (due)
            act(x, i);
    }
    if (!pthread_mutex_trylock(&rr->rx)) {
        if (rr->pr.r) {
            rr->d = kvw_receiver_poll(rr->pr.r);
            kvw_req_t *req = (kvw_req_t *)rr->pr.r;
            bool landed = atomic_load(&req->rx.landed_ns) || rr->d == KVW_POLL_SUCCESS;
            if (landed && !rr->landed_seen_ms)
                rr->landed_seen_ms = el + 1;
            if (ended(rr->d) && !atomic_load(&rr->dec_ended)) {
                bool reuse = x->sc->reuse && rr->d == KVW_POLL_SUCCESS;
                if (reuse)
                    reuse_at_success(x, i);
                atomic_store(&rr->dec_ended, true);
                if (rr->d == KVW_POLL_FAILED && rr->canary < 0)
                    rr->canary = take_canary(x, (int)i, "Failed");
                if (reuse && rr->canary < 0)
                    rr->canary = take_canary(x, (int)i, "reused at Success");
            }
        } else if (rr->r_gone) {
            rr->d = rr->d_gone;
        }
        pthread_mutex_unlock(&rr->rx);
    }
    if (!pthread_mutex_trylock(&rr->tx)) {
        if (rr->pr.s) {
            rr->s = kvw_sender_poll(rr->pr.s);
            if (rr->s == KVW_POLL_SUCCESS && !rr->landed_seen_ms)
                rr->landed_seen_ms = el + 1;
        } else if (rr->s_gone_set) {
            rr->s = rr->s_gone;
        }
        pthread_mutex_unlock(&rr->tx);
    }
}

/* When the schedule's device dies, and when it comes back. */
static uint32_t kill_ms(const schedule_t *sc)
{
    return sc->flaps ? sc->flap_first_ms : 2;
}

static uint32_t back_ms(const schedule_t *sc)
{
    return sc->flaps ? sc->flap_first_ms + sc->flap_back_ms : 50;
}

/* I9's first failure: the device and its port go down, and from now on
 * ACKs are late, so that requests decode completes meanwhile stay in
 * flight at prefill across the rejoin and the next failure. */
static void first_flap(const schedule_t *sc)
{
    kill_with_event(sc->kill_nic);
    if (sc->flap_ack_us) {
        fake_nic_faults_t f = sc->nic;
        f.ack_delay_us = sc->flap_ack_us;
        fake_nic_set_faults(&f);
    }
}

/* I9: once prefill saw the lane rejoin, the device fails again after
 * flap_gap_ms (its port events too), and comes back flap_back_ms later;
 * sc->flaps times. all: every room ended (a failure then finds none in
 * flight). */
static void flap(run_t *x, uint64_t el, bool all)
{
    const schedule_t *sc = x->sc;
    if (!sc->flaps || !x->revived || x->flaps_done == sc->flaps)
        return;
    if (x->flap_down) {
        if (el < x->flap_down_ms + sc->flap_back_ms)
            return;
        x->rejoins_at_back = atomic_load(&x->p.prefill->counters.lanes_rejoined);
        x->rejoin_seen_ms = 0;
        revive(sc->kill_nic);
        x->flap_down = false;
        x->flaps_done++;
        return;
    }
    if (!x->rejoin_seen_ms &&
        atomic_load(&x->p.prefill->counters.lanes_rejoined) > x->rejoins_at_back)
        x->rejoin_seen_ms = el + 1;
    if (!x->rejoin_seen_ms || el + 1 < x->rejoin_seen_ms + sc->flap_gap_ms)
        return;
    kill_with_event(sc->kill_nic);
    x->flap_down = true;
    x->flap_down_ms = el;
    x->flap_kills++;
    x->flaps_in_flight += !all;
}

/* Poll every room often until all ended on both sides and the close (if
 * any) is over. */
static void drive(run_t *x)
{
    const schedule_t *sc = x->sc;
    uint64_t end = x->t0 + END_MS;
    for (;;) {
        uint64_t now = pair_now_ms(), el = now - x->t0;
        bool all = true; /* every room ended on both sides */
        for (uint32_t i = 0; i < SLOTS; i++) {
            room_run_t *rr = &x->rooms[i];
            if (!rr->used)
                continue;
            if (!atomic_load(&rr->started)) {
                /* not created (a violation already), or NEW_ROOM: the
                 * closer starts it before it is done, if it can */
                all = all && (i < NEW_ROOM || atomic_load(&x->close_done));
                continue;
            }
            step(x, i, el);
            all = all && ended(rr->d) && ended(rr->s);
        }
        if (sc->kill_nic && !x->killed && el >= kill_ms(sc)) {
            if (sc->flaps) /* prefill's own device must say so: its writes would only stall */
                first_flap(sc);
            else
                fake_nic_kill_device(sc->kill_nic);
            x->killed = true;
        }
        if (sc->rail_back && x->killed && !x->revived && el >= back_ms(sc)) {
            if (sc->flaps)
                x->rejoins_at_back = atomic_load(&x->p.prefill->counters.lanes_rejoined);
            revive(sc->kill_nic);
            x->revived = true;
        }
        flap(x, el, all);
        if (sc->silent_side && el >= 2 && !atomic_load(&silent_side))
            atomic_store(&silent_side, sc->silent_side);
        /* The close comes at its time, or once the schedule's own rooms all
         * ended (NEW_ROOM waits for it). */
        bool rest = all;
        for (uint32_t i = 0; x->new_room && i < sc->rooms; i++) {
            const room_run_t *rr = &x->rooms[i];
            rest =
                (i == 0 || rest) && (!atomic_load(&rr->started) || (ended(rr->d) && ended(rr->s)));
        }
        if (sc->close && !x->close_started && (el >= sc->close_ms || rest)) {
            x->close_started = true;
            x->closer_thread = pthread_create(&x->closer, NULL, closer_main, x) == 0;
            if (!x->closer_thread)
                closer_main(x);
            all = false;
        }
        if (sc->close && !atomic_load(&x->close_done))
            all = false;
        if (all)
            return;
        if (now > end) {
            for (uint32_t i = 0; i < SLOTS; i++) {
                room_run_t *rr = &x->rooms[i];
                if (rr->used && (!ended(rr->d) || !ended(rr->s)))
                    VIOLATION(sc, "I5 room %u still %s (decode) / %s (prefill) after %d ms", i,
                              kvw_poll_name(rr->d), kvw_poll_name(rr->s), END_MS);
            }
            if (sc->close && !atomic_load(&x->close_done))
                VIOLATION(sc, "I5 the close (%s) still under way after %d ms",
                          sc->close == CLOSE_DECODE ? "decode engine leaving" : "prefill restart",
                          END_MS);
            return;
        }
        sleep_us(200);
    }
}

/* ----------------------------------------------------------------- checks */

/* The serial of the connection decode engine e holds to prefill, up and
 * not closing; UINT32_MAX if none is. */
static uint32_t decode_connection(kvw_engine_t *e)
{
    uint32_t serial = UINT32_MAX;
    pthread_mutex_lock(&e->lock); /* a slot is cleared (then freed) under it */
    for (uint32_t i = 0; i < atomic_load(&e->num_peers); i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && atomic_load(&p->state) == PEER_CONNECTED && !atomic_load(&p->closing))
            serial = p->serial;
    }
    pthread_mutex_unlock(&e->lock);
    return serial;
}

/* Prefill's lanes out of their (live) connections now, on every rail. */
static uint32_t lanes_out(const kvw_engine_t *prefill)
{
    kvw_rail_health_t h[KVW_MAX_RAILS];
    uint32_t n = kvw_engine_rail_health(prefill, h, KVW_MAX_RAILS), out = 0;
    for (uint32_t r = 0; r < n; r++)
        out += h[r].lanes_out;
    return out;
}

/* I8 (see the top). Waits for the rejoins, so that the checks after it
 * see the lanes back. A connection that closed takes its lanes out with
 * it (the decode engine that leaves). */
static void check_rejoin(run_t *x)
{
    const schedule_t *sc = x->sc;
    if (!sc->rail_back || decode_connection(x->p.decode) == UINT32_MAX)
        return;
    if (x->killed && !x->revived) { /* every room ended before it was back */
        uint64_t back = x->t0 + back_ms(sc), now = pair_now_ms();
        if (now < back)
            pair_sleep_ms((int)(back - now));
        revive(sc->kill_nic);
        x->revived = true;
    }
    if (x->flap_down) { /* the rooms ended while it was down */
        revive(sc->kill_nic);
        x->flap_down = false;
    }
    uint64_t until = pair_now_ms() + REJOIN_MS;
    while (lanes_out(x->p.prefill) && pair_now_ms() < until)
        pair_sleep_ms(2);
    uint32_t out = lanes_out(x->p.prefill);
    if (out)
        VIOLATION(sc,
                  "I8 %u of prefill's lanes still out of their connections %d ms after the "
                  "schedule, with decode's device back",
                  out, REJOIN_MS);
}

static void count_room(const room_run_t *rr)
{
    tally.rooms++;
    tally.decode_ok += rr->d == KVW_POLL_SUCCESS;
    tally.decode_failed += rr->d == KVW_POLL_FAILED;
    tally.both_ok += rr->d == KVW_POLL_SUCCESS && rr->s == KVW_POLL_SUCCESS;
}

static void check_room(run_t *x, uint32_t i)
{
    const schedule_t *sc = x->sc;
    room_run_t *rr = &x->rooms[i];
    count_room(rr);
    /* Reused pages (I9) were checked when decode reported Success. */
    size_t wrong = rr->reused ? rr->wrong_at_success : pair_wrong_bytes(&x->p, &rr->pr);
    if (rr->d == KVW_POLL_SUCCESS && wrong)
        VIOLATION(sc, "I1 room %u: decode Success with %zu wrong bytes", i, wrong);
    if (rr->s == KVW_POLL_SUCCESS && wrong && rr->d != KVW_POLL_FAILED)
        VIOLATION(sc, "I2 room %u: prefill Success with %zu wrong bytes", i, wrong);
    if (rr->s == KVW_POLL_SUCCESS && wrong && rr->d == KVW_POLL_FAILED && !own_pages_kept(x, i))
        VIOLATION(sc, "I2 room %u: prefill Success, decode Failed, bytes partly written", i);
    if (!room_connection_fault(sc, i) && !rr->expect_fail &&
        (rr->d != KVW_POLL_SUCCESS || rr->s != KVW_POLL_SUCCESS)) {
        const char *why = "";
        if (rr->pr.r)
            kvw_receiver_failure(rr->pr.r, &why);
        else if (rr->pr.s)
            kvw_sender_failure(rr->pr.s, &why);
        VIOLATION(sc,
                  "I4 room %u failed (decode %s, prefill %s) without a fault of its own or of "
                  "its connection: %s",
                  i, kvw_poll_name(rr->d), kvw_poll_name(rr->s), why);
    }
}

static void check_counters(engine_pair_t *p, const schedule_t *sc)
{
    kvw_counters_t c = {0};
    if (!p->prefill)
        return;
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

/* --------------------------------------------------------------- schedule */

static void tally_schedule(const schedule_t *sc)
{
    tally.with_fault[0] += !connection_fault(sc);
    tally.with_fault[1] += sc->nic.fail_post_call != 0;
    tally.with_fault[2] += sc->nic.error_wr != 0;
    tally.with_fault[3] += sc->drop_pct != 0;
    tally.with_fault[4] += sc->kill_nic != NULL;
    tally.with_fault[5] += sc->silent_side != 0;
    tally.with_fault[6] += sc->rail_down;
    tally.rails += sc->rails;
    tally.rail_back += sc->rail_back;
    tally.flap_schedules += sc->flaps != 0;
    tally.qps[sc->cfg.qps_per_peer - 1]++;
    tally.gpu[sc->gpu_src + 2 * sc->gpu_dst]++;
    tally.copy_delay += (sc->gpu_src || sc->gpu_dst) && sc->copy_delay_us;
    tally.late_ack += sc->nic.ack_delay_us != 0;
    tally.close[sc->close]++;
    for (uint32_t i = 0; i < sc->rooms; i++) {
        tally.sends[sc->send[i]]++;
        tally.parts += parts_of(sc, i);
        tally.gapped += parts_of(sc, i) > 1 && sc->gap_ms[i];
    }
}

static void run_schedule(uint64_t seed, bool described)
{
    static run_t x; /* large (the canaries): not on the stack */
    schedule_t sc;
    make_schedule(seed, &sc);
    schedule_reported = described;
    tally_schedule(&sc);
    memset(&x, 0, sizeof(x));
    x.sc = &sc;
    pthread_mutex_init(&x.canary_lock, NULL);
    fake_cuda_config_t cuda = {.gdr = 0, .copy_delay_us = sc.copy_delay_us};
    fake_nic_stats_t final;
    kvw_config_t dcfg = sc.cfg;
    if (sc.rails) {
        pair_set_nic_devices(4);
        snprintf(sc.cfg.devices, sizeof(sc.cfg.devices), "fake0,fake2");
        snprintf(dcfg.devices, sizeof(dcfg.devices), "fake1,fake3");
    }
    if (pair_open_staged(&x.p, &sc.cfg, sc.rails ? &dcfg : NULL, sc.gpu_src, sc.gpu_dst, &cuda) !=
            KVW_OK ||
        (sc.close == CLOSE_DECODE && pair_add_decode(&x.p, &x.second) != KVW_OK)) {
        VIOLATION(&sc, "engines did not start");
        kvw_engine_destroy(x.second);
        pair_close(&x.p);
        pair_set_nic_devices(0);
        return;
    }
    x.p.final_stats = &final;
    /* Pages: a window per room; the rest of the pool is free (the restarted
     * prefill's room takes the end of it). */
    uint32_t used = sc.rooms * sc.pages;
    x.new_room = sc.close == CLOSE_PREFILL && used < PAIR_POOL;
    for (uint32_t i = 0; i < SLOTS; i++) {
        room_run_t *rr = &x.rooms[i];
        pthread_mutex_init(&rr->rx, NULL);
        pthread_mutex_init(&rr->tx, NULL);
        rr->canary = -1;
        rr->d = rr->s = KVW_POLL_BOOTSTRAPPING;
        rr->dec = i < MAX_ROOMS && sc.on_second[i] ? x.second : x.p.decode;
        if (i < sc.rooms) {
            rr->used = true;
            pair_pick(&rr->pr, seed * 100 + i, sc.pages, seed * 31 + i, i);
            rr->expect_fail = sc.abort_side[i] || sc.bad_side[i];
        } else if (i == NEW_ROOM && x.new_room) {
            rr->used = true;
            size_t n = PAIR_POOL - used < sc.pages ? PAIR_POOL - used : sc.pages;
            pair_pick(&rr->pr, seed * 100 + 50, n, seed * 37, i);
            for (size_t k = 0; k < n; k++)
                rr->pr.dst[k] = used + (k + seed) % n;
            rr->pr.aux_dst = sc.rooms < PAIR_AUX_ITEMS ? sc.rooms : KVW_NO_AUX;
        }
    }
    tally.free_pages += PAIR_POOL - used;
    for (uint32_t i = 0; i < sc.rooms; i++) {
        if (create_room(&x, i) != KVW_OK) {
            VIOLATION(&sc, "room %u: create failed", i);
            continue;
        }
        atomic_store(&x.rooms[i].started, true);
        if (!sc.init_ms[i])
            init_room(&x, i, true);
    }
    for (uint32_t i = 0; i < sc.rooms; i++) {
        kvw_sender_t *s = x.rooms[i].pr.s;
        if (s && x.rooms[i].inited && kvw_sender_poll(s) != KVW_POLL_FAILED)
            while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING)
                pair_sleep_ms(1); /* decode's requests first: the transfers overlap */
    }
    uint32_t serial = decode_connection(x.p.decode);
    fake_nic_set_faults(&sc.nic);
    atomic_store(&drop_state, seed);
    atomic_store(&drop_pct, sc.drop_pct);
    atomic_store(&silent_side, 0);
    atomic_store(&prefill_router, x.p.prefill->router);
    if (sc.drop_pct || sc.silent_side)
        atomic_store(&kvw__zdrop_hook, drop_some);
    x.t0 = pair_now_ms();
    drive(&x);
    if (!connection_fault(&sc) && sc.close != CLOSE_PREFILL && serial != UINT32_MAX) {
        uint32_t now = decode_connection(x.p.decode);
        if (now != serial)
            VIOLATION(&sc,
                      "I4 decode's connection to prefill broke without a connection fault "
                      "(serial %u at the start, %s)",
                      serial, now == UINT32_MAX ? "none up at the end" : "another at the end");
    }
    check_rejoin(&x);
    for (uint32_t i = 0; i < SLOTS; i++)
        if (x.rooms[i].destroying)
            pthread_join(x.rooms[i].destroyer, NULL);
    if (x.closer_thread)
        pthread_join(x.closer, NULL);
    for (uint32_t i = 0; i < SLOTS; i++) { /* what the threads saw last */
        room_run_t *rr = &x.rooms[i];
        if (rr->r_gone)
            rr->d = rr->d_gone;
        if (rr->s_gone_set)
            rr->s = rr->s_gone;
    }
    if (x.restart_status)
        VIOLATION(&sc, "the restarted prefill did not serve a new room: %s",
                  kvw_status_name(x.restart_status));
    atomic_store(&kvw__zdrop_hook, NULL);
    fake_nic_quiesce(2000);
    /* A late write would land by now; schedules where nothing failed
     * have only their ended rooms' pages and the free ones to watch. */
    pair_sleep_ms((int)(sc.nic.delay_us / 1000 + 2));
    uint64_t grace_end = x.last_canary_ms + GRACE_MS;
    if (x.ncanaries && pair_now_ms() < grace_end)
        pair_sleep_ms((int)(grace_end - pair_now_ms()));
    for (uint32_t i = 0; i < SLOTS; i++)
        if (x.rooms[i].used)
            check_room(&x, i);
    tally.new_rooms += x.new_room;
    tally.new_rooms_ok += x.new_room && x.rooms[NEW_ROOM].d == KVW_POLL_SUCCESS &&
                          x.rooms[NEW_ROOM].s == KVW_POLL_SUCCESS;
    tally.canaries += (uint64_t)x.ncanaries;
    check_canaries(&x, "after a grace period");
    check_counters(&x.p, &sc);
    tally.lanes_rejoined += atomic_load(&x.p.prefill->counters.lanes_rejoined);
    tally.replay_asks += atomic_load(&x.p.prefill->counters.replay_asks);
    tally.flap_fails += x.flap_kills;
    tally.flap_fails_in_flight += x.flaps_in_flight;
    for (uint32_t i = 0; i < SLOTS; i++)
        tally.reused_rooms += x.rooms[i].reused;
    for (uint32_t i = 0; i < SLOTS; i++)
        pair_destroy_room(&x.rooms[i].pr);
    /* Once decode's engines are gone nothing can write their pages: the
     * canaries are compared a last time. */
    kvw_engine_destroy(x.second);
    kvw_engine_destroy(x.p.decode);
    x.p.decode = NULL;
    check_canaries(&x, "once the decode engines were destroyed");
    pair_close(&x.p);
    pair_set_nic_devices(0);
    check_nic(&sc, &final);
    for (uint32_t i = 0; i < SLOTS; i++) {
        pthread_mutex_destroy(&x.rooms[i].rx);
        pthread_mutex_destroy(&x.rooms[i].tx);
    }
    pthread_mutex_destroy(&x.canary_lock);
}

/* Faults make the engines log errors by design: keep them unless asked. */
static void quiet(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    (void)msg;
}

static void summary(uint64_t n, uint64_t first, uint64_t last, uint64_t t0)
{
    printf("chaos: %" PRIu64 " schedules: %" PRIu64 " without a connection fault, %" PRIu64
           " failed posts, %" PRIu64 " error completions, %" PRIu64 " with lost control "
           "messages, %" PRIu64 " dead NICs, %" PRIu64 " silent peers\n",
           n, tally.with_fault[0], tally.with_fault[1], tally.with_fault[2], tally.with_fault[3],
           tally.with_fault[4], tally.with_fault[5]);
    printf("chaos: GPU regions staged: prefill's %" PRIu64 ", decode's %" PRIu64 ", both %" PRIu64
           " schedules (%" PRIu64 " with slow copies), none %" PRIu64 "; late ACKs %" PRIu64 "\n",
           tally.gpu[1], tally.gpu[2], tally.gpu[3], tally.copy_delay, tally.gpu[0],
           tally.late_ack);
    printf(
        "chaos: closing peers: a decode engine left in %" PRIu64 ", prefill restarted in %" PRIu64
        " schedules (its new room landed in %" PRIu64 " of %" PRIu64 ")\n",
        tally.close[CLOSE_DECODE], tally.close[CLOSE_PREFILL], tally.new_rooms_ok, tally.new_rooms);
    printf("chaos: rooms sent whole %" PRIu64 ", in page chunks %" PRIu64
           ", layer by layer %" PRIu64 ", chunks x layers %" PRIu64 ": %" PRIu64 " parts, %" PRIu64
           " rooms with gaps\n",
           tally.sends[SEND_WHOLE], tally.sends[SEND_CHUNKS], tally.sends[SEND_LAYERS],
           tally.sends[SEND_CHUNKS_LAYERS], tally.parts, tally.gapped);
    static const char *const sides[] = {"", "decode aborts", "prefill aborts", "sender destroys",
                                        "receiver destroys"};
    for (int a = 1; a <= 4; a++) {
        uint64_t all = 0;
        for (int ph = 0; ph < PH_KINDS; ph++)
            all += tally.acts[a][ph];
        printf("chaos: %" PRIu64 " %s:", all, sides[a]);
        for (int ph = 0; ph < PH_KINDS; ph++)
            printf("%s %" PRIu64 " %s", ph ? "," : "", tally.acts[a][ph], phase_names[ph]);
        printf("\n");
    }
    printf("chaos: %" PRIu64 " rooms: decode Success %" PRIu64 " (both sides %" PRIu64
           "), decode Failed %" PRIu64 "; %" PRIu64 " canaries taken, %" PRIu64
           " free pages watched\n",
           tally.rooms, tally.decode_ok, tally.both_ok, tally.decode_failed, tally.canaries,
           tally.free_pages);
    printf("chaos: connections of 1, 2, 3 QPs: %" PRIu64 ", %" PRIu64 ", %" PRIu64 " schedules\n",
           tally.qps[0], tally.qps[1], tally.qps[2]);
    printf("chaos: two rails per engine in %" PRIu64 " schedules, %" PRIu64 " of them with a rail "
           "down (%" PRIu64 " of those back at 50 ms); lanes rejoined %" PRIu64
           ", requests asked about (REPLAY_ASK) %" PRIu64 "\n",
           tally.rails, tally.with_fault[6], tally.rail_back, tally.lanes_rejoined,
           tally.replay_asks);
    printf("chaos: %" PRIu64 " flap schedules (I9): the rail failed again %" PRIu64
           " times after a rejoin, %" PRIu64 " of them with requests in flight; %" PRIu64
           " rooms' pages reused at Success\n",
           tally.flap_schedules, tally.flap_fails, tally.flap_fails_in_flight, tally.reused_rooms);
    printf("chaos: %" PRIu64 " fault schedules on the fake NIC (not RDMA) in %.1f s, seeds "
           "%" PRIu64 "..%" PRIu64 ": %d invariant violations\n",
           n, (double)(pair_now_ms() - t0) / 1000.0, first, last, violations);
}

int main(int argc, char **argv)
{
    if (getenv("KVW_TEST_LOG"))
        kvw_set_log_handler(NULL, NULL, KVW_LOG_INFO);
    else
        kvw_set_log_handler(quiet, NULL, KVW_LOG_ERROR);
    if (argc > 1) {
        uint64_t seed = strtoull(argv[1], NULL, 10);
        schedule_t sc;
        make_schedule(seed, &sc);
        describe(&sc);
        run_schedule(seed, true);
        printf("chaos: seed %" PRIu64 ": %d invariant violations\n", seed, violations);
        return violations != 0;
    }
    const char *n_env = getenv("KVW_CHAOS_SCHEDULES"), *first_env = getenv("KVW_CHAOS_FIRST");
    uint64_t n = n_env ? strtoull(n_env, NULL, 10) : 2000;
    uint64_t first = first_env ? strtoull(first_env, NULL, 10) : 1;
    bool flaps_only = getenv("KVW_CHAOS_FLAPS_ONLY") != NULL;
    uint64_t t0 = pair_now_ms(), ran = 0;
    for (uint64_t seed = first; seed < first + n; seed++) {
        uint64_t ts = pair_now_ms();
        if (flaps_only) {
            schedule_t sc;
            make_schedule(seed, &sc);
            if (!sc.flaps)
                continue;
        }
        ran++;
        run_schedule(seed, false);
        if (getenv("KVW_CHAOS_TIMES"))
            fprintf(stderr, "seed %" PRIu64 " %" PRIu64 " ms\n", seed, pair_now_ms() - ts);
    }
    summary(ran, first, first + n - 1, t0);
    return violations != 0;
}
