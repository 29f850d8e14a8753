/* SPDX-License-Identifier: Apache-2.0 */
/* Decode's side of the control plane: one connection per prefill rank,
 * made on demand when a receiver needs it: an asynchronous bootstrap
 * lookup, then a DEALER to prefill's ROUTER for the handshake, requests,
 * aborts, credits and heartbeats. */
#include "engine/control.h"
#include "engine/rails/rails.h"
#include "engine/stager.h"
#include "engine/verify.h"

#include "common/log.h"
#include "ctrl/registry.h"
#include "ctrl/zsock.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    LOOKUP_RETRY_MS = 200,
    /* How long "rank N is not registered" is retried before the connection
     * fails: covers a prefill still starting and a bootstrap service that
     * restarted (prefill re-registers every second). */
    LOOKUP_GRACE_MS = 1000, /* beyond one refresh interval */
};

static void *dealer(kvw_engine_t *e)
{
    return kvw__zsocket_secure(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms, e->zsec);
}

static void close_monitor(kvw_peer_t *p)
{
    kvw__zmonitor_close(p->sock, p->monitor);
    p->monitor = NULL;
}

static void send_lookup(kvw_peer_t *p)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_LOOKUP};
    m.u.bs.rank = p->rank;
    kvw__zsend(p->bs_sock, &m, ZMQ_DONTWAIT);
}

/* A peer made by kvw_receiver_create_at: its "bootstrap address" is '@'
 * and the prefill engine's own control endpoint, dialled without a lookup. */
static bool direct(const kvw_peer_t *p)
{
    return p->bootstrap_addr[0] == '@';
}

static void peer_start_hello(kvw_engine_t *e, kvw_peer_t *p, const char *endpoint);
static void rank_not_registered(kvw_engine_t *e, kvw_peer_t *p, uint64_t now);

/* KVW_REGISTRY: the rank's endpoint from the registry's table (memory its
 * own thread keeps current from a watch: no round trip, never blocks),
 * checked as a bootstrap answer is; not registered is retried as there. */
static void registry_lookup(kvw_engine_t *e, kvw_peer_t *p)
{
    char ep[KVW_WIRE_ENDPOINT_MAX], why[KVW_WIRE_REASON_MAX] = "";
    kvw_status_t st = kvw__registry_lookup(e->registry, p->rank, ep, sizeof(ep), why, sizeof(why));
    if (st == KVW_OK)
        peer_start_hello(e, p, ep);
    else if (st == KVW_ERR_NOT_FOUND)
        rank_not_registered(e, p, kvw__now_ns());
    else
        kvw__peer_kill(p, st, "%s", why);
}

static void open_lookup(kvw_engine_t *e, kvw_peer_t *p, bool ask_now)
{
    if (direct(p)) {
        peer_start_hello(e, p, p->bootstrap_addr + 1);
        return;
    }
    if (e->registry) {
        if (ask_now)
            registry_lookup(e, p);
        /* Made after this pass's deadlines were taken: a retry it set must
         * have the loop take them again. */
        if (ask_now && p->next_ping_ns)
            kvw__wake(e->control_wake_fd);
        return;
    }
    char ep[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(p->bootstrap_addr, ep, sizeof(ep));
    p->bs_sock = dealer(e);
    /* a failed connect shows up as a lookup timeout with a reason */
    if (p->bs_sock && zmq_connect(p->bs_sock, ep) == 0 && ask_now)
        send_lookup(p);
}

/* The endpoint the bootstrap service gave us does not answer (a prefill
 * that died, and maybe restarted elsewhere, leaves a stale registration):
 * drop it and ask again, until the peer's bootstrap deadline. */
static void restart_lookup(kvw_engine_t *e, kvw_peer_t *p, const char *why)
{
    if (!kvw__peer_transition(p, PEER_HELLO, PEER_LOOKUP))
        return;
    atomic_fetch_add(&e->counters.reconnects, 1);
    KVW_INFO("prefill rank %u: %s; looking it up again at %s", p->rank, why,
             e->registry ? kvw__registry_name(e->registry) : p->bootstrap_addr);
    close_monitor(p);
    zmq_close(p->sock);
    p->sock = NULL;
    if (direct(p)) { /* no service to ask: the same endpoint again, until the deadline */
        p->next_ping_ns = kvw__now_ns() + kvw__ms_ns(LOOKUP_RETRY_MS);
        return;
    }
    /* Not at once: until its successor registers, the service keeps
     * answering with the same stale endpoint. */
    open_lookup(e, p, false);
    p->next_ping_ns = kvw__now_ns() + kvw__ms_ns(LOOKUP_RETRY_MS);
}

/* Our routing identity towards prefill: engine id + connection serial,
 * never reused, so a reconnect cannot collide with a pipe prefill's ROUTER
 * has not dropped yet. */
static void set_identity(kvw_engine_t *e, kvw_peer_t *p)
{
    memcpy(p->id, &e->id, 8);
    memcpy(p->id + 8, &p->serial, 4);
}

static void send_hello(kvw_engine_t *e, kvw_peer_t *p, const char *endpoint)
{
    /* Receives are posted once per QP; a repeated handshake reuses them. */
    if (!atomic_load(&p->lanes[0].recvs_posted) && kvw__peer_post_recvs(p, e->cfg.rq_depth)) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "cannot post receives");
        return;
    }
    for (uint32_t i = 0; i < p->nlanes; i++) /* HELLO carries them */
        atomic_store(&p->lanes[i].credits_sent, atomic_load(&p->lanes[i].recvs_posted));
    kvw_msg_t hello;
    kvw__peer_hello(p, KVW_MSG_HELLO, &hello);
    kvw_status_t st = kvw__zsend(p->sock, &hello, ZMQ_DONTWAIT);
    kvw__wire_free(&hello);
    p->hello_retry_ns = kvw__now_ns() + kvw__ms_ns(e->cfg.peer_timeout_ms);
    if (st)
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot send handshake to %s", endpoint);
    else if (kvw__peer_transition(p, PEER_LOOKUP, PEER_HELLO))
        KVW_DEBUG("HELLO sent to prefill rank %u at %s (%u QPs)", p->rank, endpoint, p->nlanes);
}

