/* SPDX-License-Identifier: Apache-2.0 */
/* Prefill side of a request: the public sender API. A request is handed
 * over in parts (all at once, one prefill chunk at a time, or layer by
 * layer as the forward pass produces them); each part is planned as soon
 * as decode's pages are known and posted by the poller while later parts
 * are still being computed. The part that covers the request's last (page,
 * layer) pair, with the state given, is the final one: it also writes the
 * aux item and the state, and its last write carries the immediate that
 * tells decode the whole request landed (RC delivers in order). */
#include "engine/core.h"
#include "engine/poller.h"
#include "engine/stager.h"
#include "engine/verify.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void sender_free(kvw_req_t *r)
{
    kvw__seg_free_list(r->engine, r->tx.segs_head);
    kvw__seg_free_list(r->engine, r->stage.unstaged_head);
    kvw__seg_free_list(r->engine,
                       r->stage.staging); /* the stager stopped midway (the engine stops) */
    r->stage.staging = NULL;
    r->tx.segs_head = r->tx.segs_tail = NULL;
    r->stage.unstaged_head = r->stage.unstaged_tail = NULL;
    free(r->tx.covered);
    free(r->tx.src_state);
    r->tx.covered = r->tx.src_state = NULL;
    free(r->tx.src_state_n);
    r->tx.src_state_n = NULL;
    free(r->tx.dst_pages);
    free(r->tx.kv_geom);
    free(r->tx.dst_state_n);
}

/* (lock) Plan s against decode's pages: runs of (source, destination) pairs
 * contiguous on both sides, and for the final part the aux item and state. */
/* Head slicing: the gather writes of s's KV slots (each slot's geometry
 * is the same in every layer, so one count per slot). */
static uint64_t slice_count(const kvw_req_t *r, const kvw_seg_t *s)
{
    const kvw_peer_t *p = r->peer;
    const kvw_layout_t *l = &r->engine->layout;
    uint64_t total = 0;
    for (uint32_t j = 0; s->le > s->lb && j < l->kv_per_layer; j++) {
        kvw_heads_plan_t hp;
        kvw__seg_slice_plan(p, l, s, (size_t)s->lb * l->kv_per_layer + j, &hp);
        total += kvw__heads_count(&hp) * (s->le - s->lb);
    }
    return total;
}

/* (lock) The final part's state: each state group's regions with the runs
 * of its own list (a staged slice's sources are 0.. in its chunk). */
static void plan_state_sets(const kvw_req_t *r, kvw_seg_t *s, uint32_t nsets)
{
    const kvw_layout_t *l = &r->engine->layout;
    size_t src_off = 0, dst_off = 0, runs = 0;
    for (uint32_t g = 0; g < nsets; g++) {
        uint32_t n = r->tx.dst_state_n[g];
        const uint64_t *src = !n ? NULL : s->state_src ? s->state_src : r->tx.src_state + src_off;
        kvw_plan_set_t *set = &s->state_sets[g];
        set->slots = l->state_slots + l->state_first[g];
        set->num_slots = l->state_nslots[g];
        set->runs = n ? s->state_runs + runs : NULL;
        set->num_runs =
            n ? kvw__plan_runs(src, r->tx.dst_state + dst_off, n, s->state_runs + runs) : 0;
        runs += set->num_runs;
        src_off += r->tx.src_state_n[g];
        dst_off += n;
    }
    s->plan.state_sets = s->state_sets;
    s->plan.num_state_sets = nsets;
}

/* Landing: page position first + k lands at position first + k of each
 * KV slot's area, so runs break only where the source jumps. */
static size_t landing_runs(const uint64_t *src, size_t first, size_t n, kvw_run_t *runs)
{
    size_t nr = 0;
    for (size_t k = 0; k < n; k++) {
        if (nr && runs[nr - 1].src + runs[nr - 1].count == src[k]) {
            runs[nr - 1].count++;
            continue;
        }
        runs[nr++] = (kvw_run_t){src[k], first + k, 1};
    }
    return nr;
}

