#include "engine/stager.h"

#include "common/log.h"
#include "mem/staging.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Which connection a chunk was taken for: its peer slot and the peer's
 * serial (a slot is reused once its peer is reclaimed; serials never are). */
typedef struct chunk_owner {
    uint32_t slot, serial;
} chunk_owner_t;

/* The chunks the connection with this serial holds. */
typedef struct peer_share {
    uint32_t serial, held;
} peer_share_t;

/* A prefill slice being copied into its chunk; appended to its request
 * once its lane finished. */
typedef struct pending_slice {
    kvw_req_t *r; /* a reference */
    kvw_seg_t *s;
    int lane;
} pending_slice_t;

struct kvw_stager {
    kvw_engine_t *e;
    kvw_staging_t *pool;
    bool kind[3]; /* staged kinds (KVW_LAYOUT_*) */
    pthread_t thread;
    bool started;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;                      /* (lock) */
    kvw_req_t *job_head, *job_tail; /* (lock) requests with work, each with a reference */

    /* prefill */
    size_t chunk_len;
    uint32_t nchunks, nfree; /* (lock) */
    uint32_t *free_chunks;   /* (lock) a stack of chunk ids (index + 1) */
    /* A connection holds at most peer_cap chunks (taken and not back: being
     * copied, waiting to be posted, or posted and not complete), so that
     * one whose writes stall cannot take the pool from the others. */
    uint32_t peer_cap;
    chunk_owner_t *owner;             /* (lock) per chunk: whose share it counts in */
    peer_share_t *share;              /* (lock) per peer slot */
    kvw_req_t *park_head, *park_tail; /* (lock) requests waiting for a chunk, with a ref */
    /* (lock) Requests whose part waits on its producer's CUDA event, with
     * a ref: queued again at ev_due_ns to look at it once more. */
    kvw_req_t *ev_head, *ev_tail;
    uint64_t ev_due_ns;
    /* (lock) Chunks given back so far, and their count when the first of
     * the parked requests found none: any given back since, and they all
     * try again (one only a later failure saw would be a lost wake-up). */
    uint64_t chunks_back, park_gen;
    bool park_gen_set;
    uint64_t *chunk_seq;  /* poller: per chunk, per lane: the writes to complete first */
    uint32_t *chunk_next; /* poller: the next id in its peer's list, 0 = end */
    pending_slice_t pend[KVW_STAGING_MAX_LANES]; /* thread: oldest first */
    int npend, next_lane;

    /* decode */
    uint64_t slots;                   /* slots of each staged kind */
    uint64_t *region_off;             /* per region: where its slots start in the pool */
    uint32_t *free_slots[3];          /* (lock) stacks */
    uint64_t nfree_slots[3];          /* (lock) */
    bool slots_freed;                 /* (lock) waiting receivers may fit now */
    kvw_req_t *wait_head, *wait_tail; /* (engine lock) receivers waiting for slots, with a ref */
};

typedef struct kvw_stager kvw_stager_t;

static uint32_t region_kind(const kvw_layout_t *l, uint32_t region)
{
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        if (region >= g->first && region < g->first + g->num_layers * g->per_layer)
            return g->kind;
    }
    return KVW_LAYOUT_KV;
}

/* Append r to a queue linked through snext; the caller hands over the
 * reference the queue holds. */
static void append_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    r->stage.snext = NULL;
    if (*tail)
        (*tail)->stage.snext = r;
    else
        *head = r;
    *tail = r;
}

/* Append r, with a reference of the queue's own. */
static void queue_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    atomic_fetch_add(&r->refs, 1);
    append_req(head, tail, r);
}

static void push_job_locked(kvw_stager_t *st, kvw_req_t *r)
{
    /* A parked one resumes when a chunk is back, one waiting on an event
     * at its next look. */
    if (r->stage.queued || r->stage.parked || r->stage.evwait)
        return;
    r->stage.queued = true;
    queue_req(&st->job_head, &st->job_tail, r);
    pthread_cond_broadcast(&st->cond);
}

