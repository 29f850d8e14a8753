/* SPDX-License-Identifier: Apache-2.0 */
/* Prefill over several decode receivers (decode TP > prefill TP): one
 * sender handle over one plain sender ("member") per decode request, all
 * for the same room. A decode engine's REQUEST claims a member nobody
 * claimed yet (kvw__txset_claim_locked, from the control thread), which
 * then serves it as a plain sender serves its one request: its pages, aux
 * item, state and, with head slicing, its heads. The caller's calls apply
 * to every member. The set is Success once every member is; when one
 * fails, the others are failed at once (each tells its decode receiver once
 * its writes drained), and the set is Failed once every member ended, with
 * the first failure's reason naming its receiver.
 *
 * A set made by kvw_sender_create_learn starts with member 0 alone and
 * learns how many members it has from the first decode REQUEST for the
 * room (its room_receivers, wire 12; 1 when it says none): the control
 * thread adds the members then, under the engine lock, and publishes the
 * count (`known`, release); the caller's thread reads the members only
 * once it saw `known` (acquire), so n never changes under it. Until then
 * the caller's calls that hand work over are refused (KVW_ERR_STATE):
 * they would reach member 0 alone. Any request whose count disagrees with
 * the set's fails the room. */
#include "engine/core.h"
#include "engine/stager.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvw_txset {
    kvw_engine_t *engine;
    uint32_t n;          /* (lock until known) */
    bool learn;          /* n comes from the first decode request */
    _Atomic bool known;  /* n is final (always, unless learn) */
    kvw_set_fate_t fate; /* (lock) */
    kvw_req_t *m[];      /* member i serves the i-th decode request to claim it */
};

/* The members the caller's thread may use: every one once the count is
 * known, else member 0 alone (the only one there is). */
static uint32_t known_members(kvw_txset_t *set)
{
    return atomic_load_explicit(&set->known, memory_order_acquire) ? set->n : 1;
}

/* (lock) The decode receivers r's request said ask for the room (1 when it
 * said none), or 0 for a record of no request (decode's ABORT). */
static uint32_t said_receivers(const kvw_req_t *r)
{
    if (!r->tx.have_dst || r->tx.abort_heard)
        return 0;
    return r->tx.room_receivers ? r->tx.room_receivers : 1;
}

/* (lock) Why a request saying `said` receivers disagrees with the set. */
static void disagree_reason(const kvw_txset_t *set, uint32_t said, char *why, size_t size)
{
    snprintf(why, size,
             "decode receivers disagree on the room: a request says %u decode receivers ask for "
             "it, the room's sender serves %u (%s)",
             said, set->n, set->learn ? "the first request's count" : "its caller's count");
}

/* (lock) A request of the room no sender owns yet (decode asked first). */
static bool is_orphan(const kvw_req_t *r)
{
    return !r->has_user && !r->user_gone;
}

/* (lock) The room's requests before the set exists: drop tombstones of
 * destroyed senders, and refuse a room a live sender owns. */
static kvw_status_t check_room_locked(kvw_engine_t *e, uint64_t room)
{
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    while (r) {
        kvw_req_t *next = kvw__req_find_next_locked(r);
        if (r->user_gone && r->tx.drained && !r->tx.notify_failure)
            kvw__req_drop_locked(r); /* a destroyed sender's tombstone */
        else if (r->has_user)
            return KVW_ERR_EXISTS;
        r = next;
    }
    return KVW_OK;
}

/* (lock) Fail every member still live for why. */
static void fail_all_locked(kvw_txset_t *set, kvw_status_t st, const char *why)
{
    kvw__set_fail_locked(&set->fate, st, "%s", why);
    for (uint32_t i = 0; i < set->n; i++)
        if (!kvw__req_ended(set->m[i]))
            kvw__sender_fail_locked(set->m[i], KVW_ERR_ABORTED, why);
}

static void set_member_locked(kvw_txset_t *set, uint32_t i, kvw_req_t *r)
{
    kvw__sender_adopt_locked(r);
    r->tx.set = set;
    r->tx.member_failed_locked = kvw__txset_member_failed_locked;
    r->tx.set_index = i;
    set->m[i] = r;
}