static kvw_status_t plan_seg_locked(kvw_req_t *r, kvw_seg_t *s)
{
    const kvw_engine_t *e = r->engine;
    const kvw_layout_t *l = &e->layout;
    kvw_plan_t *p = &s->plan;
    /* The runs in bytes (kvw__plan_wruns) live after the runs, in the same
     * allocation: kvw__seg_free frees both. Not zeroed: only the entries the
     * planner fills are read. */
    s->runs = s->n ? malloc(s->n * (sizeof(*s->runs) + sizeof(kvw_wrun_t))) : NULL;
    size_t ns = s->final ? r->tx.num_dst_state : 0;
    uint32_t nsets = s->final ? l->num_state_groups : 0;
    s->state_runs = ns ? calloc(ns, sizeof(*s->state_runs)) : NULL;
    s->state_sets = nsets ? calloc(nsets, sizeof(*s->state_sets)) : NULL;
    if (s->chunk) /* a staged slice: its source is the chunk */
        s->stage_regions = malloc(l->num_regions * sizeof(*s->stage_regions));
    if ((s->n && !s->runs) || (ns && !s->state_runs) || (nsets && !s->state_sets) ||
        (s->chunk && !s->stage_regions))
        return KVW_ERR_NO_MEMORY;
    if (s->chunk)
        kvw__stager_slice_regions(r, s, s->stage_regions);
    *p = (kvw_plan_t){.regions = s->chunk ? s->stage_regions : r->peer->regions,
                      .kv_slots = l->kv_slots,
                      .kv_per_layer = l->kv_per_layer,
                      .layer_begin = s->lb,
                      .layer_end = s->le,
                      .max_msg = r->peer->max_msg_sz};
    s->landing = r->tx.landing;
    s->digest_due = r->tx.verify && !r->tx.caller_digest;
    p->num_runs = s->landing
                      ? landing_runs(s->src, s->first, s->n, s->runs)
                      : kvw__plan_runs(s->src, r->tx.dst_pages ? r->tx.dst_pages + s->first : NULL,
                                       s->n, s->runs);
    p->runs = s->runs;
    s->land_addr = r->tx.land_addr;
    s->land_area = r->tx.land_area;
    s->land_rkey = r->peer->landing_rkey;
    s->sliced = r->peer->sliced || r->tx.kv_geom || r->tx.owes_none;
    s->kv_geom = r->tx.kv_geom ? r->tx.kv_geom : r->peer->kv_geom;
    s->slices_done = r->tx.owes_none; /* a rank owing no heads: no KV write */
    if (s->sliced)
        p->layer_end = p->layer_begin; /* the KV writes are the head slices' */
    else if (s->n)
        kvw__plan_wruns(p, (kvw_wrun_t *)(s->runs + s->n));
    if (s->final) {
        plan_state_sets(r, s, nsets);
        p->aux_slots = l->aux_slots;
        p->num_aux = l->num_aux;
        p->has_aux = r->tx.aux_index != KVW_NO_AUX && r->tx.dst_aux != KVW_NO_AUX;
        p->aux_src = r->tx.aux_index;
        p->aux_dst = r->tx.dst_aux;
    }
    s->writes_total = kvw__plan_count(p) + (s->sliced && !s->slices_done ? slice_count(r, s) : 0);
    return KVW_OK;
}

/* (lock) Plan the parts handed over before decode's request was known. */
static kvw_status_t plan_pending_locked(kvw_req_t *r)
{
    for (; r->tx.to_plan;
         r->tx.to_plan = atomic_load_explicit(&r->tx.to_plan->next, memory_order_relaxed)) {
        kvw_status_t st = plan_seg_locked(r, r->tx.to_plan);
        if (st)
            return st;
    }
    return KVW_OK;
}

/* (lock) The poller's first look at r: it holds a reference from now on. */
static void hand_to_poller_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    if (!r->tx.in_poller) {
        r->tx.in_poller = true;
        atomic_fetch_add(&r->refs, 1); /* the poller's, dropped when it retires r */
        r->tx.drained = false;
        atomic_store(&r->state, KVW_POLL_TRANSFERRING);
        KVW_DEBUG("room %llu: Transferring", (unsigned long long)r->room);
        /* A watchdog, not the limit: the transfer clock starts at the
         * first post (first_post_ns), which the control thread checks. */
        kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.transfer_timeout_ms));
    }
    r->tx.starved = false;
    r->qnext = NULL;
    if (e->ready_tail)
        e->ready_tail->qnext = r;
    else
        e->ready_head = r;
    e->ready_tail = r;
    atomic_store(&e->ready_pending, true);
    kvw__wake_poller(e);
}

kvw_status_t kvw__sender_feed_locked(kvw_req_t *r)
{
    if (!r->tx.have_dst || !r->tx.segs_head || atomic_load(&r->state) == KVW_POLL_FAILED)
        return KVW_OK;
    bool ranged = r->tx.kv_geom || r->tx.owes_none; /* planned per request instead */
    if (r->peer->sliced && r->peer->slice_bad && !ranged)
        return kvw__sender_fail_locked(r, KVW_ERR_MISMATCH, r->peer->slice_why);
    if ((r->peer->sliced || ranged) && kvw__stager_on(r->engine))
        return kvw__sender_fail_locked(r, KVW_ERR_UNSUPPORTED,
                                       "head slicing needs directly registered memory, not "
                                       "staged GPU memory");
    kvw_status_t st = plan_pending_locked(r);
    if (st)
        return kvw__sender_fail_locked(r, st, "no memory to plan the transfer");
    if (!r->tx.in_poller || r->tx.starved)
        hand_to_poller_locked(r);
    return KVW_OK;
}

