/* SPDX-License-Identifier: Apache-2.0 */
/* Prefill's side of the control plane: a ROUTER socket that decode engines
 * dial. Handshakes create connections (capped by max_peers); requests
 * claim rooms (the first claimer owns the room); requests for rooms no
 * sender has claimed yet ("orphans") are kept for orphan_ttl_ms within
 * per-connection caps. */
#include "engine/control.h"
#include "engine/poller.h"
#include "engine/rails/rails.h"
#include "engine/verify.h"

#include "common/log.h"
#include "ctrl/zsock.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    RECHECK_MS = 100,      /* a tombstone whose writes are still in flight looks again */
    PROBE_TICK_MS = 10,    /* while probing connections after a disconnect */
    PROBE_WINDOW_MS = 500, /* how long a disconnect keeps us probing */
    /* How long after our BYE to a decode engine that said CLOSING its
     * disconnect is expected (it closes on that BYE): one probe round of
     * every live connection per decode engine that leaves in order made
     * a storm of them (1024 engines leaving: minutes instead of seconds). */
    CLOSE_EXPECT_MS = 1000,
    ROUTER_BATCH = 256, /* messages served per control-loop iteration */
};

static void send_failed(kvw_engine_t *e, const kvw_peer_t *p, uint64_t room, uint32_t token,
                        kvw_status_t st, const char *why)
{
    kvw_msg_t m = kvw__failure_msg(KVW_MSG_REQUEST_FAILED, room, token, st, why);
    kvw__ctl_route(e, p->id, sizeof(p->id), &m);
}

/* The live peer with this identity, or (any) also a dead one still in its
 * slot. Peers are few (max_peers): a scan is cheaper than a second index. */
static kvw_peer_t *peer_by_identity(kvw_engine_t *e, const uint8_t *id, size_t len, bool any)
{
    if (len != KVW_IDENTITY_LEN)
        return NULL;
    kvw_peer_t *dead = NULL;
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || memcmp(p->id, id, len) != 0)
            continue;
        if (atomic_load(&p->state) != PEER_DEAD)
            return p;
        dead = p;
    }
    return any ? dead : NULL;
}

static void reject_hello(kvw_engine_t *e, const uint8_t *id, kvw_status_t st, const char *why)
{
    KVW_ERROR("handshake from a decode engine rejected: %s", why);
    atomic_fetch_add(&e->counters.handshakes_refused, 1);
    kvw_msg_t m = {.type = KVW_MSG_HELLO_ACK, .status = st};
    snprintf(m.u.hello.reason, sizeof(m.u.hello.reason), "%s", why);
    kvw__ctl_route(e, id, KVW_IDENTITY_LEN, &m);
}

/* The same HELLO again (same identity, same QPs): decode resent it before
 * our HELLO_ACK reached it, and may act on either copy of the answer. Both
 * must describe the one connection: answer again with it. Replacing it
 * would leave decode's QPs connected to QPs we destroyed. */
static bool hello_resent(kvw_engine_t *e, kvw_peer_t *old, const kvw_msg_t *m)
{
    /* A connection that is closing (decode said BYE, or we are killing it)
     * is not the one a resend asks for: it serves no new request, so a
     * REQUEST after this HELLO would be lost on it. */
    if (!old || !m->u.hello.num_qps || old->hello_qpn != m->u.hello.qps[0].qpn ||
        atomic_load(&old->state) != PEER_CONNECTED || atomic_load(&old->closing))
        return false;
    kvw_msg_t ack;
    kvw__peer_hello(old, KVW_MSG_HELLO_ACK, &ack);
    kvw__ctl_route(e, old->id, sizeof(old->id), &ack);
    kvw__wire_free(&ack);
    KVW_INFO("decode engine %016llx resent its handshake: answered again as peer %u",
             (unsigned long long)m->u.hello.engine_id, old->index);
    return true;
}

/* Lanes that could not be connected (their rail's link is down): the
 * connection starts on the others, and these are failed over as soon as
 * the poller sees them, before anything is posted, then probed back like
 * any failed lane (rejoin.c). Their QPs keep decode's offer for that. */
static void start_without(kvw_peer_t *p, uint64_t engine_id, uint32_t out, const char *why)
{
    for (uint32_t m = out; m; m &= m - 1)
        kvw__lane_mark_down(p, (uint32_t)__builtin_ctz(m), KVW_DOWN_HELLO);
    KVW_WARN("decode engine %016llx: %u of %u QPs could not be connected (%s): the connection "
             "starts without them and probes them back",
             (unsigned long long)engine_id, (unsigned)__builtin_popcount(out), p->nlanes, why);
}

/* The first of the HELLO's QPs that a lane of p already sends to (the same
 * GID and QP number), or UINT32_MAX. An all-zero GID names no device (test
 * clients that play decode send one): it matches nothing. */
static uint32_t reused_qpn(const kvw_peer_t *p, const kvw_msg_t *m)
{
    static const uint8_t none[16];
    for (uint32_t j = 0; j < p->nlanes; j++) {
        const kvw_qp_info_t *r = &p->lanes[j].remote;
        bool named = r->qpn && memcmp(r->gid, none, sizeof(none)) != 0;
        for (uint32_t i = 0; named && i < m->u.hello.num_qps; i++)
            if (m->u.hello.qps[i].qpn == r->qpn &&
                memcmp(m->u.hello.qps[i].gid, r->gid, sizeof(r->gid)) == 0)
                return r->qpn;
    }
    return UINT32_MAX;
}