static void push_job(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    push_job_locked(st, r);
    pthread_mutex_unlock(&st->lock);
}

static kvw_req_t *pop_job_locked(kvw_stager_t *st)
{
    kvw_req_t *r = st->job_head;
    if (r) {
        st->job_head = r->stage.snext;
        if (!st->job_head)
            st->job_tail = NULL;
        r->stage.queued = false;
    }
    return r;
}

/* ---- slices: where each staged region's items sit in a chunk ------------------ */

typedef void (*visit_fn)(void *arg, uint32_t region, uint32_t kind, uint64_t off, size_t count);

/* Walk a slice's staged regions in chunk order (KV layer by layer, then
 * state, then aux, as the planner posts them); returns the bytes used. */
static uint64_t visit_slice(const kvw_stager_t *st, const kvw_seg_t *s, size_t ns, bool aux,
                            visit_fn fn, void *arg)
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
    for (uint32_t i = 0; s->final && st->kind[KVW_LAYOUT_STATE] && ns && i < l->num_state; i++) {
        uint32_t k = l->state_slots[i];
        if (fn)
            fn(arg, k, KVW_LAYOUT_STATE, off, ns);
        off += ns * e->regions[k].item_len;
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
    visit_slice(st, s, r->tx.num_src_state, final_has_aux(r), point_at_chunk, &a);
}

/* ---- prefill: chunks -------------------------------------------------------- */

void kvw__stager_put_chunk(kvw_engine_t *e, uint32_t id)
{
    kvw_stager_t *st = e->stager;
    if (!st || !id)
        return; /* the engine is being torn down */
    pthread_mutex_lock(&st->lock);
    st->free_chunks[st->nfree++] = id;
    chunk_owner_t o = st->owner[id - 1];
    peer_share_t *sh = &st->share[o.slot];
    if (sh->serial == o.serial && sh->held) /* else its connection is gone */
        sh->held--;
    st->chunks_back++;
    if (st->park_head)
        pthread_cond_broadcast(&st->cond);
    pthread_mutex_unlock(&st->lock);
}

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
        push_job(r->engine->stager, r);
}

void kvw__stager_kick_locked(kvw_req_t *r)
{
    if (r->stage.unstaged_head)
        push_job(r->engine->stager, r);
}

/* Append a finished slice to its request, or drop it if the request ended
 * (or failed: st). */
