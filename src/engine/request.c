/* Senders and receivers: the public per-request API and the state changes
 * shared by the control and poller threads. */
#include "engine/engine.h"

#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kvw_sender {
    kvw_req_t req;
};
struct kvw_receiver {
    kvw_req_t req;
};

/* ------------------------------------------------------------ lifecycle */

static uint64_t ms_ns(uint32_t ms)
{
    return (uint64_t)ms * 1000000ull;
}

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
    r->aux_index = r->aux = KVW_NO_AUX;
    atomic_init(&r->state, KVW_POLL_BOOTSTRAPPING);
    atomic_init(&r->refs, 1); /* the engine list's reference */
    r->drained = true;        /* nothing posted yet */
    r->listed = true;
    kvw__room_insert_locked(e, r);
    kvw__req_set_deadline_locked(r, kvw__now_ns() + ms_ns(e->cfg.bootstrap_timeout_ms));
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
    free(r->src_pages);
    free(r->dst_pages);
    free(r->runs);
    free(r->pages);
    free(r);
}

void kvw__req_unorphan_locked(kvw_req_t *r)
{
    if (!r->orphan)
        return;
    r->orphan = false;
    r->peer->orphans--;
    r->peer->orphan_bytes -= r->num_pages * sizeof(uint64_t);
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
    if (s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS)
        return;
    r->fail_status = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->fail_reason, sizeof(r->fail_reason), fmt, ap);
    va_end(ap);
    /* Release: the reason is visible to whoever sees Failed. */
    if (atomic_compare_exchange_strong(&r->state, &s, KVW_POLL_FAILED)) {
        atomic_fetch_add(&r->engine->counters.failed, 1);
        KVW_INFO("room %llu failed: %s: %s", (unsigned long long)r->room, kvw_strerror(st),
                 r->fail_reason);
    }
}

bool kvw__req_succeed(kvw_req_t *r)
{
    int s = KVW_POLL_TRANSFERRING;
    if (!atomic_compare_exchange_strong(&r->state, &s, KVW_POLL_SUCCESS))
        return false;
    atomic_fetch_add(&r->engine->counters.ok, 1);
    return true;
}

static bool req_ended(const kvw_req_t *r)
{
    int s = atomic_load(&r->state);
    return s == KVW_POLL_FAILED || s == KVW_POLL_SUCCESS;
}

void kvw__req_drained(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    r->drained = true;
    if (r->notify_failure || r->user_gone)
        kvw__req_touch_locked(r);
    pthread_mutex_unlock(&e->lock);
}

static kvw_poll_t req_poll(const kvw_req_t *r)
{
    return (kvw_poll_t)atomic_load(&r->state);
}

static kvw_status_t req_failure(const kvw_req_t *r, const char **reason_p)
{
    if (atomic_load(&r->state) != KVW_POLL_FAILED)
        return KVW_OK;
    if (reason_p)
        *reason_p = r->fail_reason;
    return r->fail_status;
}

/* (lock) Give up a receiver whose request prefill does not have: nothing
 * can land, so it fails now, and prefill is told so that its sender fails
 * too instead of waiting for a request that never comes. */
static void receiver_fail_unsent_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    kvw__req_fail(r, st, "%s", why);
    r->request_due = false;
    r->abort_due = true;
    kvw__req_touch_locked(r);
}

/* (lock) Give up a receiver that has not ended. */
static void receiver_abort_locked(kvw_req_t *r, const char *why)
{
    if (r->aborting)
        return; /* already waiting for prefill's confirmation */
    if (r->request_sent)
        kvw__receiver_start_abort_locked(r, KVW_ERR_ABORTED, why);
    else
        receiver_fail_unsent_locked(r, KVW_ERR_ABORTED, why);
}

/* (lock) A request whose handle is gone stays on the list only while the
 * other side may still need an answer about it: a failed sender that decode
 * may yet ask for, or one whose failure decode has not been told; a receiver
 * whose ABORT is not sent. The control thread drops it afterwards. */
static void release_handle_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    r->has_user = false;
    r->user_gone = true;
    bool answer_owed =
        r->role == KVW_ROLE_PREFILL ? atomic_load(&r->state) == KVW_POLL_FAILED : r->abort_due;
    if (answer_owed) {
        kvw__req_set_deadline_locked(r, kvw__now_ns() + ms_ns(e->cfg.bootstrap_timeout_ms));
        kvw__req_touch_locked(r);
        return;
    }
    kvw__req_drop_locked(r);
}