/* (lock) A learning set's count from the requests decode engines sent
 * before it existed: the first one's (1 when it says none), 0 when none
 * of them is a request (an ABORT's record, or none at all). */
static uint32_t learn_from_orphans_locked(kvw_engine_t *e, uint64_t room)
{
    for (kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room); r;
         r = kvw__req_find_next_locked(r))
        if (is_orphan(r) && !r->tx.set && said_receivers(r))
            return said_receivers(r);
    return 0;
}

/* (lock) Fail the room when an adopted request disagrees with the set's
 * count (a member that said none cannot disagree). */
static void check_counts_locked(kvw_txset_t *set)
{
    for (uint32_t i = 0; i < set->n && !set->fate.failed; i++) {
        uint32_t said = set->m[i]->tx.room_receivers;
        if (said_receivers(set->m[i]) && said && said != set->n) {
            char why[KVW_WIRE_REASON_MAX];
            disagree_reason(set, said, why, sizeof(why));
            fail_all_locked(set, KVW_ERR_MISMATCH, why);
        }
    }
}

kvw_status_t kvw__txset_create(kvw_engine_t *e, uint64_t room, uint32_t n, kvw_req_t **first_p)
{
    if (kvw__stager_on(e)) {
        KVW_ERROR("room %llu: a sender over several decode receivers needs memory registered "
                  "directly (not staged)",
                  (unsigned long long)room);
        return KVW_ERR_UNSUPPORTED;
    }
    bool learn = n == 0;
    kvw_txset_t *set =
        calloc(1, sizeof(*set) + (learn ? KVW_MAX_DECODE_RECEIVERS : n) * sizeof(kvw_req_t *));
    if (!set)
        return KVW_ERR_NO_MEMORY;
    set->engine = e;
    set->learn = learn;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = check_room_locked(e, room);
    if (learn) { /* known now if a decode engine asked ahead, else member 0 alone */
        n = st ? 1 : learn_from_orphans_locked(e, room);
        atomic_store_explicit(&set->known, n != 0, memory_order_relaxed);
        n = n ? n : 1;
    } else {
        atomic_store_explicit(&set->known, true, memory_order_relaxed);
    }
    /* Requests decode engines sent ahead (or their aborts): the first n are
     * members (a failed one fails the set), the rest refused. */
    for (kvw_req_t *r = st ? NULL : kvw__req_find_locked(e, KVW_ROLE_PREFILL, room); r;
         r = kvw__req_find_next_locked(r)) {
        if (!is_orphan(r) || r->tx.set)
            continue;
        if (set->n < n)
            set_member_locked(set, set->n++, r);
        else if (!kvw__req_ended(r))
            kvw__sender_fail_locked(r, KVW_ERR_LIMIT,
                                    "the room's sender serves fewer decode receivers");
    }
    while (!st && set->n < n) {
        kvw_req_t *r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room);
        if (!r)
            st = KVW_ERR_NO_MEMORY;
        else
            set_member_locked(set, set->n++, r);
    }
    /* A decode engine gave the room up before the sender existed: the
     * room fails for every receiver. */
    for (uint32_t i = 0; !st && !set->fate.failed && i < set->n; i++)
        if (atomic_load(&set->m[i]->state) == KVW_POLL_FAILED)
            kvw__txset_member_failed_locked(set->m[i]);
    if (!st)
        check_counts_locked(set);
    pthread_mutex_unlock(&e->lock);
    if (st) {
        if (set->n)
            kvw__txset_destroy(set);
        else
            free(set);
        return st;
    }
    *first_p = set->m[0];
    return KVW_OK;
}

/* (lock) A learning set's first request says `said` receivers: add the
 * members it lacks, then publish the count. A set that failed already
 * (nothing to serve) learns nothing: its one member answers. */
static kvw_status_t learn_locked(kvw_txset_t *set, uint32_t said, char *why, size_t size)
{
    if (set->fate.failed)
        return KVW_OK;
    kvw_engine_t *e = set->engine;
    while (set->n < said) {
        kvw_req_t *r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, set->m[0]->room);
        if (!r) {
            snprintf(why, size, "no memory for the room's decode receiver %u of %u", set->n + 1,
                     said);
            fail_all_locked(set, KVW_ERR_NO_MEMORY, why);
            return KVW_ERR_NO_MEMORY;
        }
        set_member_locked(set, set->n, r);
        set->n++;
    }
    atomic_store_explicit(&set->known, true, memory_order_release);
    KVW_DEBUG("room %llu: the sender serves %u decode receivers (the first request's count)",
              (unsigned long long)set->m[0]->room, set->n);
    return KVW_OK;
}

