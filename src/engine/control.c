/* SPDX-License-Identifier: Apache-2.0 */
/* The control thread: the engine's only user of ZeroMQ. Prefill serves a
 * ROUTER socket (handshakes, requests, aborts, pings; ctl_prefill.c);
 * decode dials one DEALER per prefill peer after an asynchronous bootstrap
 * lookup (ctl_decode.c). This file is the loop; ctl_frame.c the framing.
 *
 * Event-driven: the thread sleeps until a socket is readable, another
 * thread queues a request for it (kvw__req_touch_locked), or the earliest
 * deadline (the request heap, the peers' heartbeats) is due. It never scans
 * the request table on a timer, so an idle engine costs nothing and
 * thousands of requests in flight cost only their own events.
 *
 * Death detection, fastest first: a peer process that exits closes its TCP
 * connection, which the sockets' monitors report at once; a peer that kills
 * the connection says BYE; a silent peer (host or link gone) misses
 * heartbeats for peer_timeout_ms. */
#include "engine/control.h"

#include "common/log.h"
#include "ctrl/bootstrap.h"
#include "ctrl/zsock.h"
#include "engine/rails/rails.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ================================================================ BYE */

/* A connection we declared dead: tell the other side why (best effort). */
static void say_bye(kvw_engine_t *e, kvw_peer_t *p)
{
    if (!atomic_load(&p->bye_due))
        return;
    if (atomic_load(&p->ctl_gone)) { /* nobody left to tell (an engine that exits, say) */
        atomic_store(&p->bye_due, false);
        return;
    }
    pthread_mutex_lock(&e->lock);
    kvw_msg_t bye = kvw__failure_msg(KVW_MSG_BYE, 0, 0, p->dead_status, p->dead_reason);
    pthread_mutex_unlock(&e->lock);
    if (e->role == KVW_ROLE_PREFILL)
        kvw__prefill_say_bye(e, p, &bye);
    else
        kvw__decode_say_bye(e, p, &bye);
    atomic_store(&p->bye_due, false); /* last: the peer may be reclaimed after this */
}

/* ======================================================== device events */

/* The connection one of whose QPs (or CQs) an event names, or NULL. */
static kvw_peer_t *peer_of_event(kvw_engine_t *e, const struct ibv_async_event *ev)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        for (uint32_t j = 0; p && j < p->nlanes; j++) {
            const kvw_qp_t *q = p->lanes[j].qp;
            if (q && ((ev->event_type == IBV_EVENT_CQ_ERR && q->cq == ev->element.cq) ||
                      (ev->event_type != IBV_EVENT_CQ_ERR && q->qp == ev->element.qp)))
                return p;
        }
    }
    return NULL;
}

static void kill_all_peers(kvw_engine_t *e, const char *why)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && atomic_load(&p->state) != PEER_DEAD)
            kvw__peer_kill(p, KVW_ERR_VERBS, "%s", why);
    }
}

/* A rail's port went down on an engine with several: every lane on it
 * to ERR, so that its writes complete (flushed) now rather than after the
 * retries, and the poller fails them over to the other rails (or fails
 * the connection when no other rail is left). Verbs calls, no lock. */
static void rail_down(kvw_engine_t *e, const kvw_dev_t *dev, const char *why)
{
    KVW_ERROR("%s: its lanes fail over to the other rails", why);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        for (uint32_t j = 0; p && atomic_load(&p->state) != PEER_DEAD && j < p->nlanes; j++)
            if (e->rail[p->lanes[j].rail].dev == dev) {
                kvw__qp_set_error(p->lanes[j].qp);
                kvw__lane_mark_down(p, j, KVW_DOWN_PORT);
                if (e->role == KVW_ROLE_DECODE) /* prefill's writes would run out of retries */
                    kvw__rejoin_say_down(p, j);
            }
    }
    kvw__wake(e->poller_wake_fd);
}

/* What one event asks of us: a connection to fail (*peer_p), every
 * connection to fail (returns true), or nothing. why gets the reason. */
