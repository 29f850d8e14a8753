/* The control thread: the engine's only user of ZeroMQ. Prefill serves a
 * ROUTER socket (handshakes, requests, aborts, pings); decode dials one
 * DEALER per prefill peer after an asynchronous bootstrap lookup. Every tick
 * it also enforces the timeouts, so a dead peer turns into Failed in bounded
 * time.
 *
 * Death detection, fastest first: a peer process that exits closes its TCP
 * connection, which the sockets' monitors report at once; a peer that kills
 * the connection says BYE; a silent peer (host or link gone) misses
 * heartbeats for peer_timeout_ms. */
#include "engine/engine.h"

#include "common/log.h"
#include "ctrl/zsock.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum {
    TICK_MS = 100,
    PROBE_TICK_MS = 10,    /* while probing connections after a disconnect */
    PROBE_WINDOW_MS = 500, /* how long a disconnect keeps us probing */
    LOOKUP_RETRY_MS = 200,
    MAX_ITEMS = 3 + 3 * KVW_MAX_PEERS,
};

static uint64_t ms_to_ns(uint32_t ms)
{
    return (uint64_t)ms * 1000000ull;
}

static kvw_msg_t failure_msg(uint16_t type, uint64_t room, uint32_t token, kvw_status_t st,
                             const char *why)
{
    kvw_msg_t m = {.type = type, .status = st < 0 ? st : KVW_ERR_PEER};
    m.u.failed.room = room;
    m.u.failed.token = token;
    snprintf(m.u.failed.reason, sizeof(m.u.failed.reason), "%s", why);
    return m;
}

/* =============================================================== prefill */

static void send_failed(kvw_engine_t *e, const kvw_peer_t *p, uint64_t room, uint32_t token,
                        kvw_status_t st, const char *why)
{
    kvw_msg_t m = failure_msg(KVW_MSG_REQUEST_FAILED, room, token, st, why);
    kvw__zsend_to(e->router, p->id, sizeof(p->id), &m);
}

/* The newest peer with this identity, dead or alive. */
static kvw_peer_t *peer_by_identity_any(kvw_engine_t *e, const uint8_t *id, size_t len)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = np; i-- > 0;) /* newest first: a reconnect replaces */
        if (len == KVW_IDENTITY_LEN && memcmp(e->peers[i]->id, id, len) == 0)
            return e->peers[i];
    return NULL;
}

static kvw_peer_t *peer_by_identity(kvw_engine_t *e, const uint8_t *id, size_t len)
{
    kvw_peer_t *p = peer_by_identity_any(e, id, len);
    return p && atomic_load(&p->state) != PEER_DEAD ? p : NULL;
}

static void reject_hello(kvw_engine_t *e, const uint8_t *id, kvw_status_t st, const char *why)
{
    KVW_ERROR("handshake from a decode engine rejected: %s", why);
    kvw_msg_t m = {.type = KVW_MSG_HELLO_ACK, .status = st};
    kvw__zsend_to(e->router, id, KVW_IDENTITY_LEN, &m);
}

static void on_hello(kvw_engine_t *e, const uint8_t *id, const kvw_msg_t *m)
{
    kvw_peer_t *old = peer_by_identity(e, id, KVW_IDENTITY_LEN);
    if (old)
        kvw__peer_kill(old, KVW_ERR_PEER, "decode engine reconnected");
    kvw_peer_t *p = NULL;
    char why[KVW_WIRE_REASON_MAX] = "";
    kvw_status_t st = kvw__peer_create(e, &p);
    if (!st && !(st = kvw__peer_accept_layout(p, m, why, sizeof(why))))
        st = kvw__qp_connect(p->qp, &m->u.hello.qp, &e->cfg);
    if (!st) {
        memcpy(p->id, id, KVW_IDENTITY_LEN);
        p->last_seen_ns = kvw__now_ns();
        atomic_store(&p->imm_limit, m->u.hello.recv_credits);
        atomic_store(&p->state, PEER_CONNECTED); /* not yet visible to other threads */
        pthread_mutex_lock(&e->lock);
        st = kvw__peer_publish_locked(e, p);
        pthread_mutex_unlock(&e->lock);
    }
    if (st) {
        reject_hello(e, id, st, why[0] ? why : kvw_strerror(st));
        kvw__peer_destroy(p);
        return;
    }
    kvw_msg_t ack;
    kvw__peer_hello(p, KVW_MSG_HELLO_ACK, &ack);
    kvw__zsend_to(e->router, id, KVW_IDENTITY_LEN, &ack);
    kvw__wire_free(&ack);
    KVW_INFO("decode engine %016llx connected as peer %u (QPN %u -> %u, %u receive credits)",
             (unsigned long long)m->u.hello.engine_id, p->index, p->qp->qp->qp_num,
             m->u.hello.qp.qpn, m->u.hello.recv_credits);
}

