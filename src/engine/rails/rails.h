/* SPDX-License-Identifier: Apache-2.0 */
/* Rails (docs/rails.md): a connection's lanes over several devices, and
 * what happens when one fails. The interface the poller and the control
 * thread call (an error completion, a pass over a peer, a tick, a
 * message); the state is the rails' own (state.h: a lane's health, a
 * connection's turn of lanes, an engine rail's counters). Files:
 * failover.c (the poller's failover, replay and hold for decode's
 * answer), rejoin.c and ctl_rejoin.c (a failed lane's way back, each
 * thread's half), ask.c (REPLAY_ASK / REPLAY_ANSWER on the control
 * thread).
 *
 * A lane that failed comes back into its connection:
 *
 * Prefill owns the rejoin. A failed lane (failover.c) is first
 * drained: the poller waits until its last posted WR's completion was
 * reaped, so no completion of the QP's old life can arrive after the
 * reset. Then it is paused, and the control thread probes its rail's port
 * after a cooldown that grows (100 ms, doubling to 10 s) each time the
 * port is still down or the lane does not work. Once the port is up, the
 * QP is reset under a new PSN and LANE_RESET asks decode to do the same;
 * decode's poller waits for its receives to flush, resets and reconnects
 * its end, posts fresh receives and has LANE_READY sent. Prefill connects
 * its end again and the poller sends one zero-length write: only when it
 * lands (the path works both ways) does the lane take its turns again.
 * Any step failing puts the lane back to paused, with a longer cooldown.
 *
 * Immediate credits restart from a common count: LANE_RESET carries the
 * immediates prefill posted on the lane in all, and decode's fresh
 * receives are counted on top of it, so a CREDIT of the lane's old life is
 * never above the new count and changes nothing. */
#ifndef KVW_ENGINE_RAILS_RAILS_H
#define KVW_ENGINE_RAILS_RAILS_H

#include "engine/core.h"

enum {
    KVW_REJOIN_COOLDOWN_MIN_MS = 100,
    KVW_REJOIN_COOLDOWN_MAX_MS = 10000,
};

/* The next cooldown after a try that failed: doubled, up to the most. */
static inline uint32_t kvw__rejoin_grown(uint32_t ms)
{
    return ms >= KVW_REJOIN_COOLDOWN_MAX_MS / 2 ? KVW_REJOIN_COOLDOWN_MAX_MS : ms * 2;
}

/* The cooldown after the lane's current try failed: grown, unless a port
 * event had brought the try forward (the port came up, yet the lane does
 * not work yet): that failure says nothing the cooldown did not already
 * account for, so the schedule goes on as it was. */
static inline uint32_t kvw__rejoin_cooldown_after_failure(kvw_lane_t *l)
{
    if (l->health.probe_early) {
        l->health.probe_early = false;
        return l->health.cooldown_ms;
    }
    return kvw__rejoin_grown(l->health.cooldown_ms);
}

static inline const char *kvw__rail_name(const kvw_engine_t *e, const kvw_lane_t *l)
{
    return e->rail[l->rail].dev->name;
}

/* ---- the poller's interface (failover.c, rejoin.c) ----
 *
 * The poller calls in on an error completion, once per pass over a
 * connected peer (lanes taken down, answers served, rejoins moved along),
 * and when the peer died; it retires what landed itself afterwards. */

/* Prefill: an error completion on `lane` (first: its send queue was not
 * broken before it). true when the rails carried on (the lane was out
 * already, or it failed over); false: the connection has to go. The
 * poller drained the ready queue first, so that a failover sees every
 * part handed over. */
bool kvw__rails_send_error(kvw_peer_t *p, uint32_t lane, const struct ibv_wc *wc, bool first);
/* Decode: an error completion on `lane`; false: the connection has to go. */
bool kvw__rails_recv_error(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, const struct ibv_wc *wc);
/* Prefill: fail over the lanes marked down (kvw__lane_mark_down), or kill
 * the connection when no other rail is left. */
