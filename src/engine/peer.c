/* SPDX-License-Identifier: Apache-2.0 */
/* Peers: one connection per (prefill engine, decode engine) pair, of
 * cfg.qps_per_peer RC QPs ("lanes"), created during the handshake, with the
 * two memory tables paired region by region. */
#include "engine/core.h"

#include "common/log.h"
#include "ctrl/zsock.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

/* One QP (and its CQ) of p. Decode's receive WRs exist before the peer is
 * published, so the poller (which re-posts them) sees them initialised. */
static kvw_status_t lane_create(kvw_peer_t *p, kvw_lane_t *l, uint32_t rail)
{
    kvw_engine_t *e = p->engine;
    bool decode = e->role == KVW_ROLE_DECODE;
    if (decode && !(l->rwrs = calloc(e->cfg.rq_depth, sizeof(*l->rwrs))))
        return KVW_ERR_NO_MEMORY;
    /* Gather writes when this engine describes heads: a prefill rank may
     * then send a decode rank a slice of its heads (head slicing). */
    uint32_t sge = !decode && e->layout_heads ? KVW_HEADS_MAX_SGE : 1;
    l->rail = (uint8_t)rail;
    return kvw__qp_create_sge(e->rail[rail].dev, e->rail[rail].channel, p, e->cfg.sq_depth,
                              decode ? e->cfg.rq_depth : 1, sge, decode, &l->qp);
}

uint32_t kvw__decode_lanes(const kvw_engine_t *e)
{
    uint32_t n = e->cfg.qps_per_peer * e->nrails;
    return n < KVW_MAX_LANES ? n : KVW_MAX_LANES;
}

kvw_status_t kvw__peer_create(kvw_engine_t *e, uint32_t nlanes, const uint8_t *rails,
                              kvw_peer_t **peer_p)
{
    kvw_peer_t *p = calloc(1, sizeof(*p));
    uint32_t n = e->layout.num_regions;
    if (!p)
        return KVW_ERR_NO_MEMORY;
    p->engine = e;
    p->regions = calloc(n, sizeof(*p->regions));
    kvw_status_t st = p->regions ? KVW_OK : KVW_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < nlanes && i < KVW_MAX_LANES && !st; i++, p->nlanes++)
        st = lane_create(p, &p->lanes[i], rails ? rails[i] : i % e->nrails);
    if (st) {
        kvw__peer_destroy(p);
        return st;
    }
    *peer_p = p;
    return KVW_OK;
}

static uint32_t free_slot(kvw_engine_t *e)
{
    uint32_t n = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < n; i++)
        if (!kvw__peer_at(e, i))
            return i;
    return n;
}

/* Make p visible to the poller and the control loop. */
kvw_status_t kvw__peer_publish_locked(kvw_engine_t *e, kvw_peer_t *p, char *why, size_t why_size)
{
    if (e->live_peers >= e->cfg.max_peers) {
        snprintf(why, why_size,
                 "%u connections are live, the most max_peers (KVW_MAX_PEERS) allows",
                 e->live_peers);
        return KVW_ERR_LIMIT;
    }
    uint32_t i = free_slot(e);
    if (i == e->peer_slots) {
        snprintf(why, why_size, "all %u connection slots hold dead connections still draining",
                 e->peer_slots);
        return KVW_ERR_LIMIT;
    }
    p->index = i;
    p->live = true;
    e->live_peers++;
    atomic_store_explicit(&e->peers[i], p, memory_order_release);
    if (i == atomic_load(&e->num_peers))
        atomic_store(&e->num_peers, i + 1);
    kvw__wake(e->poller_wake_fd); /* so a sleeping poller arms the new CQ */
    return KVW_OK;
}

/* A dead peer may go once the BYE is said, the poller let go of its
 * queues and no listed request points at it. */
static bool reclaimable_locked(kvw_peer_t *p)
{
    return atomic_load(&p->state) == PEER_DEAD && !atomic_load(&p->bye_due) &&
           atomic_load(&p->poller_done) && p->nreqs == 0 && !p->sock && !p->bs_sock;
}

void kvw__peers_unpublish_dead(kvw_engine_t *e)
{
    pthread_mutex_lock(&e->lock);
    uint32_t n = atomic_load(&e->num_peers);
    bool any = false;
    for (uint32_t i = 0; i < n; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || !reclaimable_locked(p))
            continue;
        atomic_store_explicit(&e->peers[i], NULL, memory_order_release);
        p->grave_next = e->graveyard;
        e->graveyard = p;
        any = true;
    }
    while (n > 0 && !kvw__peer_at(e, n - 1))
        n--;
    atomic_store(&e->num_peers, n);
    pthread_mutex_unlock(&e->lock);
    if (any) {
        atomic_store(&e->graves_pending, true);
        kvw__wake(e->poller_wake_fd);
    }
}

