/* SPDX-License-Identifier: Apache-2.0 */
/* What senders (sender.c) and receivers (receiver.c) share: the request's
 * lifecycle, its state changes, and the checks of indices against the
 * registered regions. */
#include "engine/core.h"
#include "engine/verify.h"

#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------ lifecycle */

kvw_req_t *kvw__req_new_locked(kvw_engine_t *e, kvw_role_t role, uint64_t room)
{
    /* Both handle types wrap a kvw_req_t as their only member. */
    if (kvw__reqtab_reserve_locked(e))
        return NULL;
    kvw_req_t *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->engine = e;
    r->role = role;
    r->room = room;
    if (role == KVW_ROLE_PREFILL) {
        r->tx.aux_index = KVW_NO_AUX;
        r->tx.drained = true; /* nothing posted yet */
    } else {
        r->rx.aux = KVW_NO_AUX;
    }
    atomic_init(&r->state, KVW_POLL_BOOTSTRAPPING);
    atomic_init(&r->refs, 1); /* the engine list's reference */
    r->listed = true;
    r->created_ns = kvw__now_ns();
    atomic_fetch_add_explicit(&e->counters.created, 1, memory_order_relaxed);
    kvw__room_insert_locked(e, r);
    kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.bootstrap_timeout_ms));
    /* Appended: the control thread serves requests in creation order, so
     * decode asks for (and prefill writes) the oldest request first. */
    r->prev = e->reqs_tail;
    if (e->reqs_tail)
        e->reqs_tail->next = r;
    else
        e->reqs = r;
    e->reqs_tail = r;
    return r;
}

static void unlink_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    kvw__req_set_deadline_locked(r, 0);
    kvw__req_attach_locked(r, NULL);
    kvw__room_remove_locked(e, r);
    r->listed = false;
    if (r->prev)
        r->prev->next = r->next;
    else if (e->reqs == r)
        e->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else if (e->reqs_tail == r)
        e->reqs_tail = r->prev;
    r->prev = r->next = NULL;
}

void kvw__req_drop_locked(kvw_req_t *r)
{
    unlink_locked(r);
    kvw__req_unref(r);
}

void kvw__req_unref(kvw_req_t *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    r->engine->ops->free(r);
    free(r);
}

void kvw__req_unorphan_locked(kvw_req_t *r)
{
    if (!r->orphan)
        return;
    r->orphan = false;
    r->peer->orphans--;
    r->peer->orphan_bytes -= r->tx.num_pages * sizeof(uint64_t);
}

void kvw__req_attach_locked(kvw_req_t *r, kvw_peer_t *p)
{
    if (r->peer == p)
        return;
    if (r->peer) {
        kvw__req_unorphan_locked(r);
        r->peer->nreqs--;
    }
    r->peer = p;
    if (p)
        p->nreqs++;
}

void kvw__req_fail(kvw_req_t *r, kvw_status_t st, const char *fmt, ...)
{
    int s = atomic_load(&r->state);
    if (s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS ||
        (r->role == KVW_ROLE_DECODE && r->stage.staging_in))
        return;
    r->fail_status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->fail_reason, sizeof(r->fail_reason), fmt, ap);
    va_end(ap);
    /* Release: the reason is visible to whoever sees Failed. A sender's
     * move waits for a query of its producer's events under way (see
     * event_lock), so that none runs once the caller sees Failed. */
    bool events = r->role == KVW_ROLE_PREFILL;
    if (events)
        pthread_mutex_lock(&r->engine->event_lock);
    bool failed = atomic_compare_exchange_strong(&r->state, &s, KVW_POLL_FAILED);
    if (events)
        pthread_mutex_unlock(&r->engine->event_lock);
    if (failed) {
        atomic_fetch_add(&r->engine->counters.failed, 1);
        kvw__metrics_request_ended(r, false);
        KVW_INFO("room %llu failed: %s: %s", (unsigned long long)r->room, kvw_strerror(st),
                 r->fail_reason);
    }
    /* The poller retires it once none of its writes is in flight (at once
     * when none is), and only then may decode be told. */
    if (r->engine->ops->failed_locked)
        r->engine->ops->failed_locked(r);
}

bool kvw__req_succeed(kvw_req_t *r)
{
    int s = KVW_POLL_TRANSFERRING;
    if (!atomic_compare_exchange_strong(&r->state, &s, KVW_POLL_SUCCESS))
        return false;
    atomic_fetch_add(&r->engine->counters.ok, 1);
    kvw__metrics_request_ended(r, true);
    KVW_DEBUG("room %llu: Success", (unsigned long long)r->room);
    return true;
}