kvw_status_t kvw__txset_claim_locked(kvw_txset_t *set, const kvw_peer_t *p, const kvw_msg_t *msg,
                                     kvw_req_t **r_p, bool *resend, char *why, size_t size)
{
    kvw_req_t *free_member = NULL;
    uint32_t token = msg->u.request.token, said = msg->u.request.room_receivers;
    *r_p = NULL;
    *resend = false;
    if (!atomic_load_explicit(&set->known, memory_order_relaxed)) {
        kvw_status_t st = learn_locked(set, said ? said : 1, why, size);
        if (st)
            return st;
    } else if (said && said != set->n && !set->fate.failed) {
        disagree_reason(set, said, why, size);
        fail_all_locked(set, KVW_ERR_MISMATCH, why);
        return KVW_ERR_MISMATCH;
    }
    for (uint32_t i = 0; i < set->n; i++) {
        kvw_req_t *m = set->m[i];
        if (m->peer == p && m->tx.have_dst) {
            if (m->token == token) { /* an exact resend */
                *r_p = m;
                *resend = true;
                return KVW_OK;
            }
            snprintf(why, size,
                     "this decode engine already asked for the room (one request per decode "
                     "engine; the room's sender serves %u)",
                     set->n);
            return KVW_ERR_EXISTS;
        }
        if (!free_member && !m->tx.have_dst && !m->peer)
            free_member = m;
    }
    if (!free_member) {
        snprintf(why, size, "the room's sender serves %u decode receivers, all claimed", set->n);
        return KVW_ERR_LIMIT;
    }
    *r_p = free_member;
    return KVW_OK;
}

kvw_req_t *kvw__txset_member_of_locked(kvw_txset_t *set, const kvw_peer_t *p)
{
    kvw_req_t *free_member = NULL;
    for (uint32_t i = 0; i < set->n; i++) {
        kvw_req_t *m = set->m[i];
        if (m->peer == p)
            return m;
        if (!free_member && !m->tx.have_dst && !m->peer)
            free_member = m;
    }
    return free_member;
}

void kvw__txset_member_failed_locked(kvw_req_t *r)
{
    kvw_txset_t *set = r->tx.set;
    if (set->fate.failed)
        return; /* the first failure fails the rest (fail_all_locked's loop) */
    kvw__set_fail_locked(&set->fate, r->fail_status, "decode receiver %u of %u: %.100s",
                         r->tx.set_index + 1, set->n, r->fail_reason);
    char why[KVW_WIRE_REASON_MAX];
    snprintf(why, sizeof(why), "decode receiver %u of %u of the room failed", r->tx.set_index + 1,
             set->n);
    fail_all_locked(set, r->fail_status, why);
}

/* Apply one call to every member; the first error is returned (a member
 * that failed fails the others, whose calls then return KVW_ERR_STATE). */
#define EACH_MEMBER(set, call)                                                                     \
    do {                                                                                           \
        if (!atomic_load_explicit(&(set)->known, memory_order_acquire))                            \
            return KVW_ERR_STATE; /* a learning set: its count is not known yet */                 \
        kvw_status_t first_ = KVW_OK;                                                              \
        for (uint32_t i_ = 0; i_ < (set)->n; i_++) {                                               \
            kvw_req_t *m = (set)->m[i_];                                                           \
            kvw_status_t st_ = (call);                                                             \
            if (st_ && !first_)                                                                    \
                first_ = st_;                                                                      \
        }                                                                                          \
        return first_;                                                                             \
    } while (0)

kvw_status_t kvw__txset_init(kvw_txset_t *set, size_t num_pages, uint32_t aux_index)
{
    EACH_MEMBER(set, kvw__sender_init_one(m, num_pages, aux_index));
}

kvw_status_t kvw__txset_send_part(kvw_txset_t *set, const kvw_part_t *part, void *event)
{
    EACH_MEMBER(set, kvw__sender_send_part_one(m, part, event));
}