/* A decode QP number one of our connections still sends to: that remote
 * QP is gone (one device never has two live QPs of one number; rxe hands
 * a destroyed QP's number to the next QP at once), its process killed
 * before we noticed. Our QP there still retransmits, and once decode's new
 * QP is ready the stale packets reach it: rxe answers them with a NAK to
 * our new QP, and the new connection fails ("remote invalid request", seen
 * in the rxe soak on a loaded host right after a killed decode process).
 * So the old connection dies first: its QPs in ERR before our HELLO_ACK
 * lets decode bring the new one up. */
static void kill_reused_qpns(kvw_engine_t *e, const kvw_msg_t *m)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        uint32_t qpn =
            p && atomic_load(&p->state) == PEER_CONNECTED ? reused_qpn(p, m) : UINT32_MAX;
        if (qpn != UINT32_MAX)
            kvw__peer_kill(p, KVW_ERR_PEER,
                           "decode's QP %u was given to a new connection: its old one is gone",
                           qpn);
    }
}

static void on_hello(kvw_engine_t *e, const uint8_t *id, const kvw_msg_t *m)
{
    kvw_peer_t *old = peer_by_identity(e, id, KVW_IDENTITY_LEN, false);
    if (hello_resent(e, old, m))
        return;
    KVW_DEBUG("HELLO from decode engine %016llx (%u QPs offered)",
              (unsigned long long)m->u.hello.engine_id, m->u.hello.num_qps);
    kvw_wire_offer_t theirs = kvw__wire_hello_offer(m), agreed;
    char why[KVW_WIRE_REASON_MAX] = "";
    if (kvw__wire_agree(&e->wire, &theirs, "prefill", "decode", &agreed, why, sizeof(why))) {
        reject_hello(e, id, KVW_ERR_MISMATCH, why);
        return;
    }
    if (old) {
        atomic_fetch_add(&e->counters.reconnects, 1);
        kvw__peer_kill(old, KVW_ERR_PEER, "decode engine reconnected");
    }
    kvw_peer_t *p = NULL;
    /* Verbs calls (QP create and connect) happen before the lock. As many
     * QPs as both sides want (qps_per_peer on each of our rails): decode
     * connects that many of its own, the first ones it offered. Its rail d
     * pairs with our rail d mod nrails: rail i of each node on network i,
     * as multi-rail clusters are cabled. */
    uint32_t want = e->cfg.qps_per_peer * e->nrails;
    uint32_t lanes = m->u.hello.num_qps < want ? m->u.hello.num_qps : want;
    uint8_t rails[KVW_MAX_LANES];
    for (uint32_t i = 0; i < lanes; i++)
        rails[i] = (uint8_t)(m->u.hello.qp_rail[i] % e->nrails);
    uint32_t out = 0;
    kvw_status_t st = kvw__peer_create(e, lanes, rails, &p);
    if (!st) { /* the layout's landing buffer needs the capabilities */
        p->wire_version = agreed.max;
        p->wire_caps = agreed.caps;
        p->wire_offered = m->u.hello.offer.max != 0;
    }
    if (!st)
        st = kvw__peer_accept_layout(p, m, why, sizeof(why));
    if (!st) /* a peer we would connect: its QPs prove which of ours are stale */
        kill_reused_qpns(e, m);
    if (!st)
        st = kvw__peer_connect_lanes(p, m->u.hello.qps, lanes, &out, why, sizeof(why));
    if (!st) {
        memcpy(p->id, id, KVW_IDENTITY_LEN);
        p->hello_qpn = m->u.hello.num_qps ? m->u.hello.qps[0].qpn : 0;
        p->serial = e->ctl->next_serial++;
        p->last_seen_ns = kvw__now_ns();
        for (uint32_t i = 0; i < lanes; i++)
            atomic_store(&p->lanes[i].imm_limit, m->u.hello.recv_credits);
        if (out)
            start_without(p, m->u.hello.engine_id, out, why);
        atomic_store(&p->state, PEER_CONNECTED); /* not yet visible to other threads */
        pthread_mutex_lock(&e->lock);
        st = kvw__peer_publish_locked(e, p, why, sizeof(why));
        pthread_mutex_unlock(&e->lock);
    }
    if (st) {
        reject_hello(e, id, st, why[0] ? why : kvw_strerror(st));
        kvw__peer_destroy(p);
        return;
    }
    kvw_msg_t ack;
    kvw__peer_hello(p, KVW_MSG_HELLO_ACK, &ack);
    kvw__ctl_route(e, id, KVW_IDENTITY_LEN, &ack);
    kvw__wire_free(&ack);
    atomic_fetch_add(&e->counters.handshakes, 1);
    KVW_INFO("decode engine %016llx connected as peer %u (%u QP%s, QPN %u -> %u, %u receive "
             "credits per QP, wire %u, capabilities 0x%x)",
             (unsigned long long)m->u.hello.engine_id, p->index, lanes, lanes > 1 ? "s" : "",
             p->lanes[0].qp->qp->qp_num, m->u.hello.qps[0].qpn, m->u.hello.recv_credits,
             p->wire_version, p->wire_caps);
}

