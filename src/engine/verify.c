/* SPDX-License-Identifier: Apache-2.0 */
/* Verified transfers: the digest of a request's items on both sides, and
 * decode's decision (engine/verify.h). */
#include "engine/verify.h"

#include "common/crc32c.h"
#include "common/log.h"

#include <stdio.h>
#include <string.h>

void (*_Atomic kvw__verify_hook)(uint64_t room);

uint8_t kvw__verify_mode(const kvw_engine_t *e)
{
    if (!e->cfg.verify)
        return KVW_VERIFY_OFF;
    /* Directly registered GPU memory needs a kernel to read: the caller's. */
    for (uint32_t i = 0; i < e->layout.num_regions; i++)
        if (e->mrs[i].path == KVW_MEM_PATH_DMABUF || e->mrs[i].path == KVW_MEM_PATH_PEERMEM)
            return KVW_VERIFY_CALLER;
    return KVW_VERIFY_KVWIRE;
}

uint64_t kvw__verify_item(uint32_t region, uint64_t index, const void *addr, uint64_t len)
{
    uint8_t key[12];
    for (int i = 0; i < 4; i++)
        key[i] = (uint8_t)(region >> 8 * i);
    for (int i = 0; i < 8; i++)
        key[4 + i] = (uint8_t)(index >> 8 * i);
    return kvw__crc32c(kvw__crc32c(0, key, sizeof(key)), addr, (size_t)len);
}

/* ---- prefill ---------------------------------------------------------------- */

kvw_status_t kvw__verify_accept_locked(kvw_req_t *r, const kvw_peer_t *p, const kvw_msg_t *m,
                                       char *why, size_t size)
{
    const kvw_engine_t *e = r->engine;
    bool asked = m->u.request.heads_flags & KVW_WIRE_REQ_VERIFY;
    if (asked != (e->verify_mode != KVW_VERIFY_OFF)) {
        snprintf(why, size, "%s verifies the bytes (KVW_VERIFY=1) and %s does not: both or neither",
                 asked ? "decode" : "prefill", asked ? "prefill" : "decode");
        return KVW_ERR_MISMATCH;
    }
    if (asked && (p->sliced || m->u.request.heads_flags & KVW_WIRE_HEADS_RANGE)) {
        snprintf(why, size, "verify (KVW_VERIFY=1) is not supported with head slicing");
        return KVW_ERR_UNSUPPORTED;
    }
    r->tx.verify = r->tx.digest_due = asked;
    r->tx.caller_digest = e->verify_mode == KVW_VERIFY_CALLER;
    return KVW_OK;
}

/* The items of one region over runs: source item run.src + c (in the
 * plan's local memory) lands as decode's item run.dst + c. */
static uint64_t runs_sum(const kvw_plan_region_t *g, uint32_t k, const kvw_run_t *runs, size_t n)
{
    const uint8_t *base = (const uint8_t *)(uintptr_t)g->local_addr;
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i++)
        for (uint64_t c = 0; c < runs[i].count; c++)
            sum += kvw__verify_item(k, runs[i].dst + c, base + (runs[i].src + c) * g->item_len,
                                    g->item_len);
    return sum;
}

void kvw__verify_seg(kvw_req_t *r, kvw_seg_t *s)
{
    const kvw_plan_t *p = &s->plan;
    uint64_t sum = 0;
    for (uint32_t l = p->layer_begin; l < p->layer_end; l++)
        for (uint32_t j = 0; j < p->kv_per_layer; j++) {
            uint32_t k = p->kv_slots[(size_t)l * p->kv_per_layer + j];
            sum += runs_sum(&p->regions[k], k, p->runs, p->num_runs);
        }
    for (uint32_t t = 0; t < p->num_state_sets; t++) {
        const kvw_plan_set_t *set = &p->state_sets[t];
        for (uint32_t j = 0; j < set->num_slots; j++)
            sum += runs_sum(&p->regions[set->slots[j]], set->slots[j], set->runs, set->num_runs);
    }
    for (uint32_t i = 0; p->has_aux && i < p->num_aux; i++) {
        const kvw_plan_region_t *g = &p->regions[p->aux_slots[i]];
        const uint8_t *base = (const uint8_t *)(uintptr_t)g->local_addr;
        sum += kvw__verify_item(p->aux_slots[i], p->aux_dst, base + p->aux_src * g->item_len,
                                g->item_len);
    }
    atomic_fetch_add_explicit(&r->tx.digest, sum, memory_order_relaxed);
    s->digest_due = false;
}