kvw_status_t kvw__txset_send(kvw_txset_t *set, const uint64_t *pages, size_t n, void *event)
{
    EACH_MEMBER(set, kvw__sender_send_one(m, pages, n, event));
}

kvw_status_t kvw__txset_send_state(kvw_txset_t *set, const uint64_t *state, size_t n,
                                   const kvw_state_list_t *lists, size_t num_lists)
{
    EACH_MEMBER(set, kvw__sender_send_state_one(m, state, n, lists, num_lists));
}

kvw_poll_t kvw__txset_poll(kvw_txset_t *set)
{
    bool known = atomic_load_explicit(&set->known, memory_order_acquire);
    kvw_poll_t s = kvw__members_poll(set->m, known ? set->n : 1);
    /* A learning set is Bootstrapping until it knows its members (its
     * member 0 may have turned WaitingForInput since `known` was read). */
    return known || s == KVW_POLL_FAILED ? s : KVW_POLL_BOOTSTRAPPING;
}

kvw_status_t kvw__txset_failure(kvw_txset_t *set, const char **reason_p)
{
    return kvw__set_failure(set->engine, kvw__txset_poll(set), &set->fate, reason_p);
}

kvw_status_t kvw__txset_requested(kvw_txset_t *set, size_t *num_pages_p, uint32_t *aux_p)
{
    uint32_t n = known_members(set);
    for (uint32_t i = 0; i < n; i++) { /* members are claimed in order */
        kvw_status_t st = kvw__sender_requested_one(set->m[i], num_pages_p, aux_p);
        if (st != KVW_ERR_STATE)
            return st;
    }
    return KVW_ERR_STATE;
}

kvw_status_t kvw__txset_metrics(kvw_txset_t *set, kvw_req_metrics_t *out)
{
    kvw_req_metrics_t sum = {0};
    uint32_t n = known_members(set);
    for (uint32_t i = 0; i < n; i++) {
        const kvw_req_t *r = set->m[i];
        uint64_t first = atomic_load(&r->tx.first_post_ns), done = atomic_load(&r->tx.done_ns);
        sum.bytes += atomic_load(&r->bytes_posted);
        sum.writes += atomic_load(&r->tx.writes_posted);
        if (first && (!sum.start_ns || first < sum.start_ns))
            sum.start_ns = first;
        if (done > sum.end_ns)
            sum.end_ns = done;
    }
    sum.transfer_us =
        sum.start_ns && sum.end_ns > sum.start_ns ? (sum.end_ns - sum.start_ns) / 1000 : 0;
    *out = sum;
    return KVW_OK;
}

kvw_status_t kvw__txset_set_digest(kvw_txset_t *set, uint64_t digest)
{
    /* Every member sends the same bytes (MLA's latent whole to each decode
     * rank; head slicing is not verified): one digest for all. */
    kvw_engine_t *e = set->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = KVW_ERR_STATE;
    for (uint32_t i = 0; i < set->n; i++)
        if (!kvw__sender_set_digest_locked(set->m[i], digest))
            st = KVW_OK; /* a member that failed keeps none: its decode was told */
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_status_t kvw__txset_abort(kvw_txset_t *set)
{
    kvw_engine_t *e = set->engine;
    pthread_mutex_lock(&e->lock);
    bool live = kvw__members_live(set->m, set->n);
    if (live)
        fail_all_locked(set, KVW_ERR_ABORTED, "aborted by prefill");
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding them now */
    return live ? KVW_OK : KVW_ERR_STATE;
}

void kvw__txset_destroy(kvw_txset_t *set)
{
    kvw_engine_t *e = set->engine;
    pthread_mutex_lock(&e->lock);
    bool live = kvw__members_live(set->m, set->n);
    if (live)
        fail_all_locked(set, KVW_ERR_ABORTED, "sender destroyed by the caller");
    /* Plain senders from here on: a member the engine keeps (its decode
     * receiver not told yet) no longer points at the set. */
    for (uint32_t i = 0; i < set->n; i++) {
        set->m[i]->tx.set = NULL;
        set->m[i]->tx.member_failed_locked = NULL;
    }
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < set->n; i++)
        kvw__sender_destroy_one(set->m[i]);
    free(set);
}