static void peer_start_hello(kvw_engine_t *e, kvw_peer_t *p, const char *endpoint)
{
    zmq_close(p->bs_sock);
    p->bs_sock = NULL;
    p->sock = dealer(e);
    set_identity(e, p);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_ROUTING_ID, p->id, sizeof(p->id))) {
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot create a socket for prefill at %s: %s", endpoint,
                       zmq_strerror(errno));
        return;
    }
    char name[64];
    snprintf(name, sizeof(name), "%016llx-%u", (unsigned long long)e->id, p->serial);
    /* Optional (heartbeats still work without it): a closed connection,
     * and a refused one while the handshake is pending. */
    p->monitor =
        kvw__zmonitor(e->zctx, p->sock, name, ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECT_RETRIED);
    if (zmq_connect(p->sock, endpoint)) {
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot connect to prefill at %s: %s", endpoint,
                       zmq_strerror(errno));
        return;
    }
    send_hello(e, p, endpoint);
}

/* Not registered: retry while the prefill may still be starting or the
 * service restarting, then fail with the reason. */
static void rank_not_registered(kvw_engine_t *e, kvw_peer_t *p, uint64_t now)
{
    /* One re-registration interval and a little, but within the bootstrap
     * timeout, so the reason given is the missing rank. */
    uint32_t grace = e->cfg.bootstrap_refresh_ms + LOOKUP_GRACE_MS;
    if (grace > e->cfg.bootstrap_timeout_ms / 2)
        grace = e->cfg.bootstrap_timeout_ms / 2;
    if (!p->missing_since_ns)
        p->missing_since_ns = now;
    if (now - p->missing_since_ns >= kvw__ms_ns(grace)) {
        kvw__peer_kill(p, KVW_ERR_NOT_FOUND, "prefill rank %u is not registered at %s", p->rank,
                       e->registry ? kvw__registry_name(e->registry) : p->bootstrap_addr);
        return;
    }
    p->next_ping_ns = now + kvw__ms_ns(LOOKUP_RETRY_MS);
}

void kvw__decode_on_bootstrap(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX] = "";
    while (p->bs_sock && atomic_load(&p->state) == PEER_LOOKUP) {
        kvw_status_t st = kvw__zrecv(p->bs_sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
        if (st == KVW_ERR_NOT_FOUND)
            return;
        if (st || m.type != KVW_MSG_BS_LOOKUP_REPLY || m.u.bs.rank != p->rank) {
            kvw__peer_kill(p, KVW_ERR_PROTOCOL, "bad bootstrap reply from %s: %s",
                           p->bootstrap_addr, st ? why : kvw__wire_type_name(m.type));
            if (!st)
                kvw__wire_free(&m);
            return;
        }
        if (m.status == KVW_OK && strncmp(m.u.bs.endpoint, "tcp://", 6) != 0)
            /* Prefill engines bind tcp:// only; another scheme (ipc://,
             * inproc://, pgm://) from a bootstrap service would have us
             * dial a local file or a multicast group on its word. */
            kvw__peer_kill(p, KVW_ERR_PROTOCOL,
                           "bootstrap %s gave rank %u an endpoint that is not tcp://: %.64s",
                           p->bootstrap_addr, p->rank, m.u.bs.endpoint);
        else if (m.status == KVW_OK)
            peer_start_hello(e, p, m.u.bs.endpoint);
        else if (m.status == KVW_ERR_NOT_FOUND)
            rank_not_registered(e, p, kvw__now_ns());
        else
            kvw__peer_kill(p, (kvw_status_t)m.status, "bootstrap %s refused the lookup of rank %u",
                           p->bootstrap_addr, p->rank);
    }
}

/* (lock) Requests waiting for this connection have something to do now. */
static void touch_waiting_locked(kvw_engine_t *e, kvw_peer_t *p)
{
    for (kvw_req_t *r = e->reqs; r; r = r->next)
        if (r->peer == p)
            kvw__req_touch_locked(r);
}