static void sender_destroy(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    if (!req_ended(r))
        kvw__sender_fail_locked(r, KVW_ERR_ABORTED, "sender destroyed by the caller");
    release_handle_locked(r);
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it */
    kvw__req_unref(r);            /* the caller's */
}

/* Abort a receiver that has not ended and wait until it has: when this
 * returns no write of the request can land any more. The wait is bounded:
 * without prefill's confirmation the control thread kills the connection
 * after peer_timeout_ms, which fails the request. */
static void receiver_end(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    if (!req_ended(r))
        receiver_abort_locked(r, "receiver destroyed by the caller");
    pthread_mutex_unlock(&e->lock);
    uint64_t give_up = kvw__now_ns() + 2 * ms_ns(e->cfg.peer_timeout_ms) + ms_ns(1000);
    while (!req_ended(r) && kvw__now_ns() < give_up) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (!req_ended(r))
        KVW_ERROR("room %llu: receiver destroyed before its abort completed",
                  (unsigned long long)r->room);
}

static void receiver_destroy(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    receiver_end(r);
    pthread_mutex_lock(&e->lock);
    if (e->tokens[r->token & 0xffff] == r)
        e->tokens[r->token & 0xffff] = NULL;
    release_handle_locked(r);
    pthread_mutex_unlock(&e->lock);
    kvw__req_unref(r); /* the caller's */
}

/* Index of the first page >= limit, or n when all fit. */
static size_t first_out_of_range(const uint64_t *pages, size_t n, uint64_t limit)
{
    size_t i = 0;
    while (i < n && pages[i] < limit)
        i++;
    return i;
}

/* Checks of a request's pages against this engine's own regions, shared by
 * both roles: KVW_ERR_OUT_OF_RANGE with the reason in why, or KVW_OK. */
static kvw_status_t check_page_count(const kvw_engine_t *e, size_t n, char *why, size_t size)
{
    if (n <= e->local_max_pages && n <= KVW_WIRE_MAX_PAGES)
        return KVW_OK;
    snprintf(why, size, "%zu pages exceed the %llu the regions hold", n,
             (unsigned long long)e->local_max_pages);
    return KVW_ERR_OUT_OF_RANGE;
}

static kvw_status_t check_aux(const kvw_engine_t *e, uint32_t aux_index, char *why, size_t size)
{
    if (aux_index == KVW_NO_AUX || aux_index < e->local_max_aux)
        return KVW_OK;
    snprintf(why, size, "aux index %u outside the aux regions (%llu items)", aux_index,
             (unsigned long long)e->local_max_aux);
    return KVW_ERR_OUT_OF_RANGE;
}

/* side: "source" (prefill) or "destination" (decode). */
static kvw_status_t check_pages(const kvw_engine_t *e, const char *side, const uint64_t *pages,
                                size_t n, char *why, size_t size)
{
    size_t bad = first_out_of_range(pages, n, e->local_max_pages);
    if (bad == n)
        return KVW_OK;
    snprintf(why, size, "%s page %llu (index %zu) outside the registered regions (%llu pages)",
             side, (unsigned long long)pages[bad], bad, (unsigned long long)e->local_max_pages);
    return KVW_ERR_OUT_OF_RANGE;
}

/* --------------------------------------------------------------- sender */

kvw_status_t kvw__sender_fail_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    if (st != KVW_ERR_ABORTED)
        KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
    kvw__req_fail(r, st, "%s", why);
    if (r->have_dst) {
        /* Decode is waiting: tell it, but only once no write of ours can
         * still land in its pages (drained), so its Failed is final. */
        r->notify_failure = true;
        if (r->drained)
            kvw__req_touch_locked(r);
    }
    return st;
}

kvw_status_t kvw__sender_start_locked(kvw_req_t *r)
{
    kvw_engine_t *e = r->engine;
    r->runs = r->num_pages ? calloc(r->num_pages, sizeof(*r->runs)) : NULL;
    if (r->num_pages && !r->runs)
        return kvw__sender_fail_locked(r, KVW_ERR_NO_MEMORY, "no memory to plan the transfer");
    kvw_plan_t *p = &r->plan;
    p->num_runs = kvw__plan_runs(r->src_pages, r->dst_pages, r->num_pages, r->runs);
    p->runs = r->runs;
    p->regions = r->peer->regions;
    p->num_layers = e->num_layers;
    p->num_aux = e->num_aux;
    p->has_aux = r->aux_index != KVW_NO_AUX;
    p->aux_src = r->aux_index;
    p->aux_dst = r->dst_aux;
    p->max_msg = r->peer->max_msg_sz;
    r->writes_total = kvw__plan_count(p);
    int s = atomic_load(&r->state);
    if (s == KVW_POLL_FAILED)
        return r->fail_status;
    atomic_store(&r->state, KVW_POLL_TRANSFERRING);
    /* A watchdog, not the limit: the transfer clock starts at the first
     * post (first_post_ns), which the control thread checks then. */
    kvw__req_set_deadline_locked(r, kvw__now_ns() + ms_ns(e->cfg.transfer_timeout_ms));
    atomic_fetch_add(&r->refs, 1); /* the poller's, dropped when it retires r */
    r->drained = false;
    r->qnext = NULL;
    if (e->ready_tail)
        e->ready_tail->qnext = r;
    else
        e->ready_head = r;
    e->ready_tail = r;
    atomic_store(&e->ready_pending, true);
    kvw__wake(e->poller_wake_fd);
    return KVW_OK;
}

