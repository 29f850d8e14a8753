/* SPDX-License-Identifier: Apache-2.0 */
/* The stager (engine/stager.h): creation and teardown. Its jobs run on
 * the engine's copy executor (copier.c, the loop above the two halves,
 * stage_send.c for prefill and stage_recv.c for decode); the job queue and
 * the copies both halves use are stage_jobs.c's; stager_int.h holds what
 * they share. */
#include "engine/stager_int.h"

#include "common/log.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

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
    if (rc) {
        stager_free(st);
        return rc;
    }
    e->stager = st; /* the copy executor starts with the engine's threads */
    return KVW_OK;
}

void kvw__stager_stop(kvw_engine_t *e)
{
    kvw_stager_t *st = e->stager;
    if (!st)
        return;
    kvw__copier_stop(e); /* the executor's thread runs this stager's loop */
    kvw_req_t *r;
    while ((r = kvw__stage_pop_job_locked(st))) { /* the thread is gone: no lock needed */
        /* A copy-in that never started: nothing was written. */
        if (r->role == KVW_ROLE_DECODE && r->stage.staging_in) {
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
