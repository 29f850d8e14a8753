/* SPDX-License-Identifier: Apache-2.0 */
/* Any KV layout, chunked and layer-wise sends, on the engine itself: a
 * prefill and a decode engine in one process with buffer groups of the
 * test's choosing. Every byte of decode's memory is checked: what the
 * request covers must equal prefill's source, the rest must still hold the
 * canary.
 *
 * Built twice: as a unit test on the fake NIC (not RDMA), and with
 * LAYOUTS_ON_RXE as tests/integration/layouts_test on the test bed's real
 * rxe devices (rxe0 -> rxe1). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

#include <cmocka.h>

#include "engine/core.h"
#include "engine/stager.h"
#include "support/engine_pair.h"
#include "support/fake_cuda.h"
#include "support/fake_nic.h"
#include "support/testbed_env.h"

#include <stdatomic.h>

enum { WAIT_MS = 20000, MAX_GROUPS = 8, MAX_REGIONS = 256, CANARY = 0xee };

/* One side's memory: every region of every group, allocated. */
typedef struct side {
    kvw_group_t groups[MAX_GROUPS];
    kvw_region_t regions[MAX_REGIONS];
    uint8_t *mem[MAX_REGIONS];
    bool gpu[MAX_REGIONS]; /* fake CUDA memory (support/fake_cuda.h) */
    uint32_t num_groups, num_regions;
    bool next_gpu;                       /* add_group allocates "GPU" memory */
    kvw_group_heads_t heads[MAX_GROUPS]; /* head slicing: passed when has_heads */
    bool has_heads;
} side_t;

typedef struct lpair {
    kvw_bootstrap_t *bs;
    kvw_engine_t *prefill, *decode;
    side_t src, dst;
    kvw_config_t cfg;
    uint32_t staging_mib, staging_chunk_kib; /* nonzero: override */
    uint32_t qps_prefill, qps_decode;        /* nonzero: KVW_QPS_PER_PEER of each side */
    bool one_device;                         /* both engines on the first device */
} lpair_t;

static lpair_t lp;
/* A second prefill engine (rank 1) and its memory: decode over two ranks. */
static kvw_engine_t *prefill2;
static side_t src2;

static uint8_t pattern(uint32_t region, uint64_t item, size_t byte)
{
    return (uint8_t)(region * 29u + item * 7u + byte * 13u + 3u);
}

/* Add a group of layers x per_layer regions, each `items` items of
 * item_len[j] bytes (region j of every layer). */
static void add_group(side_t *s, kvw_group_kind_t kind, uint32_t layers, uint32_t per_layer,
                      const size_t *item_len, uint64_t items, bool fill)
{
    assert_true(s->num_groups < MAX_GROUPS);
    uint32_t first = s->num_regions;
    for (uint32_t j = 0; j < per_layer; j++)
        for (uint32_t l = 0; l < layers; l++) {
            uint32_t r = s->num_regions++;
            assert_true(r < MAX_REGIONS);
            size_t len = item_len[j] * items;
            s->gpu[r] = s->next_gpu;
            s->mem[r] = s->gpu[r] ? fake_cuda_alloc(len) : malloc(len);
            assert_non_null(s->mem[r]);
            for (size_t b = 0; b < len; b++)
                s->mem[r][b] = fill ? pattern(r, b / item_len[j], b % item_len[j]) : CANARY;
            s->regions[r] = (kvw_region_t){s->mem[r], len, item_len[j]};
        }
    s->groups[s->num_groups++] = (kvw_group_t){kind, layers, per_layer, &s->regions[first]};
}

/* The same groups on both sides: prefill's filled, decode's canary. */
static void add_both(kvw_group_kind_t kind, uint32_t layers, uint32_t per_layer,
                     const size_t *item_len, uint64_t items)
{
    add_group(&lp.src, kind, layers, per_layer, item_len, items, true);
    add_group(&lp.dst, kind, layers, per_layer, item_len, items, false);
}

/* The two devices: the fake NIC's, or the test bed's rxe0 and rxe1. */
static kvw_status_t devices(tb_device_t *d0, tb_device_t *d1)
{
#ifdef LAYOUTS_ON_RXE
    if (!tb_device(0, d0))
        return KVW_ERR_NO_DEVICE;
    if (lp.one_device || !tb_device(1, d1))
        *d1 = *d0;
    kvw_config_init(&lp.cfg);
#else
    if (fake_nic_init(NULL))
        return KVW_ERR_NO_DEVICE;
    kvw__verbs_set_ops(&fake_nic_ops);
    *d0 = (tb_device_t){"fake0", "127.0.0.1"};
    *d1 = (tb_device_t){"fake1", "127.0.0.1"};
    pair_config(&lp.cfg);
#endif
    return KVW_OK;
}

static kvw_status_t open_engines(void)
{
    tb_device_t d0, d1;
    kvw_status_t st = devices(&d0, &d1);
    if (st)
        return st;
    if (lp.staging_mib)
        lp.cfg.staging_mib = lp.staging_mib;
    if (lp.staging_chunk_kib)
        lp.cfg.staging_chunk_kib = lp.staging_chunk_kib;
    kvw_config_t dcfg = lp.cfg;
    if (lp.qps_prefill)
        lp.cfg.qps_per_peer = lp.qps_prefill;
    if (lp.qps_decode)
        dcfg.qps_per_peer = lp.qps_decode;
    char bind[80];
    snprintf(bind, sizeof(bind), "%s:0", d0.ip);
    kvw_bootstrap_params_t bp = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = bind, .config = &lp.cfg};
    st = kvw_bootstrap_create(&bp, &lp.bs);
    kvw_engine_params_t pp = {.struct_size = sizeof(kvw_engine_params_t),
                              .role = KVW_ROLE_PREFILL,
                              .device = d0.name,
                              .local_ip = d0.ip,
                              .bootstrap_addr = st ? NULL : kvw_bootstrap_addr(lp.bs),
                              .config = &lp.cfg,
                              .num_groups = lp.src.num_groups,
                              .groups = lp.src.groups,
                              .group_heads = lp.src.has_heads ? lp.src.heads : NULL};
    kvw_engine_params_t dp = {.struct_size = sizeof(kvw_engine_params_t),
                              .role = KVW_ROLE_DECODE,
                              .device = d1.name,
                              .local_ip = d1.ip,
                              .config = &dcfg,
                              .num_groups = lp.dst.num_groups,
                              .groups = lp.dst.groups,
                              .group_heads = lp.dst.has_heads ? lp.dst.heads : NULL};
    if (!st)
        st = kvw_engine_create(&pp, &lp.prefill);
    if (!st)
        st = kvw_engine_create(&dp, &lp.decode);
    return st;
}

static void free_side(side_t *s)
{
    for (uint32_t r = 0; r < s->num_regions; r++)
        if (s->gpu[r])
            fake_cuda_free(s->mem[r]);
        else
            free(s->mem[r]);
}

static int teardown(void **state)
{
    (void)state;
    pair_order_peeks(lp.prefill); /* peeks at its connections, before they go */
    kvw_engine_destroy(lp.decode);
    kvw_engine_destroy(lp.prefill);
    kvw_engine_destroy(prefill2);
    prefill2 = NULL;
    kvw_bootstrap_destroy(lp.bs);
#ifndef LAYOUTS_ON_RXE
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
#endif
    free_side(&lp.src);
    free_side(&lp.dst);
    free_side(&src2);
    memset(&src2, 0, sizeof(src2));
    memset(&lp, 0, sizeof(lp));
    kvw__cuda_set_ops(NULL);
    return 0;
}

static int setup(void **state)
{
    (void)state;
    memset(&lp, 0, sizeof(lp));
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    return 0;
}

/* One state group's own index list (kvw_state_list_t on both sides). */
typedef struct state_spec {
    uint32_t group;
    size_t n;
    const uint64_t *src, *dst;
} state_spec_t;

/* What one request moves: page i of the request goes from src_pages[i] to
 * dst_pages[i] in every KV region, state[i] likewise in every state region
 * (a state group in lists: its own list's), aux item aux_src to aux_dst in
 * every aux region. */
typedef struct req_spec {
    uint64_t room;
    size_t n, ns;
    const uint64_t *src_pages, *dst_pages, *src_state, *dst_state;
    uint32_t aux_src, aux_dst;
    const state_spec_t *lists;
    size_t nlists;
} req_spec_t;

/* The list state group g takes in q: its own, or NULL for the shared one. */
static const state_spec_t *list_of(const req_spec_t *q, uint32_t g)
{
    for (size_t i = 0; i < q->nlists; i++)
        if (q->lists[i].group == g)
            return &q->lists[i];
    return NULL;
}

/* Expected byte at decode region r (of group g) offset b. */
static uint8_t expected(const req_spec_t *q, uint32_t g, uint32_t kind, uint32_t r, size_t item_len,
                        size_t b)
{
    uint64_t item = b / item_len;
    const state_spec_t *own = kind == KVW_GROUP_STATE ? list_of(q, g) : NULL;
    const uint64_t *dst = own ? own->dst : kind == KVW_GROUP_STATE ? q->dst_state : q->dst_pages;
    const uint64_t *src = own ? own->src : kind == KVW_GROUP_STATE ? q->src_state : q->src_pages;
    size_t n = own ? own->n : kind == KVW_GROUP_KV ? q->n : kind == KVW_GROUP_STATE ? q->ns : 0;
    for (size_t i = 0; i < n; i++)
        if (dst[i] == item)
            return pattern(r, src[i], b % item_len);
    if (kind == KVW_GROUP_AUX && q->aux_dst != KVW_NO_AUX && item == q->aux_dst)
        return pattern(r, q->aux_src, b % item_len);
    return CANARY;
}

/* Bytes of decode's memory that differ from what the request should have
 * left there (landed bytes, and the canary everywhere else). */
static size_t wrong_bytes(const req_spec_t *q)
{
    size_t wrong = 0;
    for (uint32_t g = 0; g < lp.dst.num_groups; g++) {
        const kvw_group_t *gr = &lp.dst.groups[g];
        for (uint32_t k = 0; k < gr->num_layers * gr->regions_per_layer; k++) {
            uint32_t r = (uint32_t)(gr->regions - lp.dst.regions) + k;
            const kvw_region_t *reg = &lp.dst.regions[r];
            for (size_t b = 0; b < reg->len; b++)
                wrong += lp.dst.mem[r][b] != expected(q, g, gr->kind, r, reg->item_len, b);
        }
    }
    return wrong;
}

