#include "plan/plan.h"

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

uint64_t kvw__plan_count(const kvw_plan_t *p)
{
    uint64_t total = 0, longest = 0;
    for (size_t r = 0; r < p->num_runs; r++)
        longest = p->runs[r].count > longest ? p->runs[r].count : longest;
    for (uint32_t s = 0; s < 2 * p->num_layers; s++) {
        if (longest * p->regions[s].item_len <= p->max_msg) {
            total += p->num_runs; /* no run of this layer needs splitting */
            continue;
        }
        for (size_t r = 0; r < p->num_runs; r++)
            total += div_ceil(p->runs[r].count * p->regions[s].item_len, p->max_msg);
    }
    if (p->has_aux)
        for (uint32_t a = 0; a < p->num_aux; a++)
            total += div_ceil(p->regions[2 * p->num_layers + a].item_len, p->max_msg);
    return total;
}

/* KV segments are ordered layer by layer, K before V; regions[] holds all K
 * layers first, then all V layers. */
static const kvw_plan_region_t *kv_region(const kvw_plan_t *p, uint32_t seg)
{
    uint32_t layer = seg / 2;
    return &p->regions[(seg & 1) ? p->num_layers + layer : layer];
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

int kvw__plan_next(const kvw_plan_t *p, kvw_plan_cursor_t *c, kvw_write_t *w)
{
    uint32_t kv_segs = 2 * p->num_layers;
    while (c->seg < kv_segs) {
        if (c->run >= p->num_runs) {
            c->seg++;
            c->run = 0;
            continue;
        }
        const kvw_plan_region_t *g = kv_region(p, c->seg);
        const kvw_run_t *r = &p->runs[c->run];
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
    uint32_t aux = c->seg - kv_segs;
    if (!p->has_aux || aux >= p->num_aux)
        return 0;
    const kvw_plan_region_t *g = &p->regions[kv_segs + aux];
    uint64_t left = g->item_len - c->off;
    uint64_t len = left < p->max_msg ? left : p->max_msg;
    emit(g, p->aux_src * g->item_len + c->off, p->aux_dst * g->item_len + c->off, len, w);
    c->off += len;
    if (c->off == g->item_len) {
        c->off = 0;
        c->seg++;
    }
    return 1;
}
