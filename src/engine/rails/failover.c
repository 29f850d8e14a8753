/* SPDX-License-Identifier: Apache-2.0 */
/* Rails, the poller's side of a lane failing: failover (the connection
 * goes on on its other rails), replay (a request's writes start over under
 * the next epoch), the hold for decode's REPLAY_ANSWER, and lanes taken
 * down on an event or decode's word. The poller calls in through
 * rails/rails.h (an error completion, a pass over a peer) and retires what
 * landed itself afterwards; the lane's way back is rejoin.c. */
#include "engine/pqueue.h"
#include "engine/rails/rails.h"

#include "common/log.h"

#include <stdio.h>

/* ---- a lane's lives ----
 *
 * A request's writes on a lane (its bit in lane_mask, last_seq) are of
 * the lane's life they were made in. When that life ends, its failover
 * looks at every request that used it: one whose writes there all landed
 * forgets the lane (forget_lane), any other starts over (which forgets
 * it), is asked about, or fails. So a request that still has a lane of an
 * earlier life in its mask was missed by that failover (a part handed
 * over meanwhile): what became of those writes is unknown (the rejoin made
 * their flushed sequence numbers read as completed), and it must start
 * over before its final immediate goes. */

/* r waits for nothing more of its writes on the lane: they all landed, or
 * they will never land and r starts over. */
static void forget_lane(kvw_req_t *r, uint32_t lane)
{
    r->tx.lane_mask &= ~(1u << lane);
    r->tx.last_seq[lane] = 0;
}

/* r's lanes whose writes will never be known landed: failed over and not
 * (all) landed, or of an earlier life. Dead lanes whose writes of r all
 * landed are settled on the way. */
uint32_t kvw__rails_lanes_lost(const kvw_peer_t *p, kvw_req_t *r)
{
    uint32_t lost = 0;
    for (uint32_t m = r->tx.lane_mask, j; m; m &= m - 1) {
        j = (uint32_t)__builtin_ctz(m);
        if (!kvw__rails_of_this_life(p, r, j))
            lost |= 1u << j;
        else if (p->lanes[j].health.dead && r->tx.last_seq[j] >= p->lanes[j].txq.completed)
            lost |= 1u << j;
        else if (p->lanes[j].health.dead)
            forget_lane(r, j);
    }
    return lost;
}

/* ---- failover (rails) ----
 *
 * A lane's QP failed while lanes on another rail live: the connection goes
 * on without it. Each request whose writes on it are not all known landed
 * starts over on the live lanes (KV writes are idempotent: the same bytes
 * to the same place), its immediates under the next epoch, which makes
 * decode forget those of the attempt before. Only while its final
 * immediate on the failed lane was never posted: else decode may have
 * counted it, reported Success and reused the pages, and a replay would
 * write into them, so the request fails instead (the abort barrier tells
 * decode once nothing of it is in flight). */

enum { REQ_UNTOUCHED, REQ_REPLAY, REQ_ASK, REQ_REFUSE };

/* How long a request waits for decode's REPLAY_ANSWER before it fails. */
enum { ASK_WAIT_MS = 5000 };

/* Can p go on without `lane`: connected, not closing or being killed,
 * and another rail's lane live (kvw__peer_other_rail_up). */
static bool can_fail_over(const kvw_peer_t *p, uint32_t lane)
{
    /* Killing: its QPs go to ERR before it turns DEAD, and their flushes
     * are the kill's, not a rail's. */
    if (atomic_load(&p->state) != PEER_CONNECTED || atomic_load(&p->closing) ||
        atomic_load(&p->killing))
        return false;
    return kvw__peer_other_rail_up(p, lane, p->rails.dead_lanes);
}

/* What r needs now that `lane` failed with every write before `landed`
 * landed; exact: none from there on did (else they may have: a write whose
 * ACK was lost, or one in flight when the QP was failed, reached decode).
 * Only the life that ended counts: writes of r in an earlier life of the
 * lane were settled by that life's failover. r forgets the lane when its
 * writes there all landed and no immediate is owed there. */
