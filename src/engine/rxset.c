/* SPDX-License-Identifier: Apache-2.0 */
/* Decode over several prefill ranks (head slicing with decode TP < prefill
 * TP, docs/head-slicing.md): one receiver handle over one plain receiver
 * ("member") per prefill rank, all for the same room. Once every member's
 * rank is connected (its heads known from the handshake), kvw__heads_assign
 * says which heads each owes; each member's REQUEST then names its range
 * (count 0: the rank owes nothing and finishes with one empty write), and
 * only the first member owing heads asks for the aux item and the state.
 * The set is Success once every member is; when one fails, the others are
 * aborted (the abort barrier of each), and the set is Failed once every
 * member ended, with the first failure's reason naming its rank. */
#include "engine/core.h"
#include "engine/stager.h"

#include "common/log.h"
#include "common/sized.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvw_rxset {
    kvw_engine_t *engine;
    uint32_t n;
    bool assigned;       /* (lock) the members know their heads */
    kvw_set_fate_t fate; /* (lock) */
    kvw_req_t *m[];      /* member i asks prefill rank ranks[i] */
};

/* The group of KV slot j. */
static uint32_t slot_group(const kvw_layout_t *l, uint32_t j)
{
    uint32_t r = l->kv_slots[j], g = 0;
    while (g + 1 < l->num_groups && r >= l->groups[g + 1].first)
        g++;
    return g;
}

/* Our heads: those of the KV group of slot 0 (every KV group must
 * describe the same heads, checked at creation, and again once heads
 * learned from prefill are known). */
static const kvw_heads_t *slot_heads(const kvw_layout_t *l, uint32_t j)
{
    return &l->groups[slot_group(l, j)].heads;
}

/* Every KV group describes the same heads: one head range per request
 * then means the same slice of every KV region. */
static bool heads_uniform(const kvw_layout_t *l)
{
    const kvw_heads_t *h0 = slot_heads(l, 0);
    for (uint32_t j = 0; j < l->kv_per_layer; j++) {
        const kvw_heads_t *h = slot_heads(l, j);
        if (!h->total || memcmp(h, h0, sizeof(*h)) != 0)
            return false;
    }
    return true;
}

/* (lock) At creation: every KV group describes the same heads, or every
 * KV group learns them from prefill (then checked as described once all
 * ranks are connected, kvw__rxset_ready_locked). */
static bool heads_usable_locked(const kvw_engine_t *e)
{
    const kvw_layout_t *l = &e->layout;
    if (heads_uniform(l))
        return true;
    for (uint32_t j = 0; j < l->kv_per_layer; j++)
        if (!(e->learn_groups >> slot_group(l, j) & 1))
            return false;
    return e->learn_groups != 0;
}

static void set_free(kvw_rxset_t *set)
{
    free(set);
}

kvw_status_t kvw__rxset_create(kvw_engine_t *e, const kvw_receiver_params_t *params,
                               kvw_req_t **first_p)
{
    kvw_receiver_params_t p = {.struct_size = sizeof(p)};
    size_t min = offsetof(kvw_receiver_params_t, ranks) + sizeof(p.ranks);
    if (kvw__sized_read("receiver params", &p, sizeof(p), min, params))
        return KVW_ERR_INVALID;
    if (!p.num_ranks || p.num_ranks > KVW_MAX_PREFILL_RANKS || !p.ranks ||
        p.room_receivers > KVW_MAX_DECODE_RECEIVERS)
        return KVW_ERR_INVALID;
    char addrs[KVW_MAX_PREFILL_RANKS][KVW_WIRE_ENDPOINT_MAX];
    for (uint32_t i = 0; i < p.num_ranks; i++) {
        const kvw_prefill_rank_t *k = &p.ranks[i];
        if (k->bootstrap_addr) {
            if (k->bootstrap_addr[0] == '@' ||
                strlen(k->bootstrap_addr) >= KVW_WIRE_ENDPOINT_MAX - 6)
                return KVW_ERR_INVALID;
            snprintf(addrs[i], sizeof(addrs[i]), "%s", k->bootstrap_addr);
        } else if (k->endpoint && strncmp(k->endpoint, "tcp://", 6) == 0 && k->endpoint[6] &&
                   strlen(k->endpoint) < KVW_WIRE_ENDPOINT_MAX - 1) {
            snprintf(addrs[i], sizeof(addrs[i]), "@%s", k->endpoint);
        } else {
            return KVW_ERR_INVALID;
        }
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(addrs[i], addrs[j]) == 0 &&
                (addrs[i][0] == '@' || p.ranks[j].rank == k->rank))
                return KVW_ERR_INVALID; /* the same rank twice */
    }
    pthread_mutex_lock(&e->lock); /* heads learned from prefill are written under it */
    bool usable = e->layout_heads && heads_usable_locked(e);
    pthread_mutex_unlock(&e->lock);
    if (!usable || kvw__stager_on(e)) {
        KVW_ERROR("room %llu: a receiver over several prefill ranks needs every KV group to "
                  "describe the same heads, and memory registered directly (not staged)",
                  (unsigned long long)p.room);
        return KVW_ERR_UNSUPPORTED;
    }
    if (e->verify_mode) {
        KVW_ERROR("room %llu: a receiver over several prefill ranks cannot verify the bytes "
                  "(KVW_VERIFY=1): head slicing is not verified",
                  (unsigned long long)p.room);
        return KVW_ERR_UNSUPPORTED;
    }
    kvw_rxset_t *set = calloc(1, sizeof(*set) + p.num_ranks * sizeof(kvw_req_t *));
    if (!set)
        return KVW_ERR_NO_MEMORY;
    set->engine = e;
    kvw_status_t st = KVW_OK;
    for (uint32_t i = 0; i < p.num_ranks && !st; i++) {
        st = kvw__receiver_create(e, addrs[i], p.ranks[i].rank, p.room, true, &set->m[i]);
        if (!st) {
            /* before any failure can look for it: not yet inited */
            set->m[i]->rx.set = set;
            set->m[i]->rx.member_failed_locked = kvw__rxset_member_failed_locked;
            set->n = i + 1;
        }
    }
    if (!st) {
        pthread_mutex_lock(&e->lock);
        st = kvw__rxset_set_room_receivers_locked(set, p.room_receivers);
        pthread_mutex_unlock(&e->lock);
    }
    if (st) {
        kvw__rxset_destroy(set);
        return st;
    }
    *first_p = set->m[0];
    return KVW_OK;
}