/* ------------------------------------------------------------ handshakes
 *
 * A storm of decode engines connecting at once (a whole decode fleet
 * restarting) must degrade into waiting, never into timeouts. Each
 * handshake costs prefill QP creation and connection (verbs calls that take
 * milliseconds on real NICs); served inline, a burst of them held the
 * control loop for as long as they took, connected peers went unserved, and
 * decode engines that heard nothing within peer_timeout_ms resent their
 * HELLO, which prefill then served twice (the second killing the first's
 * connection). So HELLOs are queued in arrival order, at most
 * max_handshakes are served per loop pass (and for at most heartbeat_ms / 2),
 * and each decode engine a batch
 * leaves waiting gets a PONG then and every heartbeat_ms: it then keeps
 * waiting (up to its bootstrap_timeout_ms) instead of resending. Without a
 * storm every HELLO is served in the pass that read it, and nothing
 * changes on the wire. A resent HELLO replaces
 * the queued one of the same identity; a BYE withdraws it; one that comes
 * after its original was served is answered with the same connection.  */

struct kvw_pending_hello {
    uint8_t id[KVW_IDENTITY_LEN];
    kvw_msg_t m;
    uint64_t nudged_ns; /* the last PONG telling decode to wait */
};

static void nudge(kvw_engine_t *e, struct kvw_pending_hello *h, uint64_t now)
{
    kvw_msg_t pong = {.type = KVW_MSG_PONG}; /* engine id 0: see kvw__peer_hello */
    kvw__ctl_route(e, h->id, sizeof(h->id), &pong);
    h->nudged_ns = now;
}

static struct kvw_pending_hello *queued_hello(kvw_engine_t *e, const uint8_t *id)
{
    for (uint32_t i = 0; i < e->ctl->hello_count; i++) {
        struct kvw_pending_hello *h = &e->ctl->hellos[e->ctl->hello_head + i];
        if (memcmp(h->id, id, KVW_IDENTITY_LEN) == 0)
            return h;
    }
    return NULL;
}

/* Room at the end of the array: reuse what the served head left. */
static bool hello_room(kvw_engine_t *e)
{
    if (e->ctl->hello_head && e->ctl->hello_head + e->ctl->hello_count == e->ctl->hello_cap) {
        memmove(e->ctl->hellos, e->ctl->hellos + e->ctl->hello_head,
                e->ctl->hello_count * sizeof(*e->ctl->hellos));
        e->ctl->hello_head = 0;
    }
    if (e->ctl->hello_head + e->ctl->hello_count < e->ctl->hello_cap)
        return true;
    uint32_t cap = e->ctl->hello_cap ? 2 * e->ctl->hello_cap : 64;
    struct kvw_pending_hello *n = realloc(e->ctl->hellos, cap * sizeof(*n));
    if (!n)
        return false;
    e->ctl->hellos = n;
    e->ctl->hello_cap = cap;
    return true;
}

static void reject_hello(kvw_engine_t *e, const uint8_t *id, kvw_status_t st, const char *why);

/* Takes m (freed when served or dropped). */
static void queue_hello(kvw_engine_t *e, const uint8_t *id, kvw_msg_t *m)
{
    struct kvw_pending_hello *h = queued_hello(e, id);
    if (h) { /* decode resent it: the newer one stands, in the older one's place */
        kvw__wire_free(&h->m);
        h->m = *m;
        return;
    }
    if (e->ctl->hello_count >= 2 * e->cfg.max_peers || !hello_room(e)) {
        reject_hello(e, id, KVW_ERR_LIMIT,
                     "prefill has too many handshakes waiting (twice max_peers)");
        kvw__wire_free(m);
        return;
    }
    h = &e->ctl->hellos[e->ctl->hello_head + e->ctl->hello_count++];
    memcpy(h->id, id, KVW_IDENTITY_LEN);
    h->m = *m;
    h->nudged_ns = 0; /* told to wait only if this pass's batch leaves it waiting */
}

/* Takes the HELLO queued for id out of the queue (into *out). */
static bool take_hello(kvw_engine_t *e, const uint8_t *id, struct kvw_pending_hello *out)
{
    struct kvw_pending_hello *h = e->ctl->hello_count ? queued_hello(e, id) : NULL;
    if (!h)
        return false;
    *out = *h;
    struct kvw_pending_hello *end = &e->ctl->hellos[e->ctl->hello_head + e->ctl->hello_count];
    memmove(h, h + 1, (size_t)(end - (h + 1)) * sizeof(*h));
    e->ctl->hello_count--;
    return true;
}

/* A BYE from a decode engine still waiting: it gave up, serve nothing. */
static bool withdraw_hello(kvw_engine_t *e, const uint8_t *id)
{
    struct kvw_pending_hello h;
    if (!take_hello(e, id, &h))
        return false;
    kvw__wire_free(&h.m);
    return true;
}

static void on_hello(kvw_engine_t *e, const uint8_t *id, const kvw_msg_t *m);

/* Another message from an engine whose HELLO waits in the queue: serve the
 * HELLO first. A decode engine's messages must be handled in the order it
 * sent them (a REQUEST after its HELLO belongs to the connection that HELLO
 * makes); handled before it, the REQUEST met no connection, or the old one,
 * and was lost. Decode engines wait for HELLO_ACK before they send more, so
 * a storm still queues; this only keeps order for those that do not. */
static void serve_hello_before(kvw_engine_t *e, const uint8_t *id)
{
    struct kvw_pending_hello h;
    if (!take_hello(e, id, &h))
        return;
    on_hello(e, h.id, &h.m);
    kvw__wire_free(&h.m);
}

