/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/plan/heads.c: head descriptions, who sends which
 * heads (GQA and MLA replication), and the gather writes of a head-sliced
 * transfer, their counts and entries, and the bytes they move: each test
 * deployment runs its writes on host memory (a write copies its entries,
 * in order, to its remote address, as the NIC does) and checks every byte
 * of every head on every decode rank. The NIC deployments post the same
 * writes as multi-entry RDMA WRITEs on the fake NIC (tests/support), over
 * src/verbs QPs, one QP pair per prefill rank and decode rank. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/heads.h"
#include "plan/layout.h"
#include "support/fake_nic.h"
#include "verbs/device.h"
#include "verbs/qp.h"

#include <time.h>

/* ------------------------------------------------------------ helpers */

/* The heads rank r of tp ranks holds of a model with total KV heads: an
 * equal share, or when there are fewer heads than ranks one head held by
 * tp / total ranks (GQA replication; MLA is total 1). */
static kvw_heads_t rank_heads(uint32_t total, uint32_t tp, uint32_t r, uint32_t head_bytes,
                              uint32_t page_tokens, uint32_t order)
{
    kvw_heads_t h = {total, 0, 0, head_bytes, page_tokens, order};
    if (total >= tp) {
        h.count = total / tp;
        h.first = r * h.count;
    } else {
        h.count = 1;
        h.first = r / (tp / total);
    }
    return h;
}

static uint64_t page_bytes(const kvw_heads_t *h)
{
    return (uint64_t)h->page_tokens * h->count * h->head_bytes;
}

/* Byte b of head `head` of the request's token `token` (layer 0), as every
 * prefill rank holding the head has it. */
static uint8_t value(uint64_t token, uint32_t head, uint32_t b)
{
    uint64_t x = token * 1000003u + head * 7919u + b * 31u + 17;
    return (uint8_t)(x ^ (x >> 8) ^ (x >> 16));
}

/* Offset of (token in page, local head, byte) in a page. */
static uint64_t in_page(const kvw_heads_t *h, uint32_t t, uint32_t k, uint32_t b)
{
    if (h->order == KVW_HEADS_NHD)
        return ((uint64_t)t * h->count + k) * h->head_bytes + b;
    return ((uint64_t)k * h->page_tokens + t) * h->head_bytes + b;
}

static void fill_source(uint8_t *mem, const kvw_heads_t *h, const uint64_t *pages, size_t n)
{
    for (size_t i = 0; i < n; i++)
        for (uint32_t t = 0; t < h->page_tokens; t++)
            for (uint32_t k = 0; k < h->count; k++)
                for (uint32_t b = 0; b < h->head_bytes; b++)
                    mem[pages[i] * page_bytes(h) + in_page(h, t, k, b)] =
                        value(i * h->page_tokens + t, h->first + k, b);
}

typedef struct stats {
    uint64_t writes, sges, units;
} stats_t;

/* The fake NIC deployments: prefill's regions on fake0, decode's on fake1,
 * a QP pair per (prefill rank, decode rank) that exchanges heads. NULL:
 * writes are copied on the host. */
typedef struct nic {
    kvw_dev_t *dev[2];
    kvw_config_t cfg;
    uint32_t max_sge;
} nic_t;

static nic_t *nic;

/* Register buf on a side's device (0 prefill, 1 decode); NULL without a
 * NIC. */