kvw_status_t kvw__rxset_set_room_receivers_locked(kvw_rxset_t *set, uint32_t n)
{
    for (uint32_t i = 0; i < set->n; i++) {
        kvw_status_t st = kvw__receiver_set_room_receivers_locked(set->m[i], n);
        if (st)
            return st;
    }
    return KVW_OK;
}

kvw_status_t kvw__rxset_init(kvw_rxset_t *set, const kvw_indices_t *x,
                             const kvw_state_list_t *lists, size_t num_lists)
{
    kvw_status_t first = KVW_OK;
    for (uint32_t i = 0; i < set->n; i++) {
        kvw_status_t st = kvw__receiver_init_one(set->m[i], x, lists, num_lists);
        if (st && !first)
            first = st;
    }
    return first;
}

/* (lock) Bytes of its share of every KV page member r expects. */
static uint64_t member_kv_bytes(const kvw_engine_t *e, const kvw_req_t *r)
{
    const kvw_layout_t *l = &e->layout;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < l->kv_layers * l->kv_per_layer; i++) {
        const kvw_heads_t *h = slot_heads(l, i % l->kv_per_layer);
        bytes +=
            r->rx.npages * (e->regions[l->kv_slots[i]].item_len / h->count) * r->rx.heads.count;
    }
    return bytes;
}

/* (lock) Bytes member r expects: its share of every KV page, and the aux
 * item and state if it is the one asking for them. */
static uint64_t member_bytes(const kvw_engine_t *e, const kvw_req_t *r)
{
    const kvw_layout_t *l = &e->layout;
    uint64_t bytes = member_kv_bytes(e, r);
    for (uint32_t i = 0; r->rx.aux != KVW_NO_AUX && i < l->num_aux; i++)
        bytes += e->regions[l->aux_slots[i]].item_len;
    for (uint32_t g = 0; r->rx.state_n && g < l->num_state_groups; g++)
        for (uint32_t i = 0; i < l->state_nslots[g]; i++)
            bytes += (uint64_t)r->rx.state_n[g] *
                     e->regions[l->state_slots[l->state_first[g] + i]].item_len;
    return bytes;
}

bool kvw__rxset_ready_locked(kvw_req_t *r)
{
    kvw_rxset_t *set = r->rx.set;
    if (!set || set->assigned)
        return true;
    kvw_engine_t *e = set->engine;
    kvw_heads_t src[KVW_MAX_PREFILL_RANKS];
    for (uint32_t i = 0; i < set->n; i++) {
        const kvw_req_t *m = set->m[i];
        const kvw_peer_t *p = m->peer;
        if (kvw__req_ended(m) || !m->rx.request_due || !p ||
            atomic_load(&p->state) != PEER_CONNECTED || !p->kv_theirs)
            return false; /* touched again when it connects (or the set fails) */
        src[i] = p->kv_theirs[0];
    }
    kvw_head_range_t out[KVW_MAX_PREFILL_RANKS];
    char why[KVW_WIRE_REASON_MAX];
    bool known = heads_uniform(&e->layout); /* else heads to learn no prefill rank gave */
    if (!known)
        snprintf(why, sizeof(why),
                 "decode's KV heads are not known: they are learned from a prefill rank "
                 "describing its heads, and none of these %u did (or not the same in every "
                 "KV group)",
                 set->n);
    if (!known ||
        kvw__heads_assign(slot_heads(&e->layout, 0), src, set->n, out, why, sizeof(why))) {
        for (uint32_t i = 0; i < set->n; i++)
            if (!kvw__req_ended(set->m[i]))
                kvw__receiver_fail_unsent_locked(set->m[i], KVW_ERR_MISMATCH, why);
        return false;
    }
    bool rest_taken = false;
    for (uint32_t i = 0; i < set->n; i++) {
        kvw_req_t *m = set->m[i];
        m->rx.heads_set = true;
        m->rx.heads = out[i];
        m->rx.no_rest = rest_taken || !out[i].count;
        rest_taken |= !m->rx.no_rest;
        if (m->rx.no_rest) { /* aux and state from another rank */
            m->rx.aux = KVW_NO_AUX;
            m->rx.nstate = 0;
            for (uint32_t g = 0; m->rx.state_n && g < e->layout.num_state_groups; g++)
                m->rx.state_n[g] = 0;
        }
        atomic_store(&m->bytes_posted, member_bytes(e, m));
        /* Fewer heads than ours: strided rows, landed then copied (path
         * (b)) where the landing buffer has room, else a write per row. */
        bool strided = out[i].count && out[i].count < slot_heads(&e->layout, 0)->count;
        bool landing = strided && kvw__landing_reserve_locked(e, m, member_kv_bytes(e, m));
        KVW_INFO("room %llu: prefill rank %u sends heads [%u, %u)%s%s", (unsigned long long)m->room,
                 m->rx.prefill_rank, out[i].first, out[i].first + out[i].count,
                 m->rx.no_rest ? "" : " and the aux item and state",
                 landing   ? ", landed and copied"
                 : strided ? ", a write per row"
                           : "");
        kvw__req_touch_locked(m);
    }
    set->assigned = true;
    return true;
}