static void on_hello_ack(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX] = "";
    kvw_status_t st = (kvw_status_t)m->status;
    if (st) {
        atomic_fetch_add(&e->counters.handshakes_refused, 1);
        kvw__peer_kill(p, st, "prefill rank %u refused the handshake: %.100s", p->rank,
                       m->u.hello.reason[0] ? m->u.hello.reason : kvw_strerror(st));
        return;
    }
    /* Wire 12: prefill answers in the version it chose (one without an
     * offer is a 1.4.x engine, 11 alone); we use what both have. */
    kvw_wire_offer_t theirs = kvw__wire_hello_offer(m);
    p->wire_version = m->version;
    p->wire_caps = e->wire.caps & theirs.caps;
    if (m->version < e->wire.min || m->version > e->wire.max) {
        snprintf(why, sizeof(why),
                 "prefill answered in wire version %u: it speaks %u..%u, we %u..%u", m->version,
                 theirs.min, theirs.max, e->wire.min, e->wire.max);
        st = KVW_ERR_MISMATCH;
    } else if (m->u.hello.num_qps > p->nlanes) {
        snprintf(why, sizeof(why), "prefill connected %u QPs, we offered %u", m->u.hello.num_qps,
                 p->nlanes);
        st = KVW_ERR_PEER;
    } else {
        st = kvw__peer_accept_layout(p, m, why, sizeof(why));
    }
    /* Prefill may take fewer QPs than we offered: the rest stay idle. One
     * we cannot connect (our rail's link is down) is left out: LANE_DOWN,
     * once connected, has prefill fail it over and probe it back. */
    uint32_t out = 0;
    if (!st)
        st = kvw__peer_connect_lanes(p, m->u.hello.qps, m->u.hello.num_qps, &out, why, sizeof(why));
    if (!st && out)
        KVW_WARN("prefill rank %u: %u of %u QPs could not be connected (%s): the connection "
                 "starts without them; prefill is told and probes them back",
                 p->rank, (unsigned)__builtin_popcount(out), m->u.hello.num_qps, why);
    if (st) {
        kvw__peer_kill(p, st, "handshake with prefill rank %u failed: %s", p->rank,
                       why[0] ? why : kvw_strerror(st));
        return;
    }
    uint64_t now = kvw__now_ns();
    p->last_seen_ns = now;
    p->next_ping_ns = now + kvw__ms_ns(e->cfg.heartbeat_ms);
    if (!kvw__peer_transition(p, PEER_HELLO, PEER_CONNECTED))
        return; /* killed meanwhile: stays dead */
    atomic_fetch_add(&e->counters.handshakes, 1);
    for (uint32_t i = 0; i < m->u.hello.num_qps; i++)
        if (out & 1u << i)
            kvw__rejoin_say_down(p, i); /* prefill fails it over before any write */
    uint32_t lanes = m->u.hello.num_qps;
    KVW_INFO("connected to prefill rank %u via %s as peer %u (%u QP%s, QPN %u -> %u, wire %u, "
             "capabilities 0x%x)",
             p->rank, p->bootstrap_addr, p->index, lanes, lanes > 1 ? "s" : "",
             p->lanes[0].qp->qp->qp_num, m->u.hello.qps[0].qpn, p->wire_version, p->wire_caps);
    pthread_mutex_lock(&e->lock);
    touch_waiting_locked(e, p); /* send the requests waiting for this peer */
    pthread_mutex_unlock(&e->lock);
}

/* Prefill says the room failed and that none of its writes can still land. */
static void on_request_failed(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_DECODE, m->u.failed.room);
    if (r && r->peer != p) /* receivers made by kvw_receiver_create_at share rooms across peers */
        for (r = e->reqs; r && !(r->role == KVW_ROLE_DECODE && r->peer == p &&
                                 r->room == m->u.failed.room && r->token == m->u.failed.token);
             r = r->next)
            ;
    if (r && r->peer == p && r->token == m->u.failed.token) {
        KVW_DEBUG("room %llu: REQUEST_FAILED from prefill rank %u%s", (unsigned long long)r->room,
                  p->rank, r->rx.aborting ? " (our abort confirmed)" : "");
        atomic_fetch_add(
            r->rx.aborting ? &e->counters.abort_confirms : &e->counters.requests_refused, 1);
        if (r->rx.aborting)
            kvw__req_fail(r, r->rx.abort_status, "%s", r->rx.abort_reason);
        else
            kvw__req_fail(r, (kvw_status_t)m->status, "prefill: %s", m->u.failed.reason);
        kvw__req_set_deadline_locked(r, 0);
        kvw__req_touch_locked(r); /* a destroyed receiver may leave now */
    }
    pthread_mutex_unlock(&e->lock);
}

/* Prefill's digest of what it wrote for a request we verify: Success or
 * KVW_ERR_CORRUPT once ours is in too (engine/verify.h). */