static kvw_poll_t wait_end(kvw_poll_t (*poll)(void *), void *h)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    kvw_poll_t s;
    while ((s = poll(h)) != KVW_POLL_SUCCESS && s != KVW_POLL_FAILED && pair_now_ms() < end)
        pair_sleep_ms(1);
    return s;
}

static kvw_poll_t poll_s(void *h)
{
    return kvw_sender_poll(h);
}

static kvw_poll_t poll_r(void *h)
{
    return kvw_receiver_poll(h);
}

/* Wait until decode's request reached the sender. */
static kvw_poll_t wait_end_ready(kvw_sender_t *s)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_sender_poll(s);
}

/* A byte of decode's memory while the NIC may be writing it. */
static uint8_t peek(const uint8_t *addr)
{
#ifdef LAYOUTS_ON_RXE
    return *(const volatile uint8_t *)addr;
#else
    return fake_nic_peek(addr);
#endif
}

/* Create both sides of q; the receiver is initialised, the sender too. */
static void start(const req_spec_t *q, kvw_sender_t **s, kvw_receiver_t **r)
{
    assert_int_equal(kvw_sender_create(lp.prefill, q->room, s), KVW_OK);
    assert_int_equal(kvw_receiver_create(lp.decode, kvw_bootstrap_addr(lp.bs), 0, q->room, r),
                     KVW_OK);
    kvw_indices_t x = {q->dst_pages, q->n, q->aux_dst, q->dst_state, q->ns};
    kvw_state_list_t lists[MAX_GROUPS];
    for (size_t i = 0; i < q->nlists; i++)
        lists[i] = (kvw_state_list_t){q->lists[i].group, 0, q->lists[i].dst, q->lists[i].n};
    if (q->nlists)
        assert_int_equal(kvw_receiver_init_lists(*r, &x, lists, q->nlists), KVW_OK);
    else
        assert_int_equal(kvw_receiver_init_indices(*r, &x), KVW_OK);
    assert_int_equal(kvw_sender_init(*s, q->n, q->aux_src), KVW_OK);
}

/* Prefill's state for q: each listed group's own source list, the shared
 * one for the rest. */
static kvw_status_t send_state_of(const req_spec_t *q, kvw_sender_t *s)
{
    kvw_state_list_t lists[MAX_GROUPS];
    for (size_t i = 0; i < q->nlists; i++)
        lists[i] = (kvw_state_list_t){q->lists[i].group, 0, q->lists[i].src, q->lists[i].n};
    return kvw_sender_send_state_lists(s, q->src_state, q->ns, lists, q->nlists);
}

/* Both ends of q Success (a failure's reason is printed first). */
static void finish(const req_spec_t *q, kvw_sender_t *s, kvw_receiver_t *r)
{
    kvw_poll_t rs = wait_end(poll_r, r), ss = wait_end(poll_s, s);
    const char *why = "";
    if (rs != KVW_POLL_SUCCESS && kvw_receiver_failure(r, &why) != KVW_OK)
        why = "";
    if (rs != KVW_POLL_SUCCESS)
        print_message("room %llu: decode %s: %s\n", (unsigned long long)q->room, kvw_poll_name(rs),
                      why);
    if (ss != KVW_POLL_SUCCESS && kvw_sender_failure(s, &why) == KVW_OK)
        print_message("room %llu: prefill %s: %s\n", (unsigned long long)q->room, kvw_poll_name(ss),
                      why);
    assert_int_equal(rs, KVW_POLL_SUCCESS);
    assert_int_equal(ss, KVW_POLL_SUCCESS);
    assert_int_equal(wrong_bytes(q), 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* -------------------------------------------------------------- tests */

/* DeepSeek-like MLA: one 576-byte latent region per layer, 61 layers. The
 * bytes posted are exactly the pages' bytes: nothing doubled for a V that
 * does not exist. */
static void test_mla_no_wasted_bytes(void **state)
{
    (void)state;
    size_t latent = 576, aux = 64;
    add_both(KVW_GROUP_KV, 61, 1, &latent, 32);
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {3, 4, 5, 9, 20}, dst[] = {0, 1, 2, 7, 31};
    req_spec_t q = {
        .room = 1, .n = 5, .src_pages = src, .dst_pages = dst, .aux_src = 2, .aux_dst = 1};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, src, 5), KVW_OK);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(s, &m), KVW_OK);
    print_message("MLA: 5 pages x 61 layers x 576 B + one 64 B aux item = %llu bytes in %llu "
                  "writes (runs 3+1+1 per layer), %llu us\n",
                  (unsigned long long)m.bytes, (unsigned long long)m.writes,
                  (unsigned long long)m.transfer_us);
    assert_int_equal(m.bytes, 5ull * 61 * 576 + 64);
    assert_int_equal(m.writes, 3ull * 61 + 1);
    kvw_req_metrics_t dm;
    assert_int_equal(kvw_receiver_metrics(r, &dm), KVW_OK);
    assert_int_equal(dm.bytes, m.bytes);
    finish(&q, s, r);
}

/* Head slicing, prefill TP 1 -> decode TP 2: prefill holds all 8 KV heads
 * (64 bytes each, 16-token pages), this decode engine heads [4, 8), the
 * other decode rank's half being the same transfer. NHD and HND, chunked,
 * fragmented pages: every head of every token checked against prefill's,
 * the canary elsewhere; the writes are gathers (no write per token). */
