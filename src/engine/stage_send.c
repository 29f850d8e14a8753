/* SPDX-License-Identifier: Apache-2.0 */
/* The stager's prefill half (engine/stager.h): a sender's parts cut into
 * slices of at most a chunk, each copied from the GPU into its chunk and
 * appended to the request with the chunk as its source; chunks shared
 * out between connections and given back once their writes completed. */
#include "engine/stager_int.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- slices: where each staged region's items sit in a chunk ------------------ */

typedef void (*visit_fn)(void *arg, uint32_t region, uint32_t kind, uint64_t off, size_t count);

/* Walk a slice's staged regions in chunk order (KV layer by layer, then
 * state, then aux, as the planner posts them); returns the bytes used. */
static uint64_t visit_slice(const kvw_stager_t *st, const kvw_seg_t *s, const uint32_t *state_n,
                            bool aux, visit_fn fn, void *arg)
{
    const kvw_engine_t *e = st->e;
    const kvw_layout_t *l = &e->layout;
    uint64_t off = 0;
    for (uint32_t layer = s->lb; st->kind[KVW_LAYOUT_KV] && s->n && layer < s->le; layer++)
        for (uint32_t j = 0; j < l->kv_per_layer; j++) {
            uint32_t k = l->kv_slots[layer * l->kv_per_layer + j];
            if (fn)
                fn(arg, k, KVW_LAYOUT_KV, off, s->n);
            off += s->n * e->regions[k].item_len;
        }
    /* Each state group's regions hold its own list's items (state_n). */
    for (uint32_t g = 0;
         s->final && st->kind[KVW_LAYOUT_STATE] && state_n && g < l->num_state_groups; g++)
        for (uint32_t i = 0; state_n[g] && i < l->state_nslots[g]; i++) {
            uint32_t k = l->state_slots[l->state_first[g] + i];
            if (fn)
                fn(arg, k, KVW_LAYOUT_STATE, off, state_n[g]);
            off += state_n[g] * e->regions[k].item_len;
        }
    for (uint32_t i = 0; s->final && st->kind[KVW_LAYOUT_AUX] && aux && i < l->num_aux; i++) {
        uint32_t k = l->aux_slots[i];
        if (fn)
            fn(arg, k, KVW_LAYOUT_AUX, off, 1);
        off += e->regions[k].item_len;
    }
    return off;
}

static bool final_has_aux(const kvw_req_t *r)
{
    return r->tx.aux_index != KVW_NO_AUX && r->tx.dst_aux != KVW_NO_AUX;
}

static uint8_t *chunk_addr(const kvw_stager_t *st, uint32_t id)
{
    return st->pool->base + (size_t)(id - 1) * st->chunk_len;
}

typedef struct {
    const kvw_stager_t *st;
    const kvw_req_t *r;
    kvw_plan_region_t *out;
    uint8_t *chunk;
} regions_arg_t;

static void point_at_chunk(void *arg, uint32_t k, uint32_t kind, uint64_t off, size_t count)
{
    regions_arg_t *a = arg;
    (void)count;
    kvw_plan_region_t *g = &a->out[k];
    g->local_addr = (uint64_t)(uintptr_t)(a->chunk + off);
    g->lkey = a->st->pool->lkey;
    /* The planner reads the aux item at aux_src * item: make that the chunk. */
    if (kind == KVW_LAYOUT_AUX)
        g->local_addr -= (uint64_t)a->r->tx.aux_index * g->item_len;
}

void kvw__stager_slice_regions(const kvw_req_t *r, const kvw_seg_t *s, kvw_plan_region_t *out)
{
    const kvw_stager_t *st = r->engine->stager;
    memcpy(out, r->peer->regions, r->engine->layout.num_regions * sizeof(*out));
    regions_arg_t a = {st, r, out, chunk_addr(st, s->chunk)};
    visit_slice(st, s, r->tx.src_state_n, final_has_aux(r), point_at_chunk, &a);
}

/* ---- prefill: chunks -------------------------------------------------------- */

void kvw__stager_drop_unposted(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    for (kvw_seg_t *s = r->tx.segs_head; s;
         s = atomic_load_explicit(&s->next, memory_order_relaxed))
        if (s->chunk) {
            kvw__stager_put_chunk(e, s->chunk);
            s->chunk = 0;
        }
    pthread_mutex_unlock(&e->lock);
}