bool kvw__sender_starve_locked(kvw_req_t *r)
{
    if (atomic_load_explicit(&r->tx.seg->next, memory_order_relaxed) || r->tx.to_plan)
        return false; /* a planned part arrived meanwhile */
    /* Failed while the poller posted its last part: its failure found it
     * on the active queue, not parked, and handed nothing back. Parked now,
     * nothing ever would: the poller drops it instead. */
    if (atomic_load(&r->state) != KVW_POLL_TRANSFERRING)
        return false;
    r->tx.starved = true;
    return true;
}

void kvw__sender_unstarve_locked(kvw_req_t *r)
{
    if (r->tx.starved)
        hand_to_poller_locked(r);
}

/* (lock) r just failed: hand a parked request back to the poller, and a
 * fan-out member's failure fails the room for the set's other receivers. */
static void sender_failed_locked(kvw_req_t *r)
{
    kvw__sender_unstarve_locked(r);
    if (r->tx.member_failed_locked) /* the set's hook (txset.c) */
        r->tx.member_failed_locked(r);
}

/* (lock) Decode may still ask for a failed request, or wait for its
 * digest. */
static bool sender_answer_owed_locked(kvw_req_t *r)
{
    if (r->tx.caller_digest && !r->tx.digest_given)
        r->tx.digest_due = false; /* verify: the caller's digest can no longer come */
    return atomic_load(&r->state) == KVW_POLL_FAILED || kvw__verify_owed_locked(r);
}

const kvw_role_ops_t kvw__prefill_ops = {
    .failed_locked = sender_failed_locked,
    .free = sender_free,
    .answer_owed_locked = sender_answer_owed_locked,
    .fail_locked = kvw__sender_fail_locked,
    .starve_locked = kvw__sender_starve_locked,
    .unstarve_locked = kvw__sender_unstarve_locked,
    .append_locked = kvw__sender_append_locked,
};

/* ----------------------------------------------------------- accepting */

kvw_status_t kvw__sender_fail_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    if (st != KVW_ERR_ABORTED)
        KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
    kvw__req_fail(r, st, "%s", why); /* a parked request goes back to the poller */
    if (r->tx.have_dst) {
        /* Decode is waiting: tell it, but only once no write of ours can
         * still land in its pages (drained), so its Failed is final. */
        r->tx.notify_failure = true;
        if (r->tx.drained)
            kvw__req_touch_locked(r);
    }
    return st;
}

/* The first state group whose counts differ between the two sides, or -1. */
static int state_mismatch(const kvw_layout_t *l, const uint32_t *src_n, const uint32_t *dst_n)
{
    for (uint32_t g = 0; g < l->num_state_groups; g++)
        if (src_n[g] != dst_n[g])
            return (int)g;
    return -1;
}

/* Decode's state lists: one per state group of ours (the layouts matched
 * at the handshake), each inside decode's regions of that group, and the
 * counts this sender gave, if it did. */
static kvw_status_t check_request_state(const kvw_req_t *r, const kvw_peer_t *peer,
                                        const kvw_msg_t *m, const uint64_t *state, char *why,
                                        size_t size)
{
    const kvw_layout_t *l = &r->engine->layout;
    uint32_t nl = m->u.request.num_state_lists;
    if (nl != l->num_state_groups) {
        snprintf(why, size, "decode sends %u state lists, prefill has %u state groups", nl,
                 l->num_state_groups);
        return KVW_ERR_MISMATCH;
    }
    size_t off = 0;
    for (uint32_t g = 0; g < nl; g++) {
        uint32_t n = m->u.request.state_counts[g];
        size_t bad = n ? kvw__first_out_of_range(state + off, n, peer->remote_state_max[g]) : 0;
        if (n && bad < n) {
            snprintf(why, size,
                     "destination state index %llu of group %u outside decode's regions "
                     "(%llu items)",
                     (unsigned long long)state[off + bad], l->state_group[g],
                     (unsigned long long)peer->remote_state_max[g]);
            return KVW_ERR_OUT_OF_RANGE;
        }
        off += n;
    }
    /* A rank leaving the state to another (head slicing) is asked for none. */
    bool rest = !(m->u.request.heads_flags & KVW_WIRE_HEADS_NO_REST);
    int g = r->tx.have_state && rest
                ? state_mismatch(l, r->tx.src_state_n, m->u.request.state_counts)
                : -1;
    if (g >= 0) {
        snprintf(why, size, "state group %u: decode asks for %u indices, prefill gave %u",
                 l->state_group[g], m->u.request.state_counts[g], r->tx.src_state_n[g]);
        return KVW_ERR_MISMATCH;
    }
    return KVW_OK;
}

