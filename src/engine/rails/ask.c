/* SPDX-License-Identifier: Apache-2.0 */
/* Rails, the control thread's side of a replay: prefill asks decode
 * (REPLAY_ASK) whether it completed an attempt whose final immediate was
 * on a lane that failed, and hands decode's REPLAY_ANSWER to the poller
 * (failover.c serves it); decode answers from its receiver's state. */
#include "engine/rails/rails.h"

#include "ctrl/zsock.h"
#include "engine/control.h"

#include <zmq.h>

/* ---- prefill ---- */

/* REPLAY_ASK for each request the poller holds for decode's answer (a
 * lane failed while its final immediate was on it). */
void kvw__rails_send_asks(kvw_engine_t *e, kvw_peer_t *p)
{
    if (!atomic_exchange(&p->rails.asks_due, false))
        return;
    pthread_mutex_lock(&e->lock);
    for (kvw_req_t *r = e->reqs; r; r = r->next) {
        if (r->role != KVW_ROLE_PREFILL || r->peer != p || r->tx.ask != KVW_ASK_DUE)
            continue;
        kvw_msg_t m = {.type = KVW_MSG_REPLAY_ASK};
        m.u.replay.room = r->room;
        m.u.replay.token = r->token;
        m.u.replay.epoch = r->tx.epoch;
        r->tx.ask = KVW_ASK_SENT;
        kvw__ctl_route(e, p->id, sizeof(p->id), &m);
    }
    pthread_mutex_unlock(&e->lock);
}

/* Decode's answer: the poller replays the request, ends it as landed, or
 * fails it. */
void kvw__rails_on_replay_answer(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    bool found = false;
    pthread_mutex_lock(&e->lock);
    for (kvw_req_t *r = e->reqs; r && !found; r = r->next)
        if (r->role == KVW_ROLE_PREFILL && r->peer == p && r->room == m->u.replay.room &&
            r->token == m->u.replay.token && r->tx.ask == KVW_ASK_SENT &&
            r->tx.epoch == m->u.replay.epoch) {
            r->tx.ask = KVW_ASK_SENT + (int)m->u.replay.answer;
            found = true;
        }
    pthread_mutex_unlock(&e->lock);
    if (!found) {
        kvw__ctl_dropped(e, "REPLAY_ANSWER for room %llu, which nothing asked about",
                         (unsigned long long)m->u.replay.room);
        return;
    }
    kvw__wake(e->poller_wake_fd);
}

/* ---- decode ---- */

/* Prefill asks whether we completed an attempt of a request (a lane failed
 * while the attempt's final immediate was on it). Not yet: from now on no
 * immediate of that attempt counts, so prefill may replay it under the
 * next epoch. */
void kvw__rails_on_replay_ask(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    kvw_msg_t a = {.type = KVW_MSG_REPLAY_ANSWER};
    a.u.replay = m->u.replay;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__token_lookup_locked(e, m->u.replay.token);
    if (!r || r->peer != p || r->room != m->u.replay.room)
        a.u.replay.answer = KVW_WIRE_REPLAY_GONE;
    else if (atomic_load(&r->state) == KVW_POLL_SUCCESS || (r->rx.v_landed && !kvw__req_ended(r)))
        a.u.replay.answer = KVW_WIRE_REPLAY_DONE; /* verified: landed, its digest awaited */
    else if (kvw__req_ended(r))
        a.u.replay.answer = KVW_WIRE_REPLAY_GONE;
    else {
        if (r->rx.imm_epoch <= m->u.replay.epoch) {
            r->rx.imm_epoch = m->u.replay.epoch + 1;
            r->rx.imms_landed = 0;
        }
        a.u.replay.answer = KVW_WIRE_REPLAY_AGAIN;
    }
    pthread_mutex_unlock(&e->lock);
    kvw__zsend(p->sock, &a, ZMQ_DONTWAIT);
}