static void heads_tp1_to_tp2(uint32_t order)
{
    enum { H = 8, HB = 64, T = 16, PAGES = 32, LAYERS_H = 4 };
    size_t src_item = (size_t)T * H * HB, dst_item = src_item / 2, aux = 64;
    add_group(&lp.src, KVW_GROUP_KV, LAYERS_H, 2, (size_t[]){src_item, src_item}, PAGES, true);
    add_group(&lp.dst, KVW_GROUP_KV, LAYERS_H, 2, (size_t[]){dst_item, dst_item}, PAGES, false);
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
    lp.src.heads[0] = (kvw_group_heads_t){H, 0, H, HB, T, order};
    lp.dst.heads[0] = (kvw_group_heads_t){H, H / 2, H / 2, HB, T, order};
    lp.src.has_heads = lp.dst.has_heads = true;
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {3, 4, 5, 9, 20, 21, 30, 1}, dst[] = {0, 1, 2, 3, 7, 8, 9, 31};
    req_spec_t q = {
        .room = 1, .n = 8, .src_pages = src, .dst_pages = dst, .aux_src = 2, .aux_dst = 1};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, src, 3), KVW_OK);
    assert_int_equal(kvw_sender_send(s, src + 3, 5), KVW_OK);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(s, &m), KVW_OK);
    assert_int_equal(m.bytes, 8ull * 2 * LAYERS_H * dst_item + aux);
    print_message("heads TP 1 -> 2 (%s): %llu bytes in %llu writes (%u token rows a region)\n",
                  order ? "HND" : "NHD", (unsigned long long)m.bytes, (unsigned long long)m.writes,
                  8 * T);
    assert_true(m.writes < 2ull * LAYERS_H * 8 * T / 4);
    size_t wrong = 0;
    for (uint32_t reg = 0; reg < 2 * LAYERS_H; reg++)
        for (uint64_t p = 0; p < PAGES; p++) {
            size_t i = 8;
            for (size_t k = 0; k < 8; k++)
                i = dst[k] == p ? k : i;
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t k = 0; k < H / 2; k++)
                    for (uint32_t b = 0; b < HB; b++) {
                        size_t at = order == KVW_PAGE_NHD ? ((size_t)t * (H / 2) + k) * HB + b
                                                          : ((size_t)k * T + t) * HB + b;
                        size_t from = order == KVW_PAGE_NHD
                                          ? ((size_t)t * H + H / 2 + k) * HB + b
                                          : ((size_t)(H / 2 + k) * T + t) * HB + b;
                        uint8_t want = i < 8 ? pattern(reg, src[i], from) : (uint8_t)CANARY;
                        wrong += peek(&lp.dst.mem[reg][p * dst_item + at]) != want;
                    }
        }
    assert_int_equal(wrong, 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

static void test_heads_tp1_to_tp2_nhd(void **state)
{
    (void)state;
    heads_tp1_to_tp2(KVW_PAGE_NHD);
}

static void test_heads_tp1_to_tp2_hnd(void **state)
{
    (void)state;
    heads_tp1_to_tp2(KVW_PAGE_HND);
}

/* The second prefill engine (rank 1, src2's memory) on the first device. */
static void open_prefill2(void)
{
#ifdef LAYOUTS_ON_RXE
    tb_device_t d0;
    assert_true(tb_device(0, &d0));
#else
    tb_device_t d0 = {"fake0", "127.0.0.1"};
#endif
    kvw_engine_params_t pp = {.struct_size = sizeof(kvw_engine_params_t),
                              .role = KVW_ROLE_PREFILL,
                              .device = d0.name,
                              .local_ip = d0.ip,
                              .bootstrap_addr = kvw_bootstrap_addr(lp.bs),
                              .config = &lp.cfg,
                              .engine_rank = 1,
                              .num_groups = src2.num_groups,
                              .groups = src2.groups,
                              .group_heads = src2.heads};
    assert_int_equal(kvw_engine_create(&pp, &prefill2), KVW_OK);
}

/* Head slicing, prefill TP 2 -> decode TP 1: two prefill engines (ranks 0
 * and 1, heads [0, 4) and [4, 8), 64 bytes each, 16-token pages) on the
 * first device, one decode engine holding all 8 heads, one receiver over
 * both ranks. Rank 1's memory has its own pattern, so a head from the
 * wrong rank shows. kill: rank 1 is destroyed (its sender, then its
 * engine: the process gone) once rank 0 sent half: decode fails only once
 * rank 0 confirmed its abort, naming rank 1, and nothing lands after. */
static void heads_tp2_to_tp1(uint32_t order, bool kill)
{
    enum { H = 8, HB = 64, T = 16, PAGES = 32, LAYERS_H = 4 };
    size_t src_item = (size_t)T * (H / 2) * HB, dst_item = (size_t)T * H * HB, aux = 64;
    size_t items[2] = {src_item, src_item}, ditems[2] = {dst_item, dst_item};
    add_group(&lp.src, KVW_GROUP_KV, LAYERS_H, 2, items, PAGES, true);
    add_group(&src2, KVW_GROUP_KV, LAYERS_H, 2, items, PAGES, true);
    add_group(&lp.dst, KVW_GROUP_KV, LAYERS_H, 2, ditems, PAGES, false);
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
    add_group(&src2, KVW_GROUP_AUX, 1, 1, &aux, 4, true);
    for (uint32_t r = 0; r < src2.num_regions; r++) /* rank 1's own pattern */
        for (size_t b = 0; b < src2.regions[r].len; b++)
            src2.mem[r][b] =
                pattern(r + 100, b / src2.regions[r].item_len, b % src2.regions[r].item_len);
    lp.src.heads[0] = (kvw_group_heads_t){H, 0, H / 2, HB, T, order};
    src2.heads[0] = (kvw_group_heads_t){H, H / 2, H / 2, HB, T, order};
    lp.dst.heads[0] = (kvw_group_heads_t){H, 0, H, HB, T, order};
    lp.src.has_heads = lp.dst.has_heads = true;
    assert_int_equal(open_engines(), KVW_OK);
    open_prefill2();
    uint64_t src[] = {3, 4, 5, 9, 20, 21, 30, 1}, dst[] = {0, 1, 2, 3, 7, 8, 9, 31};
    kvw_prefill_rank_t ranks[2] = {{kvw_bootstrap_addr(lp.bs), NULL, 0},
                                   {kvw_bootstrap_addr(lp.bs), NULL, 1}};
    kvw_receiver_params_t rp = {
        .struct_size = sizeof(rp), .room = 1, .num_ranks = 2, .ranks = ranks};
    kvw_receiver_t *r;
    kvw_sender_t *s[2];
    assert_int_equal(kvw_receiver_create_ranks(lp.decode, &rp, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, dst, 8, 1), KVW_OK);
    assert_int_equal(kvw_sender_create(lp.prefill, 1, &s[0]), KVW_OK);
    assert_int_equal(kvw_sender_create(prefill2, 1, &s[1]), KVW_OK);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_init(s[k], 8, 2), KVW_OK);
        assert_int_equal(kvw_sender_send(s[k], src, 3), KVW_OK);
    }
    uint64_t units = order == KVW_PAGE_NHD ? 8ull * T : 8; /* one write per row or page */
    if (kill) {
        uint64_t half = 3ull * 2 * LAYERS_H * src_item, end = pair_now_ms() + WAIT_MS;
        kvw_req_metrics_t m = {0};
        while (pair_now_ms() < end && (kvw_sender_metrics(s[0], &m), m.bytes < half))
            pair_sleep_ms(1);
        assert_int_equal(m.bytes, half);
        assert_int_not_equal(kvw_receiver_poll(r), KVW_POLL_FAILED);
        kvw_sender_destroy(s[1]);
        kvw_engine_destroy(prefill2);
        prefill2 = NULL;
        assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
        assert_int_equal(kvw_sender_poll(s[0]), KVW_POLL_FAILED); /* told, and confirmed */
        const char *why = NULL;
        assert_int_not_equal(kvw_receiver_failure(r, &why), KVW_OK);
        print_message("heads TP 2 -> 1 (%s), rank 1 killed: %s\n", order ? "HND" : "NHD", why);
        assert_non_null(strstr(why, "prefill rank 1"));
        kvw_landing_stats_t ls; /* nothing copied from the landing buffer, all of it free */
        kvw__landing_stats(lp.decode, &ls);
        assert_int_equal(ls.scatters, 0);
        assert_int_equal(ls.reserved, 0);
        size_t total = 2 * LAYERS_H * PAGES * dst_item;
        uint8_t *before = malloc(total);
        assert_non_null(before);
        for (uint32_t reg = 0; reg < 2 * LAYERS_H; reg++)
            for (size_t b = 0; b < PAGES * dst_item; b++)
                before[reg * PAGES * dst_item + b] = peek(&lp.dst.mem[reg][b]);
        assert_int_not_equal(kvw_sender_send(s[0], src + 3, 5), KVW_OK);
        pair_sleep_ms(100);
        size_t changed = 0;
        for (uint32_t reg = 0; reg < 2 * LAYERS_H; reg++)
            for (size_t b = 0; b < PAGES * dst_item; b++)
                changed += before[reg * PAGES * dst_item + b] != peek(&lp.dst.mem[reg][b]);
        free(before);
        assert_int_equal(changed, 0);
        kvw_sender_destroy(s[0]);
        kvw_receiver_destroy(r);
        return;
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(kvw_sender_send(s[k], src + 3, 5), KVW_OK);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(wait_end(poll_s, s[k]), KVW_POLL_SUCCESS);
        kvw_req_metrics_t m;
        assert_int_equal(kvw_sender_metrics(s[k], &m), KVW_OK);
        print_message("heads TP 2 -> 1 (%s), rank %d: %llu bytes in %llu writes\n",
                      order ? "HND" : "NHD", k, (unsigned long long)m.bytes,
                      (unsigned long long)m.writes);
        /* Rank 0 also sends the aux item. */
        assert_int_equal(m.bytes, 8ull * 2 * LAYERS_H * src_item + (k == 0 ? aux : 0));
        /* Landed in decode's landing buffer (path (b)): one gather write per
         * part and region (a part's source runs fit one write's entries),
         * where a write per row or page would take units per region. */
        assert_int_equal(m.writes, 2ull * LAYERS_H * 2 + (k == 0));
        assert_true(m.writes < 2ull * LAYERS_H * units);
    }
    kvw_landing_stats_t ls;
    kvw__landing_stats(lp.decode, &ls);
    assert_int_equal(ls.scatters, 2); /* each rank's heads copied into the rows */
    assert_int_equal(ls.reserved, 0);
    size_t wrong = 0;
    for (uint32_t reg = 0; reg < 2 * LAYERS_H; reg++)
        for (uint64_t p = 0; p < PAGES; p++) {
            size_t i = 8;
            for (size_t k = 0; k < 8; k++)
                i = dst[k] == p ? k : i;
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t k = 0; k < H; k++)
                    for (uint32_t b = 0; b < HB; b++) {
                        size_t at = order == KVW_PAGE_NHD ? ((size_t)t * H + k) * HB + b
                                                          : ((size_t)k * T + t) * HB + b;
                        uint32_t kk = k % (H / 2), from_reg = reg + (k < H / 2 ? 0 : 100);
                        size_t from = order == KVW_PAGE_NHD ? ((size_t)t * (H / 2) + kk) * HB + b
                                                            : ((size_t)kk * T + t) * HB + b;
                        uint8_t want = i < 8 ? pattern(from_reg, src[i], from) : (uint8_t)CANARY;
                        wrong += peek(&lp.dst.mem[reg][p * dst_item + at]) != want;
                    }
        }
    for (size_t b = 0; b < 4 * aux; b++) /* aux item 2 of rank 0 -> item 1 */
        wrong += peek(&lp.dst.mem[2 * LAYERS_H][b]) !=
                 (b / aux == 1 ? pattern(2 * LAYERS_H, 2, b % aux) : (uint8_t)CANARY);
    assert_int_equal(wrong, 0);
    for (int k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
}

static void test_heads_tp2_to_tp1_nhd(void **state)
{
    (void)state;
    heads_tp2_to_tp1(KVW_PAGE_NHD, false);
}

static void test_heads_tp2_to_tp1_hnd(void **state)
{
    (void)state;
    heads_tp2_to_tp1(KVW_PAGE_HND, false);
}

static void test_heads_tp2_to_tp1_rank_killed(void **state)
{
    (void)state;
    heads_tp2_to_tp1(KVW_PAGE_NHD, true);
}

/* K/V with different item lengths per region, two aux groups, and a state
 * group with its own index space (two layers of Mamba-like state). */
static void test_kv_two_aux_and_state(void **state)
{
    (void)state;
    size_t kv[2] = {256, 128}, aux_a = 48, aux_b[2] = {16, 80}, st = 512;
    add_both(KVW_GROUP_KV, 3, 2, kv, 16);
    add_both(KVW_GROUP_AUX, 1, 1, &aux_a, 4);
    add_both(KVW_GROUP_AUX, 1, 2, aux_b, 4);
    add_both(KVW_GROUP_STATE, 2, 1, &st, 8);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {1, 2, 3, 10}, dst[] = {5, 6, 7, 0}, ss[] = {6}, ds[] = {2};
    req_spec_t q = {.room = 2,
                    .n = 4,
                    .ns = 1,
                    .src_pages = src,
                    .dst_pages = dst,
                    .src_state = ss,
                    .dst_state = ds,
                    .aux_src = 3,
                    .aux_dst = 0};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    /* Decode's request at prefill first: on a slow test bed the handshake
     * alone can outlast a fixed sleep (seen once in the TCG guest). */
    assert_int_equal(wait_end_ready(s), KVW_POLL_WAITING_FOR_INPUT);
    assert_int_equal(kvw_sender_send(s, src, 4), KVW_OK);
    /* Every page is handed over, but the state is not: not complete yet. */
    pair_sleep_ms(50);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_TRANSFERRING);
    assert_int_equal(kvw_sender_send_state(s, ss, 1), KVW_OK);
    finish(&q, s, r);
}

/* sglang's chunked prefill: send() once per chunk, the last one shorter. */
static void test_chunked_sends(void **state)
{
    (void)state;
    size_t kv[2] = {256, 256}, aux = 32;
    add_both(KVW_GROUP_KV, 4, 2, kv, 32);
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 2);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[13], dst[13];
    for (int i = 0; i < 13; i++) {
        src[i] = (uint64_t)(i * 2);  /* never contiguous at the source */
        dst[i] = (uint64_t)(31 - i); /* nor at the destination */
    }
    req_spec_t q = {
        .room = 3, .n = 13, .src_pages = src, .dst_pages = dst, .aux_src = 1, .aux_dst = 0};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, src, 5), KVW_OK);
    assert_int_equal(kvw_sender_send(s, src + 5, 5), KVW_OK);
    /* The first chunks land while the last is not handed over yet. */
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (peek(&lp.dst.mem[0][dst[0] * 256]) != pattern(0, src[0], 0) && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_int_equal(peek(&lp.dst.mem[0][dst[0] * 256]), pattern(0, src[0], 0));
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_TRANSFERRING);
    assert_int_equal(kvw_sender_send(s, src + 10, 4), KVW_ERR_INVALID); /* past init's 13 */
    assert_int_equal(kvw_sender_send(s, src + 10, 3), KVW_OK);
    assert_int_equal(kvw_sender_send(s, src, 1), KVW_ERR_STATE); /* already complete */
    kvw_req_metrics_t m;
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    assert_int_equal(kvw_sender_metrics(s, &m), KVW_OK);
    assert_int_equal(m.writes, 13ull * 8 + 1); /* one write per page per region, and aux */
    finish(&q, s, r);
}