/* Decode's pages, aux and state must fit its own regions (as it told us in
 * its handshake) and agree with what this sender declared. */
static kvw_status_t check_request(const kvw_req_t *r, const kvw_peer_t *peer, const kvw_msg_t *m,
                                  char *why, size_t size)
{
    uint32_t n = m->u.request.num_pages;
    const uint64_t *pages = m->u.request.pages, *state = pages ? pages + n : NULL;
    size_t bad = kvw__first_out_of_range(pages, n, peer->remote_max[KVW_LAYOUT_KV]);
    if (bad < n) {
        snprintf(why, size,
                 "destination page %llu (index %zu) outside decode's regions (%llu pages)",
                 (unsigned long long)pages[bad], bad,
                 (unsigned long long)peer->remote_max[KVW_LAYOUT_KV]);
        return KVW_ERR_OUT_OF_RANGE;
    }
    kvw_status_t st = check_request_state(r, peer, m, state, why, size);
    if (st)
        return st;
    uint32_t aux = m->u.request.aux_index, ns = m->u.request.num_state;
    /* Another prefill rank sends the aux item and state: ours are not asked. */
    bool rest = !(m->u.request.heads_flags & KVW_WIRE_HEADS_NO_REST);
    if (!rest && (aux != KVW_NO_AUX || ns)) {
        snprintf(why, size, "decode says another rank sends aux and state, yet asks for them");
        return KVW_ERR_PROTOCOL;
    }
    if (aux != KVW_NO_AUX && aux >= peer->remote_max[KVW_LAYOUT_AUX]) {
        snprintf(why, size, "destination aux index %u outside decode's aux regions (%llu items)",
                 aux, (unsigned long long)peer->remote_max[KVW_LAYOUT_AUX]);
        return KVW_ERR_OUT_OF_RANGE;
    }
    if (r->tx.inited && (r->tx.num_pages != n ||
                         (rest && (r->tx.aux_index == KVW_NO_AUX) != (aux == KVW_NO_AUX)))) {
        snprintf(why, size, "decode asks for %u pages%s, prefill sends %zu%s", n,
                 aux == KVW_NO_AUX ? "" : " + aux", r->tx.num_pages,
                 r->tx.aux_index == KVW_NO_AUX ? "" : " + aux");
        return KVW_ERR_MISMATCH;
    }
    return KVW_OK;
}

/* The KV group of our KV slot j. */
static const kvw_heads_t *slot_heads(const kvw_layout_t *l, uint32_t j)
{
    uint32_t r = l->kv_slots[j], g = 0;
    while (g + 1 < l->num_groups && r >= l->groups[g + 1].first)
        g++;
    return &l->groups[g].heads;
}

/* Decode asks for its heads in its landing buffer (path (b)): every KV
 * slot's slices contiguous there, slot after slot from off, which must lie
 * inside the buffer its HELLO advertised, like any index. tx.kv_geom turns
 * into the landing geometry. */
static kvw_status_t accept_landing(kvw_req_t *r, const kvw_peer_t *peer, const kvw_msg_t *m,
                                   char *why, size_t size)
{
    const kvw_layout_t *l = &r->engine->layout;
    const kvw_heads_geom_t *g = r->tx.kv_geom;
    uint64_t off = m->u.request.landing_off;
    for (uint32_t j = 1; j < l->kv_per_layer; j++)
        if (g[j].slice != g[0].slice || g[j].units_per_page != g[0].units_per_page) {
            snprintf(why, size, "a landing buffer needs the same head slice in every KV slot");
            return KVW_ERR_UNSUPPORTED;
        }
    uint64_t slots = (uint64_t)l->kv_layers * l->kv_per_layer;
    uint64_t area = 0, need = 0;
    bool over = __builtin_mul_overflow((uint64_t)m->u.request.num_pages * g[0].units_per_page,
                                       g[0].slice, &area) ||
                __builtin_mul_overflow(area, slots, &need);
    if (over || !peer->landing_len || off > peer->landing_len || need > peer->landing_len - off) {
        snprintf(why, size, "landing [%llu, +%llu) outside decode's landing buffer (%llu bytes)",
                 (unsigned long long)off, (unsigned long long)need,
                 (unsigned long long)peer->landing_len);
        return KVW_ERR_OUT_OF_RANGE;
    }
    for (uint32_t j = 0; j < l->kv_per_layer; j++)
        kvw__heads_landing(&r->tx.kv_geom[j], &r->tx.kv_geom[j]);
    r->tx.landing = true;
    r->tx.land_addr = peer->landing_addr + off;
    r->tx.land_area = area;
    return KVW_OK;
}

/* Decode over several prefill ranks: the head range its REQUEST asks of
 * this rank, planned per KV slot against decode's heads (tx.kv_geom), or
 * nothing owed. Every KV group must describe its heads on both sides. */