kvw_status_t kvw__sender_accept_request_locked(kvw_req_t *r, kvw_peer_t *peer, const kvw_msg_t *m,
                                               char *why, size_t size)
{
    uint32_t n = m->u.request.num_pages;
    size_t bad = first_out_of_range(m->u.request.pages, n, peer->remote_max_pages);
    if (bad < n) {
        snprintf(why, size,
                 "destination page %llu (index %zu) outside decode's regions "
                 "(%llu pages)",
                 (unsigned long long)m->u.request.pages[bad], bad,
                 (unsigned long long)peer->remote_max_pages);
        return KVW_ERR_OUT_OF_RANGE;
    }
    if (m->u.request.aux_index != KVW_NO_AUX && m->u.request.aux_index >= peer->remote_max_aux) {
        snprintf(why, size, "destination aux index %u outside decode's aux regions (%llu items)",
                 m->u.request.aux_index, (unsigned long long)peer->remote_max_aux);
        return KVW_ERR_OUT_OF_RANGE;
    }
    if (r->inited && (r->num_pages != n ||
                      (r->aux_index == KVW_NO_AUX) != (m->u.request.aux_index == KVW_NO_AUX))) {
        snprintf(why, size, "decode asks for %u pages%s, prefill sends %zu%s", n,
                 m->u.request.aux_index == KVW_NO_AUX ? "" : " + aux", r->num_pages,
                 r->aux_index == KVW_NO_AUX ? "" : " + aux");
        return KVW_ERR_MISMATCH;
    }
    r->dst_pages = n ? malloc((size_t)n * sizeof(uint64_t)) : NULL;
    if (n && !r->dst_pages)
        return KVW_ERR_NO_MEMORY;
    if (n)
        memcpy(r->dst_pages, m->u.request.pages, (size_t)n * sizeof(uint64_t));
    r->dst_aux = m->u.request.aux_index;
    r->token = m->u.request.token;
    kvw__req_attach_locked(r, peer);
    r->have_dst = true;
    if (!r->inited)
        r->num_pages = n;
    if (atomic_load(&r->state) == KVW_POLL_BOOTSTRAPPING && !r->have_src)
        atomic_store(&r->state, KVW_POLL_WAITING_FOR_INPUT);
    if (r->has_user)
        kvw__req_set_deadline_locked(r, 0); /* waiting for prefill's own compute has no limit */
    return r->have_src ? kvw__sender_start_locked(r) : KVW_OK;
}

kvw_status_t kvw_sender_create(kvw_engine_t *e, uint64_t room, kvw_sender_t **sender_p)
{
    if (!e || !sender_p || e->role != KVW_ROLE_PREFILL)
        return KVW_ERR_INVALID;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_PREFILL, room);
    kvw_status_t st = KVW_OK;
    if (r && r->user_gone && r->drained && !r->notify_failure) {
        kvw__req_drop_locked(r); /* a destroyed sender's tombstone: the room is new */
        r = NULL;
    }
    if (r && r->has_user) {
        st = KVW_ERR_EXISTS; /* a live sender already owns this room */
    } else if (!r && !(r = kvw__req_new_locked(e, KVW_ROLE_PREFILL, room))) {
        st = KVW_ERR_NO_MEMORY;
    }
    if (!st) {
        r->has_user = true; /* adopt a request decode sent ahead of us, if any */
        if (r->orphan) {
            kvw__req_unorphan_locked(r);
            kvw__req_set_deadline_locked(r, 0); /* waiting for our compute has no limit */
        }
        atomic_fetch_add(&r->refs, 1);
    }
    pthread_mutex_unlock(&e->lock);
    if (!st)
        *sender_p = (kvw_sender_t *)r;
    return st;
}