/* Serve up to max_handshakes queued HELLOs; nudge those left waiting.
 * Returns when to run again: now while any is left. */
static uint64_t serve_handshakes(kvw_engine_t *e, uint64_t now)
{
    /* Also bounded in time: where a connection costs long (slow verbs), a
     * batch must still end well before waiting decode engines give up. */
    uint64_t stop = now + kvw__ms_ns(e->cfg.heartbeat_ms) / 2;
    for (uint32_t n = 0;
         n < e->cfg.max_handshakes && e->ctl->hello_count && (!n || kvw__now_ns() < stop); n++) {
        struct kvw_pending_hello h = e->ctl->hellos[e->ctl->hello_head++];
        e->ctl->hello_count--;
        on_hello(e, h.id, &h.m);
        kvw__wire_free(&h.m);
    }
    if (!e->ctl->hello_count) {
        e->ctl->hello_head = 0;
        return 0;
    }
    now = kvw__now_ns();
    uint64_t every = kvw__ms_ns(e->cfg.heartbeat_ms);
    for (uint32_t i = 0; i < e->ctl->hello_count; i++) {
        struct kvw_pending_hello *h = &e->ctl->hellos[e->ctl->hello_head + i];
        if (!h->nudged_ns || now - h->nudged_ns >= every)
            nudge(e, h, now);
    }
    return now;
}

void kvw__prefill_fini_handshakes(kvw_engine_t *e)
{
    for (uint32_t i = 0; i < e->ctl->hello_count; i++)
        kvw__wire_free(&e->ctl->hellos[e->ctl->hello_head + i].m);
    free(e->ctl->hellos);
    e->ctl->hellos = NULL;
    e->ctl->hello_head = e->ctl->hello_count = e->ctl->hello_cap = 0;
}

/* (lock) Would one more record for a room without a sender, holding
 * `bytes` of page indices, take p past its orphan caps? Then why (may be
 * NULL) says which: decode engines cannot make prefill hold unbounded
 * memory for rooms it never serves. */
static bool over_orphan_caps_locked(const kvw_engine_t *e, const kvw_peer_t *p, uint64_t bytes,
                                    char *why, size_t size)
{
    uint64_t max_bytes = (uint64_t)e->cfg.max_orphan_mib_per_peer << 20;
    if (p->orphans >= e->cfg.max_orphans_per_peer)
        snprintf(why, size,
                 "prefill already holds %u requests from this engine for rooms without a sender "
                 "(max_orphans_per_peer)",
                 p->orphans);
    else if (p->orphan_bytes + bytes > max_bytes)
        snprintf(why, size,
                 "requests for rooms without a sender would hold %llu KiB of page indices, over "
                 "max_orphan_mib_per_peer (%u MiB)",
                 (unsigned long long)((p->orphan_bytes + bytes) >> 10),
                 e->cfg.max_orphan_mib_per_peer);
    else
        return false;
    return true;
}

/* (lock) Refuse a request that would take p past its orphan caps. */
static bool orphan_refused_locked(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX];
    uint64_t bytes = (uint64_t)m->u.request.num_pages * sizeof(uint64_t);
    if (!over_orphan_caps_locked(e, p, bytes, why, sizeof(why)))
        return false;
    send_failed(e, p, m->u.request.room, m->u.request.token, KVW_ERR_LIMIT, why);
    atomic_fetch_add(&e->counters.requests_refused, 1);
    return true;
}

/* (lock) Decode asked before prefill created the room's sender: keep the
 * request, within the caps, for at most orphan_ttl_ms. */
static kvw_req_t *new_orphan_locked(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    if (orphan_refused_locked(e, p, m))
        return NULL;
    kvw_req_t *r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, m->u.request.room);
    if (!r) {
        send_failed(e, p, m->u.request.room, m->u.request.token, KVW_ERR_NO_MEMORY,
                    "prefill is out of memory");
        return NULL;
    }
    kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.orphan_ttl_ms));
    return r;
}

/* (lock) r is held for p's decode engine and no sender claimed it yet:
 * count it against p's caps (kvw__req_unorphan_locked gives it back when a
 * sender claims it or it leaves the table). */
static void count_orphan_locked(kvw_req_t *r)
{
    if (r->has_user || r->user_gone || r->orphan || !r->peer)
        return;
    r->orphan = true;
    atomic_fetch_add(&r->engine->counters.orphans, 1);
    KVW_DEBUG("room %llu: held for peer %u until a sender claims it", (unsigned long long)r->room,
              r->peer->index);
    r->peer->orphans++;
    r->peer->orphan_bytes += r->tx.num_pages * sizeof(uint64_t);
}

/* (lock) Among the room's requests no sender owns yet (several decode
 * engines may ask before a fan-out sender exists), the one p sent, or
 * NULL. */
static kvw_req_t *orphan_of_locked(kvw_req_t *r, const kvw_peer_t *p)
{
    for (; r; r = kvw__req_find_next_locked(r))
        if (r->peer == p)
            return r;
    return NULL;
}

/* (lock) The room's request p's REQUEST is for: a fan-out sender's member
 * (false: answered here), the one p sent ahead, or the room's request. */