void kvw__rails_take_down(kvw_engine_t *e, kvw_peer_t *p);
/* Prefill: the requests held for decode's REPLAY_ANSWER that have one
 * (or ran out of time): replayed, ended as landed, or failed. */
void kvw__rails_serve_answers(kvw_engine_t *e, kvw_peer_t *p);
/* Prefill, building r's writes: r may have lost writes on the `lost`
 * lanes and its final immediate is not out: it starts over under the
 * next epoch (or fails, replayed too often). */
void kvw__rails_start_over(kvw_peer_t *p, kvw_req_t *r, uint32_t lost);
/* r's lanes whose writes will never be known landed: failed over and not
 * (all) landed, or of an earlier life of the lane. */
uint32_t kvw__rails_lanes_lost(const kvw_peer_t *p, kvw_req_t *r);
/* r's writes on `lane` are of the lane's current life (a request's
 * lane_mask and last_seq mean something only for the life they were made
 * in: see failover.c). */
static inline bool kvw__rails_of_this_life(const kvw_peer_t *p, const kvw_req_t *r, uint32_t lane)
{
    return r->tx.lane_life[lane] == p->lanes[lane].health.life;
}

/* rejoin.c. Poller: the lane failed over (prefill) or was given up (decode). */
void kvw__rejoin_lane_failed(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane);
/* Poller: a completion reaped on a lane that is out of its connection
 * (prefill, wr_id as reaped; ok: it succeeded) or any error completion
 * (decode). Prefill: each counts towards the drain, and a failed probe
 * write sends the lane back to paused. Decode: one receive fewer posted. */
void kvw__rejoin_reaped(kvw_engine_t *e, kvw_peer_t *p, uint32_t lane, uint64_t wr_id, bool ok);
/* Poller: move p's lanes that are out along (drained, probe to post,
 * probe landed; decode: the reset prefill asked for). Cheap when none is. */
void kvw__rejoin_poll(kvw_engine_t *e, kvw_peer_t *p);
/* Poller: p died; its lanes out no longer count as out. */
void kvw__rejoin_peer_gone(kvw_engine_t *e, kvw_peer_t *p);
/* Poller: the turn lanes take chains in, less the dead lanes. */
void kvw__rejoin_rebuild_turns(kvw_peer_t *p);

/* ctl_rejoin.c. Control thread: probes and resets due (prefill), LANE_READY to send
 * (decode). Returns when it next needs to run (0: nothing pending). */
uint64_t kvw__rejoin_tick(kvw_engine_t *e, kvw_peer_t *p, uint64_t now);
/* Decode, control thread: tell prefill our end of `lane` is down
 * (LANE_DOWN), if p is connected; best effort (a full queue drops it:
 * prefill then learns it from its writes or its rejoin's timeout). */
void kvw__rejoin_say_down(kvw_peer_t *p, uint32_t lane);
/* Prefill, control thread: decode said its end of a lane is down. */
void kvw__rejoin_on_down(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);
/* Control thread: dev's port came up (IBV_EVENT_PORT_ACTIVE). Prefill
 * probes its paused lanes on that rail now instead of after their
 * cooldown; decode tells prefill (LANE_UP) for each lane on it, since
 * prefill's own port may never have gone down. */
void kvw__rejoin_rail_up(kvw_engine_t *e, const kvw_dev_t *dev);
/* Prefill, control thread: decode said its end of a lane is up again. */
void kvw__rejoin_on_up(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);
/* Control thread, decode: prefill's LANE_RESET. */
void kvw__rejoin_on_reset(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);
/* ask.c. Prefill, control thread: REPLAY_ASK for each request the poller
 * holds for decode's answer; decode's REPLAY_ANSWER handed to the poller. */
void kvw__rails_send_asks(kvw_engine_t *e, kvw_peer_t *p);
void kvw__rails_on_replay_answer(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);
/* Decode, control thread: prefill's REPLAY_ASK answered. */
void kvw__rails_on_replay_ask(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);
/* Control thread, prefill: decode's LANE_READY. */
void kvw__rejoin_on_ready(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m);

#endif