void kvw__peers_reap(kvw_engine_t *e)
{
    if (!atomic_exchange(&e->graves_pending, false))
        return;
    pthread_mutex_lock(&e->lock);
    kvw_peer_t *p = e->graveyard;
    e->graveyard = NULL;
    pthread_mutex_unlock(&e->lock);
    /* ibv_destroy_cq waits for every completion event of the CQ to be
     * acknowledged: take what the channel holds first. */
    struct ibv_cq *cq;
    void *ctx;
    for (uint32_t r = 0; r < e->nrails; r++)
        while (e->dev->ops->get_cq_event(e->rail[r].channel, &cq, &ctx) == 0)
            e->dev->ops->ack_cq_events(cq, 1);
    while (p) {
        kvw_peer_t *next = p->grave_next;
        kvw__peer_destroy(p);
        p = next;
    }
}

void kvw__peers_destroy_all(kvw_engine_t *e)
{
    kvw_peer_t *p;
    while ((p = e->graveyard)) {
        e->graveyard = p->grave_next;
        kvw__peer_destroy(p);
    }
    uint32_t n = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < n; i++)
        kvw__peer_destroy(kvw__peer_at(e, i));
    atomic_store(&e->num_peers, 0);
}

void kvw__peer_destroy(kvw_peer_t *p)
{
    if (!p)
        return;
    kvw__zmonitor_close(p->sock, p->monitor);
    if (p->sock)
        zmq_close(p->sock);
    if (p->bs_sock)
        zmq_close(p->bs_sock);
    for (uint32_t i = 0; i < KVW_MAX_LANES; i++) {
        kvw__txq_fini(&p->lanes[i].txq);
        kvw__qp_destroy(p->lanes[i].qp);
        free(p->lanes[i].rwrs);
    }
    free(p->regions);
    free(p->kv_geom);
    free(p->kv_theirs);
    free(p);
}

/* Wire 12. Decode opens in the format of the oldest version it speaks,
 * which any prefill of that version reads, offering its range. Prefill
 * answers in the version agreed, offering its own range, or to a decode
 * that offered none (a 1.4.x engine) exactly as 1.4.0 answers. */
static void hello_offer(const kvw_peer_t *p, kvw_msg_t *m)
{
    const kvw_engine_t *e = p->engine;
    bool decode = e->role == KVW_ROLE_DECODE;
    m->version = decode ? e->wire.min : p->wire_version;
    if (decode || p->wire_offered)
        m->u.hello.offer = e->wire;
}

void kvw__peer_hello(const kvw_peer_t *p, uint16_t type, kvw_msg_t *m)
{
    const kvw_engine_t *e = p->engine;
    const kvw_layout_t *l = &e->layout;
    memset(m, 0, sizeof(*m));
    m->type = type;
    hello_offer(p, m);
    /* Prefill's engine id is what its bootstrap registration is owned by
     * (renewal and unregistering): it stays between prefill and the
     * service, never handed to a decode peer. */
    m->u.hello.engine_id = e->role == KVW_ROLE_DECODE ? e->id : 0;
    m->u.hello.num_qps = p->nlanes;
    for (uint32_t i = 0; i < p->nlanes; i++) {
        kvw__qp_local_info(p->lanes[i].qp, &m->u.hello.qps[i]);
        m->u.hello.qp_rail[i] = p->lanes[i].rail;
    }
    m->u.hello.num_rails = e->nrails;
    for (uint32_t r = 0; r < e->nrails; r++)
        m->u.hello.rail_mbps[r] = e->rail[r].mbps;
    /* The same on every lane: each got rq_depth receives before the HELLO. */
    m->u.hello.recv_credits = (uint32_t)atomic_load(&p->lanes[0].recvs_posted);
    m->u.hello.max_msg_sz = e->dev->max_msg_sz;
    kvw__landing_advertise(e, m);
    m->u.hello.regions = calloc(l->num_regions, sizeof(kvw_wire_region_t));
    if (!m->u.hello.regions)
        return; /* no groups: encodes, and the peer rejects it */
    m->u.hello.num_groups = l->num_groups;
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        /* Decode's control thread, which alone writes learned heads: a
         * group still learning says its page and our attention TP place. */
        kvw_heads_t h = g->heads;
        if (!h.total && e->learn_groups >> i & 1)
            h = (kvw_heads_t){
                0, e->tp_rank, e->tp_size, 0, e->learn[i].page_tokens, e->learn[i].order};
        m->u.hello.groups[i] =
            (kvw_wire_group_t){(uint8_t)g->kind, g->num_layers, g->per_layer,  h.total, h.first,
                               h.count,          h.head_bytes,  h.page_tokens, h.order};
    }
    /* Only decode's memory is a write target: prefill sends its layout
     * (lengths) but no address or rkey, and registered none for remote use. */
    bool target = e->role == KVW_ROLE_DECODE;
    for (uint32_t i = 0; i < l->num_regions; i++) {
        kvw_wire_region_t *g = &m->u.hello.regions[i];
        *g = (kvw_wire_region_t){target ? e->mrs[i].addr : 0,
                                 target ? e->mrs[i].len : e->regions[i].len, /* staged: slots */
                                 e->regions[i].item_len, target ? e->mrs[i].rkey : 0};
        for (uint32_t r = 1; target && r < e->nrails; r++)
            g->rail_rkeys[r - 1] = kvw__rail_mrs(e, r)[i].rkey;
    }
}