/* (lock) A request that decode's peer may not touch: it belongs to another
 * connection. */
static bool foreign_locked(const kvw_req_t *r, const kvw_peer_t *p)
{
    return r->peer && r->peer != p;
}

/* (lock) r already failed (bad source pages, abort, destroy, timeout)
 * before decode asked: nothing was posted, answer at once. */
static void answer_failed_locked(kvw_engine_t *e, kvw_req_t *r, kvw_peer_t *p, uint32_t token)
{
    send_failed(e, p, r->room, token, r->fail_status, r->fail_reason);
}

static void on_request(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX] = "";
    uint64_t room = m->u.request.room;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    if (r && (r->have_dst || foreign_locked(r, p))) {
        /* The room belongs to whoever claimed it first. A second claim is
         * refused to that claimer alone (its token): the first request's
         * writes go on. An exact resend of the first claim is dropped. */
        bool resend = r->peer == p && r->token == m->u.request.token;
        pthread_mutex_unlock(&e->lock);
        KVW_WARN("room %llu: %s from peer %u refused", (unsigned long long)room,
                 resend ? "repeated request" : "second claim", p->index);
        if (!resend)
            send_failed(e, p, room, m->u.request.token, KVW_ERR_EXISTS,
                        "the room is already claimed by another request");
        return;
    }
    if (r && atomic_load(&r->state) == KVW_POLL_FAILED) {
        answer_failed_locked(e, r, p, m->u.request.token);
        pthread_mutex_unlock(&e->lock);
        return;
    }
    if (!r) { /* decode asked before prefill created the sender: keep it */
        r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room);
        if (!r) {
            pthread_mutex_unlock(&e->lock);
            send_failed(e, p, room, m->u.request.token, KVW_ERR_NO_MEMORY,
                        "prefill is out of memory");
            return;
        }
    }
    kvw_status_t st = kvw__sender_accept_request_locked(r, p, m, why, sizeof(why));
    if (st && !r->have_dst) {
        /* Rejected before any write: fail the sender (a later one adopts the
         * failure) and tell decode now. */
        kvw__req_fail(r, st, "%s", why);
        send_failed(e, p, room, m->u.request.token, st, why);
    }
    pthread_mutex_unlock(&e->lock);
    if (st)
        KVW_ERROR("request for room %llu rejected before any write: %s", (unsigned long long)room,
                  why[0] ? why : kvw_strerror(st));
}

/* Decode gave a room up. Stop writing it; REQUEST_FAILED goes back once
 * every write posted for it has completed (see notify_failure_locked). */
static void on_abort(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    uint64_t room = m->u.failed.room;
    char why[KVW_WIRE_REASON_MAX];
    snprintf(why, sizeof(why), "decode gave the room up: %.120s", m->u.failed.reason);
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    if (r && (foreign_locked(r, p) || (r->have_dst && r->token != m->u.failed.token))) {
        pthread_mutex_unlock(&e->lock);
        KVW_WARN("room %llu: abort from peer %u for a request it does not own ignored",
                 (unsigned long long)room, p->index);
        return;
    }
    if (!r && !(r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room))) {
        pthread_mutex_unlock(&e->lock);
        return; /* out of memory: the sender fails by its own timeout */
    }
    if (!r->have_dst) { /* else both are set already, and the poller reads them */
        r->peer = p;
        r->token = m->u.failed.token;
    }
    kvw__req_fail(r, (kvw_status_t)m->status, "%s", why);
    /* Decode waits for this answer before reporting Failed, even when the
     * request had already succeeded here. */
    r->have_dst = true;
    r->notify_failure = true;
    kvw__wake(e->control_wake_fd);
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it */
}

static void on_credit(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    /* Cumulative, so only ever raise it: a reordered or stale CREDIT is harmless. */
    uint64_t cur = atomic_load(&p->imm_limit);
    while (m->u.credit.recvs_posted > cur &&
           !atomic_compare_exchange_weak(&p->imm_limit, &cur, m->u.credit.recvs_posted))
        ;
    kvw__wake(e->poller_wake_fd);
}