static kvw_status_t accept_heads(kvw_req_t *r, const kvw_peer_t *peer, const kvw_msg_t *m,
                                 char *why, size_t size)
{
    const kvw_layout_t *l = &r->engine->layout;
    kvw_head_range_t want = {m->u.request.head_first, m->u.request.head_count};
    if (!(m->u.request.heads_flags & KVW_WIRE_HEADS_RANGE))
        return KVW_OK;
    for (uint32_t j = 0; j < l->kv_per_layer; j++)
        if (!slot_heads(l, j)->total || !peer->kv_theirs || !peer->kv_theirs[j].total) {
            snprintf(why, size,
                     "decode asks for heads [%u, %u), but KV slot %u does not describe its "
                     "heads on both sides",
                     want.first, want.first + want.count, j);
            return KVW_ERR_UNSUPPORTED;
        }
    if (!want.count) {
        r->tx.owes_none = true;
        return KVW_OK;
    }
    const kvw_heads_t *d = &peer->kv_theirs[0];
    if (!peer->sliced) { /* the same heads on both sides: all of them, or refused */
        if (want.first == d->first && want.count == d->count)
            return KVW_OK;
        snprintf(why, size, "heads [%u, %u) of decode's [%u, %u): both sides hold the same heads",
                 want.first, want.first + want.count, d->first, d->first + d->count);
        return KVW_ERR_UNSUPPORTED;
    }
    kvw_heads_geom_t *g = calloc(l->kv_per_layer, sizeof(*g));
    if (!g)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t j = 0; j < l->kv_per_layer; j++)
        if (kvw__heads_geom(slot_heads(l, j), &peer->kv_theirs[j], want, &g[j], why, size)) {
            free(g);
            return KVW_ERR_MISMATCH;
        }
    r->tx.kv_geom = g;
    return m->u.request.heads_flags & KVW_WIRE_HEADS_LANDING ? accept_landing(r, peer, m, why, size)
                                                             : KVW_OK;
}

kvw_status_t kvw__sender_accept_request_locked(kvw_req_t *r, kvw_peer_t *peer, const kvw_msg_t *m,
                                               char *why, size_t size)
{
    const char *lacks = kvw__wire_request_lacks(m, peer->wire_caps);
    if (lacks) { /* wire 12: only what the connection agreed */
        snprintf(why, size, "the request uses %s, which the connection did not agree on", lacks);
        return KVW_ERR_PROTOCOL;
    }
    kvw_status_t st = check_request(r, peer, m, why, size);
    if (!st)
        st = kvw__verify_accept_locked(r, peer, m, why, size);
    if (!st)
        st = accept_heads(r, peer, m, why, size);
    if (st)
        return st;
    uint32_t n = m->u.request.num_pages, ns = m->u.request.num_state;
    size_t total = (size_t)n + ns;
    r->tx.dst_pages = total ? malloc(total * sizeof(uint64_t)) : NULL;
    if (total && !r->tx.dst_pages)
        return KVW_ERR_NO_MEMORY;
    if (total)
        memcpy(r->tx.dst_pages, m->u.request.pages, total * sizeof(uint64_t));
    r->tx.dst_state = r->tx.dst_pages ? r->tx.dst_pages + n : NULL;
    r->tx.num_dst_state = ns;
    uint32_t nl = m->u.request.num_state_lists; /* checked: our state groups */
    r->tx.dst_state_n = nl ? malloc(nl * sizeof(uint32_t)) : NULL;
    if (nl && !r->tx.dst_state_n)
        return KVW_ERR_NO_MEMORY;
    if (nl)
        memcpy(r->tx.dst_state_n, m->u.request.state_counts, nl * sizeof(uint32_t));
    r->tx.dst_aux = m->u.request.aux_index;
    r->tx.no_rest = m->u.request.heads_flags & KVW_WIRE_HEADS_NO_REST;
    r->tx.room_receivers = m->u.request.room_receivers;
    r->token = m->u.request.token;
    kvw__req_attach_locked(r, peer);
    r->tx.have_dst = true;
    if (!r->tx.inited)
        r->tx.num_pages = n;
    if (atomic_load(&r->state) == KVW_POLL_BOOTSTRAPPING) {
        atomic_store(&r->state, KVW_POLL_WAITING_FOR_INPUT);
        KVW_DEBUG("room %llu: WaitingForInput: decode's request (%u pages, token %u) from peer %u",
                  (unsigned long long)r->room, n, r->token, peer->index);
    }
    if (r->has_user)
        kvw__req_set_deadline_locked(r, 0); /* waiting for prefill's own compute has no limit */
    if (kvw__stager_on(r->engine))
        kvw__stager_kick_locked(r);
    return kvw__sender_feed_locked(r);
}