bool kvw__req_ended(const kvw_req_t *r)
{
    int s = atomic_load(&r->state);
    return s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS;
}

bool kvw__members_live(kvw_req_t *const *m, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!kvw__req_ended(m[i]))
            return true;
    return false;
}

void kvw__set_fail_locked(kvw_set_fate_t *f, kvw_status_t st, const char *fmt, ...)
{
    if (f->failed)
        return;
    f->failed = true;
    f->status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->reason, sizeof(f->reason), fmt, ap);
    va_end(ap);
}

kvw_status_t kvw__set_failure(kvw_engine_t *e, kvw_poll_t state, const kvw_set_fate_t *f,
                              const char **reason_p)
{
    if (state != KVW_POLL_FAILED)
        return KVW_OK;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = f->failed ? f->status : KVW_ERR_ABORTED;
    pthread_mutex_unlock(&e->lock);
    if (reason_p)
        *reason_p = f->reason;
    return st;
}

void kvw__req_drained(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    r->tx.drained = true;
    if (r->tx.notify_failure || r->user_gone || r->tx.digest_due)
        kvw__req_touch_locked(r);
    pthread_mutex_unlock(&e->lock);
}

kvw_status_t kvw__req_failure(const kvw_req_t *r, const char **reason_p)
{
    if (atomic_load(&r->state) != KVW_POLL_FAILED)
        return KVW_OK;
    if (reason_p)
        *reason_p = r->fail_reason;
    return r->fail_status;
}

/* (lock) A request whose handle is gone stays on the list only while the
 * other side may still need an answer about it: a failed sender that decode
 * may yet ask for, or one whose failure decode has not been told; a receiver
 * whose ABORT is not sent. The control thread drops it afterwards. A
 * receiver still Transferring (destroy gave up waiting for its abort) stays
 * until it ends (its connection's death, at the latest): prefill may still
 * write its pages, so its staging slots are not given to another. */
void kvw__req_release_handle_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    r->has_user = false;
    r->user_gone = true;
    if (r->role == KVW_ROLE_DECODE && atomic_load(&r->state) == KVW_POLL_TRANSFERRING) {
        kvw__req_touch_locked(r);
        return;
    }
    if (r->engine->ops->answer_owed_locked(r)) {
        kvw__req_set_deadline_locked(r, kvw__now_ns() + kvw__ms_ns(e->cfg.bootstrap_timeout_ms));
        kvw__req_touch_locked(r);
        return;
    }
    kvw__req_drop_locked(r);
}

/* Index of the first page >= limit, or n when all fit. */
size_t kvw__first_out_of_range(const uint64_t *pages, size_t n, uint64_t limit)
{
    size_t i = 0;
    while (i < n && pages[i] < limit)
        i++;
    return i;
}

kvw_status_t kvw__check_count(const kvw_engine_t *e, int kind, size_t n, char *why, size_t size)
{
    uint64_t max = e->local_max[kind];
    if (n <= max && n <= KVW_WIRE_MAX_PAGES)
        return KVW_OK;
    snprintf(why, size, "%zu %s indices exceed the %llu the regions hold", n,
             kvw__layout_kind_name((uint32_t)kind), (unsigned long long)max);
    return KVW_ERR_OUT_OF_RANGE;
}

kvw_status_t kvw__check_aux(const kvw_engine_t *e, uint32_t aux_index, char *why, size_t size)
{
    uint64_t max = e->local_max[KVW_LAYOUT_AUX];
    if (aux_index == KVW_NO_AUX || aux_index < max)
        return KVW_OK;
    snprintf(why, size, "aux index %u outside the aux regions (%llu items)", aux_index,
             (unsigned long long)max);
    return KVW_ERR_OUT_OF_RANGE;
}

kvw_status_t kvw__check_indices(const kvw_engine_t *e, int kind, const char *side,
                                const uint64_t *idx, size_t n, char *why, size_t size)
{
    uint64_t max = e->local_max[kind];
    size_t bad = kvw__first_out_of_range(idx, n, max);
    if (bad == n)
        return KVW_OK;
    snprintf(why, size, "%s %s %llu (index %zu) outside the registered regions (%llu items)", side,
             kind == KVW_LAYOUT_KV ? "page" : "state index", (unsigned long long)idx[bad], bad,
             (unsigned long long)max);
    return KVW_ERR_OUT_OF_RANGE;
}