static bool request_target_locked(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m,
                                  kvw_req_t **r_p)
{
    uint64_t room = m->u.request.room;
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    if (r && r->tx.set) {
        char why[KVW_WIRE_REASON_MAX];
        bool resend = false;
        kvw_status_t st = kvw__txset_claim_locked(r->tx.set, p, m, r_p, &resend, why, sizeof(why));
        if (st || resend) {
            KVW_WARN("room %llu: %s from peer %u refused%s%s", (unsigned long long)room,
                     resend ? "repeated request" : "request", p->index, st ? ": " : "",
                     st ? why : "");
            if (st) {
                send_failed(e, p, room, m->u.request.token, st, why);
                atomic_fetch_add(&e->counters.requests_refused, 1);
            }
            return false;
        }
        return true;
    }
    if (r && !r->has_user && !r->user_gone && r->peer && r->peer != p)
        r = orphan_of_locked(r, p); /* another decode engine asked ahead: its own record */
    *r_p = r;
    return true;
}

static void on_request(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    char why[KVW_WIRE_REASON_MAX] = "";
    uint64_t room = m->u.request.room;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = NULL;
    if (!request_target_locked(e, p, m, &r)) {
        pthread_mutex_unlock(&e->lock);
        return;
    }
    if (r && atomic_load(&r->state) == KVW_POLL_FAILED && !r->tx.have_dst) {
        /* It failed (bad source pages, abort, destroy, timeout) before
         * decode asked: nothing was posted, answer at once. */
        send_failed(e, p, room, m->u.request.token, r->fail_status, r->fail_reason);
        pthread_mutex_unlock(&e->lock);
        return;
    }
    if (r && (r->tx.have_dst || (r->peer && r->peer != p))) {
        /* The room belongs to whoever claimed it first. A second claim is
         * refused to that claimer alone (its token): the first request's
         * writes go on. An exact resend of the first claim is dropped. */
        bool resend = r->peer == p && r->token == m->u.request.token;
        pthread_mutex_unlock(&e->lock);
        KVW_WARN("room %llu: %s from peer %u refused", (unsigned long long)room,
                 resend ? "repeated request" : "second claim", p->index);
        if (!resend) {
            send_failed(e, p, room, m->u.request.token, KVW_ERR_EXISTS,
                        "the room is already claimed by another request");
            atomic_fetch_add(&e->counters.requests_refused, 1);
        }
        return;
    }
    if (!r && !(r = new_orphan_locked(e, p, m))) {
        pthread_mutex_unlock(&e->lock);
        return;
    }
    kvw_status_t st = kvw__sender_accept_request_locked(r, p, m, why, sizeof(why));
    if (st && !r->tx.have_dst) {
        /* Rejected before any write: fail the sender (a later one adopts the
         * failure) and tell decode now. */
        kvw__req_fail(r, st, "%s", why);
        send_failed(e, p, room, m->u.request.token, st, why);
    } else if (!st) {
        count_orphan_locked(r);
    }
    pthread_mutex_unlock(&e->lock);
    if (st)
        KVW_ERROR("request for room %llu rejected before any write: %s", (unsigned long long)room,
                  why[0] ? why : kvw_strerror(st));
}

/* (lock) An ABORT for a room prefill holds nothing for. Nothing of the
 * room was ever posted, so decode may be answered at once, and that answer
 * is all decode needs (an aborting receiver waits for it; one that never
 * sent its request has failed already). A record is kept for prefill's own
 * sake: the ABORT may have raced ahead of the sender's creation, and a
 * sender created later adopts the failure and ends at once instead of
 * waiting bootstrap_timeout_ms for a request that never comes. Like a
 * request no sender claimed, the record is an orphan: counted against the
 * same per-connection caps (it holds no page indices) and kept for
 * orphan_ttl_ms. Past the caps the ABORT is answered and nothing is held;
 * such a late sender then merely waits out its own timeout. NULL: answered
 * here. */
static kvw_req_t *abort_unknown_locked(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m,
                                       const char *why)
{
    uint64_t room = m->u.failed.room;
    kvw_req_t *r = NULL;
    if (!over_orphan_caps_locked(e, p, 0, NULL, 0))
        r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room);
    if (!r) {
        send_failed(e, p, room, m->u.failed.token, (kvw_status_t)m->status, why);
        return NULL;
    }
    kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.orphan_ttl_ms));
    return r;
}

/* Decode gave a room up. Stop writing it; REQUEST_FAILED goes back once
 * every write posted for it has completed (see notify_failure_locked). A
 * request no sender claimed yet stays counted against the orphan caps
 * while it is held, aborted or not: else REQUEST and ABORT, room after
 * room, would pile up requests the caps never see. */
