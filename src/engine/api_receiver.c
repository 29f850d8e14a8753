/* SPDX-License-Identifier: Apache-2.0 */
/* The public receiver API (kvw_receiver_*, include/kvwire.h). A handle is
 * a request: a plain receiver's own, or member 0 of a set over several
 * prefill ranks (rxset.c), and each call says once which (rx.set) and
 * hands the work to the owner below: receiver.c for one request, rxset.c
 * for a set, which calls receiver.c per member. */
#include "engine/core.h"

#include "common/log.h"

#include <stdio.h>
#include <string.h>

struct kvw_receiver {
    kvw_req_t req;
};

kvw_status_t kvw_receiver_create_ranks(kvw_engine_t *e, const kvw_receiver_params_t *params,
                                       kvw_receiver_t **recv_p)
{
    if (!e || !params || !recv_p || e->role != KVW_ROLE_DECODE)
        return KVW_ERR_INVALID;
    return kvw__rxset_create(e, params, (kvw_req_t **)recv_p);
}

static kvw_status_t receiver_create(kvw_engine_t *e, const char *addr, uint32_t prefill_rank,
                                    uint64_t room, kvw_receiver_t **recv_p)
{
    kvw_req_t *r = NULL;
    kvw_status_t st = kvw__receiver_create(e, addr, prefill_rank, room, false, &r);
    if (!st)
        *recv_p = (kvw_receiver_t *)r;
    return st;
}

kvw_status_t kvw_receiver_create(kvw_engine_t *e, const char *bootstrap_addr, uint32_t prefill_rank,
                                 uint64_t room, kvw_receiver_t **recv_p)
{
    if (!e || !recv_p || !bootstrap_addr || e->role != KVW_ROLE_DECODE ||
        strlen(bootstrap_addr) >= KVW_WIRE_ENDPOINT_MAX - 6 || bootstrap_addr[0] == '@')
        return KVW_ERR_INVALID;
    return receiver_create(e, bootstrap_addr, prefill_rank, room, recv_p);
}

kvw_status_t kvw_receiver_create_at(kvw_engine_t *e, const char *endpoint, uint32_t prefill_rank,
                                    uint64_t room, kvw_receiver_t **recv_p)
{
    if (!e || !recv_p || !endpoint || e->role != KVW_ROLE_DECODE ||
        strncmp(endpoint, "tcp://", 6) != 0 || !endpoint[6] ||
        strlen(endpoint) >= KVW_WIRE_ENDPOINT_MAX - 1)
        return KVW_ERR_INVALID;
    char addr[KVW_WIRE_ENDPOINT_MAX];
    snprintf(addr, sizeof(addr), "@%s", endpoint);
    return receiver_create(e, addr, prefill_rank, room, recv_p);
}

kvw_status_t kvw_receiver_init_lists(kvw_receiver_t *rc, const kvw_indices_t *x,
                                     const kvw_state_list_t *lists, size_t num_lists)
{
    if (!rc || !x || (x->num_pages && !x->pages) || (x->num_state && !x->state) ||
        (num_lists && !lists))
        return KVW_ERR_INVALID;
    const char *caller_tag = kvw__log_set_engine(rc->req.engine->log_tag); /* its lines */
    kvw_status_t st = rc->req.rx.set ? kvw__rxset_init(rc->req.rx.set, x, lists, num_lists)
                                     : kvw__receiver_init_one(&rc->req, x, lists, num_lists);
    kvw__log_set_engine(caller_tag);
    return st;
}

kvw_status_t kvw_receiver_init_indices(kvw_receiver_t *rc, const kvw_indices_t *x)
{
    return kvw_receiver_init_lists(rc, x, NULL, 0);
}

kvw_status_t kvw_receiver_init(kvw_receiver_t *rc, const uint64_t *pages, size_t n,
                               uint32_t aux_index)
{
    kvw_indices_t x = {.pages = pages, .num_pages = n, .aux_index = aux_index};
    return kvw_receiver_init_indices(rc, &x);
}

kvw_status_t kvw_receiver_metrics(const kvw_receiver_t *rc, kvw_req_metrics_t *m)
{
    if (!rc || !m)
        return KVW_ERR_INVALID;
    if (rc->req.rx.set)
        return kvw__rxset_metrics(rc->req.rx.set, m);
    const kvw_req_t *r = &rc->req;
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    uint64_t sent = r->rx.sent_ns, landed = atomic_load(&r->rx.landed_ns);
    pthread_mutex_unlock(&e->lock);
    *m = (kvw_req_metrics_t){.bytes = atomic_load(&r->bytes_posted),
                             .transfer_us = sent && landed > sent ? (landed - sent) / 1000 : 0,
                             .start_ns = sent,
                             .end_ns = landed};
    return KVW_OK;
}

kvw_status_t kvw_receiver_set_room_receivers(kvw_receiver_t *rc, uint32_t n)
{
    if (!rc || n > KVW_MAX_DECODE_RECEIVERS)
        return KVW_ERR_INVALID;
    kvw_engine_t *e = rc->req.engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = rc->req.rx.set ? kvw__rxset_set_room_receivers_locked(rc->req.rx.set, n)
                                     : kvw__receiver_set_room_receivers_locked(&rc->req, n);
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_status_t kvw_receiver_abort(kvw_receiver_t *rc)
{
    if (!rc)
        return KVW_ERR_INVALID;
    if (rc->req.rx.set)
        return kvw__rxset_abort(rc->req.rx.set);
    kvw_req_t *r = &rc->req;
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = kvw__req_ended(r) ? KVW_ERR_STATE : KVW_OK;
    if (!st)
        kvw__receiver_abort_locked(r, "aborted by the caller");
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_poll_t kvw_receiver_poll(kvw_receiver_t *rc)
{
    if (rc->req.rx.set)
        return kvw__rxset_poll(rc->req.rx.set);
    return kvw__req_poll(&rc->req);
}

kvw_status_t kvw_receiver_failure(const kvw_receiver_t *rc, const char **reason_p)
{
    if (rc->req.rx.set)
        return kvw__rxset_failure(rc->req.rx.set, reason_p);
    return kvw__req_failure(&rc->req, reason_p);
}

void kvw_receiver_destroy(kvw_receiver_t *rc)
{
    if (rc && rc->req.rx.set)
        kvw__rxset_destroy(rc->req.rx.set);
    else if (rc)
        kvw__receiver_destroy_one(&rc->req);
}

int kvw_receiver_landed(kvw_receiver_t *rc)
{
    if (!rc || rc->req.rx.set)
        return 0;
    return kvw__receiver_landed_one(&rc->req);
}

kvw_status_t kvw_receiver_verify(kvw_receiver_t *rc, uint64_t digest)
{
    if (!rc || rc->req.rx.set)
        return KVW_ERR_INVALID;
    return kvw__receiver_verify_one(&rc->req, digest);
}