static void on_digest(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__token_lookup_locked(e, m->u.digest.token);
    bool ours = r && r->peer == p && r->room == m->u.digest.room && r->rx.verify;
    if (ours)
        kvw__verify_remote_locked(r, m->u.digest.value);
    bool ended = ours && kvw__req_ended(r);
    if (ended) /* nothing lands in its staging slots any more: free them now */
        atomic_fetch_add(&r->refs, 1);
    pthread_mutex_unlock(&e->lock);
    if (!ours)
        KVW_INFO("DIGEST for room %llu (token 0x%x) matches no verified receiver of prefill "
                 "rank %u (ended or destroyed?)",
                 (unsigned long long)m->u.digest.room, m->u.digest.token, p->rank);
    if (ended) {
        kvw__stager_unreserve(r);
        kvw__req_unref(r);
    }
}

void kvw__decode_on_message(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX] = "";
    while (p->sock && atomic_load(&p->state) != PEER_DEAD) {
        kvw_status_t st = kvw__zrecv(p->sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
        if (st == KVW_ERR_NOT_FOUND)
            return;
        if (st) {
            kvw__peer_kill(p, KVW_ERR_PROTOCOL, "bad message from prefill rank %u: %s", p->rank,
                           why);
            return;
        }
        p->last_seen_ns = kvw__now_ns();
        if (m.type == KVW_MSG_HELLO_ACK && atomic_load(&p->state) == PEER_HELLO)
            on_hello_ack(e, p, &m);
        else if (m.type == KVW_MSG_REQUEST_FAILED)
            on_request_failed(e, p, &m);
        else if (m.type == KVW_MSG_LANE_RESET && atomic_load(&p->state) == PEER_CONNECTED)
            kvw__rejoin_on_reset(e, p, &m);
        else if (m.type == KVW_MSG_REPLAY_ASK && atomic_load(&p->state) == PEER_CONNECTED)
            kvw__rails_on_replay_ask(e, p, &m);
        else if (m.type == KVW_MSG_DIGEST && atomic_load(&p->state) == PEER_CONNECTED)
            on_digest(e, p, &m);
        else if (m.type == KVW_MSG_BYE && atomic_load(&p->closing_said))
            kvw__peer_kill(p, (kvw_status_t)m.status,
                           "prefill rank %u ended the connection after our CLOSING", p->rank);
        else if (m.type == KVW_MSG_BYE)
            kvw__peer_kill(p, (kvw_status_t)m.status,
                           "prefill rank %u closed the connection: %.100s", p->rank,
                           m.u.failed.reason);
        else if (m.type == KVW_MSG_PONG && atomic_load(&p->state) == PEER_HELLO)
            /* Prefill has our HELLO queued behind others (a storm): wait
             * for it instead of resending, up to the handshake deadline. */
            p->hello_retry_ns = p->last_seen_ns + kvw__ms_ns(e->cfg.peer_timeout_ms);
        else if (m.type != KVW_MSG_PONG)
            kvw__ctl_dropped(e, "unexpected %s from prefill rank %u", kvw__wire_type_name(m.type),
                             p->rank);
        kvw__wire_free(&m);
    }
}

void kvw__decode_on_monitor(kvw_engine_t *e, kvw_peer_t *p)
{
    int ev;
    while (p->monitor && (ev = kvw__zmonitor_event(p->monitor)) != 0) {
        bool lost = ev == ZMQ_EVENT_DISCONNECTED || ev == ZMQ_EVENT_CONNECT_RETRIED;
        if (lost && atomic_load(&p->state) == PEER_HELLO)
            restart_lookup(e, p, "its endpoint refused or dropped the handshake");
        else if (ev == ZMQ_EVENT_DISCONNECTED) {
            atomic_store(&p->ctl_gone, true);
            kvw__peer_kill(p, KVW_ERR_PEER, "prefill rank %u's control connection closed", p->rank);
        }
    }
}

/* ------------------------------------------------------------- peers */

/* Every lane's count in one message, when any lane has a quarter queue
 * (or, forced, anything) to tell. */
static void send_credits(kvw_engine_t *e, kvw_peer_t *p, bool force)
{
    kvw_msg_t m = {.type = KVW_MSG_CREDIT};
    bool due = false;
    m.u.credit.num_qps = p->nlanes;
    for (uint32_t i = 0; i < p->nlanes; i++) {
        uint64_t posted = atomic_load(&p->lanes[i].recvs_posted);
        uint64_t sent = atomic_load(&p->lanes[i].credits_sent);
        m.u.credit.recvs_posted[i] = posted;
        due |= posted != sent && (force || posted - sent >= (e->cfg.rq_depth + 3) / 4);
    }
    if (!due || kvw__zsend(p->sock, &m, ZMQ_DONTWAIT) != KVW_OK)
        return;
    for (uint32_t i = 0; i < p->nlanes; i++)
        atomic_store(&p->lanes[i].credits_sent, m.u.credit.recvs_posted[i]);
}

