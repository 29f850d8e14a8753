/* SPDX-License-Identifier: Apache-2.0 */
#include "plan/layout.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kvw__layout_kind_name(uint32_t kind)
{
    switch (kind) {
    case KVW_LAYOUT_KV:
        return "kv";
    case KVW_LAYOUT_AUX:
        return "aux";
    case KVW_LAYOUT_STATE:
        return "state";
    }
    return "unknown";
}

static int check_groups(const kvw_layout_group_t *g, uint32_t n, uint32_t max_regions, char *why,
                        size_t size)
{
    if (n == 0 || n > KVW_LAYOUT_MAX_GROUPS) {
        snprintf(why, size, "%u buffer groups: need 1 to %u", n, KVW_LAYOUT_MAX_GROUPS);
        return -1;
    }
    uint64_t regions = 0;
    uint32_t kv_layers = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (g[i].kind > KVW_LAYOUT_STATE || !g[i].num_layers || !g[i].per_layer) {
            snprintf(why, size, "group %u: kind %u, %u layers, %u regions per layer", i, g[i].kind,
                     g[i].num_layers, g[i].per_layer);
            return -1;
        }
        if (g[i].kind == KVW_LAYOUT_AUX && g[i].num_layers != 1) {
            snprintf(why, size, "aux group %u has %u layers: aux groups have one", i,
                     g[i].num_layers);
            return -1;
        }
        if (g[i].heads.total && g[i].kind != KVW_LAYOUT_KV) {
            snprintf(why, size, "%s group %u describes heads: only kv groups do",
                     kvw__layout_kind_name(g[i].kind), i);
            return -1;
        }
        char what[160];
        if (g[i].heads.total && kvw__heads_check(&g[i].heads,
                                                 (uint64_t)g[i].heads.page_tokens *
                                                     g[i].heads.count * g[i].heads.head_bytes,
                                                 what, sizeof(what))) {
            snprintf(why, size, "kv group %u: %s", i, what);
            return -1;
        }
        if (g[i].kind == KVW_LAYOUT_KV && kv_layers && g[i].num_layers != kv_layers) {
            snprintf(why, size, "kv group %u has %u layers, an earlier kv group %u", i,
                     g[i].num_layers, kv_layers);
            return -1;
        }
        if (g[i].kind == KVW_LAYOUT_KV)
            kv_layers = g[i].num_layers;
        regions += (uint64_t)g[i].num_layers * g[i].per_layer;
    }
    if (!kv_layers) {
        snprintf(why, size, "no kv group");
        return -1;
    }
    if (regions > max_regions) {
        snprintf(why, size, "%llu regions, at most %u", (unsigned long long)regions, max_regions);
        return -1;
    }
    return 0;
}

/* Slots in posting order: KV layer by layer (every KV group's regions of
 * that layer), state layer by layer, aux group by group. */
static void fill_slots(kvw_layout_t *l)
{
    uint32_t k = 0, a = 0, s = 0;
    for (uint32_t layer = 0; layer < l->kv_layers; layer++)
        for (uint32_t i = 0; i < l->num_groups; i++)
            for (uint32_t j = 0; l->groups[i].kind == KVW_LAYOUT_KV && j < l->groups[i].per_layer;
                 j++)
                l->kv_slots[k++] = kvw__layout_region(&l->groups[i], layer, j);
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        if (g->kind == KVW_LAYOUT_STATE) {
            uint32_t sg = l->num_state_groups++;
            l->state_group[sg] = i;
            l->state_first[sg] = s;
            l->state_nslots[sg] = g->num_layers * g->per_layer;
        }
        for (uint32_t layer = 0; layer < g->num_layers; layer++)
            for (uint32_t j = 0; j < g->per_layer; j++) {
                if (g->kind == KVW_LAYOUT_AUX)
                    l->aux_slots[a++] = kvw__layout_region(g, layer, j);
                else if (g->kind == KVW_LAYOUT_STATE)
                    l->state_slots[s++] = kvw__layout_region(g, layer, j);
            }
    }
}