static void answer_dead_peer(kvw_engine_t *e, const uint8_t *id, size_t id_len, uint16_t type)
{
    kvw_peer_t *dead = peer_by_identity_any(e, id, id_len);
    if (!dead || type == KVW_MSG_BYE) {
        KVW_WARN("control: %s from an unknown peer dropped", kvw__wire_type_name(type));
        return;
    }
    /* Decode is still talking on a connection we killed: say so again (our
     * BYE may have been lost), so it fails its requests now. */
    pthread_mutex_lock(&e->lock);
    kvw_msg_t bye = failure_msg(KVW_MSG_BYE, 0, 0, dead->dead_status, dead->dead_reason);
    pthread_mutex_unlock(&e->lock);
    kvw__zsend_to(e->router, dead->id, sizeof(dead->id), &bye);
}

static void dispatch_prefill(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    switch (m->type) {
    case KVW_MSG_REQUEST:
        on_request(e, p, m);
        break;
    case KVW_MSG_ABORT:
        on_abort(e, p, m);
        break;
    case KVW_MSG_CREDIT:
        on_credit(e, p, m);
        break;
    case KVW_MSG_PING: {
        kvw_msg_t pong = {.type = KVW_MSG_PONG};
        pong.u.ping.engine_id = e->id;
        kvw__zsend_to(e->router, p->id, sizeof(p->id), &pong);
        break;
    }
    case KVW_MSG_BYE:
        kvw__peer_kill(p, (kvw_status_t)m->status, "decode closed the connection: %.120s",
                       m->u.failed.reason);
        break;
    default:
        KVW_WARN("control: unexpected %s from peer %u", kvw__wire_type_name(m->type), p->index);
    }
}

/* Drain every frame of the current multi-part message. */
static void skip_rest(void *sock)
{
    int more = 0;
    size_t len = sizeof(more);
    char sink[64];
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) == 0 && more)
        zmq_recv(sock, sink, sizeof(sink), 0);
}

static void serve_router(kvw_engine_t *e)
{
    for (;;) {
        uint8_t id[64];
        int id_len = zmq_recv(e->router, id, sizeof(id), ZMQ_DONTWAIT);
        if (id_len < 0)
            return;
        kvw_msg_t m;
        char why[KVW_WIRE_REASON_MAX] = "";
        kvw_status_t st = kvw__zrecv(e->router, &m, ZMQ_DONTWAIT, why, sizeof(why));
        skip_rest(e->router);
        if (st) {
            KVW_WARN("control: dropped a bad message: %s", why[0] ? why : kvw_strerror(st));
            continue;
        }
        kvw_peer_t *p = peer_by_identity(e, id, (size_t)id_len);
        if (p)
            p->last_seen_ns = kvw__now_ns();
        if (m.type == KVW_MSG_HELLO && id_len == KVW_IDENTITY_LEN)
            on_hello(e, id, &m);
        else if (!p)
            answer_dead_peer(e, id, (size_t)id_len, m.type);
        else
            dispatch_prefill(e, p, &m);
        kvw__wire_free(&m);
    }
}

/* A ROUTER cannot say which peer's connection closed; with
 * ZMQ_ROUTER_MANDATORY a send to an identity whose connection is gone
 * fails with EHOSTUNREACH, so probe each live peer with a PONG. */
static void probe_connections(kvw_engine_t *e)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = e->peers[i];
        if (atomic_load(&p->state) != PEER_CONNECTED)
            continue;
        kvw_msg_t pong = {.type = KVW_MSG_PONG};
        pong.u.ping.engine_id = e->id;
        if (kvw__zdropped(e->router, &pong))
            continue; /* a lost probe tells nothing */
        if (zmq_send(e->router, p->id, sizeof(p->id), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            if (errno == EHOSTUNREACH)
                kvw__peer_kill(p, KVW_ERR_PEER, "decode engine's control connection closed");
            continue;
        }
        kvw__zsend_raw(e->router, &pong, ZMQ_DONTWAIT);
    }
}

static void on_router_monitor(kvw_engine_t *e)
{
    int ev;
    bool disconnected = false;
    while ((ev = kvw__zmonitor_event(e->router_monitor)) != 0)
        disconnected |= ev == ZMQ_EVENT_DISCONNECTED;
    if (!disconnected)
        return;
    /* The router drops the identity's pipe a few command rounds after the
     * event: keep probing for a short window. */
    e->probe_until_ns = kvw__now_ns() + ms_to_ns(PROBE_WINDOW_MS);
    probe_connections(e);
}

/* (lock) Tell decode about failed senders whose writes have all drained. */
static void notify_failure_locked(kvw_engine_t *e, kvw_req_t *r)
{
    if (!r->notify_failure || !r->drained || !r->peer)
        return;
    r->notify_failure = false;
    if (atomic_load(&r->state) == KVW_POLL_FAILED)
        send_failed(e, r->peer, r->room, r->token, r->fail_status, r->fail_reason);
    else /* succeeded before decode's abort arrived: every write has landed */
        send_failed(e, r->peer, r->room, r->token, KVW_ERR_ABORTED,
                    "aborted after the transfer had completed");
}

