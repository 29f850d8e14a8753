/* SPDX-License-Identifier: Apache-2.0 */
#include "plan/heads.h"

#include <stdbool.h>
#include <stdio.h>

static const char *order_name(uint32_t order)
{
    return order == KVW_HEADS_NHD ? "NHD" : order == KVW_HEADS_HND ? "HND" : "unknown";
}

int kvw__heads_check(const kvw_heads_t *h, uint64_t item_len, char *why, size_t why_size)
{
    if (!h->total)
        return 0; /* not described: the region moves whole */
    if (h->order > KVW_HEADS_HND || !h->count || !h->head_bytes || !h->page_tokens ||
        (uint64_t)h->first + h->count > h->total) {
        snprintf(why, why_size,
                 "heads [%u, %u) of %u, %u bytes a head, %u tokens a page, order %u: need "
                 "1 or more heads inside the model's, bytes and tokens above 0, NHD or HND",
                 h->first, h->first + h->count, h->total, h->head_bytes, h->page_tokens, h->order);
        return -1;
    }
    uint64_t row = (uint64_t)h->count * h->head_bytes;
    if (row > UINT64_MAX / h->page_tokens || row * h->page_tokens != item_len) {
        snprintf(why, why_size,
                 "a page of %u tokens x %u heads x %u bytes is not the region's item length %llu",
                 h->page_tokens, h->count, h->head_bytes, (unsigned long long)item_len);
        return -1;
    }
    return 0;
}

int kvw__heads_compare(const kvw_heads_t *ours, const kvw_heads_t *peer, char *why, size_t why_size)
{
    if (!ours->total != !peer->total) {
        snprintf(why, why_size, "peer %s its heads, ours %s",
                 peer->total ? "describes" : "does not describe",
                 ours->total ? "does" : "does not");
        return -1;
    }
    if (!ours->total)
        return 0;
    const char *what = NULL;
    uint32_t a = 0, b = 0;
    if (ours->total != peer->total)
        what = "model KV heads", a = peer->total, b = ours->total;
    else if (ours->head_bytes != peer->head_bytes)
        what = "bytes per head", a = peer->head_bytes, b = ours->head_bytes;
    else if (ours->page_tokens != peer->page_tokens)
        what = "tokens per page", a = peer->page_tokens, b = ours->page_tokens;
    if (what) {
        snprintf(why, why_size, "%s: peer %u, ours %u", what, a, b);
        return -1;
    }
    if (ours->order != peer->order) {
        snprintf(why, why_size, "page layout: peer %s, ours %s", order_name(peer->order),
                 order_name(ours->order));
        return -1;
    }
    return 0;
}

int kvw__heads_learn(const kvw_heads_t *prefill, uint32_t page_tokens, uint32_t order,
                     uint64_t item_len, uint32_t tp_rank, uint32_t tp_size, kvw_heads_t *out,
                     char *why, size_t why_size)
{
    uint32_t total = prefill->total, hb = prefill->head_bytes;
    if (prefill->page_tokens != page_tokens || prefill->order != order) {
        snprintf(why, why_size, "prefill's pages hold %u tokens (%s), decode's %u (%s)",
                 prefill->page_tokens, order_name(prefill->order), page_tokens, order_name(order));
        return -1;
    }
    if (!tp_size || tp_rank >= tp_size) {
        snprintf(why, why_size, "decode is attention TP rank %u of %u", tp_rank, tp_size);
        return -1;
    }
    uint64_t head_page = (uint64_t)page_tokens * hb;
    if (!total || !head_page || !item_len || item_len % head_page) {
        snprintf(why, why_size,
                 "decode's item length %llu is no multiple of %u tokens x %u bytes a head "
                 "(prefill's)",
                 (unsigned long long)item_len, page_tokens, hb);
        return -1;
    }
    uint64_t n = item_len / head_page;
    uint32_t first;
    if (total >= tp_size) {
        if (n > total || n * tp_size != total) { /* n > total first: no overflow */
            snprintf(why, why_size,
                     "decode's item length %llu: %llu heads (of %u B x %u tokens) x %u ranks "
                     "is not the model's %u",
                     (unsigned long long)item_len, (unsigned long long)n, hb, page_tokens, tp_size,
                     total);
            return -1;
        }
        first = tp_rank * (uint32_t)n;
    } else {
        if (n != 1 || tp_size % total) {
            if (n != 1)
                snprintf(why, why_size,
                         "the model's %u heads over %u decode ranks: each holds 1 of them, but "
                         "decode's item length %llu holds %llu",
                         total, tp_size, (unsigned long long)item_len, (unsigned long long)n);
            else
                snprintf(why, why_size,
                         "the model's %u heads do not replicate evenly over %u decode ranks", total,
                         tp_size);
            return -1;
        }
        first = (uint32_t)((uint64_t)tp_rank * total / tp_size);
    }
    *out = (kvw_heads_t){total, first, (uint32_t)n, hb, page_tokens, order};
    return 0;
}

static bool holds(const kvw_heads_t *h, uint32_t head)
{
    return head >= h->first && head - h->first < h->count;
}