static struct ibv_mr *reg(int side, void *buf, size_t len)
{
    if (!nic)
        return NULL;
    struct ibv_mr *mr = fake_nic_ops.reg_mr(nic->dev[side]->pd, buf, len,
                                            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    assert_non_null(mr);
    return mr;
}

/* Wait for one completion on a's CQ: success, of len bytes. */
static void wait_one(kvw_qp_t *a, uint32_t len)
{
    struct ibv_wc wc;
    int got = 0;
    for (int spin = 0; !got && spin < 1000000; spin++) {
        got = fake_nic_ops.poll_cq(a->cq, 1, &wc);
        if (!got)
            nanosleep(&(struct timespec){0, 1000}, NULL);
    }
    assert_int_equal(got, 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.byte_len, len);
}

enum { CHAIN = 32 };

/* Post every write of p on a fresh QP pair, in chains of CHAIN WRs whose
 * last is signaled, waiting for each chain's completion. */
static uint64_t post_all(const kvw_heads_plan_t *p)
{
    kvw_qp_t *a, *b;
    assert_int_equal(
        kvw__qp_create_sge(nic->dev[0], NULL, NULL, 2 * CHAIN, 4, nic->max_sge, false, &a), KVW_OK);
    assert_int_equal(kvw__qp_create_sge(nic->dev[1], NULL, NULL, 2 * CHAIN, 4, 1, true, &b),
                     KVW_OK);
    assert_int_equal(a->max_send_sge, nic->max_sge);
    kvw_qp_info_t ia, ib;
    kvw__qp_local_info(a, &ia);
    kvw__qp_local_info(b, &ib);
    assert_int_equal(kvw__qp_connect(a, &ib, &nic->cfg), KVW_OK);
    assert_int_equal(kvw__qp_connect(b, &ia, &nic->cfg), KVW_OK);
    kvw_heads_cursor_t c;
    memset(&c, 0, sizeof(c));
    static struct ibv_sge sge[CHAIN][KVW_HEADS_MAX_SGE];
    struct ibv_send_wr wr[CHAIN];
    kvw_gwrite_t w;
    uint64_t n = 0;
    uint32_t k = 0;
    for (int more = 1; more;) {
        more = kvw__heads_next(p, &c, &w);
        if (more) {
            for (uint32_t i = 0; i < w.num_sge; i++)
                sge[k][i] = (struct ibv_sge){w.sge[i].addr, w.sge[i].len, p->lkey};
            wr[k] = (struct ibv_send_wr){.wr_id = n++,
                                         .sg_list = sge[k],
                                         .num_sge = (int)w.num_sge,
                                         .opcode = IBV_WR_RDMA_WRITE,
                                         .next = NULL};
            wr[k].wr.rdma.remote_addr = w.remote_addr;
            wr[k].wr.rdma.rkey = p->rkey;
            if (k)
                wr[k - 1].next = &wr[k];
            k++;
        }
        if (k && (k == CHAIN || !more)) {
            wr[k - 1].send_flags = IBV_SEND_SIGNALED;
            struct ibv_send_wr *bad = NULL;
            assert_int_equal(fake_nic_ops.post_send(a->qp, wr, &bad), 0);
            uint32_t len = 0;
            for (int i = 0; i < wr[k - 1].num_sge; i++)
                len += wr[k - 1].sg_list[i].length;
            wait_one(a, len);
            k = 0;
        }
    }
    kvw__qp_destroy(a);
    kvw__qp_destroy(b);
    return n;
}

/* Run a plan's writes as the NIC would, checking each against the plan's
 * limits, and that count predicted them. */
static void execute(const kvw_heads_plan_t *p, stats_t *s)
{
    if (nic) {
        uint64_t n = post_all(p);
        assert_int_equal(kvw__heads_count(p), n);
        s->writes += n;
        s->units += kvw__heads_units(p);
        return;
    }
    kvw_heads_cursor_t c;
    memset(&c, 0, sizeof(c));
    kvw_gwrite_t w;
    uint64_t n = 0, bytes = 0;
    uint32_t cap = p->max_sge < KVW_HEADS_MAX_SGE ? p->max_sge : KVW_HEADS_MAX_SGE;
    while (kvw__heads_next(p, &c, &w)) {
        assert_true(w.num_sge >= 1 && w.num_sge <= cap);
        assert_true(w.len >= 1 && w.len <= p->max_msg);
        uint8_t *dst = (uint8_t *)(uintptr_t)w.remote_addr;
        uint64_t sum = 0;
        for (uint32_t i = 0; i < w.num_sge; i++) {
            memcpy(dst + sum, (const void *)(uintptr_t)w.sge[i].addr, w.sge[i].len);
            sum += w.sge[i].len;
        }
        assert_int_equal(sum, w.len);
        bytes += w.len;
        s->sges += w.num_sge;
        n++;
    }
    assert_int_equal(kvw__heads_next(p, &c, &w), 0); /* done stays done */
    assert_int_equal(kvw__heads_count(p), n);
    assert_int_equal(bytes, kvw__heads_units(p) * p->geom.slice);
    s->writes += n;
    s->units += kvw__heads_units(p);
}

enum { MAX_RANKS = 8, MAX_PAGES = 64 };

typedef struct deploy {
    uint32_t total, prefill_tp, decode_tp, head_bytes, page_tokens, order;
    uint32_t max_sge;
    uint64_t max_msg;
    int landing; /* strided destinations land contiguously, then a 2D copy */
    size_t num_pages;
    const uint64_t *src_pages, *dst_pages;
    uint64_t region_pages; /* pages each region holds */
} deploy_t;

/* Every decode rank receives its heads from the prefill ranks that owe
 * them; every byte of every head of every destination page is checked, and
 * every other byte of decode's regions is left alone. */
static stats_t run_deploy(const deploy_t *d)
{
    stats_t s = {0, 0, 0};
    uint8_t *src[MAX_RANKS];
    struct ibv_mr *src_mr[MAX_RANKS];
    kvw_heads_t ph[MAX_RANKS];
    for (uint32_t r = 0; r < d->prefill_tp; r++) {
        ph[r] = rank_heads(d->total, d->prefill_tp, r, d->head_bytes, d->page_tokens, d->order);
        char why[200];
        assert_int_equal(kvw__heads_check(&ph[r], page_bytes(&ph[r]), why, sizeof(why)), 0);
        src[r] = malloc(d->region_pages * page_bytes(&ph[r]));
        assert_non_null(src[r]);
        memset(src[r], 0xee, d->region_pages * page_bytes(&ph[r]));
        fill_source(src[r], &ph[r], d->src_pages, d->num_pages);
        src_mr[r] = reg(0, src[r], d->region_pages * page_bytes(&ph[r]));
    }
    kvw_run_t runs[MAX_PAGES];
    size_t num_runs = kvw__plan_runs(d->src_pages, d->dst_pages, d->num_pages, runs);
    for (uint32_t q = 0; q < d->decode_tp; q++) {
        kvw_heads_t dh =
            rank_heads(d->total, d->decode_tp, q, d->head_bytes, d->page_tokens, d->order);
        uint64_t pb = page_bytes(&dh);
        uint8_t *dst = malloc(d->region_pages * pb);
        assert_non_null(dst);
        memset(dst, 0x55, d->region_pages * pb);
        struct ibv_mr *dst_mr = reg(1, dst, d->region_pages * pb);
        kvw_head_range_t owed[MAX_RANKS];
        char why[200];
        assert_int_equal(kvw__heads_assign(&dh, ph, d->prefill_tp, owed, why, sizeof(why)), 0);
        uint32_t heads = 0;
        for (uint32_t r = 0; r < d->prefill_tp; r++) {
            heads += owed[r].count;
            if (!owed[r].count)
                continue;
            assert_int_equal(kvw__heads_compare(&dh, &ph[r], why, sizeof(why)), 0);
            kvw_heads_plan_t p = {.local_addr = (uintptr_t)src[r],
                                  .remote_addr = (uintptr_t)dst,
                                  .runs = runs,
                                  .num_runs = num_runs,
                                  .lkey = nic ? src_mr[r]->lkey : 0,
                                  .rkey = nic ? dst_mr->rkey : 0,
                                  .max_sge = d->max_sge,
                                  .max_msg = d->max_msg};
            assert_int_equal(kvw__heads_geom(&ph[r], &dh, owed[r], &p.geom, why, sizeof(why)), 0);
            if (!d->landing || kvw__heads_mode(&p.geom) != KVW_HEADS_ROWS) {
                execute(&p, &s);
                continue;
            }
            /* Land the slices contiguously in a buffer of decode's, in
             * destination-page order, then scatter them with a 2D copy. */
            kvw_heads_geom_t rows = p.geom, land;
            kvw__heads_landing(&rows, &land);
            assert_int_equal(kvw__heads_mode(&land), KVW_HEADS_COPY);
            uint8_t *buf = malloc(d->region_pages * page_bytes(&dh));
            assert_non_null(buf);
            struct ibv_mr *buf_mr = reg(1, buf, d->region_pages * page_bytes(&dh));
            p.geom = land;
            p.remote_addr = (uintptr_t)buf;
            p.rkey = nic ? buf_mr->rkey : 0;
            execute(&p, &s);
            if (nic)
                assert_int_equal(fake_nic_ops.dereg_mr(buf_mr), 0);
            for (size_t i = 0; i < d->num_pages; i++)
                for (uint64_t u = 0; u < land.units_per_page; u++) {
                    uint64_t k = d->dst_pages[i] * land.units_per_page + u;
                    memcpy(dst + k * rows.dst_stride + rows.dst_off, buf + k * land.slice,
                           land.slice);
                }
            free(buf);
        }
        assert_int_equal(heads, dh.count); /* every head owed exactly once */
        uint8_t *want = malloc(d->region_pages * pb);
        assert_non_null(want);
        memset(want, 0x55, d->region_pages * pb);
        fill_source(want, &dh, d->dst_pages, d->num_pages);
        assert_memory_equal(dst, want, d->region_pages * pb);
        free(want);
        if (nic)
            assert_int_equal(fake_nic_ops.dereg_mr(dst_mr), 0);
        free(dst);
    }
    for (uint32_t r = 0; r < d->prefill_tp; r++) {
        if (nic)
            assert_int_equal(fake_nic_ops.dereg_mr(src_mr[r]), 0);
        free(src[r]);
    }
    return s;
}

static uint64_t contiguous[MAX_PAGES], fragmented[MAX_PAGES], shuffled[MAX_PAGES];

static void pages_setup(void)
{
    for (uint64_t i = 0; i < MAX_PAGES; i++) {
        contiguous[i] = 2 + i;
        fragmented[i] = 2 * i + 1; /* never two in a row */
        shuffled[i] = (i * 37 + 5) % MAX_PAGES;
    }
}

static uint64_t div_ceil(uint64_t a, uint64_t b)
{
    return (a + b - 1) / b;
}

/* A Llama-like layout: 8 KV heads of 128 bytes. */
static deploy_t llama(uint32_t prefill_tp, uint32_t decode_tp, uint32_t order, uint32_t page_tokens,
                      uint32_t max_sge, size_t num_pages)
{
    pages_setup();
    return (deploy_t){.total = 8,
                      .prefill_tp = prefill_tp,
                      .decode_tp = decode_tp,
                      .head_bytes = 128,
                      .page_tokens = page_tokens,
                      .order = order,
                      .max_sge = max_sge,
                      .max_msg = 1u << 30,
                      .num_pages = num_pages,
                      .src_pages = contiguous,
                      .dst_pages = contiguous,
                      .region_pages = 3 * MAX_PAGES + 2};
}

/* ------------------------------------------------------------ descriptions */

static void test_check(void **state)
{
    (void)state;
    char why[200];
    kvw_heads_t h = {8, 4, 4, 128, 16, KVW_HEADS_NHD};
    assert_int_equal(kvw__heads_check(&h, 16 * 4 * 128, why, sizeof(why)), 0);
    assert_int_equal(kvw__heads_check(&h, 16 * 8 * 128, why, sizeof(why)), -1);
    assert_non_null(strstr(why, "item length 16384"));
    h.first = 5; /* [5, 9) of 8 */
    assert_int_equal(kvw__heads_check(&h, 16 * 4 * 128, why, sizeof(why)), -1);
    assert_non_null(strstr(why, "[5, 9) of 8"));
    h = (kvw_heads_t){8, 0, 0, 128, 16, KVW_HEADS_NHD};
    assert_int_equal(kvw__heads_check(&h, 0, why, sizeof(why)), -1);
    h = (kvw_heads_t){8, 0, 8, 128, 16, 2};
    assert_int_equal(kvw__heads_check(&h, 16 * 8 * 128, why, sizeof(why)), -1);
    /* Not described: anything goes, the region moves whole. */
    h = (kvw_heads_t){0, 0, 0, 0, 0, 0};
    assert_int_equal(kvw__heads_check(&h, 12345, why, sizeof(why)), 0);
}

static void test_compare(void **state)
{
    (void)state;
    char why[200];
    kvw_heads_t ours = {8, 0, 4, 128, 16, KVW_HEADS_NHD};
    kvw_heads_t peer = {8, 0, 8, 128, 16, KVW_HEADS_NHD};
    /* Different head ranges are what slicing is for. */
    assert_int_equal(kvw__heads_compare(&ours, &peer, why, sizeof(why)), 0);
    peer.total = 16;
    assert_int_equal(kvw__heads_compare(&ours, &peer, why, sizeof(why)), -1);
    assert_string_equal(why, "model KV heads: peer 16, ours 8");
    peer.total = 8;
    peer.head_bytes = 256;
    assert_int_equal(kvw__heads_compare(&ours, &peer, why, sizeof(why)), -1);
    assert_string_equal(why, "bytes per head: peer 256, ours 128");
    peer.head_bytes = 128;
    peer.page_tokens = 64;
    assert_int_equal(kvw__heads_compare(&ours, &peer, why, sizeof(why)), -1);
    assert_string_equal(why, "tokens per page: peer 64, ours 16");
    peer.page_tokens = 16;
    peer.order = KVW_HEADS_HND;
    assert_int_equal(kvw__heads_compare(&ours, &peer, why, sizeof(why)), -1);
    assert_string_equal(why, "page layout: peer HND, ours NHD");
    kvw_heads_t none = {0, 0, 0, 0, 0, 0};
    assert_int_equal(kvw__heads_compare(&ours, &none, why, sizeof(why)), -1);
    assert_string_equal(why, "peer does not describe its heads, ours does");
    assert_int_equal(kvw__heads_compare(&none, &none, why, sizeof(why)), 0);
}

/* ------------------------------------------------------------ who sends */

static void assign_all(uint32_t total, uint32_t ptp, uint32_t dtp, uint32_t q,
                       kvw_head_range_t *out)
{
    kvw_heads_t p[MAX_RANKS];
    for (uint32_t r = 0; r < ptp; r++)
        p[r] = rank_heads(total, ptp, r, 128, 16, KVW_HEADS_NHD);
    kvw_heads_t d = rank_heads(total, dtp, q, 128, 16, KVW_HEADS_NHD);
    char why[200];
    assert_int_equal(kvw__heads_assign(&d, p, ptp, out, why, sizeof(why)), 0);
}

static void assert_range(kvw_head_range_t r, uint32_t first, uint32_t count)
{
    assert_int_equal(r.count, count);
    if (count)
        assert_int_equal(r.first, first);
}

static void test_assign_splits(void **state)
{
    (void)state;
    kvw_head_range_t o[MAX_RANKS];
    /* 1:2, decode rank 1 takes heads [4, 8) of prefill's 8. */
    assign_all(8, 1, 2, 1, o);
    assert_range(o[0], 4, 4);
    /* 2:1: decode's 8 heads from two ranks. */
    assign_all(8, 2, 1, 0, o);
    assert_range(o[0], 0, 4);
    assert_range(o[1], 4, 4);
    /* 4:1 */
    assign_all(8, 4, 1, 0, o);
    for (uint32_t r = 0; r < 4; r++)
        assert_range(o[r], 2 * r, 2);
    /* 8:2, decode rank 1 holds [4, 8): prefill ranks 4..7 owe one each. */
    assign_all(8, 8, 2, 1, o);
    for (uint32_t r = 0; r < 4; r++)
        assert_range(o[r], 0, 0);
    for (uint32_t r = 4; r < 8; r++)
        assert_range(o[r], r, 1);
    /* 1:4 */
    assign_all(8, 1, 4, 3, o);
    assert_range(o[0], 6, 2);
}

static void test_assign_gqa_mla(void **state)
{
    (void)state;
    kvw_head_range_t o[MAX_RANKS];
    /* GQA: 2 KV heads over prefill TP 8 (4 replicas each), decode TP 2:
     * decode rank 1 (head 1) from prefill rank 4 only. */
    assign_all(2, 8, 2, 1, o);
    for (uint32_t r = 0; r < 8; r++)
        assert_range(o[r], 1, r == 4);
    /* Decode TP 1 holds both: ranks 0 and 4 send, the other six owe nothing. */
    assign_all(2, 8, 1, 0, o);
    for (uint32_t r = 0; r < 8; r++)
        assert_range(o[r], r / 4, r % 4 == 0);
    /* Replicated on decode too (4 heads, prefill TP 8, decode TP 8): each
     * decode rank from the first prefill replica of its head. */
    assign_all(4, 8, 8, 3, o);
    for (uint32_t r = 0; r < 8; r++)
        assert_range(o[r], 1, r == 2);
    /* MLA: one latent "head", every rank holds it: prefill rank 0 sends. */
    assign_all(1, 8, 2, 1, o);
    for (uint32_t r = 0; r < 8; r++)
        assert_range(o[r], 0, r == 0);
}

static void test_assign_contiguous_share_and_hole(void **state)
{
    (void)state;
    char why[200];
    /* Overlapping ranks: the rank already sending keeps on while it holds
     * the next head, so each share stays one range. */
    kvw_heads_t p[2] = {{8, 2, 2, 128, 16, 0}, {8, 0, 8, 128, 16, 0}};
    kvw_heads_t d = {8, 0, 8, 128, 16, 0};
    kvw_head_range_t o[2];
    assert_int_equal(kvw__heads_assign(&d, p, 2, o, why, sizeof(why)), 0);
    assert_range(o[0], 0, 0);
    assert_range(o[1], 0, 8);
    /* A head nobody holds. */
    kvw_heads_t q[2] = {{8, 0, 4, 128, 16, 0}, {8, 5, 3, 128, 16, 0}};
    assert_int_equal(kvw__heads_assign(&d, q, 2, o, why, sizeof(why)), -1);
    assert_string_equal(why, "head 4 of decode's [0, 8) is held by none of 2 prefill ranks");
}

static void test_geom_modes(void **state)
{
    (void)state;
    char why[200];
    kvw_heads_geom_t g;
    kvw_heads_t p8 = {8, 0, 8, 128, 16, KVW_HEADS_NHD}, d4 = {8, 4, 4, 128, 16, KVW_HEADS_NHD};
    assert_int_equal(kvw__heads_geom(&p8, &d4, (kvw_head_range_t){4, 4}, &g, why, sizeof(why)), 0);
    assert_int_equal(g.src_stride, 1024);
    assert_int_equal(g.dst_stride, 512);
    assert_int_equal(g.src_off, 512);
    assert_int_equal(g.dst_off, 0);
    assert_int_equal(g.slice, 512);
    assert_int_equal(g.units_per_page, 16);
    assert_int_equal(kvw__heads_mode(&g), KVW_HEADS_GATHER);
    /* The other way: decode holds 8, prefill sends its 4: strided rows. */
    assert_int_equal(kvw__heads_geom(&d4, &p8, (kvw_head_range_t){4, 4}, &g, why, sizeof(why)), 0);
    assert_int_equal(kvw__heads_mode(&g), KVW_HEADS_ROWS);
    assert_int_equal(g.dst_off, 512);
    /* Same heads: a plain copy. */
    assert_int_equal(kvw__heads_geom(&p8, &p8, (kvw_head_range_t){0, 8}, &g, why, sizeof(why)), 0);
    assert_int_equal(kvw__heads_mode(&g), KVW_HEADS_COPY);
    /* HND: the unit is a page's slice of heads. */
    kvw_heads_t h8 = p8, h4 = d4;
    h8.order = h4.order = KVW_HEADS_HND;
    assert_int_equal(kvw__heads_geom(&h8, &h4, (kvw_head_range_t){4, 4}, &g, why, sizeof(why)), 0);
    assert_int_equal(g.src_stride, 16384);
    assert_int_equal(g.src_off, 8192);
    assert_int_equal(g.slice, 8192);
    assert_int_equal(g.units_per_page, 1);
    assert_int_equal(kvw__heads_mode(&g), KVW_HEADS_GATHER);
    /* A range one side does not hold. */
    assert_int_equal(kvw__heads_geom(&p8, &d4, (kvw_head_range_t){2, 4}, &g, why, sizeof(why)), -1);
    assert_string_equal(why, "heads [2, 6): prefill holds [0, 8), decode [4, 8)");
}

/* ------------------------------------------------------------ writes */

/* The entries of a 1:2 NHD gather: each write takes max_sge token slices
 * of 512 bytes, 1024 bytes apart at the source, into contiguous bytes. */
static void test_gather_entries(void **state)
{
    (void)state;
    static uint8_t src[4 * 16 * 1024], dst[4 * 16 * 512];
    kvw_heads_t p8 = {8, 0, 8, 128, 16, KVW_HEADS_NHD}, d4 = {8, 4, 4, 128, 16, KVW_HEADS_NHD};
    kvw_run_t run = {1, 2, 2}; /* prefill pages 1-2 -> decode pages 2-3 */
    kvw_heads_plan_t p = {.local_addr = (uintptr_t)src,
                          .remote_addr = (uintptr_t)dst,
                          .runs = &run,
                          .num_runs = 1,
                          .max_sge = 30,
                          .max_msg = 1u << 30};
    char why[200];
    assert_int_equal(kvw__heads_geom(&p8, &d4, (kvw_head_range_t){4, 4}, &p.geom, why, sizeof(why)),
                     0);
    kvw_heads_cursor_t c = {0, 0, 0};
    kvw_gwrite_t w;
    /* 32 tokens: 30 + 2. */
    assert_int_equal(kvw__heads_next(&p, &c, &w), 1);
    assert_int_equal(w.num_sge, 30);
    assert_int_equal(w.len, 30 * 512);
    assert_int_equal(w.remote_addr, (uintptr_t)dst + 2 * 16 * 512);
    for (uint32_t i = 0; i < 30; i++) {
        assert_int_equal(w.sge[i].addr, (uintptr_t)src + 16 * 1024 + i * 1024 + 512);
        assert_int_equal(w.sge[i].len, 512);
    }
    assert_int_equal(kvw__heads_next(&p, &c, &w), 1);
    assert_int_equal(w.num_sge, 2);
    assert_int_equal(w.remote_addr, (uintptr_t)dst + 2 * 16 * 512 + 30 * 512);
    assert_int_equal(w.sge[1].addr, (uintptr_t)src + 16 * 1024 + 31 * 1024 + 512);
    assert_int_equal(kvw__heads_next(&p, &c, &w), 0);
    /* max_sge 1 and 2. */
    p.max_sge = 1;
    assert_int_equal(kvw__heads_count(&p), 32);
    p.max_sge = 2;
    assert_int_equal(kvw__heads_count(&p), 16);
    /* More entries than the plan can hold are capped. */
    p.max_sge = 1000;
    assert_int_equal(kvw__heads_count(&p), 1);
    /* max_msg caps the gather: 3 slices a write. */
    p.max_msg = 3 * 512 + 100;
    assert_int_equal(kvw__heads_count(&p), 11);
}

/* Decode holds fewer heads (decode TP > prefill TP): NHD gathers, HND one
 * entry per page; WR counts per region for contiguous pages. */
static void test_fewer_heads_counts(void **state)
{
    (void)state;
    const uint32_t sges[] = {1, 2, 30};
    const uint32_t splits[][2] = {{1, 2}, {1, 4}, {2, 4}, {1, 8}};
    for (size_t k = 0; k < sizeof(sges) / sizeof(sges[0]); k++)
        for (size_t t = 0; t < sizeof(splits) / sizeof(splits[0]); t++)
            for (uint32_t tokens = 16; tokens <= 64; tokens *= 4) {
                deploy_t d = llama(splits[t][0], splits[t][1], KVW_HEADS_NHD, tokens, sges[k], 5);
                stats_t s = run_deploy(&d);
                /* One run of 5 pages per decode rank, from one prefill rank. */
                assert_int_equal(s.units, (uint64_t)splits[t][1] * 5 * tokens);
                assert_int_equal(s.writes, splits[t][1] * div_ceil(5 * tokens, sges[k]));
                d.order = KVW_HEADS_HND;
                s = run_deploy(&d);
                assert_int_equal(s.units, splits[t][1] * 5);
                assert_int_equal(s.writes, splits[t][1] * div_ceil(5, sges[k]));
            }
}

/* Decode holds more heads (decode TP < prefill TP): each prefill rank
 * fills a strided slice, one write per token row (NHD) or per page (HND),
 * or one write per page run when it lands contiguously for a 2D copy. */
static void test_more_heads_counts(void **state)
{
    (void)state;
    const uint32_t splits[][2] = {{2, 1}, {4, 1}, {8, 2}, {4, 2}};
    for (size_t t = 0; t < sizeof(splits) / sizeof(splits[0]); t++)
        for (uint32_t order = 0; order <= 1; order++) {
            deploy_t d = llama(splits[t][0], splits[t][1], order, 16, 30, 6);
            uint64_t per_page = order == KVW_HEADS_NHD ? 16 : 1;
            stats_t s = run_deploy(&d);
            /* Each decode rank takes every page from each of its senders. */
            uint64_t senders = splits[t][0];
            assert_int_equal(s.writes, senders * 6 * per_page);
            assert_int_equal(s.sges, s.writes);
            d.landing = 1;
            s = run_deploy(&d);
            assert_int_equal(s.writes, senders); /* one run each */
        }
}

/* Fragmented pages: a gather needs only the destination contiguous, so
 * fragmented source pages cost nothing; fragmented destination pages cost
 * a write per destination page run. */
static void test_fragmented_pages(void **state)
{
    (void)state;
    const uint32_t sges[] = {1, 2, 30};
    for (size_t k = 0; k < 3; k++) {
        deploy_t d = llama(1, 2, KVW_HEADS_NHD, 16, sges[k], 12);
        d.src_pages = fragmented;
        stats_t s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * div_ceil(12 * 16, sges[k]));
        d.src_pages = contiguous;
        d.dst_pages = fragmented;
        s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * 12 * div_ceil(16, sges[k]));
        /* Both shuffled, HND: one entry per page, pages never adjacent at
         * decode except by chance, so count against the plan's runs. */
        d.order = KVW_HEADS_HND;
        d.src_pages = shuffled;
        d.dst_pages = fragmented;
        s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * 12);
        d.dst_pages = contiguous;
        s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * div_ceil(12, sges[k]));
        /* More heads at decode, fragmented both ways, landing or not. */
        d = llama(2, 1, KVW_HEADS_NHD, 16, sges[k], 12);
        d.src_pages = shuffled;
        d.dst_pages = fragmented;
        s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * 12 * 16);
        d.landing = 1;
        s = run_deploy(&d);
        assert_int_equal(s.writes, 2 * 12);
    }
}