/* (lock) Returns true when r should leave the list. */
static bool prefill_request_tick_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    int s = atomic_load(&r->state);
    notify_failure_locked(e, r);
    uint64_t first = atomic_load_explicit(&r->first_post_ns, memory_order_relaxed);
    /* first may be newer than now (the poller set it after this tick
     * began): compare without unsigned wrap-around. */
    if (s == KVW_POLL_TRANSFERRING && first && first < now && r->peer &&
        now - first > ms_to_ns(e->cfg.transfer_timeout_ms)) {
        /* RC completes in order: a request stuck this long means the
         * connection is stuck, not the request. */
        kvw__peer_kill_locked(r->peer, KVW_ERR_TIMEOUT, "room %llu: writes not complete in %u ms",
                              (unsigned long long)r->room, e->cfg.transfer_timeout_ms);
        return false;
    }
    if (!r->deadline_ns || now < r->deadline_ns)
        return false;
    r->deadline_ns = 0;
    if (r->has_user) {
        if (s == KVW_POLL_BOOTSTRAPPING)
            kvw__req_fail(r, KVW_ERR_TIMEOUT, "no request from decode within %u ms",
                          e->cfg.bootstrap_timeout_ms);
        return false;
    }
    if (!r->user_gone && s != KVW_POLL_FAILED && r->peer) {
        /* Decode's request was never claimed by a sender: tell decode, and
         * keep the failure a while for a sender that comes too late. */
        kvw__req_fail(r, KVW_ERR_TIMEOUT, "prefill created no sender for this room within %u ms",
                      e->cfg.bootstrap_timeout_ms);
        send_failed(e, r->peer, r->room, r->token, r->fail_status, r->fail_reason);
        r->deadline_ns = now + ms_to_ns(e->cfg.bootstrap_timeout_ms);
        return false;
    }
    if (!r->drained || r->notify_failure) {
        r->deadline_ns = now + ms_to_ns(TICK_MS); /* still owed an answer: look again */
        return false;
    }
    return true;
}

static void prefill_tick(kvw_engine_t *e, uint64_t now)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = e->peers[i];
        if (atomic_load(&p->state) == PEER_CONNECTED &&
            now - p->last_seen_ns > ms_to_ns(e->cfg.peer_timeout_ms))
            kvw__peer_kill(p, KVW_ERR_PEER, "decode engine silent for %u ms",
                           e->cfg.peer_timeout_ms);
    }
    if (e->probe_until_ns && now < e->probe_until_ns)
        probe_connections(e);
    else
        e->probe_until_ns = 0;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *next;
    for (kvw_req_t *r = e->reqs; r; r = next) {
        next = r->next;
        if (prefill_request_tick_locked(e, r, now))
            kvw__req_drop_locked(r);
    }
    pthread_mutex_unlock(&e->lock);
}

/* ================================================================ decode */

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