typedef struct layer_feed {
    kvw_sender_t *s;
    const uint64_t *pages;
    size_t n;
    uint32_t layers;
    int delay_ms;
    atomic_bool first_landed; /* set by the test once layer 0's bytes are at decode */
} layer_feed_t;

/* The forward pass: each layer becomes ready after delay_ms, and is handed
 * over from this thread, not the one that created the sender. Layer 1 is
 * "computed" only once layer 0 has landed (or after WAIT_MS), so the test
 * sees an early layer at decode while later ones do not exist yet. */
static void *feed_layers(void *arg)
{
    layer_feed_t *f = arg;
    for (uint32_t l = 0; l < f->layers; l++) {
        for (int waited = 0; l == 1 && !atomic_load(&f->first_landed) && waited < WAIT_MS; waited++)
            pair_sleep_ms(1);
        pair_sleep_ms(f->delay_ms);
        kvw_part_t p = {.pages = f->pages, .num_pages = f->n, .layer_begin = l, .layer_end = l + 1};
        if (kvw_sender_send_part(f->s, &p) != KVW_OK)
            return (void *)1;
    }
    return NULL;
}

/* Layer-wise streaming: earlier layers land while later ones are still
 * being computed; the request completes with the last layer. */
static void test_layerwise_from_another_thread(void **state)
{
    (void)state;
    size_t kv[2] = {512, 512};
    add_both(KVW_GROUP_KV, 6, 2, kv, 16);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {0, 1, 2, 3, 8, 9}, dst[] = {10, 11, 12, 13, 1, 2};
    req_spec_t q = {.room = 4,
                    .n = 6,
                    .src_pages = src,
                    .dst_pages = dst,
                    .aux_src = KVW_NO_AUX,
                    .aux_dst = KVW_NO_AUX};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    layer_feed_t f = {s, src, 6, 6, 40, false};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, feed_layers, &f), 0);
    /* Layer 0 (K region of layer 0 is region 0) lands long before the end. */
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (peek(&lp.dst.mem[0][dst[0] * 512]) != pattern(0, src[0], 0) && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_TRANSFERRING);
    print_message("layer 0 landed while layers 1-5 were still to be computed\n");
    atomic_store(&f.first_landed, true);
    /* A part out of order changes nothing. */
    kvw_part_t bad = {
        .pages = src, .num_pages = 6, .layer_begin = 5, .layer_end = 6, .first_page = 1};
    assert_int_equal(kvw_sender_send_part(s, &bad), KVW_ERR_INVALID);
    void *rc;
    pthread_join(t, &rc);
    assert_null(rc);
    finish(&q, s, r);
}

/* Chunks and layers combined: two chunks, each handed over layer range by
 * layer range. */
static void test_chunks_times_layers(void **state)
{
    (void)state;
    size_t lat = 192;
    add_both(KVW_GROUP_KV, 4, 1, &lat, 16);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {0, 1, 2, 3, 4, 5}, dst[] = {6, 7, 8, 9, 10, 11};
    req_spec_t q = {.room = 5,
                    .n = 6,
                    .src_pages = src,
                    .dst_pages = dst,
                    .aux_src = KVW_NO_AUX,
                    .aux_dst = KVW_NO_AUX};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    kvw_part_t parts[] = {
        {src, 4, 0, 0, 2}, {src, 4, 0, 2, 4}, {src + 4, 2, 4, 2, 4}, {src + 4, 2, 4, 0, 2}};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvw_receiver_poll(r) == KVW_POLL_SUCCESS, 0);
        assert_int_equal(kvw_sender_send_part(s, &parts[i]), KVW_OK);
    }
    finish(&q, s, r);
}

/* Bad input in a part: an out-of-range source page fails the request on
 * both sides before anything is posted, and decode's pages keep their
 * canary; a state count that disagrees with decode's fails it likewise. */
static void test_bad_parts_fail_both_sides(void **state)
{
    (void)state;
    size_t kv[2] = {256, 256}, st = 128;
    add_both(KVW_GROUP_KV, 2, 2, kv, 16);
    add_both(KVW_GROUP_STATE, 1, 1, &st, 4);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[] = {1, 2}, dst[] = {3, 4}, bad[] = {1, 16}, ss[] = {0}, ds[] = {1, 2};
    req_spec_t q = {.room = 30,
                    .n = 2,
                    .ns = 2,
                    .src_pages = src,
                    .dst_pages = dst,
                    .src_state = ss,
                    .dst_state = ds,
                    .aux_src = KVW_NO_AUX,
                    .aux_dst = KVW_NO_AUX};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING) /* decode's request arrives */
        pair_sleep_ms(1);
    kvw_part_t p = {bad, 2, 0, 0, 1};
    assert_int_equal(kvw_sender_send_part(s, &p), KVW_ERR_OUT_OF_RANGE);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_OUT_OF_RANGE);
    assert_non_null(strstr(why, "source page 16"));
    assert_int_equal(kvw_sender_failure(s, NULL), KVW_ERR_OUT_OF_RANGE);
    req_spec_t none = {.aux_src = KVW_NO_AUX, .aux_dst = KVW_NO_AUX};
    assert_int_equal(wrong_bytes(&none), 0); /* nothing landed */
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);

    q.room = 31;
    start(&q, &s, &r);
    while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING)
        pair_sleep_ms(1);
    assert_int_equal(kvw_sender_send_state(s, ss, 1), KVW_ERR_MISMATCH); /* decode asked 2 */
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_int_equal(kvw_sender_failure(s, NULL), KVW_ERR_MISMATCH);
    assert_int_equal(wrong_bytes(&none), 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* Different groups on the two sides: refused, saying what differs. */
static void test_group_mismatch_says_what(void **state)
{
    (void)state;
    size_t lat = 576, kv[2] = {576, 576};
    add_group(&lp.src, KVW_GROUP_KV, 4, 1, &lat, 8, true);
    add_group(&lp.dst, KVW_GROUP_KV, 4, 2, kv, 8, false);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t pages[] = {1};
    kvw_receiver_t *r;
    assert_int_equal(kvw_receiver_create(lp.decode, kvw_bootstrap_addr(lp.bs), 0, 9, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, pages, 1, KVW_NO_AUX), KVW_OK);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    print_message("%s\n", why);
    /* prefill speaks: the "peer" is this decode engine */
    assert_non_null(strstr(why, "group 0: peer has kv, 4 layers x 2 regions; we have kv, 4 x 1"));
    kvw_receiver_destroy(r);
}

/* ------------------------------------------------------------ staging */

/* GPU memory the NIC cannot reach, through the staging pool: the fake CUDA
 * seam's "GPU" memory is host memory on a GPU without GPUDirect RDMA, its
 * copies run on worker threads. On rxe the NIC is real; the GPU is not. */
static void use_fake_gpu(void)
{
    fake_cuda_config_t c = {.gdr = 0, .copy_delay_us = 50};
    fake_cuda_init(&c);
    kvw__cuda_set_ops(&fake_cuda_ops);
}

/* 4 layers x K/V of 4 KiB pages and a state group on the "GPU" of the
 * sides asked, a host aux group. A 1 MiB pool: prefill has 16 chunks of
 * 64 KiB, decode 31 slots (8 x 4 KiB + 512 B each). */
static void staged_layout(bool prefill_gpu, bool decode_gpu)
{
    size_t kv[2] = {4096, 4096}, aux = 64, st = 512;
    lp.staging_mib = 1;
    lp.staging_chunk_kib = 64;
    lp.src.next_gpu = prefill_gpu;
    lp.dst.next_gpu = decode_gpu;
    add_both(KVW_GROUP_KV, 4, 2, kv, 48);
    add_both(KVW_GROUP_STATE, 1, 1, &st, 8);
    lp.src.next_gpu = lp.dst.next_gpu = false;
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
}

/* 20 scattered pages, one state index, the aux item. */
static uint64_t st_src[20], st_dst[20], st_ss[] = {5}, st_ds[] = {2};

static req_spec_t staged_spec(uint64_t room)
{
    for (int i = 0; i < 20; i++) {
        st_src[i] = (uint64_t)(i * 2 + (i > 9)); /* runs of one page at the source */
        st_dst[i] = (uint64_t)(47 - i);          /* descending at decode */
    }
    return (req_spec_t){.room = room,
                        .n = 20,
                        .ns = 1,
                        .src_pages = st_src,
                        .dst_pages = st_dst,
                        .src_state = st_ss,
                        .dst_state = st_ds,
                        .aux_src = 3,
                        .aux_dst = 1};
}

static void send_staged(const req_spec_t *q, kvw_sender_t *s)
{
    assert_int_equal(kvw_sender_send(s, q->src_pages, 12), KVW_OK);
    assert_int_equal(kvw_sender_send(s, q->src_pages + 12, 8), KVW_OK);
    assert_int_equal(kvw_sender_send_state(s, q->src_state, 1), KVW_OK);
}

/* Prefill's connection's lanes: how many, and the WRs each posted. Read
 * under the engine lock: a connection is unpublished under it before the
 * poller frees it (decode's teardown ends it), so the read happens before. */
typedef struct lanes_seen {
    uint32_t nlanes;
    uint64_t wrs_posted[KVW_MAX_LANES], imm_posted[KVW_MAX_LANES];
} lanes_seen_t;

static lanes_seen_t prefill_lanes(void)
{
    lanes_seen_t seen = {0};
    pthread_mutex_lock(&lp.prefill->lock);
    const kvw_peer_t *p = kvw__peer_at(lp.prefill, 0);
    assert_non_null(p);
    seen.nlanes = p->nlanes;
    for (uint32_t i = 0; i < p->nlanes; i++) {
        seen.wrs_posted[i] = p->lanes[i].txq.wrs_posted;
        seen.imm_posted[i] = p->lanes[i].imm_posted;
    }
    pthread_mutex_unlock(&lp.prefill->lock);
    return seen;
}

static void assert_pools_free(void)
{
    kvw_stager_stats_t ps, ds;
    kvw__stager_stats(lp.prefill, &ps);
    kvw__stager_stats(lp.decode, &ds);
    assert_int_equal(ps.free_chunks, ps.chunks);
    assert_int_equal(ds.free_slots, ds.slots);
}

/* Both sides staged: prefill streams each request through 64 KiB chunks
 * (3 slices per layer), decode lands it in slots and copies it to its GPU
 * pages before Success. A second request that does not fit decode's free
 * slots waits, in order, and goes once the first returned them. */
static void test_staged_gpu_both_sides(void **state)
{
    (void)state;
    use_fake_gpu();
    staged_layout(true, true);
    assert_int_equal(open_engines(), KVW_OK);
    kvw_stager_stats_t ps, ds;
    kvw__stager_stats(lp.prefill, &ps);
    kvw__stager_stats(lp.decode, &ds);
    assert_int_equal(ps.chunks, 16);
    assert_int_equal(ds.slots, 31);
    assert_true(ps.kind[KVW_LAYOUT_KV] && ps.kind[KVW_LAYOUT_STATE] && !ps.kind[KVW_LAYOUT_AUX]);
    for (uint32_t i = 0; i < lp.src.num_regions; i++) /* nothing on the "GPU" registered */
        assert_int_equal(lp.prefill->mrs[i].path,
                         lp.src.gpu[i] ? KVW_MEM_PATH_STAGING : KVW_MEM_PATH_HOST);
    req_spec_t qa = staged_spec(40), qb = staged_spec(41);
    qb.room = 41;
    kvw_sender_t *sa, *sb;
    kvw_receiver_t *ra, *rb;
    start(&qa, &sa, &ra);
    start(&qb, &sb, &rb); /* the same pages: both leave decode's memory alike */
    assert_int_equal(wait_end_ready(sa), KVW_POLL_WAITING_FOR_INPUT);
    pair_sleep_ms(100); /* b needs 20 slots, 11 are free: its request waits */
    assert_int_equal(kvw_sender_poll(sb), KVW_POLL_BOOTSTRAPPING);
    send_staged(&qa, sa);
    assert_int_equal(wait_end(poll_r, ra), KVW_POLL_SUCCESS);
    assert_int_equal(wait_end(poll_s, sa), KVW_POLL_SUCCESS);
    assert_int_equal(wrong_bytes(&qa), 0);
    kvw_req_metrics_t m;
    assert_int_equal(kvw_sender_metrics(sa, &m), KVW_OK);
    assert_int_equal(m.bytes, 20ull * 8 * 4096 + 512 + 64);
    send_staged(&qb, sb); /* may be before or after b's slots came */
    finish(&qb, sb, rb);
    kvw_sender_destroy(sa);
    kvw_receiver_destroy(ra);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    print_message("staged: %ld copies (%ld from the GPU, %ld to it), %llu bytes, at most %ld "
                  "queued at once\n",
                  cs.copies, cs.copies_from_gpu, cs.copies_to_gpu,
                  (unsigned long long)cs.bytes_copied, cs.max_pending);
    assert_true(cs.copies_from_gpu > 0 && cs.copies_to_gpu > 0);
    assert_int_equal(cs.failed_copies, 0);
    assert_pools_free();
}

/* Only prefill's memory on the GPU; decode's in host memory, registered. */
static void test_staged_prefill_only(void **state)
{
    (void)state;
    use_fake_gpu();
    staged_layout(true, false);
    assert_int_equal(open_engines(), KVW_OK);
    assert_null(lp.decode->stager);
    req_spec_t q = staged_spec(42);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    send_staged(&q, s);
    finish(&q, s, r);
    assert_pools_free();
}

/* What staging refuses or loses: a request larger than decode's pool fails
 * at once naming the setting; a failed copy out of prefill's GPU fails the
 * request on both sides with nothing landed; a failed copy into decode's
 * GPU fails decode's side; the pools come back whole and the next request
 * succeeds. */
static void test_staged_limits_and_copy_failures(void **state)
{
    (void)state;
    use_fake_gpu();
    staged_layout(true, true);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t big[40];
    for (int i = 0; i < 40; i++)
        big[i] = (uint64_t)i;
    kvw_receiver_t *r;
    kvw_sender_t *s;
    const char *why = NULL;
    assert_int_equal(kvw_receiver_create(lp.decode, kvw_bootstrap_addr(lp.bs), 0, 50, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, big, 40, KVW_NO_AUX), KVW_ERR_LIMIT);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_LIMIT);
    assert_non_null(strstr(why, "KVW_STAGING_MIB"));
    kvw_receiver_destroy(r);

    req_spec_t none = {.aux_src = KVW_NO_AUX, .aux_dst = KVW_NO_AUX};
    req_spec_t q = staged_spec(51);
    fake_cuda_fail_next(false);
    start(&q, &s, &r);
    send_staged(&q, s);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(s, &why), KVW_ERR_TRANSFER);
    assert_non_null(strstr(why, "staging pool failed"));
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    assert_int_equal(wrong_bytes(&none), 0); /* decode's GPU memory untouched */
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);

    q.room = 52;
    fake_cuda_fail_next(true);
    start(&q, &s, &r);
    send_staged(&q, s);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_TRANSFER);
    assert_non_null(strstr(why, "from the staging pool to the GPU failed"));
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS); /* it all landed */
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);

    q.room = 53;
    start(&q, &s, &r);
    send_staged(&q, s);
    finish(&q, s, r);
    assert_pools_free();
}