static void deliver(kvw_stager_t *st, kvw_req_t *r, kvw_seg_t *s, kvw_status_t err, const char *why)
{
    kvw_engine_t *e = st->e;
    pthread_mutex_lock(&e->lock);
    if (err && !kvw__req_ended(r))
        kvw__sender_fail_locked(r, err, why);
    if (kvw__req_ended(r))
        kvw__seg_free(e, s);
    else
        kvw__sender_append_locked(r, s); /* frees s if it cannot plan it */
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

static void finish_all(kvw_stager_t *st)
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

typedef struct {
    kvw_stager_t *st;
    const kvw_req_t *r;
    const uint64_t *pages; /* the slice's source pages */
    uint8_t *chunk;
    int lane;
    kvw_status_t err;
    char why[200];
} copy_arg_t;

/* Queue copies of count items at idx[] of region k into dst, one per run
 * of consecutive indices. */
static void copy_runs(copy_arg_t *a, uint32_t k, const uint64_t *idx, size_t count, uint8_t *dst,
                      bool to_gpu)
{
    const kvw_engine_t *e = a->st->e;
    uint64_t item = e->regions[k].item_len;
    uint8_t *gpu = e->regions[k].addr;
    for (size_t i = 0; i < count && !a->err;) {
        size_t run = 1;
        while (i + run < count && idx[i + run] == idx[i] + run)
            run++;
        uint8_t *g = gpu + idx[i] * item, *h = dst + i * item;
        a->err = kvw__staging_copy(a->st->pool, a->lane, e->mrs[k].cuda_ctx, to_gpu ? g : h,
                                   to_gpu ? h : g, run * item, a->why, sizeof(a->why));
        i += run;
    }
}

static void copy_out(void *arg, uint32_t k, uint32_t kind, uint64_t off, size_t count)
{
    copy_arg_t *a = arg;
    uint64_t aux = a->r->tx.aux_index;
    const uint64_t *idx = kind == KVW_LAYOUT_KV      ? a->pages
                          : kind == KVW_LAYOUT_STATE ? a->r->tx.src_state
                                                     : &aux;
    copy_runs(a, k, idx, count, a->chunk + off, false);
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
        kvw__sender_fail_locked(r, err, why);
    pthread_mutex_unlock(&st->e->lock);
}

/* How staging a slice, a part or a request went: SLICE_WAIT when a slice
 * needs a chunk r's connection may not take now (take_chunk): r parks and
 * resumes where it stopped (r->stage_*) once a chunk comes back.
 * SLICE_EVENT when r's part waits on its producer's CUDA event: r is set
 * aside and looked at again KVW_EVENT_RECHECK_US later. */
typedef enum { SLICE_OK, SLICE_FAILED, SLICE_WAIT, SLICE_EVENT } slice_rc_t;

/* Stage pages [p0, p0 + n) of layers [lb, le) of part (or, final, its
 * state and aux) as one slice. */
static slice_rc_t stage_slice(kvw_stager_t *st, kvw_req_t *r, const kvw_seg_t *part, size_t p0,
                              size_t n, uint32_t lb, uint32_t le, bool final)
{
    size_t ns = final ? r->tx.num_src_state : 0;
    bool aux = final && final_has_aux(r);
    kvw_seg_t *x = new_slice(part, p0, n, lb, le, final, ns, st->kind[KVW_LAYOUT_STATE]);
    if (!x) {
        fail_part(st, r, KVW_ERR_NO_MEMORY, "no memory to stage a part");
        return SLICE_FAILED;
    }
    uint64_t bytes = visit_slice(st, x, ns, aux, NULL, NULL);
    if (!bytes) { /* nothing of it is staged: in order, after what is */
        finish_all(st);
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
    visit_slice(st, x, ns, aux, copy_out, &a);
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
    finish_all(st);
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
static slice_rc_t stage_parts(kvw_stager_t *st, kvw_req_t *r)
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

/* ---- decode: slots -------------------------------------------------------------- */

/* Slots of each kind a receiver needs. */
static void slots_needed(const kvw_stager_t *st, const kvw_req_t *r, uint64_t need[3])
{
    need[KVW_LAYOUT_KV] = st->kind[KVW_LAYOUT_KV] ? r->rx.npages : 0;
    need[KVW_LAYOUT_STATE] = st->kind[KVW_LAYOUT_STATE] ? r->rx.nstate : 0;
    need[KVW_LAYOUT_AUX] = st->kind[KVW_LAYOUT_AUX] && r->rx.aux != KVW_NO_AUX ? 1 : 0;
}

/* Where a kind's indices sit in r->stage.slots. */
static uint64_t *slots_of(kvw_req_t *r, int kind)
{
    return kind == KVW_LAYOUT_KV      ? r->stage.slots
           : kind == KVW_LAYOUT_STATE ? r->stage.slots + r->rx.npages
                                      : r->stage.slots + r->rx.npages + r->rx.nstate;
}

/* Take every slot r needs, or none. */
static bool take_slots(kvw_stager_t *st, kvw_req_t *r)
{
    uint64_t need[3];
    slots_needed(st, r, need);
    pthread_mutex_lock(&st->lock);
    bool fits = true;
    for (int k = 0; k < 3; k++)
        fits &= need[k] <= st->nfree_slots[k];
    for (int k = 0; fits && k < 3; k++) {
        uint64_t *out = slots_of(r, k);
        for (uint64_t i = 0; i < need[k]; i++)
            out[i] = st->free_slots[k][--st->nfree_slots[k]];
    }
    r->stage.slots_held = fits;
    pthread_mutex_unlock(&st->lock);
    return fits;
}

void kvw__stager_unreserve(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    if (!st)
        return;
    uint64_t need[3];
    /* Only once nothing can write them: no copy-in reads them, and prefill
     * never had the request or it ended (Failed means that none of its
     * writes can land any more; Success, that all did). A receiver still
     * Transferring keeps them, even destroyed (receiver_end gave up). */
    bool writable = atomic_load(&r->state) == KVW_POLL_TRANSFERRING;
    pthread_mutex_lock(&st->lock);
    if (r->stage.slots_held && !r->stage.staging_in && !writable) {
        slots_needed(st, r, need);
        /* Pushed back in reverse, so the next taker gets them in order. */
        for (int k = 0; k < 3; k++) {
            const uint64_t *in = slots_of(r, k);
            for (uint64_t i = need[k]; i-- > 0;)
                st->free_slots[k][st->nfree_slots[k]++] = (uint32_t)in[i];
        }
        r->stage.slots_held = false;
        st->slots_freed = true;
        pthread_cond_broadcast(&st->cond);
    }
    pthread_mutex_unlock(&st->lock);
}

kvw_status_t kvw__stager_reserve_locked(kvw_req_t *r, bool *ready, char *why, size_t size)
{
    kvw_stager_t *st = r->engine->stager;
    static const char *const kinds[3] = {"page", "aux", "state"};
    uint64_t need[3];
    slots_needed(st, r, need);
    for (int k = 0; k < 3; k++)
        if (need[k] > st->slots) {
            snprintf(why, size,
                     "the request needs %llu staging slots for %s indices; the pool "
                     "(KVW_STAGING_MIB=%u) holds %llu",
                     (unsigned long long)need[k], kinds[k], r->engine->cfg.staging_mib,
                     (unsigned long long)st->slots);
            return KVW_ERR_LIMIT;
        }
    /* Unstaged kinds keep their own indices; the aux slot follows the state. */
    size_t n = r->rx.npages + r->rx.nstate;
    r->stage.slots = malloc((n + 1) * sizeof(uint64_t));
    if (!r->stage.slots) {
        snprintf(why, size, "no memory for the staging slots");
        return KVW_ERR_NO_MEMORY;
    }
    if (n)
        memcpy(r->stage.slots, r->rx.pages, n * sizeof(uint64_t));
    r->stage.slots[n] = r->rx.aux;
    *ready = !st->wait_head && take_slots(st, r);
    if (!*ready) { /* in order: a large request is not overtaken forever */
        queue_req(&st->wait_head, &st->wait_tail, r);
        r->stage.waiting = true;
    }
    return KVW_OK;
}

void kvw__stager_waiter_left_locked(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    /* grant_waiters drops ended receivers from the head of the queue and
     * serves the ones behind them. */
    pthread_mutex_lock(&st->lock);
    st->slots_freed = true;
    pthread_cond_broadcast(&st->cond);
    pthread_mutex_unlock(&st->lock);
}

/* Stager thread: give freed slots to the receivers waiting, in order. */
static void grant_waiters(kvw_stager_t *st)
{
    kvw_engine_t *e = st->e;
    kvw_req_t *done = NULL, *r;
    pthread_mutex_lock(&e->lock);
    while ((r = st->wait_head) && (kvw__req_ended(r) || take_slots(st, r))) {
        st->wait_head = r->stage.snext;
        if (!st->wait_head)
            st->wait_tail = NULL;
        r->stage.waiting = false;
        if (!kvw__req_ended(r)) {
            r->rx.request_due = true;
            kvw__req_touch_locked(r);
        }
        r->stage.snext = done;
        done = r;
    }
    pthread_mutex_unlock(&e->lock);
    while ((r = done)) {
        done = r->stage.snext;
        kvw__req_unref(r);
    }
}

void kvw__stager_landed_locked(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    pthread_mutex_lock(&st->lock);
    r->stage.staging_in = true; /* under both locks (engine.h) */
    push_job_locked(st, r);
    pthread_mutex_unlock(&st->lock);
}

bool kvw__stager_copying(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    if (!st)
        return false;
    pthread_mutex_lock(&st->lock);
    bool copying = r->stage.staging_in;
    pthread_mutex_unlock(&st->lock);
    return copying;
}

/* (lock) r's copy to the GPU is over (or will never start): from here on
 * r may end, and failures count again. */
static void copy_in_over_locked(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    r->stage.staging_in = false;
    pthread_mutex_unlock(&st->lock);
}

static void copy_in_runs(copy_arg_t *a, kvw_req_t *r, uint32_t k, int kind)
{
    const kvw_stager_t *st = a->st;
    uint64_t item = st->e->regions[k].item_len;
    uint64_t aux = r->rx.aux;
    const uint64_t *dst = kind == KVW_LAYOUT_KV      ? r->rx.pages
                          : kind == KVW_LAYOUT_STATE ? r->rx.pages + r->rx.npages
                                                     : &aux;
    const uint64_t *slot = slots_of(r, kind);
    size_t count = kind == KVW_LAYOUT_KV      ? r->rx.npages
                   : kind == KVW_LAYOUT_STATE ? r->rx.nstate
                                              : 1;
    uint8_t *shadow = st->pool->base + st->region_off[k];
    /* Runs consecutive on both sides: one copy each. */
    for (size_t i = 0; i < count && !a->err;) {
        size_t run = 1;
        while (i + run < count && dst[i + run] == dst[i] + run && slot[i + run] == slot[i] + run)
            run++;
        copy_runs(a, k, &dst[i], run, shadow + slot[i] * item, true);
        i += run;
    }
}

/* The request landed in its slots: copy them to the GPU pages, then end it. */
static void copy_in(kvw_stager_t *st, kvw_req_t *r)
{
    kvw_engine_t *e = st->e;
    const kvw_layout_t *l = &e->layout;
    copy_arg_t a = {.st = st, .r = r, .lane = 0};
    if (st->kind[KVW_LAYOUT_KV])
        for (uint32_t i = 0; i < l->kv_layers * l->kv_per_layer; i++)
            copy_in_runs(&a, r, l->kv_slots[i], KVW_LAYOUT_KV);
    if (st->kind[KVW_LAYOUT_STATE])
        for (uint32_t i = 0; i < l->num_state; i++)
            copy_in_runs(&a, r, l->state_slots[i], KVW_LAYOUT_STATE);
    if (st->kind[KVW_LAYOUT_AUX] && r->rx.aux != KVW_NO_AUX)
        for (uint32_t i = 0; i < l->num_aux; i++)
            copy_in_runs(&a, r, l->aux_slots[i], KVW_LAYOUT_AUX);
    char why[200] = "";
    kvw_status_t err = kvw__staging_wait(st->pool, 0, why, sizeof(why));
    if (a.err)
        err = a.err;
    /* Every copy is done: r ends now, and only now. Failures that came
     * meanwhile were ignored (kvw__req_fail): all of r had landed. Only
     * decode's own abort (or destroy) stands, as promised to its caller. */
    pthread_mutex_lock(&e->lock);
    copy_in_over_locked(st, r);
    if (err)
        kvw__req_fail(r, KVW_ERR_TRANSFER,
                      "the data landed but copying it from the staging pool to the GPU failed: %s",
                      a.err ? a.why : why);
    else if (r->rx.aborting)
        kvw__req_fail(r, r->rx.abort_status, "%s", r->rx.abort_reason);
    else if (kvw__req_succeed(r))
        kvw__req_set_deadline_locked(r, 0);
    pthread_mutex_unlock(&e->lock);
    kvw__stager_unreserve(r); /* nothing lands after the immediate */
}

/* ---- the thread ------------------------------------------------------------------ */

/* r waits for a chunk: the slices copied so far go to the NIC first (their
 * chunks come back once it read them), then r parks, keeping the job's
 * reference, unless a new part queued it again meanwhile. */
static void park(kvw_stager_t *st, kvw_req_t *r)
{
    finish_all(st);
    pthread_mutex_lock(&st->lock);
    bool queued = r->stage.queued;
    if (!queued) {
        r->stage.parked = true;
        append_req(&st->park_head, &st->park_tail, r);
    }
    pthread_mutex_unlock(&st->lock);
    if (queued)
        kvw__req_unref(r);
}

/* r's part waits on its producer's event: aside, keeping the job's
 * reference, until the next look (unless a new part queued it again). */
static void wait_event(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    bool queued = r->stage.queued;
    if (!queued) {
        r->stage.evwait = true;
        if (!st->ev_head)
            st->ev_due_ns = kvw__now_ns() + KVW_EVENT_RECHECK_US * 1000ull;
        append_req(&st->ev_head, &st->ev_tail, r);
    }
    pthread_mutex_unlock(&st->lock);
    atomic_fetch_add_explicit(&st->e->counters.event_waits, 1, memory_order_relaxed);
    if (queued)
        kvw__req_unref(r);
}

/* (lock) Time to look at the waiting events again: those requests go to
 * the job queue, in order, with their reference. */
static void requeue_events_locked(kvw_stager_t *st)
{
    kvw_req_t *r;
    while ((r = st->ev_head)) {
        st->ev_head = r->stage.snext;
        r->stage.evwait = false;
        r->stage.queued = true;
        append_req(&st->job_head, &st->job_tail, r);
    }
    st->ev_tail = NULL;
}

/* (lock) A chunk came back: every parked request tries again, in order,
 * on the job queue (with the park's reference; one queued meanwhile
 * already has one: *drop). */
static kvw_req_t *unpark_all_locked(kvw_stager_t *st)
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
        append_req(&st->job_head, &st->job_tail, r);
    }
    st->park_tail = NULL;
    return drop;
}

static void unref_list(kvw_req_t *r)
{
    while (r) {
        kvw_req_t *next = r->stage.snext;
        kvw__req_unref(r);
        r = next;
    }
}

static void *stager_main(void *arg)
{
    kvw_stager_t *st = arg;
    pthread_mutex_lock(&st->lock);
    while (!st->stop) {
        if (st->slots_freed) {
            st->slots_freed = false;
            pthread_mutex_unlock(&st->lock);
            grant_waiters(st);
            pthread_mutex_lock(&st->lock);
            continue;
        }
        if (st->park_head && st->chunks_back != st->park_gen) {
            kvw_req_t *drop = unpark_all_locked(st);
            pthread_mutex_unlock(&st->lock);
            unref_list(drop);
            pthread_mutex_lock(&st->lock);
            continue;
        }
        if (st->ev_head && kvw__now_ns() >= st->ev_due_ns) {
            requeue_events_locked(st);
            continue;
        }
        kvw_req_t *r = pop_job_locked(st);
        if (!r && st->npend) { /* nothing more to overlap with: finish them */
            pthread_mutex_unlock(&st->lock);
            finish_all(st);
            pthread_mutex_lock(&st->lock);
            continue;
        }
        if (!r && st->ev_head) { /* until the next look at the events */
            struct timespec due = {(time_t)(st->ev_due_ns / 1000000000ull),
                                   (long)(st->ev_due_ns % 1000000000ull)};
            pthread_cond_timedwait(&st->cond, &st->lock, &due);
            continue;
        }
        if (!r) {
            pthread_cond_wait(&st->cond, &st->lock);
            continue;
        }
        pthread_mutex_unlock(&st->lock);
        slice_rc_t rc = SLICE_OK;
        if (st->e->role == KVW_ROLE_DECODE)
            copy_in(st, r);
        else
            rc = stage_parts(st, r);
        if (rc == SLICE_WAIT) {
            park(st, r); /* the thread goes on with the other requests */
            r = NULL;
        } else if (rc == SLICE_EVENT) {
            wait_event(st, r);
            r = NULL;
        }
        if (r)
            kvw__req_unref(r);
        pthread_mutex_lock(&st->lock);
    }
    pthread_mutex_unlock(&st->lock);
    finish_all(st); /* their requests fail with the engine */
    return NULL;
}

/* ---- creation ------------------------------------------------------------------ */

/* Which kinds have a staged region, and the CUDA contexts of those. */
static bool find_staged(kvw_stager_t *st, void **ctxs, int *nctx)
{
    const kvw_engine_t *e = st->e;
    bool any = false;
    *nctx = 0;
    for (uint32_t i = 0; i < e->layout.num_regions; i++)
        if (e->mrs[i].path == KVW_MEM_PATH_STAGING) {
            any = st->kind[region_kind(&e->layout, i)] = true;
            if (*nctx < KVW_MEM_MAX_FLUSH)
                ctxs[(*nctx)++] = e->mrs[i].cuda_ctx;
        }
    return any;
}

static kvw_status_t setup_chunks(kvw_stager_t *st)
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

/* Decode: the pool as slots; every region of a staged kind advertises its
 * slots in place of its memory. */
static kvw_status_t setup_slots(kvw_stager_t *st)
{
    kvw_engine_t *e = st->e;
    uint32_t n = e->layout.num_regions;
    uint64_t per_slot = 0;
    for (uint32_t i = 0; i < n; i++)
        if (st->kind[region_kind(&e->layout, i)])
            per_slot += e->regions[i].item_len;
    st->slots = per_slot ? st->pool->len / per_slot : 0;
    if (!st->slots || st->slots > UINT32_MAX) {
        KVW_ERROR("staging: the pool (KVW_STAGING_MIB=%u) %s", e->cfg.staging_mib,
                  st->slots ? "holds more slots than kvwire counts" : "cannot hold one page");
        return KVW_ERR_INVALID;
    }
    st->region_off = calloc(n, sizeof(uint64_t));
    for (int k = 0; k < 3; k++)
        if (!(st->free_slots[k] = calloc(st->kind[k] ? st->slots : 1, sizeof(uint32_t))))
            return KVW_ERR_NO_MEMORY;
    if (!st->region_off)
        return KVW_ERR_NO_MEMORY;
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!st->kind[region_kind(&e->layout, i)])
            continue;
        st->region_off[i] = off;
        kvw_mr_t *m = &e->mrs[i];
        m->addr = (uint64_t)(uintptr_t)(st->pool->base + off);
        m->len = st->slots * e->regions[i].item_len;
        m->lkey = st->pool->lkey;
        m->rkey = st->pool->rkey;
        off += m->len;
    }
    for (int k = 0; k < 3; k++)
        for (uint64_t i = 0; st->kind[k] && i < st->slots; i++) /* slot 0 on top */
            st->free_slots[k][st->nfree_slots[k]++] = (uint32_t)(st->slots - 1 - i);
    KVW_INFO("staging: %llu page slots for decode's GPU regions", (unsigned long long)st->slots);
    return KVW_OK;
}