void kvw__stager_chunk_posted(kvw_peer_t *p, kvw_seg_t *s)
{
    kvw_stager_t *st = p->engine->stager;
    uint32_t id = s->chunk;
    s->chunk = 0; /* the poller's now */
    /* A slice's writes may span lanes: wait for all that was built on each. */
    uint64_t *upto = &st->chunk_seq[(size_t)(id - 1) * KVW_MAX_LANES];
    for (uint32_t i = 0; i < p->nlanes; i++)
        upto[i] = p->lanes[i].txq.posted + p->lanes[i].txq.pending;
    st->chunk_next[id - 1] = 0;
    if (p->chunk_tail)
        st->chunk_next[p->chunk_tail - 1] = id;
    else
        p->chunk_head = id;
    p->chunk_tail = id;
}

/* Everything built on p's lanes before the chunk's slice completed. */
static bool chunk_read(const kvw_stager_t *st, const kvw_peer_t *p, uint32_t id)
{
    const uint64_t *upto = &st->chunk_seq[(size_t)(id - 1) * KVW_MAX_LANES];
    for (uint32_t i = 0; i < p->nlanes; i++)
        if (p->lanes[i].txq.completed < upto[i])
            return false;
    return true;
}

void kvw__stager_chunks_completed(kvw_peer_t *p, bool all)
{
    kvw_stager_t *st = p->engine->stager;
    uint32_t id;
    while ((id = p->chunk_head) && (all || chunk_read(st, p, id))) {
        p->chunk_head = st->chunk_next[id - 1];
        kvw__stager_put_chunk(p->engine, id);
    }
    if (!p->chunk_head)
        p->chunk_tail = 0;
}

/* ---- prefill: the stager thread's side --------------------------------------- */

void kvw__stager_take_part_locked(kvw_req_t *r, kvw_seg_t *s)
{
    s->next = NULL;
    if (r->stage.unstaged_tail)
        r->stage.unstaged_tail->next = s;
    else
        r->stage.unstaged_head = s;
    r->stage.unstaged_tail = s;
    if (r->tx.have_dst)
        kvw__stage_push_job(r->engine->stager, r);
}

void kvw__stager_kick_locked(kvw_req_t *r)
{
    if (r->stage.unstaged_head)
        kvw__stage_push_job(r->engine->stager, r);
}

/* Append a finished slice to its request, or drop it if the request ended
 * (or failed: st). */
static void deliver(kvw_stager_t *st, kvw_req_t *r, kvw_seg_t *s, kvw_status_t err, const char *why)
{
    kvw_engine_t *e = st->e;
    pthread_mutex_lock(&e->lock);
    if (err && !kvw__req_ended(r))
        r->engine->ops->fail_locked(r, err, why);
    if (kvw__req_ended(r))
        kvw__seg_free(e, s);
    else
        r->engine->ops->append_locked(r, s); /* frees s if it cannot plan it */
    pthread_mutex_unlock(&e->lock);
}

/* Wait for the oldest slice's copies, then hand it over. */
static void finish_oldest(kvw_stager_t *st)
{
    pending_slice_t ps = st->pend[0];
    memmove(st->pend, st->pend + 1, (size_t)(st->npend - 1) * sizeof(st->pend[0]));
    st->npend--;
    char why[100] = "", msg[KVW_WIRE_REASON_MAX];
    kvw_status_t err = kvw__staging_wait(st->pool, ps.lane, why, sizeof(why));
    snprintf(msg, sizeof(msg), "copying GPU memory into the staging pool failed: %.100s", why);
    deliver(st, ps.r, ps.s, err, msg);
    kvw__req_unref(ps.r);
}

void kvw__stage_finish_all(kvw_stager_t *st)
{
    while (st->npend)
        finish_oldest(st);
}

/* A free chunk for r's connection, without waiting: 0 when the pool is
 * empty, the connection holds its share (peer_cap) or the engine stops.
 * The thread then parks r and serves the other requests: waiting here
 * would make every connection wait for the slowest. */