void kvw__rxset_member_failed_locked(kvw_req_t *r)
{
    kvw_rxset_t *set = r->rx.set;
    kvw__set_fail_locked(&set->fate, r->fail_status, "prefill rank %u: %.120s", r->rx.prefill_rank,
                         r->fail_reason);
    char why[KVW_WIRE_REASON_MAX];
    snprintf(why, sizeof(why), "prefill rank %u of the room failed", r->rx.prefill_rank);
    for (uint32_t i = 0; i < set->n; i++)
        if (set->m[i] != r && !kvw__req_ended(set->m[i]))
            kvw__receiver_abort_locked(set->m[i], why);
}

kvw_poll_t kvw__rxset_poll(kvw_rxset_t *set)
{
    return kvw__members_poll(set->m, set->n);
}

kvw_status_t kvw__rxset_failure(kvw_rxset_t *set, const char **reason_p)
{
    return kvw__set_failure(set->engine, kvw__rxset_poll(set), &set->fate, reason_p);
}

/* (lock) Fail the set for the caller's reason and abort every member. */
static void abort_all_locked(kvw_rxset_t *set, const char *why)
{
    kvw__set_fail_locked(&set->fate, KVW_ERR_ABORTED, "%s", why);
    for (uint32_t i = 0; i < set->n; i++)
        if (!kvw__req_ended(set->m[i]))
            kvw__receiver_abort_locked(set->m[i], why);
}

kvw_status_t kvw__rxset_abort(kvw_rxset_t *set)
{
    pthread_mutex_lock(&set->engine->lock);
    bool live = kvw__members_live(set->m, set->n);
    if (live)
        abort_all_locked(set, "aborted by the caller");
    pthread_mutex_unlock(&set->engine->lock);
    return live ? KVW_OK : KVW_ERR_STATE;
}

kvw_status_t kvw__rxset_metrics(kvw_rxset_t *set, kvw_req_metrics_t *out)
{
    kvw_req_metrics_t sum = {0};
    pthread_mutex_lock(&set->engine->lock);
    for (uint32_t i = 0; i < set->n; i++) {
        const kvw_req_t *r = set->m[i];
        uint64_t sent = r->rx.sent_ns, landed = atomic_load(&r->rx.landed_ns);
        sum.bytes += atomic_load(&r->bytes_posted);
        if (sent && (!sum.start_ns || sent < sum.start_ns))
            sum.start_ns = sent;
        if (landed > sum.end_ns)
            sum.end_ns = landed;
    }
    pthread_mutex_unlock(&set->engine->lock);
    sum.transfer_us =
        sum.start_ns && sum.end_ns > sum.start_ns ? (sum.end_ns - sum.start_ns) / 1000 : 0;
    *out = sum;
    return KVW_OK;
}

void kvw__rxset_destroy(kvw_rxset_t *set)
{
    kvw_engine_t *e = set->engine;
    pthread_mutex_lock(&e->lock);
    bool live = kvw__members_live(set->m, set->n);
    if (live)
        abort_all_locked(set, "receiver destroyed by the caller");
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < set->n; i++)
        kvw__receiver_end(set->m[i]);
    /* Plain receivers from here on: a member the engine keeps (its abort
     * unconfirmed) no longer points at the set. */
    pthread_mutex_lock(&e->lock);
    for (uint32_t i = 0; i < set->n; i++) {
        set->m[i]->rx.set = NULL;
        set->m[i]->rx.member_failed_locked = NULL;
    }
    pthread_mutex_unlock(&e->lock);
    for (uint32_t i = 0; i < set->n; i++)
        kvw__receiver_destroy_one(set->m[i]);
    set_free(set);
}