static void on_abort(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    uint64_t room = m->u.failed.room;
    char why[KVW_WIRE_REASON_MAX];
    snprintf(why, sizeof(why), "decode gave the room up: %.120s", m->u.failed.reason);
    atomic_fetch_add(&e->counters.aborts, 1);
    KVW_DEBUG("room %llu: ABORT from peer %u", (unsigned long long)room, p->index);
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    if (r && r->tx.set) {
        if (!(r = kvw__txset_member_of_locked(r->tx.set, p))) {
            /* Every member serves another decode engine: nothing of the
             * room was posted for this one. */
            pthread_mutex_unlock(&e->lock);
            send_failed(e, p, room, m->u.failed.token, (kvw_status_t)m->status, why);
            return;
        }
    } else if (r && !r->has_user && !r->user_gone && r->peer && r->peer != p) {
        r = orphan_of_locked(r, p); /* another decode engine asked ahead */
    }
    if (r && ((r->peer && r->peer != p) || (r->tx.have_dst && r->token != m->u.failed.token))) {
        pthread_mutex_unlock(&e->lock);
        KVW_WARN("room %llu: abort from peer %u for a request it does not own ignored",
                 (unsigned long long)room, p->index);
        return;
    }
    bool unknown = !r;
    if (!r && !(r = abort_unknown_locked(e, p, m, why))) {
        pthread_mutex_unlock(&e->lock);
        return;
    }
    if (!r->tx.have_dst) { /* else both are set already, and the poller reads them */
        kvw__req_attach_locked(r, p);
        r->token = m->u.failed.token;
    }
    if (unknown)
        count_orphan_locked(r);
    kvw__req_fail(r, (kvw_status_t)m->status, "%s", why); /* a parked one: back to the poller */
    /* Decode waits for this answer before reporting Failed, even when the
     * request had already succeeded here. */
    r->tx.have_dst = true;
    r->tx.notify_failure = true;
    r->tx.abort_heard = true;
    kvw__req_touch_locked(r);
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it */
}

static void on_credit(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    /* Cumulative, so only ever raise it: a reordered or stale CREDIT is
     * harmless. Decode may have more QPs than it connected: ours count. */
    for (uint32_t i = 0; i < m->u.credit.num_qps && i < p->nlanes; i++) {
        _Atomic uint64_t *limit = &p->lanes[i].imm_limit;
        uint64_t cur = atomic_load(limit);
        while (m->u.credit.recvs_posted[i] > cur &&
               !atomic_compare_exchange_weak(limit, &cur, m->u.credit.recvs_posted[i]))
            ;
    }
    kvw__wake(e->poller_wake_fd);
}

static void answer_dead_peer(kvw_engine_t *e, const uint8_t *id, size_t id_len, uint16_t type)
{
    kvw_peer_t *dead = peer_by_identity(e, id, id_len, true);
    if (!dead || type == KVW_MSG_BYE) {
        kvw__ctl_dropped(e, "%s from an unknown peer", kvw__wire_type_name(type));
        return;
    }
    /* Decode is still talking on a connection we killed: say so again (our
     * BYE may have been lost), so it fails its requests now. */
    pthread_mutex_lock(&e->lock);
    kvw_msg_t bye = kvw__failure_msg(KVW_MSG_BYE, 0, 0, dead->dead_status, dead->dead_reason);
    pthread_mutex_unlock(&e->lock);
    kvw__ctl_route(e, dead->id, sizeof(dead->id), &bye);
}

static void dispatch(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *m)
{
    switch (m->type) {
    case KVW_MSG_REQUEST:
        /* The sender may be waiting with its writes: post them from here
         * if the poller sleeps (one wake-up off the request's path). */
        kvw__wake_defer();
        on_request(e, p, m);
        kvw__poller_help(e);
        break;
    case KVW_MSG_ABORT:
        on_abort(e, p, m);
        break;
    case KVW_MSG_CREDIT:
        on_credit(e, p, m);
        break;
    case KVW_MSG_LANE_READY:
        kvw__rejoin_on_ready(e, p, m);
        break;
    case KVW_MSG_LANE_DOWN:
        kvw__rejoin_on_down(e, p, m);
        break;
    case KVW_MSG_LANE_UP:
        kvw__rejoin_on_up(e, p, m);
        break;
    case KVW_MSG_REPLAY_ANSWER:
        kvw__rails_on_replay_answer(e, p, m);
        break;
    case KVW_MSG_PING: {
        kvw_msg_t pong = {.type = KVW_MSG_PONG}; /* engine id 0: see kvw__peer_hello */
        kvw__ctl_route(e, p->id, sizeof(p->id), &pong);
        break;
    }
    case KVW_MSG_BYE:
        kvw__peer_close(p, (kvw_status_t)m->status, "decode closed the connection: %.120s",
                        m->u.failed.reason);
        break;
    case KVW_MSG_CLOSING:
        atomic_store(&p->closing_said, true);
        /* Decode keeps its QPs up until our BYE: wait for the ACKs of what
         * we posted (a loaded host may take longer than one ACK timeout),
         * so that a request decode counted as landed ends Success here
         * too. Bounded as a silent peer is. */
        kvw__peer_close_within(p, kvw__ms_ns(e->cfg.peer_timeout_ms), (kvw_status_t)m->status,
                               "decode engine closed the connection: %.120s", m->u.failed.reason);
        break;
    default:
        kvw__ctl_dropped(e, "unexpected %s from peer %u", kvw__wire_type_name(m->type), p->index);
    }
}

/* At most ROUTER_BATCH messages per loop iteration: under a flood (a
 * misbehaving client, garbage) the socket never runs dry, and the loop must
 * still reach its heartbeats, kills and the requests other threads queued. */
