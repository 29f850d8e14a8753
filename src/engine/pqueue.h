/* SPDX-License-Identifier: Apache-2.0 */
/* The poller's request queues (a peer's active, in-flight, event-wait
 * and asking lists, linked through qnext) and a sender part's write count:
 * inline helpers shared by the poller (poller.c) and the rails' failover
 * (rails/failover.c), which both move requests between those queues under
 * the pass lock. */
#ifndef KVW_ENGINE_PQUEUE_H
#define KVW_ENGINE_PQUEUE_H

#include "engine/core.h"

static inline void kvw__queue_push(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    r->qnext = NULL;
    if (*tail)
        (*tail)->qnext = r;
    else
        *head = r;
    *tail = r;
}

static inline kvw_req_t *kvw__queue_pop(kvw_req_t **head, kvw_req_t **tail)
{
    kvw_req_t *r = *head;
    if (r) {
        *head = r->qnext;
        if (!*head)
            *tail = NULL;
        r->qnext = NULL;
    }
    return r;
}

/* The writes part s makes in all. A final part with nothing to copy: one
 * zero-length write carries the immediate. */
static inline uint64_t kvw__seg_total(const kvw_seg_t *s)
{
    return s->final && !s->writes_total ? 1 : s->writes_total;
}

/* Every write of r's last part is built (its final immediate among them). */
static inline bool kvw__req_fully_built(const kvw_req_t *r)
{
    return r->tx.seg->final && r->tx.seg->writes_built == kvw__seg_total(r->tx.seg);
}

#endif
