/* SPDX-License-Identifier: Apache-2.0 */
/* An engine's memory layout as buffer groups (see kvw_group_t), flattened
 * into region indices the planner walks: the KV regions of each layer in
 * posting order, the aux regions, the state regions. Pure: no I/O. */
#ifndef KVW_PLAN_LAYOUT_H
#define KVW_PLAN_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

enum {
    KVW_LAYOUT_MAX_GROUPS = 64,
    KVW_LAYOUT_KV = 0, /* the values of kvw_group_kind_t */
    KVW_LAYOUT_AUX = 1,
    KVW_LAYOUT_STATE = 2,
};

typedef struct kvw_layout_group {
    uint32_t kind, num_layers, per_layer;
    uint32_t first; /* index of its first region among all regions */
} kvw_layout_group_t;

typedef struct kvw_layout {
    uint32_t num_groups;
    kvw_layout_group_t groups[KVW_LAYOUT_MAX_GROUPS];
    uint32_t num_regions;
    uint32_t kv_layers;    /* layers of the KV groups (all the same) */
    uint32_t kv_per_layer; /* KV regions per layer over all KV groups */
    uint32_t *kv_slots;    /* region of KV slot j of layer l: [l * kv_per_layer + j] */
    uint32_t num_aux, *aux_slots;
    uint32_t num_state, *state_slots;
} kvw_layout_t;

/* Region j of layer l of group g is region first + j * num_layers + l. */
static inline uint32_t kvw__layout_region(const kvw_layout_group_t *g, uint32_t layer, uint32_t j)
{
    return g->first + j * g->num_layers + layer;
}

/* Build from groups' kind, num_layers and per_layer (first is computed).
 * Checks: 1..KVW_LAYOUT_MAX_GROUPS groups, at least one KV group, every
 * KV group with the same layer count, aux groups of one layer, at most
 * max_regions regions. -1 with the reason in why, -2 out of memory, 0. */
int kvw__layout_build(kvw_layout_t *l, const kvw_layout_group_t *groups, uint32_t num_groups,
                      uint32_t max_regions, char *why, size_t why_size);
void kvw__layout_free(kvw_layout_t *l);
/* The classic layout: one K/V group of num_layers layers, and one aux
 * group of num_aux regions when num_aux > 0. */
int kvw__layout_classic(kvw_layout_t *l, uint32_t num_layers, uint32_t num_aux);
const char *kvw__layout_kind_name(uint32_t kind);
/* The items every region of each kind can hold (the smallest region of the
 * kind; 0 for a kind with no region), from each region's item count:
 * max[KVW_LAYOUT_KV] pages, max[KVW_LAYOUT_AUX], max[KVW_LAYOUT_STATE]. */
void kvw__layout_limits(const kvw_layout_t *l, const uint64_t *items, uint64_t max[3]);

#endif
