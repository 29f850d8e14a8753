/* SPDX-License-Identifier: Apache-2.0 */
#include "plan/plan.h"

enum { PHASE_KV, PHASE_STATE, PHASE_AUX, PHASE_DONE };

size_t kvw__plan_runs(const uint64_t *src, const uint64_t *dst, size_t n, kvw_run_t *runs)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        kvw_run_t *r = k ? &runs[k - 1] : NULL;
        if (r && src[i] == r->src + r->count && dst[i] == r->dst + r->count) {
            r->count++;
            continue;
        }
        runs[k++] = (kvw_run_t){src[i], dst[i], 1};
    }
    return k;
}

static uint64_t div_ceil(uint64_t a, uint64_t b)
{
    return a / b + (a % b != 0);
}

/* Writes for `runs` in each region of `slots`. */
static uint64_t count_runs(const kvw_plan_t *p, const uint32_t *slots, size_t num_slots,
                           const kvw_run_t *runs, size_t num_runs)
{
    uint64_t total = 0, longest = 0;
    for (size_t r = 0; r < num_runs; r++)
        longest = runs[r].count > longest ? runs[r].count : longest;
    for (size_t s = 0; s < num_slots; s++) {
        uint64_t item = p->regions[slots[s]].item_len;
        if (longest * item <= p->max_msg) {
            total += num_runs; /* no run in this region needs splitting */
            continue;
        }
        for (size_t r = 0; r < num_runs; r++)
            total += div_ceil(runs[r].count * item, p->max_msg);
    }
    return total;
}

uint64_t kvw__plan_count(const kvw_plan_t *p)
{
    size_t kv_slots = (size_t)(p->layer_end - p->layer_begin) * p->kv_per_layer;
    uint64_t total = count_runs(p, p->kv_slots + (size_t)p->layer_begin * p->kv_per_layer, kv_slots,
                                p->runs, p->num_runs);
    for (uint32_t i = 0; i < p->num_state_sets; i++) {
        const kvw_plan_set_t *set = &p->state_sets[i];
        total += count_runs(p, set->slots, set->num_slots, set->runs, set->num_runs);
    }
    if (p->has_aux)
        for (uint32_t a = 0; a < p->num_aux; a++)
            total += div_ceil(p->regions[p->aux_slots[a]].item_len, p->max_msg);
    return total;
}

void kvw__plan_wruns(kvw_plan_t *p, kvw_wrun_t *out)
{
    p->wruns = NULL;
    p->wrun_item = 0;
    if (!p->num_runs || p->layer_end <= p->layer_begin || !p->kv_per_layer)
        return;
    uint64_t item = p->regions[p->kv_slots[(size_t)p->layer_begin * p->kv_per_layer]].item_len;
    uint64_t longest = 0, before = 0;
    for (size_t r = 0; r < p->num_runs; r++)
        longest = p->runs[r].count > longest ? p->runs[r].count : longest;
    /* Zero-length writes and split runs keep the general path. */
    if (!item || longest > p->max_msg / item)
        return;
    for (size_t r = 0; r < p->num_runs; r++) {
        const kvw_run_t *run = &p->runs[r];
        out[r] = (kvw_wrun_t){run->src * item, run->dst * item, before, run->count * item};
        before += run->count * item;
    }
    p->wruns = out;
    p->wrun_item = item;
}

static void emit(const kvw_plan_region_t *g, uint64_t src_off, uint64_t dst_off, uint64_t len,
                 kvw_write_t *w)
{
    w->local_addr = g->local_addr + src_off;
    w->remote_addr = g->remote_addr + dst_off;
    w->lkey = g->lkey;
    w->rkey = g->rkey;
    w->len = (uint32_t)len;
}

/* The next write of `runs` over the regions of `slots`; 0 when the phase
 * is done. */
static int next_run_write(const kvw_plan_t *p, kvw_plan_cursor_t *c, const uint32_t *slots,
                          size_t num_slots, const kvw_run_t *runs, size_t num_runs, kvw_write_t *w)
{
    while (c->slot < num_slots) {
        if (c->run >= num_runs) {
            c->slot++;
            c->run = 0;
            continue;
        }
        const kvw_plan_region_t *g = &p->regions[slots[c->slot]];
        const kvw_run_t *r = &runs[c->run];
        uint64_t item = g->item_len, bytes = r->count * item;
        if (c->off == 0 && bytes <= p->max_msg) {
            /* The common case: the whole run is one write. */
            emit(g, r->src * item, r->dst * item, bytes, w);
            c->run++;
            return 1;
        }
        uint64_t len = bytes - c->off < p->max_msg ? bytes - c->off : p->max_msg;
        emit(g, r->src * item + c->off, r->dst * item + c->off, len, w);
        c->off += len;
        if (c->off == bytes) {
            c->off = 0;
            c->run++;
        }
        return 1;
    }
    return 0;
}

/* The next write of the state sets, set by set; 0 when all are done. */
static int next_state_write(const kvw_plan_t *p, kvw_plan_cursor_t *c, kvw_write_t *w)
{
    for (; c->set < p->num_state_sets; c->set++, c->slot = 0, c->run = 0, c->off = 0) {
        const kvw_plan_set_t *set = &p->state_sets[c->set];
        if (next_run_write(p, c, set->slots, set->num_slots, set->runs, set->num_runs, w))
            return 1;
    }
    return 0;
}

static int next_aux_write(const kvw_plan_t *p, kvw_plan_cursor_t *c, kvw_write_t *w)
{
    if (!p->has_aux || c->slot >= p->num_aux)
        return 0;
    const kvw_plan_region_t *g = &p->regions[p->aux_slots[c->slot]];
    uint64_t left = g->item_len - c->off;
    uint64_t len = left < p->max_msg ? left : p->max_msg;
    emit(g, p->aux_src * g->item_len + c->off, p->aux_dst * g->item_len + c->off, len, w);
    c->off += len;
    if (c->off == g->item_len) {
        c->off = 0;
        c->slot++;
    }
    return 1;
}

int kvw__plan_next(const kvw_plan_t *p, kvw_plan_cursor_t *c, kvw_write_t *w)
{
    for (;;) {
        int got = 0;
        if (c->phase == PHASE_KV)
            got = next_run_write(p, c, p->kv_slots + (size_t)p->layer_begin * p->kv_per_layer,
                                 (size_t)(p->layer_end - p->layer_begin) * p->kv_per_layer, p->runs,
                                 p->num_runs, w);
        else if (c->phase == PHASE_STATE)
            got = next_state_write(p, c, w);
        else if (c->phase == PHASE_AUX)
            got = next_aux_write(p, c, w);
        else
            return 0;
        if (got)
            return 1;
        c->phase++;
        c->set = 0;
        c->slot = 0;
        c->run = 0;
        c->off = 0;
    }
}