/* ------------------------------------------------------- several QPs */

/* One connection over `want` QPs (prefill's count; decode offers qd): 48
 * scattered pages x 2 layers x K/V, every byte checked. Each QP carried
 * writes of the request and its own immediate, and decode reported Success
 * only with all of them. */
static void striped_round(uint32_t qp, uint32_t qd, bool one_device, uint64_t room)
{
    size_t kv[2] = {4096, 4096}, aux = 64;
    memset(&lp, 0, sizeof(lp));
    lp.qps_prefill = qp;
    lp.qps_decode = qd;
    lp.one_device = one_device;
    add_both(KVW_GROUP_KV, 2, 2, kv, 64);
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
    assert_int_equal(open_engines(), KVW_OK);
    uint64_t src[48], dst[48];
    for (int i = 0; i < 48; i++) {
        src[i] = (uint64_t)(i * 5 % 64); /* no two consecutive: a write per page */
        dst[i] = (uint64_t)(63 - i);
    }
    req_spec_t q = {
        .room = room, .n = 48, .src_pages = src, .dst_pages = dst, .aux_src = 2, .aux_dst = 3};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, src, 48), KVW_OK);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    assert_int_equal(wrong_bytes(&q), 0);
    uint32_t want = qp < qd ? qp : qd;
    lanes_seen_t seen = prefill_lanes();
    assert_int_equal(seen.nlanes, want);
    char line[160];
    int at = snprintf(line, sizeof(line), "%u QP%s (%s): WRs per QP", want, want > 1 ? "s" : "",
                      one_device ? "one device" : "two devices");
    for (uint32_t i = 0; i < want; i++) {
        /* every QP carried writes (a whole chain, or the last write), and
         * ended the request with an immediate */
        assert_true(seen.wrs_posted[i] >= 1);
        assert_int_equal(seen.imm_posted[i], 1);
        at += snprintf(line + at, sizeof(line) - (size_t)at, " %llu",
                       (unsigned long long)seen.wrs_posted[i]);
    }
    print_message("%s\n", line);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    teardown(NULL);
}

/* Staging over a striped connection: a slice's writes may span lanes, so
 * its chunk comes back only once every lane completed what was built before
 * it. Chunks are few (16) and the request needs 25 slices: each is reused. */
static void test_staged_striped(void **state)
{
    (void)state;
    use_fake_gpu();
    staged_layout(true, true);
    lp.qps_prefill = lp.qps_decode = 3;
    assert_int_equal(open_engines(), KVW_OK);
    for (uint64_t room = 80; room < 83; room++) {
        req_spec_t q = staged_spec(room);
        kvw_sender_t *s;
        kvw_receiver_t *r;
        start(&q, &s, &r);
        send_staged(&q, s);
        finish(&q, s, r);
    }
    lanes_seen_t seen = prefill_lanes();
    assert_int_equal(seen.nlanes, 3);
    for (uint32_t i = 0; i < 3; i++)
        assert_true(seen.wrs_posted[i] > 0);
    assert_pools_free();
}

static void test_striped_qps(void **state)
{
    (void)state;
    striped_round(1, 1, false, 70);
    striped_round(2, 2, false, 71);
    striped_round(4, 4, false, 72);
    striped_round(2, 4, false, 73); /* decode offers more: two are used */
    striped_round(4, 2, false, 74);
    striped_round(2, 2, true, 75);
    striped_round(4, 4, true, 76);
}

/* A receiver waiting for decode's slots gives up: it fails at once on
 * decode and, told by decode, on prefill; nothing of it lands; its place
 * in the queue goes, and the slots it never got serve the next request. */
static void test_staged_waiting_receiver_aborts(void **state)
{
    (void)state;
    use_fake_gpu();
    staged_layout(true, true);
    assert_int_equal(open_engines(), KVW_OK);
    req_spec_t qa = staged_spec(90), qb = staged_spec(91);
    kvw_sender_t *sa, *sb;
    kvw_receiver_t *ra, *rb;
    start(&qa, &sa, &ra);
    assert_int_equal(wait_end_ready(sa), KVW_POLL_WAITING_FOR_INPUT);
    start(&qb, &sb, &rb); /* 20 slots wanted, 11 free: it waits */
    pair_sleep_ms(100);
    assert_int_equal(kvw_sender_poll(sb), KVW_POLL_BOOTSTRAPPING);
    assert_int_equal(kvw_receiver_abort(rb), KVW_OK);
    const char *why = NULL;
    assert_int_equal(wait_end(poll_r, rb), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(rb, &why), KVW_ERR_ABORTED);
    assert_int_equal(wait_end(poll_s, sb), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(sb, NULL), KVW_ERR_ABORTED);
    kvw_sender_destroy(sb);
    kvw_receiver_destroy(rb);
    send_staged(&qa, sa);
    finish(&qa, sa, ra); /* every byte: a's, and nothing of b's */
    qa.room = 92;
    start(&qa, &sa, &ra);
    send_staged(&qa, sa);
    finish(&qa, sa, ra);
    assert_pools_free();
}