size_t kvw__state_off(const uint32_t *counts, uint32_t s)
{
    size_t off = 0;
    for (uint32_t i = 0; i < s; i++)
        off += counts[i];
    return off;
}

/* Which list each state group takes (-1: the shared one); KVW_ERR_INVALID
 * for a list naming no state group, or a group twice. */
static kvw_status_t pick_lists(const kvw_layout_t *l, const kvw_state_list_t *lists, size_t n,
                               int pick[KVW_LAYOUT_MAX_GROUPS], char *why, size_t size)
{
    for (uint32_t s = 0; s < l->num_state_groups; s++)
        pick[s] = -1;
    for (size_t i = 0; i < n; i++) {
        int s = lists[i].group < l->num_groups ? kvw__layout_state_index(l, lists[i].group) : -1;
        if (s < 0 || pick[s] >= 0 || (lists[i].count && !lists[i].indices) || lists[i].reserved) {
            snprintf(why, size, "state list %zu (group %u): %s", i, lists[i].group,
                     s < 0          ? "not a state group"
                     : pick[s] >= 0 ? "the group is listed twice"
                                    : "bad list (NULL indices or reserved not 0)");
            return KVW_ERR_INVALID;
        }
        pick[s] = (int)i;
    }
    return KVW_OK;
}

kvw_status_t kvw__state_lists(const kvw_engine_t *e, const char *side, const uint64_t *shared,
                              size_t num_shared, const kvw_state_list_t *lists, size_t num_lists,
                              size_t prefix, uint64_t **out_p, uint32_t **counts_p, size_t *total_p,
                              char *why, size_t size)
{
    const kvw_layout_t *l = &e->layout;
    int pick[KVW_LAYOUT_MAX_GROUPS];
    *out_p = NULL;
    *counts_p = NULL;
    *total_p = 0;
    if ((num_lists && !lists) || (num_shared && !shared)) {
        snprintf(why, size, "NULL state indices");
        return KVW_ERR_INVALID;
    }
    if ((num_shared || num_lists) && !l->num_state_groups) {
        snprintf(why, size, "%zu state indices, but the layout has no state group",
                 num_shared + num_lists);
        return KVW_ERR_INVALID;
    }
    kvw_status_t st = pick_lists(l, lists, num_lists, pick, why, size);
    uint64_t total = 0;
    for (uint32_t s = 0; !st && s < l->num_state_groups; s++) {
        const uint64_t *v = pick[s] < 0 ? shared : lists[pick[s]].indices;
        size_t n = pick[s] < 0 ? num_shared : lists[pick[s]].count;
        size_t bad = kvw__first_out_of_range(v, n, e->state_max[s]);
        if (bad < n) {
            snprintf(why, size,
                     "%s state index %llu (index %zu) of group %u outside its regions (%llu items)",
                     side, (unsigned long long)v[bad], bad, l->state_group[s],
                     (unsigned long long)e->state_max[s]);
            st = KVW_ERR_OUT_OF_RANGE;
        }
        total += n;
    }
    if (!st && prefix + total > KVW_WIRE_MAX_PAGES) {
        snprintf(why, size, "%zu pages and %llu state indices: at most %u together", prefix,
                 (unsigned long long)total, KVW_WIRE_MAX_PAGES);
        st = KVW_ERR_OUT_OF_RANGE;
    }
    if (st)
        return st;
    uint64_t *out = prefix + total ? malloc((prefix + total) * sizeof(uint64_t)) : NULL;
    uint32_t *counts = l->num_state_groups ? calloc(l->num_state_groups, sizeof(uint32_t)) : NULL;
    if ((prefix + total && !out) || (l->num_state_groups && !counts)) {
        free(out);
        free(counts);
        snprintf(why, size, "no memory for the state lists");
        return KVW_ERR_NO_MEMORY;
    }
    size_t at = prefix;
    for (uint32_t s = 0; s < l->num_state_groups; s++) {
        const uint64_t *v = pick[s] < 0 ? shared : lists[pick[s]].indices;
        size_t n = pick[s] < 0 ? num_shared : lists[pick[s]].count;
        if (n)
            memcpy(out + at, v, n * sizeof(uint64_t));
        counts[s] = (uint32_t)n;
        at += n;
    }
    *out_p = out;
    *counts_p = counts;
    *total_p = (size_t)total;
    return KVW_OK;
}