/* ------------------------------------------------------------- the API */

void kvw__sender_adopt_locked(kvw_req_t *r)
{
    r->has_user = true; /* adopt a request decode sent ahead of us, if any */
    if (r->orphan) {
        kvw__req_unorphan_locked(r);
        kvw__req_set_deadline_locked(r, 0); /* waiting for our compute has no limit */
    }
    atomic_fetch_add(&r->refs, 1);
}

kvw_status_t kvw__sender_create_one(kvw_engine_t *e, uint64_t room, kvw_req_t **r_p)
{
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    kvw_status_t st = KVW_OK;
    if (r && r->user_gone && r->tx.drained && !r->tx.notify_failure) {
        kvw__req_drop_locked(r); /* a destroyed sender's tombstone: the room is new */
        r = NULL;
    }
    if (r && r->has_user) {
        st = KVW_ERR_EXISTS; /* a live sender already owns this room */
    } else if (!r && !(r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room))) {
        st = KVW_ERR_NO_MEMORY;
    }
    if (!st) {
        kvw__sender_adopt_locked(r);
        /* Other decode engines that asked for the room ahead of us (a
         * fan-out sender would serve them): this one serves one. */
        for (kvw_req_t *o = kvw__req_find_next_locked(r); o; o = kvw__req_find_next_locked(o))
            if (!o->has_user && !o->user_gone && !kvw__req_ended(o))
                kvw__sender_fail_locked(o, KVW_ERR_EXISTS,
                                        "the room is already claimed by another request (its "
                                        "sender serves one decode receiver)");
    }
    pthread_mutex_unlock(&e->lock);
    if (!st)
        *r_p = r;
    return st;
}

kvw_status_t kvw__sender_init_one(kvw_req_t *r, size_t num_pages, uint32_t aux_index)
{
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    kvw_status_t st = KVW_OK;
    uint64_t *covered = calloc(e->layout.kv_layers, sizeof(uint64_t));
    pthread_mutex_lock(&e->lock);
    if (r->tx.inited || atomic_load(&r->state) == KVW_POLL_FAILED) {
        st = KVW_ERR_STATE;
    } else if (!covered) {
        st = kvw__sender_fail_locked(r, KVW_ERR_NO_MEMORY, "no memory for the request");
    } else if ((st = kvw__check_count(e, KVW_LAYOUT_KV, num_pages, why, sizeof(why))) ||
               (st = kvw__check_aux(e, aux_index, why, sizeof(why)))) {
        kvw__sender_fail_locked(r, st, why);
    } else if (r->tx.have_dst &&
               (r->tx.num_pages != num_pages ||
                (!r->tx.no_rest && (aux_index == KVW_NO_AUX) != (r->tx.dst_aux == KVW_NO_AUX)))) {
        snprintf(why, sizeof(why), "prefill sends %zu pages%s, decode asked for %zu%s", num_pages,
                 aux_index == KVW_NO_AUX ? "" : " + aux", r->tx.num_pages,
                 r->tx.dst_aux == KVW_NO_AUX ? "" : " + aux");
        st = kvw__sender_fail_locked(r, KVW_ERR_MISMATCH, why);
    } else {
        r->tx.inited = true;
        r->tx.num_pages = num_pages;
        r->tx.aux_index = aux_index;
        r->tx.covered = covered;
        covered = NULL;
    }
    pthread_mutex_unlock(&e->lock);
    free(covered);
    return st;
}

/* (lock) Is the request complete once these layers have `upto` pages? */
static bool completes_locked(const kvw_req_t *r, uint32_t lb, uint32_t le, uint64_t upto)
{
    const kvw_engine_t *e = r->engine;
    if (e->layout.num_state && !r->tx.have_state)
        return false;
    for (uint32_t l = 0; l < e->layout.kv_layers; l++)
        if ((l >= lb && l < le ? upto : r->tx.covered[l]) != r->tx.num_pages)
            return false;
    return true;
}

/* (lock) A part out of order or out of bounds changes nothing. */
static kvw_status_t check_part_locked(const kvw_req_t *r, const kvw_part_t *part, char *why,
                                      size_t size)
{
    uint32_t lb = part->layer_begin, le = part->layer_end, layers = r->engine->layout.kv_layers;
    if (lb > le || le > layers) {
        snprintf(why, size, "layers [%u, %u) outside the %u kv layers", lb, le, layers);
        return KVW_ERR_INVALID;
    }
    if (part->first_page > r->tx.num_pages ||
        part->num_pages > r->tx.num_pages - part->first_page) {
        snprintf(why, size, "pages [%zu, %zu) past the %zu init declared", part->first_page,
                 part->first_page + part->num_pages, r->tx.num_pages);
        return KVW_ERR_INVALID;
    }
    for (uint32_t l = lb; l < le; l++)
        if (r->tx.covered[l] != part->first_page) {
            snprintf(why, size, "layer %u has pages [0, %llu) handed over, the part starts at %zu",
                     l, (unsigned long long)r->tx.covered[l], part->first_page);
            return KVW_ERR_INVALID;
        }
    return KVW_OK;
}

