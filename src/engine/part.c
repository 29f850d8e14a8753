/* SPDX-License-Identifier: Apache-2.0 */
/* A sender's parts (kvw_seg_t, core.h), which the sender, the poller
 * and the stager's prefill half each hold in turn: freeing them (with
 * their staging chunk) and the query of a part's producer event. */
#include "engine/core.h"
#include "engine/stager.h"

#include <stdio.h>
#include <stdlib.h>

void kvw__seg_free(kvw_engine_t *e, kvw_seg_t *s)
{
    kvw__stager_put_chunk(e, s->chunk);
    free(s->src);
    free(s->runs);
    free(s->state_runs);
    free(s->state_sets);
    free(s->stage_regions);
    free(s->state_src);
    free(s);
}

void kvw__seg_free_list(kvw_engine_t *e, kvw_seg_t *s)
{
    while (s) {
        kvw_seg_t *next = atomic_load_explicit(&s->next, memory_order_relaxed);
        kvw__seg_free(e, s);
        s = next;
    }
}

int kvw__seg_event_ready(kvw_req_t *r, kvw_seg_t *s, char *why, size_t size)
{
    if (!s->event)
        return 1;
    kvw_engine_t *e = r->engine;
    const kvw_cuda_ops_t *cu = kvw__cuda_ops();
    char err[160] = "the CUDA seam cannot query events";
    int rc = 0;
    pthread_mutex_lock(&e->event_lock);
    if (!kvw__req_ended(r)) { /* ended: the caller may have destroyed it */
        int q = cu->event_query ? cu->event_query(e->event_ctx, s->event, err, sizeof(err)) : -1;
        rc = q == 0 ? 1 : q == 1 ? 0 : -1;
        atomic_fetch_add_explicit(&e->counters.event_queries, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&e->event_lock);
    if (rc == 1)
        s->event = NULL; /* completed: never looked at again */
    else if (rc < 0)
        snprintf(why, size,
                 "the producer's CUDA event of the part (layers [%u, %u), pages [%zu, %zu)) "
                 "failed: %s",
                 s->lb, s->le, s->first, s->first + s->n, err);
    return rc;
}

void kvw__seg_slice_plan(const kvw_peer_t *p, const kvw_layout_t *l, const kvw_seg_t *s,
                         size_t slot, kvw_heads_plan_t *hp)
{
    /* The keys of the lane being built (the poller set s's plan to them);
     * a staged slice's plan holds the chunk, not the peer's regions. */
    const kvw_plan_region_t *g = &(s->chunk ? p->regions : s->plan.regions)[l->kv_slots[slot]];
    /* Landing: slot after slot in decode's landing buffer (one rail: see
     * landing.c), not its rows. */
    *hp = (kvw_heads_plan_t){.geom = s->kv_geom[slot % l->kv_per_layer],
                             .local_addr = g->local_addr,
                             .remote_addr =
                                 s->landing ? s->land_addr + slot * s->land_area : g->remote_addr,
                             .lkey = g->lkey,
                             .rkey = s->landing ? s->land_rkey : g->rkey,
                             .runs = s->runs,
                             .num_runs = s->plan.num_runs,
                             .max_sge = p->max_sge,
                             .max_msg = p->max_msg_sz};
}