/* The routes of p's lanes connected by a HELLO of the peer (the first
 * `used` lanes): each distinct pair of our rail and theirs gets a table of
 * the regions with its keys, and each lane points at its pair's. */
static kvw_status_t build_routes(kvw_peer_t *p, const kvw_msg_t *h, uint32_t used)
{
    const kvw_engine_t *e = p->engine;
    uint32_t n = e->layout.num_regions, route_of[KVW_MAX_LANES], pairs[KVW_MAX_LANES], nroutes = 0;
    for (uint32_t i = 0; i < used; i++) {
        p->lanes[i].remote_rail = h->u.hello.qp_rail[i];
        uint32_t pair = (uint32_t)p->lanes[i].rail * KVW_MAX_RAILS + p->lanes[i].remote_rail, k = 0;
        while (k < nroutes && pairs[k] != pair)
            k++;
        if (k == nroutes)
            pairs[nroutes++] = pair;
        route_of[i] = k;
    }
    if (!nroutes)
        nroutes = 1; /* no lane connected (a refusal): keep one table */
    kvw_plan_region_t *t = calloc((size_t)n * nroutes, sizeof(*t));
    if (!t)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t k = 0; k < nroutes; k++) {
        uint32_t ours = used ? pairs[k] / KVW_MAX_RAILS : 0;
        uint32_t theirs = used ? pairs[k] % KVW_MAX_RAILS : 0;
        const kvw_mr_t *mrs = kvw__rail_mrs(e, ours);
        for (uint32_t i = 0; i < n; i++) {
            const kvw_wire_region_t *r = &h->u.hello.regions[i];
            t[(size_t)k * n + i] = (kvw_plan_region_t){.local_addr = mrs[i].addr,
                                                       .remote_addr = r->addr,
                                                       .item_len = r->item_len,
                                                       .lkey = mrs[i].lkey,
                                                       .rkey = kvw__wire_region_rkey(r, theirs)};
        }
    }
    free(p->regions);
    p->regions = t;
    p->nroutes = nroutes;
    for (uint32_t i = 0; i < used; i++)
        p->lanes[i].regions = t + (size_t)route_of[i] * n;
    return KVW_OK;
}

/* Prefill: the turn lanes take chains in. Each lane weighs its route's
 * link speed (the slower of the two rails; unknown counts as the fastest
 * known, all unknown as equal), reduced to small integers, so that a rail
 * twice as fast carries twice the chains; equal rails give the plain
 * round robin 0, 1, ..., nlanes - 1, as before rails. Interleaved: each
 * round gives every lane that still has turns one. */
static void build_sched(kvw_peer_t *p, const kvw_msg_t *h, uint32_t used)
{
    const kvw_engine_t *e = p->engine;
    uint32_t w[KVW_MAX_LANES], max = 0, min = UINT32_MAX;
    for (uint32_t i = 0; i < used; i++) {
        uint32_t a = e->rail[p->lanes[i].rail].mbps,
                 b = h->u.hello.rail_mbps[p->lanes[i].remote_rail];
        w[i] = a && b ? (a < b ? a : b) : (a ? a : b);
        max = w[i] > max ? w[i] : max;
    }
    for (uint32_t i = 0; i < used; i++) {
        if (!w[i])
            w[i] = max ? max : 1;
        min = w[i] < min ? w[i] : min;
    }
    uint32_t left[KVW_MAX_LANES], total = 0;
    for (uint32_t i = 0; i < used; i++) {
        /* In units of the slowest lane, rounded; at most 4 turns each. */
        uint32_t t = (w[i] + min / 2) / min;
        left[i] = t < 1 ? 1 : t > 4 ? 4 : t;
        total += left[i];
    }
    p->rails.nsched = 0;
    while (total && p->rails.nsched < KVW_MAX_SCHED)
        for (uint32_t i = 0; i < used && p->rails.nsched < KVW_MAX_SCHED; i++)
            if (left[i]) {
                left[i]--;
                total--;
                p->rails.sched[p->rails.nsched++] = (uint8_t)i;
            }
    if (!p->rails.nsched)
        p->rails.sched[p->rails.nsched++] = 0;
    p->rails.sched_pos = 0;
    p->rails.next_lane = p->rails.sched[0];
    memcpy(p->rails.sched_all, p->rails.sched, p->rails.nsched);
    p->rails.nsched_all = p->rails.nsched;
}