/* No pinned memory for the pool: the engine is not created, says why, and
 * leaves nothing behind. */
static void test_staged_pool_allocation_fails(void **state)
{
    (void)state;
    fake_cuda_config_t c = {.gdr = 0, .fail_host_alloc = 1};
    fake_cuda_init(&c);
    kvw__cuda_set_ops(&fake_cuda_ops);
    staged_layout(true, true);
    assert_int_equal(open_engines(), KVW_ERR_NO_MEMORY);
    assert_null(lp.prefill);
    fake_cuda_stats_t cs;
    fake_cuda_stats(&cs);
    assert_int_equal(cs.live_host_allocs, 0);
    assert_int_equal(cs.live_streams, 0);
}

/* Giving up while slices are being copied (slow copies): both handles
 * destroyed mid-transfer. Every chunk and slot comes back, and the next
 * request moves every byte. */
static void test_staged_abort_mid_copy(void **state)
{
    (void)state;
    fake_cuda_config_t c = {.gdr = 0, .copy_delay_us = 2000};
    fake_cuda_init(&c);
    kvw__cuda_set_ops(&fake_cuda_ops);
    staged_layout(true, true);
    assert_int_equal(open_engines(), KVW_OK);
    req_spec_t q = staged_spec(60);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(wait_end_ready(s), KVW_POLL_WAITING_FOR_INPUT);
    send_staged(&q, s);
    pair_sleep_ms(20); /* some slices copied, most not */
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    kvw_stager_stats_t ps;
    uint64_t end = pair_now_ms() + WAIT_MS;
    do {
        pair_sleep_ms(5);
        kvw__stager_stats(lp.prefill, &ps);
    } while (ps.free_chunks != ps.chunks && pair_now_ms() < end);
    assert_pools_free();
    fake_cuda_init(&(fake_cuda_config_t){.gdr = 0});
    q.room = 61;
    start(&q, &s, &r);
    send_staged(&q, s);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    /* Only what request 61 wrote, or what 60 may have landed before its
     * abort (the same bytes): every page of it right. */
    assert_int_equal(wrong_bytes(&q), 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    assert_pools_free();
}

/* ------------------------------------------------------------ hybrid models */

/* A hybrid model's memory (sglang's Mamba and SWA pools beside full
 * attention): group 0 K/V of 2 layers (32 pages), group 1 aux, group 2
 * Mamba state (2 layers of a conv and an SSM region, 4 slots), group 3 an
 * SWA pool (2 layers of K and V, 12 pages: fewer than the KV pool, so the
 * smallest-state-region limit of one shared list would refuse it), group
 * 4 a DSA-like pool of 8 items that the request skips. gpu: every group
 * but aux on the fake "GPU" of both sides, staged through the pool. */
static void hybrid_layout(bool gpu)
{
    size_t kv[2] = {256, 256}, aux = 48, mamba[2] = {96, 160}, swa[2] = {256, 256}, dsa = 64;
    if (gpu) {
        lp.staging_mib = 1;
        lp.staging_chunk_kib = 64;
    }
    lp.src.next_gpu = lp.dst.next_gpu = gpu;
    add_both(KVW_GROUP_KV, 2, 2, kv, 32);
    lp.src.next_gpu = lp.dst.next_gpu = false;
    add_both(KVW_GROUP_AUX, 1, 1, &aux, 4);
    lp.src.next_gpu = lp.dst.next_gpu = gpu;
    add_both(KVW_GROUP_STATE, 2, 2, mamba, 4);
    add_both(KVW_GROUP_STATE, 2, 2, swa, 12);
    add_both(KVW_GROUP_STATE, 1, 1, &dsa, 8);
    lp.src.next_gpu = lp.dst.next_gpu = false;
}

/* 6 KV pages, Mamba slot 1 -> 3, SWA pages {4, 5, 9} -> {0, 1, 11} (SWA
 * page 11 is past the Mamba pool's 4 slots), the DSA group skipped. */
static const uint64_t hy_src[] = {1, 2, 3, 4, 10, 11}, hy_dst[] = {20, 21, 22, 5, 6, 7};
static const uint64_t hy_mamba_src[] = {1}, hy_mamba_dst[] = {3};
static const uint64_t hy_swa_src[] = {4, 5, 9}, hy_swa_dst[] = {0, 1, 11};
static const state_spec_t hy_lists[] = {
    {2, 1, hy_mamba_src, hy_mamba_dst}, {3, 3, hy_swa_src, hy_swa_dst}, {4, 0, NULL, NULL}};

static req_spec_t hybrid_spec(uint64_t room)
{
    return (req_spec_t){.room = room,
                        .n = 6,
                        .src_pages = hy_src,
                        .dst_pages = hy_dst,
                        .aux_src = 2,
                        .aux_dst = 1,
                        .lists = hy_lists,
                        .nlists = 3};
}

/* Bytes a request moves: each group's regions times its own item count. */
static uint64_t spec_bytes(const req_spec_t *q)
{
    uint64_t bytes = 0;
    for (uint32_t g = 0; g < lp.dst.num_groups; g++) {
        const kvw_group_t *gr = &lp.dst.groups[g];
        const state_spec_t *own = list_of(q, g);
        uint64_t n = gr->kind == KVW_GROUP_KV    ? q->n
                     : gr->kind == KVW_GROUP_AUX ? (q->aux_dst != KVW_NO_AUX)
                     : own                       ? own->n
                                                 : q->ns;
        for (uint32_t k = 0; k < gr->num_layers * gr->regions_per_layer; k++)
            bytes += n * gr->regions[k].item_len;
    }
    return bytes;
}

static void run_hybrid(uint64_t room)
{
    req_spec_t q = hybrid_spec(room);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, q.src_pages, 4), KVW_OK); /* two prefill chunks */
    assert_int_equal(kvw_sender_send(s, q.src_pages + 4, 2), KVW_OK);
    assert_int_equal(send_state_of(&q, s), KVW_OK);
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_SUCCESS);
    /* Region by region: every covered item holds prefill's source, the
     * skipped DSA group and everything else the canary. */
    assert_int_equal(wrong_bytes(&q), 0);
    kvw_req_metrics_t ms, mr;
    assert_int_equal(kvw_sender_metrics(s, &ms), KVW_OK);
    assert_int_equal(kvw_receiver_metrics(r, &mr), KVW_OK);
    print_message("hybrid: %llu bytes in %llu writes\n", (unsigned long long)ms.bytes,
                  (unsigned long long)ms.writes);
    assert_int_equal(ms.bytes, spec_bytes(&q));
    assert_int_equal(mr.bytes, spec_bytes(&q));
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* Decode's memory back to the canary, for the next request's check. */
static void reset_dst(void)
{
    for (uint32_t r = 0; r < lp.dst.num_regions; r++)
        memset(lp.dst.mem[r], CANARY, lp.dst.regions[r].len);
}

/* Mamba and SWA state, each in its own index space, beside full attention. */
static void test_hybrid_mamba_swa(void **state)
{
    (void)state;
    hybrid_layout(false);
    assert_int_equal(open_engines(), KVW_OK);
    run_hybrid(60);
    /* An old caller's shared list still goes to every state group. */
    reset_dst();
    uint64_t src[] = {7}, dst[] = {2}, ss[] = {3}, ds[] = {1};
    req_spec_t q = {.room = 61,
                    .n = 1,
                    .ns = 1,
                    .src_pages = src,
                    .dst_pages = dst,
                    .src_state = ss,
                    .dst_state = ds,
                    .aux_src = KVW_NO_AUX,
                    .aux_dst = KVW_NO_AUX};
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(kvw_sender_send(s, src, 1), KVW_OK);
    assert_int_equal(kvw_sender_send_state(s, ss, 1), KVW_OK);
    finish(&q, s, r);
}

/* The same through the staging pool (GPU memory the NIC cannot reach):
 * each state group's items are staged and copied by its own list. */
static void test_hybrid_staged(void **state)
{
    (void)state;
    use_fake_gpu();
    hybrid_layout(true);
    assert_int_equal(open_engines(), KVW_OK);
    run_hybrid(62);
    assert_pools_free();
}

/* A receiver refused at init: Failed, with why, and prefill told. */
static void refused_init(uint64_t room, const kvw_state_list_t *lists, size_t n, kvw_status_t want,
                         const char *why_has)
{
    kvw_receiver_t *r;
    assert_int_equal(kvw_receiver_create(lp.decode, kvw_bootstrap_addr(lp.bs), 0, room, &r),
                     KVW_OK);
    kvw_indices_t x = {hy_dst, 6, KVW_NO_AUX, NULL, 0};
    assert_int_equal(kvw_receiver_init_lists(r, &x, lists, n), want);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), want);
    print_message("%s\n", why);
    assert_non_null(strstr(why, why_has));
    kvw_receiver_destroy(r);
}

/* Both sides of q end Failed with want, decode's reason naming why_has,
 * and nothing landed. */
static void both_failed(const req_spec_t *q, kvw_sender_t *s, kvw_receiver_t *r, kvw_status_t want,
                        const char *why_has)
{
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    assert_int_equal(wait_end(poll_s, s), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), want);
    print_message("decode: %s\n", why);
    assert_non_null(strstr(why, why_has));
    assert_int_equal(kvw_sender_failure(s, NULL), want);
    req_spec_t none = {.aux_src = KVW_NO_AUX, .aux_dst = KVW_NO_AUX};
    assert_int_equal(wrong_bytes(&none), 0);
    (void)q;
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* Every list is checked against its own group before anything is sent or
 * posted; counts that differ between the sides fail both. */