/* Equal TP through the head planner: a copy, one write per run as the
 * classic planner makes, and source-fragmented runs gathered. */
static void test_equal_tp_copy(void **state)
{
    (void)state;
    deploy_t d = llama(2, 2, KVW_HEADS_NHD, 16, 30, 10);
    stats_t s = run_deploy(&d);
    assert_int_equal(s.writes, 2);
    assert_int_equal(s.sges, 2);
    d.order = KVW_HEADS_HND;
    d.src_pages = fragmented;
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2);
    assert_int_equal(s.sges, 2 * 10);
    /* A write holds at most max_msg: 10 pages of 8 KiB in 3 KiB writes. */
    d.src_pages = contiguous;
    d.max_msg = 3072;
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2 * div_ceil(10 * 8192, 3072));
}

/* GQA and MLA on real bytes: replicas owe nothing, every head arrives. */
static void test_gqa_mla_bytes(void **state)
{
    (void)state;
    deploy_t d = llama(8, 2, KVW_HEADS_NHD, 16, 30, 4);
    d.total = 2; /* 2 KV heads over prefill TP 8: 2 senders, a copy each */
    stats_t s = run_deploy(&d);
    assert_int_equal(s.writes, 2);
    d.decode_tp = 1; /* decode holds both: a strided row each */
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2 * 4 * 16);
    d.order = KVW_HEADS_HND;
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2 * 4);
    /* MLA: one 576-byte latent "head" on every rank, one sender. */
    d = llama(4, 2, KVW_HEADS_NHD, 64, 30, 7);
    d.total = 1;
    d.head_bytes = 576;
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2); /* one copy per decode rank */
}

