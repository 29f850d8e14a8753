/* SPDX-License-Identifier: Apache-2.0 */
/* The completion-queue poller: one thread per engine. It moves ready
 * requests onto their peer's send queues in doorbell-batched chains (a
 * connection's chains take its lanes, one QP each, in turn), retires
 * completions, and drives request states. When idle it spins briefly, then
 * sleeps on the completion channel so an idle engine burns no core. */
#include "engine/poller.h"
#include "engine/pqueue.h"
#include "engine/rails/rails.h"
#include "engine/stager.h"
#include "engine/verify.h"

#include "common/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { WC_BATCH = 32, IDLE_SLEEP_MS = 1000 };

static void release(kvw_req_t *r);
static void retire_inflight(kvw_peer_t *p);

/* Requests whose both page lists are known, handed over by other threads.
 * Under the lock: a kill detaches requests from their peer, and a dead
 * peer's queues must not grow once the poller has let go of them. */
static int drain_ready(kvw_engine_t *e)
{
    if (!atomic_exchange(&e->ready_pending, false))
        return 0;
    kvw_req_t *orphaned = NULL;
    int n = 0;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = e->ready_head;
    e->ready_head = e->ready_tail = NULL;
    while (r) {
        kvw_req_t *next = r->qnext;
        kvw_peer_t *p = r->peer;
        if (p && atomic_load(&p->state) != PEER_DEAD) {
            kvw__queue_push(&p->active_head, &p->active_tail, r);
        } else { /* its connection died before it was posted */
            r->qnext = orphaned;
            orphaned = r;
        }
        r = next;
        n++;
    }
    pthread_mutex_unlock(&e->lock);
    while ((r = orphaned)) {
        orphaned = r->qnext;
        release(r);
    }
    return n;
}

/* r leaves the poller with no write in flight: it was never posted, or all
 * its posted writes completed, or its connection died (QP in ERR). Once
 * per request, not per write: a failed (or aborted after it succeeded)
 * sender may now tell decode. */
static void release(kvw_req_t *r)
{
    if (kvw__stager_on(r->engine) && atomic_load(&r->state) != KVW_POLL_SUCCESS)
        kvw__stager_drop_unposted(r); /* a Success posted every slice */
    kvw__req_drained(r);
    kvw__req_unref(r);
}

/* Completion accounting: WRs known landed or known lost since the last call. */
static void publish_outcomes(kvw_engine_t *e, kvw_txq_t *q)
{
    atomic_fetch_add_explicit(&e->counters.wrs_completed, q->wrs_ok, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.wrs_flushed, q->wrs_flushed, memory_order_relaxed);
    q->wrs_ok = q->wrs_flushed = 0;
}

/* A dead peer's requests were already failed by kvw__peer_kill(); the
 * poller only lets go of them. WRs not known to have completed never will
 * land: their QP is in ERR. */
static void drop_queues(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_req_t *r;
    while ((r = kvw__queue_pop(&p->active_head, &p->active_tail)))
        release(r);
    while ((r = kvw__queue_pop(&p->inflight_head, &p->inflight_tail)))
        release(r);
    while ((r = kvw__queue_pop(&p->evwait_head, &p->evwait_tail))) {
        atomic_fetch_sub(&e->ev_waiting, 1);
        release(r);
    }
    while ((r = kvw__queue_pop(&p->rails.asking_head, &p->rails.asking_tail)))
        release(r);
    for (uint32_t i = 0; i < p->nlanes; i++) {
        kvw_lane_t *l = &p->lanes[i];
        if (!l->txq_ready)
            continue;
        kvw__txq_fail_at(&l->txq, l->txq.completed); /* no-op once broken */
        publish_outcomes(e, &l->txq);
    }
    if (p->chunk_head) /* the QP is in ERR: the NIC reads no chunk any more */
        kvw__stager_chunks_completed(p, true);
}

/* Chains, WRs and bytes posted on all of p's lanes so far. */
static void lane_totals(const kvw_peer_t *p, uint64_t t[3])
{
    t[0] = t[1] = t[2] = 0;
    for (uint32_t i = 0; i < p->nlanes; i++) {
        const kvw_txq_t *q = &p->lanes[i].txq;
        t[0] += q->chains;
        t[1] += q->wrs_posted;
        t[2] += q->bytes_posted;
    }
}

/* Work requests and bytes per rail: with one rail, what the connection
 * posted; with several, each lane's growth since it was last counted. */
static void publish_rails(kvw_engine_t *e, kvw_peer_t *p, const uint64_t now[3],
                          const uint64_t before[3])
{
    if (e->nrails == 1) {
        atomic_fetch_add_explicit(&e->rail[0].wrs, now[1] - before[1], memory_order_relaxed);
        atomic_fetch_add_explicit(&e->rail[0].bytes, now[2] - before[2], memory_order_relaxed);
        return;
    }
    for (uint32_t i = 0; i < p->nlanes; i++) {
        kvw_lane_t *l = &p->lanes[i];
        atomic_fetch_add_explicit(&e->rail[l->rail].wrs, l->txq.wrs_posted - l->wrs_counted,
                                  memory_order_relaxed);
        atomic_fetch_add_explicit(&e->rail[l->rail].bytes, l->txq.bytes_posted - l->bytes_counted,
                                  memory_order_relaxed);
        l->wrs_counted = l->txq.wrs_posted;
        l->bytes_counted = l->txq.bytes_posted;
    }
}

static void publish_counters(kvw_engine_t *e, kvw_peer_t *p, const uint64_t before[3])
{
    uint64_t now[3];
    lane_totals(p, now);
    publish_rails(e, p, now, before);
    atomic_fetch_add_explicit(&e->counters.chains, now[0] - before[0], memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.wrs, now[1] - before[1], memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.bytes, now[2] - before[2], memory_order_relaxed);
}