static bool judge_async_event(kvw_engine_t *e, const kvw_dev_t *dev,
                              const struct ibv_async_event *ev, kvw_peer_t **peer_p, char *why,
                              size_t size)
{
    const char *name = ibv_event_type_str(ev->event_type);
    *peer_p = NULL;
    switch (ev->event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_CQ_ERR:
        *peer_p = peer_of_event(e, ev);
        snprintf(why, size, "%s: %s", dev->name, name);
        return false;
    case IBV_EVENT_PORT_ERR:
        if (ev->element.port_num != dev->port)
            return false;
        snprintf(why, size, "%s port %u went down (%s)", dev->name, dev->port, name);
        if (e->nrails > 1) { /* one rail of several: its lanes fail over */
            rail_down(e, dev, why);
            return false;
        }
        return true;
    case IBV_EVENT_DEVICE_FATAL:
        snprintf(why, size, "%s: %s", dev->name, name);
        return true;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_GID_CHANGE:
    case IBV_EVENT_LID_CHANGE:
        KVW_WARN("%s port %u: %s", dev->name, ev->element.port_num, name);
        if (ev->event_type == IBV_EVENT_PORT_ACTIVE && ev->element.port_num == dev->port &&
            e->nrails > 1) /* its lanes out can rejoin */
            kvw__rejoin_rail_up(e, dev);
        return false;
    default:
        return false;
    }
}

/* The device's asynchronous events (ibv_get_async_event(3)). Without them
 * a QP the device declared fatal, or a port that went down, would only be
 * noticed by each posted write running out of retries (7 x the ACK
 * timeout, seconds), and requests not yet posted would learn nothing. The
 * event is acknowledged before acting on it: destroying a QP waits for
 * its events to be acknowledged. */
static void serve_async_events(kvw_engine_t *e, const kvw_dev_t *dev)
{
    struct ibv_async_event ev;
    while (dev->ops->get_async_event(dev->ctx, &ev) == 0) {
        char why[KVW_WIRE_REASON_MAX] = "";
        kvw_peer_t *p = NULL;
        bool all = judge_async_event(e, dev, &ev, &p, why, sizeof(why));
        dev->ops->ack_async_event(&ev);
        if (all) {
            KVW_ERROR("%s: failing every connection", why);
            kill_all_peers(e, why);
        } else if (p && atomic_load(&p->state) != PEER_DEAD) {
            kvw__peer_kill(p, KVW_ERR_VERBS, "%s", why);
        }
    }
}

/* ================================================================= loop */

typedef enum {
    ITEM_WAKE,
    ITEM_ASYNC,
    ITEM_ROUTER,
    ITEM_ROUTER_MONITOR,
    ITEM_REGISTRAR,
    ITEM_BOOTSTRAP,
    ITEM_PEER,
    ITEM_PEER_MONITOR
} item_kind_t;

typedef struct poll_set {
    zmq_pollitem_t *items;
    kvw_peer_t **peer;
    item_kind_t *kind;
    int n, cap;
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
    for (uint32_t r = 0; r < e->nrails; r++) /* every rail's device events */
        if (e->rail[r].dev->ctx->async_fd >= 0)
            add_item(ps, NULL, e->rail[r].dev->ctx->async_fd, NULL, ITEM_ASYNC);
    if (e->router)
        add_item(ps, e->router, 0, NULL, ITEM_ROUTER);
    if (e->router_monitor)
        add_item(ps, e->router_monitor, 0, NULL, ITEM_ROUTER_MONITOR);
    if (e->ctl->registrar)
        add_item(ps, kvw__registrar_socket(e->ctl->registrar), 0, NULL, ITEM_REGISTRAR);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p)
            continue;
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
    case ITEM_ASYNC: /* the rail whose device's fd it is */
        for (uint32_t r = 0; r < e->nrails; r++)
            if (e->rail[r].dev->ctx->async_fd == ps->items[i].fd)
                serve_async_events(e, e->rail[r].dev);
        break;
    case ITEM_ROUTER:
        kvw__prefill_serve_router(e);
        break;
    case ITEM_ROUTER_MONITOR:
        kvw__prefill_on_monitor(e);
        break;
    case ITEM_REGISTRAR:
        kvw__registrar_on_readable(e->ctl->registrar);
        break;
    case ITEM_BOOTSTRAP:
        kvw__decode_on_bootstrap(e, ps->peer[i]);
        break;
    case ITEM_PEER:
        kvw__decode_on_message(e, ps->peer[i]);
        break;
    case ITEM_PEER_MONITOR:
        kvw__decode_on_monitor(e, ps->peer[i]);
        break;
    }
}

/* Serve what other threads queued, then what is due. */
static void serve_requests(kvw_engine_t *e, uint64_t now)
{
    bool (*serve)(kvw_engine_t *, kvw_req_t *, uint64_t) =
        e->role == KVW_ROLE_PREFILL ? kvw__prefill_service_locked : kvw__decode_service_locked;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r;
    while ((r = kvw__pop_work_locked(e))) {
        if (r->listed && serve(e, r, now))
            kvw__req_drop_locked(r);
        kvw__req_unref(r); /* the work list's */
    }
    while ((r = kvw__pop_expired_locked(e, now)))
        if (serve(e, r, now))
            kvw__req_drop_locked(r);
    pthread_mutex_unlock(&e->lock);
}

