/* SPDX-License-Identifier: Apache-2.0 */
/* Head slicing: prefill and decode run with different tensor parallelism,
 * so each rank's KV region holds a different range of the model's
 * attention heads. This file describes which heads a region holds and how
 * a page lays them out, decides which prefill rank sends each head of a
 * decode rank (exactly one, also when heads are replicated over ranks, as
 * with GQA or MLA), and walks the writes that move one head range from a
 * prefill region into a decode region: gather writes, several source
 * slices (one scatter/gather entry each) into one contiguous destination,
 * so that no transfer needs a write per token. Pure: no I/O, no
 * allocation.
 *
 * Page layouts (one region = one layer's K, V or latent cache):
 *   NHD  token-major, [page][token][head][dim] (sglang's MHA pools): a
 *        token's row holds the rank's heads side by side, so a head range
 *        is one slice per token, strided by the row.
 *   HND  head-major per page, [page][head][token][dim] (vLLM's HND): a
 *        head range is one slice per page, strided by the page.
 * Either way a slice ("unit") sits at a constant stride from the next one
 * over a run of contiguous pages, which is what the walk below relies on. */
#ifndef KVW_PLAN_HEADS_H
#define KVW_PLAN_HEADS_H

#include <stddef.h>
#include <stdint.h>

#include "plan/plan.h"

enum {
    KVW_HEADS_NHD = 0, /* token-major [token][head][dim] */
    KVW_HEADS_HND = 1, /* head-major per page [head][token][dim] */
    /* Scatter/gather entries a gather write uses at most, whatever the
     * device offers (mlx5 offers 30, rxe 32). */
    KVW_HEADS_MAX_SGE = 32,
};

/* Which heads one rank's region holds. total == 0: not described (the
 * region is moved whole, as before head slicing). */
typedef struct kvw_heads {
    uint32_t total;       /* the model's KV heads over all ranks (MLA: 1) */
    uint32_t first;       /* this rank holds heads [first, first + count) */
    uint32_t count;       /* replicated heads (GQA, MLA): the same range on several ranks */
    uint32_t head_bytes;  /* one head of one token: head_dim * element size */
    uint32_t page_tokens; /* tokens per page */
    uint32_t order;       /* KVW_HEADS_NHD or KVW_HEADS_HND */
} kvw_heads_t;

/* A range of heads, [first, first + count); count 0: none. */
typedef struct kvw_head_range {
    uint32_t first, count;
} kvw_head_range_t;

/* A description is valid, and its page (item_len bytes) holds exactly
 * page_tokens * count * head_bytes. 0, or -1 with the reason in why. */
int kvw__heads_check(const kvw_heads_t *h, uint64_t item_len, char *why, size_t why_size);

/* A decode group that learns its heads from prefill's handshake (the
 * public kvw_group_heads_t's learning entry, docs/head-slicing.md): it
 * knows only its page (page_tokens, order); total, count and head_bytes
 * are 0 until learned. */
static inline int kvw__heads_learning(const kvw_heads_t *h)
{
    return !h->total && !h->first && !h->count && !h->head_bytes && h->page_tokens;
}

/* A decode rank's heads learned from a prefill rank's description, as
 * sglang sizes its pools: decode's pages hold page_tokens tokens (prefill's
 * too) in the same order, and its item length (item_len bytes a page)
 * holds n = item_len / (page_tokens * prefill's head_bytes) heads, so n
 * must divide exactly; decode is rank tp_rank of tp_size ranks splitting
 * the model's heads: first = tp_rank * n when the model has at least
 * tp_size heads (n * tp_size must be the model's), else each head is
 * replicated (n 1, tp_size a multiple of the heads) and first = tp_rank *
 * total / tp_size. 0 with *out, or -1 with the numbers that disagree in
 * why (never a guess). */
int kvw__heads_learn(const kvw_heads_t *prefill, uint32_t page_tokens, uint32_t order,
                     uint64_t item_len, uint32_t tp_rank, uint32_t tp_size, kvw_heads_t *out,
                     char *why, size_t why_size);

/* Two sides can exchange heads when they agree on what the model is: the
 * head count, the bytes of a head, the page size and the page layout (a
 * described region never pairs with an undescribed one). Their head
 * ranges may differ. 0, or -1 with what differs ("peer ... , ours ...")
 * in why. */
int kvw__heads_compare(const kvw_heads_t *ours, const kvw_heads_t *peer, char *why,
                       size_t why_size);