static int next_write(kvw_seg_t *s, kvw_write_t *w)
{
    if (s->writes_total)
        return kvw__plan_next(&s->plan, &s->cursor, w);
    *w = (kvw_write_t){.remote_addr = s->plan.regions[0].remote_addr,
                       .rkey = s->plan.regions[0].rkey};
    return 1;
}

/* Head slicing: the next gather write of a sliced part's KV slots, with
 * its plan (for the keys); 0 once they are all out. */
static int next_slice(const kvw_peer_t *p, kvw_seg_t *s, kvw_heads_plan_t *hp, kvw_gwrite_t *w)
{
    const kvw_layout_t *l = &p->engine->layout;
    size_t slots = (size_t)(s->le - s->lb) * l->kv_per_layer;
    for (; s->hslot < slots; s->hslot++, s->hcursor = (kvw_heads_cursor_t){0, 0, 0}) {
        kvw__seg_slice_plan(p, l, s, (size_t)s->lb * l->kv_per_layer + s->hslot, hp);
        if (kvw__heads_next(hp, &s->hcursor, w))
            return 1;
    }
    return 0;
}

/* Append s's next write to q, plain or with an immediate: a sliced part's
 * gather writes first, then the plan's. 0 when s has none left. */
static int add_next(const kvw_peer_t *p, kvw_txq_t *q, kvw_seg_t *s, int with_imm, uint32_t imm,
                    uint64_t *seq, uint64_t *bytes)
{
    if (s->sliced && !s->slices_done) {
        kvw_heads_plan_t hp;
        kvw_gwrite_t g;
        if (next_slice(p, s, &hp, &g)) {
            *seq = kvw__txq_add_gather(q, &g, hp.lkey, hp.rkey, with_imm, imm);
            *bytes += g.len;
            return 1;
        }
        s->slices_done = true;
    }
    kvw_write_t w;
    if (!next_write(s, &w))
        return 0;
    *seq = kvw__txq_add(q, &w, with_imm, imm);
    *bytes += w.len;
    return 1;
}

/* The part to post from: the current one, or the next planned one once the
 * current is done (the owner appends with a release store). */
static kvw_seg_t *current_seg(kvw_req_t *r)
{
    kvw_seg_t *s = r->tx.seg;
    while (s->writes_built == kvw__seg_total(s) && !s->final) {
        kvw_seg_t *next = atomic_load_explicit(&s->next, memory_order_acquire);
        if (!next)
            break;
        s = r->tx.seg = next;
    }
    return s;
}

/* An immediate consumes one receive decode posted on the lane; without a
 * credit (or send-queue room) it waits: the connection, not a request, is
 * out of them. */
static bool imm_room(kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (l->imm_posted < atomic_load_explicit(&l->imm_limit, memory_order_acquire) &&
        kvw__txq_room(&l->txq))
        return true;
    p->credit_blocked = true;
    return false;
}

/* r's latest write on a lane, in the lane's current life. */
static void note_lane(kvw_peer_t *p, kvw_req_t *r, uint32_t lane, uint64_t seq)
{
    r->tx.last_seq[lane] = seq;
    r->tx.lane_life[lane] = p->lanes[lane].health.life;
    r->tx.lane_mask |= 1u << lane;
}

/* Plain writes of s that can go in as a span of whole runs (at most room,
 * never the part's last write when it carries the immediate): appended
 * straight from the precomputed byte runs. Returns how many (0: none, take
 * the next write one at a time). */
static uint32_t build_span(kvw_txq_t *q, kvw_seg_t *s, uint32_t room, uint64_t *bytes)
{
    uint64_t plain = kvw__seg_total(s) - s->writes_built - (s->final ? 1 : 0);
    const kvw_plan_region_t *g;
    const kvw_wrun_t *runs;
    uint32_t n =
        kvw__plan_span(&s->plan, &s->cursor, plain < room ? (uint32_t)plain : room, &g, &runs);
    if (!n)
        return 0;
    *bytes += kvw__txq_add_runs(q, g, runs, n);
    kvw__plan_skip(&s->plan, &s->cursor, n);
    s->writes_built += n;
    return n;
}

/* A staged slice whose writes are all built: its chunk is free again once
 * they completed. */
static void seg_posted(kvw_peer_t *p, kvw_seg_t *s)
{
    if (s->chunk && s->writes_built == kvw__seg_total(s))
        kvw__stager_chunk_posted(p, s);
}

/* s's writes go on `lane` next: its plan takes that lane's keys (its
 * rail's lkeys, the peer rail's rkeys). A staged slice keeps its own
 * regions (the staging chunk; one rail only). */
static inline void use_lane_keys(const kvw_peer_t *p, uint32_t lane, kvw_seg_t *s)
{
    if (!s->chunk)
        s->plan.regions = p->lanes[lane].regions;
}

/* The request's last write, with the immediate, on the lane the finish
 * began on, and a zero-length write with the same immediate on every other
 * lane that carried part of it: each lands after that lane's writes (RC
 * order per QP), and the immediate says how many there are, so decode
 * knows the request landed once all arrived. false when a lane is out of
 * credits or room: it resumes where it stopped. */