/* Prefill, head slicing: for each KV slot (the same group in every
 * layer), the geometry that sends decode all of its heads of that group
 * from ours, or why it cannot (decode wants heads this rank lacks). */
static kvw_status_t plan_slices(kvw_peer_t *p, const kvw_layout_group_t *peer)
{
    const kvw_layout_t *l = &p->engine->layout;
    p->kv_geom = calloc(l->kv_per_layer, sizeof(*p->kv_geom));
    if (!p->kv_geom)
        return KVW_ERR_NO_MEMORY;
    p->max_sge = KVW_HEADS_MAX_SGE;
    for (uint32_t i = 0; i < p->nlanes; i++)
        if (p->lanes[i].qp->max_send_sge < p->max_sge)
            p->max_sge = p->lanes[i].qp->max_send_sge;
    for (uint32_t j = 0; j < l->kv_per_layer; j++) {
        uint32_t r = l->kv_slots[j], g = 0;
        while (g + 1 < l->num_groups && r >= l->groups[g + 1].first)
            g++;
        const kvw_heads_t *ours = &l->groups[g].heads, *theirs = &peer[g].heads;
        kvw_head_range_t want = {theirs->first, theirs->count};
        if (!ours->total) /* not described: the whole page, as one slice */
            p->kv_geom[j] = (kvw_heads_geom_t){
                p->regions[r].item_len, p->regions[r].item_len, 0, 0, p->regions[r].item_len, 1};
        else if (kvw__heads_geom(ours, theirs, want, &p->kv_geom[j], p->slice_why,
                                 sizeof(p->slice_why)))
            p->slice_bad = true;
    }
    return KVW_OK;
}

/* The peer's heads of each KV slot's group, for head ranges planned per
 * request (prefill) and over several ranks (decode). */
static kvw_status_t keep_peer_heads(kvw_peer_t *p, const kvw_layout_group_t *peer)
{
    const kvw_layout_t *l = &p->engine->layout;
    free(p->kv_theirs);
    p->kv_theirs = calloc(l->kv_per_layer, sizeof(*p->kv_theirs));
    if (!p->kv_theirs)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t j = 0; j < l->kv_per_layer; j++) {
        uint32_t r = l->kv_slots[j], g = 0;
        while (g + 1 < l->num_groups && r >= l->groups[g + 1].first)
            g++;
        p->kv_theirs[j] = peer[g].heads;
    }
    return KVW_OK;
}

/* The peer's groups have our shape (kind, layers, regions per layer): only
 * then does its region table have our length and order. */
static bool shapes_match(const kvw_layout_t *l, const kvw_layout_group_t *peer, uint32_t n)
{
    if (n != l->num_groups)
        return false;
    for (uint32_t i = 0; i < n; i++)
        if (peer[i].kind != l->groups[i].kind || peer[i].num_layers != l->groups[i].num_layers ||
            peer[i].per_layer != l->groups[i].per_layer)
            return false;
    return true;
}

/* Prefill: decode's learning groups (its HELLO, KVW_WIRE_CAP_LEARN_HEADS)
 * get the heads decode learns from our HELLO_ACK, derived the same way
 * from our description and decode's item lengths (items); with a group we
 * do not describe, decode's pairs as undescribed. -1 with why. */
static int derive_decode_heads(const kvw_peer_t *p, const kvw_msg_t *h, kvw_layout_group_t *peer,
                               const uint64_t *items, char *why, size_t size)
{
    const kvw_layout_t *l = &p->engine->layout;
    for (uint32_t i = 0; p->wire_caps & KVW_WIRE_CAP_LEARN_HEADS && i < l->num_groups; i++) {
        const kvw_wire_group_t *b = &h->u.hello.groups[i];
        if (b->total_heads || b->head_bytes || !b->page_tokens)
            continue; /* described, or undescribed */
        kvw_heads_t learning = {0, 0, 0, 0, b->page_tokens, b->page_order};
        peer[i].heads = (kvw_heads_t){0};
        if (l->groups[i].heads.total &&
            kvw__layout_learn_group(l, i, &learning, &l->groups[i].heads, items, b->first_head,
                                    b->num_heads, &peer[i].heads, why, size))
            return -1;
    }
    return 0;
}