static int req_after_lane_failed(const kvw_peer_t *p, kvw_req_t *r, uint32_t lane, uint64_t landed,
                                 bool exact)
{
    if (atomic_load(&r->state) != KVW_POLL_TRANSFERRING)
        return REQ_UNTOUCHED;
    uint32_t bit = 1u << lane;
    bool wrote = (r->tx.lane_mask & bit) && kvw__rails_of_this_life(p, r, lane);
    /* The final write or a zero-length immediate is on it (posted in
     * this life: the finish fixed the lanes while it was live). */
    bool imm_posted = (r->tx.imms_posted & bit) ||
                      (r->tx.imm_lanes && r->tx.final_lane == lane && kvw__req_fully_built(r));
    bool imm_owed = (r->tx.imm_lanes & bit) && !imm_posted;
    bool all_landed = !wrote || r->tx.last_seq[lane] < landed;
    if (all_landed && !imm_owed) { /* nothing of it lost, no immediate owed there */
        if (wrote)
            forget_lane(r, lane);
        return REQ_UNTOUCHED;
    }
    /* An exact boundary (the peer refused the write, or it never left):
     * nothing from it on landed, so neither did the immediate. */
    if (r->tx.epoch == KVW_WIRE_IMM_EPOCH_MASK)
        return REQ_REFUSE;
    /* The immediate may have landed: decode may have reported Success and
     * reused the pages, so only decode can say whether to replay. */
    return imm_posted && !exact ? REQ_ASK : REQ_REPLAY;
}

/* r's writes start over from its first part, on the live lanes. */
static void restart_req(kvw_engine_t *e, kvw_req_t *r)
{
    for (kvw_seg_t *s = r->tx.segs_head; s;
         s = atomic_load_explicit(&s->next, memory_order_acquire)) {
        s->cursor = (kvw_plan_cursor_t){0};
        s->writes_built = 0;
        s->hslot = 0;
        s->hcursor = (kvw_heads_cursor_t){0, 0, 0};
        s->slices_done = false;
    }
    r->tx.seg = r->tx.segs_head;
    r->tx.writes_built = 0;
    /* The live lanes keep what they carried: writes of the earlier attempt
     * may still be in flight there, and r must not count as drained (nor
     * decode be told it failed) before they completed. The failed lanes'
     * writes, and those of a lane's earlier life, will never land:
     * forgotten. */
    kvw_peer_t *p = r->peer;
    for (uint32_t m = r->tx.lane_mask, j; p && m; m &= m - 1) {
        j = (uint32_t)__builtin_ctz(m);
        if (p->lanes[j].health.dead || !kvw__rails_of_this_life(p, r, j))
            forget_lane(r, j);
    }
    r->tx.imm_lanes = r->tx.imms_posted = r->tx.final_lane = 0;
    r->tx.epoch++;
    atomic_fetch_add(&e->counters.replays, 1);
}

static void refuse_req(kvw_engine_t *e, kvw_req_t *r, uint32_t lane)
{
    char why[KVW_WIRE_REASON_MAX];
    if (r->tx.epoch == KVW_WIRE_IMM_EPOCH_MASK)
        snprintf(why, sizeof(why), "lane %u failed and the request was replayed too often", lane);
    else
        snprintf(why, sizeof(why),
                 "lane %u failed after the request's final immediate went on it: decode may "
                 "have it, so the writes are not replayed",
                 lane);
    atomic_fetch_add(&e->counters.replay_refused, 1);
    pthread_mutex_lock(&e->lock);
    if (!kvw__req_ended(r))
        r->engine->ops->fail_locked(r, KVW_ERR_TRANSFER, why);
    pthread_mutex_unlock(&e->lock);
}

/* r may have lost writes on the `lost` lanes, and its final immediate is
 * not out: it starts over (or fails, replayed too often). */
void kvw__rails_start_over(kvw_peer_t *p, kvw_req_t *r, uint32_t lost)
{
    if (r->tx.epoch == KVW_WIRE_IMM_EPOCH_MASK)
        refuse_req(p->engine, r, (uint32_t)__builtin_ctz(lost));
    else
        restart_req(p->engine, r);
}

/* r goes on hold until decode answers whether it completed the attempt
 * (the control thread asks, kvw__prefill_asks). */
static void hold_for_answer(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t *r)
{
    atomic_fetch_add(&e->counters.replay_asks, 1);
    pthread_mutex_lock(&e->lock);
    r->tx.ask = KVW_ASK_DUE;
    r->tx.ask_deadline_ns = kvw__now_ns() + kvw__ms_ns(ASK_WAIT_MS);
    pthread_mutex_unlock(&e->lock);
    kvw__queue_push(&p->rails.asking_head, &p->rails.asking_tail, r);
    atomic_store(&p->rails.asks_due, true);
    kvw__wake(e->control_wake_fd);
}

/* The requests of one poller queue (active or in flight) that used the
 * lane: restarted (to the active queue), held for decode's answer, or
 * refused (kept where they are, to drain). */