kvw_status_t kvw_sender_init(kvw_sender_t *s, size_t num_pages, uint32_t aux_index)
{
    if (!s)
        return KVW_ERR_INVALID;
    kvw_req_t *r = &s->req;
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    kvw_status_t st = KVW_OK;
    pthread_mutex_lock(&e->lock);
    if (r->inited || atomic_load(&r->state) == KVW_POLL_FAILED) {
        st = KVW_ERR_STATE;
    } else if ((st = check_page_count(e, num_pages, why, sizeof(why))) ||
               (st = check_aux(e, aux_index, why, sizeof(why)))) {
        kvw__sender_fail_locked(r, st, why);
    } else if (r->have_dst && (r->num_pages != num_pages ||
                               (aux_index == KVW_NO_AUX) != (r->dst_aux == KVW_NO_AUX))) {
        snprintf(why, sizeof(why), "prefill sends %zu pages%s, decode asked for %zu%s", num_pages,
                 aux_index == KVW_NO_AUX ? "" : " + aux", r->num_pages,
                 r->dst_aux == KVW_NO_AUX ? "" : " + aux");
        st = kvw__sender_fail_locked(r, KVW_ERR_MISMATCH, why);
    } else {
        r->inited = true;
        r->num_pages = num_pages;
        r->aux_index = aux_index;
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_status_t kvw_sender_send(kvw_sender_t *s, const uint64_t *pages, size_t n)
{
    if (!s || (n && !pages))
        return KVW_ERR_INVALID;
    kvw_req_t *r = &s->req;
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    kvw_status_t st = KVW_OK;
    pthread_mutex_lock(&e->lock);
    if (!r->inited || r->have_src || atomic_load(&r->state) == KVW_POLL_FAILED) {
        st = KVW_ERR_STATE;
        goto out;
    }
    if (n != r->num_pages) {
        snprintf(why, sizeof(why), "send() got %zu pages, init() declared %zu", n, r->num_pages);
        st = kvw__sender_fail_locked(r, KVW_ERR_MISMATCH, why);
        goto out;
    }
    if ((st = check_pages(e, "source", pages, n, why, sizeof(why)))) {
        kvw__sender_fail_locked(r, st, why);
        goto out;
    }
    r->src_pages = n ? malloc(n * sizeof(uint64_t)) : NULL;
    if (n && !r->src_pages) {
        st = kvw__sender_fail_locked(r, KVW_ERR_NO_MEMORY, "no memory for the page list");
        goto out;
    }
    if (n)
        memcpy(r->src_pages, pages, n * sizeof(uint64_t));
    r->have_src = true;
    if (r->have_dst)
        st = kvw__sender_start_locked(r);
out:
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_poll_t kvw_sender_poll(const kvw_sender_t *s)
{
    return req_poll(&s->req);
}

kvw_status_t kvw_sender_failure(const kvw_sender_t *s, const char **reason_p)
{
    return req_failure(&s->req, reason_p);
}

kvw_status_t kvw_sender_abort(kvw_sender_t *s)
{
    if (!s)
        return KVW_ERR_INVALID;
    kvw_req_t *r = &s->req;
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = req_ended(r) ? KVW_ERR_STATE : KVW_OK;
    if (!st)
        kvw__sender_fail_locked(r, KVW_ERR_ABORTED, "aborted by prefill");
    pthread_mutex_unlock(&e->lock);
    kvw__wake(e->poller_wake_fd); /* stop feeding it now, not at the next completion */
    return st;
}

void kvw_sender_destroy(kvw_sender_t *s)
{
    if (s)
        sender_destroy(&s->req);
}

/* ------------------------------------------------------------- receiver */

kvw_req_t *kvw__token_lookup_locked(kvw_engine_t *e, uint32_t token)
{
    kvw_req_t *r = e->tokens[token & 0xffff];
    return r && r->token == token ? r : NULL;
}

static kvw_status_t token_alloc_locked(kvw_engine_t *e, kvw_req_t *r)
{
    uint32_t slots = 1u << KVW_TOKEN_BITS;
    for (uint32_t i = 0; i < slots; i++) {
        uint32_t slot = (e->token_hint + i) & (slots - 1);
        if (!e->tokens[slot]) {
            /* The generation makes a late immediate for a reused slot miss. */
            uint16_t gen = ++e->token_gen[slot];
            r->token = ((uint32_t)gen << 16) | slot;
            e->tokens[slot] = r;
            e->token_hint = slot + 1;
            return KVW_OK;
        }
    }
    KVW_ERROR("more than %u receivers in flight on one engine", slots);
    return KVW_ERR_NO_MEMORY;
}

kvw_status_t kvw_receiver_create(kvw_engine_t *e, const char *bootstrap_addr, uint32_t prefill_rank,
                                 uint64_t room, kvw_receiver_t **recv_p)
{
    if (!e || !recv_p || !bootstrap_addr || e->role != KVW_ROLE_DECODE ||
        strlen(bootstrap_addr) >= KVW_WIRE_ENDPOINT_MAX - 6)
        return KVW_ERR_INVALID;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = KVW_OK;
    kvw_req_t *r = kvw__req_find_locked(e, KVW_ROLE_DECODE, room);
    if (r) {
        st = KVW_ERR_EXISTS;
    } else if (!(r = kvw__req_new_locked(e, KVW_ROLE_DECODE, room))) {
        st = KVW_ERR_NO_MEMORY;
    } else if ((st = token_alloc_locked(e, r))) {
        kvw__req_drop_locked(r);
    } else {
        r->has_user = true;
        atomic_fetch_add(&r->refs, 1);
        r->prefill_rank = prefill_rank;
        snprintf(r->bootstrap_addr, sizeof(r->bootstrap_addr), "%s", bootstrap_addr);
        kvw__req_touch_locked(r); /* attach it to a peer */
    }
    pthread_mutex_unlock(&e->lock);
    if (!st)
        *recv_p = (kvw_receiver_t *)r;
    return st;
}

kvw_status_t kvw_receiver_init(kvw_receiver_t *rc, const uint64_t *pages, size_t n,
                               uint32_t aux_index)
{
    if (!rc || (n && !pages))
        return KVW_ERR_INVALID;
    kvw_req_t *r = &rc->req;
    kvw_engine_t *e = r->engine;
    char why[KVW_WIRE_REASON_MAX];
    kvw_status_t st = check_page_count(e, n, why, sizeof(why));
    if (!st)
        st = check_pages(e, "destination", pages, n, why, sizeof(why));
    if (!st)
        st = check_aux(e, aux_index, why, sizeof(why));
    uint64_t *copy = NULL;
    if (!st && n && !(copy = malloc(n * sizeof(uint64_t)))) {
        snprintf(why, sizeof(why), "no memory for the page list");
        st = KVW_ERR_NO_MEMORY;
    }
    if (copy)
        memcpy(copy, pages, n * sizeof(uint64_t));
    pthread_mutex_lock(&e->lock);
    if (r->pages || r->request_due || r->request_sent || req_ended(r)) {
        free(copy);
        pthread_mutex_unlock(&e->lock);
        return KVW_ERR_STATE;
    }
    if (st) {
        KVW_ERROR("room %llu: %s", (unsigned long long)r->room, why);
        receiver_fail_unsent_locked(r, st, why);
    } else {
        r->pages = copy;
        r->npages = n;
        r->aux = aux_index;
        r->request_due = true;
        kvw__req_touch_locked(r);
    }
    pthread_mutex_unlock(&e->lock);
    return st;
}

void kvw__receiver_start_abort_locked(kvw_req_t *r, kvw_status_t st, const char *why)
{
    kvw_engine_t *e = r->engine;
    r->aborting = true;
    r->abort_status = st;
    snprintf(r->abort_reason, sizeof(r->abort_reason), "%s", why);
    r->abort_due = true;
    kvw__req_set_deadline_locked(r, kvw__now_ns() + ms_ns(e->cfg.peer_timeout_ms));
    KVW_INFO("room %llu: aborting: %s", (unsigned long long)r->room, why);
    kvw__req_touch_locked(r);
}

kvw_status_t kvw_receiver_abort(kvw_receiver_t *rc)
{
    if (!rc)
        return KVW_ERR_INVALID;
    kvw_req_t *r = &rc->req;
    kvw_engine_t *e = r->engine;
    pthread_mutex_lock(&e->lock);
    kvw_status_t st = req_ended(r) ? KVW_ERR_STATE : KVW_OK;
    if (!st)
        receiver_abort_locked(r, "aborted by the caller");
    pthread_mutex_unlock(&e->lock);
    return st;
}

kvw_poll_t kvw_receiver_poll(const kvw_receiver_t *rc)
{
    return req_poll(&rc->req);
}

kvw_status_t kvw_receiver_failure(const kvw_receiver_t *rc, const char **reason_p)
{
    return req_failure(&rc->req, reason_p);
}

void kvw_receiver_destroy(kvw_receiver_t *rc)
{
    if (rc)
        receiver_destroy(&rc->req);
}
