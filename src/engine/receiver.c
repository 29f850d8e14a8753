/* SPDX-License-Identifier: Apache-2.0 */
/* Decode side of a request: the public receiver API. */
#include "engine/core.h"
#include "engine/stager.h"
#include "engine/verify.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void kvw__receiver_fail_unsent_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    kvw__req_fail(r, st, "%s", why);
    r->rx.request_due = false;
    r->rx.abort_due = true;
    kvw__req_touch_locked(r);
    if (r->stage.waiting) /* its place in the queue goes to the next */
        kvw__stager_waiter_left_locked(r);
}

/* (lock) Give up a staged receiver whose every write landed and whose
 * copy to the GPU runs: nothing more can land, so there is no ABORT to
 * send nor confirmation to wait for (and prefill's sender, all of whose
 * writes completed, stays a Success). The copy is not recalled (CUDA
 * copies cannot be, and a page half copied serves nobody): it finishes,
 * then the receiver turns Failed with this reason (stage_recv.c), so that
 * nothing is written into its pages after Failed. */
static void receiver_abort_landed_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    r->rx.aborting = true;
    r->rx.abort_status = st;
    snprintf(r->rx.abort_reason, sizeof(r->rx.abort_reason), "%s", why);
    KVW_INFO("room %llu: aborting once its copy to the GPU is over: %s",
             (unsigned long long)r->room, why);
}

/* (lock) Give up a receiver that has not ended. */
void kvw__receiver_abort_locked(kvw_req_t *r, const char *why)
{
    if (r->rx.aborting)
        return; /* already waiting for prefill's confirmation */
    if (r->stage.staging_in)
        receiver_abort_landed_locked(r, KVW_ERR_ABORTED, why);
    else if (r->rx.request_sent)
        kvw__receiver_start_abort_locked(r, KVW_ERR_ABORTED, why);
    else
        kvw__receiver_fail_unsent_locked(r, KVW_ERR_ABORTED, why);
}

/* Abort a receiver that has not ended and wait until it has: when this
 * returns no write of the request can land any more, from the NIC or from
 * the stager. The wait for the network is bounded: without prefill's
 * confirmation the control thread kills the connection after
 * peer_timeout_ms, which fails the request. A copy from the staging pool
 * to the GPU is local and always finishes: it is waited for however long
 * it takes, since the request ends only with it. */
void kvw__receiver_end(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    if (!kvw__req_ended(r))
        kvw__receiver_abort_locked(r, "receiver destroyed by the caller");
    pthread_mutex_unlock(&e->lock);
    uint64_t give_up = kvw__now_ns() + 2 * kvw__ms_ns(e->cfg.peer_timeout_ms) + kvw__ms_ns(1000);
    while (!kvw__req_ended(r) && (kvw__now_ns() < give_up || kvw__stager_copying(r))) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (!kvw__req_ended(r))
        KVW_ERROR("room %llu: receiver destroyed before its abort completed; the engine keeps "
                  "it (and its staging slots) until it ends",
                  (unsigned long long)r->room);
}

/* Its last reference went: its slots (if it ended, nothing lands in them
 * any more) and its pages. */
static void receiver_free(kvw_req_t *r)
{
    kvw__stager_unreserve(r);
    free(r->stage.slots);
    free(r->rx.pages);
    free(r->rx.state_n);
}

/* (lock) One rank of a receiver over several failed: the others follow. */
static void receiver_failed_locked(kvw_req_t *r)
{
    /* Failed comes only once nothing more of it can land: its landing
     * space may serve another request. */
    if (atomic_load(&r->state) == KVW_POLL_FAILED)
        kvw__landing_release_locked(r->engine, r);
    if (r->rx.member_failed_locked) /* the set's hook (rxset.c) */
        r->rx.member_failed_locked(r);
}

/* (lock) Its ABORT is still to be sent. */
static bool receiver_answer_owed_locked(kvw_req_t *r)
{
    return r->rx.abort_due;
}

const kvw_role_ops_t kvw__decode_ops = {
    .failed_locked = receiver_failed_locked,
    .free = receiver_free,
    .answer_owed_locked = receiver_answer_owed_locked,
};

