/* SPDX-License-Identifier: Apache-2.0 */
/* A lane that failed comes back into its connection, the poller's half
 * (see rails.h; the control thread's half is ctl_rejoin.c). */
#include "engine/rails/rails.h"

#include "common/log.h"

enum {
    /* A lane failing again this soon after it came back (a flapping link)
     * starts from its last cooldown, doubled, not from the first. */
    FLAP_MS = 10000,
};

/* The lane leaves the connection (prefill: until its rejoin; decode: until
 * prefill asks for a reset). */
static void lane_out(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    p->lanes[lane].health.dead = true;
    p->rails.dead_lanes |= 1u << lane;
    atomic_fetch_add(&e->rail[p->lanes[lane].rail].out, 1);
}

/* The lane is back: it carries writes again (prefill: takes its turns). */
static void lane_in(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    p->lanes[lane].health.dead = false;
    p->lanes[lane].health.life++; /* nothing a request noted of the old life reads as this one's */
    p->rails.dead_lanes &= ~(1u << lane);
    atomic_fetch_sub(&e->rail[p->lanes[lane].rail].out, 1);
    atomic_fetch_add(&e->rail[p->lanes[lane].rail].rejoined, 1);
    atomic_fetch_add(&e->counters.lanes_rejoined, 1);
}

void kvw__rejoin_rebuild_turns(kvw_peer_t *p)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->rails.nsched_all; i++)
        if (!p->lanes[p->rails.sched_all[i]].health.dead)
            p->rails.sched[n++] = p->rails.sched_all[i];
    p->rails.nsched = n;
    p->rails.sched_pos = 0;
    p->rails.next_lane = p->rails.sched[0];
}

void kvw__rejoin_lane_failed(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    lane_out(e, p, lane);
    atomic_fetch_add(&e->rail[l->rail].failed, 1);
    atomic_fetch_add(&e->counters.lanes_failed, 1);
    if (e->role != KVW_ROLE_PREFILL)
        return;
    uint64_t now = kvw__now_ns();
    bool flapping = l->health.rejoined_ns && now - l->health.rejoined_ns < kvw__ms_ns(FLAP_MS);
    l->health.cooldown_ms = flapping && l->health.cooldown_ms
                                ? kvw__rejoin_grown(l->health.cooldown_ms)
                                : KVW_REJOIN_COOLDOWN_MIN_MS;
    l->health.failed_ns = now;
    l->health.reaped_upto = l->txq.completed;
    atomic_store(&l->health.rejoin, LANE_DRAINING);
}

/* ---- prefill, poller ---------------------------------------------------- */

/* Paused again after a try that failed (poller side), for longer. */
static void probe_failed_poller(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const char *why)
{
    kvw_lane_t *l = &p->lanes[lane];
    atomic_fetch_add(&e->counters.lane_probes_failed, 1);
    l->health.cooldown_ms = kvw__rejoin_cooldown_after_failure(l);
    KVW_WARN("connection %u: lane %u on %s: %s: paused again, next probe in %u ms", p->index, lane,
             kvw__rail_name(e, l), why, l->health.cooldown_ms);
    atomic_store(&l->health.rejoin, LANE_DRAINING);
}

void kvw__rejoin_reaped(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t wr_id, bool ok)
{
    kvw_lane_t *l = &p->lanes[lane];
    if (e->role != KVW_ROLE_PREFILL) {
        atomic_fetch_add(&l->health.rq_flushed,
                         !ok); /* decode posts receives only: each error is one gone */
        return;
    }
    /* A late success counts too: a write whose ACK came after the lane
     * failed (its QP moved to ERR from outside) completes successfully. */
    if (wr_id + 1 > l->health.reaped_upto)
        l->health.reaped_upto = wr_id + 1;
    if (!ok && atomic_load(&l->health.rejoin) == LANE_PROBE_SENT)
        probe_failed_poller(e, p, lane, "the probe write failed");
}

/* Every WR posted on the lane before it failed has completed (flushed or
 * not): RC completes in order and the last WR of every chain is signaled,
 * so the last one's completion comes last. A reset before that would let
 * a completion of the QP's old life be taken for one of its new life. */
