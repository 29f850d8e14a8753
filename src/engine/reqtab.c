/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's request table, all under engine->lock: rooms in a hash table
 * (lookups by room are O(1) however many requests are in flight), deadlines
 * in a binary min-heap (the control thread sleeps until the earliest one
 * instead of ticking), and a work list of requests that have something to
 * do now (the control thread serves only those, never the whole table);
 * and decode's token table (slot -> receiver, for the immediates). */
#include "engine/core.h"

#include "common/log.h"

#include <stdlib.h>

enum { MIN_BUCKETS = 64 };

static size_t bucket_of(const kvw_engine_t *e, uint64_t room)
{
    /* Fibonacci hashing: rooms are often sequential. */
    return (size_t)((room * 0x9e3779b97f4a7c15ull) >> 32) & e->tab.room_mask;
}

static kvw_status_t rehash(kvw_engine_t *e, size_t nbuckets)
{
    kvw_req_t **b = calloc(nbuckets, sizeof(*b));
    if (!b)
        return KVW_ERR_NO_MEMORY;
    kvw_req_t **old = e->tab.rooms;
    size_t old_n = old ? e->tab.room_mask + 1 : 0;
    e->tab.rooms = b;
    e->tab.room_mask = nbuckets - 1;
    for (size_t i = 0; i < old_n; i++) {
        kvw_req_t *r = old[i], *next;
        for (; r; r = next) {
            next = r->hnext;
            size_t h = bucket_of(e, r->room);
            r->hnext = b[h];
            b[h] = r;
        }
    }
    free(old);
    return KVW_OK;
}

/* Room for one more request: in the hash table and, so that setting a
 * deadline never allocates, in the heap. */
kvw_status_t kvw__reqtab_reserve_locked(kvw_engine_t *e)
{
    size_t need = e->tab.num_reqs + 1;
    if (!e->tab.rooms && rehash(e, MIN_BUCKETS))
        return KVW_ERR_NO_MEMORY;
    if (need > 2 * (e->tab.room_mask + 1))
        rehash(e, 2 * (e->tab.room_mask + 1)); /* a failed grow only makes chains longer */
    if (need > e->tab.heap_cap) {
        size_t cap = e->tab.heap_cap ? 2 * e->tab.heap_cap : MIN_BUCKETS;
        kvw_req_t **h = realloc(e->tab.heap, cap * sizeof(*h));
        if (!h)
            return KVW_ERR_NO_MEMORY;
        e->tab.heap = h;
        e->tab.heap_cap = cap;
    }
    return KVW_OK;
}

void kvw__room_insert_locked(kvw_engine_t *e, kvw_req_t *r)
{
    size_t h = bucket_of(e, r->room);
    r->hnext = e->tab.rooms[h];
    e->tab.rooms[h] = r;
    e->tab.num_reqs++;
}

void kvw__room_remove_locked(kvw_engine_t *e, kvw_req_t *r)
{
    for (kvw_req_t **pp = &e->tab.rooms[bucket_of(e, r->room)]; *pp; pp = &(*pp)->hnext)
        if (*pp == r) {
            *pp = r->hnext;
            r->hnext = NULL;
            e->tab.num_reqs--;
            return;
        }
}

kvw_req_t *kvw__req_find_locked(kvw_engine_t *e, kvw_role_t role, uint64_t room)
{
    if (!e->tab.rooms)
        return NULL;
    for (kvw_req_t *r = e->tab.rooms[bucket_of(e, room)]; r; r = r->hnext)
        if (r->room == room && r->role == role)
            return r;
    return NULL;
}

kvw_req_t *kvw__req_find_next_locked(kvw_req_t *r)
{
    for (kvw_req_t *n = r->hnext; n; n = n->hnext)
        if (n->room == r->room && n->role == r->role)
            return n;
    return NULL;
}

/* ------------------------------------------------------------ the heap */

static bool earlier(const kvw_req_t *a, const kvw_req_t *b)
{
    return a->deadline_ns < b->deadline_ns;
}

static void heap_place(kvw_engine_t *e, size_t i, kvw_req_t *r)
{
    e->tab.heap[i] = r;
    r->heap_pos = i + 1;
}

static void sift_up(kvw_engine_t *e, size_t i)
{
    kvw_req_t *r = e->tab.heap[i];
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!earlier(r, e->tab.heap[parent]))
            break;
        heap_place(e, i, e->tab.heap[parent]);
        i = parent;
    }
    heap_place(e, i, r);
}