int kvw__heads_assign(const kvw_heads_t *dst, const kvw_heads_t *src, uint32_t n,
                      kvw_head_range_t *out, char *why, size_t why_size)
{
    for (uint32_t i = 0; i < n; i++)
        out[i] = (kvw_head_range_t){0, 0};
    uint32_t prev = UINT32_MAX;
    for (uint32_t h = dst->first; h - dst->first < dst->count; h++) {
        uint32_t owner = prev != UINT32_MAX && holds(&src[prev], h) ? prev : UINT32_MAX;
        for (uint32_t i = 0; owner == UINT32_MAX && i < n; i++)
            owner = holds(&src[i], h) ? i : UINT32_MAX;
        if (owner == UINT32_MAX) {
            snprintf(why, why_size,
                     "head %u of decode's [%u, %u) is held by none of %u prefill ranks", h,
                     dst->first, dst->first + dst->count, n);
            return -1;
        }
        if (!out[owner].count)
            out[owner].first = h;
        out[owner].count++;
        prev = owner;
    }
    return 0;
}

int kvw__heads_geom(const kvw_heads_t *src, const kvw_heads_t *dst, kvw_head_range_t range,
                    kvw_heads_geom_t *g, char *why, size_t why_size)
{
    uint32_t last = range.first + range.count - 1;
    if (!range.count || last < range.first || !holds(src, range.first) || !holds(src, last) ||
        !holds(dst, range.first) || !holds(dst, last)) {
        snprintf(why, why_size, "heads [%u, %u): prefill holds [%u, %u), decode [%u, %u)",
                 range.first, range.first + range.count, src->first, src->first + src->count,
                 dst->first, dst->first + dst->count);
        return -1;
    }
    /* NHD: the unit is a token row of count heads; HND: a page of count
     * heads, each page_tokens rows of one head. */
    uint64_t head = src->head_bytes;
    if (src->order == KVW_HEADS_HND)
        head *= src->page_tokens;
    *g = (kvw_heads_geom_t){.src_stride = src->count * head,
                            .dst_stride = dst->count * head,
                            .src_off = (range.first - src->first) * head,
                            .dst_off = (range.first - dst->first) * head,
                            .slice = range.count * head,
                            .units_per_page = src->order == KVW_HEADS_HND ? 1 : src->page_tokens};
    return 0;
}

int kvw__heads_mode(const kvw_heads_geom_t *g)
{
    if (g->slice != g->dst_stride)
        return KVW_HEADS_ROWS;
    return g->slice == g->src_stride ? KVW_HEADS_COPY : KVW_HEADS_GATHER;
}

void kvw__heads_landing(const kvw_heads_geom_t *g, kvw_heads_geom_t *landing)
{
    *landing = *g;
    landing->dst_stride = g->slice;
    landing->dst_off = 0;
}

int kvw__heads_next(const kvw_heads_plan_t *p, kvw_heads_cursor_t *c, kvw_gwrite_t *w)
{
    const kvw_heads_geom_t *g = &p->geom;
    uint32_t cap = p->max_sge < 1                   ? 1
                   : p->max_sge > KVW_HEADS_MAX_SGE ? KVW_HEADS_MAX_SGE
                                                    : p->max_sge;
    uint64_t max = p->max_msg < UINT32_MAX ? p->max_msg : UINT32_MAX;
    bool both = g->slice == g->src_stride && g->slice == g->dst_stride;
    uint64_t dst_end = 0;
    w->len = 0;
    w->num_sge = 0;
    while (c->run < p->num_runs) {
        const kvw_run_t *r = &p->runs[c->run];
        uint64_t units = r->count * g->units_per_page;
        if (c->unit >= units) {
            c->run++;
            c->unit = 0;
            continue;
        }
        uint64_t src = p->local_addr + (r->src * g->units_per_page + c->unit) * g->src_stride +
                       g->src_off + c->off;
        uint64_t dst = p->remote_addr + (r->dst * g->units_per_page + c->unit) * g->dst_stride +
                       g->dst_off + c->off;
        if (w->len && dst != dst_end)
            break; /* the destination jumps: a write lands on contiguous bytes */
        uint64_t room = max - w->len;
        kvw_sge_t *last = w->num_sge ? &w->sge[w->num_sge - 1] : NULL;
        bool extend = last && last->addr + last->len == src;
        /* Contiguous on both sides: the rest of the run is one stretch. */
        uint64_t left = both ? (units - c->unit) * g->slice - c->off : g->slice - c->off;
        uint64_t take = left < room ? left : room;
        /* A new entry takes a whole slice, unless the slice alone is more
         * than a write holds (or both sides are contiguous: then bytes are
         * bytes, as without slicing). */
        if (!room || (!extend && (w->num_sge == cap || (!both && take < left && w->len))))
            break;
        if (!w->len)
            w->remote_addr = dst;
        if (extend)
            last->len += (uint32_t)take;
        else
            w->sge[w->num_sge++] = (kvw_sge_t){src, (uint32_t)take};
        w->len += (uint32_t)take;
        dst_end = dst + take;
        uint64_t done = c->off + take;
        c->unit += done / g->slice;
        c->off = done % g->slice;
    }
    return w->len != 0;
}

uint64_t kvw__heads_count(const kvw_heads_plan_t *p)
{
    kvw_heads_cursor_t c = {0, 0, 0};
    kvw_gwrite_t w;
    uint64_t n = 0;
    while (kvw__heads_next(p, &c, &w))
        n++;
    return n;
}

uint64_t kvw__heads_units(const kvw_heads_plan_t *p)
{
    uint64_t n = 0;
    for (size_t r = 0; r < p->num_runs; r++)
        n += p->runs[r].count * p->geom.units_per_page;
    return n;
}