/* A slice larger than a write: HND pages of 64 tokens and 8 heads of 128
 * bytes (64 KiB a page) through 20 KiB writes. */
static void test_slice_over_max_msg(void **state)
{
    (void)state;
    deploy_t d = llama(1, 2, KVW_HEADS_HND, 64, 30, 3);
    d.max_msg = 20 * 1024;
    stats_t s = run_deploy(&d);
    /* Each decode rank: 3 slices of 32 KiB, each in 20 + 12 KiB (a new
     * entry takes a whole slice when it fits a write). */
    assert_int_equal(s.writes, 2 * 3 * 2);
    d = llama(2, 1, KVW_HEADS_HND, 64, 30, 3);
    d.max_msg = 20 * 1024;
    s = run_deploy(&d);
    assert_int_equal(s.writes, 2 * 3 * 2); /* each 32 KiB slice in 2 writes */
}

/* ------------------------------------------------------------ fake NIC */

static nic_t nic_state;

static int nic_setup(void **state)
{
    (void)state;
    fake_nic_fini();
    assert_int_equal(fake_nic_init(NULL), 0);
    kvw__verbs_set_ops(&fake_nic_ops);
    memset(&nic_state, 0, sizeof(nic_state));
    assert_int_equal(kvw_config_init(&nic_state.cfg), KVW_OK);
    assert_int_equal(kvw__dev_open("fake0", "127.0.0.1", 1, -1, &nic_state.dev[0]), KVW_OK);
    assert_int_equal(kvw__dev_open("fake1", "127.0.0.1", 1, -1, &nic_state.dev[1]), KVW_OK);
    nic = &nic_state;
    return 0;
}

