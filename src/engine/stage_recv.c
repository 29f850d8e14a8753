/* SPDX-License-Identifier: Apache-2.0 */
/* The stager's decode half (engine/stager.h): receivers' page slots in
 * the pool, taken in order of arrival, and the copy of a landed request
 * from its slots to the GPU pages, which ends it. */
#include "engine/stager_int.h"
#include "engine/verify.h"

#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- decode: slots -------------------------------------------------------------- */

/* Slots of each kind a receiver needs. */
static void slots_needed(const kvw_stager_t *st, const kvw_req_t *r, uint64_t need[3])
{
    need[KVW_LAYOUT_KV] = st->kind[KVW_LAYOUT_KV] ? r->rx.npages : 0;
    need[KVW_LAYOUT_STATE] = st->kind[KVW_LAYOUT_STATE] ? r->rx.nstate : 0;
    need[KVW_LAYOUT_AUX] = st->kind[KVW_LAYOUT_AUX] && r->rx.aux != KVW_NO_AUX ? 1 : 0;
}

/* Where a kind's indices sit in r->stage.slots. */
static uint64_t *slots_of(kvw_req_t *r, int kind)
{
    return kind == KVW_LAYOUT_KV      ? r->stage.slots
           : kind == KVW_LAYOUT_STATE ? r->stage.slots + r->rx.npages
                                      : r->stage.slots + r->rx.npages + r->rx.nstate;
}

/* Take every slot r needs, or none. */
static bool take_slots(kvw_stager_t *st, kvw_req_t *r)
{
    uint64_t need[3];
    slots_needed(st, r, need);
    pthread_mutex_lock(&st->lock);
    bool fits = true;
    for (int k = 0; k < 3; k++)
        fits &= need[k] <= st->nfree_slots[k];
    for (int k = 0; fits && k < 3; k++) {
        uint64_t *out = slots_of(r, k);
        for (uint64_t i = 0; i < need[k]; i++)
            out[i] = st->free_slots[k][--st->nfree_slots[k]];
    }
    r->stage.slots_held = fits;
    pthread_mutex_unlock(&st->lock);
    return fits;
}

void kvw__stager_unreserve(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    if (!st)
        return;
    uint64_t need[3];
    /* Only once nothing can write them: no copy-in reads them, and prefill
     * never had the request or it ended (Failed means that none of its
     * writes can land any more; Success, that all did). A receiver still
     * Transferring keeps them, even destroyed (receiver_end gave up). */
    bool writable = atomic_load(&r->state) == KVW_POLL_TRANSFERRING;
    pthread_mutex_lock(&st->lock);
    if (r->stage.slots_held && !r->stage.staging_in && !writable) {
        slots_needed(st, r, need);
        /* Pushed back in reverse, so the next taker gets them in order. */
        for (int k = 0; k < 3; k++) {
            const uint64_t *in = slots_of(r, k);
            for (uint64_t i = need[k]; i-- > 0;)
                st->free_slots[k][st->nfree_slots[k]++] = (uint32_t)in[i];
        }
        r->stage.slots_held = false;
        st->slots_freed = true;
        pthread_cond_broadcast(&st->cond);
    }
    pthread_mutex_unlock(&st->lock);
}

kvw_status_t kvw__stager_reserve_locked(kvw_req_t *r, bool *ready, char *why, size_t size)
{
    kvw_stager_t *st = r->engine->stager;
    static const char *const kinds[3] = {"page", "aux", "state"};
    uint64_t need[3];
    slots_needed(st, r, need);
    for (int k = 0; k < 3; k++)
        if (need[k] > st->slots) {
            snprintf(why, size,
                     "the request needs %llu staging slots for %s indices; the pool "
                     "(KVW_STAGING_MIB=%u) holds %llu",
                     (unsigned long long)need[k], kinds[k], r->engine->cfg.staging_mib,
                     (unsigned long long)st->slots);
            return KVW_ERR_LIMIT;
        }
    /* Unstaged kinds keep their own indices; the aux slot follows the state. */
    size_t n = r->rx.npages + r->rx.nstate;
    r->stage.slots = malloc((n + 1) * sizeof(uint64_t));
    if (!r->stage.slots) {
        snprintf(why, size, "no memory for the staging slots");
        return KVW_ERR_NO_MEMORY;
    }
    if (n)
        memcpy(r->stage.slots, r->rx.pages, n * sizeof(uint64_t));
    r->stage.slots[n] = r->rx.aux;
    *ready = !st->wait_head && take_slots(st, r);
    if (!*ready) { /* in order: a large request is not overtaken forever */
        kvw__stage_queue_req(&st->wait_head, &st->wait_tail, r);
        r->stage.waiting = true;
    }
    return KVW_OK;
}

