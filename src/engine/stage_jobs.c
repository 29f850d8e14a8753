/* SPDX-License-Identifier: Apache-2.0 */
/* The staging jobs, below the copy executor's loop (copier.c) and the
 * stager's two halves (stage_send.c, stage_recv.c): the job queue the
 * executor serves, the copies between GPU regions and the host pool, and
 * the chunks given back to the pool (by the poller once a slice's writes
 * completed, or by a part freed unposted). */
#include "engine/stager_int.h"

#include "common/log.h"

#include <pthread.h>

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
    if (r->stage.queued || (r->role == KVW_ROLE_PREFILL && (r->stage.parked || r->stage.evwait)))
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