/* Decode: each of our learning groups that prefill describes learns its
 * heads from prefill's into mine (our layout for this handshake), with
 * our item lengths (ours); *learned when one learned now (the caller
 * commits them once the handshake is accepted). Heads learned before
 * must come out the same. -1 with why. */
static int learn_heads(const kvw_peer_t *p, const kvw_layout_group_t *peer, const uint64_t *ours,
                       kvw_layout_t *mine, bool *learned, char *why, size_t size)
{
    const kvw_engine_t *e = p->engine;
    *learned = false;
    for (uint32_t g = 0; p->wire_caps & KVW_WIRE_CAP_LEARN_HEADS && g < e->layout.num_groups; g++) {
        if (!(e->learn_groups >> g & 1) || !peer[g].heads.total)
            continue; /* not learning, or prefill describes none: undescribed */
        kvw_heads_t d;
        if (kvw__layout_learn_group(&e->layout, g, &e->learn[g], &peer[g].heads, ours, e->tp_rank,
                                    e->tp_size, &d, why, size))
            return -1;
        const kvw_heads_t *had = &e->layout.groups[g].heads;
        if (had->total && memcmp(had, &d, sizeof(d)) != 0) {
            snprintf(why, size,
                     "kv group %u: prefill rank %u gives decode heads [%u, %u) of %u x %u B, not "
                     "[%u, %u) of %u x %u B as learned before",
                     g, p->rank, d.first, d.first + d.count, d.total, d.head_bytes, had->first,
                     had->first + had->count, had->total, had->head_bytes);
            return -1;
        }
        if (!had->total) {
            mine->groups[g].heads = d;
            *learned = true;
        }
    }
    return 0;
}

/* Decode: the heads learned in this handshake (mine) become the engine's,
 * once, under the lock: what readers on other threads see. */
static void commit_learned(kvw_peer_t *p, const kvw_layout_t *mine)
{
    kvw_engine_t *e = p->engine;
    pthread_mutex_lock(&e->lock);
    for (uint32_t g = 0; g < e->layout.num_groups; g++) {
        const kvw_heads_t *h = &mine->groups[g].heads;
        if (!(e->learn_groups >> g & 1) || e->layout.groups[g].heads.total || !h->total)
            continue;
        e->layout.groups[g].heads = *h;
        KVW_INFO("kv group %u learned its heads from prefill rank %u: [%u, %u) of %u, %u bytes "
                 "a head (attention TP rank %u of %u)",
                 g, p->rank, h->first, h->first + h->count, h->total, h->head_bytes, e->tp_rank,
                 e->tp_size);
    }
    pthread_mutex_unlock(&e->lock);
}

/* Both sides' heads where decode learns them: prefill derives decode's,
 * decode learns its own into mine. items: the peer's item lengths, ours:
 * our own. -1 with why. */
static int pair_learning(kvw_peer_t *p, const kvw_msg_t *h, kvw_layout_group_t *peer,
                         const uint64_t *items, const uint64_t *ours, kvw_layout_t *mine,
                         bool *learned, char *why, size_t size)
{
    *learned = false;
    if (p->engine->role == KVW_ROLE_PREFILL)
        return derive_decode_heads(p, h, peer, items, why, size);
    return p->engine->learn_groups ? learn_heads(p, peer, ours, mine, learned, why, size) : 0;
}

/* The peer's layout must pair with ours (kvw__layout_compare): the same
 * groups, heads described alike, and the same item length region for
 * region where heads are not described, or pages would land misaligned.
 * Different head ranges make the connection sliced. Decode heads learned
 * from prefill (include/kvwire.h) are derived first, on both sides. */