static void stager_free(kvw_stager_t *st)
{
    kvw__staging_destroy(st->pool);
    free(st->free_chunks);
    free(st->chunk_next);
    free(st->chunk_seq);
    free(st->owner);
    free(st->share);
    free(st->region_off);
    for (int k = 0; k < 3; k++)
        free(st->free_slots[k]);
    pthread_mutex_destroy(&st->lock);
    pthread_cond_destroy(&st->cond);
    free(st);
}

kvw_status_t kvw__stager_create(kvw_engine_t *e)
{
    kvw_stager_t *st = calloc(1, sizeof(*st));
    if (!st)
        return KVW_ERR_NO_MEMORY;
    st->e = e;
    pthread_mutex_init(&st->lock, NULL);
    /* Monotonic: the timed wait for the next look at producer events. */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&st->cond, &ca);
    pthread_condattr_destroy(&ca);
    void *ctxs[KVW_MEM_MAX_FLUSH];
    int nctx;
    if (!find_staged(st, ctxs, &nctx)) {
        stager_free(st);
        return KVW_OK; /* nothing to stage */
    }
    bool decode = e->role == KVW_ROLE_DECODE;
    size_t len = (size_t)e->cfg.staging_mib << 20;
    kvw_status_t rc =
        kvw__staging_create(e->dev, len, decode, ctxs, nctx, (int)e->cfg.staging_lanes, &st->pool);
    if (!rc)
        rc = decode ? setup_slots(st) : setup_chunks(st);
    if (!rc && pthread_create(&st->thread, NULL, stager_main, st))
        rc = KVW_ERR_NO_MEMORY;
    if (rc) {
        stager_free(st);
        return rc;
    }
    st->started = true;
    pthread_setname_np(st->thread, "kvw-stager");
    e->stager = st;
    return KVW_OK;
}

