/* SPDX-License-Identifier: Apache-2.0 */
/* A lane that failed comes back into its connection, the control thread's
 * half: probes, resets and the LANE_RESET / LANE_READY exchange (see
 * rails.h; the poller's half is rejoin.c). */
#include "engine/rails/rails.h"

#include "common/log.h"
#include "ctrl/zsock.h"
#include "engine/control.h"

#include <zmq.h>

enum {
    READY_WAIT_MS = 2000, /* LANE_READY within this, or the try failed */
    RESEND_MS = 10,       /* LANE_READY could not be queued: try again then */
};

/* ---- prefill, control thread --------------------------------------------- */

/* Paused again after a try that failed (control side), for longer. */
static uint64_t probe_failed_ctl(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now,
                                 const char *why)
{
    kvw_lane_t *l = &p->lanes[lane];
    atomic_fetch_add(&e->counters.lane_probes_failed, 1);
    l->health.cooldown_ms = kvw__rejoin_cooldown_after_failure(l);
    l->health.probe_at_ns = now + kvw__ms_ns(l->health.cooldown_ms);
    KVW_INFO("connection %u: lane %u on %s: %s: next probe in %u ms", p->index, lane,
             kvw__rail_name(e, l), why, l->health.cooldown_ms);
    atomic_store(&l->health.rejoin, LANE_PAUSED);
    return l->health.probe_at_ns;
}

/* A paused lane's probe, when due: its port up, its QP reset and decode
 * asked to reset its end. Returns when the lane next needs us. */
static uint64_t probe_lane(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (now < l->health.probe_at_ns)
        return l->health.probe_at_ns;
    atomic_fetch_add(&e->counters.lane_probes, 1);
    atomic_fetch_add(&e->rail[l->rail].probes, 1);
    if (!kvw__dev_port_active(e->rail[l->rail].dev))
        return probe_failed_ctl(e, p, lane, now, "its port is not up");
    if (kvw__qp_reset(l->qp))
        return probe_failed_ctl(e, p, lane, now, "resetting its QP failed");
    kvw_msg_t m = {.type = KVW_MSG_LANE_RESET};
    m.u.lane.qp = lane;
    m.u.lane.psn = l->qp->psn;
    m.u.lane.count = atomic_load(&l->health.imm_base);
    l->health.reset_deadline_ns = now + kvw__ms_ns(READY_WAIT_MS);
    atomic_store(&l->health.rejoin, LANE_RESETTING);
    kvw__ctl_route(e, p->id, sizeof(p->id), &m);
    return l->health.reset_deadline_ns;
}

static uint64_t prefill_tick(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    switch (atomic_load(&l->health.rejoin)) {
    case LANE_PAUSED:
        return probe_lane(e, p, lane, now);
    case LANE_RESETTING:
        if (now <= l->health.reset_deadline_ns)
            return l->health.reset_deadline_ns;
        return probe_failed_ctl(e, p, lane, now, "no LANE_READY from decode");
    default: /* the poller's now */
        return 0;
    }
}