kvw_status_t kvw__peer_accept_layout(kvw_peer_t *p, const kvw_msg_t *h, char *why, size_t size)
{
    const kvw_engine_t *e = p->engine;
    const kvw_layout_t *l = &e->layout;
    uint32_t n = l->num_regions;
    /* rxe takes 8 MiB per message, mlx5 1 GiB: plan with the smaller. */
    p->max_msg_sz =
        h->u.hello.max_msg_sz < e->dev->max_msg_sz ? h->u.hello.max_msg_sz : e->dev->max_msg_sz;
    /* decode's landing buffer, for REQUESTs asking for it (if both have them) */
    if (e->role == KVW_ROLE_PREFILL && p->wire_caps & KVW_WIRE_CAP_LANDING) {
        p->landing_addr = h->u.hello.landing_addr;
        p->landing_len = h->u.hello.landing_len;
        p->landing_rkey = h->u.hello.landing_rkey;
    }
    kvw_layout_group_t peer[KVW_LAYOUT_MAX_GROUPS];
    uint32_t ng = h->u.hello.num_groups < KVW_LAYOUT_MAX_GROUPS ? h->u.hello.num_groups
                                                                : KVW_LAYOUT_MAX_GROUPS;
    for (uint32_t i = 0; i < ng; i++) {
        const kvw_wire_group_t *b = &h->u.hello.groups[i];
        peer[i] = (kvw_layout_group_t){b->kind,
                                       b->num_layers,
                                       b->per_layer,
                                       0,
                                       {b->total_heads, b->first_head, b->num_heads, b->head_bytes,
                                        b->page_tokens, b->page_order}};
    }
    uint64_t *items = calloc(2 * (size_t)n, sizeof(*items));
    if (!items)
        return KVW_ERR_NO_MEMORY;
    uint64_t *ours = items + n;
    for (uint32_t i = 0; i < n; i++)
        ours[i] = e->regions[i].item_len;
    kvw_layout_t mine = *l; /* ours, with the heads decode learns in this handshake */
    bool learned = false;
    kvw_status_t st = KVW_OK;
    /* Only matching groups promise a region table of our length. */
    bool shaped = shapes_match(l, peer, h->u.hello.num_groups);
    for (uint32_t i = 0; shaped && i < n; i++)
        items[i] = h->u.hello.regions[i].item_len;
    if (shaped && pair_learning(p, h, peer, items, ours, &mine, &learned, why, size))
        st = KVW_ERR_MISMATCH;
    char what[200];
    if (!st && (kvw__layout_compare(&mine, NULL, peer, h->u.hello.num_groups, NULL, why, size) ||
                kvw__layout_compare(&mine, ours, peer, h->u.hello.num_groups, items, why, size))) {
        st = KVW_ERR_MISMATCH;
    } else if (!st) {
        /* The groups match ours: the peer's region table has our shape. */
        kvw_layout_t pl = mine;
        memcpy(pl.groups, peer, ng * sizeof(*peer));
        if (kvw__layout_check_heads(&pl, items, what, sizeof(what))) {
            snprintf(why, size, "peer's %s", what);
            st = KVW_ERR_MISMATCH;
        }
    }
    for (uint32_t i = 0; i < n && !st; i++) {
        const kvw_wire_region_t *r = &h->u.hello.regions[i];
        items[i] = r->len / r->item_len;
    }
    uint32_t used = h->u.hello.num_qps < p->nlanes ? h->u.hello.num_qps : p->nlanes;
    if (!st && (st = build_routes(p, h, used)) == KVW_OK)
        build_sched(p, h, used);
    if (!st) {
        kvw__layout_limits(&e->layout, items, p->remote_max);
        kvw__layout_state_limits(&e->layout, items, p->remote_state_max);
    }
    free(items);
    if (!st && e->layout_heads)
        st = keep_peer_heads(p, peer);
    p->sliced = !st && kvw__layout_sliced(&mine, peer, ng);
    if (p->sliced && e->role == KVW_ROLE_PREFILL)
        st = plan_slices(p, peer);
    if (!st && learned)
        commit_learned(p, &mine);
    return st;
}

kvw_status_t kvw__lane_post_recvs(kvw_lane_t *l, uint32_t n, uint32_t *accepted_p)
{
    for (uint32_t i = 0; i < n; i++)
        l->rwrs[i] = (struct ibv_recv_wr){.wr_id = i, .next = i + 1 < n ? &l->rwrs[i + 1] : NULL};
    struct ibv_recv_wr *bad = NULL;
    if (l->qp->dev->ops->post_recv(l->qp->qp, l->rwrs, &bad)) {
        int err = errno;
        /* The receives before bad_wr were posted (verbs: ibv_post_recv). */
        uint32_t accepted = bad >= l->rwrs && bad < l->rwrs + n ? (uint32_t)(bad - l->rwrs) : 0;
        atomic_fetch_add(&l->recvs_posted, accepted);
        *accepted_p = accepted;
        KVW_ERROR("ibv_post_recv of %u receives failed at the %u-th: %s", n, accepted + 1,
                  strerror(err));
        return KVW_ERR_VERBS;
    }
    atomic_fetch_add(&l->recvs_posted, n);
    *accepted_p = n;
    return KVW_OK;
}

kvw_status_t kvw__peer_post_recvs(kvw_peer_t *p, uint32_t n)
{
    uint32_t accepted;
    for (uint32_t k = 0; k < p->nlanes; k++)
        if (kvw__lane_post_recvs(&p->lanes[k], n, &accepted))
            return KVW_ERR_VERBS;
    return KVW_OK;
}

