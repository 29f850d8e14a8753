/* SPDX-License-Identifier: Apache-2.0 */
/* The stager's insides, shared by its files: stager.c (creation and
 * teardown), stage_jobs.c (the job queue, the copies, the pool's chunks),
 * copier.c (the copy executor's thread, whose loop serves the jobs),
 * stage_send.c (prefill: chunks, slices and copies out of the GPU) and
 * stage_recv.c (decode: slots and copies into the GPU). Not for the rest of the engine, which
 * uses engine/stager.h. */
#ifndef KVW_ENGINE_STAGER_INT_H
#define KVW_ENGINE_STAGER_INT_H

#include "engine/stager.h"
#include "mem/staging.h"

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

/* One slice's or one request's copies, between the GPU and the pool. */
typedef struct {
    kvw_stager_t *st;
    const kvw_req_t *r;
    const uint64_t *pages; /* the slice's source pages */
    uint8_t *chunk;
    int lane;
    kvw_status_t err;
    char why[200];
} copy_arg_t;

/* How staging a slice, a part or a request went: SLICE_WAIT when a slice
 * needs a chunk r's connection may not take now (take_chunk): r parks and
 * resumes where it stopped (r->stage) once a chunk comes back.
 * SLICE_EVENT when r's part waits on its producer's CUDA event: r is set
 * aside and looked at again KVW_EVENT_RECHECK_US later. */
typedef enum { SLICE_OK, SLICE_FAILED, SLICE_WAIT, SLICE_EVENT } slice_rc_t;

/* stage_jobs.c */
uint32_t kvw__stage_region_kind(const kvw_layout_t *l, uint32_t region);
/* Append r to a queue linked through stage.snext; the caller hands over
 * the reference the queue holds. */
void kvw__stage_append_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r);
/* Append r, with a reference of the queue's own. */
void kvw__stage_queue_req(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r);
/* r has work for the thread (once: not if queued, parked or waiting on an
 * event). _locked: under st->lock. */
void kvw__stage_push_job_locked(kvw_stager_t *st, kvw_req_t *r);
void kvw__stage_push_job(kvw_stager_t *st, kvw_req_t *r);
kvw_req_t *kvw__stage_pop_job_locked(kvw_stager_t *st);
/* Queue copies of count items at idx[] of region k into (or, to_gpu, out
 * of) dst, one per run of consecutive indices. */
void kvw__stage_copy_runs(copy_arg_t *a, uint32_t k, const uint64_t *idx, size_t count,
                          uint8_t *dst, bool to_gpu);

/* stage_send.c: prefill, on the stager thread */
kvw_status_t kvw__stage_setup_chunks(kvw_stager_t *st);
/* Stage r's queued parts, slice by slice, as far as chunks allow. */
slice_rc_t kvw__stage_parts(kvw_stager_t *st, kvw_req_t *r);
/* Wait for the slices being copied and hand them to their requests. */
void kvw__stage_finish_all(kvw_stager_t *st);
void kvw__stage_park(kvw_stager_t *st, kvw_req_t *r);
void kvw__stage_wait_event(kvw_stager_t *st, kvw_req_t *r);
void kvw__stage_requeue_events_locked(kvw_stager_t *st);
kvw_req_t *kvw__stage_unpark_all_locked(kvw_stager_t *st);

/* stage_recv.c: decode */
kvw_status_t kvw__stage_setup_slots(kvw_stager_t *st);
/* Receivers waiting for slots take them, in order, while they fit. */
void kvw__stage_grant_waiters(kvw_stager_t *st);
/* The request landed in its slots: copy them to the GPU pages, then end it. */
void kvw__stage_copy_in(kvw_stager_t *st, kvw_req_t *r);
/* (engine lock) r's copy to the GPU is over (or will never run). */
void kvw__stage_copy_in_over_locked(kvw_stager_t *st, kvw_req_t *r);

#endif