void kvw__receiver_destroy_one(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    kvw__receiver_end(r);
    kvw__stager_unreserve(r); /* if it ended: nothing lands in its slots any more */
    pthread_mutex_lock(&e->lock);
    kvw__token_release_locked(e, r);
    kvw__req_release_handle_locked(r);
    pthread_mutex_unlock(&e->lock);
    kvw__req_unref(r); /* the caller's */
}

/* ------------------------------------------------------------- receiver */

/* addr: a bootstrap service's address, or (kvw_receiver_create_at) '@'
 * and a prefill engine's "tcp://ip:port", which the control thread dials
 * directly (ctl_decode.c); no bootstrap address starts with '@'. */
kvw_status_t kvw__receiver_create(kvw_engine_t *e, const char *addr, uint32_t prefill_rank,
                                  uint64_t room, bool member, kvw_req_t **r_p)
{
    const char *bootstrap_addr = addr;
    bool direct = addr[0] == '@';
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = KVW_OK;
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_DECODE, room);
    /* One receiver per room and prefill endpoint (or, for a set's members,
     * rank): another endpoint or rank may share it. */
    if (r && (direct || member))
        for (r = e->reqs; r && !(r->role == KVW_ROLE_DECODE && r->room == room &&
                                 strcmp(r->rx.bootstrap_addr, addr) == 0 &&
                                 (direct || r->rx.prefill_rank == prefill_rank));
             r = r->next)
            ;
    if (r) {
        st = KVW_ERR_EXISTS;
    } else if (!(r = kvw__req_new_locked(e, KVW_ROLE_DECODE, room))) {
        st = KVW_ERR_NO_MEMORY;
    } else if ((st = kvw__token_alloc_locked(e, r))) {
        kvw__req_drop_locked(r);
    } else {
        r->has_user = true;
        atomic_fetch_add(&r->refs, 1);
        r->rx.prefill_rank = prefill_rank;
        r->rx.verify = e->verify_mode; /* a member: refused earlier (rxset.c) */
        snprintf(r->rx.bootstrap_addr, sizeof(r->rx.bootstrap_addr), "%s", bootstrap_addr);
        kvw__req_touch_locked(r); /* attach it to a peer */
    }
    pthread_mutex_unlock(&e->lock);
    if (!st)
        *r_p = r;
    return st;
}

/* Check and copy a request's indices for the wire: pages, then each state
 * group's list (its own, or the shared one), with a count per state group. */
static kvw_status_t copy_indices(const kvw_engine_t *e, const kvw_indices_t *x,
                                 const kvw_state_list_t *lists, size_t num_lists, uint64_t **copy_p,
                                 uint32_t **counts_p, size_t *nstate_p, char *why, size_t size)
{
    *copy_p = NULL;
    *counts_p = NULL;
    *nstate_p = 0;
    kvw_status_t st = kvw__check_count(e, KVW_LAYOUT_KV, x->num_pages, why, size);
    if (!st)
        st = kvw__check_indices(e, KVW_LAYOUT_KV, "destination", x->pages, x->num_pages, why, size);
    if (!st)
        st = kvw__check_aux(e, x->aux_index, why, size);
    if (!st)
        st = kvw__state_lists(e, "destination", x->state, x->num_state, lists, num_lists,
                              x->num_pages, copy_p, counts_p, nstate_p, why, size);
    if (!st && x->num_pages)
        memcpy(*copy_p, x->pages, x->num_pages * sizeof(uint64_t));
    return st;
}

/* What decode expects to land: its own pages' bytes in every KV region,
 * one aux item per aux region, each state group's items in its regions. */