static void fail_over_list(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t **head, kvw_req_t **tail,
                           uint32_t lane, uint64_t landed, bool exact)
{
    kvw_req_t *keep_head = NULL, *keep_tail = NULL, *replay_head = NULL, *replay_tail = NULL, *r;
    while ((r = kvw__queue_pop(head, tail))) {
        int what = req_after_lane_failed(p, r, lane, landed, exact);
        if (what == REQ_REPLAY) {
            restart_req(e, r);
            kvw__queue_push(&replay_head, &replay_tail, r);
            continue;
        }
        if (what == REQ_ASK) {
            hold_for_answer(e, p, r);
            continue;
        }
        if (what == REQ_REFUSE)
            refuse_req(e, r, lane);
        kvw__queue_push(&keep_head, &keep_tail, r);
    }
    *head = keep_head;
    *tail = keep_tail;
    while ((r = kvw__queue_pop(&replay_head, &replay_tail)))
        kvw__queue_push(&p->active_head, &p->active_tail, r);
}

/* Requests waiting on a CUDA event have not posted their final
 * immediate: restarted in place (or refused, replayed too often). */
static void fail_over_evwait(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t *head, uint32_t lane,
                             uint64_t landed, bool exact)
{
    for (kvw_req_t *r = head; r; r = r->qnext) {
        int what = req_after_lane_failed(p, r, lane, landed, exact);
        if (what == REQ_REPLAY)
            restart_req(e, r);
        else if (what != REQ_UNTOUCHED)
            refuse_req(e, r, lane);
    }
}

/* Requests parked between parts (on none of the poller's queues) that
 * used the lane: they start over and come back to the poller. */
static void fail_over_parked(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t landed)
{
    pthread_mutex_lock(&e->lock);
    for (kvw_req_t *r = e->reqs; r; r = r->next) {
        if (r->role != KVW_ROLE_PREFILL || r->peer != p || !r->tx.starved)
            continue;
        int what = req_after_lane_failed(p, r, lane, landed, false);
        if (what == REQ_REPLAY) {
            restart_req(e, r);
            r->engine->ops->unstarve_locked(r);
        } else if (what == REQ_REFUSE) { /* replayed too often: its failure hands it back */
            atomic_fetch_add(&e->counters.replay_refused, 1);
            r->engine->ops->fail_locked(r, KVW_ERR_TRANSFER,
                                        "a lane failed and the request was replayed too often");
        }
    }
    pthread_mutex_unlock(&e->lock);
}

/* Whether an error completion fixes exactly what landed: the peer refused
 * the write (a NAK: it executes nothing after it) or it never left. A
 * transport timeout, or a flush of a QP failed from outside (its port
 * went down), may follow writes that reached decode unacknowledged. */
static bool exact_boundary(enum ibv_wc_status st)
{
    return st != IBV_WC_RETRY_EXC_ERR && st != IBV_WC_WR_FLUSH_ERR && st != IBV_WC_FATAL_ERR &&
           st != IBV_WC_RESP_TIMEOUT_ERR && st != IBV_WC_GENERAL_ERR;
}

static void fail_over(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const char *what, bool exact)
{
    kvw_lane_t *l = &p->lanes[lane];
    kvw__rejoin_lane_failed(e, p, lane); /* out, until it rejoins (rejoin.c) */
    kvw__rejoin_rebuild_turns(p);
    KVW_WARN("connection %u: lane %u on %s failed (%s): its unfinished requests start over on "
             "the other rails; the lane is probed back",
             p->index, lane, e->rail[l->rail].dev->name, what);
    uint64_t landed = l->txq.completed;
    fail_over_list(e, p, &p->active_head, &p->active_tail, lane, landed, exact);
    fail_over_list(e, p, &p->inflight_head, &p->inflight_tail, lane, landed, exact);
    fail_over_evwait(e, p, p->evwait_head, lane, landed, exact);
    fail_over_parked(e, p, lane, landed);
}

/* Requests held for decode's answer (hold_for_answer): replayed under
 * the next epoch, ended as landed (decode completed them), or failed
 * (decode no longer has them, no answer in time, or they failed
 * meanwhile). One that ends goes to the in-flight queue with nothing left
 * to wait for, so that it is retired and released in order. */