static void test_hybrid_refusals(void **state)
{
    (void)state;
    hybrid_layout(false);
    assert_int_equal(open_engines(), KVW_OK);
    /* Decode: SWA page 12 is inside the KV pool (32) but not the SWA one. */
    uint64_t swa12[] = {0, 12}, one[] = {0};
    kvw_state_list_t l = {3, 0, swa12, 2};
    refused_init(70, &l, 1, KVW_ERR_OUT_OF_RANGE,
                 "destination state index 12 (index 1) of group 3");
    l = (kvw_state_list_t){0, 0, one, 1}; /* the KV group */
    refused_init(71, &l, 1, KVW_ERR_INVALID, "not a state group");
    kvw_state_list_t twice[2] = {{3, 0, one, 1}, {3, 0, one, 1}};
    refused_init(72, twice, 2, KVW_ERR_INVALID, "listed twice");
    /* Prefill: Mamba slot 4 of 4. Decode hears why. */
    req_spec_t q = hybrid_spec(73);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    start(&q, &s, &r);
    assert_int_equal(wait_end_ready(s), KVW_POLL_WAITING_FOR_INPUT);
    uint64_t slot4[] = {4};
    kvw_state_list_t bad[3] = {{2, 0, slot4, 1}, {3, 0, hy_swa_src, 3}, {4, 0, NULL, 0}};
    assert_int_equal(kvw_sender_send_state_lists(s, NULL, 0, bad, 3), KVW_ERR_OUT_OF_RANGE);
    both_failed(&q, s, r, KVW_ERR_OUT_OF_RANGE, "source state index 4 (index 0) of group 2");
    /* Counts: decode asked for 3 SWA pages, prefill gives 2, after
     * decode's request arrived ... */
    q = hybrid_spec(74);
    start(&q, &s, &r);
    assert_int_equal(wait_end_ready(s), KVW_POLL_WAITING_FOR_INPUT);
    kvw_state_list_t short_swa[3] = {{2, 0, hy_mamba_src, 1}, {3, 0, hy_swa_src, 2}, {4, 0, 0, 0}};
    assert_int_equal(kvw_sender_send_state_lists(s, NULL, 0, short_swa, 3), KVW_ERR_MISMATCH);
    both_failed(&q, s, r, KVW_ERR_MISMATCH,
                "state group 3: prefill gives 2 indices, decode asked for 3");
    /* ... and before it: the request is refused when it arrives. */
    q = hybrid_spec(75);
    assert_int_equal(kvw_sender_create(lp.prefill, q.room, &s), KVW_OK);
    assert_int_equal(kvw_sender_init(s, q.n, q.aux_src), KVW_OK);
    assert_int_equal(kvw_sender_send_state_lists(s, NULL, 0, short_swa, 3), KVW_OK);
    assert_int_equal(kvw_receiver_create(lp.decode, kvw_bootstrap_addr(lp.bs), 0, q.room, &r),
                     KVW_OK);
    kvw_state_list_t want[3] = {{2, 0, hy_mamba_dst, 1}, {3, 0, hy_swa_dst, 3}, {4, 0, 0, 0}};
    kvw_indices_t x = {hy_dst, 6, q.aux_dst, NULL, 0};
    assert_int_equal(kvw_receiver_init_lists(r, &x, want, 3), KVW_OK);
    both_failed(&q, s, r, KVW_ERR_MISMATCH,
                "state group 3: decode asks for 3 indices, prefill gave 2");
}

/* ------------------------------------ hybrid state over two prefill ranks */

/* Prefill TP 2 -> decode TP 1 with a hybrid model: group 0 K/V of 2 layers
 * with its heads described (8 heads of 32 bytes, 4-token pages, 32 pages;
 * rank 0 holds [0, 4), rank 1 [4, 8), decode all 8), group 1 aux, group 2
 * Mamba state (a conv and an SSM region a layer, 4 slots, one per request),
 * group 3 an SWA pool (K and V a layer, 12 pages: shorter than KV's). Rank
 * 1's memory has its own pattern (regions offset by 100), so a byte from
 * the wrong rank shows. Both ranks' senders declare aux and state, as the
 * ranks of one TP group run the same code; one rank sends them. */
enum { HY_H = 8, HY_HB = 32, HY_T = 4, HY_PAGES = 32, HY_LAYERS = 2, HY_KV_REGIONS = 4 };
static const size_t hy_aux_len = 48, hy_mamba_len[2] = {96, 160}, hy_swa_len[2] = {256, 256};
static const uint64_t hyr_src[] = {3, 4, 5, 9, 20, 21, 30, 1},
                      hyr_dst[] = {0, 1, 2, 3, 7, 8, 9, 31};

/* A group on both prefill ranks (rank 1 with its own pattern) and decode. */
static void add_ranks(kvw_group_kind_t kind, uint32_t per_layer, const size_t *src_len,
                      const size_t *dst_len, uint64_t items)
{
    uint32_t layers = kind == KVW_GROUP_AUX ? 1 : HY_LAYERS;
    add_group(&lp.src, kind, layers, per_layer, src_len, items, true);
    uint32_t first = src2.num_regions;
    add_group(&src2, kind, layers, per_layer, src_len, items, true);
    for (uint32_t r = first; r < src2.num_regions; r++)
        for (size_t b = 0; b < src2.regions[r].len; b++)
            src2.mem[r][b] =
                pattern(r + 100, b / src2.regions[r].item_len, b % src2.regions[r].item_len);
    add_group(&lp.dst, kind, layers, per_layer, dst_len, items, false);
}

static void hybrid_ranks_layout(uint32_t order)
{
    size_t src_item = (size_t)HY_T * (HY_H / 2) * HY_HB, dst_item = 2 * src_item;
    add_ranks(KVW_GROUP_KV, 2, (size_t[]){src_item, src_item}, (size_t[]){dst_item, dst_item},
              HY_PAGES);
    add_ranks(KVW_GROUP_AUX, 1, &hy_aux_len, &hy_aux_len, 4);
    add_ranks(KVW_GROUP_STATE, 2, hy_mamba_len, hy_mamba_len, 4);
    add_ranks(KVW_GROUP_STATE, 2, hy_swa_len, hy_swa_len, 12);
    lp.src.heads[0] = (kvw_group_heads_t){HY_H, 0, HY_H / 2, HY_HB, HY_T, order};
    src2.heads[0] = (kvw_group_heads_t){HY_H, HY_H / 2, HY_H / 2, HY_HB, HY_T, order};
    lp.dst.heads[0] = (kvw_group_heads_t){HY_H, 0, HY_H, HY_HB, HY_T, order};
    lp.src.has_heads = lp.dst.has_heads = true;
    assert_int_equal(open_engines(), KVW_OK);
    open_prefill2();
}

/* Decode's bytes that differ from what q should have left: every head of
 * every token of q's pages from the rank holding it, the aux item and the
 * state from rank rest (a region of rank 1 has pattern region + 100), the
 * canary everywhere else. */
static size_t wrong_hybrid_ranks(uint32_t order, const req_spec_t *q, uint32_t rest)
{
    enum { HALF = HY_H / 2 };
    size_t dst_item = (size_t)HY_T * HY_H * HY_HB, wrong = 0;
    for (uint32_t reg = 0; reg < HY_KV_REGIONS; reg++)
        for (uint64_t p = 0; p < HY_PAGES; p++) {
            size_t i = q->n;
            for (size_t k = 0; k < q->n; k++)
                i = q->dst_pages[k] == p ? k : i;
            for (uint32_t t = 0; t < HY_T; t++)
                for (uint32_t k = 0; k < HY_H; k++)
                    for (uint32_t b = 0; b < HY_HB; b++) {
                        size_t at = order == KVW_PAGE_NHD ? ((size_t)t * HY_H + k) * HY_HB + b
                                                          : ((size_t)k * HY_T + t) * HY_HB + b;
                        uint32_t kk = k % HALF, from_reg = reg + (k < HALF ? 0 : 100);
                        size_t from = order == KVW_PAGE_NHD ? ((size_t)t * HALF + kk) * HY_HB + b
                                                            : ((size_t)kk * HY_T + t) * HY_HB + b;
                        uint8_t want =
                            i < q->n ? pattern(from_reg, q->src_pages[i], from) : (uint8_t)CANARY;
                        wrong += peek(&lp.dst.mem[reg][p * dst_item + at]) != want;
                    }
        }
    for (uint32_t g = 1; g < lp.dst.num_groups; g++) { /* aux and state: whole items */
        const kvw_group_t *gr = &lp.dst.groups[g];
        for (uint32_t k = 0; k < gr->num_layers * gr->regions_per_layer; k++) {
            uint32_t r = (uint32_t)(gr->regions - lp.dst.regions) + k;
            const kvw_region_t *reg = &lp.dst.regions[r];
            for (size_t b = 0; b < reg->len; b++)
                wrong += peek(&lp.dst.mem[r][b]) !=
                         expected(q, g, gr->kind, r + 100 * rest, reg->item_len, b);
        }
    }
    return wrong;
}

/* Runs of n (source, destination) pairs contiguous on both sides: the
 * writes a state list costs in each of its group's regions. */
static uint64_t runs_of(const uint64_t *src, const uint64_t *dst, size_t n)
{
    uint64_t runs = 0;
    for (size_t i = 0; i < n; i++)
        runs += !i || src[i] != src[i - 1] + 1 || dst[i] != dst[i - 1] + 1;
    return runs;
}

static const uint64_t hyr_mamba_src[] = {1}, hyr_mamba_dst[] = {3};
static const uint64_t hyr_swa_src[] = {4, 5, 9}, hyr_swa_dst[] = {0, 1, 11};
static const state_spec_t hyr_lists[] = {{2, 1, hyr_mamba_src, hyr_mamba_dst},
                                         {3, 3, hyr_swa_src, hyr_swa_dst}};

static req_spec_t hybrid_ranks_spec(uint64_t room)
{
    return (req_spec_t){.room = room,
                        .n = 8,
                        .src_pages = hyr_src,
                        .dst_pages = hyr_dst,
                        .aux_src = 2,
                        .aux_dst = 1,
                        .lists = hyr_lists,
                        .nlists = 2};
}

/* A receiver over both ranks for q, listed first_rank first, initialised
 * with q's lists. */
static kvw_receiver_t *hybrid_receiver(const req_spec_t *q, uint32_t first_rank, kvw_status_t want)
{
    kvw_prefill_rank_t ranks[2] = {{kvw_bootstrap_addr(lp.bs), NULL, first_rank},
                                   {kvw_bootstrap_addr(lp.bs), NULL, 1 - first_rank}};
    kvw_receiver_params_t rp = {
        .struct_size = sizeof(rp), .room = q->room, .num_ranks = 2, .ranks = ranks};
    kvw_receiver_t *r;
    assert_int_equal(kvw_receiver_create_ranks(lp.decode, &rp, &r), KVW_OK);
    kvw_indices_t x = {q->dst_pages, q->n, q->aux_dst, NULL, 0};
    kvw_state_list_t lists[MAX_GROUPS];
    for (size_t i = 0; i < q->nlists; i++)
        lists[i] = (kvw_state_list_t){q->lists[i].group, 0, q->lists[i].dst, q->lists[i].n};
    assert_int_equal(kvw_receiver_init_lists(r, &x, lists, q->nlists), want);
    return r;
}