static void open_lookup(kvw_engine_t *e, kvw_peer_t *p)
{
    char ep[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(p->bootstrap_addr, ep, sizeof(ep));
    p->bs_sock = kvw__zsocket(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms);
    if (p->bs_sock && zmq_connect(p->bs_sock, ep) == 0)
        send_lookup(p);
    /* a failed connect shows up as a lookup timeout with a reason */
}

/* The endpoint the bootstrap service gave us does not answer (a prefill
 * that died, and maybe restarted elsewhere, leaves a stale registration):
 * drop it and ask again, until the peer's bootstrap deadline. */
static void restart_lookup(kvw_engine_t *e, kvw_peer_t *p, const char *why)
{
    if (!kvw__peer_transition(p, PEER_HELLO, PEER_LOOKUP))
        return;
    KVW_INFO("prefill rank %u: %s; looking it up again at %s", p->rank, why, p->bootstrap_addr);
    close_monitor(p);
    zmq_close(p->sock);
    p->sock = NULL;
    /* Not at once: until its successor registers, the service keeps
     * answering with the same stale endpoint. */
    char ep[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(p->bootstrap_addr, ep, sizeof(ep));
    p->bs_sock = kvw__zsocket(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms);
    if (p->bs_sock)
        zmq_connect(p->bs_sock, ep);
    p->next_ping_ns = kvw__now_ns() + ms_to_ns(LOOKUP_RETRY_MS);
}

static void peer_start_hello(kvw_engine_t *e, kvw_peer_t *p, const char *endpoint)
{
    zmq_close(p->bs_sock);
    p->bs_sock = NULL;
    p->sock = kvw__zsocket(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms);
    memcpy(p->id, &e->id, 8);
    memcpy(p->id + 8, &p->index, 4);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_ROUTING_ID, p->id, sizeof(p->id))) {
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot create a socket for prefill at %s: %s", endpoint,
                       zmq_strerror(errno));
        return;
    }
    char name[64];
    snprintf(name, sizeof(name), "%016llx-%u", (unsigned long long)e->id, p->index);
    /* Optional (heartbeats still work without it): a closed connection,
     * and a refused one while the handshake is pending. */
    p->monitor =
        kvw__zmonitor(e->zctx, p->sock, name, ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CONNECT_RETRIED);
    if (zmq_connect(p->sock, endpoint)) {
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot connect to prefill at %s: %s", endpoint,
                       zmq_strerror(errno));
        return;
    }
    /* Receives are posted once per QP; a repeated handshake reuses them. */
    if (!atomic_load(&p->recvs_posted) && kvw__peer_post_recvs(p, e->cfg.rq_depth)) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "cannot post receives");
        return;
    }
    atomic_store(&p->credits_sent, atomic_load(&p->recvs_posted)); /* HELLO carries them */
    kvw_msg_t hello;
    kvw__peer_hello(p, KVW_MSG_HELLO, &hello);
    kvw_status_t st = kvw__zsend(p->sock, &hello, ZMQ_DONTWAIT);
    kvw__wire_free(&hello);
    p->hello_retry_ns = kvw__now_ns() + ms_to_ns(e->cfg.peer_timeout_ms);
    if (st)
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot send handshake to %s", endpoint);
    else
        kvw__peer_transition(p, PEER_LOOKUP, PEER_HELLO);
}

static void on_bootstrap_reply(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    while (p->bs_sock && atomic_load(&p->state) == PEER_LOOKUP) {
        kvw_status_t st = kvw__zrecv(p->bs_sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
        if (st == KVW_ERR_NOT_FOUND)
            return;
        if (st || m.type != KVW_MSG_BS_LOOKUP_REPLY) {
            kvw__peer_kill(p, KVW_ERR_PROTOCOL, "bad bootstrap reply from %s: %s",
                           p->bootstrap_addr, st ? why : kvw__wire_type_name(m.type));
            if (!st)
                kvw__wire_free(&m);
            return;
        }
        if (m.status == KVW_OK)
            peer_start_hello(e, p, m.u.bs.endpoint);
        else /* not registered yet: the prefill may still be starting */
            p->next_ping_ns = kvw__now_ns() + ms_to_ns(LOOKUP_RETRY_MS);
    }
}

static void on_hello_ack(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX] = "";
    kvw_status_t st = (kvw_status_t)m->status;
    if (st) {
        kvw__peer_kill(p, st, "prefill rank %u refused the handshake: %s", p->rank,
                       kvw_strerror(st));
        return;
    }
    if ((st = kvw__peer_accept_layout(p, m, why, sizeof(why))) ||
        (st = kvw__qp_connect(p->qp, &m->u.hello.qp, &e->cfg))) {
        kvw__peer_kill(p, st, "handshake with prefill rank %u failed: %s", p->rank,
                       why[0] ? why : kvw_strerror(st));
        return;
    }
    uint64_t now = kvw__now_ns();
    p->last_seen_ns = now;
    p->next_ping_ns = now + ms_to_ns(e->cfg.heartbeat_ms);
    if (!kvw__peer_transition(p, PEER_HELLO, PEER_CONNECTED))
        return; /* killed meanwhile: stays dead */
    KVW_INFO("connected to prefill rank %u via %s as peer %u (QPN %u -> %u)", p->rank,
             p->bootstrap_addr, p->index, p->qp->qp->qp_num, m->u.hello.qp.qpn);
    kvw__wake(e->control_wake_fd); /* send the requests waiting for this peer */
}

/* Prefill says the room failed and that none of its writes can still land. */
static void on_request_failed(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_DECODE, m->u.failed.room);
    if (r && r->peer == p && r->token == m->u.failed.token) {
        if (r->aborting)
            kvw__req_fail(r, r->abort_status, "%s", r->abort_reason);
        else
            kvw__req_fail(r, (kvw_status_t)m->status, "prefill: %s", m->u.failed.reason);
    }
    pthread_mutex_unlock(&e->lock);
}