static uint32_t take_chunk(kvw_stager_t *st, const kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    peer_share_t *sh = &st->share[r->stage.slot];
    if (sh->serial != r->stage.serial) /* the slot's earlier connection is gone */
        *sh = (peer_share_t){r->stage.serial, 0};
    uint32_t id = 0;
    if (!st->stop && st->nfree && sh->held < st->peer_cap) {
        id = st->free_chunks[--st->nfree];
        st->owner[id - 1] = (chunk_owner_t){r->stage.slot, r->stage.serial};
        sh->held++;
    } else if (!st->park_gen_set) { /* the next chunk back wakes the parked */
        st->park_gen = st->chunks_back;
        st->park_gen_set = true;
    }
    pthread_mutex_unlock(&st->lock);
    return id;
}

/* The source list of state region k's group. */
static const uint64_t *state_src_of(const kvw_req_t *r, uint32_t k)
{
    int g = kvw__layout_state_of_region(&r->engine->layout, k);
    return r->tx.src_state + kvw__state_off(r->tx.src_state_n, (uint32_t)g);
}

static void copy_out(void *arg, uint32_t k, uint32_t kind, uint64_t off, size_t count)
{
    copy_arg_t *a = arg;
    uint64_t aux = a->r->tx.aux_index;
    const uint64_t *idx = kind == KVW_LAYOUT_KV      ? a->pages
                          : kind == KVW_LAYOUT_STATE ? state_src_of(a->r, k)
                                                     : &aux;
    kvw__stage_copy_runs(a, k, idx, count, a->chunk + off, false);
}

static uint64_t *identity(size_t n)
{
    uint64_t *v = n ? malloc(n * sizeof(uint64_t)) : NULL;
    for (size_t i = 0; v && i < n; i++)
        v[i] = i;
    return v;
}

static kvw_seg_t *new_slice(const kvw_seg_t *part, size_t p0, size_t n, uint32_t lb, uint32_t le,
                            bool final, size_t ns, bool staged_state)
{
    kvw_seg_t *x = calloc(1, sizeof(*x));
    if (!x)
        return NULL;
    *x = (kvw_seg_t){.first = part->first + p0, .n = n, .lb = lb, .le = le, .final = final};
    x->src = identity(n);
    x->state_src = staged_state ? identity(ns) : NULL;
    if ((n && !x->src) || (staged_state && ns && !x->state_src)) {
        free(x->src);
        free(x->state_src);
        free(x);
        return NULL;
    }
    return x;
}

static void fail_part(kvw_stager_t *st, kvw_req_t *r, kvw_status_t err, const char *why)
{
    pthread_mutex_lock(&st->e->lock);
    if (!kvw__req_ended(r))
        r->engine->ops->fail_locked(r, err, why);
    pthread_mutex_unlock(&st->e->lock);
}

/* Stage pages [p0, p0 + n) of layers [lb, le) of part (or, final, its
 * state and aux) as one slice. */
static slice_rc_t stage_slice(kvw_stager_t *st, kvw_req_t *r, const kvw_seg_t *part, size_t p0,
                              size_t n, uint32_t lb, uint32_t le, bool final)
{
    /* A staged state group's sources are 0.. in the chunk: identity of the
     * longest list serves every group. */
    size_t ns = 0;
    const uint32_t *state_n = final ? r->tx.src_state_n : NULL;
    for (uint32_t g = 0; state_n && g < st->e->layout.num_state_groups; g++)
        ns = state_n[g] > ns ? state_n[g] : ns;
    bool aux = final && final_has_aux(r);
    kvw_seg_t *x = new_slice(part, p0, n, lb, le, final, ns, st->kind[KVW_LAYOUT_STATE]);
    if (!x) {
        fail_part(st, r, KVW_ERR_NO_MEMORY, "no memory to stage a part");
        return SLICE_FAILED;
    }
    uint64_t bytes = visit_slice(st, x, state_n, aux, NULL, NULL);
    if (!bytes) { /* nothing of it is staged: in order, after what is */
        kvw__stage_finish_all(st);
        deliver(st, r, x, KVW_OK, NULL);
        return SLICE_OK;
    }
    if (bytes > st->chunk_len) {
        char why[KVW_WIRE_REASON_MAX];
        snprintf(why, sizeof(why),
                 "the state and aux items (%llu bytes) do not fit one staging chunk "
                 "(KVW_STAGING_CHUNK_KIB=%zu)",
                 (unsigned long long)bytes, st->chunk_len >> 10);
        kvw__seg_free(st->e, x);
        fail_part(st, r, KVW_ERR_LIMIT, why);
        return SLICE_FAILED;
    }
    if (!(x->chunk = take_chunk(st, r))) {
        kvw__seg_free(st->e, x);
        return SLICE_WAIT;
    }
    copy_arg_t a = {.st = st,
                    .r = r,
                    .pages = part->src + p0,
                    .chunk = chunk_addr(st, x->chunk),
                    .lane = st->next_lane};
    visit_slice(st, x, state_n, aux, copy_out, &a);
    atomic_fetch_add(&r->refs, 1);
    st->pend[st->npend++] = (pending_slice_t){r, x, a.lane};
    st->next_lane = (st->next_lane + 1) % st->pool->lanes;
    if (a.err) { /* its wait reports it; the copies queued before still run */
        KVW_ERROR("room %llu: staging copy refused: %s", (unsigned long long)r->room, a.why);
        fail_part(st, r, KVW_ERR_TRANSFER, a.why);
    }
    if (st->npend == st->pool->lanes)
        finish_oldest(st);
    return SLICE_OK;
}

