/* SPDX-License-Identifier: Apache-2.0 */
/* Host staging of GPU regions the NIC cannot reach (the STAGING path of
 * mem/mem.h), one stager per engine that has such a region, with a thread
 * of its own that issues the CUDA copies and waits for them, so that no
 * other thread ever blocks on a copy.
 *
 * A kind of region (KV, aux, state) with any staged region is staged as a
 * whole: its page indices then name places in the pool, not in the
 * regions, and every one of its regions is copied.
 *
 * Prefill: the pool is cut into chunks (staging_chunk_kib). Every part
 * handed to a sender waits, in order, until decode's pages are known; the
 * stager then cuts it into slices of at most a chunk (a range of layers,
 * or a range of pages of one layer), copies each slice's source pages from
 * the GPU into a chunk, and appends the slice to the request as a part of
 * its own whose source is the chunk. Copies run on staging_lanes streams
 * in turn, so slice k+1 is copied while the NIC writes slice k. The poller
 * gives a chunk back once the writes that read it completed. One thread
 * serves every connection, and never waits for a chunk: a connection
 * holds at most a share of them (a quarter of the pool, at least
 * staging_lanes + 1), and a request that cannot have one now (the pool
 * empty, or its connection at its share) parks while the thread serves
 * the others, resuming where it stopped when a chunk comes back. So a
 * connection whose writes stall holds its share until its transfer
 * timeout, and the others go on. Nor does it wait for a producer's CUDA
 * event (kvw_sender_send_part_after): nothing of a part is copied, or
 * passed to the NIC as it is, before its event completed; a request whose
 * part waits is set aside and looked at again every KVW_EVENT_RECHECK_US
 * (cuEventQuery), and an event that fails fails the request. Its slices
 * carry no event.
 *
 * Decode: the pool holds page slots: a slot of a kind has room for one
 * item of every region of that kind, and decode's handshake advertises
 * the slots instead of its GPU regions. A receiver takes slots for its
 * pages (in order of arrival; one that can never fit fails with
 * KVW_ERR_LIMIT) and sends them as its destination; when its last write
 * landed, the stager copies the slots to the GPU pages, and only then is
 * the request a Success. Slots return to the pool after that copy, or
 * when a failed receiver is destroyed (nothing can land in them then).
 *
 * The abort barrier: once a receiver reports Failed, or its destroy
 * returned, nothing writes its pages any more, the stager included. So a
 * request whose data landed ends only when its copy to the GPU is over:
 * failures from the network meanwhile (prefill's REQUEST_FAILED, the
 * connection's death) are ignored, for every byte had landed, and the
 * request is a Success once copied; decode's own abort or destroy lets
 * the copy finish, then fails it (no ABORT goes out: nothing can land);
 * the transfer deadline stops at the landing.
 *
 * Locks: engine->lock before the stager's own lock, never the reverse. */
#ifndef KVW_ENGINE_STAGER_H
#define KVW_ENGINE_STAGER_H

#include "engine/core.h"

/* At engine creation, after registration: a stager if any region took the
 * staging path (e->stager stays NULL otherwise). Logs and fails when the
 * pool cannot hold one page of a layer, or cannot be allocated. */
kvw_status_t kvw__stager_create(kvw_engine_t *e);
/* Stop the thread and let go of the requests it held. Threads of the
 * engine may still be running; call before stopping them. */
void kvw__stager_stop(kvw_engine_t *e);
/* After every other thread stopped: the pool and the stager. */
void kvw__stager_destroy(kvw_engine_t *e);

/* Whether parts of this engine's senders go through the stager. */
static inline bool kvw__stager_on(const kvw_engine_t *e)
{
    return e->stager != NULL;
}

/* ---- prefill ---- */
/* (lock) A part handed to a sender: queued for staging once decode's pages
 * are known. */
void kvw__stager_take_part_locked(kvw_req_t *r, kvw_seg_t *s);
/* (lock) Decode's pages became known: stage the parts queued so far. */
void kvw__stager_kick_locked(kvw_req_t *r);
/* (lock) Plan-time: point the staged regions of a slice's plan at its
 * chunk. out holds a copy of every plan region (num_regions). */
void kvw__stager_slice_regions(const kvw_req_t *r, const kvw_seg_t *s, kvw_plan_region_t *out);
/* Any thread: a chunk is free again. */
void kvw__stager_put_chunk(kvw_engine_t *e, uint32_t chunk);
/* Poller: a request left the poller without completing (failed, its
 * connection dead) and none of its writes is in flight: the chunks of its
 * slices that were not (all) posted return now, not when it is freed, so
 * that a failed sender kept by its caller holds no share of the pool. */
void kvw__stager_drop_unposted(kvw_req_t *r);
/* Poller, on p: the writes of a slice were all built; its chunk returns
 * once everything built on p's lanes so far completed. */
void kvw__stager_chunk_posted(kvw_peer_t *p, kvw_seg_t *s);
/* Poller: give back the chunks whose writes completed (all of them when
 * the connection died: nothing reads them any more). */
void kvw__stager_chunks_completed(kvw_peer_t *p, bool all);

/* ---- decode ---- */
/* (lock) A receiver's indices are known: take slots for them. KVW_OK with
 * *ready true (send the request now) or false (it waits for slots, in
 * order, and is sent when they come; r->stage.waiting meanwhile);
 * KVW_ERR_LIMIT with why when it can never fit. */
kvw_status_t kvw__stager_reserve_locked(kvw_req_t *r, bool *ready, char *why, size_t size);
/* (lock) A receiver waiting for slots ended (timeout, abort): the ones
 * queued behind it are served without waiting for slots to come back. */
void kvw__stager_waiter_left_locked(kvw_req_t *r);
/* (lock) The request's last write landed in its slots: copy them to the
 * GPU, then Success (or the abort's failure). Until that copy is over the
 * request does not end (staging_in: kvw__req_fail ignores it). */
void kvw__stager_landed_locked(kvw_req_t *r);
/* Whether r's copy to the GPU is queued or running. Any thread, no lock. */
bool kvw__stager_copying(kvw_req_t *r);
/* A receiver that ended and can receive nothing more (destroyed, freed):
 * its slots return to the pool. No-op while its copy runs (the stager
 * returns them then), while it is still Transferring (prefill may write
 * them: a destroyed one stays listed until it ends, and its final
 * reference returns them) or when it holds none. Any thread, any lock. */
void kvw__stager_unreserve(kvw_req_t *r);

/* For tests and tools: the pool's use now. All zero without a stager. */
typedef struct kvw_stager_stats {
    uint32_t chunks, free_chunks; /* prefill */
    uint64_t slots, free_slots;   /* decode: of the KV kind, or the first staged one */
    bool kind[3];                 /* staged kinds */
} kvw_stager_stats_t;
void kvw__stager_stats(const kvw_engine_t *e, kvw_stager_stats_t *out);

#endif