static kvw_seg_t *new_seg(const kvw_part_t *part, uint32_t lb, uint32_t le)
{
    kvw_seg_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->first = part->first_page;
    s->n = part->num_pages;
    s->lb = lb;
    s->le = le;
    s->src = s->n ? malloc(s->n * sizeof(uint64_t)) : NULL;
    if (s->n && !s->src) {
        free(s);
        return NULL;
    }
    if (s->n)
        memcpy(s->src, part->pages, s->n * sizeof(uint64_t));
    return s;
}

kvw_status_t kvw__sender_append_locked(kvw_req_t *r, kvw_seg_t *s)
{
    if (r->tx.have_dst && !r->tx.to_plan) {
        kvw_status_t st = plan_seg_locked(r, s);
        if (st) {
            kvw__seg_free(r->engine, s);
            return kvw__sender_fail_locked(r, st, "no memory to plan the transfer");
        }
    } else if (!r->tx.to_plan) {
        r->tx.to_plan = s;
    }
    if (r->tx.segs_tail) /* release: the poller follows next without the lock */
        atomic_store_explicit(&r->tx.segs_tail->next, s, memory_order_release);
    else
        r->tx.segs_head = s;
    r->tx.segs_tail = s;
    r->tx.final_given |= s->final;
    return kvw__sender_feed_locked(r);
}

/* (lock) A new part: to the stager when GPU regions are staged, else
 * straight to the request. */
static kvw_status_t hand_over_locked(kvw_req_t *r, kvw_seg_t *s)
{
    if (!kvw__stager_on(r->engine))
        return kvw__sender_append_locked(r, s);
    r->tx.final_given |= s->final;
    kvw__stager_take_part_locked(r, s);
    return KVW_OK;
}

static kvw_status_t send_part_locked(kvw_req_t *r, const kvw_part_t *part, void *event)
{
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    if (!r->tx.inited || r->tx.final_given || kvw__req_ended(r))
        return KVW_ERR_STATE;
    kvw_part_t p = *part;
    if (!p.layer_begin && !p.layer_end)
        p.layer_end = e->layout.kv_layers;
    kvw_status_t st = check_part_locked(r, &p, why, sizeof(why));
    if (st) {
        KVW_ERROR("room %llu: part refused: %s", (unsigned long long)r->room, why);
        return st;
    }
    if ((st = kvw__check_indices(e, KVW_LAYOUT_KV, "source", p.pages, p.num_pages, why,
                                 sizeof(why))))
        return kvw__sender_fail_locked(r, st, why);
    kvw_seg_t *s = new_seg(&p, p.layer_begin, p.layer_end);
    if (!s)
        return kvw__sender_fail_locked(r, KVW_ERR_NO_MEMORY, "no memory for the page list");
    uint64_t upto = p.first_page + p.num_pages;
    s->event = event;
    s->final = completes_locked(r, p.layer_begin, p.layer_end, upto);
    for (uint32_t l = p.layer_begin; l < p.layer_end; l++)
        r->tx.covered[l] = upto;
    return hand_over_locked(r, s);
}

/* An event can only be waited for with CUDA there: without it the call
 * is refused, and nothing changes. */
static kvw_status_t check_event(const kvw_req_t *r, void *event)
{
    if (!event)
        return KVW_OK;
    const kvw_cuda_ops_t *cu = kvw__cuda_ops();
    char why[160] = "";
    if (cu->init(why, sizeof(why)) == 0 && cu->event_query)
        return KVW_OK;
    if (!why[0])
        snprintf(why, sizeof(why), "the driver lacks cuEventQuery");
    KVW_ERROR("room %llu: a CUDA event came with the part, but CUDA is not available (%s): "
              "events are for pages a GPU writes; pass NULL for pages already written",
              (unsigned long long)r->room, why);
    return KVW_ERR_UNSUPPORTED;
}

kvw_status_t kvw__sender_send_part_one(kvw_req_t *r, const kvw_part_t *part, void *cuda_event)
{
    kvw_status_t st = check_event(r, cuda_event);
    if (st)
        return st;
    kvw__wake_defer(); /* post from this thread if the poller sleeps */
    pthread_mutex_lock(&r->engine->lock);
    st = send_part_locked(r, part, cuda_event);
    pthread_mutex_unlock(&r->engine->lock);
    kvw__poller_help(r->engine);
    return st;
}