static int nic_teardown(void **state)
{
    (void)state;
    nic = NULL;
    kvw__dev_close(nic_state.dev[0]);
    kvw__dev_close(nic_state.dev[1]);
    kvw__verbs_set_ops(NULL);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.live_mrs + st.live_qps + st.live_cqs + st.live_pds, 0);
    assert_int_equal(st.wrs_accepted, st.wrs_succeeded);
    assert_int_equal(st.fatal_errors, 0);
    fake_nic_fini();
    return 0;
}

/* The gather writes as RDMA WRITEs of up to max_sge entries, over src/verbs
 * QPs on the fake NIC, for every split and both page layouts, with the
 * QP's max_send_sge at 1, 2 and 30: every head of every decode rank
 * checked byte for byte, and the WR counts the planner predicts. */
static void test_nic_splits(void **state)
{
    (void)state;
    const uint32_t sges[] = {1, 2, 30};
    const uint32_t splits[][2] = {{1, 2}, {2, 1}, {1, 4}, {4, 1}, {8, 2}};
    for (size_t k = 0; k < 3; k++)
        for (size_t t = 0; t < sizeof(splits) / sizeof(splits[0]); t++)
            for (uint32_t order = 0; order <= 1; order++) {
                nic->max_sge = sges[k];
                deploy_t d = llama(splits[t][0], splits[t][1], order, 16, sges[k], 5);
                d.src_pages = fragmented;
                stats_t s = run_deploy(&d);
                uint64_t per = order == KVW_HEADS_NHD ? 5 * 16 : 5;
                if (splits[t][0] < splits[t][1]) /* gather */
                    assert_int_equal(s.writes, splits[t][1] * div_ceil(per, sges[k]));
                else /* a write per row, or per page for HND */
                    assert_int_equal(s.writes, splits[t][0] * per);
                if (splits[t][0] > splits[t][1]) {
                    d.landing = 1;
                    s = run_deploy(&d);
                    /* One landing write gathers the fragmented source pages. */
                    assert_int_equal(s.writes, splits[t][0] * div_ceil(5, sges[k]));
                }
            }
    /* GQA: 2 KV heads on prefill TP 8, decode TP 2 and 1. */
    nic->max_sge = 30;
    deploy_t d = llama(8, 2, KVW_HEADS_NHD, 16, 30, 4);
    d.total = 2;
    assert_int_equal(run_deploy(&d).writes, 2);
    d.decode_tp = 1;
    assert_int_equal(run_deploy(&d).writes, 2 * 4 * 16);
}