static void sift_down(kvw_engine_t *e, size_t i)
{
    kvw_req_t *r = e->tab.heap[i];
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= e->tab.heap_len)
            break;
        if (c + 1 < e->tab.heap_len && earlier(e->tab.heap[c + 1], e->tab.heap[c]))
            c++;
        if (!earlier(e->tab.heap[c], r))
            break;
        heap_place(e, i, e->tab.heap[c]);
        i = c;
    }
    heap_place(e, i, r);
}

static void heap_remove(kvw_engine_t *e, kvw_req_t *r)
{
    size_t i = r->heap_pos - 1;
    r->heap_pos = 0;
    kvw_req_t *last = e->tab.heap[--e->tab.heap_len];
    if (last == r)
        return;
    heap_place(e, i, last);
    sift_up(e, i);
    sift_down(e, last->heap_pos - 1);
}

void kvw__req_set_deadline_locked(kvw_req_t *r, uint64_t ns)
{
    kvw_engine_t *e = r->engine;
    if (r->heap_pos)
        heap_remove(e, r);
    r->deadline_ns = ns;
    if (!ns || !r->listed)
        return;
    /* kvw__reqtab_reserve_locked made room when r was listed. */
    e->tab.heap[e->tab.heap_len] = r;
    r->heap_pos = ++e->tab.heap_len;
    sift_up(e, e->tab.heap_len - 1);
    /* Wake the control thread only if it would sleep past it: a request's
     * watchdog (seconds away) must not cost a system call and a thread
     * wake-up on the request's own path. */
    if (r->heap_pos == 1 && ns < e->control_due_ns)
        kvw__wake(e->control_wake_fd);
}

uint64_t kvw__next_deadline_locked(const kvw_engine_t *e)
{
    return e->tab.heap_len ? e->tab.heap[0]->deadline_ns : 0;
}

kvw_req_t *kvw__pop_expired_locked(kvw_engine_t *e, uint64_t now)
{
    if (!e->tab.heap_len || e->tab.heap[0]->deadline_ns > now)
        return NULL;
    kvw_req_t *r = e->tab.heap[0];
    heap_remove(e, r);
    return r; /* deadline_ns is kept: the handler compares it with now */
}

/* -------------------------------------------------------- the work list */

void kvw__req_touch_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    if (r->in_work || !r->listed)
        return;
    r->in_work = true;
    atomic_fetch_add(&r->refs, 1); /* the list's own: r may leave the table meanwhile */
    r->wnext = NULL;
    if (e->tab.work_tail)
        e->tab.work_tail->wnext = r;
    else
        e->tab.work_head = r;
    e->tab.work_tail = r;
    kvw__wake(e->control_wake_fd);
}

kvw_req_t *kvw__pop_work_locked(kvw_engine_t *e)
{
    kvw_req_t *r = e->tab.work_head;
    if (!r)
        return NULL;
    e->tab.work_head = r->wnext;
    if (!e->tab.work_head)
        e->tab.work_tail = NULL;
    r->wnext = NULL;
    r->in_work = false;
    return r; /* the caller drops the list's reference */
}

void kvw__reqtab_fini(kvw_engine_t *e)
{
    free(e->tab.heap);
    free(e->tab.rooms);
    e->tab.heap = NULL;
    e->tab.rooms = NULL;
    e->tab.heap_len = e->tab.heap_cap = 0;
}

/* ------------------------------------------------------------- tokens */

kvw_req_t *kvw__token_lookup_locked(kvw_engine_t *e, uint32_t token)
{
    kvw_req_t *r = e->tab.tokens[token & 0xffff];
    return r && r->token == token ? r : NULL;
}

kvw_status_t kvw__token_alloc_locked(kvw_engine_t *e, kvw_req_t *r)
{
    uint32_t slots = 1u << KVW_TOKEN_BITS;
    for (uint32_t i = 0; i < slots; i++) {
        uint32_t slot = (e->tab.token_hint + i) & (slots - 1);
        if (!e->tab.tokens[slot]) {
            /* The generation makes a late immediate for a reused slot miss. */
            uint32_t gen = ++e->tab.token_gen[slot] & KVW_TOKEN_GEN_MASK;
            r->token = (gen << 16) | slot; /* within KVW_WIRE_TOKEN_MASK */
            e->tab.tokens[slot] = r;
            e->tab.token_hint = slot + 1;
            return KVW_OK;
        }
    }
    KVW_ERROR("more than %u receivers in flight on one engine", slots);
    return KVW_ERR_NO_MEMORY;
}

void kvw__token_release_locked(kvw_engine_t *e, const kvw_req_t *r)
{
    if (e->tab.tokens[r->token & 0xffff] == r)
        e->tab.tokens[r->token & 0xffff] = NULL;
}
