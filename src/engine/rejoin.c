/* SPDX-License-Identifier: Apache-2.0 */
/* A lane that failed comes back into its connection: see rejoin.h. */
#include "engine/rejoin.h"

#include "common/log.h"
#include "ctrl/zsock.h"
#include "engine/control.h"

#include <zmq.h>

enum {
    COOLDOWN_MIN_MS = 100,
    COOLDOWN_MAX_MS = 10000,
    READY_WAIT_MS = 2000, /* LANE_READY within this, or the try failed */
    /* A lane failing again this soon after it came back (a flapping link)
     * starts from its last cooldown, doubled, not from the first. */
    FLAP_MS = 10000,
    RESEND_MS = 10, /* LANE_READY could not be queued: try again then */
};

static uint32_t grown(uint32_t ms)
{
    return ms >= COOLDOWN_MAX_MS / 2 ? COOLDOWN_MAX_MS : ms * 2;
}

static const char *rail_name(const kvw_engine_t *e, const kvw_lane_t *l)
{
    return e->rails[l->rail]->name;
}

/* The lane leaves the connection (prefill: until its rejoin; decode: until
 * prefill asks for a reset). */
static void lane_out(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    p->lanes[lane].dead = true;
    p->dead_lanes |= 1u << lane;
    atomic_fetch_add(&e->rail_out[p->lanes[lane].rail], 1);
}

/* The lane is back: it carries writes again (prefill: takes its turns). */
static void lane_in(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    p->lanes[lane].dead = false;
    p->dead_lanes &= ~(1u << lane);
    atomic_fetch_sub(&e->rail_out[p->lanes[lane].rail], 1);
    atomic_fetch_add(&e->rail_rejoined[p->lanes[lane].rail], 1);
    atomic_fetch_add(&e->counters.lanes_rejoined, 1);
}

void kvw__rejoin_rebuild_turns(kvw_peer_t *p)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->nsched_all; i++)
        if (!p->lanes[p->sched_all[i]].dead)
            p->sched[n++] = p->sched_all[i];
    p->nsched = n;
    p->sched_pos = 0;
    p->next_lane = p->sched[0];
}

void kvw__rejoin_lane_failed(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    lane_out(e, p, lane);
    atomic_fetch_add(&e->rail_failed[l->rail], 1);
    atomic_fetch_add(&e->counters.lanes_failed, 1);
    if (e->role != KVW_ROLE_PREFILL)
        return;
    uint64_t now = kvw__now_ns();
    bool flapping = l->rejoined_ns && now - l->rejoined_ns < kvw__ms_ns(FLAP_MS);
    l->cooldown_ms = flapping && l->cooldown_ms ? grown(l->cooldown_ms) : COOLDOWN_MIN_MS;
    l->failed_ns = now;
    l->reaped_upto = l->txq.completed;
    atomic_store(&l->rejoin, LANE_DRAINING);
}

/* ---- prefill, poller ---------------------------------------------------- */

/* Paused again after a try that failed (poller side), for longer. */
static void probe_failed_poller(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const char *why)
{
    kvw_lane_t *l = &p->lanes[lane];
    atomic_fetch_add(&e->counters.lane_probes_failed, 1);
    l->cooldown_ms = grown(l->cooldown_ms);
    KVW_WARN("connection %u: lane %u on %s: %s: paused again, next probe in %u ms", p->index, lane,
             rail_name(e, l), why, l->cooldown_ms);
    atomic_store(&l->rejoin, LANE_DRAINING);
}

void kvw__rejoin_reaped(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t wr_id, bool ok)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (e->role != KVW_ROLE_PREFILL) {
        l->rq_flushed += !ok; /* decode posts receives only: each error is one gone */
        return;
    }
    /* A late success counts too: a write whose ACK came after the lane
     * failed (its QP moved to ERR from outside) completes successfully. */
    if (wr_id + 1 > l->reaped_upto)
        l->reaped_upto = wr_id + 1;
    if (!ok && atomic_load(&l->rejoin) == LANE_PROBE_SENT)
        probe_failed_poller(e, p, lane, "the probe write failed");
}

/* Every WR posted on the lane before it failed has completed (flushed or
 * not): RC completes in order and the last WR of every chain is signaled,
 * so the last one's completion comes last. A reset before that would let
 * a completion of the QP's old life be taken for one of its new life. */