bool kvw__peer_other_rail_up(const kvw_peer_t *p, uint32_t lane, uint32_t down)
{
    const kvw_engine_t *e = p->engine;
    if (e->nrails < 2 || e->stager)
        return false;
    for (uint32_t j = 0; j < p->nlanes; j++)
        if (!(down & 1u << j) && p->lanes[j].rail != p->lanes[lane].rail)
            return true;
    return false;
}

void kvw__lane_mark_down(kvw_peer_t *p, uint32_t lane, uint8_t why)
{
    atomic_store(&p->lanes[lane].health.down_why,
                 why); /* before: the poller reads it after down_due */
    atomic_store(&p->lanes[lane].health.down_due, true);
    atomic_store(&p->rails.lanes_down, true);
    KVW_DEBUG_IN(KVW_SUB_RAIL, "connection %u: lane %u marked down (reason %u)", p->index, lane,
                 (unsigned)why);
}

/* Lanes `out` may stay out of a new connection of n lanes (decode may
 * have offered more; those past n are idle): each has a lane on another
 * rail that connected. */
static bool can_start_without(const kvw_peer_t *p, uint32_t n, uint32_t out)
{
    uint32_t down = out | (n < 32 ? ~0u << n : 0);
    for (uint32_t m = out; m; m &= m - 1)
        if (!kvw__peer_other_rail_up(p, (uint32_t)__builtin_ctz(m), down))
            return false;
    return true;
}

kvw_status_t kvw__peer_connect_lanes(kvw_peer_t *p, const kvw_qp_info_t *remote, uint32_t n,
                                     uint32_t *out, char *why, size_t why_size)
{
    kvw_engine_t *e = p->engine;
    kvw_status_t first = KVW_OK;
    *out = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvw_lane_t *l = &p->lanes[i];
        const kvw_dev_t *dev = e->rail[l->rail].dev;
        l->remote = remote[i]; /* a rejoin connects to it again */
        pthread_mutex_lock(&e->lock);
        l->health.peer_psn = remote[i].psn; /* the lane's first life, for LANE_DOWN */
        pthread_mutex_unlock(&e->lock);
        kvw_status_t st = kvw__dev_port_active(dev) ? kvw__qp_connect(l->qp, &remote[i], &e->cfg)
                                                    : KVW_ERR_NO_DEVICE;
        if (!st)
            continue;
        if (!first)
            snprintf(why, why_size, "QP %u on %s: %s", i, dev->name,
                     st == KVW_ERR_NO_DEVICE ? "its port is not up" : kvw_strerror(st));
        first = first ? first : st;
        *out |= 1u << i;
    }
    if (!*out || can_start_without(p, n, *out))
        return KVW_OK;
    return first;
}

void kvw__peer_set_error(kvw_peer_t *p)
{
    for (uint32_t i = 0; i < p->nlanes; i++)
        kvw__qp_set_error(p->lanes[i].qp);
}

bool kvw__peer_transition(kvw_peer_t *p, kvw_peer_state_t from, kvw_peer_state_t to)
{
    int expected = (int)from;
    return atomic_compare_exchange_strong(&p->state, &expected, (int)to);
}

/* (lock) The QP is in ERR: nothing more lands, so requests may now report
 * Failed. */
static void finish_kill_locked(kvw_peer_t *p)
{
    kvw_engine_t *e = p->engine;
    p->kill_due = false;
    atomic_store(&p->state, PEER_DEAD);
    if (p->live) {
        p->live = false;
        e->live_peers--;
    }
    uint32_t hit = 0; /* requests still running that this fails */
    for (kvw_req_t *r = e->reqs; r; r = r->next) {
        if (r->peer != p)
            continue;
        bool decode = r->role == KVW_ROLE_DECODE;
        /* a landed one ends with its copy */
        hit += !kvw__req_ended(r) && !(decode && r->stage.staging_in);
        if (decode && r->rx.aborting) /* it was being given up anyway: keep its own reason */
            kvw__req_fail(r, r->rx.abort_status, "%s (then: %s)", r->rx.abort_reason,
                          p->dead_reason);
        else
            kvw__req_fail(r, p->dead_status, "%s", p->dead_reason);
        if (decode)
            r->rx.abort_due = false;
        else
            r->tx.notify_failure = false; /* the BYE below tells decode about all of them */
        /* A parked one was handed back by its failure: with no peer, the
         * poller lets it go at once. */
        if (r->role == KVW_ROLE_DECODE && r->user_gone)
            kvw__req_touch_locked(r); /* destroyed, kept until it ended: it leaves now */
        kvw__req_attach_locked(r, NULL);
    }
    /* A peer that left (said so, or closed its control connection), or
     * one we closed in order, with nothing in flight is news, not trouble. */
    bool left =
        atomic_load(&p->closing) || atomic_load(&p->ctl_gone) || atomic_load(&p->closing_said);
    if (hit || !left)
        KVW_WARN("peer %u: %s (%u request(s) failed)", p->index, p->dead_reason, hit);
    else
        KVW_INFO("peer %u: %s", p->index, p->dead_reason);
    atomic_store(&p->bye_due, true);
    kvw__wake(e->control_wake_fd);
    kvw__wake(e->poller_wake_fd); /* it drops the peer's queues */
}