/* Bytes of one page of a layer over its KV regions. */
static uint64_t layer_page_bytes(const kvw_engine_t *e, uint32_t layer)
{
    const kvw_layout_t *l = &e->layout;
    uint64_t bytes = 0;
    for (uint32_t j = 0; j < l->kv_per_layer; j++)
        bytes += e->regions[l->kv_slots[layer * l->kv_per_layer + j]].item_len;
    return bytes;
}

/* Cut a part's KV pages into slices of at most a chunk: as many whole
 * layers as fit, or a layer's pages in pieces; from r->stage.layer and
 * r->stage.page on, which follow each slice staged. */
static slice_rc_t stage_kv(kvw_stager_t *st, kvw_req_t *r, const kvw_seg_t *s)
{
    while (r->stage.layer < s->le) {
        uint32_t l0 = r->stage.layer;
        uint64_t bytes = s->n * layer_page_bytes(st->e, l0);
        if (bytes <= st->chunk_len) {
            uint32_t l1 = l0 + 1;
            while (l1 < s->le && bytes + s->n * layer_page_bytes(st->e, l1) <= st->chunk_len)
                bytes += s->n * layer_page_bytes(st->e, l1++);
            slice_rc_t rc = stage_slice(st, r, s, 0, s->n, l0, l1, false);
            if (rc != SLICE_OK)
                return rc;
            r->stage.layer = l1;
            continue;
        }
        size_t per = st->chunk_len / layer_page_bytes(st->e, l0); /* >= 1: checked at create */
        while (r->stage.page < s->n) {
            size_t p0 = r->stage.page, n = s->n - p0 < per ? s->n - p0 : per;
            slice_rc_t rc = stage_slice(st, r, s, p0, n, l0, l0 + 1, false);
            if (rc != SLICE_OK)
                return rc;
            r->stage.page = p0 + n;
        }
        r->stage.page = 0;
        r->stage.layer = l0 + 1;
    }
    return SLICE_OK;
}

/* Hand a part of nothing staged over as it is, after the slices before it. */
static void pass_through(kvw_stager_t *st, kvw_req_t *r, kvw_seg_t *s)
{
    kvw__stage_finish_all(st);
    deliver(st, r, s, KVW_OK, NULL);
}

/* A part's pages as they are (KV is not staged), its staged tail after. */
static slice_rc_t pass_pages(kvw_stager_t *st, kvw_req_t *r, const kvw_seg_t *s)
{
    kvw_seg_t *x = new_slice(s, 0, s->n, s->lb, s->le, false, 0, false);
    if (!x) {
        fail_part(st, r, KVW_ERR_NO_MEMORY, "no memory to stage a part");
        return SLICE_FAILED;
    }
    memcpy(x->src, s->src, s->n * sizeof(uint64_t));
    pass_through(st, r, x);
    return SLICE_OK;
}

/* Steps of a part (r->stage.step): its KV pages, then (final part) the
 * state and aux. */
enum { STEP_KV, STEP_TAIL };

/* Stage the rest of r's current part (r->stage.staging), then let go of it;
 * SLICE_WAIT leaves it, to resume where it stopped. */