void kvw__stager_waiter_left_locked(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    /* grant_waiters drops ended receivers from the head of the queue and
     * serves the ones behind them. */
    pthread_mutex_lock(&st->lock);
    st->slots_freed = true;
    pthread_cond_broadcast(&st->cond);
    pthread_mutex_unlock(&st->lock);
}

/* Stager thread: give freed slots to the receivers waiting, in order. */
void kvw__stage_grant_waiters(kvw_stager_t *st)
{
    kvw_engine_t *e = st->e;
    kvw_req_t *done = NULL, *r;
    pthread_mutex_lock(&e->lock);
    while ((r = st->wait_head) && (kvw__req_ended(r) || take_slots(st, r))) {
        st->wait_head = r->stage.snext;
        if (!st->wait_head)
            st->wait_tail = NULL;
        r->stage.waiting = false;
        if (!kvw__req_ended(r)) {
            r->rx.request_due = true;
            kvw__req_touch_locked(r);
        }
        r->stage.snext = done;
        done = r;
    }
    pthread_mutex_unlock(&e->lock);
    while ((r = done)) {
        done = r->stage.snext;
        kvw__req_unref(r);
    }
}

void kvw__stager_landed_locked(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    pthread_mutex_lock(&st->lock);
    r->stage.staging_in = true; /* under both locks (core.h) */
    kvw__stage_push_job_locked(st, r);
    pthread_mutex_unlock(&st->lock);
}

bool kvw__stager_copying(kvw_req_t *r)
{
    kvw_stager_t *st = r->engine->stager;
    if (!st)
        return false;
    pthread_mutex_lock(&st->lock);
    bool copying = r->stage.staging_in;
    pthread_mutex_unlock(&st->lock);
    return copying;
}

/* (lock) r's copy to the GPU is over (or will never start): from here on
 * r may end, and failures count again. */
void kvw__stage_copy_in_over_locked(kvw_stager_t *st, kvw_req_t *r)
{
    pthread_mutex_lock(&st->lock);
    r->stage.staging_in = false;
    pthread_mutex_unlock(&st->lock);
}

static void copy_in_runs(copy_arg_t *a, kvw_req_t *r, uint32_t k, int kind)
{
    const kvw_stager_t *st = a->st;
    uint64_t item = st->e->regions[k].item_len;
    uint64_t aux = r->rx.aux;
    const uint64_t *dst = kind == KVW_LAYOUT_KV      ? r->rx.pages
                          : kind == KVW_LAYOUT_STATE ? r->rx.pages + r->rx.npages
                                                     : &aux;
    const uint64_t *slot = slots_of(r, kind);
    size_t count = kind == KVW_LAYOUT_KV ? r->rx.npages : 1;
    if (kind == KVW_LAYOUT_STATE) { /* region k's group's own list, and its slots */
        uint32_t g = (uint32_t)kvw__layout_state_of_region(&st->e->layout, k);
        size_t off = kvw__state_off(r->rx.state_n, g);
        dst += off;
        slot += off;
        count = r->rx.state_n[g];
    }
    uint8_t *shadow = st->pool->base + st->region_off[k];
    /* Runs consecutive on both sides: one copy each. */
    for (size_t i = 0; i < count && !a->err;) {
        size_t run = 1;
        while (i + run < count && dst[i + run] == dst[i] + run && slot[i + run] == slot[i] + run)
            run++;
        kvw__stage_copy_runs(a, k, &dst[i], run, shadow + slot[i] * item, true);
        i += run;
    }
}

/* (lock) Verified r is on the GPU: Success once prefill's digest came and
 * agrees. Landing cleared its transfer deadline (the copy is local); the
 * wait for the DIGEST is bounded again, by what was left of it. */
static void verify_copied_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t digest)
{
    kvw__verify_landed_locked(r, r->rx.verify == KVW_VERIFY_KVWIRE, digest);
    if (!kvw__req_ended(r)) {
        uint64_t now = kvw__now_ns(), end = r->rx.sent_ns + kvw__ms_ns(e->cfg.transfer_timeout_ms);
        kvw__req_set_deadline_locked(r, end > now ? end : now + 1);
    }
}