void kvw__stager_stop(kvw_engine_t *e)
{
    kvw_stager_t *st = e->stager;
    if (!st || !st->started)
        return;
    pthread_mutex_lock(&st->lock);
    st->stop = true;
    pthread_cond_broadcast(&st->cond);
    pthread_mutex_unlock(&st->lock);
    pthread_join(st->thread, NULL);
    st->started = false;
    kvw_req_t *r;
    while ((r = pop_job_locked(st))) { /* the thread is gone: no lock needed */
        /* A copy-in that never started: nothing was written. */
        if (r->stage.staging_in) {
            pthread_mutex_lock(&e->lock);
            copy_in_over_locked(st, r);
            kvw__req_fail(r, KVW_ERR_STATE, "engine destroyed");
            pthread_mutex_unlock(&e->lock);
        }
        kvw__req_unref(r);
    }
    while ((r = st->wait_head)) {
        st->wait_head = r->stage.snext;
        kvw__req_unref(r);
    }
    st->wait_tail = NULL;
    while ((r = st->park_head)) { /* their parts go with them */
        st->park_head = r->stage.snext;
        r->stage.parked = false;
        kvw__req_unref(r);
    }
    st->park_tail = NULL;
    while ((r = st->ev_head)) {
        st->ev_head = r->stage.snext;
        r->stage.evwait = false;
        kvw__req_unref(r);
    }
    st->ev_tail = NULL;
}

void kvw__stager_destroy(kvw_engine_t *e)
{
    if (!e->stager)
        return;
    kvw__stager_stop(e);
    stager_free(e->stager);
    e->stager = NULL;
}

void kvw__stager_stats(const kvw_engine_t *e, kvw_stager_stats_t *out)
{
    kvw_stager_t *st = e->stager;
    *out = (kvw_stager_stats_t){0};
    if (!st)
        return;
    pthread_mutex_lock(&st->lock);
    int k = st->kind[KVW_LAYOUT_KV]      ? KVW_LAYOUT_KV
            : st->kind[KVW_LAYOUT_STATE] ? KVW_LAYOUT_STATE
                                         : KVW_LAYOUT_AUX;
    *out = (kvw_stager_stats_t){st->nchunks, st->nfree, e->role == KVW_ROLE_DECODE ? st->slots : 0,
                                st->nfree_slots[k]};
    memcpy(out->kind, st->kind, sizeof(out->kind));
    pthread_mutex_unlock(&st->lock);
}