void kvw__prefill_serve_router(kvw_engine_t *e)
{
    uint8_t id[KVW_CTL_MAX_ID];
    size_t id_len;
    kvw_msg_t m;
    kvw_status_t st;
    for (int n = 0; n < ROUTER_BATCH &&
                    (st = kvw__ctl_recv_routed(e, e->router, id, &id_len, &m)) != KVW_ERR_NOT_FOUND;
         n++) {
        if (st)
            continue; /* dropped (and counted) */
        if (m.type == KVW_MSG_HELLO && id_len == KVW_IDENTITY_LEN) {
            kvw_peer_t *old = peer_by_identity(e, id, id_len, false);
            if (old)
                old->last_seen_ns = kvw__now_ns();
            queue_hello(e, id, &m); /* takes m */
            continue;
        }
        if (m.type != KVW_MSG_BYE && id_len == KVW_IDENTITY_LEN)
            serve_hello_before(e, id);
        kvw_peer_t *p = peer_by_identity(e, id, id_len, false);
        if (p)
            p->last_seen_ns = kvw__now_ns();
        if (!p && !(m.type == KVW_MSG_BYE && withdraw_hello(e, id)))
            answer_dead_peer(e, id, id_len, m.type);
        else if (p)
            dispatch(e, p, &m);
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
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || atomic_load(&p->state) != PEER_CONNECTED)
            continue;
        kvw_msg_t pong = {.type = KVW_MSG_PONG}; /* engine id 0: see kvw__peer_hello */
        if (kvw__zdropped(e->router, &pong))
            continue; /* a lost probe tells nothing */
        if (zmq_send(e->router, p->id, sizeof(p->id), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
            if (errno == EHOSTUNREACH) {
                atomic_store(&p->ctl_gone, true);
                kvw__peer_close(p, KVW_ERR_PEER, "decode engine's control connection closed");
            }
            continue;
        }
        kvw__zsend_raw(e->router, &pong, ZMQ_DONTWAIT);
    }
}

/* A disconnect that an orderly close announced (CLOSING, then our BYE). */
static bool close_expected(kvw_engine_t *e)
{
    if (e->ctl->closes_expected && kvw__now_ns() >= e->ctl->closes_expected_until_ns)
        e->ctl->closes_expected = 0; /* not come in time: probe for what comes */
    return e->ctl->closes_expected > 0;
}

/* Only the closing of a connection that completed its handshake starts a
 * probe: a client without the cluster key (or speaking garbage, or none)
 * that connects and fails made every live connection be probed every 10 ms
 * for 500 ms, an amplification anyone who can reach the port could drive.
 * libzmq reports the fd only on DISCONNECTED, not on the handshake's
 * outcome, so count instead: every connection that never completed its
 * handshake reports exactly one HANDSHAKE_FAILED_* before its DISCONNECTED
 * (closing mid-handshake is NO_DETAIL), so a DISCONNECTED not matched by
 * a pending failure belongs to a handshaken connection. */
void kvw__prefill_on_monitor(kvw_engine_t *e)
{
    int ev;
    bool disconnected = false;
    while ((ev = kvw__zmonitor_event(e->router_monitor)) != 0) {
        if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
            ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL || ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
            e->ctl->unhandshaken_closes++;
        else if (ev == ZMQ_EVENT_DISCONNECTED && e->ctl->unhandshaken_closes)
            e->ctl->unhandshaken_closes--;
        else if (ev == ZMQ_EVENT_DISCONNECTED && close_expected(e))
            e->ctl->closes_expected--;
        else if (ev == ZMQ_EVENT_DISCONNECTED)
            disconnected = true;
    }
    if (!disconnected)
        return;
    /* The router drops the identity's pipe a few command rounds after the
     * event: keep probing for a short window. */
    e->ctl->probe_until_ns = kvw__now_ns() + kvw__ms_ns(PROBE_WINDOW_MS);
    probe_connections(e);
}

void kvw__prefill_say_bye(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *bye)
{
    kvw_status_t st = kvw__ctl_route(e, p->id, sizeof(p->id), bye);
    /* Decode closes its connection on this BYE (unroutable: it is gone
     * already, its disconnect came before). */
    if (!st && atomic_load(&p->closing_said)) {
        e->ctl->closes_expected++;
        e->ctl->closes_expected_until_ns = kvw__now_ns() + kvw__ms_ns(CLOSE_EXPECT_MS);
    }
}

uint64_t kvw__prefill_peers_tick(kvw_engine_t *e, uint64_t now)
{
    /* Decode pings an idle connection only every idle_heartbeat_ms: wait
     * for three of those (a decode engine that exits is noticed at once,
     * by its socket closing, and writes to a dead one fail by themselves). */
    uint32_t ms = e->cfg.peer_timeout_ms > 3 * e->cfg.idle_heartbeat_ms
                      ? e->cfg.peer_timeout_ms
                      : 3 * e->cfg.idle_heartbeat_ms;
    uint64_t next = serve_handshakes(e, now), limit = kvw__ms_ns(ms);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || atomic_load(&p->state) != PEER_CONNECTED)
            continue;
        if (atomic_load(&p->closing)) { /* the poller kills it once drained, or here */
            kvw__peer_close_if_drained(p, false);
            next = kvw__earliest(next, p->close_deadline_ns + 1); /* set before closing */
            continue;
        }
        /* Writes decode's NIC acknowledged count as much as its PINGs. */
        uint64_t seen = atomic_load_explicit(&p->data_seen_ns, memory_order_relaxed);
        uint64_t due = (seen > p->last_seen_ns ? seen : p->last_seen_ns) + limit;
        if (now > due)
            kvw__peer_kill(p, KVW_ERR_PEER, "decode engine silent for %u ms", ms);
        else
            next = kvw__earliest(next, due + 1);
        next = kvw__earliest(next, kvw__rejoin_tick(e, p, now));
        kvw__rails_send_asks(e, p);
    }
    if (e->ctl->probe_until_ns && now < e->ctl->probe_until_ns) {
        probe_connections(e);
        next = kvw__earliest(next, now + kvw__ms_ns(PROBE_TICK_MS));
    } else {
        e->ctl->probe_until_ns = 0;
    }
    return next;
}