static bool drained(const kvw_lane_t *l)
{
    return l->health.reaped_upto >= l->txq.posted;
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
    l->health.probe_seq = kvw__txq_add(&l->txq, &w, 0, 0);
    atomic_store(&l->health.rejoin, LANE_PROBE_SENT);
    if (kvw__txq_flush(&l->txq)) {
        kvw__txq_fail_at(&l->txq, l->health.probe_seq);
        l->health.reaped_upto = l->txq.posted;
        probe_failed_poller(e, p, lane, "posting the probe write failed");
    }
}

static void lane_back(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    uint64_t now = kvw__now_ns(), us = (now - l->health.failed_ns) / 1000;
    lane_in(e, p, lane);
    l->health.rejoined_ns = now;
    l->health.probe_early = false;
    atomic_store(&l->health.down_due, false); /* that port-down was dealt with */
    kvw__rejoin_rebuild_turns(p);
    atomic_store(&e->rail[l->rail].recovery_us, us);
    uint64_t max = atomic_load(&e->rail[l->rail].recovery_max_us);
    while (us > max && !atomic_compare_exchange_weak(&e->rail[l->rail].recovery_max_us, &max, us))
        ;
    atomic_store(&l->health.rejoin, LANE_LIVE);
    KVW_WARN("connection %u: lane %u on %s is back, %llu ms after it failed: it carries writes "
             "again",
             p->index, lane, kvw__rail_name(e, l), (unsigned long long)(us / 1000));
}

static void prefill_step(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane)
{
    kvw_lane_t *l = &p->lanes[lane];
    switch (atomic_load(&l->health.rejoin)) {
    case LANE_DRAINING:
        if (!drained(l))
            return;
        atomic_store(&l->health.imm_base, l->imm_posted);
        l->health.probe_at_ns = kvw__now_ns() + kvw__ms_ns(l->health.cooldown_ms);
        atomic_store(&l->health.rejoin, LANE_PAUSED);
        atomic_fetch_or(&p->rails.rejoin_ctl, 1u << lane);
        kvw__wake(e->control_wake_fd);
        return;
    case LANE_PROBING:
        post_probe(e, p, lane);
        return;
    case LANE_PROBE_SENT:
        if (l->txq.completed > l->health.probe_seq)
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
    int st = atomic_load(&l->health.rejoin);
    if (st == LANE_BACK_DUE) {
        if (l->health.dead)
            lane_in(e, p, lane);
        KVW_WARN("connection %u: lane %u on %s reset at prefill's request: back in the connection",
                 p->index, lane, kvw__rail_name(e, l));
        atomic_compare_exchange_strong(&l->health.rejoin, &st, LANE_LIVE);
        return true;
    }
    if (st != LANE_RESET_DUE)
        return true;
    if (!l->health.dead)
        lane_out(e, p, lane);
    if (!l->health.err_set) {
        kvw__qp_set_error(l->qp);
        l->health.err_set = true;
    }
    if (atomic_load(&l->health.rq_flushed) < e->cfg.rq_depth)
        return false;
    if (atomic_compare_exchange_strong(&l->health.rejoin, &st, LANE_READY_DUE)) {
        atomic_fetch_or(&p->rails.rejoin_ctl, 1u << lane);
        kvw__wake(e->control_wake_fd);
    }
    return true;
}

void kvw__rejoin_poll(kvw_engine_t *e, kvw_peer_t *p)
{
    if (e->role == KVW_ROLE_PREFILL) {
        for (uint32_t dead = p->rails.dead_lanes; dead; dead &= dead - 1)
            prefill_step(e, p, (uint32_t)__builtin_ctz(dead));
        return;
    }
    for (uint32_t due = atomic_load(&p->rails.rejoin_poll); due; due &= due - 1) {
        uint32_t lane = (uint32_t)__builtin_ctz(due);
        /* Cleared before the step, so that the control thread's next
         * hand-over (it sets the bit after the state) is never lost. */
        atomic_fetch_and(&p->rails.rejoin_poll, ~(1u << lane));
        if (!decode_step(e, p, lane))
            atomic_fetch_or(&p->rails.rejoin_poll, 1u << lane);
    }
}

void kvw__rejoin_peer_gone(kvw_engine_t *e, kvw_peer_t *p)
{
    for (uint32_t dead = p->rails.dead_lanes; dead; dead &= dead - 1)
        atomic_fetch_sub(&e->rail[p->lanes[__builtin_ctz(dead)].rail].out, 1);
}
