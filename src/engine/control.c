/* The control thread: the engine's only user of ZeroMQ. Prefill serves a
 * ROUTER socket (handshakes, requests, pings); decode dials one DEALER per
 * prefill peer after an asynchronous bootstrap lookup. Every tick it also
 * enforces the timeouts, so a dead peer turns into Failed in bounded time. */
#include "engine/engine.h"

#include "common/log.h"
#include "ctrl/zsock.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { TICK_MS = 100, LOOKUP_RETRY_MS = 200, MAX_ITEMS = 2 + 2 * KVW_MAX_PEERS };

static uint64_t ms_to_ns(uint32_t ms)
{
    return (uint64_t)ms * 1000000ull;
}

static void send_failed(kvw_engine_t *e, const kvw_peer_t *p, uint64_t room, kvw_status_t st,
                        const char *why)
{
    kvw_msg_t m = {.type = KVW_MSG_REQUEST_FAILED, .status = st};
    m.u.failed.room = room;
    snprintf(m.u.failed.reason, sizeof(m.u.failed.reason), "%s", why);
    kvw__zsend_to(e->router, p->id, sizeof(p->id), &m);
}

/* =============================================================== prefill */

static kvw_peer_t *peer_by_identity(kvw_engine_t *e, const uint8_t *id, size_t len)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = np; i-- > 0;) /* newest first: a reconnect replaces */
        if (len == KVW_IDENTITY_LEN && memcmp(e->peers[i]->id, id, len) == 0 &&
            atomic_load(&e->peers[i]->state) != PEER_DEAD)
            return e->peers[i];
    return NULL;
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
        atomic_store(&p->state, PEER_CONNECTED);
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
    KVW_INFO("decode engine %016llx connected as peer %u (QPN %u -> %u)",
             (unsigned long long)m->u.hello.engine_id, p->index, p->qp->qp->qp_num,
             m->u.hello.qp.qpn);
}

static void on_request(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX] = "";
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, m->u.request.room);
    bool orphan = !r;
    if (orphan) /* decode asked before prefill created the sender: keep it */
        r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, m->u.request.room);
    kvw_status_t st = r ? kvw__sender_accept_request_locked(r, p, m, why, sizeof(why))
                        : KVW_ERR_NO_MEMORY;
    if (st && r && !orphan && st != KVW_ERR_EXISTS)
        kvw__req_fail(r, st, "%s", why);
    if (st && r && orphan)
        kvw__req_drop_locked(r);
    pthread_mutex_unlock(&e->lock);
    if (st) {
        KVW_ERROR("request for room %llu rejected before any write: %s",
                  (unsigned long long)m->u.request.room, why);
        send_failed(e, p, m->u.request.room, st, why[0] ? why : kvw_strerror(st));
    }
}

static void serve_router(kvw_engine_t *e)
{
    for (;;) {
        uint8_t id[64];
        int id_len = zmq_recv(e->router, id, sizeof(id), ZMQ_DONTWAIT);
        if (id_len < 0)
            return;
        kvw_msg_t m;
        char why[KVW_WIRE_REASON_MAX];
        kvw_status_t st = kvw__zrecv(e->router, &m, ZMQ_DONTWAIT, why, sizeof(why));
        if (st) {
            KVW_WARN("control: dropped a bad message: %s", why);
            continue;
        }
        kvw_peer_t *p = peer_by_identity(e, id, (size_t)id_len);
        if (p)
            p->last_seen_ns = kvw__now_ns();
        if (m.type == KVW_MSG_HELLO && id_len == KVW_IDENTITY_LEN) {
            on_hello(e, id, &m);
        } else if (!p) {
            KVW_WARN("control: %s from an unknown or dead peer dropped",
                     kvw__wire_type_name(m.type));
        } else if (m.type == KVW_MSG_REQUEST) {
            on_request(e, p, &m);
        } else if (m.type == KVW_MSG_PING) {
            kvw_msg_t pong = {.type = KVW_MSG_PONG};
            pong.u.ping.engine_id = e->id;
            kvw__zsend_to(e->router, p->id, sizeof(p->id), &pong);
        } else {
            KVW_WARN("control: unexpected %s from peer %u", kvw__wire_type_name(m.type),
                     p->index);
        }
        kvw__wire_free(&m);
    }
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
    pthread_mutex_lock(&e->lock);
    kvw_req_t *next;
    for (kvw_req_t *r = e->reqs; r; r = next) {
        next = r->next;
        int s = atomic_load(&r->state);
        if (r->notify_failure && r->peer) {
            r->notify_failure = false;
            send_failed(e, r->peer, r->room, r->fail_status, r->fail_reason);
        }
        if (!r->deadline_ns || now < r->deadline_ns)
            continue;
        if (s == KVW_POLL_BOOTSTRAPPING && r->has_user) {
            kvw__req_fail(r, KVW_ERR_TIMEOUT, "no request from decode within %u ms",
                          e->cfg.bootstrap_timeout_ms);
            r->deadline_ns = 0;
        } else if (!r->has_user && !r->user_gone) {
            /* decode's request was never claimed by a sender */
            if (r->peer)
                send_failed(e, r->peer, r->room, KVW_ERR_TIMEOUT,
                            "prefill created no sender for this room in time");
            kvw__req_drop_locked(r);
        } else if (s == KVW_POLL_TRANSFERRING && r->peer) {
            r->deadline_ns = 0;
            pthread_mutex_unlock(&e->lock);
            kvw__peer_kill(r->peer, KVW_ERR_TIMEOUT, "room %llu: writes not complete in %u ms",
                           (unsigned long long)r->room, e->cfg.transfer_timeout_ms);
            pthread_mutex_lock(&e->lock);
            next = e->reqs; /* the list may have changed while unlocked */
        }
    }
    pthread_mutex_unlock(&e->lock);
}