/* Handshake deadlines and lookup retries; returns when next due. */
static uint64_t connecting_tick(kvw_engine_t *e, kvw_peer_t *p, int s, uint64_t now)
{
    if (now > p->deadline_ns) {
        kvw__peer_kill(p, KVW_ERR_TIMEOUT,
                       "no handshake with prefill rank %u via bootstrap %s within %u ms", p->rank,
                       p->bootstrap_addr, e->cfg.bootstrap_timeout_ms);
        return 0;
    }
    if (s == PEER_LOOKUP && p->next_ping_ns && now > p->next_ping_ns) {
        p->next_ping_ns = 0;
        if (direct(p))
            peer_start_hello(e, p, p->bootstrap_addr + 1);
        else if (e->registry)
            registry_lookup(e, p);
        else
            send_lookup(p);
    } else if (s == PEER_HELLO && now > p->hello_retry_ns) {
        restart_lookup(e, p, "no answer to the handshake");
    }
    s = atomic_load(&p->state);
    uint64_t next = p->deadline_ns + 1;
    if (s == PEER_LOOKUP)
        next = kvw__earliest(next, p->next_ping_ns ? p->next_ping_ns + 1 : 0);
    else if (s == PEER_HELLO)
        next = kvw__earliest(next, p->hello_retry_ns + 1);
    return next;
}

/* Since when prefill has given no sign of life: its last control message,
 * its last immediate that the poller reaped, or the moment the connection
 * turned busy. The last one matters because an idle connection is pinged
 * only every idle_heartbeat_ms (above peer_timeout_ms by default): its last
 * PONG may be older than the busy limit although prefill is fine, so the
 * busy clock starts with a ping of its own. */
static uint64_t silent_since(const kvw_peer_t *p)
{
    uint64_t t = p->last_seen_ns;
    uint64_t data = atomic_load_explicit(&p->data_seen_ns, memory_order_relaxed);
    if (data > t)
        t = data;
    return p->busy_since_ns > t ? p->busy_since_ns : t;
}

/* Heartbeats and credits; returns when next due. A connection that a
 * receiver depends on is pinged every heartbeat_ms (at once when it turns
 * busy) and declared dead after peer_timeout_ms without a sign of life; an
 * idle one, every idle_heartbeat_ms, dead after three of those (prefill
 * uses the same idle bound). */
static uint64_t connected_tick(kvw_engine_t *e, kvw_peer_t *p, uint64_t now)
{
    pthread_mutex_lock(&e->lock);
    bool busy = p->nreqs > 0;
    pthread_mutex_unlock(&e->lock);
    if (busy && !p->busy) {
        p->busy_since_ns = now;
        p->next_ping_ns = now;
    }
    p->busy = busy;
    uint32_t interval = busy ? e->cfg.heartbeat_ms : e->cfg.idle_heartbeat_ms;
    uint32_t limit = busy ? e->cfg.peer_timeout_ms : 3 * e->cfg.idle_heartbeat_ms;
    uint64_t silent_at = silent_since(p) + kvw__ms_ns(limit);
    if (now > silent_at) {
        kvw__peer_kill(p, KVW_ERR_PEER, "prefill rank %u silent for %u ms", p->rank, limit);
        return 0;
    }
    bool ping_due = now >= p->next_ping_ns;
    send_credits(e, p, ping_due);
    if (ping_due) {
        kvw_msg_t ping = {.type = KVW_MSG_PING};
        ping.u.ping.engine_id = e->id;
        kvw__zsend(p->sock, &ping, ZMQ_DONTWAIT);
        p->next_ping_ns = now + kvw__ms_ns(interval);
    }
    return kvw__earliest(silent_at + 1, p->next_ping_ns);
}

uint64_t kvw__decode_peers_tick(kvw_engine_t *e, uint64_t now)
{
    uint64_t next = 0;
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        int s = p ? atomic_load(&p->state) : PEER_DEAD;
        if (s == PEER_LOOKUP || s == PEER_HELLO)
            next = kvw__earliest(next, connecting_tick(e, p, s, now));
        else if (s == PEER_CONNECTED)
            next = kvw__earliest(
                next, kvw__earliest(connected_tick(e, p, now), kvw__rejoin_tick(e, p, now)));
    }
    return next;
}

/* A connection we declared dead: tell prefill why, then close the socket so
 * prefill's monitor sees it go too. */
void kvw__decode_say_bye(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *bye)
{
    (void)e;
    close_monitor(p);
    if (p->sock) {
        kvw__zsend(p->sock, bye, ZMQ_DONTWAIT);
        int linger = 200; /* let the BYE leave; zmq_close does not block on it */
        zmq_setsockopt(p->sock, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_close(p->sock);
        p->sock = NULL;
    }
    if (p->bs_sock) {
        zmq_close(p->bs_sock);
        p->bs_sock = NULL;
    }
}

/* ---------------------------------------------------------- receivers */

static kvw_peer_t *find_peer_locked(kvw_engine_t *e, const kvw_req_t *r)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && p->rank == r->rx.prefill_rank && !atomic_load(&p->killing) &&
            strcmp(p->bootstrap_addr, r->rx.bootstrap_addr) == 0)
            return p;
    }
    return NULL;
}

/* (lock) A connection to r's prefill rank that died and still holds its
 * slot: a new one is a reconnect. */
static bool had_peer_locked(kvw_engine_t *e, const kvw_req_t *r)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && p->rank == r->rx.prefill_rank && atomic_load(&p->killing) &&
            strcmp(p->bootstrap_addr, r->rx.bootstrap_addr) == 0)
            return true;
    }
    return false;
}

/* (lock) Ask the control loop for a connection to r's prefill rank, made
 * after the lock is released (creating a QP is a verbs call). */