static bool finish_request(kvw_peer_t *p, uint32_t lane, kvw_req_t *r, kvw_seg_t *s,
                           uint64_t *bytes)
{
    if (!r->tx.imm_lanes) { /* fix the lanes once: the count must not change */
        /* A failed-over lane's writes of r all landed (else r started
         * over): it needs no immediate, and could carry none. */
        r->tx.imm_lanes = (r->tx.lane_mask & ~p->rails.dead_lanes) | 1u << lane;
        r->tx.final_lane = lane;
    }
    uint32_t count = (uint32_t)__builtin_popcount(r->tx.imm_lanes);
    uint32_t imm = r->token | r->tx.epoch << KVW_WIRE_IMM_EPOCH_SHIFT |
                   (count - 1) << KVW_WIRE_IMM_COUNT_SHIFT;
    for (uint32_t j = 0; j < p->nlanes; j++) {
        if (!(r->tx.imm_lanes & 1u << j) || j == r->tx.final_lane || r->tx.imms_posted & 1u << j)
            continue;
        if (!imm_room(p, j))
            return false;
        use_lane_keys(p, j, s);
        kvw_write_t zero = {.remote_addr = s->plan.regions[0].remote_addr,
                            .rkey = s->plan.regions[0].rkey};
        note_lane(p, r, j, kvw__txq_add(&p->lanes[j].txq, &zero, 1, imm));
        p->lanes[j].imm_posted++;
        r->tx.imms_posted |= 1u << j;
    }
    uint32_t f = r->tx.final_lane;
    uint64_t seq;
    use_lane_keys(p, f, s);
    if (!imm_room(p, f) || !add_next(p, &p->lanes[f].txq, s, 1, imm, &seq, bytes))
        return false;
    note_lane(p, r, f, seq);
    p->lanes[f].imm_posted++;
    s->writes_built++;
    seg_posted(p, s);
    return true;
}

/* The producer's event of s, r's next part to post (send_part_after):
 * 1 when it completed (or s has none), 0 while it runs, -1 when it failed:
 * r fails with the reason (decode is told once r's posted writes drained)
 * and nothing of s is posted. */
static int part_event(kvw_req_t *r, kvw_seg_t *s)
{
    char why[KVW_WIRE_REASON_MAX];
    int rc = kvw__seg_event_ready(r, s, why, sizeof(why));
    if (rc < 0) {
        kvw_engine_t *e = r->engine;
        pthread_mutex_lock(&e->lock);
        if (!kvw__req_ended(r))
            r->engine->ops->fail_locked(r, KVW_ERR_TRANSFER, why);
        pthread_mutex_unlock(&e->lock);
    }
    return rc;
}

/* Build r's next writes into the lane's open chain; returns how many.
 * Stops before a part whose producer's event has not completed
 * (r->tx.ev_blocked). */
static uint32_t build_writes(kvw_peer_t *p, uint32_t lane, kvw_req_t *r, uint32_t room)
{
    kvw_txq_t *q = &p->lanes[lane].txq;
    uint32_t built = 0;
    uint64_t bytes = 0;
    kvw_write_t w;
    bool restarted = false;
    if ((r->tx.lane_mask & 1u << lane) && !kvw__rails_of_this_life(p, r, lane)) {
        /* Its writes in the lane's earlier life were missed by that life's
         * failover: noting new ones would hide them. They may be lost. */
        kvw__rails_start_over(p, r, 1u << lane);
        return 0;
    }
    kvw_seg_t *s = current_seg(r);
    use_lane_keys(p, lane, s);
    while (built < room) {
        uint64_t total = kvw__seg_total(s);
        if (s->writes_built == total) {
            kvw_seg_t *next = current_seg(r);
            if (s->final || next == s)
                break; /* done, or the next part is not here yet */
            s = next;
            use_lane_keys(p, lane, s);
            continue;
        }
        if (s->event && part_event(r, s) != 1) {
            r->tx.ev_blocked = true; /* waits (0), or failed (-1): nothing of s goes */
            break;
        }
        if (s->digest_due) /* verify: its source is final now (event done, chunk filled) */
            kvw__verify_seg(r, s);
        uint32_t n = build_span(q, s, room - built, &bytes);
        if (n) {
            built += n;
            note_lane(p, r, lane, q->posted + q->pending - 1);
            seg_posted(p, s);
            continue;
        }
        if (s->final && s->writes_built + 1 == total) {
            uint32_t lost = r->tx.imm_lanes ? 0 : kvw__rails_lanes_lost(p, r);
            if (lost) {
                /* Missed by its lane's failover (a part handed over just
                 * then): a failed lane gets no immediate, nor does an
                 * earlier life's, so the writes it may have lost must go
                 * again. */
                kvw__rails_start_over(p, r, lost);
                restarted = true;
                break;
            }
            built += finish_request(p, lane, r, s, &bytes);
            break;
        }
        if (s->sliced) { /* head slicing: gather writes */
            uint64_t seq;
            if (!add_next(p, q, s, 0, 0, &seq, &bytes))
                break;
            note_lane(p, r, lane, seq);
        } else {
            if (!next_write(s, &w))
                break;
            note_lane(p, r, lane, kvw__txq_add(q, &w, 0, 0));
            bytes += w.len;
        }
        s->writes_built++;
        built++;
        seg_posted(p, s);
    }
    if (!r->tx.writes_built && built && !r->tx.epoch) /* the transfer clock: the first post */
        atomic_store_explicit(&r->tx.first_post_ns, kvw__now_ns(), memory_order_relaxed);
    if (!restarted) /* a restart counts from 0 again */
        r->tx.writes_built += built;
    atomic_fetch_add_explicit(&r->bytes_posted, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->tx.writes_posted, built, memory_order_relaxed);
    return built;
}

/* Every part r (the head of p's active queue) has was posted and more will
 * come: park it (it keeps the poller's reference; the next part, a failure
 * or a dead connection hands it back). It stays if a part arrived, or it
 * failed, meanwhile: the next turn posts the part, or drops it. */
static void starve(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t *r)
{
    pthread_mutex_lock(&e->lock);
    /* Off the active queue before the lock is released: once it is marked
     * starved, another thread may hand it back (through qnext) at once. */
    if (r->engine->ops->starve_locked(r))
        kvw__queue_pop(&p->active_head, &p->active_tail);
    pthread_mutex_unlock(&e->lock);
}

/* Stop feeding a request that failed meanwhile (aborted, destroyed): what
 * it already posted stays in flight and is retired in order. A request
 * parked between parts and handed back by its failure may have nothing in
 * flight any more: no completion will come for it, so look now. */
