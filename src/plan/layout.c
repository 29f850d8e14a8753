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