static void on_prefill_message(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    while (p->sock && atomic_load(&p->state) != PEER_DEAD) {
        kvw_status_t st = kvw__zrecv(p->sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
        skip_rest(p->sock);
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
        else if (m.type == KVW_MSG_BYE)
            kvw__peer_kill(p, (kvw_status_t)m.status,
                           "prefill rank %u closed the connection: "
                           "%.100s",
                           p->rank, m.u.failed.reason);
        else if (m.type != KVW_MSG_PONG)
            KVW_WARN("unexpected %s from prefill rank %u", kvw__wire_type_name(m.type), p->rank);
        kvw__wire_free(&m);
    }
}

static void on_decode_monitor(kvw_engine_t *e, kvw_peer_t *p)
{
    int ev;
    while (p->monitor && (ev = kvw__zmonitor_event(p->monitor)) != 0) {
        bool lost = ev == ZMQ_EVENT_DISCONNECTED || ev == ZMQ_EVENT_CONNECT_RETRIED;
        if (lost && atomic_load(&p->state) == PEER_HELLO)
            restart_lookup(e, p, "its endpoint refused or dropped the handshake");
        else if (ev == ZMQ_EVENT_DISCONNECTED)
            kvw__peer_kill(p, KVW_ERR_PEER, "prefill rank %u's control connection closed", p->rank);
    }
}

static kvw_peer_t *find_decode_peer_locked(kvw_engine_t *e, const kvw_req_t *r)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = np; i-- > 0;) {
        kvw_peer_t *p = e->peers[i];
        if (p->rank == r->prefill_rank && atomic_load(&p->state) != PEER_DEAD &&
            strcmp(p->bootstrap_addr, r->bootstrap_addr) == 0)
            return p;
    }
    return NULL;
}

/* A new peer starts with an asynchronous bootstrap lookup. */
static kvw_peer_t *new_decode_peer_locked(kvw_engine_t *e, const kvw_req_t *r)
{
    kvw_peer_t *p = NULL;
    if (kvw__peer_create(e, &p))
        return NULL;
    p->rank = r->prefill_rank;
    snprintf(p->bootstrap_addr, sizeof(p->bootstrap_addr), "%s", r->bootstrap_addr);
    atomic_store(&p->state, PEER_LOOKUP);
    p->deadline_ns = kvw__now_ns() + ms_to_ns(e->cfg.bootstrap_timeout_ms);
    if (kvw__peer_publish_locked(e, p)) {
        kvw__peer_destroy(p);
        return NULL;
    }
    open_lookup(e, p);
    return p;
}

static void send_request_locked(kvw_engine_t *e, kvw_req_t *r)
{
    kvw_msg_t m = {.type = KVW_MSG_REQUEST};
    m.u.request.room = r->room;
    m.u.request.token = r->token;
    m.u.request.aux_index = r->aux;
    m.u.request.num_pages = (uint32_t)r->npages;
    m.u.request.pages = r->pages;
    r->request_due = false;
    if (kvw__zsend(r->peer->sock, &m, ZMQ_DONTWAIT)) {
        kvw__req_fail(r, KVW_ERR_CONTROL, "cannot send the request to prefill rank %u",
                      r->prefill_rank);
        r->abort_due = true; /* prefill may have it after all */
        return;
    }
    r->request_sent = true;
    atomic_store(&r->state, KVW_POLL_TRANSFERRING);
    r->deadline_ns = kvw__now_ns() + ms_to_ns(e->cfg.transfer_timeout_ms);
}

static void send_abort_locked(kvw_req_t *r)
{
    const char *why = r->aborting ? r->abort_reason : r->fail_reason;
    kvw_status_t st = r->aborting ? r->abort_status : r->fail_status;
    kvw_msg_t m = failure_msg(KVW_MSG_ABORT, r->room, r->token, st, why);
    if (kvw__zsend(r->peer->sock, &m, ZMQ_DONTWAIT) == KVW_OK)
        r->abort_due = false; /* else retried on the next tick */
}

/* (lock) Returns the peer r should use, creating the connection if needed;
 * NULL (and r Failed) when none can be made. */
static kvw_peer_t *receiver_peer_locked(kvw_engine_t *e, kvw_req_t *r)
{
    if (!r->peer && !(r->peer = find_decode_peer_locked(e, r)) &&
        !(r->peer = new_decode_peer_locked(e, r))) {
        kvw__req_fail(r, KVW_ERR_NO_MEMORY, "cannot create a connection to prefill");
        r->abort_due = false;
    }
    return r->peer;
}