static slice_rc_t stage_current(kvw_stager_t *st, kvw_req_t *r)
{
    kvw_seg_t *s = r->stage.staging;
    bool kv = s->n && s->le > s->lb;
    bool tail = s->final && (st->kind[KVW_LAYOUT_STATE] || st->kind[KVW_LAYOUT_AUX]);
    if (!st->kind[KVW_LAYOUT_KV] && !tail) {
        r->stage.staging = NULL;
        pass_through(st, r, s);
        return SLICE_OK;
    }
    slice_rc_t rc = SLICE_OK;
    if (r->stage.step == STEP_KV) {
        if (kv && st->kind[KVW_LAYOUT_KV])
            rc = stage_kv(st, r, s);
        else if (kv)
            rc = pass_pages(st, r, s);
        if (rc == SLICE_WAIT)
            return rc;
        r->stage.step = STEP_TAIL;
    }
    if (rc == SLICE_OK && s->final && stage_slice(st, r, s, s->n, 0, 0, 0, true) == SLICE_WAIT)
        return SLICE_WAIT;
    r->stage.staging = NULL;
    kvw__seg_free(st->e, s);
    return rc;
}

/* (lock) r's next part becomes the current one, staged from its start for
 * r's connection. false when there is none, or r ended (then what it
 * still had is dropped: *drop). */
static bool next_part_locked(kvw_req_t *r, kvw_seg_t **drop)
{
    if (kvw__req_ended(r) || !r->peer) { /* a dead connection failed it */
        *drop = r->stage.unstaged_head;
        r->stage.unstaged_head = r->stage.unstaged_tail = NULL;
        return false;
    }
    kvw_seg_t *s = r->stage.unstaged_head;
    if (!s)
        return false;
    r->stage.unstaged_head = atomic_load_explicit(&s->next, memory_order_relaxed);
    if (!r->stage.unstaged_head)
        r->stage.unstaged_tail = NULL;
    s->next = NULL;
    r->stage.staging = s;
    r->stage.step = STEP_KV;
    r->stage.layer = s->lb;
    r->stage.page = 0;
    r->stage.slot = r->peer->index;
    r->stage.serial = r->peer->serial;
    return true;
}

static void free_parts(kvw_engine_t *e, kvw_seg_t *s)
{
    while (s) {
        kvw_seg_t *next = atomic_load_explicit(&s->next, memory_order_relaxed);
        kvw__seg_free(e, s);
        s = next;
    }
}

/* Stage r's parts in order, from where it stopped; SLICE_WAIT when it must
 * wait for a chunk. */
slice_rc_t kvw__stage_parts(kvw_stager_t *st, kvw_req_t *r)
{
    kvw_engine_t *e = st->e;
    for (;;) {
        kvw_seg_t *drop = NULL;
        pthread_mutex_lock(&e->lock);
        bool ended = kvw__req_ended(r);
        bool more = r->stage.staging || next_part_locked(r, &drop);
        pthread_mutex_unlock(&e->lock);
        free_parts(e, drop);
        if (ended && r->stage.staging) { /* stopped midway: nothing more of it goes */
            kvw__seg_free(e, r->stage.staging);
            r->stage.staging = NULL;
            continue;
        }
        if (!more)
            return SLICE_OK;
        /* Nothing of a part is read (copied, or passed to the NIC as it
         * is) before its producer's event completed; the slices made of
         * it carry none. No host wait: r waits aside, the others go on. */
        char why[KVW_WIRE_REASON_MAX];
        int ev = kvw__seg_event_ready(r, r->stage.staging, why, sizeof(why));
        if (ev == 0)
            return SLICE_EVENT;
        if (ev < 0) { /* r fails; the next round drops what it has left */
            fail_part(st, r, KVW_ERR_TRANSFER, why);
            continue;
        }
        if (stage_current(st, r) == SLICE_WAIT)
            return SLICE_WAIT;
    }
}

/* ---- the thread's side: parking ------------------------------------------------ */

/* r waits for a chunk: the slices copied so far go to the NIC first (their
 * chunks come back once it read them), then r parks, keeping the job's
 * reference, unless a new part queued it again meanwhile. */
void kvw__stage_park(kvw_stager_t *st, kvw_req_t *r)
{
    kvw__stage_finish_all(st);
    pthread_mutex_lock(&st->lock);
    bool queued = r->stage.queued;
    if (!queued) {
        r->stage.parked = true;
        kvw__stage_append_req(&st->park_head, &st->park_tail, r);
    }
    pthread_mutex_unlock(&st->lock);
    if (queued)
        kvw__req_unref(r);
}

