/* SPDX-License-Identifier: Apache-2.0 */
/* The copy executor: one thread per engine (kvw-copier), off the poller,
 * for every copy between the memory the NIC reaches and the caller's:
 * staging (its loop here, above the stager's two halves, stage_send.c and
 * stage_recv.c; its job queue and copies in stage_jobs.c) and the landing
 * buffer's scatter into the rows (landing.c). An engine has at most one of
 * the two (a landing engine is never staged), so the thread serves the
 * one its engine has, each with its own queue and lock. */
#include "engine/stager_int.h"

#include "common/log.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

struct kvw_copier {
    kvw_engine_t *e;
    pthread_t thread;
    /* The landing buffer's queue (staging's is the stager's, under its
     * own lock). */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool stop;              /* (lock) */
    _Atomic uint64_t jobs;  /* landing copies taken on (tests) */
    kvw_req_t *head, *tail; /* (lock) */
};

/* ---- staging ---------------------------------------------------------------------- */

static void unref_list(kvw_req_t *r)
{
    while (r) {
        kvw_req_t *next = r->stage.snext;
        kvw__req_unref(r);
        r = next;
    }
}

static void run_staging(kvw_stager_t *st)
{
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
}

/* ---- the landing buffer's copies ----
 *
 * A member whose heads landed in the landing buffer is copied into its
 * rows (2D copies, for GPU regions with a stream sync) here, not on the
 * poller's thread: the poller goes on reaping and posting while it runs.
 * Requests queue in landing order through stage.snext (a landing engine
 * is never staged, so the staging fields are free), each with the
 * reference the poller took. */

static void run_landing(struct kvw_copier *c)
{
    pthread_mutex_lock(&c->lock);
    for (;;) {
        kvw_req_t *r = c->head;
        if (!r && c->stop)
            break; /* what was queued is finished */
        if (!r) {
            pthread_cond_wait(&c->cond, &c->lock);
            continue;
        }
        c->head = r->stage.snext;
        if (!c->head)
            c->tail = NULL;
        r->stage.snext = NULL;
        pthread_mutex_unlock(&c->lock);
        /* Counted before the request can end: whoever sees it ended sees
         * the count. */
        atomic_fetch_add_explicit(&c->jobs, 1, memory_order_relaxed);
        kvw__landing_finish(c->e, r);
        pthread_mutex_lock(&c->lock);
    }
    pthread_mutex_unlock(&c->lock);
}

/* ---- the thread ------------------------------------------------------------------- */

static void *copier_main(void *arg)
{
    struct kvw_copier *c = arg;
    kvw__log_set_engine(c->e->log_tag);
    if (c->e->stager)
        run_staging(c->e->stager);
    else
        run_landing(c);
    return NULL;
}

kvw_status_t kvw__copier_start(kvw_engine_t *e)
{
    if (!e->landing && !e->stager)
        return KVW_OK; /* nothing to copy */
    struct kvw_copier *c = calloc(1, sizeof(*c));
    if (!c)
        return KVW_ERR_NO_MEMORY;
    c->e = e;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    if (pthread_create(&c->thread, NULL, copier_main, c)) {
        pthread_cond_destroy(&c->cond);
        pthread_mutex_destroy(&c->lock);
        free(c);
        return KVW_ERR_NO_MEMORY;
    }
    pthread_setname_np(c->thread, "kvw-copier");
    e->copier = c;
    return KVW_OK;
}

void kvw__copier_push(kvw_engine_t *e, kvw_req_t *r)
{
    struct kvw_copier *c = e->copier;
    pthread_mutex_lock(&c->lock);
    kvw__stage_append_req(&c->head, &c->tail, r);
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

void kvw__copier_stop(kvw_engine_t *e)
{
    struct kvw_copier *c = e->copier;
    if (!c)
        return;
    if (e->stager) { /* staging: what is queued is the stager's to drain */
        kvw_stager_t *st = e->stager;
        pthread_mutex_lock(&st->lock);
        st->stop = true;
        pthread_cond_broadcast(&st->cond);
        pthread_mutex_unlock(&st->lock);
    } else {
        pthread_mutex_lock(&c->lock);
        c->stop = true;
        pthread_cond_signal(&c->cond);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_join(c->thread, NULL);
    pthread_cond_destroy(&c->cond);
    pthread_mutex_destroy(&c->lock);
    free(c);
    e->copier = NULL;
}

uint64_t kvw__copier_jobs(kvw_engine_t *e)
{
    return e->copier ? atomic_load_explicit(&e->copier->jobs, memory_order_relaxed) : 0;
}