static uint64_t expected_bytes(const kvw_engine_t *e, const kvw_indices_t *x,
                               const uint32_t *state_n)
{
    const kvw_layout_t *l = &e->layout;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < l->kv_layers * l->kv_per_layer; i++)
        bytes += x->num_pages * e->regions[l->kv_slots[i]].item_len;
    for (uint32_t i = 0; x->aux_index != KVW_NO_AUX && i < l->num_aux; i++)
        bytes += e->regions[l->aux_slots[i]].item_len;
    for (uint32_t s = 0; s < l->num_state_groups; s++)
        for (uint32_t i = 0; i < l->state_nslots[s]; i++)
            bytes +=
                (uint64_t)state_n[s] * e->regions[l->state_slots[l->state_first[s] + i]].item_len;
    return bytes;
}

kvw_status_t kvw__receiver_init_one(kvw_req_t *r, const kvw_indices_t *x,
                                    const kvw_state_list_t *lists, size_t num_lists)
{
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    uint64_t *copy = NULL;
    uint32_t *counts = NULL;
    size_t nstate = 0;
    kvw_status_t st =
        copy_indices(e, x, lists, num_lists, &copy, &counts, &nstate, why, sizeof(why));
    pthread_mutex_lock(&e->lock);
    if (r->rx.pages || r->rx.request_due || r->rx.request_sent || kvw__req_ended(r)) {
        free(copy);
        free(counts);
        pthread_mutex_unlock(&e->lock);
        return KVW_ERR_STATE;
    }
    if (st) {
        KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
        kvw__receiver_fail_unsent_locked(r, st, why);
    } else {
        r->rx.pages = copy;
        r->rx.npages = x->num_pages;
        r->rx.nstate = nstate;
        r->rx.state_n = counts;
        r->rx.aux = x->aux_index;
        atomic_store(&r->bytes_posted, expected_bytes(e, x, counts));
        bool ready = true;
        if (kvw__stager_on(e) && (st = kvw__stager_reserve_locked(r, &ready, why, sizeof(why)))) {
            KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
            kvw__receiver_fail_unsent_locked(r, st, why);
        } else {
            r->rx.request_due = ready; /* else when the stager has slots for it */
            /* Waiting for slots is bounded like the rest of getting the
             * request to prefill (whose sender gives up as long after its
             * creation): by bootstrap_timeout_ms from the receiver's
             * creation, or from now if that has passed. */
            uint64_t limit = kvw__ms_ns(e->cfg.bootstrap_timeout_ms);
            if (!ready && !r->deadline_ns)
                kvw__req_set_deadline_locked(r, kvw__now_ns() + limit);
            kvw__req_touch_locked(r);
        }
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

void kvw__receiver_start_abort_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    kvw_engine_t *e = r->engine;
    r->rx.aborting = true;
    r->rx.abort_status = st;
    snprintf(r->rx.abort_reason, sizeof(r->rx.abort_reason), "%s", why);
    r->rx.abort_due = true;
    kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.peer_timeout_ms));
    KVW_INFO("room %llu: aborting: %s", (unsigned long long)r->room, why);
    kvw__req_touch_locked(r);
}

int kvw__receiver_landed_one(kvw_req_t *r)
{
    pthread_mutex_lock(&r->engine->lock);
    int landed = r->rx.verify == KVW_VERIFY_CALLER && r->rx.v_landed && !kvw__req_ended(r);
    pthread_mutex_unlock(&r->engine->lock);
    return landed;
}

kvw_status_t kvw__receiver_verify_one(kvw_req_t *r, uint64_t digest)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = r->rx.verify != KVW_VERIFY_CALLER || !r->rx.v_landed || r->rx.v_have_local ||
                              kvw__req_ended(r)
                          ? KVW_ERR_STATE
                          : KVW_OK;
    if (!st)
        kvw__verify_landed_locked(r, true, digest);
    bool ended = kvw__req_ended(r);
    pthread_mutex_unlock(&e->lock);
    if (ended)
        kvw__stager_unreserve(r); /* nothing lands in its slots any more */
    return st;
}

kvw_status_t kvw__receiver_set_room_receivers_locked(kvw_req_t *r, uint32_t n)
{
    if (r->rx.request_due || r->rx.request_sent || kvw__req_ended(r))
        return KVW_ERR_STATE; /* its REQUEST is due or gone */
    r->rx.room_receivers = n;
    return KVW_OK;
}