bool kvw__verify_sendable_locked(const kvw_req_t *r)
{
    return r->tx.digest_due && atomic_load(&r->state) == KVW_POLL_SUCCESS &&
           (!r->tx.caller_digest || r->tx.digest_given);
}

bool kvw__verify_owed_locked(const kvw_req_t *r)
{
    return r->tx.digest_due && r->peer && atomic_load(&r->state) == KVW_POLL_SUCCESS;
}

/* ---- decode ----------------------------------------------------------------- */

/* Decode's items of region k at the n indices its REQUEST named. */
static uint64_t items_sum(const kvw_engine_t *e, uint32_t k, const uint64_t *idx, size_t n)
{
    const uint8_t *base = (const uint8_t *)(uintptr_t)e->mrs[k].addr; /* staged: the pool */
    uint64_t item = e->regions[k].item_len, sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += kvw__verify_item(k, idx[i], base + idx[i] * item, item);
    return sum;
}

uint64_t kvw__verify_landed(kvw_engine_t *e, const kvw_req_t *r)
{
    void (*hook)(uint64_t) = atomic_load(&kvw__verify_hook);
    if (hook)
        hook(r->room);
    const kvw_layout_t *l = &e->layout;
    /* What the REQUEST named: staging slots stand in for staged kinds. */
    const uint64_t *sent = r->stage.slots ? r->stage.slots : r->rx.pages;
    uint64_t aux = r->stage.slots ? r->stage.slots[r->rx.npages + r->rx.nstate] : r->rx.aux;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < l->kv_layers * l->kv_per_layer; i++)
        sum += items_sum(e, l->kv_slots[i], sent, r->rx.npages);
    for (uint32_t s = 0; s < l->num_state_groups && r->rx.nstate; s++) {
        const uint64_t *idx = sent + r->rx.npages + kvw__state_off(r->rx.state_n, s);
        for (uint32_t j = 0; j < l->state_nslots[s]; j++)
            sum += items_sum(e, l->state_slots[l->state_first[s] + j], idx, r->rx.state_n[s]);
    }
    for (uint32_t i = 0; r->rx.aux != KVW_NO_AUX && i < l->num_aux; i++)
        sum += items_sum(e, l->aux_slots[i], &aux, 1);
    return sum;
}

/* (lock) End r once the writes landed and both digests are in. */
static void settle_locked(kvw_req_t *r)
{
    kvw_req_rx_t *x = &r->rx;
    if (!x->v_landed || !x->v_have_local || !x->v_have_remote || kvw__req_ended(r))
        return;
    if (x->aborting) /* given up meanwhile: nothing more lands, the abort is done */
        kvw__req_fail(r, x->abort_status, "%s", x->abort_reason);
    else if (x->v_local != x->v_remote)
        kvw__req_fail(r, KVW_ERR_CORRUPT,
                      "room %llu: the bytes that landed differ from what prefill sent "
                      "(prefill's digest 0x%016llx, decode's 0x%016llx)",
                      (unsigned long long)r->room, (unsigned long long)x->v_remote,
                      (unsigned long long)x->v_local);
    else
        kvw__req_succeed(r);
    kvw__req_set_deadline_locked(r, 0);
    kvw__req_touch_locked(r); /* a destroyed receiver may leave now */
}

void kvw__verify_landed_locked(kvw_req_t *r, bool have_local, uint64_t local)
{
    r->rx.v_landed = true;
    if (have_local && !r->rx.v_have_local) {
        r->rx.v_have_local = true;
        r->rx.v_local = local;
    }
    settle_locked(r);
}

void kvw__verify_remote_locked(kvw_req_t *r, uint64_t remote)
{
    if (r->rx.v_have_remote)
        return;
    r->rx.v_have_remote = true;
    r->rx.v_remote = remote;
    settle_locked(r);
}

void kvw__verify_check_landed(kvw_engine_t *e, kvw_req_t *r)
{
    uint64_t local = kvw__verify_landed(e, r);
    pthread_mutex_lock(&e->lock);
    kvw__verify_landed_locked(r, true, local);
    pthread_mutex_unlock(&e->lock);
    kvw__req_unref(r);
}