/* Milliseconds until `due` (0 = nothing due: wait for an event), rounded up
 * so the loop does not wake a hair early and spin. */
static long timeout_ms(uint64_t due, uint64_t now)
{
    if (!due)
        return -1;
    if (due <= now)
        return 0;
    uint64_t ms = (due - now + 999999) / 1000000;
    return ms > 60000 ? 60000 : (long)ms;
}

static bool grow_poll_set(poll_set_t *ps, int need)
{
    if (need <= ps->cap)
        return true;
    int cap = need * 2;
    zmq_pollitem_t *items = realloc(ps->items, (size_t)cap * sizeof(*items));
    if (items)
        ps->items = items;
    kvw_peer_t **peer = realloc(ps->peer, (size_t)cap * sizeof(*peer));
    if (peer)
        ps->peer = peer;
    item_kind_t *kind = realloc(ps->kind, (size_t)cap * sizeof(*kind));
    if (kind)
        ps->kind = kind;
    if (!items || !peer || !kind)
        return false;
    ps->cap = cap;
    return true;
}

kvw_status_t kvw__ctl_create(kvw_engine_t *e)
{
    e->ctl = calloc(1, sizeof(*e->ctl));
    return e->ctl ? KVW_OK : KVW_ERR_NO_MEMORY;
}

void kvw__ctl_destroy(kvw_engine_t *e)
{
    if (!e->ctl)
        return;
    /* A clean exit frees the rank at once (only a crash waits out the lease). */
    kvw__registrar_destroy(e->ctl->registrar, true);
    free(e->ctl); /* the hellos went with the thread (kvw__prefill_fini_handshakes) */
    e->ctl = NULL;
}

void *kvw__control_main(void *arg)
{
    kvw_engine_t *e = arg;
    kvw__log_set_engine(e->log_tag);
    poll_set_t ps = {0};
    uint64_t peers_due = 0;
    while (!atomic_load(&e->stop)) {
        /* Three items per peer slot, plus the engine's own (wake-up, device
         * events, router, its monitor, registrar). */
        if (!grow_poll_set(&ps, 4 + (int)e->nrails + 3 * (int)e->peer_slots)) {
            KVW_ERROR("control thread: out of memory");
            break;
        }
        build_poll_set(e, &ps);
        pthread_mutex_lock(&e->lock);
        uint64_t due = kvw__earliest(peers_due, kvw__next_deadline_locked(e));
        e->control_due_ns = due ? due : UINT64_MAX; /* an earlier deadline wakes us */
        pthread_mutex_unlock(&e->lock);
        if (zmq_poll(ps.items, ps.n, timeout_ms(due, kvw__now_ns())) < 0 && errno != EINTR)
            KVW_WARN("zmq_poll failed: %s", zmq_strerror(errno));
        atomic_fetch_add_explicit(&e->control_wakes, 1, memory_order_relaxed);
        for (int i = 0; i < ps.n; i++)
            if (ps.items[i].revents & ZMQ_POLLIN)
                serve_item(e, &ps, i);
        uint64_t now = kvw__now_ns();
        serve_requests(e, now);
        /* After the requests: one just attached to an idle connection makes
         * it busy, and the busy heartbeat must start now, not at the idle
         * one's next tick. */
        peers_due = e->role == KVW_ROLE_PREFILL ? kvw__prefill_peers_tick(e, now)
                                                : kvw__decode_peers_tick(e, now);
        if (e->ctl->registrar) /* re-register: a restarted bootstrap service relearns us */
            peers_due = kvw__earliest(peers_due, kvw__registrar_tick(e->ctl->registrar, now));
        if (e->role == KVW_ROLE_DECODE)
            kvw__decode_connect_pending(e);
        kvw__peer_finish_kills(e);
        kvw__peers_unpublish_dead(e);
    }
    if (e->role == KVW_ROLE_DECODE) {
        kvw__decode_close_all(e); /* the poller still runs: ACKs and immediates flow */
        kvw__decode_fini(e);
    } else
        kvw__prefill_fini_handshakes(e);
    free(ps.items);
    free(ps.peer);
    free(ps.kind);
    return NULL;
}