static bool drained(const kvw_lane_t *l)
{
    return l->reaped_upto >= l->txq.posted;
}

/* One zero-length write on the lane, connected again: its landing proves
 * the path both ways (the write out, the ACK back). It belongs to no
 * request. */
static void post_probe(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    const kvw_plan_region_t *g = &l->regions[0];
    kvw__txq_rearm(&l->txq);
    kvw_write_t w = {.local_addr = g->local_addr,
                     .remote_addr = g->remote_addr,
                     .lkey = g->lkey,
                     .rkey = g->rkey,
                     .len = 0};
    l->probe_seq = kvw__txq_add(&l->txq, &w, 0, 0);
    atomic_store(&l->rejoin, LANE_PROBE_SENT);
    if (kvw__txq_flush(&l->txq)) {
        kvw__txq_fail_at(&l->txq, l->probe_seq);
        l->reaped_upto = l->txq.posted;
        probe_failed_poller(e, p, lane, "posting the probe write failed");
    }
}

static void lane_back(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    uint64_t now = kvw__now_ns(), us = (now - l->failed_ns) / 1000;
    lane_in(e, p, lane);
    l->rejoined_ns = now;
    atomic_store(&l->down_due, false); /* that port-down was dealt with */
    kvw__rejoin_rebuild_turns(p);
    atomic_store(&e->rail_recovery_us[l->rail], us);
    uint64_t max = atomic_load(&e->rail_recovery_max_us[l->rail]);
    while (us > max && !atomic_compare_exchange_weak(&e->rail_recovery_max_us[l->rail], &max, us))
        ;
    atomic_store(&l->rejoin, LANE_LIVE);
    KVW_WARN("connection %u: lane %u on %s is back, %llu ms after it failed: it carries writes "
             "again",
             p->index, lane, rail_name(e, l), (unsigned long long)(us / 1000));
}

static void prefill_step(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    switch (atomic_load(&l->rejoin)) {
    case LANE_DRAINING:
        if (!drained(l))
            return;
        atomic_store(&l->imm_base, l->imm_posted);
        l->probe_at_ns = kvw__now_ns() + kvw__ms_ns(l->cooldown_ms);
        atomic_store(&l->rejoin, LANE_PAUSED);
        atomic_fetch_or(&p->rejoin_ctl, 1u << lane);
        kvw__wake(e->control_wake_fd);
        return;
    case LANE_PROBING:
        post_probe(e, p, lane);
        return;
    case LANE_PROBE_SENT:
        if (l->txq.completed > l->probe_seq)
            lane_back(e, p, lane);
        return;
    default:
        return;
    }
}

/* ---- decode, poller -------------------------------------------------------- */

/* Prefill asked for the lane's reset: to ERR, so that every receive
 * flushes; once all of them were reaped, the control thread takes over.
 * Then, once it connected the lane again, the lane is back. True once
 * the poller has nothing more to do for it. */
static bool decode_step(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    int st = atomic_load(&l->rejoin);
    if (st == LANE_BACK_DUE) {
        if (l->dead)
            lane_in(e, p, lane);
        KVW_WARN("connection %u: lane %u on %s reset at prefill's request: back in the connection",
                 p->index, lane, rail_name(e, l));
        atomic_compare_exchange_strong(&l->rejoin, &st, LANE_LIVE);
        return true;
    }
    if (st != LANE_RESET_DUE)
        return true;
    if (!l->dead)
        lane_out(e, p, lane);
    if (!l->err_set) {
        kvw__qp_set_error(l->qp);
        l->err_set = true;
    }
    if (l->rq_flushed < e->cfg.rq_depth)
        return false;
    if (atomic_compare_exchange_strong(&l->rejoin, &st, LANE_READY_DUE)) {
        atomic_fetch_or(&p->rejoin_ctl, 1u << lane);
        kvw__wake(e->control_wake_fd);
    }
    return true;
}

void kvw__rejoin_poll(kvw_engine_t *e, kvw_peer_t *p)
{
    if (e->role == KVW_ROLE_PREFILL) {
        for (uint32_t dead = p->dead_lanes; dead; dead &= dead - 1)
            prefill_step(e, p, (uint32_t)__builtin_ctz(dead));
        return;
    }
    for (uint32_t due = atomic_load(&p->rejoin_poll); due; due &= due - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(due);
        /* Cleared before the step, so that the control thread's next
         * hand-over (it sets the bit after the state) is never lost. */
        atomic_fetch_and(&p->rejoin_poll, ~(1u << lane));
        if (!decode_step(e, p, lane))
            atomic_fetch_or(&p->rejoin_poll, 1u << lane);
    }
}