void kvw__rails_serve_answers(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_req_t *keep_head = NULL, *keep_tail = NULL, *r;
    uint64_t now = kvw__now_ns();
    while ((r = kvw__queue_pop(&p->rails.asking_head, &p->rails.asking_tail))) {
        pthread_mutex_lock(&e->lock);
        int answer = r->tx.ask - KVW_ASK_SENT;
        bool failed = atomic_load(&r->state) == KVW_POLL_FAILED;
        if (!failed && answer <= 0 && now > r->tx.ask_deadline_ns) {
            r->engine->ops->fail_locked(r, KVW_ERR_TRANSFER,
                                        "a lane failed after the request's final immediate went on "
                                        "it, and decode did not say in time whether it has it");
            failed = true;
        } else if (!failed && answer == KVW_WIRE_REPLAY_GONE) {
            r->engine->ops->fail_locked(r, KVW_ERR_TRANSFER,
                                        "a lane failed and decode no longer has the request");
            failed = true;
        }
        if (!failed && answer <= 0) { /* still waiting */
            pthread_mutex_unlock(&e->lock);
            kvw__queue_push(&keep_head, &keep_tail, r);
            continue;
        }
        r->tx.ask = KVW_ASK_NONE;
        pthread_mutex_unlock(&e->lock);
        if (!failed && answer == KVW_WIRE_REPLAY_AGAIN) {
            restart_req(e, r);
            kvw__queue_push(&p->active_head, &p->active_tail, r);
            continue;
        }
        if (!failed) { /* decode counted every lane's final immediate: all landed */
            atomic_fetch_add(&e->counters.replay_done, 1);
            r->tx.lane_mask = r->tx.imm_lanes = 0;
        }
        /* Failed: it is released (and decode told) only once its writes on
         * the live lanes completed, as any failed request (the barrier). */
        kvw__queue_push(&p->inflight_head, &p->inflight_tail, r);
    }
    p->rails.asking_head = keep_head;
    p->rails.asking_tail = keep_tail;
}

static const char *down_reason(uint8_t why)
{
    return why == KVW_DOWN_HELLO  ? "the handshake could not connect it"
           : why == KVW_DOWN_PEER ? "decode says its end is down"
                                  : "its port went down";
}

/* Lanes whose rail's port went down (rail_down, control.c), that the
 * handshake could not connect, or whose decode end is down: failed over
 * before anything more is posted, or the connection killed when no other
 * rail is left. What they had posted may have landed. */
void kvw__rails_take_down(kvw_engine_t *e, kvw_peer_t *p)
{
    if (!atomic_exchange(&p->rails.lanes_down, false))
        return;
    for (uint32_t i = 0; i < p->nlanes; i++) {
        kvw_lane_t *l = &p->lanes[i];
        if (!atomic_load(&l->health.down_due) || l->health.dead || !l->txq_ready)
            continue;
        kvw__txq_fail_at(&l->txq, l->txq.completed);
        if (can_fail_over(p, i))
            fail_over(e, p, i, down_reason(atomic_load(&l->health.down_why)), false);
        else if (atomic_load(&p->state) != PEER_DEAD)
            kvw__peer_kill(p, KVW_ERR_TRANSFER, "lane %u on %s: %s, and no other rail is left", i,
                           e->rail[l->rail].dev->name,
                           down_reason(atomic_load(&l->health.down_why)));
    }
}

/* Prefill: an error completion on `lane` (first: its send queue was not
 * broken before). A lane already out counts it towards its drain; the
 * first error on a lane the connection can do without fails it over.
 * false: the rails took nothing on, the connection has to go. */
bool kvw__rails_send_error(kvw_peer_t *p, uint32_t lane, const struct ibv_wc *wc, bool first)
{
    if (p->lanes[lane].health.dead) { /* out already: its drain, or a failed probe */
        kvw__rejoin_reaped(p->engine, p, lane, wc->wr_id, false);
        return true;
    }
    if (!first || !can_fail_over(p, lane))
        return false;
    char what[96];
    snprintf(what, sizeof(what), "%s, vendor error 0x%x", ibv_wc_status_str(wc->status),
             wc->vendor_err);
    fail_over(p->engine, p, lane, what, exact_boundary(wc->status));
    kvw__rejoin_reaped(p->engine, p, lane, wc->wr_id, false);
    return true;
}

/* Decode: a lane's QP failed and another rail lives: prefill finds the
 * failure on its side and replays on the other rails; no receive is
 * posted here any more. */
static void decode_lane_failed(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane,
                               const struct ibv_wc *wc)
{
    kvw__rejoin_lane_failed(e, p, lane);
    KVW_WARN("connection %u: lane %u on %s failed (%s): the other rails carry on", p->index, lane,
             e->rail[p->lanes[lane].rail].dev->name, ibv_wc_status_str(wc->status));
}

bool kvw__rails_recv_error(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const struct ibv_wc *wc)
{
    kvw__rejoin_reaped(e, p, lane, wc->wr_id, false); /* decode: one receive fewer */
    if (p->lanes[lane].health.dead || atomic_load(&p->lanes[lane].health.rejoin) == LANE_RESET_DUE)
        return true; /* a rail already given up on, or being reset */
    if (!can_fail_over(p, lane))
        return false;
    decode_lane_failed(e, p, lane, wc);
    return true;
}