void kvw__rejoin_on_ready(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    uint32_t lane = m->u.lane.qp;
    kvw_lane_t *l = &p->lanes[lane < p->nlanes ? lane : 0];
    if (lane >= p->nlanes || atomic_load(&l->health.rejoin) != LANE_RESETTING ||
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
    atomic_fetch_and(&p->rails.rejoin_ctl,
                     ~(1u << lane)); /* before: the poller may pause it again */
    atomic_store(&l->health.rejoin, LANE_PROBING);
    kvw__wake(e->poller_wake_fd);
}

/* Does p have the lane decode's message names? If not, it is dropped
 * (counted, logged). */
static bool has_lane(kvw_engine_t *e, const kvw_peer_t *p, const kvw_msg_t *m)
{
    if (m->u.lane.qp < p->nlanes)
        return true;
    kvw__ctl_dropped(e, "%s for lane %u of peer %u, which it does not have",
                     kvw__wire_type_name(m->type), m->u.lane.qp, p->index);
    return false;
}

void kvw__rejoin_on_down(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    if (!has_lane(e, p, m))
        return;
    uint32_t lane = m->u.lane.qp;
    kvw_lane_t *l = &p->lanes[lane];
    /* Of this life of the lane (or of this reset try): decode echoes the
     * PSN it connected to, or was asked to connect to. A late one, of a
     * life that ended or a try given up, would knock out a lane that came
     * back, or abort the try that is bringing it back. */
    if (m->u.lane.peer_psn != l->qp->psn) {
        kvw__ctl_dropped(e, "LANE_DOWN for lane %u of peer %u of an earlier life (PSN %u, now %u)",
                         lane, p->index, m->u.lane.peer_psn, l->qp->psn);
        return;
    }
    switch (atomic_load(&l->health.rejoin)) {
    case LANE_RESETTING: /* decode could not connect its end: no LANE_READY will come */
        probe_failed_ctl(e, p, lane, kvw__now_ns(), "decode could not connect its end");
        return;
    case LANE_LIVE:
        /* Its writes flush now rather than run out of retries; the poller
         * fails the lane over (or is doing so already: it ignores a lane
         * that is out). */
        KVW_WARN("connection %u: decode says its end of lane %u is down", p->index, lane);
        kvw__qp_set_error(l->qp);
        kvw__lane_mark_down(p, lane, KVW_DOWN_PEER);
        kvw__wake(e->poller_wake_fd);
        return;
    default: /* out already: its next probe finds out */
        return;
    }
}

/* A paused lane is probed now: its cooldown was sized for a port that
 * might stay down, and the port just came up. A lane in any other state
 * is on its way already (or live). */
static void probe_now(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const char *why)
{
    kvw_lane_t *l = &p->lanes[lane];
    uint64_t now = kvw__now_ns();
    if (atomic_load(&l->health.rejoin) != LANE_PAUSED || l->health.probe_at_ns <= now)
        return;
    KVW_INFO("connection %u: lane %u on %s: %s: probing it now, %llu ms before its cooldown ends",
             p->index, lane, kvw__rail_name(e, l), why,
             (unsigned long long)((l->health.probe_at_ns - now) / 1000000));
    l->health.probe_at_ns = now;
    l->health.probe_early = true;
    atomic_fetch_or(&p->rails.rejoin_ctl, 1u << lane);
    atomic_fetch_add(&e->counters.lane_probes_early, 1);
}

void kvw__rejoin_on_up(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    if (has_lane(e, p, m))
        probe_now(e, p, m->u.lane.qp, "decode's port came up");
}

/* ---- decode, control thread ---------------------------------------------- */

/* LANE_DOWN and LANE_UP name the lane's life by prefill's PSN on it, the
 * one decode last heard (HELLO_ACK, or the latest LANE_RESET). */
static void say_lane(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, kvw_msg_type_t type)
{
    if (!p->sock || atomic_load(&p->state) != PEER_CONNECTED)
        return;
    kvw_msg_t m = {.type = type};
    m.u.lane.qp = lane;
    pthread_mutex_lock(&e->lock);
    m.u.lane.peer_psn = p->lanes[lane].health.peer_psn;
    pthread_mutex_unlock(&e->lock);
    kvw__zsend(p->sock, &m, ZMQ_DONTWAIT);
}

void kvw__rejoin_say_down(kvw_peer_t *p, uint32_t lane)
{
    say_lane(p->engine, p, lane, KVW_MSG_LANE_DOWN);
}

/* ---- both, control thread ------------------------------------------------ */

void kvw__rejoin_rail_up(kvw_engine_t *e, const kvw_dev_t *dev)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        for (uint32_t j = 0; p && atomic_load(&p->state) == PEER_CONNECTED && j < p->nlanes; j++) {
            if (e->rail[p->lanes[j].rail].dev != dev)
                continue;
            if (e->role == KVW_ROLE_PREFILL)
                probe_now(e, p, j, "its port came up");
            else /* every lane on the rail: prefill knows which of them are out */
                say_lane(e, p, j, KVW_MSG_LANE_UP);
        }
    }
}

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
    l->health.peer_psn = m->u.lane.psn;
    l->health.peer_base = m->u.lane.count;
    pthread_mutex_unlock(&e->lock);
    atomic_store(&l->health.rejoin, LANE_RESET_DUE);
    atomic_fetch_or(&p->rails.rejoin_poll, 1u << lane);
    kvw__wake(e->poller_wake_fd);
}