/* ------------------------------------------------------------ layouts */

/* A model of 2 layers: K/V group, MLA-like latent group, one aux item,
 * one Mamba-like state group; the K/V group holds heads [first, first +
 * count) of 8, NHD, 16 tokens of 128 bytes. */
static int build(kvw_layout_t *l, uint32_t first, uint32_t count, char *why)
{
    kvw_layout_group_t g[3] = {
        {KVW_LAYOUT_KV, 2, 2, 0, {8, first, count, 128, 16, KVW_HEADS_NHD}},
        {KVW_LAYOUT_AUX, 1, 1, 0, {0, 0, 0, 0, 0, 0}},
        {KVW_LAYOUT_STATE, 2, 1, 0, {0, 0, 0, 0, 0, 0}},
    };
    return kvw__layout_build(l, g, 3, 64, why, 200);
}

static void test_layout_heads(void **state)
{
    (void)state;
    char why[200];
    kvw_layout_t a, b;
    assert_int_equal(build(&a, 0, 8, why), 0);
    assert_int_equal(build(&b, 4, 4, why), 0);
    /* Items: 4 K/V regions, the aux, 2 state regions. */
    uint64_t ia[7] = {16384, 16384, 16384, 16384, 64, 4096, 4096};
    uint64_t ib[7] = {8192, 8192, 8192, 8192, 64, 4096, 4096};
    assert_int_equal(kvw__layout_check_heads(&a, ia, why, sizeof(why)), 0);
    assert_int_equal(kvw__layout_check_heads(&b, ib, why, sizeof(why)), 0);
    ib[3] = 16384;
    assert_int_equal(kvw__layout_check_heads(&b, ib, why, sizeof(why)), -1);
    assert_string_equal(why, "kv group 0, layer 1, region 1: a page of 16 tokens x 4 heads x 128 "
                             "bytes is not the region's item length 16384");
    ib[3] = 8192;
    /* Different ranges, different item lengths: accepted, and sliced. */
    assert_int_equal(kvw__layout_compare(&a, ia, b.groups, b.num_groups, ib, why, sizeof(why)), 0);
    assert_int_equal(kvw__layout_sliced(&a, b.groups, b.num_groups), 1);
    assert_int_equal(kvw__layout_sliced(&a, a.groups, a.num_groups), 0);
    /* Undescribed regions still need equal item lengths. */
    ib[5] = 2048;
    assert_int_equal(kvw__layout_compare(&a, ia, b.groups, b.num_groups, ib, why, sizeof(why)), -1);
    assert_string_equal(why, "state group 2, layer 0, region 0: peer item length 2048, ours 4096");
    ib[5] = 4096;
    /* What must match, said exactly. */
    kvw_layout_group_t g[3];
    memcpy(g, b.groups, sizeof(g));
    g[0].heads.head_bytes = 256;
    assert_int_equal(kvw__layout_compare(&a, ia, g, 3, NULL, why, sizeof(why)), -1);
    assert_string_equal(why, "kv group 0: bytes per head: peer 256, ours 128");
    memcpy(g, b.groups, sizeof(g));
    g[0].heads = (kvw_heads_t){0, 0, 0, 0, 0, 0};
    assert_int_equal(kvw__layout_compare(&a, ia, g, 3, NULL, why, sizeof(why)), -1);
    assert_string_equal(why, "kv group 0: peer does not describe its heads, ours does");
    memcpy(g, b.groups, sizeof(g));
    g[2].num_layers = 3;
    assert_int_equal(kvw__layout_compare(&a, ia, g, 3, NULL, why, sizeof(why)), -1);
    assert_string_equal(why, "group 2: peer has state, 3 layers x 1 regions; we have state, 2 x 1");
    assert_int_equal(kvw__layout_compare(&a, ia, g, 2, NULL, why, sizeof(why)), -1);
    assert_string_equal(why, "peer has 2 buffer groups, we have 3");
    kvw__layout_free(&a);
    kvw__layout_free(&b);
    /* Refused descriptions. */
    assert_int_equal(build(&a, 6, 4, why), -1);
    assert_non_null(strstr(why, "kv group 0: heads [6, 10) of 8"));
    kvw_layout_group_t aux[2] = {{KVW_LAYOUT_KV, 1, 1, 0, {0, 0, 0, 0, 0, 0}},
                                 {KVW_LAYOUT_AUX, 1, 1, 0, {8, 0, 8, 128, 16, 0}}};
    assert_int_equal(kvw__layout_build(&a, aux, 2, 64, why, sizeof(why)), -1);
    assert_string_equal(why, "aux group 1 describes heads: only kv groups do");
}