int kvw__layout_build(kvw_layout_t *l, const kvw_layout_group_t *groups, uint32_t num_groups,
                      uint32_t max_regions, char *why, size_t why_size)
{
    memset(l, 0, sizeof(*l));
    if (check_groups(groups, num_groups, max_regions, why, why_size))
        return -1;
    l->num_groups = num_groups;
    for (uint32_t i = 0; i < num_groups; i++) {
        l->groups[i] = groups[i];
        l->groups[i].first = l->num_regions;
        uint32_t n = groups[i].num_layers * groups[i].per_layer;
        l->num_regions += n;
        if (groups[i].kind == KVW_LAYOUT_KV) {
            l->kv_layers = groups[i].num_layers;
            l->kv_per_layer += groups[i].per_layer;
        }
        l->num_aux += groups[i].kind == KVW_LAYOUT_AUX ? n : 0;
        l->num_state += groups[i].kind == KVW_LAYOUT_STATE ? n : 0;
    }
    l->kv_slots = calloc((size_t)l->kv_layers * l->kv_per_layer, sizeof(uint32_t));
    l->aux_slots = calloc(l->num_aux + 1, sizeof(uint32_t));
    l->state_slots = calloc(l->num_state + 1, sizeof(uint32_t));
    if (!l->kv_slots || !l->aux_slots || !l->state_slots) {
        kvw__layout_free(l);
        return -2;
    }
    fill_slots(l);
    return 0;
}

void kvw__layout_free(kvw_layout_t *l)
{
    free(l->kv_slots);
    free(l->aux_slots);
    free(l->state_slots);
    l->kv_slots = l->aux_slots = l->state_slots = NULL;
}

int kvw__layout_classic(kvw_layout_t *l, uint32_t num_layers, uint32_t num_aux)
{
    kvw_layout_group_t g[2] = {{KVW_LAYOUT_KV, num_layers, 2, 0}, {KVW_LAYOUT_AUX, 1, num_aux, 0}};
    char why[128];
    return kvw__layout_build(l, g, num_aux ? 2 : 1, UINT32_MAX, why, sizeof(why));
}

void kvw__layout_limits(const kvw_layout_t *l, const uint64_t *items, uint64_t max[3])
{
    bool seen[3] = {false, false, false};
    max[0] = max[1] = max[2] = 0;
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        for (uint32_t r = g->first; r < g->first + g->num_layers * g->per_layer; r++)
            if (!seen[g->kind] || items[r] < max[g->kind]) {
                max[g->kind] = items[r];
                seen[g->kind] = true;
            }
    }
}

void kvw__layout_state_limits(const kvw_layout_t *l, const uint64_t *items,
                              uint64_t max[KVW_LAYOUT_MAX_GROUPS])
{
    for (uint32_t s = 0; s < l->num_state_groups; s++) {
        max[s] = UINT64_MAX;
        for (uint32_t i = 0; i < l->state_nslots[s]; i++) {
            uint64_t n = items[l->state_slots[l->state_first[s] + i]];
            max[s] = n < max[s] ? n : max[s];
        }
    }
}

int kvw__layout_state_index(const kvw_layout_t *l, uint32_t g)
{
    for (uint32_t s = 0; s < l->num_state_groups; s++)
        if (l->state_group[s] == g)
            return (int)s;
    return -1;
}

int kvw__layout_state_of_region(const kvw_layout_t *l, uint32_t r)
{
    for (uint32_t s = 0; s < l->num_state_groups; s++) {
        const kvw_layout_group_t *g = &l->groups[l->state_group[s]];
        if (r >= g->first && r < g->first + g->num_layers * g->per_layer)
            return (int)s;
    }
    return -1;
}

void kvw__layout_describe(const kvw_layout_t *l, uint32_t r, char *buf, size_t size)
{
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        uint32_t n = g->num_layers * g->per_layer;
        if (r >= g->first && r < g->first + n) {
            uint32_t k = r - g->first;
            snprintf(buf, size, "%s group %u, layer %u, region %u", kvw__layout_kind_name(g->kind),
                     i, k % g->num_layers, k / g->num_layers);
            return;
        }
    }
    snprintf(buf, size, "region %u", r);
}