/* The lane drained: reset, connected to prefill's new PSN, fresh
 * receives on top of prefill's count, then LANE_READY. */
static kvw_status_t reconnect(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    pthread_mutex_lock(&e->lock);
    kvw_qp_info_t r = l->remote;
    r.psn = l->health.peer_psn;
    uint64_t base = l->health.peer_base;
    pthread_mutex_unlock(&e->lock);
    kvw_status_t st = kvw__qp_reset(l->qp);
    if (!st)
        st = kvw__qp_connect(l->qp, &r, &e->cfg);
    atomic_store(&l->recvs_posted, base);
    /* Receives are posted last. rq_flushed counts towards rq_depth, which
     * the next reset waits for: after a failure nothing waits but the
     * receives a failed post accepted before its bad one, which flush
     * (counted by the poller) once the QP is in ERR, in this life. */
    atomic_store(&l->health.rq_flushed, st ? e->cfg.rq_depth : 0);
    uint32_t accepted = 0;
    if (!st && (st = kvw__lane_post_recvs(l, e->cfg.rq_depth, &accepted)) != KVW_OK)
        atomic_store(&l->health.rq_flushed, e->cfg.rq_depth - accepted);
    l->health.err_set = false;
    if (st) {
        kvw__qp_set_error(l->qp);
        l->health.err_set = true;
        return st;
    }
    atomic_store(&l->credits_sent, atomic_load(&l->recvs_posted));
    l->remote = r;
    return KVW_OK;
}

static uint64_t decode_tick(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t now)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (atomic_load(&l->health.rejoin) != LANE_READY_DUE)
        return 0;
    if (!atomic_load(
            &l->health.rq_flushed)) { /* reconnected before: only LANE_READY is left to send */
    } else if (reconnect(e, p, lane)) {
        /* It stays out; prefill's try times out and it probes again later. */
        KVW_WARN("connection %u: lane %u on %s: the reset prefill asked for failed: it stays out",
                 p->index, lane, kvw__rail_name(e, l));
        int due = LANE_READY_DUE;
        atomic_compare_exchange_strong(&l->health.rejoin, &due, LANE_LIVE);
        kvw__rejoin_say_down(p, lane); /* prefill tries again later, without waiting */
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
    if (atomic_compare_exchange_strong(&l->health.rejoin, &due, LANE_BACK_DUE)) {
        atomic_fetch_or(&p->rails.rejoin_poll, 1u << lane);
        kvw__wake(e->poller_wake_fd);
    }
    return 0;
}

uint64_t kvw__rejoin_tick(kvw_engine_t *e, kvw_peer_t *p, uint64_t now)
{
    uint64_t next = 0;
    for (uint32_t due = atomic_load(&p->rails.rejoin_ctl); due; due &= due - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(due);
        /* Cleared before the look, set again while the lane still needs
         * us: the poller's next hand-over is never lost. */
        atomic_fetch_and(&p->rails.rejoin_ctl, ~(1u << lane));
        uint64_t t = e->role == KVW_ROLE_PREFILL ? prefill_tick(e, p, lane, now)
                                                 : decode_tick(e, p, lane, now);
        if (t) {
            atomic_fetch_or(&p->rails.rejoin_ctl, 1u << lane);
            next = kvw__earliest(next, t);
        }
    }
    return next;
}
