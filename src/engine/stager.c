/* SPDX-License-Identifier: Apache-2.0 */
/* The stager (engine/stager.h): the pool, the job queue and the thread's
 * loop, creation and teardown. Each role's half: stage_send.c (prefill)
 * and stage_recv.c (decode); stager_int.h holds what they share. */
#include "engine/stager_int.h"

#include "common/log.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

uint32_t kvw__stage_region_kind(const kvw_layout_t *l, uint32_t region)
{
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        if (region >= g->first && region < g->first + g->num_layers * g->per_layer)
            return g->kind;
    }
    return KVW_LAYOUT_KV;
}

void kvw__stage_append_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    r->stage.snext = NULL;
    if (*tail)
        (*tail)->stage.snext = r;
    else
        *head = r;
    *tail = r;
}

void kvw__stage_queue_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    atomic_fetch_add(&r->refs, 1);
    kvw__stage_append_req(head, tail, r);
}

void kvw__stage_push_job_locked(kvw_stager_t *st, kvw_req_t *r)
{
    /* A parked one resumes when a chunk is back, one waiting on an event
     * at its next look. */
    if (r->stage.queued || r->stage.parked || r->stage.evwait)
        return;
    r->stage.queued = true;
    kvw__stage_queue_req(&st->job_head, &st->job_tail, r);
    pthread_cond_broadcast(&st->cond);
}

void kvw__stage_push_job(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    kvw__stage_push_job_locked(st, r);
    pthread_mutex_unlock(&st->lock);
}

kvw_req_t *kvw__stage_pop_job_locked(kvw_stager_t *st)
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

void kvw__stage_copy_runs(copy_arg_t *a, uint32_t k, const uint64_t *idx, size_t count,
                          uint8_t *dst, bool to_gpu)
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

/* ---- the thread ------------------------------------------------------------------ */

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
    kvw__log_set_engine(st->e->log_tag);
    pthread_mutex_lock(&st->lock);
    while (!st->stop) {
        if (st->slots_freed) {
            st->slots_freed = false;
            pthread_mutex_unlock(&st->lock);
            kvw__stage_grant_waiters(st);
            pthread_mutex_lock(&st->lock);
            continue;
        }
        if (st->park_head && st->chunks_back != st->park_gen) {
            kvw_req_t *drop = kvw__stage_unpark_all_locked(st);
            pthread_mutex_unlock(&st->lock);
            unref_list(drop);
            pthread_mutex_lock(&st->lock);
            continue;
        }
        if (st->ev_head && kvw__now_ns() >= st->ev_due_ns) {
            kvw__stage_requeue_events_locked(st);
            continue;
        }
        kvw_req_t *r = kvw__stage_pop_job_locked(st);
        if (!r && st->npend) { /* nothing more to overlap with: finish them */
            pthread_mutex_unlock(&st->lock);
            kvw__stage_finish_all(st);
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
            kvw__stage_copy_in(st, r);
        else
            rc = kvw__stage_parts(st, r);
        if (rc == SLICE_WAIT) {
            kvw__stage_park(st, r); /* the thread goes on with the other requests */
            r = NULL;
        } else if (rc == SLICE_EVENT) {
            kvw__stage_wait_event(st, r);
            r = NULL;
        }
        if (r)
            kvw__req_unref(r);
        pthread_mutex_lock(&st->lock);
    }
    pthread_mutex_unlock(&st->lock);
    kvw__stage_finish_all(st); /* their requests fail with the engine */
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
            any = st->kind[kvw__stage_region_kind(&e->layout, i)] = true;
            if (*nctx < KVW_MEM_MAX_FLUSH)
                ctxs[(*nctx)++] = e->mrs[i].cuda_ctx;
        }
    return any;
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
        rc = decode ? kvw__stage_setup_slots(st) : kvw__stage_setup_chunks(st);
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
    while ((r = kvw__stage_pop_job_locked(st))) { /* the thread is gone: no lock needed */
        /* A copy-in that never started: nothing was written. */
        if (r->stage.staging_in) {
            pthread_mutex_lock(&e->lock);
            kvw__stage_copy_in_over_locked(st, r);
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