static void drop_failed_active(kvw_peer_t *p, kvw_req_t *r)
{
    kvw__queue_pop(&p->active_head, &p->active_tail);
    /* Nothing posted, in this attempt or (lane_mask) an earlier one whose
     * writes may still be in flight on a live lane. */
    if (!r->tx.writes_built && !r->tx.lane_mask) {
        release(r);
        return;
    }
    kvw__queue_push(&p->inflight_head, &p->inflight_tail, r);
    retire_inflight(p);
}

/* The next lane in the connection's weighted turn (sched: each lane as
 * often as its rail's speed says; 0, 1, ..., nlanes - 1 on equal rails). */
static void advance_lane(kvw_peer_t *p)
{
    p->rails.sched_pos = p->rails.sched_pos + 1 >= p->rails.nsched ? 0 : p->rails.sched_pos + 1;
    p->rails.next_lane = p->rails.sched[p->rails.sched_pos];
}

static bool lanes_ready(kvw_engine_t *e, kvw_peer_t *p)
{
    for (uint32_t i = 0; i < p->nlanes; i++) {
        kvw_lane_t *l = &p->lanes[i];
        if (l->txq_ready)
            continue;
        /* Prefill's side of a sliced connection (kv_geom) also gets gather slots. */
        if (kvw__txq_init(&l->txq, e->dev->ops, l->qp->qp, e->cfg.sq_depth, e->cfg.chain_max,
                          e->cfg.signal_every) ||
            (p->kv_geom && kvw__txq_enable_gather(&l->txq, p->max_sge))) {
            kvw__peer_kill(p, KVW_ERR_NO_MEMORY, "no memory for the send queue");
            return false;
        }
        l->txq_ready = true;
    }
    return true;
}

/* Post every lane's open chain. The next chain starts on the next lane
 * when this pass posted one on the current lane, so that writes handed
 * over a little at a time (layer by layer, staged slices) stripe too. */
static kvw_status_t flush_lanes(kvw_peer_t *p)
{
    kvw_status_t st = KVW_OK;
    bool rotate = p->lanes[p->rails.next_lane].txq.pending > 0;
    for (uint32_t i = 0; i < p->nlanes && !st; i++)
        if (p->lanes[i].txq.pending)
            st = kvw__txq_flush(&p->lanes[i].txq);
    if (rotate)
        advance_lane(p);
    return st;
}

/* The lane to build on: the current one while its chain has room, else
 * (its chain posted) the next with room, in turn. NULL when every lane is
 * out of send-queue credits: wait for completions. */
static kvw_txq_t *pick_lane(kvw_peer_t *p, kvw_status_t *st)
{
    for (uint32_t tried = 0; tried < p->rails.nsched; tried++) {
        kvw_txq_t *q = &p->lanes[p->rails.next_lane].txq;
        if (kvw__txq_room(q))
            return q;
        if (q->pending && (*st = kvw__txq_flush(q)))
            return NULL;
        if (q->pending == 0 && kvw__txq_room(q))
            return q; /* a full chain posted: room again on the same lane */
        advance_lane(p);
    }
    return NULL;
}

/* A caller's pass posts little per connection: on rxe the device does the
 * transfer inside ibv_post_send, so a pass that posted a whole request kept
 * the caller there for as long as the wire took, and when the caller was
 * prefill's control thread, decode's pings and other decode engines'
 * requests waited meanwhile (a live prefill was declared silent). The
 * poller, woken for the rest, is the thread that may spend that time. */
enum { UNBOUNDED = UINT32_MAX };

/* What a caller's pass may post per connection (the poller's own passes
 * are unbounded): cfg.chain_max writes or CALLER_BYTES bytes, whichever comes
 * first, built CALLER_STEP writes at a time so that large writes stop it
 * early too. */
enum { CALLER_STEP = 4, CALLER_BYTES = 256 * 1024 };

/* Requests whose next part waited on its producer's event go back to the
 * active queue once it completed (or failed, or they ended: the active
 * queue lets them go); returns how many went. */
static int recheck_events(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_req_t *r, *wait_head = NULL, *wait_tail = NULL;
    int moved = 0;
    while ((r = kvw__queue_pop(&p->evwait_head, &p->evwait_tail))) {
        if (atomic_load(&r->state) == KVW_POLL_TRANSFERRING && part_event(r, r->tx.seg) == 0) {
            kvw__queue_push(&wait_head, &wait_tail, r);
            continue;
        }
        atomic_fetch_sub(&e->ev_waiting, 1);
        kvw__queue_push(&p->active_head, &p->active_tail, r);
        moved++;
    }
    p->evwait_head = wait_head;
    p->evwait_tail = wait_tail;
    p->evwait_due_ns = kvw__now_ns() + KVW_EVENT_RECHECK_US * 1000ull;
    return moved;
}

/* r's next part waits on its producer's event: off the active queue, so
 * that the connection's other requests go on meanwhile. A sleeping poller
 * is woken to sleep again no longer than KVW_EVENT_RECHECK_US. */
static void wait_for_event(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t *r)
{
    kvw__queue_pop(&p->active_head, &p->active_tail);
    if (!p->evwait_head)
        p->evwait_due_ns = kvw__now_ns() + KVW_EVENT_RECHECK_US * 1000ull;
    kvw__queue_push(&p->evwait_head, &p->evwait_tail, r);
    atomic_fetch_add_explicit(&e->counters.event_waits, 1, memory_order_relaxed);
    if (atomic_fetch_add(&e->ev_waiting, 1) == 0)
        kvw__wake_poller(e);
}

/* Posts p's requests while the send queue has room, at most `budget` WRs
 * (UNBOUNDED: no limit; else also at most CALLER_BYTES); *more is set when
 * writes are left because the budget ran out. */