/* ------------------------------------------------------------ requests */

/* (lock) Tell decode about a failed sender once its writes have drained. */
static void notify_failure_locked(kvw_engine_t *e, kvw_req_t *r)
{
    if (!r->tx.notify_failure || !r->tx.drained || !r->peer)
        return;
    r->tx.notify_failure = false;
    if (r->tx.abort_heard)
        atomic_fetch_add(&e->counters.abort_confirms, 1);
    KVW_DEBUG("room %llu: decode told it failed (its writes drained)", (unsigned long long)r->room);
    if (atomic_load(&r->state) == KVW_POLL_FAILED)
        send_failed(e, r->peer, r->room, r->token, r->fail_status, r->fail_reason);
    else /* succeeded before decode's abort arrived: every write has landed */
        send_failed(e, r->peer, r->room, r->token, KVW_ERR_ABORTED,
                    "aborted after the transfer had completed");
}

/* (lock) Verified: the digest of what a request that succeeded wrote, to
 * decode, once (engine/verify.h). */
static void send_digest_locked(kvw_engine_t *e, kvw_req_t *r)
{
    if (!r->tx.drained || !r->peer || !kvw__verify_sendable_locked(r))
        return;
    r->tx.digest_due = false;
    kvw_msg_t m = {.type = KVW_MSG_DIGEST};
    m.u.digest.room = r->room;
    m.u.digest.token = r->token;
    m.u.digest.epoch = r->tx.epoch & KVW_WIRE_IMM_EPOCH_MASK; /* drained: the poller is done */
    m.u.digest.value = r->tx.caller_digest ? r->tx.given : atomic_load(&r->tx.digest);
    kvw__ctl_route(e, r->peer->id, sizeof(r->peer->id), &m);
}

/* (lock) The transfer watchdog fired. RC completes in order: a request
 * whose first write was posted transfer_timeout_ms ago and is not complete
 * means the connection is stuck, not the request; unless the request is
 * parked (the poller posted every part it has): then what is late is
 * prefill's next part, and only this request fails. */
static void transfer_watchdog_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    uint64_t limit = kvw__ms_ns(e->cfg.transfer_timeout_ms);
    uint64_t first = atomic_load_explicit(&r->tx.first_post_ns, memory_order_relaxed);
    /* first may be newer than now (the poller set it after now was read). */
    bool late = first && first < now && now - first > limit;
    if (late && r->tx.starved) {
        char why[KVW_WIRE_REASON_MAX];
        snprintf(why, sizeof(why),
                 "the request's next part was not handed over within %u ms of its first write "
                 "(transfer_timeout_ms)",
                 e->cfg.transfer_timeout_ms);
        kvw__sender_fail_locked(r, KVW_ERR_TIMEOUT, why); /* decode is told once drained */
        return;
    }
    if (late && r->peer) {
        kvw__peer_kill_locked(r->peer, KVW_ERR_TIMEOUT, "room %llu: writes not complete in %u ms",
                              (unsigned long long)r->room, e->cfg.transfer_timeout_ms);
        return;
    }
    kvw__req_set_deadline_locked(r, (first && first < now ? first : now) + limit + 1);
}

/* (lock) Decode's request was never claimed by a sender: tell decode, and
 * keep the failure a while for a sender that comes too late. */
static void expire_orphan_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    kvw__req_fail(r, KVW_ERR_TIMEOUT, "prefill created no sender for this room within %u ms",
                  e->cfg.orphan_ttl_ms);
    atomic_fetch_add(&e->counters.orphans_expired, 1);
    send_failed(e, r->peer, r->room, r->token, r->fail_status, r->fail_reason);
    kvw__req_unorphan_locked(r);
    free(r->tx.dst_pages); /* nothing will be written: only the failure is kept */
    r->tx.dst_pages = NULL;
    free(r->tx.dst_state_n);
    r->tx.dst_state_n = NULL;
    kvw__req_set_deadline_locked(r, now + kvw__ms_ns(e->cfg.bootstrap_timeout_ms));
}

bool kvw__prefill_service_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now)
{
    int s = atomic_load(&r->state);
    notify_failure_locked(e, r);
    send_digest_locked(e, r);
    bool owed = r->tx.notify_failure || kvw__verify_owed_locked(r);
    bool due = r->deadline_ns && now >= r->deadline_ns;
    if (!due) /* a tombstone whose writes drained and whose answer went out goes now */
        return r->user_gone && r->tx.drained && !owed && !r->deadline_ns;
    kvw__req_set_deadline_locked(r, 0);
    if (s == KVW_POLL_TRANSFERRING) {
        transfer_watchdog_locked(e, r, now);
        return false;
    }
    if (r->has_user) {
        if (s == KVW_POLL_BOOTSTRAPPING)
            kvw__req_fail(r, KVW_ERR_TIMEOUT, "no request from decode within %u ms",
                          e->cfg.bootstrap_timeout_ms);
        return false;
    }
    if (!r->user_gone && s != KVW_POLL_FAILED && r->peer) {
        expire_orphan_locked(e, r, now);
        return false;
    }
    if (!r->tx.drained || owed) {
        kvw__req_set_deadline_locked(r, now + kvw__ms_ns(RECHECK_MS)); /* still owed: again */
        return false;
    }
    return true;
}