/* (lock) First caller wins; records why. */
static bool begin_kill_locked(kvw_peer_t *p, kvw_status_t st, const char *why)
{
    if (atomic_exchange(&p->killing, true))
        return false;
    p->dead_status = st;
    snprintf(p->dead_reason, sizeof(p->dead_reason), "%s", why);
    return true;
}

void kvw__peer_kill_locked(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
{
    char why[KVW_WIRE_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    if (!begin_kill_locked(p, st, why))
        return;
    p->kill_due = true;
    kvw__wake(p->engine->control_wake_fd);
}

void kvw__peer_kill(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
{
    if (atomic_load(&p->killing))
        return;
    char why[KVW_WIRE_REASON_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    kvw_engine_t *e = p->engine;
    pthread_mutex_lock(&e->lock);
    bool won = begin_kill_locked(p, st, why);
    pthread_mutex_unlock(&e->lock);
    if (!won)
        return;
    /* The QP goes to ERR before any request is reported Failed: once a
     * decode request says Failed, no write may land in its pages. */
    kvw__peer_set_error(p);
    pthread_mutex_lock(&e->lock);
    finish_kill_locked(p);
    pthread_mutex_unlock(&e->lock);
}

void kvw__peer_finish_kills(kvw_engine_t *e)
{
    uint32_t n = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < n; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || atomic_load(&p->state) == PEER_DEAD || !atomic_load(&p->killing))
            continue;
        pthread_mutex_lock(&e->lock);
        bool due = p->kill_due;
        pthread_mutex_unlock(&e->lock);
        if (!due)
            continue; /* another thread is finishing it */
        kvw__peer_set_error(p);
        pthread_mutex_lock(&e->lock);
        if (p->kill_due)
            finish_kill_locked(p);
        pthread_mutex_unlock(&e->lock);
    }
}

/* How long a closing peer's posted writes get to complete: one ACK timeout
 * (4.096 us x 2^qp_timeout, 67 ms by default), at most peer_timeout_ms. A
 * write that landed has its ACK on the wire by then. After it the NIC only
 * retransmits to a process that is gone, and a retransmission can reach a
 * new process given the dead QP's number (rxe reuses QPNs at once): its
 * connection would see our stale packets and break. */
static uint64_t close_grace_ns(const kvw_config_t *cfg)
{
    uint64_t ack_ns = cfg->qp_timeout < 40 ? 4096ull << cfg->qp_timeout : UINT64_MAX;
    uint64_t limit = kvw__ms_ns(cfg->peer_timeout_ms);
    return ack_ns < limit ? ack_ns : limit;
}

static void close_within(kvw_peer_t *p, uint64_t grace_ns, kvw_status_t st, const char *fmt,
                         va_list ap)
{
    if (atomic_load(&p->killing) || atomic_load(&p->closing))
        return;
    kvw_engine_t *e = p->engine;
    pthread_mutex_lock(&e->lock);
    vsnprintf(p->close_reason, sizeof(p->close_reason), fmt, ap);
    p->close_status = st;
    p->close_deadline_ns = kvw__now_ns() + grace_ns;
    pthread_mutex_unlock(&e->lock);
    atomic_store(&p->closing, true);
    kvw__wake(e->poller_wake_fd);  /* it decides when the writes drained */
    kvw__wake(e->control_wake_fd); /* it enforces the deadline */
}

void kvw__peer_close(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    close_within(p, close_grace_ns(&p->engine->cfg), st, fmt, ap);
    va_end(ap);
}

void kvw__peer_close_within(kvw_peer_t *p, uint64_t grace_ns, kvw_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    close_within(p, grace_ns, st, fmt, ap);
    va_end(ap);
}

void kvw__peer_close_if_drained(kvw_peer_t *p, bool drained)
{
    if (!atomic_load(&p->closing) || atomic_load(&p->killing))
        return;
    kvw_engine_t *e = p->engine;
    pthread_mutex_lock(&e->lock);
    bool due = drained || kvw__now_ns() >= p->close_deadline_ns;
    kvw_status_t st = p->close_status;
    char why[KVW_WIRE_REASON_MAX];
    snprintf(why, sizeof(why), "%s", p->close_reason);
    pthread_mutex_unlock(&e->lock);
    if (due)
        kvw__peer_kill(p, st, "%s", why);
}