static int post_peer(kvw_engine_t *e, kvw_peer_t *p, uint32_t budget, bool *more)
{
    /* A spinning poller passes every microsecond or so: the events are
     * looked at only every KVW_EVENT_RECHECK_US. */
    int moved = p->evwait_head && kvw__now_ns() >= p->evwait_due_ns ? recheck_events(e, p) : 0;
    /* Before anything is posted, and on an idle connection too: its lanes'
     * rejoin starts from here. */
    if (atomic_load_explicit(&p->rails.lanes_down, memory_order_relaxed) && lanes_ready(e, p)) {
        /* Parts handed over since this pass began: their requests join the
         * active queue first, so that a failover sees them. */
        drain_ready(e);
        kvw__rails_take_down(e, p);
        retire_inflight(p);
    }
    if (!p->active_head || !lanes_ready(e, p))
        return moved;
    uint64_t before[3];
    lane_totals(p, before);
    kvw_status_t st = KVW_OK;
    int work = 0;
    uint64_t bytes = 0;
    bool bounded = budget != UNBOUNDED;
    kvw_req_t *r;
    kvw_txq_t *q;
    p->credit_blocked = false;
    while (!st && !p->credit_blocked && (r = p->active_head) && (q = pick_lane(p, &st))) {
        uint32_t room = kvw__txq_room(q);
        uint64_t pending_before = 0;
        if (bounded) { /* a caller's pass: the poller's own skips all this */
            if ((uint32_t)work >= budget || bytes >= CALLER_BYTES) {
                *more = true;
                break;
            }
            room = room > CALLER_STEP ? CALLER_STEP : room;
            pending_before = q->pending_bytes;
        }
        if (atomic_load(&r->state) != KVW_POLL_TRANSFERRING) {
            drop_failed_active(p, r);
            continue;
        }
        if (!r->tx.seg)
            r->tx.seg = r->tx.segs_head; /* set before it was handed over */
        uint32_t n = build_writes(p, p->rails.next_lane, r, room);
        work += (int)n;
        if (bounded)
            bytes += q->pending_bytes - pending_before;
        if (p->nlanes > 1 && !kvw__txq_room(q) && q->pending) { /* a full chain: next lane */
            st = kvw__txq_flush(q);
            advance_lane(p);
        }
        if (r->tx.ev_blocked) {
            r->tx.ev_blocked = false;
            /* Failed (event error): the head of the queue, dropped next round. */
            if (atomic_load(&r->state) == KVW_POLL_TRANSFERRING)
                wait_for_event(e, p, r);
            continue;
        }
        if (kvw__req_fully_built(r)) {
            kvw__queue_pop(&p->active_head, &p->active_tail);
            kvw__queue_push(&p->inflight_head, &p->inflight_tail, r);
        } else if (n < room && !p->credit_blocked &&
                   current_seg(r)->writes_built == kvw__seg_total(current_seg(r))) {
            starve(e, p, r); /* waits for its next part */
        }
    }
    if (!st)
        st = flush_lanes(p);
    publish_counters(e, p, before);
    work += moved;
    if (st) {
        /* Nothing more may be posted on this QP: a later chain would put an
         * immediate on the wire after a hole in the request's writes. */
        atomic_fetch_add(&e->counters.errors, 1);
        kvw__peer_kill(p, KVW_ERR_VERBS, "posting to the send queue failed");
    }
    return work;
}

/* Every write of r completed, on every lane it used. */
static bool req_landed(const kvw_peer_t *p, const kvw_req_t *r)
{
    for (uint32_t m = r->tx.lane_mask, j; m; m &= m - 1) {
        j = (uint32_t)__builtin_ctz(m);
        const kvw_txq_t *q = &p->lanes[j].txq;
        /* A failed request has nothing in flight on a failed-over lane:
         * retired, its failure reaches decode. */
        if (r->tx.last_seq[j] >= q->completed &&
            !(q->broken && atomic_load(&r->state) == KVW_POLL_FAILED))
            return false;
    }
    return true;
}

static void retire_inflight(kvw_peer_t *p)
{
    kvw_req_t *r;
    while ((r = p->inflight_head) && req_landed(p, r)) {
        kvw__queue_pop(&p->inflight_head, &p->inflight_tail);
        atomic_store_explicit(&r->tx.done_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_succeed(r); /* unless it failed meanwhile */
        release(r);
    }
}

static uint64_t room_of_seq(const kvw_peer_t *p, uint32_t lane, uint64_t seq)
{
    for (const kvw_req_t *r = p->inflight_head; r; r = r->qnext)
        if (r->tx.lane_mask & 1u << lane && r->tx.last_seq[lane] >= seq)
            return r->room;
    return p->active_head ? p->active_head->room : UINT64_MAX;
}

/* RC completes in order: everything posted before the failing WR landed.
 * Retire those requests as Success first; then the rails fail the lane
 * over, or the connection fails. */
static void on_send_error(kvw_peer_t *p, uint32_t lane, const struct ibv_wc *wc)
{
    kvw_txq_t *q = &p->lanes[lane].txq;
    bool first = !q->broken;
    kvw__txq_fail_at(q, wc->wr_id);
    if (first && !p->lanes[lane].health.dead) /* a failover must see parts handed over meanwhile */
        drain_ready(p->engine);
    bool carried_on = kvw__rails_send_error(p, lane, wc, first);
    retire_inflight(p);
    if (!carried_on && first && !p->lanes[lane].health.dead && atomic_load(&p->state) != PEER_DEAD)
        kvw__peer_kill(p, KVW_ERR_TRANSFER,
                       "RDMA write (room %llu) completed with %s (vendor error 0x%x)",
                       (unsigned long long)room_of_seq(p, lane, wc->wr_id),
                       ibv_wc_status_str(wc->status), wc->vendor_err);
}

static void on_error_completion(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane,
                                const struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_WR_FLUSH_ERR ||
        (atomic_load(&p->state) != PEER_DEAD && !p->lanes[lane].health.dead))
        atomic_fetch_add(&e->counters.errors, 1); /* flushes after a kill are expected */
    if (e->role == KVW_ROLE_PREFILL) {
        on_send_error(p, lane, wc);
        return;
    }
    if (!kvw__rails_recv_error(e, p, lane, wc) && atomic_load(&p->state) != PEER_DEAD)
        kvw__peer_kill(p, KVW_ERR_TRANSFER, "receive completed with %s (vendor error 0x%x)",
                       ibv_wc_status_str(wc->status), wc->vendor_err);
}

