/* SPDX-License-Identifier: Apache-2.0 */
/* An engine's memory layout as buffer groups (see kvw_group_t), flattened
 * into region indices the planner walks: the KV regions of each layer in
 * posting order, the aux regions, the state regions. Pure: no I/O. */
#ifndef KVW_PLAN_LAYOUT_H
#define KVW_PLAN_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "plan/heads.h"

enum {
    KVW_LAYOUT_MAX_GROUPS = 64,
    KVW_LAYOUT_KV = 0, /* the values of kvw_group_kind_t */
    KVW_LAYOUT_AUX = 1,
    KVW_LAYOUT_STATE = 2,
};

typedef struct kvw_layout_group {
    uint32_t kind, num_layers, per_layer;
    uint32_t first; /* index of its first region among all regions */
    /* KV groups: the heads each of its regions holds (plan/heads.h);
     * heads.total 0: not described, every region moves whole. */
    kvw_heads_t heads;
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
    /* State groups in group order, each with its own index list in a
     * request: state group s is group state_group[s]; its regions are
     * state_slots[state_first[s] .. + state_nslots[s]). */
    uint32_t num_state_groups;
    uint32_t state_group[KVW_LAYOUT_MAX_GROUPS];
    uint32_t state_first[KVW_LAYOUT_MAX_GROUPS];
    uint32_t state_nslots[KVW_LAYOUT_MAX_GROUPS];
} kvw_layout_t;

/* Region j of layer l of group g is region first + j * num_layers + l. */
static inline uint32_t kvw__layout_region(const kvw_layout_group_t *g, uint32_t layer, uint32_t j)
{
    return g->first + j * g->num_layers + layer;
}

/* Build from groups' kind, num_layers, per_layer and heads (first is
 * computed). Checks: 1..KVW_LAYOUT_MAX_GROUPS groups, at least one KV
 * group, every KV group with the same layer count, aux groups of one
 * layer, heads described for KV groups only (NHD or HND, a range inside
 * the model's), at most max_regions regions. -1 with the reason in why, -2
 * out of memory, 0. */
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

/* The items every region of each state group can hold (the smallest of
 * its regions), from each region's item count: max[s] for state group s. */
void kvw__layout_state_limits(const kvw_layout_t *l, const uint64_t *items,
                              uint64_t max[KVW_LAYOUT_MAX_GROUPS]);
/* The state group s (0..num_state_groups-1) of group index g, or -1 when g
 * is not a state group. */
int kvw__layout_state_index(const kvw_layout_t *l, uint32_t g);
/* The state group of region r, or -1 when r is not a state region. */
int kvw__layout_state_of_region(const kvw_layout_t *l, uint32_t r);

/* Which group, layer and region of it region r is ("kv group 0, layer 3,
 * region 1"), for messages. */
void kvw__layout_describe(const kvw_layout_t *l, uint32_t r, char *buf, size_t size);
/* Group g's one item length: every region of it must have the same (a
 * group learning its heads, kvw__heads_learn, derives them from it). 0
 * with *len, or -1 naming the region that differs in why. */
int kvw__layout_group_item_len(const kvw_layout_t *l, uint32_t g, const uint64_t *item_len,
                               uint64_t *len, char *why, size_t why_size);

/* Decode's learning group g (its page in `learning`) learns its heads
 * from prefill's description of the group and the group's item lengths
 * (item_len[], decode's, by region): kvw__heads_learn over its one item
 * length. 0 with *out, or -1 with why ("kv group 0: ..."). */
int kvw__layout_learn_group(const kvw_layout_t *l, uint32_t g, const kvw_heads_t *learning,
                            const kvw_heads_t *prefill, const uint64_t *item_len, uint32_t tp_rank,
                            uint32_t tp_size, kvw_heads_t *out, char *why, size_t why_size);

/* Each described group's regions hold exactly its heads: item_len (by
 * region index) is page_tokens * heads * head_bytes. 0, or -1 with why. */
int kvw__layout_check_heads(const kvw_layout_t *l, const uint64_t *item_len, char *why,
                            size_t why_size);
/* Can two sides exchange pages: the same groups (kind, layers, regions per
 * layer), heads described alike (kvw__heads_compare: the model's heads,
 * head bytes, page size and page layout; the ranges may differ), and, per
 * region, the same item length where the heads are not described (where
 * they are, each side's item length follows from its own range and was
 * checked by kvw__layout_check_heads). peer_items: the peer's item length
 * by region index, NULL to skip that check. 0, or -1 with exactly what
 * differs in why ("peer ..., ours ..."). */
int kvw__layout_compare(const kvw_layout_t *ours, const uint64_t *our_items,
                        const kvw_layout_group_t *peer, uint32_t peer_groups,
                        const uint64_t *peer_items, char *why, size_t why_size);
/* Whether any KV group's head range differs from the peer's (the transfer
 * then needs the head planner instead of whole pages). */
int kvw__layout_sliced(const kvw_layout_t *ours, const kvw_layout_group_t *peer,
                       uint32_t peer_groups);

#endif