void kvw__rejoin_peer_gone(kvw_engine_t *e, kvw_peer_t *p)
{
    for (uint32_t dead = p->dead_lanes; dead; dead &= dead - 1)
        atomic_fetch_sub(&e->rail_out[p->lanes[__builtin_ctz(dead)].rail], 1);
}

/* ---- prefill, control thread --------------------------------------------- */

/* Paused again after a try that failed (control side), for longer. */
static uint64_t probe_failed_ctl(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now,
                                 const char *why)
{
    kvw_lane_t *l = &p->lanes[lane];
    atomic_fetch_add(&e->counters.lane_probes_failed, 1);
    l->cooldown_ms = grown(l->cooldown_ms);
    l->probe_at_ns = now + kvw__ms_ns(l->cooldown_ms);
    KVW_INFO("connection %u: lane %u on %s: %s: next probe in %u ms", p->index, lane,
             rail_name(e, l), why, l->cooldown_ms);
    atomic_store(&l->rejoin, LANE_PAUSED);
    return l->probe_at_ns;
}

/* A paused lane's probe, when due: its port up, its QP reset and decode
 * asked to reset its end. Returns when the lane next needs us. */
static uint64_t probe_lane(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (now < l->probe_at_ns)
        return l->probe_at_ns;
    const kvw_dev_t *dev = e->rails[l->rail];
    struct ibv_port_attr pa;
    atomic_fetch_add(&e->counters.lane_probes, 1);
    atomic_fetch_add(&e->rail_probes[l->rail], 1);
    if (dev->ops->query_port(dev->ctx, dev->port, &pa) || pa.state != IBV_PORT_ACTIVE)
        return probe_failed_ctl(e, p, lane, now, "its port is not up");
    if (kvw__qp_reset(l->qp))
        return probe_failed_ctl(e, p, lane, now, "resetting its QP failed");
    kvw_msg_t m = {.type = KVW_MSG_LANE_RESET};
    m.u.lane.qp = lane;
    m.u.lane.psn = l->qp->psn;
    m.u.lane.count = atomic_load(&l->imm_base);
    l->reset_deadline_ns = now + kvw__ms_ns(READY_WAIT_MS);
    atomic_store(&l->rejoin, LANE_RESETTING);
    kvw__ctl_route(e, p->id, sizeof(p->id), &m);
    return l->reset_deadline_ns;
}

static uint64_t prefill_tick(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    switch (atomic_load(&l->rejoin)) {
    case LANE_PAUSED:
        return probe_lane(e, p, lane, now);
    case LANE_RESETTING:
        if (now <= l->reset_deadline_ns)
            return l->reset_deadline_ns;
        return probe_failed_ctl(e, p, lane, now, "no LANE_READY from decode");
    default: /* the poller's now */
        return 0;
    }
}

void kvw__rejoin_on_ready(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    uint32_t lane = m->u.lane.qp;
    kvw_lane_t *l = &p->lanes[lane < p->nlanes ? lane : 0];
    if (lane >= p->nlanes || atomic_load(&l->rejoin) != LANE_RESETTING ||
        m->u.lane.peer_psn != l->qp->psn) {
        kvw__ctl_dropped(e, "LANE_READY for lane %u of peer %u, which is not resetting", lane,
                         p->index);
        return;
    }
    kvw_qp_info_t r = l->remote;
    r.psn = m->u.lane.psn;
    if (kvw__qp_connect(l->qp, &r, &e->cfg)) {
        probe_failed_ctl(e, p, lane, kvw__now_ns(), "connecting its QP again failed");
        return;
    }
    l->remote = r;
    /* Credits from the common count: a CREDIT of the lane's old life is
     * never above it. */
    _Atomic uint64_t *limit = &l->imm_limit;
    uint64_t cur = atomic_load(limit);
    while (m->u.lane.count > cur && !atomic_compare_exchange_weak(limit, &cur, m->u.lane.count))
        ;
    atomic_fetch_and(&p->rejoin_ctl, ~(1u << lane)); /* before: the poller may pause it again */
    atomic_store(&l->rejoin, LANE_PROBING);
    kvw__wake(e->poller_wake_fd);
}