/* kvw__heads_learn: a decode rank's heads from prefill's description, its
 * item length and its attention TP place, as sglang sizes its pools; and
 * each inconsistency refused with the numbers. */
static void learn_ok(const kvw_heads_t *pre, uint64_t item_len, uint32_t rank, uint32_t size,
                     uint32_t first, uint32_t count)
{
    kvw_heads_t out;
    char why[200] = "";
    assert_int_equal(kvw__heads_learn(pre, pre->page_tokens, pre->order, item_len, rank, size, &out,
                                      why, sizeof(why)),
                     0);
    kvw_heads_t want = {pre->total, first, count, pre->head_bytes, pre->page_tokens, pre->order};
    assert_memory_equal(&out, &want, sizeof(out));
}

static void learn_refused(const kvw_heads_t *pre, uint32_t page_tokens, uint64_t item_len,
                          uint32_t rank, uint32_t size, const char *reason)
{
    kvw_heads_t out;
    char why[200] = "";
    assert_int_equal(kvw__heads_learn(pre, page_tokens, pre->order, item_len, rank, size, &out, why,
                                      sizeof(why)),
                     -1);
    if (!strstr(why, reason))
        fail_msg("\"%s\" lacks \"%s\"", why, reason);
}

static void test_learn(void **state)
{
    (void)state;
    kvw_heads_t pre = {8, 4, 4, 256, 16, KVW_HEADS_NHD}; /* prefill rank 1 of TP 2 */
    learn_ok(&pre, 16 * 8 * 256, 0, 1, 0, 8);            /* decode TP 1: all 8 */
    learn_ok(&pre, 16 * 4 * 256, 1, 2, 4, 4);            /* equal TP */
    learn_ok(&pre, 16 * 2 * 256, 3, 4, 6, 2);            /* decode TP 4 */
    kvw_heads_t gqa = {2, 1, 1, 128, 4, KVW_HEADS_HND};  /* 2 heads over prefill TP 8 */
    learn_ok(&gqa, 4 * 128, 5, 8, 1, 1);                 /* decode rank 5 of 8: head 1 */
    learn_ok(&gqa, 4 * 128, 1, 2, 1, 1);                 /* TP 2: one head each */
    kvw_heads_t one = {1, 0, 1, 512, 4, KVW_HEADS_NHD};
    learn_ok(&one, 4 * 512, 1, 2, 0, 1); /* 1 head on decode TP 2: replicated */
    learn_refused(&pre, 16, 16 * 3 * 256 + 8, 0, 1, "no multiple of 16 tokens x 256 bytes");
    learn_refused(&pre, 16, 16 * 4 * 256, 0, 1,
                  "4 heads (of 256 B x 16 tokens) x 1 ranks is not the model's 8");
    learn_refused(&pre, 16, 16 * 16 * 256, 0, 1, "16 heads (of 256 B x 16 tokens)");
    learn_refused(&pre, 8, 8 * 4 * 256, 0, 2, "prefill's pages hold 16 tokens (NHD), decode's 8");
    learn_refused(&pre, 16, 16 * 4 * 256, 2, 2, "decode is attention TP rank 2 of 2");
    learn_refused(&pre, 16, 16 * 4 * 256, 0, 0, "decode is attention TP rank 0 of 0");
    learn_refused(&gqa, 4, 2 * 4 * 128, 0, 4, "each holds 1 of them, but decode's item length");
    learn_refused(&gqa, 4, 4 * 128, 0, 3, "the model's 2 heads do not replicate evenly over 3");
    kvw_heads_t none = {0};
    none.page_tokens = 16;
    learn_refused(&none, 16, 16 * 256, 0, 1, "no multiple");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check),
        cmocka_unit_test(test_compare),
        cmocka_unit_test(test_assign_splits),
        cmocka_unit_test(test_assign_gqa_mla),
        cmocka_unit_test(test_assign_contiguous_share_and_hole),
        cmocka_unit_test(test_geom_modes),
        cmocka_unit_test(test_gather_entries),
        cmocka_unit_test(test_fewer_heads_counts),
        cmocka_unit_test(test_more_heads_counts),
        cmocka_unit_test(test_fragmented_pages),
        cmocka_unit_test(test_equal_tp_copy),
        cmocka_unit_test(test_gqa_mla_bytes),
        cmocka_unit_test(test_slice_over_max_msg),
        cmocka_unit_test(test_layout_heads),
        cmocka_unit_test(test_learn),
        cmocka_unit_test_setup_teardown(test_nic_splits, nic_setup, nic_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