/* ================================================================ decode */

static void peer_start_hello(kvw_engine_t *e, kvw_peer_t *p, const char *endpoint)
{
    zmq_close(p->bs_sock);
    p->bs_sock = NULL;
    p->sock = kvw__zsocket(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms);
    memcpy(p->id, &e->id, 8);
    memcpy(p->id + 8, &p->index, 4);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_ROUTING_ID, p->id, sizeof(p->id)) ||
        zmq_connect(p->sock, endpoint)) {
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot connect to prefill at %s: %s", endpoint,
                       zmq_strerror(errno));
        return;
    }
    if (kvw__peer_post_recvs(p, e->cfg.rq_depth)) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "cannot post receives");
        return;
    }
    kvw_msg_t hello;
    kvw__peer_hello(p, KVW_MSG_HELLO, &hello);
    kvw_status_t st = kvw__zsend(p->sock, &hello, ZMQ_DONTWAIT);
    kvw__wire_free(&hello);
    if (st)
        kvw__peer_kill(p, KVW_ERR_CONTROL, "cannot send handshake to %s", endpoint);
    else
        atomic_store(&p->state, PEER_HELLO);
}

static void send_lookup(kvw_peer_t *p)
{
    kvw_msg_t m = {.type = KVW_MSG_BS_LOOKUP};
    m.u.bs.rank = p->rank;
    kvw__zsend(p->bs_sock, &m, ZMQ_DONTWAIT);
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
    atomic_store(&p->state, PEER_CONNECTED);
    KVW_INFO("connected to prefill rank %u via %s as peer %u (QPN %u -> %u)", p->rank,
             p->bootstrap_addr, p->index, p->qp->qp->qp_num, m->u.hello.qp.qpn);
}

static void on_request_failed(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_DECODE, m->u.failed.room);
    if (r && r->peer == p)
        kvw__req_fail(r, (kvw_status_t)m->status, "prefill: %s", m->u.failed.reason);
    pthread_mutex_unlock(&e->lock);
}

static void on_prefill_message(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_msg_t m;
    char why[KVW_WIRE_REASON_MAX];
    while (p->sock && atomic_load(&p->state) != PEER_DEAD) {
        kvw_status_t st = kvw__zrecv(p->sock, &m, ZMQ_DONTWAIT, why, sizeof(why));
        if (st == KVW_ERR_NOT_FOUND)
            return;
        if (st) {
            kvw__peer_kill(p, KVW_ERR_PROTOCOL, "bad message from prefill rank %u: %s",
                           p->rank, why);
            return;
        }
        p->last_seen_ns = kvw__now_ns();
        if (m.type == KVW_MSG_HELLO_ACK && atomic_load(&p->state) == PEER_HELLO)
            on_hello_ack(e, p, &m);
        else if (m.type == KVW_MSG_REQUEST_FAILED)
            on_request_failed(e, p, &m);
        else if (m.type != KVW_MSG_PONG)
            KVW_WARN("unexpected %s from prefill rank %u", kvw__wire_type_name(m.type),
                     p->rank);
        kvw__wire_free(&m);
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
    char ep[KVW_WIRE_ENDPOINT_MAX];
    if (kvw__peer_create(e, &p) || kvw__peer_publish_locked(e, p)) {
        kvw__peer_destroy(p);
        return NULL;
    }
    p->rank = r->prefill_rank;
    snprintf(p->bootstrap_addr, sizeof(p->bootstrap_addr), "%s", r->bootstrap_addr);
    atomic_store(&p->state, PEER_LOOKUP);
    p->deadline_ns = kvw__now_ns() + ms_to_ns(e->cfg.bootstrap_timeout_ms);
    kvw__zendpoint(p->bootstrap_addr, ep, sizeof(ep));
    p->bs_sock = kvw__zsocket(e->zctx, ZMQ_DEALER, e->cfg.heartbeat_ms);
    if (p->bs_sock && zmq_connect(p->bs_sock, ep) == 0)
        send_lookup(p);
    return p; /* a failed connect shows up as a lookup timeout with a reason */
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
        return;
    }
    atomic_store(&r->state, KVW_POLL_TRANSFERRING);
    r->deadline_ns = kvw__now_ns() + ms_to_ns(e->cfg.transfer_timeout_ms);
}