static void receiver_deadline_locked(kvw_engine_t *e, kvw_req_t *r, int s)
{
    if (r->aborting) {
        /* No confirmation: only a dead connection guarantees nothing lands. */
        kvw__peer_kill_locked(r->peer, KVW_ERR_TIMEOUT,
                              "room %llu: prefill did not confirm the abort within %u ms",
                              (unsigned long long)r->room, e->cfg.peer_timeout_ms);
    } else if (s == KVW_POLL_TRANSFERRING) {
        char why[KVW_WIRE_REASON_MAX];
        snprintf(why, sizeof(why), "data did not land within %u ms", e->cfg.transfer_timeout_ms);
        kvw__receiver_start_abort_locked(r, KVW_ERR_TIMEOUT, why);
    } else if (s == KVW_POLL_BOOTSTRAPPING) {
        r->deadline_ns = 0;
        kvw__req_fail(r, KVW_ERR_TIMEOUT, "not connected to prefill rank %u within %u ms",
                      r->prefill_rank, e->cfg.bootstrap_timeout_ms);
    }
}

/* (lock) Returns true when r should leave the list. */
static bool service_receiver_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    int s = atomic_load(&r->state);
    bool ended = s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS;
    if (ended && !r->abort_due)
        return r->user_gone;
    if (r->user_gone && r->deadline_ns && now > r->deadline_ns)
        return true; /* an ABORT we could not deliver in time */
    kvw_peer_t *p = receiver_peer_locked(e, r);
    if (!p)
        return r->user_gone;
    int ps = atomic_load(&p->state);
    if (ps == PEER_DEAD) {
        kvw__req_fail(r, KVW_ERR_PEER, "%s", p->dead_reason);
        r->abort_due = false;
        return r->user_gone;
    }
    if (ps == PEER_CONNECTED) {
        if (s == KVW_POLL_BOOTSTRAPPING)
            atomic_store(&r->state, KVW_POLL_WAITING_FOR_INPUT);
        if (r->request_due && !ended)
            send_request_locked(e, r);
        if (r->abort_due)
            send_abort_locked(r);
    }
    if (!ended && !r->user_gone && r->deadline_ns && now > r->deadline_ns)
        receiver_deadline_locked(e, r, atomic_load(&r->state));
    return false;
}

static void send_credits(kvw_engine_t *e, kvw_peer_t *p, bool force)
{
    uint64_t posted = atomic_load(&p->recvs_posted), sent = atomic_load(&p->credits_sent);
    if (posted == sent || (!force && posted - sent < (e->cfg.rq_depth + 3) / 4))
        return;
    kvw_msg_t m = {.type = KVW_MSG_CREDIT};
    m.u.credit.recvs_posted = posted;
    if (kvw__zsend(p->sock, &m, ZMQ_DONTWAIT) == KVW_OK)
        atomic_store(&p->credits_sent, posted);
}

static void decode_peer_tick(kvw_engine_t *e, kvw_peer_t *p, uint64_t now)
{
    int s = atomic_load(&p->state);
    if (s == PEER_LOOKUP || s == PEER_HELLO) {
        if (now > p->deadline_ns)
            kvw__peer_kill(p, KVW_ERR_TIMEOUT,
                           "no handshake with prefill rank %u via bootstrap %s within %u ms",
                           p->rank, p->bootstrap_addr, e->cfg.bootstrap_timeout_ms);
        else if (s == PEER_LOOKUP && p->next_ping_ns && now > p->next_ping_ns) {
            p->next_ping_ns = 0;
            send_lookup(p);
        } else if (s == PEER_HELLO && now > p->hello_retry_ns) {
            restart_lookup(e, p, "no answer to the handshake");
        }
    } else if (s == PEER_CONNECTED) {
        if (now - p->last_seen_ns > ms_to_ns(e->cfg.peer_timeout_ms)) {
            kvw__peer_kill(p, KVW_ERR_PEER, "prefill rank %u silent for %u ms", p->rank,
                           e->cfg.peer_timeout_ms);
            return;
        }
        bool ping_due = now >= p->next_ping_ns;
        send_credits(e, p, ping_due);
        if (ping_due) {
            kvw_msg_t ping = {.type = KVW_MSG_PING};
            ping.u.ping.engine_id = e->id;
            kvw__zsend(p->sock, &ping, ZMQ_DONTWAIT);
            p->next_ping_ns = now + ms_to_ns(e->cfg.heartbeat_ms);
        }
    }
}

static void decode_tick(kvw_engine_t *e, uint64_t now)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++)
        decode_peer_tick(e, e->peers[i], now);
    pthread_mutex_lock(&e->lock);
    kvw_req_t *next;
    for (kvw_req_t *r = e->reqs; r; r = next) {
        next = r->next;
        if (service_receiver_locked(e, r, now))
            kvw__req_drop_locked(r);
    }
    pthread_mutex_unlock(&e->lock);
}