kvw_status_t kvw__sender_send_one(kvw_req_t *r, const uint64_t *pages, size_t n, void *cuda_event)
{
    kvw_status_t st = check_event(r, cuda_event);
    if (st)
        return st;
    kvw__wake_defer();
    pthread_mutex_lock(&r->engine->lock);
    /* Chunks cover every layer alike: continue from layer 0's count. */
    kvw_part_t part = {.pages = pages, .num_pages = n};
    part.first_page = r->tx.covered && r->engine->layout.kv_layers ? r->tx.covered[0] : 0;
    st = send_part_locked(r, &part, cuda_event);
    pthread_mutex_unlock(&r->engine->lock);
    kvw__poller_help(r->engine);
    return st;
}

kvw_status_t kvw__sender_send_state_one(kvw_req_t *r, const uint64_t *state, size_t n,
                                        const kvw_state_list_t *lists, size_t num_lists)
{
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    uint64_t *copy = NULL;
    uint32_t *counts = NULL;
    size_t total = 0;
    /* Checked (each list against its group's regions) and copied before
     * the lock: the regions are fixed. */
    kvw_status_t checked = kvw__state_lists(e, "source", state, n, lists, num_lists, 0, &copy,
                                            &counts, &total, why, sizeof(why));
    kvw__wake_defer();
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = KVW_OK;
    int g = -1;
    if (!r->tx.inited || r->tx.have_state || r->tx.final_given || kvw__req_ended(r)) {
        st = KVW_ERR_STATE;
    } else if (!e->layout.num_state) {
        st = KVW_ERR_INVALID; /* no state group to write */
    } else if (checked == KVW_ERR_INVALID) {
        st = checked; /* a bad argument: nothing changes */
        KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
    } else if (checked) {
        kvw__sender_fail_locked(r, checked, why);
        st = checked;
    } else if (r->tx.have_dst && !r->tx.no_rest &&
               (g = state_mismatch(&e->layout, counts, r->tx.dst_state_n)) >= 0) {
        snprintf(why, sizeof(why), "state group %u: prefill gives %u indices, decode asked for %u",
                 e->layout.state_group[g], counts[g], r->tx.dst_state_n[g]);
        st = kvw__sender_fail_locked(r, KVW_ERR_MISMATCH, why);
    } else {
        r->tx.src_state = copy;
        r->tx.num_src_state = total;
        r->tx.src_state_n = counts;
        r->tx.have_state = true;
        copy = NULL;
        counts = NULL;
        if (completes_locked(r, 0, 0, 0)) { /* every page already handed over */
            kvw_part_t none = {.first_page = r->tx.num_pages};
            kvw_seg_t *s = new_seg(&none, 0, 0);
            if (!s)
                st = kvw__sender_fail_locked(r, KVW_ERR_NO_MEMORY, "no memory");
            else {
                s->final = true;
                st = hand_over_locked(r, s);
            }
        }
    }
    free(counts);
    pthread_mutex_unlock(&e->lock);
    kvw__poller_help(e);
    free(copy);
    return st;
}

kvw_status_t kvw__sender_requested_one(const kvw_req_t *r, size_t *num_pages_p, uint32_t *aux_p)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    /* Decode's count: prefill's own, once inited, equals it or failed the request. */
    bool known = r->tx.have_dst;
    size_t n = r->tx.num_pages;
    uint32_t aux = r->tx.dst_aux == KVW_NO_AUX ? KVW_NO_AUX : 0;
    pthread_mutex_unlock(&e->lock);
    if (!known)
        return KVW_ERR_STATE;
    if (num_pages_p)
        *num_pages_p = n;
    if (aux_p)
        *aux_p = aux;
    return KVW_OK;
}

kvw_status_t kvw__sender_set_digest_locked(kvw_req_t *r, uint64_t digest)
{
    /* After Success too: the writes may complete before the caller's
     * digest is computed; the DIGEST waits for it. */
    if (r->engine->verify_mode != KVW_VERIFY_CALLER || r->tx.digest_given ||
        atomic_load(&r->state) == KVW_POLL_FAILED)
        return KVW_ERR_STATE;
    r->tx.digest_given = true;
    r->tx.given = digest;
    kvw__req_touch_locked(r); /* the control thread sends it once it may */
    return KVW_OK;
}

kvw_status_t kvw__sender_abort_one(kvw_req_t *r, const char *why)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = kvw__req_ended(r) ? KVW_ERR_STATE : KVW_OK;
    if (!st)
        kvw__sender_fail_locked(r, KVW_ERR_ABORTED, why);
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it now, not at the next completion */
    return st;
}

void kvw__sender_destroy_one(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    if (!kvw__req_ended(r))
        kvw__sender_fail_locked(r, KVW_ERR_ABORTED, "sender destroyed by the caller");
    kvw__req_release_handle_locked(r);
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it */
    kvw__req_unref(r);            /* the caller's */
}