static void service_receiver_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    int s = atomic_load(&r->state);
    if (s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS)
        return;
    if (!r->peer && !(r->peer = find_decode_peer_locked(e, r)) &&
        !(r->peer = new_decode_peer_locked(e, r))) {
        kvw__req_fail(r, KVW_ERR_NO_MEMORY, "cannot create a connection to prefill");
        return;
    }
    if (atomic_load(&r->peer->state) == PEER_CONNECTED) {
        if (s == KVW_POLL_BOOTSTRAPPING)
            atomic_store(&r->state, KVW_POLL_WAITING_FOR_INPUT);
        if (r->request_due)
            send_request_locked(e, r);
    } else if (atomic_load(&r->peer->state) == PEER_DEAD) {
        kvw__req_fail(r, KVW_ERR_PEER, "%s", r->peer->dead_reason);
    }
    if (r->deadline_ns && now > r->deadline_ns) {
        if (s == KVW_POLL_TRANSFERRING) {
            r->deadline_ns = 0;
            /* Fail the QP too, so no late write can land in pages the
             * caller will reuse. */
            kvw__qp_set_error(r->peer->qp);
            kvw__req_fail(r, KVW_ERR_TIMEOUT, "data did not land within %u ms",
                          e->cfg.transfer_timeout_ms);
        } else if (s != KVW_POLL_WAITING_FOR_INPUT) {
            kvw__req_fail(r, KVW_ERR_TIMEOUT, "not connected to prefill rank %u within %u ms",
                          r->prefill_rank, e->cfg.bootstrap_timeout_ms);
        }
    }
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
        }
    } else if (s == PEER_CONNECTED) {
        if (now - p->last_seen_ns > ms_to_ns(e->cfg.peer_timeout_ms)) {
            kvw__peer_kill(p, KVW_ERR_PEER, "prefill rank %u silent for %u ms", p->rank,
                           e->cfg.peer_timeout_ms);
        } else if (now >= p->next_ping_ns) {
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
    for (kvw_req_t *r = e->reqs; r; r = r->next)
        service_receiver_locked(e, r, now);
    pthread_mutex_unlock(&e->lock);
}

/* ================================================================= loop */

typedef struct poll_set {
    zmq_pollitem_t items[MAX_ITEMS];
    kvw_peer_t *peer[MAX_ITEMS];
    bool bootstrap[MAX_ITEMS];
    int n;
} poll_set_t;

static void add_item(poll_set_t *ps, void *sock, int fd, kvw_peer_t *p, bool bs)
{
    ps->items[ps->n] = (zmq_pollitem_t){sock, fd, ZMQ_POLLIN, 0};
    ps->peer[ps->n] = p;
    ps->bootstrap[ps->n] = bs;
    ps->n++;
}

static void build_poll_set(kvw_engine_t *e, poll_set_t *ps)
{
    ps->n = 0;
    add_item(ps, NULL, e->control_wake_fd, NULL, false);
    if (e->router)
        add_item(ps, e->router, 0, NULL, false);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = e->peers[i];
        if (atomic_load(&p->state) == PEER_DEAD)
            continue;
        if (p->bs_sock)
            add_item(ps, p->bs_sock, 0, p, true);
        if (p->sock)
            add_item(ps, p->sock, 0, p, false);
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
        if (zmq_poll(ps->items, ps->n, TICK_MS) < 0 && errno != EINTR)
            KVW_WARN("zmq_poll failed: %s", zmq_strerror(errno));
        uint64_t v;
        if ((ps->items[0].revents & ZMQ_POLLIN) &&
            read(e->control_wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
            KVW_WARN("control wake read failed: %s", strerror(errno));
        for (int i = 1; i < ps->n; i++) {
            if (!(ps->items[i].revents & ZMQ_POLLIN))
                continue;
            if (!ps->peer[i])
                serve_router(e);
            else if (ps->bootstrap[i])
                on_bootstrap_reply(e, ps->peer[i]);
            else
                on_prefill_message(e, ps->peer[i]);
        }
        uint64_t now = kvw__now_ns();
        if (e->role == KVW_ROLE_PREFILL)
            prefill_tick(e, now);
        else
            decode_tick(e, now);
    }
    free(ps);
    return NULL;
}
