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

/* Group n pairs into maximal runs; runs must hold n entries. Returns the
 * number of runs (0 when n == 0). */
size_t kvw__plan_runs(const uint64_t *src, const uint64_t *dst, size_t n, kvw_run_t *runs);

/* A local region paired with the peer's matching region (same item_len). */
typedef struct kvw_plan_region {
    uint64_t local_addr, remote_addr, item_len;
    uint32_t lkey, rkey;
} kvw_plan_region_t;

/* One part of a request: the KV regions of layers [layer_begin,
 * layer_end) for the part's runs, and for the final part also the state
 * regions for the state runs and one item of every aux region. Posting
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
    const uint32_t *state_slots;
    uint32_t num_state;
    const kvw_run_t *state_runs;
    size_t num_state_runs;
    const uint32_t *aux_slots;
    uint32_t num_aux;
    int has_aux;
    uint64_t aux_src, aux_dst; /* aux item indices, when has_aux */
    uint64_t max_msg;          /* largest single write */
} kvw_plan_t;

typedef struct kvw_plan_cursor {
    uint32_t phase; /* 0 KV, 1 state, 2 aux, 3 done */
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

#endif