/* r's part waits on its producer's event: aside, keeping the job's
 * reference, until the next look (unless a new part queued it again). */
void kvw__stage_wait_event(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    bool queued = r->stage.queued;
    if (!queued) {
        r->stage.evwait = true;
        if (!st->ev_head)
            st->ev_due_ns = kvw__now_ns() + KVW_EVENT_RECHECK_US * 1000ull;
        kvw__stage_append_req(&st->ev_head, &st->ev_tail, r);
    }
    pthread_mutex_unlock(&st->lock);
    atomic_fetch_add_explicit(&st->e->counters.event_waits, 1, memory_order_relaxed);
    if (queued)
        kvw__req_unref(r);
}

/* (lock) Time to look at the waiting events again: those requests go to
 * the job queue, in order, with their reference. */
void kvw__stage_requeue_events_locked(kvw_stager_t *st)
{
    kvw_req_t *r;
    while ((r = st->ev_head)) {
        st->ev_head = r->stage.snext;
        r->stage.evwait = false;
        r->stage.queued = true;
        kvw__stage_append_req(&st->job_head, &st->job_tail, r);
    }
    st->ev_tail = NULL;
}

/* (lock) A chunk came back: every parked request tries again, in order,
 * on the job queue (with the park's reference; one queued meanwhile
 * already has one: *drop). */
kvw_req_t *kvw__stage_unpark_all_locked(kvw_stager_t *st)
{
    kvw_req_t *r, *drop = NULL;
    st->park_gen_set = false;
    while ((r = st->park_head)) {
        st->park_head = r->stage.snext;
        r->stage.parked = false;
        if (r->stage.queued) {
            r->stage.snext = drop;
            drop = r;
            continue;
        }
        r->stage.queued = true;
        kvw__stage_append_req(&st->job_head, &st->job_tail, r);
    }
    st->park_tail = NULL;
    return drop;
}

kvw_status_t kvw__stage_setup_chunks(kvw_stager_t *st)
{
    const kvw_engine_t *e = st->e;
    st->chunk_len = (size_t)e->cfg.staging_chunk_kib << 10;
    if (st->chunk_len > st->pool->len)
        st->chunk_len = st->pool->len;
    for (uint32_t l = 0; st->kind[KVW_LAYOUT_KV] && l < e->layout.kv_layers; l++)
        if (layer_page_bytes(e, l) > st->chunk_len) {
            KVW_ERROR("staging: one page of layer %u (%llu bytes) does not fit a chunk "
                      "(KVW_STAGING_CHUNK_KIB=%u)",
                      l, (unsigned long long)layer_page_bytes(e, l), e->cfg.staging_chunk_kib);
            return KVW_ERR_INVALID;
        }
    st->nchunks = (uint32_t)(st->pool->len / st->chunk_len);
    st->free_chunks = calloc(st->nchunks, sizeof(uint32_t));
    st->chunk_next = calloc(st->nchunks, sizeof(uint32_t));
    st->chunk_seq = calloc((size_t)st->nchunks * KVW_MAX_LANES, sizeof(uint64_t));
    st->owner = calloc(st->nchunks, sizeof(*st->owner));
    st->share = calloc(e->peer_slots, sizeof(*st->share));
    if (!st->free_chunks || !st->chunk_next || !st->chunk_seq || !st->owner || !st->share)
        return KVW_ERR_NO_MEMORY;
    for (uint32_t i = 0; i < st->nchunks; i++) /* chunk 1 on top */
        st->free_chunks[st->nfree++] = st->nchunks - i;
    /* A quarter of the pool, and enough to copy one slice per lane while
     * the NIC writes another: past that, more chunks in flight to one
     * connection add nothing to its pipeline, and a quarter held by a
     * stalled one still leaves the others most of the pool. */
    st->peer_cap = st->nchunks / 4;
    if (st->peer_cap < (uint32_t)st->pool->lanes + 1)
        st->peer_cap = (uint32_t)st->pool->lanes + 1;
    if (st->peer_cap > st->nchunks)
        st->peer_cap = st->nchunks;
    KVW_INFO("staging: %u chunks of %zu KiB for prefill's GPU regions, at most %u per connection",
             st->nchunks, st->chunk_len >> 10, st->peer_cap);
    return KVW_OK;
}