/* The request landed in its slots: copy them to the GPU pages, then end it. */
void kvw__stage_copy_in(kvw_stager_t *st, kvw_req_t *r)
{
    kvw_engine_t *e = st->e;
    const kvw_layout_t *l = &e->layout;
    copy_arg_t a = {.st = st, .r = r, .lane = 0};
    /* Verified: the digest of what landed in the slots, before they are
     * copied (the copy leaves them as they are; this is what the NIC
     * wrote). */
    uint64_t digest = r->rx.verify == KVW_VERIFY_KVWIRE ? kvw__verify_landed(e, r) : 0;
    if (st->kind[KVW_LAYOUT_KV])
        for (uint32_t i = 0; i < l->kv_layers * l->kv_per_layer; i++)
            copy_in_runs(&a, r, l->kv_slots[i], KVW_LAYOUT_KV);
    if (st->kind[KVW_LAYOUT_STATE])
        for (uint32_t i = 0; i < l->num_state; i++)
            copy_in_runs(&a, r, l->state_slots[i], KVW_LAYOUT_STATE);
    if (st->kind[KVW_LAYOUT_AUX] && r->rx.aux != KVW_NO_AUX)
        for (uint32_t i = 0; i < l->num_aux; i++)
            copy_in_runs(&a, r, l->aux_slots[i], KVW_LAYOUT_AUX);
    char why[200] = "";
    kvw_status_t err = kvw__staging_wait(st->pool, 0, why, sizeof(why));
    if (a.err)
        err = a.err;
    /* Every copy is done: r ends now, and only now. Failures that came
     * meanwhile were ignored (kvw__req_fail): all of r had landed. Only
     * decode's own abort (or destroy) stands, as promised to its caller. */
    pthread_mutex_lock(&e->lock);
    kvw__stage_copy_in_over_locked(st, r);
    if (err)
        kvw__req_fail(r, KVW_ERR_TRANSFER,
                      "the data landed but copying it from the staging pool to the GPU failed: %s",
                      a.err ? a.why : why);
    else if (r->rx.aborting)
        kvw__req_fail(r, r->rx.abort_status, "%s", r->rx.abort_reason);
    else if (r->rx.verify)
        verify_copied_locked(e, r, digest);
    else if (kvw__req_succeed(r))
        kvw__req_set_deadline_locked(r, 0);
    pthread_mutex_unlock(&e->lock);
    kvw__stager_unreserve(r); /* nothing lands after the immediate */
}

/* Decode: the pool as slots; every region of a staged kind advertises its
 * slots in place of its memory. */
kvw_status_t kvw__stage_setup_slots(kvw_stager_t *st)
{
    kvw_engine_t *e = st->e;
    uint32_t n = e->layout.num_regions;
    uint64_t per_slot = 0;
    for (uint32_t i = 0; i < n; i++)
        if (st->kind[kvw__stage_region_kind(&e->layout, i)])
            per_slot += e->regions[i].item_len;
    st->slots = per_slot ? st->pool->len / per_slot : 0;
    if (!st->slots || st->slots > UINT32_MAX) {
        KVW_ERROR("staging: the pool (KVW_STAGING_MIB=%u) %s", e->cfg.staging_mib,
                  st->slots ? "holds more slots than kvwire counts" : "cannot hold one page");
        return KVW_ERR_INVALID;
    }
    st->region_off = calloc(n, sizeof(uint64_t));
    for (int k = 0; k < 3; k++)
        if (!(st->free_slots[k] = calloc(st->kind[k] ? st->slots : 1, sizeof(uint32_t))))
            return KVW_ERR_NO_MEMORY;
    if (!st->region_off)
        return KVW_ERR_NO_MEMORY;
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!st->kind[kvw__stage_region_kind(&e->layout, i)])
            continue;
        st->region_off[i] = off;
        kvw_mr_t *m = &e->mrs[i];
        m->addr = (uint64_t)(uintptr_t)(st->pool->base + off);
        m->len = st->slots * e->regions[i].item_len;
        m->lkey = st->pool->lkey;
        m->rkey = st->pool->rkey;
        off += m->len;
    }
    for (int k = 0; k < 3; k++)
        for (uint64_t i = 0; st->kind[k] && i < st->slots; i++) /* slot 0 on top */
            st->free_slots[k][st->nfree_slots[k]++] = (uint32_t)(st->slots - 1 - i);
    KVW_INFO("staging: %llu page slots for decode's GPU regions", (unsigned long long)st->slots);
    return KVW_OK;
}