/* Who sends decode's heads: for each of the n prefill ranks src[i], the
 * range of dst's heads it owes (count 0: it owes nothing, e.g. a GQA
 * replica whose heads another rank sends). Each head of dst is owed by
 * exactly one rank: the one that owed the head before it if it holds this
 * one too, else the first rank (in src's order) holding it, which keeps
 * every rank's share one contiguous range. The descriptions must compare
 * equal. 0, or -1 when a head of dst is held by no rank (why says which). */
int kvw__heads_assign(const kvw_heads_t *dst, const kvw_heads_t *src, uint32_t n,
                      kvw_head_range_t *out, char *why, size_t why_size);

/* How one head range of a source region maps onto a destination region,
 * in bytes: unit k of the source (a token for NHD, a page for HND, counted
 * from page 0) is slice bytes at k * src_stride + src_off, and lands at
 * k' * dst_stride + dst_off for the destination's unit k'. */
typedef struct kvw_heads_geom {
    uint64_t src_stride, dst_stride;
    uint64_t src_off, dst_off;
    uint64_t slice;
    uint32_t units_per_page; /* NHD: page_tokens; HND: 1 */
} kvw_heads_geom_t;

/* The geometry for sending range (which both must hold) from src to dst.
 * 0, or -1 with why. */
int kvw__heads_geom(const kvw_heads_t *src, const kvw_heads_t *dst, kvw_head_range_t range,
                    kvw_heads_geom_t *g, char *why, size_t why_size);

/* How a geometry's writes look:
 *   COPY    the slice is the whole unit on both sides: contiguous pages are
 *           contiguous bytes, one entry per write (as without slicing).
 *   GATHER  contiguous destination, strided source: a write gathers up to
 *           max_sge slices (decode holds fewer heads than prefill).
 *   ROWS    strided destination: one write per slice (decode holds more
 *           heads than this prefill rank sends), unless the caller lands
 *           the slices in a buffer of its own (kvw__heads_landing). */
enum { KVW_HEADS_COPY = 0, KVW_HEADS_GATHER = 1, KVW_HEADS_ROWS = 2 };
int kvw__heads_mode(const kvw_heads_geom_t *g);

/* The geometry that lands what g sends contiguously (destination unit k at
 * k * slice), for a receiver that then scatters it into its rows with one
 * 2D copy: height slices of slice bytes from pitch slice to pitch
 * g->dst_stride, from g->dst_off. */
void kvw__heads_landing(const kvw_heads_geom_t *g, kvw_heads_geom_t *landing);

/* One region pair's head-sliced transfer over page runs. */
typedef struct kvw_heads_plan {
    kvw_heads_geom_t geom;
    uint64_t local_addr, remote_addr;
    uint32_t lkey, rkey;
    const kvw_run_t *runs; /* pages, as kvw__plan_runs groups them */
    size_t num_runs;
    uint32_t max_sge; /* entries per write: 1..KVW_HEADS_MAX_SGE */
    uint64_t max_msg; /* bytes per write */
} kvw_heads_plan_t;

typedef struct kvw_heads_cursor {
    size_t run;
    uint64_t unit; /* units of the current run already emitted */
    uint64_t off;  /* bytes of the current unit already emitted (a unit over max_msg) */
} kvw_heads_cursor_t;

typedef struct kvw_sge {
    uint64_t addr;
    uint32_t len;
} kvw_sge_t;

/* One write: num_sge local entries (lkey: the plan's) gathered, in order,
 * into len contiguous bytes at remote_addr (rkey: the plan's). */
typedef struct kvw_gwrite {
    uint64_t remote_addr;
    uint32_t len, num_sge;
    kvw_sge_t sge[KVW_HEADS_MAX_SGE];
} kvw_gwrite_t;

/* The next write, advancing the cursor (zeroed: the beginning). A write
 * takes consecutive slices for as long as the destination stays
 * contiguous (across runs too: only the destination's pages need be
 * contiguous to gather), up to max_sge entries and max_msg bytes; slices
 * contiguous at the source share an entry. 0 when done. */
int kvw__heads_next(const kvw_heads_plan_t *p, kvw_heads_cursor_t *c, kvw_gwrite_t *w);
/* Writes kvw__heads_next will produce (walks the plan: one step per write
 * for COPY, per slice otherwise). */
uint64_t kvw__heads_count(const kvw_heads_plan_t *p);
/* Slices (tokens for NHD, pages for HND) the plan moves: the writes of
 * "one write per token row". */
uint64_t kvw__heads_units(const kvw_heads_plan_t *p);

#endif