static void repost_receive(kvw_engine_t *e, kvw_peer_t *p, kvw_lane_t *l, uint64_t index)
{
    struct ibv_recv_wr *bad, *wr = &l->rwrs[index];
    wr->next = NULL;
    if (e->dev->ops->post_recv(l->qp->qp, wr, &bad)) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "re-posting a receive failed: %s", strerror(errno));
        return;
    }
    /* Credits go back to prefill in batches (CREDIT, sent by the control
     * thread), so a busy connection costs one message per quarter queue. */
    uint64_t posted = atomic_fetch_add(&l->recvs_posted, 1) + 1;
    if (posted - atomic_load(&l->credits_sent) >= (e->cfg.rq_depth + 3) / 4)
        kvw__wake(e->control_wake_fd);
}

/* (lock) One of the immediates r's writes end with; true once all arrived
 * (one per lane that carried part of it). */
static bool all_immediates_locked(kvw_req_t *r, uint32_t imm)
{
    /* Counted per attempt: prefill replays a request whose lane failed
     * under the next epoch, and an immediate of an earlier attempt no
     * longer says anything about the writes of the latest. */
    uint32_t epoch = imm >> KVW_WIRE_IMM_EPOCH_SHIFT & KVW_WIRE_IMM_EPOCH_MASK;
    if (epoch < r->rx.imm_epoch)
        return false;
    if (epoch > r->rx.imm_epoch) {
        r->rx.imm_epoch = epoch;
        r->rx.imms_landed = 0;
    }
    return ++r->rx.imms_landed >= (imm >> KVW_WIRE_IMM_COUNT_SHIFT) + 1;
}

/* (lock) Every write of verified r landed: the caller's digest is
 * awaited, or kvwire computes decode's (returns r, with a reference, for
 * kvw__verify_check_landed outside the lock). Once only. */
static kvw_req_t *landed_to_verify_locked(kvw_req_t *r)
{
    if (r->rx.v_landed)
        return NULL;
    atomic_store_explicit(&r->rx.landed_ns, kvw__now_ns(), memory_order_relaxed);
    if (r->rx.verify == KVW_VERIFY_CALLER) {
        kvw__verify_landed_locked(r, false, 0);
        return NULL;
    }
    r->rx.v_landed = true;
    atomic_fetch_add(&r->refs, 1);
    return r;
}

static void on_immediate(kvw_engine_t *e, kvw_peer_t *p, kvw_lane_t *l, const struct ibv_wc *wc)
{
    uint32_t imm = ntohl(wc->imm_data), token = imm & KVW_WIRE_TOKEN_MASK;
    /* GPU regions on GPUs that do not order the NIC's writes for their own
     * kernels: make every landed byte visible before saying Success (a CUDA
     * call, so before the lock). */
    kvw_status_t flushed =
        kvw__mem_needs_flush(&e->mem) ? kvw__mem_flush_gpu_writes(&e->mem) : KVW_OK;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__token_lookup_locked(e, token), *scatter = NULL, *check = NULL;
    bool staged = r && r->stage.slots && kvw__stager_on(e);
    if (r && r->peer == p && !all_immediates_locked(r, imm))
        ; /* another lane's still to come */
    else if (r && r->peer == p && flushed)
        kvw__req_fail(r, KVW_ERR_TRANSFER, "the data landed but flushing GPU writes failed");
    else if (r && r->peer == p && r->rx.aborting)
        /* The last write landed, so nothing more can: the abort is done. */
        kvw__req_fail(r, r->rx.abort_status, "%s", r->rx.abort_reason);
    else if (r && r->peer == p && staged && !kvw__req_ended(r)) {
        /* In the staging pool: Success once copied to the GPU (never the
         * copy of a request already ended: its pages may be another's now).
         * The transfer limit measured the landing; the copy is local and
         * the request ends with it, so no deadline fails it meanwhile. */
        atomic_store_explicit(&r->rx.landed_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_set_deadline_locked(r, 0);
        kvw__stager_landed_locked(r);
    } else if (r && r->peer == p && r->rx.land_len && !kvw__req_ended(r)) {
        /* Landed in the landing buffer: Success once copied into the rows.
         * Failures meanwhile are ignored (staging_in), as for the stager's
         * copy: every byte of it landed. */
        atomic_store_explicit(&r->rx.landed_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_set_deadline_locked(r, 0);
        r->stage.staging_in = true;
        atomic_fetch_add(&r->refs, 1);
        scatter = r;
    } else if (r && r->peer == p && r->rx.verify && !kvw__req_ended(r)) {
        /* Verified: Success once the digests agree (engine/verify.h); the
         * transfer limit still bounds the wait for them. */
        check = landed_to_verify_locked(r);
    } else if (r && r->peer == p && kvw__req_succeed(r)) {
        atomic_store_explicit(&r->rx.landed_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_set_deadline_locked(r, 0); /* its transfer limit no longer applies */
    } else
        KVW_INFO("immediate for unknown request token 0x%x (destroyed receiver?)", token);
    pthread_mutex_unlock(&e->lock);
    if (scatter) /* the copy into the rows: the copier's thread, not this one */
        kvw__copier_push(e, scatter);
    if (check)
        kvw__verify_check_landed(e, check); /* outside the lock: a pass over its bytes */
    /* Give the receive back at once so the peer never meets an empty queue. */
    if (wc->wr_id < e->cfg.rq_depth)
        repost_receive(e, p, l, wc->wr_id);
}

/* Reaps one batch of the lane's completions; *ok counts the successful
 * ones (each is proof that the other side's QP is alive). */
static int poll_lane(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, int *ok)
{
    kvw_lane_t *l = &p->lanes[lane];
    struct ibv_wc wc[WC_BATCH];
    int n = e->dev->ops->poll_cq(l->qp->cq, WC_BATCH, wc);
    if (n < 0) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "ibv_poll_cq failed");
        return 0;
    }
    for (int i = 0; i < n; i++) {
        if (wc[i].status != IBV_WC_SUCCESS) {
            on_error_completion(e, p, lane, &wc[i]);
            continue;
        }
        ++*ok;
        if (e->role == KVW_ROLE_PREFILL) {
            kvw__txq_retire(&l->txq, wc[i].wr_id);
            if (l->health.dead)
                kvw__rejoin_reaped(e, p, lane, wc[i].wr_id, true);
        } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM)
            on_immediate(e, p, l, &wc[i]);
    }
    return n;
}