/* One request over both ranks; decode lists first_rank first, so that
 * rank (owing heads) sends the aux item and the state. The other rank's
 * sender declares other_swa SWA pages (its lists are neither compared nor
 * sent), before its pages if other_state_first, else after them. */
static void hybrid_tp2_to_tp1(uint32_t order, uint32_t first_rank, size_t other_swa,
                              bool other_state_first)
{
    hybrid_ranks_layout(order);
    req_spec_t q = hybrid_ranks_spec(80);
    kvw_receiver_t *r = hybrid_receiver(&q, first_rank, KVW_OK);
    kvw_engine_t *eng[2] = {lp.prefill, prefill2};
    kvw_sender_t *s[2];
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(eng[k], q.room, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], q.n, q.aux_src), KVW_OK);
        kvw_state_list_t lists[2] = {{2, 0, hyr_mamba_src, 1},
                                     {3, 0, hyr_swa_src, k == first_rank ? 3 : other_swa}};
        bool state_first = k != first_rank && other_state_first;
        if (state_first)
            assert_int_equal(kvw_sender_send_state_lists(s[k], NULL, 0, lists, 2), KVW_OK);
        assert_int_equal(kvw_sender_send(s[k], q.src_pages, 3), KVW_OK);
        assert_int_equal(kvw_sender_send(s[k], q.src_pages + 3, q.n - 3), KVW_OK);
        if (!state_first)
            assert_int_equal(kvw_sender_send_state_lists(s[k], NULL, 0, lists, 2), KVW_OK);
    }
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_SUCCESS);
    size_t src_item = (size_t)HY_T * (HY_H / 2) * HY_HB;
    uint64_t units = order == KVW_PAGE_NHD ? q.n * HY_T : q.n; /* one write per row or page */
    uint64_t rest_bytes = hy_aux_len + HY_LAYERS * (hy_mamba_len[0] + hy_mamba_len[1]) +
                          3 * HY_LAYERS * (hy_swa_len[0] + hy_swa_len[1]);
    uint64_t rest_writes =
        1 + 2 * HY_LAYERS *
                (runs_of(hyr_mamba_src, hyr_mamba_dst, 1) + runs_of(hyr_swa_src, hyr_swa_dst, 3));
    uint64_t total = 0;
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(wait_end(poll_s, s[k]), KVW_POLL_SUCCESS);
        kvw_req_metrics_t m;
        assert_int_equal(kvw_sender_metrics(s[k], &m), KVW_OK);
        print_message("hybrid TP 2 -> 1 (%s), rank %u%s: %llu bytes in %llu writes\n",
                      order ? "HND" : "NHD", k, k == first_rank ? " (aux, state)" : "",
                      (unsigned long long)m.bytes, (unsigned long long)m.writes);
        bool rest = k == first_rank;
        assert_int_equal(m.bytes, q.n * HY_KV_REGIONS * src_item + (rest ? rest_bytes : 0));
        /* The part completing the request carries the immediate. The other
         * rank's state, given after its pages, completes it with nothing
         * to write: one empty write (as a rank owing no heads posts). */
        uint64_t extra = rest ? rest_writes : !other_state_first;
        /* KV landed in decode's landing buffer (path (b)): one gather write
         * per part (3 pages, then the rest) and region, not one per row or
         * page (units). */
        assert_int_equal(m.writes, HY_KV_REGIONS * 2 + extra);
        assert_true(HY_KV_REGIONS * 2 < HY_KV_REGIONS * units);
        total += m.bytes;
    }
    kvw_req_metrics_t rm;
    assert_int_equal(kvw_receiver_metrics(r, &rm), KVW_OK);
    assert_int_equal(rm.bytes, total);
    assert_int_equal(wrong_hybrid_ranks(order, &q, first_rank), 0);
    for (uint32_t k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
}

/* Rank 0 listed first sends aux and state, NHD; both ranks declare the
 * same lists, after their pages. */
static void test_hybrid_tp2_to_tp1_nhd(void **state)
{
    (void)state;
    hybrid_tp2_to_tp1(KVW_PAGE_NHD, 0, 3, false);
}

/* Rank 1 listed first sends them, HND; rank 0, sending no state, declares
 * 2 SWA pages where decode asks for 3 (not compared, not refused), and
 * before its pages, so its last KV write carries the immediate. */
static void test_hybrid_tp2_to_tp1_hnd_rank1_rest(void **state)
{
    (void)state;
    hybrid_tp2_to_tp1(KVW_PAGE_HND, 1, 2, true);
}

/* Both ranks' senders of q and the receiver end Failed (want for the
 * receiver and rank 0, the sending one; rank 1 aborted), decode's reason
 * naming rank 0 and why_has, and nothing landed. */
static void hybrid_both_failed(kvw_sender_t **s, kvw_receiver_t *r, kvw_status_t want,
                               const char *why_has)
{
    assert_int_equal(wait_end(poll_r, r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), want);
    print_message("decode: %s\n", why);
    assert_non_null(strstr(why, "prefill rank 0"));
    assert_non_null(strstr(why, why_has));
    for (uint32_t k = 0; k < 2; k++)
        assert_int_equal(wait_end(poll_s, s[k]), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(s[0], NULL), want);
    req_spec_t none = {.aux_src = KVW_NO_AUX, .aux_dst = KVW_NO_AUX};
    assert_int_equal(wrong_hybrid_ranks(KVW_PAGE_NHD, &none, 0), 0);
    for (uint32_t k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
}

/* Over two ranks: a state count differing from the sending rank's fails
 * both sides, whichever came first; a decode state index outside its
 * group is refused at init, before any request leaves. */
static void test_hybrid_tp2_to_tp1_refusals(void **state)
{
    (void)state;
    hybrid_ranks_layout(KVW_PAGE_NHD);
    kvw_engine_t *eng[2] = {lp.prefill, prefill2};
    kvw_state_list_t short_swa[2] = {{2, 0, hyr_mamba_src, 1}, {3, 0, hyr_swa_src, 2}};
    kvw_sender_t *s[2];
    /* Rank 0 (sending the state) gives 2 SWA pages after decode asked for 3. */
    req_spec_t q = hybrid_ranks_spec(81);
    kvw_receiver_t *r = hybrid_receiver(&q, 0, KVW_OK);
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(eng[k], q.room, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], q.n, q.aux_src), KVW_OK);
        assert_int_equal(wait_end_ready(s[k]), KVW_POLL_WAITING_FOR_INPUT);
    }
    assert_int_equal(kvw_sender_send_state_lists(s[0], NULL, 0, short_swa, 2), KVW_ERR_MISMATCH);
    hybrid_both_failed(s, r, KVW_ERR_MISMATCH,
                       "state group 3: prefill gives 2 indices, decode asked for 3");
    /* ... and before decode's request: refused when it arrives. */
    q = hybrid_ranks_spec(82);
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(eng[k], q.room, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], q.n, q.aux_src), KVW_OK);
        assert_int_equal(kvw_sender_send_state_lists(s[k], NULL, 0, short_swa, 2), KVW_OK);
    }
    r = hybrid_receiver(&q, 0, KVW_OK);
    hybrid_both_failed(s, r, KVW_ERR_MISMATCH,
                       "state group 3: decode asks for 3 indices, prefill gave 2");
    /* Decode's SWA page 12: inside the KV pool (32), past the SWA pool (12). */
    static const uint64_t swa12_dst[] = {0, 1, 12};
    state_spec_t bad[2] = {hyr_lists[0], {3, 3, hyr_swa_src, swa12_dst}};
    q = hybrid_ranks_spec(83);
    q.lists = bad;
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(eng[k], q.room, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], q.n, q.aux_src), KVW_OK);
    }
    r = hybrid_receiver(&q, 0, KVW_ERR_OUT_OF_RANGE);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_OUT_OF_RANGE);
    print_message("decode: %s\n", why);
    assert_non_null(strstr(why, "destination state index 12 (index 2) of group 3"));
    /* No request left: neither sender ever saw decode's indices. */
    for (uint32_t k = 0; k < 2; k++) {
        kvw_poll_t p = kvw_sender_poll(s[k]);
        assert_true(p == KVW_POLL_BOOTSTRAPPING || p == KVW_POLL_FAILED);
        kvw_sender_destroy(s[k]);
    }
    req_spec_t none = {.aux_src = KVW_NO_AUX, .aux_dst = KVW_NO_AUX};
    assert_int_equal(wrong_hybrid_ranks(KVW_PAGE_NHD, &none, 0), 0);
    kvw_receiver_destroy(r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_mla_no_wasted_bytes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_kv_two_aux_and_state, setup, teardown),
        cmocka_unit_test_setup_teardown(test_heads_tp1_to_tp2_nhd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_heads_tp1_to_tp2_hnd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_heads_tp2_to_tp1_nhd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_heads_tp2_to_tp1_hnd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_heads_tp2_to_tp1_rank_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chunked_sends, setup, teardown),
        cmocka_unit_test_setup_teardown(test_layerwise_from_another_thread, setup, teardown),
        cmocka_unit_test_setup_teardown(test_chunks_times_layers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_parts_fail_both_sides, setup, teardown),
        cmocka_unit_test_setup_teardown(test_group_mismatch_says_what, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_gpu_both_sides, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_prefill_only, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_limits_and_copy_failures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_abort_mid_copy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_waiting_receiver_aborts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_pool_allocation_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_striped_qps, setup, teardown),
        cmocka_unit_test_setup_teardown(test_staged_striped, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_mamba_swa, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_staged, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_tp2_to_tp1_nhd, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_tp2_to_tp1_hnd_rank1_rest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hybrid_tp2_to_tp1_refusals, setup, teardown),
    };
#ifdef LAYOUTS_ON_RXE
    tb_device_t d, d1;
    const char *name = tb_device(0, &d) ? "layouts and parts on real RDMA (rxe)" : "no RDMA device";
    printf("layouts_test: devices %s -> %s, test bed mode %s\n", tb_device(0, &d) ? d.name : "-",
           tb_device(1, &d1) ? d1.name : "the same", tb_mode());
#else
    const char *name = "layouts and parts on the fake NIC (not RDMA)";
#endif
    return cmocka_run_group_tests_name(name, tests, NULL, NULL);
}
