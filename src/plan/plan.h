/* SPDX-License-Identifier: Apache-2.0 */
/* Pure transfer planning: no I/O, no allocation. Groups (source,
 * destination) page pairs into runs contiguous on both sides, and walks a
 * request part's writes in posting order (see kvw_plan_t); a run longer
 * than the port's maximum message is split. */
#ifndef KVW_PLAN_PLAN_H
#define KVW_PLAN_PLAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct kvw_run {
    uint64_t src, dst, count; /* first source page, first destination page, pages */
} kvw_run_t;

/* A run in bytes for one item size, computed once per request part so that
 * posting it costs no multiply and no split check (kvw__plan_span). */
typedef struct kvw_wrun {
    uint64_t src_off, dst_off; /* bytes into the local and the remote region */
    uint64_t before;           /* bytes of the runs before this one */
    uint64_t len;              /* bytes: the run is one write */
} kvw_wrun_t;

/* Group n pairs into maximal runs; runs must hold n entries. Returns the
 * number of runs (0 when n == 0). */
size_t kvw__plan_runs(const uint64_t *src, const uint64_t *dst, size_t n, kvw_run_t *runs);

/* A local region paired with the peer's matching region (same item_len). */
typedef struct kvw_plan_region {
    uint64_t local_addr, remote_addr, item_len;
    uint32_t lkey, rkey;
} kvw_plan_region_t;

/* The regions of one state group and the runs of its own index list
 * (each state group of a hybrid model has its own index space). */
typedef struct kvw_plan_set {
    const uint32_t *slots; /* region indices */
    uint32_t num_slots;
    const kvw_run_t *runs;
    size_t num_runs;
} kvw_plan_set_t;

/* One part of a request: the KV regions of layers [layer_begin,
 * layer_end) for the part's runs, and for the final part also each state
 * group's regions for its own runs and one item of every aux region. Posting
 * order: KV layer by layer (each layer's regions in kv_slots order), then
 * state, then aux, so the final part's last write is an aux or state write
 * when there is one. */
typedef struct kvw_plan {
    const kvw_plan_region_t *regions; /* every region, by region index */
    const uint32_t *kv_slots;         /* layout: [l * kv_per_layer + j] -> region */
    uint32_t kv_per_layer;
    uint32_t layer_begin, layer_end;
    const kvw_run_t *runs;
    size_t num_runs;
    /* final part only (zero otherwise) */
    const kvw_plan_set_t *state_sets; /* one per state group, in group order */
    uint32_t num_state_sets;
    const uint32_t *aux_slots;
    uint32_t num_aux;
    int has_aux;
    uint64_t aux_src, aux_dst; /* aux item indices, when has_aux */
    uint64_t max_msg;          /* largest single write */
    /* runs in bytes for the KV regions of item_len wrun_item, set by
     * kvw__plan_wruns; NULL: every write comes from kvw__plan_next */
    const kvw_wrun_t *wruns;
    uint64_t wrun_item;
} kvw_plan_t;

typedef struct kvw_plan_cursor {
    uint32_t phase; /* 0 KV, 1 state, 2 aux, 3 done */
    uint32_t set;   /* state: the state set being posted */
    uint32_t slot;  /* KV: (layer - layer_begin) * kv_per_layer + j; state, aux: slot index */
    size_t run;
    uint64_t off; /* bytes of the current run already emitted */
} kvw_plan_cursor_t;

typedef struct kvw_write {
    uint64_t local_addr, remote_addr;
    uint32_t lkey, rkey, len;
} kvw_write_t;

/* Next write of the plan, advancing the cursor. Returns 0 when done.
 * A zeroed cursor starts at the beginning. */
int kvw__plan_next(const kvw_plan_t *plan, kvw_plan_cursor_t *cur, kvw_write_t *w_p);
/* Number of writes kvw__plan_next() will produce. */
uint64_t kvw__plan_count(const kvw_plan_t *plan);

/* Precompute the KV runs in bytes into out (num_runs entries) and point
 * plan->wruns at them, for the item size of the part's first KV region,
 * when each run of that size is a single write (no split). Otherwise
 * plan->wruns stays NULL. The posting order does not change. */
void kvw__plan_wruns(kvw_plan_t *plan, kvw_wrun_t *out);

/* The fast path of kvw__plan_next, inlined into the poller's build loop:
 * how many of the next writes (at most max) are whole KV runs of the
 * current region, for which wruns hold the bytes. Sets the region and the
 * first run. 0 when the next write is not such a one (another phase, a
 * split run, a region of another item size, a slot boundary): take it from
 * kvw__plan_next. Consume what was used with kvw__plan_skip. */
static inline uint32_t kvw__plan_span(const kvw_plan_t *p, const kvw_plan_cursor_t *c, uint32_t max,
                                      const kvw_plan_region_t **g_p, const kvw_wrun_t **r_p)
{
    size_t slots = (size_t)(p->layer_end - p->layer_begin) * p->kv_per_layer;
    if (!p->wruns || c->phase != 0 || c->off || c->slot >= slots || c->run >= p->num_runs)
        return 0;
    const kvw_plan_region_t *g =
        &p->regions[p->kv_slots[(size_t)p->layer_begin * p->kv_per_layer + c->slot]];
    if (g->item_len != p->wrun_item)
        return 0;
    size_t left = p->num_runs - c->run;
    *g_p = g;
    *r_p = &p->wruns[c->run];
    return left < max ? (uint32_t)left : max;
}

/* Advance past n writes of a span (as n kvw__plan_next calls would). */
static inline void kvw__plan_skip(const kvw_plan_t *p, kvw_plan_cursor_t *c, uint32_t n)
{
    c->run += n;
    if (c->run == p->num_runs) {
        c->run = 0;
        c->slot++;
    }
}

#endif