static void want_peer_locked(kvw_engine_t *e, kvw_req_t *r)
{
    if (e->npending == e->pending_cap) {
        size_t cap = e->pending_cap ? 2 * e->pending_cap : 16;
        kvw_req_t **v = realloc(e->pending, cap * sizeof(*v));
        if (!v) {
            kvw__req_fail(r, KVW_ERR_NO_MEMORY, "cannot queue a connection to prefill");
            return;
        }
        e->pending = v;
        e->pending_cap = cap;
    }
    atomic_fetch_add(&r->refs, 1);
    e->pending[e->npending++] = r;
}

static void send_request_locked(kvw_engine_t *e, kvw_req_t *r)
{
    kvw_msg_t m = {.type = KVW_MSG_REQUEST};
    m.u.request.room = r->room;
    m.u.request.token = r->token;
    /* Staged kinds name slots of the staging pool, not our GPU pages. */
    m.u.request.aux_index =
        r->stage.slots ? (uint32_t)r->stage.slots[r->rx.npages + r->rx.nstate] : r->rx.aux;
    m.u.request.num_pages = (uint32_t)r->rx.npages;
    m.u.request.num_state = (uint32_t)r->rx.nstate;
    m.u.request.pages = r->stage.slots ? r->stage.slots : r->rx.pages;
    if (r->rx.heads_set) { /* one rank of several (rxset.c): its heads, maybe the rest */
        m.u.request.heads_flags =
            KVW_WIRE_HEADS_RANGE | (r->rx.no_rest ? KVW_WIRE_HEADS_NO_REST : 0u);
        m.u.request.head_first = r->rx.heads.first;
        m.u.request.head_count = r->rx.heads.count;
        if (r->rx.land_len) { /* its heads go to its slice of our landing buffer */
            m.u.request.heads_flags |= KVW_WIRE_HEADS_LANDING;
            m.u.request.landing_off = r->rx.land_off;
        }
    }
    if (r->rx.verify) /* wire 11: prefill sends its digest (engine/verify.h) */
        m.u.request.heads_flags |= KVW_WIRE_REQ_VERIFY;
    if (r->rx.room_receivers && r->peer->wire_version >= 12 &&
        r->peer->wire_caps & KVW_WIRE_CAP_FANOUT) {
        /* Wire 12: how many decode receivers ask for the room, so that
         * prefill's sender learns it (kvw_sender_create_learn). A peer
         * without the capability never sees it; its sender serves as many
         * as its caller said. */
        m.version = 12;
        m.u.request.heads_flags |= KVW_WIRE_REQ_RECEIVERS;
        m.u.request.room_receivers = r->rx.room_receivers;
    }
    const char *lacks = kvw__wire_request_lacks(&m, r->peer->wire_caps);
    if (lacks) { /* wire 12: the connection uses only what both ends have */
        kvw__req_fail(r, KVW_ERR_UNSUPPORTED,
                      "the request needs %s, which prefill rank %u does not offer (wire "
                      "capabilities 0x%x agreed)",
                      lacks, r->rx.prefill_rank, r->peer->wire_caps);
        r->rx.request_due = false;
        return;
    }
    /* Wire 6: each state group's own list (the indices are in group order). */
    m.u.request.num_state_lists = r->engine->layout.num_state_groups;
    for (uint32_t i = 0; i < m.u.request.num_state_lists; i++)
        m.u.request.state_counts[i] = r->rx.state_n[i];
    r->rx.request_due = false;
    /* Transferring before the REQUEST leaves: prefill's sender turns
     * WaitingForInput on it, and whoever polls both sides must not then
     * see this one still waiting (the lock does not cover poll's read). */
    atomic_store(&r->state, KVW_POLL_TRANSFERRING);
    KVW_DEBUG("room %llu: Transferring: REQUEST to prefill rank %u (%u pages, token %u)",
              (unsigned long long)r->room, r->rx.prefill_rank, m.u.request.num_pages, r->token);
    if (kvw__zsend(r->peer->sock, &m, ZMQ_DONTWAIT)) {
        kvw__req_fail(r, KVW_ERR_CONTROL, "cannot send the request to prefill rank %u",
                      r->rx.prefill_rank);
        r->rx.abort_due = true; /* prefill may have it after all */
        return;
    }
    r->rx.request_sent = true;
    r->rx.sent_ns = kvw__now_ns();
    kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.transfer_timeout_ms));
}

static void send_abort_locked(kvw_req_t *r)
{
    const char *why = r->rx.aborting ? r->rx.abort_reason : r->fail_reason;
    kvw_status_t st = r->rx.aborting ? r->rx.abort_status : r->fail_status;
    kvw_msg_t m = kvw__failure_msg(KVW_MSG_ABORT, r->room, r->token, st, why);
    if (kvw__zsend(r->peer->sock, &m, ZMQ_DONTWAIT) == KVW_OK) {
        r->rx.abort_due = false;
        atomic_fetch_add(&r->engine->counters.aborts, 1);
        KVW_DEBUG("room %llu: ABORT sent to prefill rank %u", (unsigned long long)r->room,
                  r->peer->rank);
    } else /* the socket's queue is full: try again shortly */
        kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(100));
}