/* ========================================================== both roles */

/* A connection we declared dead: tell the other side why (best effort),
 * then (decode) close the socket so prefill's monitor sees it go too. */
static void say_bye(kvw_engine_t *e, kvw_peer_t *p)
{
    if (!atomic_exchange(&p->bye_due, false))
        return;
    pthread_mutex_lock(&e->lock);
    kvw_msg_t bye = failure_msg(KVW_MSG_BYE, 0, 0, p->dead_status, p->dead_reason);
    pthread_mutex_unlock(&e->lock);
    if (e->role == KVW_ROLE_PREFILL) {
        kvw__zsend_to(e->router, p->id, sizeof(p->id), &bye);
        return;
    }
    close_monitor(p);
    if (p->sock) {
        kvw__zsend(p->sock, &bye, ZMQ_DONTWAIT);
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

/* ================================================================= loop */

typedef enum {
    ITEM_WAKE,
    ITEM_ROUTER,
    ITEM_ROUTER_MONITOR,
    ITEM_BOOTSTRAP,
    ITEM_PEER,
    ITEM_PEER_MONITOR
} item_kind_t;

typedef struct poll_set {
    zmq_pollitem_t items[MAX_ITEMS];
    kvw_peer_t *peer[MAX_ITEMS];
    item_kind_t kind[MAX_ITEMS];
    int n;
} poll_set_t;

static void add_item(poll_set_t *ps, void *sock, int fd, kvw_peer_t *p, item_kind_t kind)
{
    ps->items[ps->n] = (zmq_pollitem_t){sock, fd, ZMQ_POLLIN, 0};
    ps->peer[ps->n] = p;
    ps->kind[ps->n] = kind;
    ps->n++;
}

static void build_poll_set(kvw_engine_t *e, poll_set_t *ps)
{
    ps->n = 0;
    add_item(ps, NULL, e->control_wake_fd, NULL, ITEM_WAKE);
    if (e->router)
        add_item(ps, e->router, 0, NULL, ITEM_ROUTER);
    if (e->router_monitor)
        add_item(ps, e->router_monitor, 0, NULL, ITEM_ROUTER_MONITOR);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = e->peers[i];
        say_bye(e, p);
        if (atomic_load(&p->state) == PEER_DEAD)
            continue;
        if (p->bs_sock)
            add_item(ps, p->bs_sock, 0, p, ITEM_BOOTSTRAP);
        if (p->sock)
            add_item(ps, p->sock, 0, p, ITEM_PEER);
        if (p->monitor)
            add_item(ps, p->monitor, 0, p, ITEM_PEER_MONITOR);
    }
}

static void serve_item(kvw_engine_t *e, poll_set_t *ps, int i)
{
    switch (ps->kind[i]) {
    case ITEM_WAKE: {
        uint64_t v;
        if (read(e->control_wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
            KVW_WARN("control wake read failed: %s", strerror(errno));
        break;
    }
    case ITEM_ROUTER:
        serve_router(e);
        break;
    case ITEM_ROUTER_MONITOR:
        on_router_monitor(e);
        break;
    case ITEM_BOOTSTRAP:
        on_bootstrap_reply(e, ps->peer[i]);
        break;
    case ITEM_PEER:
        on_prefill_message(e, ps->peer[i]);
        break;
    case ITEM_PEER_MONITOR:
        on_decode_monitor(e, ps->peer[i]);
        break;
    }
}

void *kvw__control_main(void *arg)
{
    kvw_engine_t *e = arg;
    poll_set_t *ps = calloc(1, sizeof(*ps));
    if (!ps) {
        KVW_ERROR("control thread: out of memory");
        return NULL;
    }
    while (!atomic_load(&e->stop)) {
        build_poll_set(e, ps);
        long timeout = e->probe_until_ns ? PROBE_TICK_MS : TICK_MS;
        if (zmq_poll(ps->items, ps->n, timeout) < 0 && errno != EINTR)
            KVW_WARN("zmq_poll failed: %s", zmq_strerror(errno));
        for (int i = 0; i < ps->n; i++)
            if (ps->items[i].revents & ZMQ_POLLIN)
                serve_item(e, ps, i);
        uint64_t now = kvw__now_ns();
        if (e->role == KVW_ROLE_PREFILL)
            prefill_tick(e, now);
        else
            decode_tick(e, now);
    }
    free(ps);
    return NULL;
}