int kvw__layout_check_heads(const kvw_layout_t *l, const uint64_t *item_len, char *why,
                            size_t why_size)
{
    for (uint32_t i = 0; i < l->num_groups; i++) {
        const kvw_layout_group_t *g = &l->groups[i];
        for (uint32_t r = g->first; g->heads.total && r < g->first + g->num_layers * g->per_layer;
             r++) {
            char what[160], where[96];
            if (kvw__heads_check(&g->heads, item_len[r], what, sizeof(what))) {
                kvw__layout_describe(l, r, where, sizeof(where));
                snprintf(why, why_size, "%s: %s", where, what);
                return -1;
            }
        }
    }
    return 0;
}

int kvw__layout_group_item_len(const kvw_layout_t *l, uint32_t g, const uint64_t *item_len,
                               uint64_t *len, char *why, size_t why_size)
{
    const kvw_layout_group_t *lg = &l->groups[g];
    for (uint32_t r = lg->first + 1; r < lg->first + lg->num_layers * lg->per_layer; r++)
        if (item_len[r] != item_len[lg->first]) {
            char where[96];
            kvw__layout_describe(l, r, where, sizeof(where));
            snprintf(why, why_size,
                     "%s: item length %llu, the group's first region %llu: a group learning "
                     "its heads has one item length",
                     where, (unsigned long long)item_len[r],
                     (unsigned long long)item_len[lg->first]);
            return -1;
        }
    *len = item_len[lg->first];
    return 0;
}

int kvw__layout_learn_group(const kvw_layout_t *l, uint32_t g, const kvw_heads_t *learning,
                            const kvw_heads_t *prefill, const uint64_t *item_len, uint32_t tp_rank,
                            uint32_t tp_size, kvw_heads_t *out, char *why, size_t why_size)
{
    uint64_t len;
    char what[200];
    if (kvw__layout_group_item_len(l, g, item_len, &len, why, why_size))
        return -1;
    if (kvw__heads_learn(prefill, learning->page_tokens, learning->order, len, tp_rank, tp_size,
                         out, what, sizeof(what))) {
        snprintf(why, why_size, "kv group %u: %s", g, what);
        return -1;
    }
    return 0;
}

int kvw__layout_compare(const kvw_layout_t *ours, const uint64_t *our_items,
                        const kvw_layout_group_t *peer, uint32_t peer_groups,
                        const uint64_t *peer_items, char *why, size_t why_size)
{
    if (peer_groups != ours->num_groups) {
        snprintf(why, why_size, "peer has %u buffer groups, we have %u", peer_groups,
                 ours->num_groups);
        return -1;
    }
    for (uint32_t i = 0; i < ours->num_groups; i++) {
        const kvw_layout_group_t *a = &ours->groups[i], *b = &peer[i];
        if (b->kind != a->kind || b->num_layers != a->num_layers || b->per_layer != a->per_layer) {
            snprintf(why, why_size,
                     "group %u: peer has %s, %u layers x %u regions; we have %s, %u x %u", i,
                     kvw__layout_kind_name(b->kind), b->num_layers, b->per_layer,
                     kvw__layout_kind_name(a->kind), a->num_layers, a->per_layer);
            return -1;
        }
        char what[160];
        if (kvw__heads_compare(&a->heads, &b->heads, what, sizeof(what))) {
            snprintf(why, why_size, "%s group %u: %s", kvw__layout_kind_name(a->kind), i, what);
            return -1;
        }
    }
    for (uint32_t i = 0; peer_items && i < ours->num_groups; i++) {
        const kvw_layout_group_t *g = &ours->groups[i];
        for (uint32_t r = g->first; !g->heads.total && r < g->first + g->num_layers * g->per_layer;
             r++)
            if (peer_items[r] != our_items[r]) {
                char where[96];
                kvw__layout_describe(ours, r, where, sizeof(where));
                snprintf(why, why_size, "%s: peer item length %llu, ours %llu", where,
                         (unsigned long long)peer_items[r], (unsigned long long)our_items[r]);
                return -1;
            }
    }
    return 0;
}

int kvw__layout_sliced(const kvw_layout_t *ours, const kvw_layout_group_t *peer,
                       uint32_t peer_groups)
{
    for (uint32_t i = 0; i < ours->num_groups && i < peer_groups; i++) {
        const kvw_heads_t *a = &ours->groups[i].heads, *b = &peer[i].heads;
        if (a->total && (a->first != b->first || a->count != b->count))
            return 1;
    }
    return 0;
}