/* ---- decode, control thread ---------------------------------------------- */

void kvw__rejoin_on_reset(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    uint32_t lane = m->u.lane.qp;
    if (lane >= p->nlanes || !p->lanes[lane].remote.qpn ||
        m->u.lane.count > UINT64_MAX - e->cfg.rq_depth) {
        kvw__ctl_dropped(e, "LANE_RESET for lane %u of peer %u, which it does not use", lane,
                         p->index);
        return;
    }
    kvw_lane_t *l = &p->lanes[lane];
    pthread_mutex_lock(&e->lock);
    l->peer_psn = m->u.lane.psn;
    l->peer_base = m->u.lane.count;
    pthread_mutex_unlock(&e->lock);
    atomic_store(&l->rejoin, LANE_RESET_DUE);
    atomic_fetch_or(&p->rejoin_poll, 1u << lane);
    kvw__wake(e->poller_wake_fd);
}

/* The lane drained: reset, connected to prefill's new PSN, fresh
 * receives on top of prefill's count, then LANE_READY. */
static kvw_status_t reconnect(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    pthread_mutex_lock(&e->lock);
    kvw_qp_info_t r = l->remote;
    r.psn = l->peer_psn;
    uint64_t base = l->peer_base;
    pthread_mutex_unlock(&e->lock);
    kvw_status_t st = kvw__qp_reset(l->qp);
    if (!st)
        st = kvw__qp_connect(l->qp, &r, &e->cfg);
    atomic_store(&l->recvs_posted, base);
    /* Receives are posted last: after a failure none (or the few a failed
     * post took, which flush) waits, so the next reset need not wait. */
    l->rq_flushed = st ? e->cfg.rq_depth : 0;
    if (!st && (st = kvw__lane_post_recvs(l, e->cfg.rq_depth)) != KVW_OK)
        l->rq_flushed = e->cfg.rq_depth;
    l->err_set = false;
    if (st) {
        kvw__qp_set_error(l->qp);
        l->err_set = true;
        return st;
    }
    atomic_store(&l->credits_sent, atomic_load(&l->recvs_posted));
    l->remote = r;
    return KVW_OK;
}

static uint64_t decode_tick(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (atomic_load(&l->rejoin) != LANE_READY_DUE)
        return 0;
    if (!l->rq_flushed) { /* reconnected before: only LANE_READY is left to send */
    } else if (reconnect(e, p, lane)) {
        /* It stays out; prefill's try times out and it probes again later. */
        KVW_WARN("connection %u: lane %u on %s: the reset prefill asked for failed: it stays out",
                 p->index, lane, rail_name(e, l));
        int due = LANE_READY_DUE;
        atomic_compare_exchange_strong(&l->rejoin, &due, LANE_LIVE);
        return 0;
    }
    kvw_msg_t m = {.type = KVW_MSG_LANE_READY};
    m.u.lane.qp = lane;
    m.u.lane.psn = l->qp->psn;
    m.u.lane.peer_psn = l->remote.psn;
    m.u.lane.count = atomic_load(&l->recvs_posted);
    if (kvw__zsend(p->sock, &m, ZMQ_DONTWAIT) != KVW_OK)
        return now + kvw__ms_ns(RESEND_MS);
    int due = LANE_READY_DUE;
    if (atomic_compare_exchange_strong(&l->rejoin, &due, LANE_BACK_DUE)) {
        atomic_fetch_or(&p->rejoin_poll, 1u << lane);
        kvw__wake(e->poller_wake_fd);
    }
    return 0;
}

uint64_t kvw__rejoin_tick(kvw_engine_t *e, kvw_peer_t *p, uint64_t now)
{
    uint64_t next = 0;
    for (uint32_t due = atomic_load(&p->rejoin_ctl); due; due &= due - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(due);
        /* Cleared before the look, set again while the lane still needs
         * us: the poller's next hand-over is never lost. */
        atomic_fetch_and(&p->rejoin_ctl, ~(1u << lane));
        uint64_t t = e->role == KVW_ROLE_PREFILL ? prefill_tick(e, p, lane, now)
                                                 : decode_tick(e, p, lane, now);
        if (t) {
            atomic_fetch_or(&p->rejoin_ctl, 1u << lane);
            next = kvw__earliest(next, t);
        }
    }
    return next;
}
