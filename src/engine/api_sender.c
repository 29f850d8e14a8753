/* SPDX-License-Identifier: Apache-2.0 */
/* The public sender API (kvw_sender_*, include/kvwire.h). A handle is a
 * request: a plain sender's own, or member 0 of a fan-out set (txset.c),
 * and each call says once which (tx.set) and hands the work to the owner
 * below: sender.c for one request (planning, the hand-off to the poller,
 * parking, failing), txset.c for a set, which calls sender.c per member. */
#include "engine/core.h"

#include "common/log.h"

struct kvw_sender {
    kvw_req_t req;
};

kvw_status_t kvw_sender_create(kvw_engine_t *e, uint64_t room, kvw_sender_t **sender_p)
{
    if (!e || !sender_p || e->role != KVW_ROLE_PREFILL)
        return KVW_ERR_INVALID;
    return kvw__sender_create_one(e, room, (kvw_req_t **)sender_p);
}

kvw_status_t kvw_sender_create_fanout(kvw_engine_t *e, uint64_t room, uint32_t n,
                                      kvw_sender_t **sender_p)
{
    if (!e || !sender_p || e->role != KVW_ROLE_PREFILL || !n || n > KVW_MAX_DECODE_RECEIVERS)
        return KVW_ERR_INVALID;
    if (n == 1)
        return kvw_sender_create(e, room, sender_p);
    return kvw__txset_create(e, room, n, (kvw_req_t **)sender_p);
}

kvw_status_t kvw_sender_create_learn(kvw_engine_t *e, uint64_t room, kvw_sender_t **sender_p)
{
    if (!e || !sender_p || e->role != KVW_ROLE_PREFILL)
        return KVW_ERR_INVALID;
    return kvw__txset_create(e, room, 0, (kvw_req_t **)sender_p);
}

kvw_status_t kvw_sender_init(kvw_sender_t *s, size_t num_pages, uint32_t aux_index)
{
    if (!s)
        return KVW_ERR_INVALID;
    const char *caller_tag = kvw__log_set_engine(s->req.engine->log_tag); /* its lines */
    kvw_status_t st = s->req.tx.set ? kvw__txset_init(s->req.tx.set, num_pages, aux_index)
                                    : kvw__sender_init_one(&s->req, num_pages, aux_index);
    kvw__log_set_engine(caller_tag);
    return st;
}

kvw_status_t kvw_sender_send_part_after(kvw_sender_t *sender, const kvw_part_t *part,
                                        void *cuda_event)
{
    if (!sender || !part || (part->num_pages && !part->pages))
        return KVW_ERR_INVALID;
    const char *caller_tag = kvw__log_set_engine(sender->req.engine->log_tag);
    kvw_status_t st = sender->req.tx.set
                          ? kvw__txset_send_part(sender->req.tx.set, part, cuda_event)
                          : kvw__sender_send_part_one(&sender->req, part, cuda_event);
    kvw__log_set_engine(caller_tag);
    return st;
}

kvw_status_t kvw_sender_send_part(kvw_sender_t *sender, const kvw_part_t *part)
{
    return kvw_sender_send_part_after(sender, part, NULL);
}

/* The next pages for every layer: a prefill chunk, or the whole request. */
kvw_status_t kvw_sender_send_after(kvw_sender_t *sender, const uint64_t *pages, size_t n,
                                   void *cuda_event)
{
    if (!sender || (n && !pages))
        return KVW_ERR_INVALID;
    const char *caller_tag = kvw__log_set_engine(sender->req.engine->log_tag);
    kvw_status_t st = sender->req.tx.set ? kvw__txset_send(sender->req.tx.set, pages, n, cuda_event)
                                         : kvw__sender_send_one(&sender->req, pages, n, cuda_event);
    kvw__log_set_engine(caller_tag);
    return st;
}

kvw_status_t kvw_sender_send(kvw_sender_t *sender, const uint64_t *pages, size_t n)
{
    return kvw_sender_send_after(sender, pages, n, NULL);
}

kvw_status_t kvw_sender_send_state(kvw_sender_t *sender, const uint64_t *state, size_t n)
{
    return kvw_sender_send_state_lists(sender, state, n, NULL, 0);
}

kvw_status_t kvw_sender_send_state_lists(kvw_sender_t *sender, const uint64_t *state, size_t n,
                                         const kvw_state_list_t *lists, size_t num_lists)
{
    if (!sender || (n && !state) || (num_lists && !lists))
        return KVW_ERR_INVALID;
    const char *caller_tag = kvw__log_set_engine(sender->req.engine->log_tag);
    kvw_status_t st = sender->req.tx.set
                          ? kvw__txset_send_state(sender->req.tx.set, state, n, lists, num_lists)
                          : kvw__sender_send_state_one(&sender->req, state, n, lists, num_lists);
    kvw__log_set_engine(caller_tag);
    return st;
}

kvw_poll_t kvw_sender_poll(kvw_sender_t *s)
{
    if (s && s->req.tx.set)
        return kvw__txset_poll(s->req.tx.set);
    return kvw__req_poll(&s->req);
}

kvw_status_t kvw_sender_failure(const kvw_sender_t *s, const char **reason_p)
{
    if (s && s->req.tx.set)
        return kvw__txset_failure(s->req.tx.set, reason_p);
    return kvw__req_failure(&s->req, reason_p);
}

kvw_status_t kvw_sender_requested(const kvw_sender_t *s, size_t *num_pages_p, uint32_t *aux_p)
{
    if (!s)
        return KVW_ERR_INVALID;
    if (s->req.tx.set)
        return kvw__txset_requested(s->req.tx.set, num_pages_p, aux_p);
    return kvw__sender_requested_one(&s->req, num_pages_p, aux_p);
}

kvw_status_t kvw_sender_metrics(const kvw_sender_t *s, kvw_req_metrics_t *m)
{
    if (!s || !m)
        return KVW_ERR_INVALID;
    if (s->req.tx.set)
        return kvw__txset_metrics(s->req.tx.set, m);
    const kvw_req_t *r = &s->req;
    uint64_t first = atomic_load(&r->tx.first_post_ns), done = atomic_load(&r->tx.done_ns);
    *m = (kvw_req_metrics_t){.bytes = atomic_load(&r->bytes_posted),
                             .writes = atomic_load(&r->tx.writes_posted),
                             .transfer_us = first && done > first ? (done - first) / 1000 : 0,
                             .start_ns = first,
                             .end_ns = done};
    return KVW_OK;
}

kvw_status_t kvw_sender_set_digest(kvw_sender_t *s, uint64_t digest)
{
    if (!s)
        return KVW_ERR_INVALID;
    if (s->req.tx.set)
        return kvw__txset_set_digest(s->req.tx.set, digest);
    kvw_engine_t *e = s->req.engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = kvw__sender_set_digest_locked(&s->req, digest);
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_status_t kvw_sender_abort(kvw_sender_t *s)
{
    if (!s)
        return KVW_ERR_INVALID;
    if (s->req.tx.set)
        return kvw__txset_abort(s->req.tx.set);
    return kvw__sender_abort_one(&s->req, "aborted by prefill");
}

void kvw_sender_destroy(kvw_sender_t *s)
{
    if (!s)
        return;
    if (s->req.tx.set)
        kvw__txset_destroy(s->req.tx.set);
    else
        kvw__sender_destroy_one(&s->req);
}