static void receiver_deadline_locked(kvw_engine_t *e, kvw_req_t *r, int s)
{
    if (r->rx.aborting) {
        /* No confirmation: only a dead connection guarantees nothing lands. */
        kvw__peer_kill_locked(r->peer, KVW_ERR_TIMEOUT,
                              "room %llu: prefill did not confirm the abort within %u ms",
                              (unsigned long long)r->room, e->cfg.peer_timeout_ms);
    } else if (s == KVW_POLL_TRANSFERRING) {
        char why[KVW_WIRE_REASON_MAX];
        if (r->rx.v_landed) /* verified: the data is there, a digest is not */
            snprintf(why, sizeof(why), "the data landed but %s did not come within %u ms",
                     !r->rx.v_have_remote ? "prefill's digest (DIGEST)"
                                          : "the caller's digest (kvw_receiver_verify)",
                     e->cfg.transfer_timeout_ms);
        else
            snprintf(why, sizeof(why), "data did not land within %u ms",
                     e->cfg.transfer_timeout_ms);
        kvw__receiver_start_abort_locked(r, KVW_ERR_TIMEOUT, why);
    } else if (s == KVW_POLL_BOOTSTRAPPING) {
        kvw__req_fail(r, KVW_ERR_TIMEOUT, "not connected to prefill rank %u within %u ms",
                      r->rx.prefill_rank, e->cfg.bootstrap_timeout_ms);
        r->rx.abort_due = false;
    } else if (r->stage.waiting) {
        char why[KVW_WIRE_REASON_MAX];
        snprintf(why, sizeof(why),
                 "no staging slots for its %zu pages within bootstrap_timeout_ms (%u ms): the "
                 "requests before it hold the pool (KVW_STAGING_MIB=%u)",
                 r->rx.npages, e->cfg.bootstrap_timeout_ms, e->cfg.staging_mib);
        kvw__receiver_fail_unsent_locked(r, KVW_ERR_TIMEOUT, why);
    }
}

/* (lock) Serve a touched or expired receiver; true when it leaves the
 * table. */
bool kvw__decode_service_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    int s = atomic_load(&r->state);
    bool ended = s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS;
    bool due = r->deadline_ns && now >= r->deadline_ns;
    if (r->stage.staging_in)
        return false; /* landed: nothing to do here, its copy to the GPU ends it */
    if (ended && !r->rx.abort_due)
        return r->user_gone;
    if (r->user_gone && due && ended)
        return true; /* an ABORT we could not deliver in time */
    if (!r->peer) {
        kvw_peer_t *p = find_peer_locked(e, r);
        if (p)
            kvw__req_attach_locked(r, p);
        else /* an ended one still owes prefill its ABORT */
            want_peer_locked(e, r);
    }
    kvw_peer_t *p = r->peer;
    if (p && atomic_load(&p->state) == PEER_CONNECTED) {
        if (s == KVW_POLL_BOOTSTRAPPING)
            atomic_store(&r->state, KVW_POLL_WAITING_FOR_INPUT);
        if (r->rx.request_due && !ended && kvw__rxset_ready_locked(r))
            send_request_locked(e, r);
        if (r->rx.abort_due)
            send_abort_locked(r);
    }
    /* Destroyed and not ended (receiver_end gave up): its abort's deadline
     * still kills the connection, the one thing that ends it for sure. */
    if (!ended && due) {
        kvw__req_set_deadline_locked(r, 0);
        receiver_deadline_locked(e, r, atomic_load(&r->state));
    }
    return false;
}

/* One receiver's connection: an existing one, or a new peer (QP created
 * here, without the lock) that starts with a bootstrap lookup. */
static void connect_receiver(kvw_engine_t *e, kvw_req_t *r)
{
    pthread_mutex_lock(&e->lock);
    bool wanted =
        r->listed && !r->peer && (r->rx.abort_due || atomic_load(&r->state) != KVW_POLL_FAILED);
    kvw_peer_t *p = wanted ? find_peer_locked(e, r) : NULL;
    if (wanted && !p && had_peer_locked(e, r))
        atomic_fetch_add(&e->counters.reconnects, 1);
    if (p) { /* made for an earlier receiver of this round */
        kvw__req_attach_locked(r, p);
        kvw__req_touch_locked(r);
    }
    pthread_mutex_unlock(&e->lock);
    if (!wanted || p)
        return;
    char why[KVW_WIRE_REASON_MAX] = "";
    kvw_status_t st = kvw__peer_create(e, kvw__decode_lanes(e), NULL, &p);
    pthread_mutex_lock(&e->lock);
    if (!st) {
        p->rank = r->rx.prefill_rank;
        p->serial = e->ctl->next_serial++;
        snprintf(p->bootstrap_addr, sizeof(p->bootstrap_addr), "%s", r->rx.bootstrap_addr);
        atomic_store(&p->state, PEER_LOOKUP);
        p->deadline_ns = kvw__now_ns() + kvw__ms_ns(e->cfg.bootstrap_timeout_ms);
        st = kvw__peer_publish_locked(e, p, why, sizeof(why));
    }
    if (st)
        kvw__req_fail(r, st, "cannot connect to prefill rank %u: %s", r->rx.prefill_rank,
                      why[0] ? why : kvw_strerror(st));
    else
        kvw__req_attach_locked(r, p);
    pthread_mutex_unlock(&e->lock);
    if (st) {
        kvw__peer_destroy(p); /* verbs: after the lock */
        return;
    }
    open_lookup(e, p, true);
}