static int poll_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    int n = 0, ok = 0;
    for (uint32_t i = 0; i < p->nlanes; i++)
        n += poll_lane(e, p, i, &ok);
    if (ok > 0) /* one clock read per batch, not per completion */
        atomic_store_explicit(&p->data_seen_ns, kvw__now_ns(), memory_order_relaxed);
    if (n > 0) {
        atomic_fetch_add_explicit(&e->counters.completions, (uint64_t)n, memory_order_relaxed);
        if (e->role == KVW_ROLE_PREFILL)
            retire_inflight(p);
        if (p->chunk_head)
            kvw__stager_chunks_completed(p, false);
    }
    if (atomic_load(&p->state) == PEER_DEAD && !atomic_load(&p->poller_done)) {
        drop_queues(e, p);
        kvw__rejoin_peer_gone(e, p);
        atomic_store(&p->poller_done, true); /* the control thread may reclaim it */
    }
    for (uint32_t i = 0; i < p->nlanes; i++)
        if (p->lanes[i].txq_ready)
            publish_outcomes(e, &p->lanes[i].txq);
    return n;
}

/* Every write posted on p completed. */
static bool lanes_drained(const kvw_peer_t *p)
{
    for (uint32_t i = 0; i < p->nlanes; i++) {
        const kvw_lane_t *l = &p->lanes[i];
        if (l->txq_ready && kvw__txq_outstanding(&l->txq))
            return false;
    }
    return true;
}

static int run_once(kvw_engine_t *e, uint32_t budget, bool *more)
{
    int work = drain_ready(e);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || atomic_load(&p->poller_done))
            continue;
        bool closing = atomic_load(&p->closing);
        if (atomic_load(&p->state) == PEER_CONNECTED && !closing &&
            (p->rails.dead_lanes ||
             atomic_load_explicit(&p->rails.rejoin_poll, memory_order_relaxed))) {
            uint64_t before[3]; /* a rejoin's probe write counts as posted */
            lane_totals(p, before);
            kvw__rejoin_poll(e, p);
            publish_counters(e, p, before);
        }
        if (p->rails.asking_head) {
            kvw__rails_serve_answers(e, p);
            retire_inflight(p);
        }
        if (e->role == KVW_ROLE_PREFILL && atomic_load(&p->state) == PEER_CONNECTED && !closing)
            work += post_peer(e, p, budget, more);
        work += poll_peer(e, p);
        if (closing) /* every posted write completed: what landed was retired */
            kvw__peer_close_if_drained(p, !p->inflight_head && lanes_drained(p));
    }
    return work;
}

/* One pass by the poller thread: free reclaimed peers first (no peer
 * pointer is held between passes, by it or by a helping caller). 0 when a
 * caller's pass holds the lock: that pass does the work, and neither side
 * ever blocks on the other (no futex wait or wake on the hot path). */
static int poller_pass(kvw_engine_t *e)
{
    if (pthread_mutex_trylock(&e->pass_lock))
        return 0;
    kvw__peers_reap(e);
    bool more = false;
    int work = run_once(e, UNBOUNDED, &more);
    pthread_mutex_unlock(&e->pass_lock);
    return work;
}

/* Arm every CQ, look once more (a completion may have slipped in before the
 * arm), then block until a completion event or a wake-up. A caller's pass
 * may run while we sleep: the CQs stay armed, so what it leaves in flight
 * still wakes us when it completes. */