void kvw__decode_connect_pending(kvw_engine_t *e)
{
    for (;;) {
        pthread_mutex_lock(&e->lock);
        kvw_req_t *r = e->npending ? e->pending[--e->npending] : NULL;
        pthread_mutex_unlock(&e->lock);
        if (!r)
            return;
        connect_receiver(e, r);
        kvw__req_unref(r); /* want_peer_locked's */
    }
}

void kvw__decode_fini(kvw_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    while (e->npending)
        kvw__req_unref(e->pending[--e->npending]);
    free(e->pending);
    e->pending = NULL;
    e->pending_cap = 0;
    pthread_mutex_unlock(&e->lock);
}

/* ------------------------------------------------------ orderly close */

/* Our engine is going. Prefill's last writes may have landed (we counted
 * their immediates, the request said Success) while their ACKs are still
 * on the way or being retransmitted; a QP torn down now loses them, and
 * prefill would fail a request we reported Success. So say CLOSING and keep
 * the QPs up until prefill, with its completions reaped, answers BYE. */
static bool say_closing(kvw_peer_t *p)
{
    if (atomic_load(&p->state) != PEER_CONNECTED || atomic_load(&p->killing) || !p->sock)
        return false;
    if (!(p->wire_caps & KVW_WIRE_CAP_CLOSING))
        return false; /* prefill does not know CLOSING (wire 12): it ends on the closed socket */
    kvw_msg_t m = kvw__failure_msg(KVW_MSG_CLOSING, 0, 0, KVW_ERR_PEER, "its engine is destroyed");
    if (kvw__zsend(p->sock, &m, ZMQ_DONTWAIT))
        return false; /* its queue is full: it ends as before, on the closed socket */
    atomic_store(&p->closing_said, true);
    return true;
}

/* The sockets (and monitors) of the peers still waiting for prefill's BYE;
 * peers[i] is item i's peer. */
static int closing_items(kvw_engine_t *e, zmq_pollitem_t *items, kvw_peer_t **peers)
{
    int n = 0;
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || !atomic_load(&p->closing_said) || atomic_load(&p->state) == PEER_DEAD)
            continue;
        items[n] = (zmq_pollitem_t){p->sock, 0, ZMQ_POLLIN, 0};
        peers[n++] = p;
        if (p->monitor) {
            items[n] = (zmq_pollitem_t){p->monitor, 0, ZMQ_POLLIN, 0};
            peers[n++] = p;
        }
    }
    return n;
}

/* Serve the waiting peers' sockets until none waits or `until` passed:
 * prefill's BYE (or its connection closing) kills the peer, QP in ERR. */
static void wait_for_byes(kvw_engine_t *e, zmq_pollitem_t *items, kvw_peer_t **peers,
                          uint64_t until)
{
    int n;
    uint64_t now;
    while ((n = closing_items(e, items, peers)) > 0 && (now = kvw__now_ns()) < until) {
        long ms = (long)((until - now + 999999) / 1000000);
        if (zmq_poll(items, n, ms) < 0 && errno != EINTR)
            break;
        for (int i = 0; i < n; i++) {
            if (!(items[i].revents & ZMQ_POLLIN))
                continue;
            if (items[i].socket == peers[i]->sock)
                kvw__decode_on_message(e, peers[i]);
            else
                kvw__decode_on_monitor(e, peers[i]);
        }
        kvw__peer_finish_kills(e); /* kills begun under the lock meanwhile */
    }
    /* n: the peers left waiting when time ran out (0 when all answered). */
    for (int i = 0; i < n; i++)
        if (items[i].socket == peers[i]->sock)
            KVW_WARN("prefill rank %u did not end the connection within %u ms of our CLOSING: "
                     "what it still had in flight to us may end Failed there",
                     peers[i]->rank, e->cfg.peer_timeout_ms + e->cfg.heartbeat_ms);
}

void kvw__decode_close_all(kvw_engine_t *e)
{
    uint32_t np = atomic_load(&e->num_peers), waiting = 0;
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        waiting += p && say_closing(p);
    }
    if (!waiting)
        return;
    /* Prefill gives its writes peer_timeout_ms from our CLOSING: a
     * heartbeat more lets its BYE arrive, so that its QPs are in ERR
     * before ours go (no retransmission then meets a reused QPN). */
    uint64_t until =
        kvw__now_ns() + kvw__ms_ns((uint64_t)e->cfg.peer_timeout_ms + e->cfg.heartbeat_ms);
    zmq_pollitem_t *items = calloc(2 * (size_t)np, sizeof(*items));
    kvw_peer_t **peers = calloc(2 * (size_t)np, sizeof(*peers));
    if (items && peers)
        wait_for_byes(e, items, peers, until);
    free(items);
    free(peers);
}