static void sleep_on_channel(kvw_engine_t *e)
{
    /* Only after a last look of our own: a caller's pass running now may
     * have polled before a completion whose event we would then miss. */
    if (pthread_mutex_trylock(&e->pass_lock)) {
        sched_yield();
        return;
    }
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        for (uint32_t j = 0; p && !atomic_load(&p->poller_done) && j < p->nlanes; j++)
            e->dev->ops->req_notify_cq(p->lanes[j].qp->cq, 0);
    }
    atomic_store(&e->poller_sleeping, true); /* from here on, new work wakes us */
    bool more = false;
    int work = run_once(e, UNBOUNDED, &more);
    pthread_mutex_unlock(&e->pass_lock);
    if (work > 0) {
        atomic_store(&e->poller_sleeping, false);
        return;
    }
    /* Every rail's completion channel, then the wake-up. */
    struct pollfd fds[KVW_MAX_RAILS + 1];
    uint32_t nr = e->nrails;
    for (uint32_t k = 0; k < nr; k++)
        fds[k] = (struct pollfd){e->rail[k].channel->fd, POLLIN, 0};
    fds[nr] = (struct pollfd){e->poller_wake_fd, POLLIN, 0};
    /* A part waiting on its producer's event: look again soon (no
     * completion or wake-up says when a CUDA event completes). */
    struct timespec idle = {IDLE_SLEEP_MS / 1000, (IDLE_SLEEP_MS % 1000) * 1000000L};
    struct timespec recheck = {0, KVW_EVENT_RECHECK_US * 1000L};
    atomic_fetch_add_explicit(&e->counters.sleeps, 1, memory_order_relaxed);
    int ready = ppoll(fds, nr + 1, atomic_load(&e->ev_waiting) ? &recheck : &idle, NULL);
    atomic_store(&e->poller_sleeping, false);
    if (ready <= 0)
        return;
    struct ibv_cq *cq;
    void *ctx;
    for (uint32_t k = 0; k < nr; k++)
        while (fds[k].revents && e->dev->ops->get_cq_event(e->rail[k].channel, &cq, &ctx) == 0)
            e->dev->ops->ack_cq_events(cq, 1);
    uint64_t v;
    if (fds[nr].revents && read(e->poller_wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        KVW_WARN("poller wake read failed: %s", strerror(errno));
}

/* Requests made that are neither Success nor Failed yet: the poller may
 * see their next write or completion any moment. */
static bool under_way(kvw_engine_t *e)
{
    const kvw_engine_counters_t *c = &e->counters;
    uint64_t ended = atomic_load_explicit(&c->ok, memory_order_relaxed) +
                     atomic_load_explicit(&c->failed, memory_order_relaxed);
    return atomic_load_explicit(&c->created, memory_order_relaxed) > ended;
}

void *kvw__poller_main(void *arg)
{
    kvw_engine_t *e = arg;
    kvw__log_set_engine(e->log_tag);
    uint64_t spin_ns = (uint64_t)e->cfg.poll_spin_us * 1000ull;
    uint64_t busy_ns = (uint64_t)e->cfg.poll_busy_us * 1000ull;
    uint64_t last_work = kvw__now_ns();
    while (!atomic_load(&e->poller_stop)) {
        if (poller_pass(e) > 0) {
            last_work = kvw__now_ns();
            continue;
        }
        /* Adaptive: a wake-up costs more than the wire (tens of us on real
         * hosts, milliseconds in an emulated guest), so keep polling a while
         * when work is under way, and sleep at once when there is none. */
        uint64_t spin = busy_ns > spin_ns && under_way(e) ? busy_ns : spin_ns;
        if (kvw__now_ns() - last_work < spin)
            continue;
        /* No spin after a wake-up unless its pass finds work: the event
         * may be for completions a caller's pass already reaped, and
         * spinning then only takes the CPU from that caller. */
        sleep_on_channel(e);
    }
    pthread_mutex_lock(&e->pass_lock);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p)
            continue;
        /* The engine is going: its QPs to ERR before its requests are let
         * go as drained. A live connection may still have writes queued,
         * and the control thread, in its last turn, tells decode of a
         * drained failed request that nothing more can land (seen: decode
         * Failed, then the queued writes landed in its pages). */
        kvw__peer_set_error(p);
        drop_queues(e, p);
    }
    pthread_mutex_unlock(&e->pass_lock);
    return NULL;
}

/* A caller's thread runs the pass itself when the poller sleeps: waking it
 * costs a system call and a thread wake-up (microseconds on a real host,
 * up to milliseconds on a busy or emulated one), and the caller is on the
 * request's critical path anyway. Never waits: when the pass is taken, its
 * holder sees the work, or the poller is woken. */
void kvw__poller_help(kvw_engine_t *e)
{
    bool wake_wanted = kvw__wake_deferred_end();
    if (atomic_load(&e->poller_sleeping) && !atomic_load(&e->stop) &&
        pthread_mutex_trylock(&e->pass_lock) == 0) {
        bool more = false;
        const char *caller_tag = kvw__log_set_engine(e->log_tag); /* the pass's lines */
        run_once(e, e->cfg.chain_max, &more);
        kvw__log_set_engine(caller_tag);
        pthread_mutex_unlock(&e->pass_lock);
        atomic_fetch_add_explicit(&e->counters.caller_passes, 1, memory_order_relaxed);
        if (more) /* the rest is the poller's */
            kvw__wake_poller(e);
        return;
    }
    if (wake_wanted)
        kvw__wake_poller(e);
}

kvw_poll_t kvw__req_poll(const kvw_req_t *r)
{
    kvw_poll_t state = (kvw_poll_t)atomic_load(&r->state);
    if (state != KVW_POLL_TRANSFERRING)
        return state;
    /* If the poller sleeps, do its pass here (decode: reap the immediate;
     * prefill: retire the writes): its wake-up would be on the request's
     * critical path. */
    kvw__poller_help(r->engine);
    return (kvw_poll_t)atomic_load(&r->state);
}

kvw_poll_t kvw__members_poll(kvw_req_t *const *m, uint32_t n)
{
    bool failed = false, ended = true;
    kvw_poll_t least = KVW_POLL_SUCCESS;
    for (uint32_t i = 0; i < n; i++) {
        kvw_poll_t s = kvw__req_poll(m[i]);
        if (s == KVW_POLL_FAILED)
            failed = true;
        else if (s != KVW_POLL_SUCCESS)
            ended = false;
        if (s != KVW_POLL_FAILED && s < least)
            least = s;
    }
    if (ended)
        return failed ? KVW_POLL_FAILED : KVW_POLL_SUCCESS;
    /* One failed and the others not ended yet: they are being failed, and
     * each ends once nothing more can land (the abort barrier). */
    return failed ? KVW_POLL_TRANSFERRING : least;
}

/* The seam (poller.h): the same functions the thread runs, nothing added. */
int kvw__poller_run_once(kvw_engine_t *e)
{
    bool more = false;
    return run_once(e, UNBOUNDED, &more);
}

int kvw__poller_post_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    bool more = false;
    return post_peer(e, p, UNBOUNDED, &more);
}

int kvw__poller_poll_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    return poll_peer(e, p);
}
