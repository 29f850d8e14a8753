/* SPDX-License-Identifier: Apache-2.0 */
/* Head slicing on the engine (docs/head-slicing.md), on the fake NIC (not
 * RDMA): one prefill engine holding all 8 KV heads, decode engines holding
 * a slice each (decode TP > prefill TP), K and V regions over 2 layers
 * plus an aux buffer, NHD and HND pages. Every byte of every decode
 * engine's memory is checked: each head of each landed token against
 * prefill's, the canary everywhere else. Also: what is refused, and how. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/core.h"
#include "plan/heads.h"
#include "support/engine_pair.h"
#include "support/fake_cuda.h"
#include "support/fake_nic.h"

enum {
    LAYERS = 2,
    HEADS = 8,
    HEAD_BYTES = 32,
    POOL = 24, /* pages per region */
    AUX_ITEM = 64,
    MAX_DECODE = 4,
    MAX_PREFILL = 8,
    CANARY = 0xee,
    WAIT_MS = 20000,
};

/* One engine's memory: K layers, V layers, one aux region. */
typedef struct mem {
    kvw_group_heads_t heads[2];
    kvw_region_t regions[2 * LAYERS + 1];
    uint8_t *buf[2 * LAYERS + 1];
    bool gpu; /* KV regions in fake GPU memory */
    kvw_group_t groups[2];
    kvw_engine_t *engine;
} mem_t;

static kvw_bootstrap_t *bs;
static kvw_config_t cfg;
static mem_t prefill, decode[MAX_DECODE], prefills[MAX_PREFILL];
static uint32_t page_tokens, order;
static uint32_t total_heads = HEADS; /* the model's KV heads */
static uint32_t engine_rank;         /* the next prefill engine's rank */
/* Decode engines opened from now on: their landing buffer (KVW_LANDING_MIB,
 * 0: none, path (a)), and their KV regions in fake GPU memory (the fake
 * CUDA seam installed) instead of host memory. */
static uint32_t landing_mib = 64;
static bool decode_gpu;
/* Decode engines opened from now on learn their heads from prefill
 * (learn_tp: their attention TP size; 0: they describe them), decode_rank
 * being the next one's attention TP rank. m->heads stays what they should
 * learn: the bytes are checked against it. */
static uint32_t learn_tp, decode_rank;

static uint64_t page_len(const kvw_group_heads_t *h)
{
    return (uint64_t)h->page_tokens * h->num_heads * h->head_bytes;
}

static uint64_t in_page(const kvw_group_heads_t *h, uint32_t t, uint32_t k, uint32_t b)
{
    if (h->page_order == KVW_PAGE_NHD)
        return ((uint64_t)t * h->num_heads + k) * h->head_bytes + b;
    return ((uint64_t)k * h->page_tokens + t) * h->head_bytes + b;
}

/* Prefill's byte b of head `head` of token t of page p in region r. */
static uint8_t value(uint32_t r, uint64_t p, uint32_t t, uint32_t head, uint32_t b)
{
    return (uint8_t)(r * 31u + p * 17u + t * 7u + head * 5u + b * 3u + 1u);
}

static void mem_open(mem_t *m, kvw_role_t role, uint32_t first, uint32_t count, uint32_t hb)
{
    memset(m, 0, sizeof(*m));
    m->heads[0] = (kvw_group_heads_t){total_heads, first, count, hb, page_tokens, order};
    uint64_t pl = page_len(&m->heads[0]);
    m->gpu = role == KVW_ROLE_DECODE && decode_gpu;
    for (uint32_t r = 0; r < 2 * LAYERS; r++) {
        m->buf[r] = m->gpu ? fake_cuda_alloc(pl * POOL) : malloc(pl * POOL);
        assert_non_null(m->buf[r]);
        memset(m->buf[r], CANARY, pl * POOL);
        if (role == KVW_ROLE_PREFILL)
            for (uint64_t p = 0; p < POOL; p++)
                for (uint32_t t = 0; t < page_tokens; t++)
                    for (uint32_t k = 0; k < count; k++)
                        for (uint32_t b = 0; b < hb; b++)
                            m->buf[r][p * pl + in_page(&m->heads[0], t, k, b)] =
                                value(r, p, t, first + k, b);
        m->regions[r] = (kvw_region_t){m->buf[r], pl * POOL, pl};
    }
    uint32_t a = 2 * LAYERS;
    m->buf[a] = malloc(AUX_ITEM * 4);
    assert_non_null(m->buf[a]);
    for (uint32_t b = 0; b < AUX_ITEM * 4; b++)
        m->buf[a][b] = role == KVW_ROLE_PREFILL ? (uint8_t)(b * 11 + 5) : CANARY;
    m->regions[a] = (kvw_region_t){m->buf[a], AUX_ITEM * 4, AUX_ITEM};
    m->groups[0] = (kvw_group_t){KVW_GROUP_KV, LAYERS, 2, m->regions};
    m->groups[1] = (kvw_group_t){KVW_GROUP_AUX, 1, 1, &m->regions[a]};
    kvw_config_t c = cfg;
    if (role == KVW_ROLE_DECODE)
        c.landing_mib = landing_mib;
    bool learning = role == KVW_ROLE_DECODE && learn_tp;
    kvw_group_heads_t learn_heads[2] = {{0, 0, 0, 0, page_tokens, order}, {0}};
    kvw_engine_params_t p = {.struct_size = sizeof(kvw_engine_params_t),
                             .role = role,
                             .device = role == KVW_ROLE_PREFILL ? "fake0" : "fake1",
                             .local_ip = "127.0.0.1",
                             .bootstrap_addr =
                                 role == KVW_ROLE_PREFILL ? kvw_bootstrap_addr(bs) : NULL,
                             .config = &c,
                             .engine_rank = role == KVW_ROLE_PREFILL ? engine_rank : 0,
                             .num_groups = 2,
                             .groups = m->groups,
                             .group_heads = learning ? learn_heads : m->heads,
                             .attn_tp_rank = learning ? decode_rank : 0,
                             .attn_tp_size = learning ? learn_tp : 0};
    assert_int_equal(kvw_engine_create(&p, &m->engine), KVW_OK);
}

static void mem_close(mem_t *m)
{
    kvw_engine_destroy(m->engine);
    for (uint32_t r = 0; r < 2 * LAYERS + 1; r++)
        if (m->gpu && r < 2 * LAYERS)
            fake_cuda_free(m->buf[r]);
        else
            free(m->buf[r]);
    memset(m, 0, sizeof(*m));
}

static int setup(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, getenv("KVW_TEST_LOG") ? KVW_LOG_INFO : KVW_LOG_ERROR);
    assert_int_equal(fake_nic_init(NULL), 0);
    kvw__verbs_set_ops(&fake_nic_ops);
    pair_config(&cfg);
    kvw_bootstrap_params_t bp = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = "127.0.0.1:0", .config = &cfg};
    assert_int_equal(kvw_bootstrap_create(&bp, &bs), KVW_OK);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int q = 0; q < MAX_DECODE; q++)
        if (decode[q].engine)
            mem_close(&decode[q]);
    for (int k = 0; k < MAX_PREFILL; k++)
        if (prefills[k].engine)
            mem_close(&prefills[k]);
    total_heads = HEADS;
    engine_rank = 0;
    learn_tp = decode_rank = 0;
    landing_mib = 64;
    decode_gpu = false;
    kvw__cuda_set_ops(NULL);
    if (prefill.engine)
        mem_close(&prefill);
    kvw_bootstrap_destroy(bs);
    bs = NULL;
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
    assert_int_equal(st.fatal_errors, 0);
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

static kvw_poll_t wait_sender(kvw_sender_t *s)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    kvw_poll_t st;
    while ((st = kvw_sender_poll(s)) != KVW_POLL_SUCCESS && st != KVW_POLL_FAILED &&
           pair_now_ms() < end)
        pair_sleep_ms(1);
    return st;
}

static kvw_poll_t wait_receiver(kvw_receiver_t *r)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    kvw_poll_t st;
    while ((st = kvw_receiver_poll(r)) != KVW_POLL_SUCCESS && st != KVW_POLL_FAILED &&
           pair_now_ms() < end)
        pair_sleep_ms(1);
    return st;
}

/* Decode engine m's bytes that differ from what the request of n pages
 * (src[i] -> dst[i], aux item 1 -> 2) should have left. */
static size_t wrong_bytes(const mem_t *m, const uint64_t *src, const uint64_t *dst, size_t n)
{
    const kvw_group_heads_t *h = &m->heads[0];
    uint64_t pl = page_len(h);
    size_t wrong = 0;
    for (uint32_t r = 0; r < 2 * LAYERS; r++)
        for (uint64_t p = 0; p < POOL; p++) {
            size_t i = n;
            for (size_t k = 0; k < n; k++)
                i = dst[k] == p ? k : i;
            for (uint32_t t = 0; t < h->page_tokens; t++)
                for (uint32_t k = 0; k < h->num_heads; k++)
                    for (uint32_t b = 0; b < h->head_bytes; b++) {
                        uint8_t want = i < n ? value(r, src[i], t, h->first_head + k, b) : CANARY;
                        wrong += m->buf[r][p * pl + in_page(h, t, k, b)] != want;
                    }
        }
    for (uint32_t b = 0; b < AUX_ITEM * 4; b++) {
        uint8_t want = b / AUX_ITEM == 2 ? (uint8_t)((AUX_ITEM + b % AUX_ITEM) * 11 + 5) : CANARY;
        wrong += m->buf[2 * LAYERS][b] != want;
    }
    return wrong;
}

/* Decode engine m's KV group's heads as the engine has them now (learned
 * ones are written under the engine lock). */
static kvw_heads_t engine_heads(const mem_t *m)
{
    pthread_mutex_lock(&m->engine->lock);
    kvw_heads_t h = m->engine->layout.groups[0].heads;
    pthread_mutex_unlock(&m->engine->lock);
    return h;
}

/* A decode engine that learned its heads has exactly those it should. */
static void assert_learned(const mem_t *m)
{
    const kvw_group_heads_t *w = &m->heads[0];
    kvw_heads_t h = engine_heads(m);
    assert_int_equal(h.total, w->total_heads);
    assert_int_equal(h.first, w->first_head);
    assert_int_equal(h.count, w->num_heads);
    assert_int_equal(h.head_bytes, w->head_bytes);
    assert_int_equal(h.page_tokens, w->page_tokens);
    assert_int_equal(h.order, w->page_order);
}

/* Prefill holds all 8 heads; decode_tp decode engines hold 8 / decode_tp
 * each; one request per decode engine moves n pages. */
static void run_split(uint32_t decode_tp, const uint64_t *src, const uint64_t *dst, size_t n)
{
    uint32_t per = HEADS / decode_tp;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    for (uint32_t q = 0; q < decode_tp; q++) {
        decode_rank = q;
        mem_open(&decode[q], KVW_ROLE_DECODE, q * per, per, HEAD_BYTES);
    }
    kvw_sender_t *s[MAX_DECODE];
    kvw_receiver_t *r[MAX_DECODE];
    for (uint32_t q = 0; q < decode_tp; q++) {
        assert_int_equal(kvw_sender_create(prefill.engine, 100 + q, &s[q]), KVW_OK);
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, 100 + q, &r[q]),
            KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], dst, n, 2), KVW_OK);
        assert_int_equal(kvw_sender_init(s[q], n, 1), KVW_OK);
        /* In two parts: chunked sends work as without slicing. */
        assert_int_equal(kvw_sender_send(s[q], src, n / 2), KVW_OK);
        assert_int_equal(kvw_sender_send(s[q], src + n / 2, n - n / 2), KVW_OK);
    }
    for (uint32_t q = 0; q < decode_tp; q++) {
        assert_int_equal(wait_receiver(r[q]), KVW_POLL_SUCCESS);
        assert_int_equal(wait_sender(s[q]), KVW_POLL_SUCCESS);
        assert_int_equal(wrong_bytes(&decode[q], src, dst, n), 0);
        assert_learned(&decode[q]);
        kvw_req_metrics_t mt;
        assert_int_equal(kvw_sender_metrics(s[q], &mt), KVW_OK);
        /* Each decode engine got its share of every page, and the aux item. */
        assert_int_equal(mt.bytes, 2 * LAYERS * n * page_len(&decode[q].heads[0]) + AUX_ITEM);
        kvw_sender_destroy(s[q]);
        kvw_receiver_destroy(r[q]);
    }
    for (uint32_t q = 0; q < decode_tp; q++)
        mem_close(&decode[q]);
    mem_close(&prefill);
}

static const uint64_t contiguous[8] = {3, 4, 5, 6, 7, 8, 9, 10};
static const uint64_t fragmented[8] = {20, 1, 14, 7, 3, 18, 11, 22};

/* 1:2 and 1:4, NHD and HND, pages contiguous or fragmented on either side:
 * the gather writes put every head where it belongs. */
static void test_decode_fewer_heads(void **state)
{
    (void)state;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++)
        for (page_tokens = 4; page_tokens <= 16; page_tokens *= 4) {
            run_split(2, fragmented, contiguous, 8);
            run_split(4, contiguous, fragmented, 8);
            run_split(2, contiguous, contiguous, 8);
        }
}

/* The gather writes count: 1:2 NHD, 16-token pages, contiguous on both
 * sides: each K or V region of each layer is one run of 8 pages, 128
 * token slices, gathered 32 a write (the fake NIC's max_sge), so 4 writes
 * a region, 16 in all plus the aux item's. */
static void test_gather_write_count(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 16;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    mem_open(&decode[0], KVW_ROLE_DECODE, 4, 4, HEAD_BYTES);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    assert_int_equal(kvw_sender_create(prefill.engine, 7, &s), KVW_OK);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 0, 7, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 8, 2), KVW_OK);
    assert_int_equal(kvw_sender_init(s, 8, 1), KVW_OK);
    assert_int_equal(kvw_sender_send(s, contiguous, 8), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
    kvw_req_metrics_t mt;
    assert_int_equal(kvw_sender_metrics(s, &mt), KVW_OK);
    assert_int_equal(mt.writes, 2 * LAYERS * 4 + 1);
    assert_int_equal(wrong_bytes(&decode[0], contiguous, contiguous, 8), 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* Decode asking for heads this prefill rank lacks fails the request on
 * both sides, saying which; a model mismatch is refused at the handshake,
 * saying what differs. */
static void test_refusals(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, 4, HEAD_BYTES); /* a rank of TP 2 */
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    const char *why = NULL;
    assert_int_equal(kvw_sender_create(prefill.engine, 9, &s), KVW_OK);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 0, 9, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(kvw_sender_init(s, 4, KVW_NO_AUX), KVW_OK);
    kvw_sender_send(s, contiguous, 4);
    assert_int_equal(wait_sender(s), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(s, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "heads [0, 8): prefill holds [0, 4), decode [0, 8)"));
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "prefill holds [0, 4)"));
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    mem_close(&decode[0]);
    /* Another head size: the handshake says so. */
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, 2, 2 * HEAD_BYTES);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 0, 10, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    kvw_receiver_failure(r, &why);
    assert_non_null(strstr(why, "bytes per head"));
    kvw_receiver_destroy(r);
}

/* ------------------------------------------- decode over several ranks */

/* Prefill rank k of ptp: its heads of the model's total_heads, replicated
 * (GQA) when ranks outnumber heads. */
static void rank_heads(uint32_t ptp, uint32_t k, uint32_t *first, uint32_t *count)
{
    if (ptp <= total_heads) {
        *count = total_heads / ptp;
        *first = k * *count;
    } else {
        *count = 1;
        *first = k / (ptp / total_heads);
    }
}

/* A receiver over every prefill rank of ptp for room, at decode engine m. */
static kvw_receiver_t *create_set(const mem_t *m, uint32_t ptp, uint64_t room)
{
    kvw_prefill_rank_t ranks[MAX_PREFILL];
    for (uint32_t k = 0; k < ptp; k++)
        ranks[k] = (kvw_prefill_rank_t){.bootstrap_addr = kvw_bootstrap_addr(bs), .rank = k};
    kvw_receiver_params_t rp = {
        .struct_size = sizeof(rp), .room = room, .num_ranks = ptp, .ranks = ranks};
    kvw_receiver_t *r = NULL;
    assert_int_equal(kvw_receiver_create_ranks(m->engine, &rp, &r), KVW_OK);
    return r;
}

/* Writes prefill rank k posts toward decode engine m for n pages, with
 * one write per token row (NHD) or page (HND) of every KV region, plus
 * the aux item for the rank sending it; a rank owing nothing posts one
 * empty write, which carries the immediate. */
static uint64_t rank_writes(const mem_t *m, uint32_t owed, bool aux, size_t n)
{
    if (!owed)
        return 1;
    (void)m;
    uint64_t units = order == KVW_PAGE_NHD ? n * page_tokens : n;
    return 2 * LAYERS * units + aux;
}

/* Prefill TP ptp -> decode TP dtp: the engines (decode engine q holds
 * heads [q per, (q + 1) per)). */
static void open_multi(uint32_t ptp, uint32_t dtp)
{
    for (uint32_t k = 0; k < ptp; k++) {
        uint32_t first, count;
        rank_heads(ptp, k, &first, &count);
        engine_rank = k;
        mem_open(&prefills[k], KVW_ROLE_PREFILL, first, count, HEAD_BYTES);
    }
    uint32_t per = total_heads / dtp;
    for (uint32_t q = 0; q < dtp; q++) {
        decode_rank = q;
        mem_open(&decode[q], KVW_ROLE_DECODE, q * per, per, HEAD_BYTES);
    }
}

static void close_multi(uint32_t ptp, uint32_t dtp)
{
    for (uint32_t q = 0; q < dtp; q++)
        mem_close(&decode[q]);
    for (uint32_t k = 0; k < ptp; k++)
        mem_close(&prefills[k]);
}

/* Decode engine q's landing buffer now. */
static kvw_landing_stats_t landing_of(uint32_t q)
{
    kvw_landing_stats_t st;
    kvw__landing_stats(decode[q].engine, &st);
    return st;
}

/* One request of room base + q per decode engine over every prefill rank,
 * each rank sending it in two parts: every head of every token of every
 * decode engine is checked, and each rank's share of the writes. landed:
 * ranks sending part of decode's rows land them in the landing buffer
 * (path (b)), else write a row at a time (path (a)). */
static void xfer_multi(uint32_t ptp, uint32_t dtp, const uint64_t *src, const uint64_t *dst,
                       size_t n, uint64_t base, bool landed)
{
    uint32_t per = total_heads / dtp;
    kvw_sender_t *s[MAX_DECODE][MAX_PREFILL];
    kvw_receiver_t *r[MAX_DECODE];
    kvw_landing_stats_t before[MAX_DECODE];
    uint64_t jobs_before[MAX_DECODE];
    for (uint32_t q = 0; q < dtp; q++) { /* the canary back where a request before landed */
        for (uint32_t g = 0; g < 2 * LAYERS; g++)
            memset(decode[q].buf[g], CANARY, decode[q].regions[g].len);
        memset(decode[q].buf[2 * LAYERS], CANARY, AUX_ITEM * 4);
    }
    for (uint32_t q = 0; q < dtp; q++) {
        before[q] = landing_of(q);
        jobs_before[q] = kvw__copier_jobs(decode[q].engine);
        r[q] = create_set(&decode[q], ptp, base + q);
        assert_int_equal(kvw_receiver_init(r[q], dst, n, 2), KVW_OK);
        for (uint32_t k = 0; k < ptp; k++) {
            assert_int_equal(kvw_sender_create(prefills[k].engine, base + q, &s[q][k]), KVW_OK);
            assert_int_equal(kvw_sender_init(s[q][k], n, 1), KVW_OK);
            assert_int_equal(kvw_sender_send(s[q][k], src, n / 2), KVW_OK);
            assert_int_equal(kvw_sender_send(s[q][k], src + n / 2, n - n / 2), KVW_OK);
        }
    }
    for (uint32_t q = 0; q < dtp; q++) {
        assert_int_equal(wait_receiver(r[q]), KVW_POLL_SUCCESS);
        assert_int_equal(wrong_bytes(&decode[q], src, dst, n), 0);
        assert_learned(&decode[q]);
        /* Who owes what: kvw__heads_assign over the ranks in list order. */
        kvw_heads_t want = {total_heads, q * per, per, HEAD_BYTES, page_tokens, order};
        kvw_heads_t have[MAX_PREFILL];
        kvw_head_range_t owed[MAX_PREFILL];
        char why[160];
        for (uint32_t k = 0; k < ptp; k++) {
            have[k] = want;
            rank_heads(ptp, k, &have[k].first, &have[k].count);
        }
        assert_int_equal(kvw__heads_assign(&want, have, ptp, owed, why, sizeof(why)), 0);
        uint64_t bytes = 0, strided = 0;
        bool aux_sent = false;
        for (uint32_t k = 0; k < ptp; k++) {
            assert_int_equal(wait_sender(s[q][k]), KVW_POLL_SUCCESS);
            kvw_req_metrics_t mt;
            assert_int_equal(kvw_sender_metrics(s[q][k], &mt), KVW_OK);
            bool aux = owed[k].count && !aux_sent;
            aux_sent |= aux;
            /* A strided destination (the rank sends part of decode's rows):
             * landed, one gather write per part and KV region (its pages'
             * runs are at most 4 entries, contiguous in the landing
             * buffer), as equal TP with contiguous destination pages;
             * else one write per row or page. All of decode's heads:
             * copies, fewer. */
            uint64_t rows = rank_writes(&decode[q], owed[k].count, aux, n);
            if (owed[k].count && owed[k].count < per) {
                strided++;
                assert_int_equal(mt.writes, landed ? (uint64_t)(2 * LAYERS * 2 + aux) : rows);
                assert_true(!landed || mt.writes < rows);
            } else {
                assert_in_range(mt.writes, 1, rows);
            }
            assert_int_equal(mt.bytes, 2 * LAYERS * n * page_tokens * owed[k].count * HEAD_BYTES +
                                           (aux ? AUX_ITEM : 0));
            bytes += mt.bytes;
            kvw_sender_destroy(s[q][k]);
        }
        kvw_req_metrics_t rm;
        assert_int_equal(kvw_receiver_metrics(r[q], &rm), KVW_OK);
        assert_int_equal(rm.bytes, bytes);
        assert_int_equal(bytes, 2 * LAYERS * n * page_len(&decode[q].heads[0]) + AUX_ITEM);
        kvw_receiver_destroy(r[q]);
        /* Each landed rank scattered once, on the copier's thread (not
         * the poller's), and gave its space back. */
        kvw_landing_stats_t now = landing_of(q);
        assert_int_equal(now.scatters - before[q].scatters, landed ? strided : 0);
        assert_int_equal(kvw__copier_jobs(decode[q].engine) - jobs_before[q], landed ? strided : 0);
        assert_int_equal(now.reserved, before[q].reserved);
    }
}

/* Prefill TP ptp -> decode TP dtp (dtp < ptp, or GQA replicas), landed
 * where the destination is strided unless landing_mib is 0. */
static void run_multi(uint32_t ptp, uint32_t dtp, const uint64_t *src, const uint64_t *dst,
                      size_t n)
{
    open_multi(ptp, dtp);
    xfer_multi(ptp, dtp, src, dst, n, 200, landing_mib != 0);
    close_multi(ptp, dtp);
}

/* 2:1, 4:1 and 8:2, NHD and HND, pages contiguous or fragmented: landed
 * and copied (path (b), the default). */
static void test_decode_more_heads(void **state)
{
    (void)state;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++)
        for (page_tokens = 4; page_tokens <= 16; page_tokens *= 4) {
            run_multi(2, 1, fragmented, contiguous, 8);
            run_multi(4, 1, contiguous, fragmented, 8);
            run_multi(8, 2, contiguous, contiguous, 8);
        }
}

/* The same without a landing buffer (KVW_LANDING_MIB=0): a write per row
 * (NHD) or page (HND), path (a). */
static void test_decode_more_heads_rows(void **state)
{
    (void)state;
    landing_mib = 0;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++)
        for (page_tokens = 4; page_tokens <= 16; page_tokens *= 4) {
            run_multi(2, 1, fragmented, contiguous, 8);
            run_multi(4, 1, contiguous, fragmented, 8);
            run_multi(8, 2, contiguous, contiguous, 8);
        }
}

/* A landing buffer with no room for the request: path (a) for it, every
 * byte still right; once room is back, path (b) again. The room is taken
 * by a reservation of the test's own. */
static void test_landing_full(void **state)
{
    (void)state;
    landing_mib = 1;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    open_multi(2, 1);
    kvw_engine_t *e = decode[0].engine;
    assert_int_equal(landing_of(0).len, 1u << 20);
    kvw_req_t hog;
    memset(&hog, 0, sizeof(hog));
    pthread_mutex_lock(&e->lock);
    /* All but 4 KiB; the request's share is 2 x 2 x 8 x 4 x 4 x 32 = 16 KiB. */
    assert_true(kvw__landing_reserve_locked(e, &hog, (1u << 20) - 4096));
    pthread_mutex_unlock(&e->lock);
    xfer_multi(2, 1, fragmented, contiguous, 8, 600, false);
    pthread_mutex_lock(&e->lock);
    kvw__landing_release_locked(e, &hog);
    pthread_mutex_unlock(&e->lock);
    assert_int_equal(landing_of(0).reserved, 0);
    xfer_multi(2, 1, contiguous, fragmented, 8, 610, true);
    close_multi(2, 1);
}

/* Prefill checks the landing slice a REQUEST names against the buffer
 * decode's HELLO advertised, like any index: here rank 0 is made to
 * believe the buffer is 4 KiB, so the 16 KiB slice of the request is
 * outside it. Rank 0's request fails on both sides (KVW_ERR_OUT_OF_RANGE,
 * before any write), rank 1 is aborted, none of rank 0's heads reaches
 * decode's rows, and every reservation is released. */
static void test_landing_refused(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    open_multi(2, 1);
    xfer_multi(2, 1, contiguous, contiguous, 8, 800, true); /* connected, landing works */
    kvw_engine_t *p0 = prefills[0].engine;
    pthread_mutex_lock(&p0->lock);
    uint32_t shrunk = 0;
    for (uint32_t i = 0; i < p0->peer_slots; i++) {
        kvw_peer_t *p = kvw__peer_at(p0, i);
        if (p && p->landing_len) {
            p->landing_len = 4096;
            shrunk++;
        }
    }
    pthread_mutex_unlock(&p0->lock);
    assert_int_equal(shrunk, 1);
    for (uint32_t g = 0; g < 2 * LAYERS; g++)
        memset(decode[0].buf[g], CANARY, decode[0].regions[g].len);
    kvw_receiver_t *r = create_set(&decode[0], 2, 810);
    assert_int_equal(kvw_receiver_init(r, fragmented, 8, 2), KVW_OK);
    kvw_sender_t *s[2];
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(prefills[k].engine, 810, &s[k]), KVW_OK);
        /* Rank 0 refuses decode's request as it meets it, which may be
         * before this init or send, and decode then aborts rank 1, which
         * may come before rank 1's (its ABORT makes the request Failed
         * before a sender exists): then the call finds the sender Failed. */
        kvw_status_t st = kvw_sender_init(s[k], 8, 1);
        if (st == KVW_OK)
            st = kvw_sender_send(s[k], contiguous, 8);
        if (st == KVW_ERR_STATE)
            assert_int_equal(kvw_sender_poll(s[k]), KVW_POLL_FAILED);
        else
            assert_int_equal(st, KVW_OK);
    }
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_OUT_OF_RANGE);
    assert_non_null(strstr(why, "prefill rank 0"));
    assert_non_null(strstr(why, "outside decode's landing buffer (4096 bytes)"));
    assert_int_equal(wait_sender(s[0]), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(s[0], &why), KVW_ERR_OUT_OF_RANGE);
    kvw_req_metrics_t mt;
    assert_int_equal(kvw_sender_metrics(s[0], &mt), KVW_OK);
    assert_int_equal(mt.writes, 0);
    /* Rank 1 may have delivered all its writes before its abort came (its
     * sender Success, its heads maybe copied in), as on any path; rank 0's
     * heads never reach the rows. */
    kvw_poll_t s1 = wait_sender(s[1]);
    assert_true(s1 == KVW_POLL_FAILED || s1 == KVW_POLL_SUCCESS);
    const kvw_group_heads_t *h = &decode[0].heads[0];
    size_t touched = 0;
    for (uint32_t g = 0; g < 2 * LAYERS; g++)
        for (uint64_t p = 0; p < POOL; p++)
            for (uint32_t t = 0; t < page_tokens; t++)
                for (uint32_t k = 0; k < HEADS / 2; k++)
                    for (uint32_t b = 0; b < HEAD_BYTES; b++)
                        touched +=
                            fake_nic_peek(
                                &decode[0].buf[g][p * page_len(h) + in_page(h, t, k, b)]) != CANARY;
    assert_int_equal(touched, 0);
    kvw_landing_stats_t ls = landing_of(0);
    assert_int_equal(ls.reserved, 0);
    assert_in_range(ls.scatters, 2, 3); /* the first request's two ranks, maybe rank 1's */
    for (uint32_t k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
    close_multi(2, 1);
}

/* Decode's KV regions in (fake) GPU memory, registered as dma-bufs: the
 * landing buffer is GPU memory from the CUDA seam, and each landed rank's
 * heads reach the rows by cuMemcpy2DAsync, one per KV region and run of
 * contiguous pages, on the fake CUDA's stream thread. */
static void test_landing_gpu(void **state)
{
    (void)state;
    fake_cuda_init(&(fake_cuda_config_t){.gdr = 1});
    kvw__cuda_set_ops(&fake_cuda_ops);
    decode_gpu = true;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++) {
        page_tokens = 4;
        open_multi(2, 1);
        assert_int_equal(decode[0].engine->mrs[0].path, KVW_MEM_PATH_DMABUF);
        kvw_landing_stats_t st = landing_of(0);
        assert_true(st.gpu);
        fake_cuda_stats_t c0, c1;
        fake_cuda_stats(&c0);
        assert_int_equal(c0.live_dev_allocs, 1);
        /* A destination of one run (contiguous), then of 8 (fragmented). */
        xfer_multi(2, 1, fragmented, contiguous, 8, 700 + order, true);
        fake_cuda_stats(&c1);
        uint64_t rows = order == KVW_PAGE_NHD ? 8 * page_tokens : 8; /* per region */
        /* 2 ranks x 4 regions x the destination's 1 run */
        assert_int_equal(c1.copies_2d - c0.copies_2d, 2 * 2 * LAYERS);
        assert_int_equal(c1.rows_2d - c0.rows_2d, 2 * 2 * LAYERS * rows);
        xfer_multi(2, 1, contiguous, fragmented, 8, 710 + order, true);
        fake_cuda_stats(&c0);
        assert_int_equal(c0.copies_2d - c1.copies_2d, 2 * 2 * LAYERS * 8);
        assert_int_equal(c0.rows_2d - c1.rows_2d, 2 * 2 * LAYERS * rows);
        assert_int_equal(landing_of(0).copies - st.copies, 2 * 2 * LAYERS * 9);
        close_multi(2, 1);
        fake_cuda_stats(&c1);
        assert_int_equal(c1.live_dev_allocs, 0);
    }
}

/* GQA: 2 KV heads over prefill TP 4 (each head on two ranks) to decode
 * TP 1 and 2: one rank sends each head, its replica owes nothing and
 * finishes with one empty write. */
static void test_gqa_replicas(void **state)
{
    (void)state;
    total_heads = 2;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    run_multi(4, 1, fragmented, contiguous, 8);
    run_multi(4, 2, contiguous, fragmented, 8);
    order = KVW_PAGE_HND;
    run_multi(4, 1, contiguous, contiguous, 8);
}

/* Snapshot of decode engine m's KV and aux bytes. */
static uint8_t *snapshot(const mem_t *m)
{
    uint64_t pl = page_len(&m->heads[0]);
    uint8_t *c = malloc(2 * LAYERS * pl * POOL + AUX_ITEM * 4);
    assert_non_null(c);
    /* Through the fake NIC's lock: its thread may still be writing. */
    for (uint32_t r = 0; r < 2 * LAYERS; r++)
        for (uint64_t b = 0; b < pl * POOL; b++)
            c[r * pl * POOL + b] = fake_nic_peek(&m->buf[r][b]);
    for (uint64_t b = 0; b < AUX_ITEM * 4; b++)
        c[2 * LAYERS * pl * POOL + b] = fake_nic_peek(&m->buf[2 * LAYERS][b]);
    return c;
}

static bool same(const mem_t *m, const uint8_t *c)
{
    uint8_t *now = snapshot(m);
    uint64_t pl = page_len(&m->heads[0]);
    bool eq = memcmp(now, c, 2 * LAYERS * pl * POOL + AUX_ITEM * 4) == 0;
    free(now);
    return eq;
}

/* Prefill TP 2 -> decode TP 1; prefill rank 1 is destroyed mid-request
 * (its process gone) while rank 0 has sent half: the receiver fails, only
 * once rank 0 confirmed its abort (its sender Failed too), naming rank 1;
 * nothing lands after Failed. */
static void test_rank_dies(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    for (uint32_t k = 0; k < 2; k++) {
        engine_rank = k;
        mem_open(&prefills[k], KVW_ROLE_PREFILL, k * 4, 4, HEAD_BYTES);
    }
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    kvw_receiver_t *r = create_set(&decode[0], 2, 300);
    assert_int_equal(kvw_receiver_init(r, contiguous, 8, 2), KVW_OK);
    kvw_sender_t *s[2];
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(prefills[k].engine, 300, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], 8, 1), KVW_OK);
    }
    assert_int_equal(kvw_sender_send(s[0], contiguous, 4), KVW_OK);
    /* Rank 0's half landed (its writes counted), then rank 1 goes. */
    uint64_t end = pair_now_ms() + WAIT_MS;
    kvw_req_metrics_t mt = {0};
    while (pair_now_ms() < end &&
           (kvw_sender_metrics(s[0], &mt), mt.bytes < 2 * LAYERS * 4 * 4 * 4 * HEAD_BYTES))
        pair_sleep_ms(1);
    assert_int_equal(mt.bytes, 2 * LAYERS * 4 * 4 * 4 * HEAD_BYTES);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_TRANSFERRING);
    /* Each rank's 8 pages of 4 tokens x 4 heads, in every region, landed. */
    assert_int_equal(landing_of(0).reserved, 2 * 2 * LAYERS * 8 * 4 * 4 * HEAD_BYTES);
    kvw_sender_destroy(s[1]);
    mem_close(&prefills[1]);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    /* Rank 0 was told, and confirmed, before decode reported Failed. */
    assert_int_equal(kvw_sender_poll(s[0]), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_not_equal(kvw_receiver_failure(r, &why), KVW_OK);
    assert_non_null(strstr(why, "prefill rank 1"));
    /* Both ranks' heads were to land in the landing buffer: neither was
     * copied into the rows, and both gave their space back. */
    kvw_landing_stats_t ls = landing_of(0);
    assert_int_equal(ls.scatters, 0);
    assert_int_equal(ls.reserved, 0);
    uint8_t *before = snapshot(&decode[0]);
    assert_int_not_equal(kvw_sender_send(s[0], contiguous + 4, 4), KVW_OK);
    pair_sleep_ms(50);
    assert_true(same(&decode[0], before));
    free(before);
    kvw_sender_destroy(s[0]);
    kvw_receiver_destroy(r);
}

/* The copy out of the landing buffer fails (the fake CUDA fails the next
 * copy into GPU memory) after every byte of both ranks landed: decode
 * reports Failed with KVW_ERR_TRANSFER and the reason, never Success; the
 * landing space comes back; both prefill ranks end (Success when their
 * writes completed before decode failed the room, else Failed: both
 * happen, by timing); and decode's rows do not change after Failed. */
static void test_landing_copy_fails(void **state)
{
    (void)state;
    fake_cuda_init(&(fake_cuda_config_t){.gdr = 1});
    kvw__cuda_set_ops(&fake_cuda_ops);
    decode_gpu = true;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    open_multi(2, 1);
    fake_cuda_fail_next(true);
    kvw_receiver_t *r = create_set(&decode[0], 2, 800);
    assert_int_equal(kvw_receiver_init(r, contiguous, 8, 2), KVW_OK);
    kvw_sender_t *s[2];
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(prefills[k].engine, 800, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], 8, 1), KVW_OK);
        assert_int_equal(kvw_sender_send(s[k], fragmented, 8), KVW_OK);
    }
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_TRANSFER);
    assert_non_null(strstr(why, "copying it from the landing buffer failed"));
    fake_cuda_stats_t c;
    fake_cuda_stats(&c);
    assert_int_equal(c.failed_copies, 1);
    for (uint32_t k = 0; k < 2; k++) {
        kvw_poll_t ps = wait_sender(s[k]);
        assert_true(ps == KVW_POLL_SUCCESS || ps == KVW_POLL_FAILED);
    }
    assert_int_equal(landing_of(0).reserved, 0);
    uint8_t *before = snapshot(&decode[0]);
    pair_sleep_ms(50);
    assert_true(same(&decode[0], before));
    free(before);
    for (uint32_t k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
    close_multi(2, 1);
    fake_cuda_stats(&c);
    assert_int_equal(c.live_dev_allocs, 0);
}

/* A receiver over ranks named by their endpoints (no bootstrap lookup),
 * aborted by the caller while both ranks are mid-request: every rank's
 * sender fails, the receiver turns Failed (KVW_ERR_ABORTED) once both
 * confirmed, and nothing lands after. */
static void test_set_endpoints_abort(void **state)
{
    (void)state;
    order = KVW_PAGE_HND;
    page_tokens = 4;
    for (uint32_t k = 0; k < 2; k++) {
        engine_rank = k;
        mem_open(&prefills[k], KVW_ROLE_PREFILL, k * 4, 4, HEAD_BYTES);
    }
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    kvw_prefill_rank_t ranks[2] = {{NULL, kvw_engine_endpoint(prefills[0].engine), 0},
                                   {NULL, kvw_engine_endpoint(prefills[1].engine), 1}};
    kvw_receiver_params_t rp = {
        .struct_size = sizeof(rp), .room = 500, .num_ranks = 2, .ranks = ranks};
    kvw_receiver_t *r = NULL;
    assert_int_equal(kvw_receiver_create_ranks(decode[0].engine, &rp, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, fragmented, 8, 2), KVW_OK);
    kvw_sender_t *s[2];
    for (uint32_t k = 0; k < 2; k++) {
        assert_int_equal(kvw_sender_create(prefills[k].engine, 500, &s[k]), KVW_OK);
        assert_int_equal(kvw_sender_init(s[k], 8, 1), KVW_OK);
        assert_int_equal(kvw_sender_send(s[k], contiguous, 4), KVW_OK);
    }
    /* Both ranks' first halves landed. */
    uint64_t half = 2 * LAYERS * 4 * page_len(&prefills[0].heads[0]), end = pair_now_ms() + WAIT_MS;
    kvw_req_metrics_t m0 = {0}, m1 = {0};
    while (pair_now_ms() < end && (kvw_sender_metrics(s[0], &m0), kvw_sender_metrics(s[1], &m1),
                                   m0.bytes < half || m1.bytes < half))
        pair_sleep_ms(1);
    assert_int_equal(m0.bytes, half);
    assert_int_equal(m1.bytes, half);
    assert_int_equal(kvw_receiver_poll(r), KVW_POLL_TRANSFERRING);
    assert_int_equal(kvw_receiver_abort(r), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    for (uint32_t k = 0; k < 2; k++) /* both told, both confirmed */
        assert_int_equal(kvw_sender_poll(s[k]), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_ABORTED);
    assert_non_null(strstr(why, "aborted by the caller"));
    assert_int_equal(kvw_receiver_abort(r), KVW_ERR_STATE);
    uint8_t *before = snapshot(&decode[0]);
    for (uint32_t k = 0; k < 2; k++)
        assert_int_not_equal(kvw_sender_send(s[k], contiguous + 4, 4), KVW_OK);
    pair_sleep_ms(50);
    assert_true(same(&decode[0], before));
    free(before);
    for (uint32_t k = 0; k < 2; k++)
        kvw_sender_destroy(s[k]);
    kvw_receiver_destroy(r);
}

/* What a receiver over several ranks refuses: an empty or repeated list,
 * and heads no rank holds (failing every member, saying which head). */
static void test_set_refusals(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    engine_rank = 0;
    mem_open(&prefills[0], KVW_ROLE_PREFILL, 0, 4, HEAD_BYTES);
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    kvw_prefill_rank_t ranks[2] = {{kvw_bootstrap_addr(bs), NULL, 0},
                                   {kvw_bootstrap_addr(bs), NULL, 0}};
    kvw_receiver_params_t rp = {.struct_size = sizeof(rp), .room = 400, .ranks = ranks};
    kvw_receiver_t *r = NULL;
    assert_int_equal(kvw_receiver_create_ranks(decode[0].engine, &rp, &r), KVW_ERR_INVALID);
    rp.num_ranks = 2;
    assert_int_equal(kvw_receiver_create_ranks(decode[0].engine, &rp, &r), KVW_ERR_INVALID);
    /* Rank 0 alone holds half of decode's heads. */
    rp.num_ranks = 1;
    assert_int_equal(kvw_receiver_create_ranks(decode[0].engine, &rp, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "head 4 of decode's [0, 8) is held by none of 1 prefill ranks"));
    kvw_receiver_destroy(r);
}

/* ------------------------------------- prefill over several decode ranks */

/* Wait until the prefill engine holds n requests (decode's REQUESTs that
 * arrived before any sender: each decode engine's own). */
static void wait_table(kvw_engine_t *e, size_t n)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (pair_table_size(e) < n && pair_now_ms() < end)
        pair_sleep_ms(1);
    assert_int_equal(pair_table_size(e), n);
}

/* The fan-out sender run_fanout makes: with the caller's count
 * (kvw_sender_create_fanout), or learned from decode's requests
 * (kvw_sender_create_learn; each receiver says the count). */
static bool learn;

static kvw_status_t create_fanout(uint32_t dtp, kvw_sender_t **s)
{
    if (learn)
        return kvw_sender_create_learn(prefill.engine, 400, s);
    return kvw_sender_create_fanout(prefill.engine, 400, dtp, s);
}

/* Wait until s leaves Bootstrapping (a learning sender takes work only
 * once it knows its receivers). */
static kvw_poll_t wait_asked(kvw_sender_t *s)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    while (kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING && pair_now_ms() < end)
        pair_sleep_ms(1);
    return kvw_sender_poll(s);
}

/* One prefill rank holding heads [0, heads) of total_heads serves one
 * room to dtp decode engines, each holding its slice (or, MLA, the same
 * one latent head): one fan-out sender, a receiver on each decode engine.
 * early: decode's REQUESTs arrive before the sender exists (adopted). */
static void run_fanout(uint32_t dtp, bool early, const uint64_t *src, const uint64_t *dst, size_t n)
{
    uint32_t per = total_heads == 1 ? 1 : total_heads / dtp;
    uint32_t hb = total_heads == 1 ? 4 * HEAD_BYTES : HEAD_BYTES;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, total_heads, hb);
    for (uint32_t q = 0; q < dtp; q++) {
        decode_rank = q;
        mem_open(&decode[q], KVW_ROLE_DECODE, total_heads == 1 ? 0 : q * per, per, hb);
    }
    kvw_sender_t *s = NULL;
    kvw_receiver_t *r[MAX_DECODE];
    if (!early)
        assert_int_equal(create_fanout(dtp, &s), KVW_OK);
    if (learn && !early) /* nothing asked yet: no work taken */
        assert_int_equal(kvw_sender_init(s, n, 1), KVW_ERR_STATE);
    for (uint32_t q = 0; q < dtp; q++) {
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, 400, &r[q]), KVW_OK);
        if (learn)
            assert_int_equal(kvw_receiver_set_room_receivers(r[q], dtp), KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], dst, n, 2), KVW_OK);
    }
    if (early) {
        wait_table(prefill.engine, dtp);
        assert_int_equal(create_fanout(dtp, &s), KVW_OK);
        assert_int_equal(pair_table_size(prefill.engine), dtp); /* adopted, none added */
    }
    if (learn) /* every decode engine asked: WaitingForInput */
        assert_int_equal(wait_asked(s), KVW_POLL_WAITING_FOR_INPUT);
    assert_int_equal(kvw_sender_init(s, n, 1), KVW_OK);
    assert_int_equal(kvw_sender_send(s, src, n / 2), KVW_OK); /* chunked */
    assert_int_equal(kvw_sender_send(s, src + n / 2, n - n / 2), KVW_OK);
    uint64_t want = 0;
    for (uint32_t q = 0; q < dtp; q++) {
        assert_int_equal(wait_receiver(r[q]), KVW_POLL_SUCCESS);
        assert_int_equal(wrong_bytes(&decode[q], src, dst, n), 0); /* every head, aux, canary */
        assert_learned(&decode[q]);
        want += 2 * LAYERS * n * page_len(&decode[q].heads[0]) + AUX_ITEM;
    }
    assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
    kvw_req_metrics_t mt;
    assert_int_equal(kvw_sender_metrics(s, &mt), KVW_OK);
    assert_int_equal(mt.bytes, want); /* each decode engine's share of every page, its aux */
    size_t np = 0;
    uint32_t aux = 0;
    assert_int_equal(kvw_sender_requested(s, &np, &aux), KVW_OK);
    assert_int_equal(np, n);
    assert_int_equal(aux, 0);
    kvw_sender_destroy(s);
    for (uint32_t q = 0; q < dtp; q++) {
        kvw_receiver_destroy(r[q]);
        mem_close(&decode[q]);
    }
    mem_close(&prefill);
}

/* MHA 1 -> 2 and 1 -> 4 through one sender: each decode engine gets its
 * heads (gathered), NHD and HND, 4- and 16-token pages, the sender made
 * before or after decode asked. */
static void test_fanout_heads(void **state)
{
    (void)state;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++)
        for (page_tokens = 4; page_tokens <= 16; page_tokens *= 4) {
            run_fanout(2, false, fragmented, contiguous, 8);
            run_fanout(2, true, contiguous, fragmented, 8);
            run_fanout(4, false, contiguous, contiguous, 8);
        }
}

/* MLA 1 -> 2: the one latent head, replicated, goes whole to each decode
 * engine (no slicing), with its own aux item. */
static void test_fanout_mla_replicated(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    total_heads = 1;
    run_fanout(2, false, fragmented, contiguous, 8);
    run_fanout(2, true, contiguous, fragmented, 8);
}

/* No count given on prefill (sglang without --disaggregation-decode-tp):
 * the sender learns from decode's requests how many decode engines read
 * the room, 2 or 4, MHA (each its heads) and MLA (the latent whole to
 * each), decode asking before or after the sender exists; every byte
 * right on every decode engine. */
static void test_fanout_learned(void **state)
{
    (void)state;
    learn = true;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    run_fanout(2, false, fragmented, contiguous, 8);
    run_fanout(2, true, contiguous, fragmented, 8);
    run_fanout(4, false, contiguous, contiguous, 8);
    total_heads = 1; /* MLA */
    run_fanout(2, false, fragmented, contiguous, 8);
    run_fanout(2, true, contiguous, fragmented, 8);
    learn = false;
}

/* Two decode engines ask a learning sender for room `room`, saying
 * `said[q]` receivers (0: say nothing) over a connection offering
 * `offer[q]`; returns their receivers, inited. */
static void ask_learning(uint64_t room, const uint32_t said[2], const kvw_wire_offer_t offer[2],
                         kvw_sender_t **s, kvw_receiver_t *r[2])
{
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    for (uint32_t q = 0; q < 2; q++) {
        mem_open(&decode[q], KVW_ROLE_DECODE, q * 4, 4, HEAD_BYTES);
        decode[q].engine->wire = offer[q]; /* before its first handshake */
    }
    assert_int_equal(kvw_sender_create_learn(prefill.engine, room, s), KVW_OK);
    for (uint32_t q = 0; q < 2; q++) {
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, room, &r[q]), KVW_OK);
        if (said[q])
            assert_int_equal(kvw_receiver_set_room_receivers(r[q], said[q]), KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], contiguous, 4, 2), KVW_OK);
        uint64_t end = pair_now_ms() + WAIT_MS; /* decode engine 0's request is the first */
        size_t np;
        uint32_t aux;
        while (q == 0 && kvw_sender_requested(*s, &np, &aux) == KVW_ERR_STATE &&
               pair_now_ms() < end)
            pair_sleep_ms(1);
    }
}

static void close_learning(kvw_sender_t *s, kvw_receiver_t *r[2])
{
    kvw_sender_destroy(s);
    for (uint32_t q = 0; q < 2; q++) {
        kvw_receiver_destroy(r[q]);
        mem_close(&decode[q]);
    }
    mem_close(&prefill);
}

static const kvw_wire_offer_t NEW = {KVW_WIRE_VERSION_MIN, KVW_WIRE_VERSION, KVW_WIRE_CAPS_ALL};
/* A decode engine as 1.4.x offers (wire 11 alone): its REQUEST cannot say
 * a count, whatever its caller set. */
static const kvw_wire_offer_t WIRE11 = {11, 11, KVW_WIRE_CAPS_V11};

/* Requests that say no count (decode engines on wire-11 connections,
 * whose callers said 2 but whose REQUESTs cannot carry it; or whose
 * callers said none): the learning sender serves the first decode engine
 * as a plain sender would, every byte right, and refuses the second
 * (KVW_ERR_LIMIT). */
static void test_fanout_learn_unsaid(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    for (int quiet = 0; quiet < 2; quiet++) {
        const uint32_t said[2] = {quiet ? 0 : 2, quiet ? 0 : 2};
        const kvw_wire_offer_t offer[2] = {quiet ? NEW : WIRE11, quiet ? NEW : WIRE11};
        kvw_sender_t *s;
        kvw_receiver_t *r[2];
        ask_learning(700 + (uint64_t)quiet, said, offer, &s, r);
        assert_int_equal(kvw_sender_poll(s), KVW_POLL_WAITING_FOR_INPUT); /* one receiver */
        assert_int_equal(wait_receiver(r[1]), KVW_POLL_FAILED);
        const char *why = NULL;
        assert_int_equal(kvw_receiver_failure(r[1], &why), KVW_ERR_LIMIT);
        assert_non_null(strstr(why, "serves 1 decode receivers, all claimed"));
        assert_int_equal(kvw_sender_init(s, 4, 1), KVW_OK);
        assert_int_equal(kvw_sender_send(s, contiguous, 4), KVW_OK);
        assert_int_equal(wait_receiver(r[0]), KVW_POLL_SUCCESS);
        assert_int_equal(wrong_bytes(&decode[0], contiguous, contiguous, 4), 0);
        assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
        close_learning(s, r);
    }
}

/* Counts that disagree fail the room for every receiver, the reason
 * naming both: a learning sender told 2 by the first request and 3 by the
 * second; a sender told 2 by its caller and 3 by a request. Nothing lands
 * on the decode engine that asked second. */
static void test_fanout_counts_disagree(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    const uint32_t said[2] = {2, 3};
    const kvw_wire_offer_t offer[2] = {NEW, NEW};
    kvw_sender_t *s;
    kvw_receiver_t *r[2];
    const char *why = NULL;
    ask_learning(710, said, offer, &s, r);
    for (uint32_t q = 0; q < 2; q++) {
        assert_int_equal(wait_receiver(r[q]), KVW_POLL_FAILED);
        assert_int_not_equal(kvw_receiver_failure(r[q], &why), KVW_OK);
    }
    assert_int_equal(kvw_receiver_failure(r[1], &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "a request says 3 decode receivers ask for it, the room's sender "
                                "serves 2 (the first request's count)"));
    assert_int_equal(wait_sender(s), KVW_POLL_FAILED);
    assert_int_equal(kvw_sender_failure(s, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "says 3 decode receivers"));
    assert_int_equal(kvw_sender_init(s, 4, 1), KVW_ERR_STATE);
    uint64_t pl = page_len(&decode[1].heads[0]);
    for (uint64_t b = 0; b < pl * POOL; b++)
        assert_int_equal(decode[1].buf[0][b], CANARY);
    close_learning(s, r);
    /* The caller's count: a request saying another fails the room. */
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, 4, HEAD_BYTES);
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 720, 2, &s), KVW_OK);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 0, 720, &r[0]),
                     KVW_OK);
    assert_int_equal(kvw_receiver_set_room_receivers(r[0], 3), KVW_OK);
    assert_int_equal(kvw_receiver_init(r[0], contiguous, 4, 2), KVW_OK);
    assert_int_equal(wait_receiver(r[0]), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r[0], &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "says 3 decode receivers ask for it, the room's sender serves 2 "
                                "(its caller's count)"));
    assert_int_equal(wait_sender(s), KVW_POLL_FAILED);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r[0]);
    mem_close(&decode[0]);
    mem_close(&prefill);
}

/* A bad count is refused where it is given: over KVW_MAX_DECODE_RECEIVERS,
 * after init, on a prefill engine's sender API (the wire's own checks:
 * test_wire's test_request_receivers). */
static void test_fanout_count_refused(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, 4, HEAD_BYTES);
    kvw_sender_t *s;
    kvw_receiver_t *r;
    assert_int_equal(kvw_sender_create_learn(decode[0].engine, 730, &s), KVW_ERR_INVALID);
    assert_int_equal(kvw_sender_create_learn(NULL, 730, &s), KVW_ERR_INVALID);
    assert_int_equal(kvw_receiver_set_room_receivers(NULL, 2), KVW_ERR_INVALID);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 0, 730, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_set_room_receivers(r, KVW_MAX_DECODE_RECEIVERS + 1),
                     KVW_ERR_INVALID);
    assert_int_equal(kvw_receiver_set_room_receivers(r, KVW_MAX_DECODE_RECEIVERS), KVW_OK);
    assert_int_equal(kvw_receiver_set_room_receivers(r, 1), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, 2), KVW_OK);
    assert_int_equal(kvw_receiver_set_room_receivers(r, 2), KVW_ERR_STATE);
    assert_int_equal(kvw_sender_create_learn(prefill.engine, 730, &s), KVW_OK);
    assert_int_equal(kvw_sender_create_learn(prefill.engine, 730, &s), KVW_ERR_EXISTS);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
    mem_close(&decode[0]);
    mem_close(&prefill);
}

/* 1 -> 2; decode engine 1 goes (its receiver destroyed and the engine
 * closed, as its process exiting does; or it aborts) while prefill has
 * sent half: the sender fails every request, decode engine 0's
 * receiver is Failed only once prefill confirmed (nothing lands after),
 * and the sender's reason names the receiver that failed first. */
static void run_fanout_receiver_fails(bool kill)
{
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    for (uint32_t q = 0; q < 2; q++)
        mem_open(&decode[q], KVW_ROLE_DECODE, q * 4, 4, HEAD_BYTES);
    kvw_sender_t *s;
    kvw_receiver_t *r[2];
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 500, 2, &s), KVW_OK);
    for (uint32_t q = 0; q < 2; q++) {
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, 500, &r[q]), KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], contiguous, 8, 2), KVW_OK);
    }
    assert_int_equal(kvw_sender_init(s, 8, 1), KVW_OK);
    assert_int_equal(kvw_sender_send(s, contiguous, 4), KVW_OK);
    uint64_t half = 2 * 2 * LAYERS * 4 * 4 * 4 * HEAD_BYTES; /* both engines' first 4 pages */
    uint64_t end = pair_now_ms() + WAIT_MS;
    kvw_req_metrics_t mt = {0};
    while (pair_now_ms() < end && (kvw_sender_metrics(s, &mt), mt.bytes < half))
        pair_sleep_ms(1);
    assert_int_equal(mt.bytes, half);
    assert_int_equal(kvw_receiver_poll(r[0]), KVW_POLL_TRANSFERRING);
    if (kill) {
        kvw_receiver_destroy(r[1]);
        mem_close(&decode[1]);
    } else {
        assert_int_equal(kvw_receiver_abort(r[1]), KVW_OK);
        assert_int_equal(wait_receiver(r[1]), KVW_POLL_FAILED);
    }
    assert_int_equal(wait_receiver(r[0]), KVW_POLL_FAILED);
    assert_int_equal(wait_sender(s), KVW_POLL_FAILED);
    const char *why = NULL;
    assert_int_not_equal(kvw_sender_failure(s, &why), KVW_OK);
    /* Receivers are numbered in the order their requests claimed the sender. */
    assert_non_null(strstr(why, " of 2: decode gave the room up: "));
    assert_non_null(strstr(why, kill ? "receiver destroyed" : "aborted by the caller"));
    assert_int_not_equal(kvw_receiver_failure(r[0], &why), KVW_OK);
    assert_non_null(strstr(why, " of 2 of the room failed"));
    uint8_t *before = snapshot(&decode[0]);
    assert_int_equal(kvw_sender_send(s, contiguous + 4, 4), KVW_ERR_STATE);
    pair_sleep_ms(50);
    assert_true(same(&decode[0], before));
    free(before);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r[0]);
    if (!kill)
        kvw_receiver_destroy(r[1]);
}

static void test_fanout_receiver_killed(void **state)
{
    (void)state;
    run_fanout_receiver_fails(true);
}

static void test_fanout_receiver_aborts(void **state)
{
    (void)state;
    run_fanout_receiver_fails(false);
}

/* Wrong counts and misuse: bad arguments; a room a sender owns; a third
 * decode engine asking a sender that serves two is refused (KVW_ERR_LIMIT)
 * and the two others go on; a plain sender serves one of two decode
 * engines that asked ahead and refuses the other at once (KVW_ERR_EXISTS). */
static void test_fanout_refusals(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    for (uint32_t q = 0; q < 3; q++)
        mem_open(&decode[q], KVW_ROLE_DECODE, (q % 2) * 4, 4, HEAD_BYTES);
    kvw_sender_t *s, *s2, *plain;
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 600, 0, &s), KVW_ERR_INVALID);
    assert_int_equal(
        kvw_sender_create_fanout(prefill.engine, 600, KVW_MAX_DECODE_RECEIVERS + 1, &s),
        KVW_ERR_INVALID);
    assert_int_equal(kvw_sender_create_fanout(decode[0].engine, 600, 2, &s), KVW_ERR_INVALID);
    assert_int_equal(kvw_sender_create(prefill.engine, 600, &plain), KVW_OK);
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 600, 2, &s), KVW_ERR_EXISTS);
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 601, 2, &s), KVW_OK);
    assert_int_equal(kvw_sender_create(prefill.engine, 601, &s2), KVW_ERR_EXISTS);
    assert_int_equal(kvw_sender_create_fanout(prefill.engine, 601, 2, &s2), KVW_ERR_EXISTS);
    /* Three decode engines ask a sender serving two. */
    kvw_receiver_t *r[3];
    const char *why = NULL;
    for (uint32_t q = 0; q < 3; q++) {
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, 601, &r[q]), KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], contiguous, 4, 2), KVW_OK);
        uint64_t end = pair_now_ms() + WAIT_MS; /* the first two claimed their requests */
        while (q == 1 && kvw_sender_poll(s) == KVW_POLL_BOOTSTRAPPING && pair_now_ms() < end)
            pair_sleep_ms(1);
    }
    assert_int_equal(wait_receiver(r[2]), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r[2], &why), KVW_ERR_LIMIT);
    assert_non_null(strstr(why, "serves 2 decode receivers, all claimed"));
    assert_int_equal(kvw_sender_init(s, 4, 1), KVW_OK);
    assert_int_equal(kvw_sender_send(s, contiguous, 4), KVW_OK);
    for (uint32_t q = 0; q < 2; q++) {
        assert_int_equal(wait_receiver(r[q]), KVW_POLL_SUCCESS);
        assert_int_equal(wrong_bytes(&decode[q], contiguous, contiguous, 4), 0);
    }
    assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
    uint64_t pl = page_len(&decode[2].heads[0]);
    for (uint64_t b = 0; b < pl * POOL; b++) /* the refused engine's pages untouched */
        assert_int_equal(decode[2].buf[0][b], CANARY);
    kvw_sender_destroy(s);
    for (uint32_t q = 0; q < 3; q++)
        kvw_receiver_destroy(r[q]);
    /* A plain sender, two decode engines asked ahead: one is served, the
     * other refused at once. */
    size_t base = pair_table_size(prefill.engine);
    for (uint32_t q = 0; q < 2; q++) {
        assert_int_equal(
            kvw_receiver_create(decode[q].engine, kvw_bootstrap_addr(bs), 0, 602, &r[q]), KVW_OK);
        assert_int_equal(kvw_receiver_init(r[q], fragmented, 4, KVW_NO_AUX), KVW_OK);
    }
    wait_table(prefill.engine, base + 2);
    assert_int_equal(kvw_sender_create(prefill.engine, 602, &s), KVW_OK);
    assert_int_equal(kvw_sender_init(s, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(kvw_sender_send(s, contiguous, 4), KVW_OK);
    assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
    kvw_poll_t a = wait_receiver(r[0]), b = wait_receiver(r[1]);
    assert_true((a == KVW_POLL_SUCCESS) != (b == KVW_POLL_SUCCESS));
    assert_int_equal(kvw_receiver_failure(a == KVW_POLL_SUCCESS ? r[1] : r[0], &why),
                     KVW_ERR_EXISTS);
    assert_non_null(strstr(why, "already claimed"));
    kvw_sender_destroy(s);
    kvw_sender_destroy(plain);
    for (uint32_t q = 0; q < 2; q++)
        kvw_receiver_destroy(r[q]);
}

/* ------------------------------------------- heads learned from prefill */

/* Decode engines describe only their pages (4 or 16 tokens, NHD or HND)
 * and their attention TP place; each learns its heads from prefill's
 * handshake (assert_learned) and every head of every token lands where it
 * belongs: equal TP (1:1), decode TP 2 over prefill TP 1 (one plain sender
 * per decode rank, and one fan-out sender for both), prefill TP 2 ->
 * decode TP 1 (a receiver over both prefill ranks, landed and copied). */
static void test_learn_heads(void **state)
{
    (void)state;
    for (order = KVW_PAGE_NHD; order <= KVW_PAGE_HND; order++)
        for (page_tokens = 4; page_tokens <= 16; page_tokens *= 4) {
            learn_tp = 1;
            engine_rank = 0; /* the one prefill engine's (open_multi leaves it at 1) */
            run_split(1, fragmented, contiguous, 8);
            run_multi(2, 1, contiguous, fragmented, 8);
            learn_tp = 2;
            engine_rank = 0;
            run_split(2, contiguous, fragmented, 8);
            run_fanout(2, false, fragmented, contiguous, 8);
            run_fanout(2, true, contiguous, contiguous, 8);
        }
}

/* GQA with fewer KV heads than decode ranks: the model's 1 head of 128 B
 * on decode TP 2, replicated: each decode rank learns head [0, 1) and
 * gets it whole from the one prefill rank (fan-out sender). */
static void test_learn_gqa_replicated(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    total_heads = 1;
    learn_tp = 2;
    run_fanout(2, false, fragmented, contiguous, 8);
    run_fanout(2, true, contiguous, fragmented, 8);
}

/* A learning decode engine (in decode[0]'s memory) with the given TP
 * place and heads array: what kvw_engine_create says. */
static kvw_status_t create_learning(kvw_role_t role, const kvw_group_heads_t *heads, uint32_t rank,
                                    uint32_t size)
{
    kvw_engine_params_t p = {.struct_size = sizeof(p),
                             .role = role,
                             .device = "fake1",
                             .local_ip = "127.0.0.1",
                             .bootstrap_addr =
                                 role == KVW_ROLE_PREFILL ? kvw_bootstrap_addr(bs) : NULL,
                             .config = &cfg,
                             .engine_rank = 5,
                             .num_groups = 2,
                             .groups = decode[0].groups,
                             .group_heads = heads,
                             .attn_tp_rank = rank,
                             .attn_tp_size = size};
    kvw_engine_t *e = NULL;
    kvw_status_t st = kvw_engine_create(&p, &e);
    if (!st)
        kvw_engine_destroy(e);
    return st;
}

/* Receiver for room at decode[0] from prefill rank `rank`: it fails, with
 * KVW_ERR_MISMATCH and `want` in its reason. */
static void expect_refused(uint32_t rank, uint64_t room, const char *want)
{
    kvw_receiver_t *r;
    const char *why = NULL;
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), rank, room, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    if (!strstr(why, want))
        fail_msg("reason \"%s\" lacks \"%s\"", why, want);
    kvw_receiver_destroy(r);
}

/* One request of 4 pages from prefill engine pm (rank `rank`) to
 * decode[0]: every byte. */
static void xfer_one(mem_t *pm, uint32_t rank, uint64_t room)
{
    kvw_sender_t *s;
    kvw_receiver_t *r;
    assert_int_equal(kvw_sender_create(pm->engine, room, &s), KVW_OK);
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), rank, room, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, fragmented, 4, 2), KVW_OK);
    assert_int_equal(kvw_sender_init(s, 4, 1), KVW_OK);
    assert_int_equal(kvw_sender_send(s, contiguous, 4), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_SUCCESS);
    assert_int_equal(wait_sender(s), KVW_POLL_SUCCESS);
    assert_int_equal(wrong_bytes(&decode[0], contiguous, fragmented, 4), 0);
    kvw_sender_destroy(s);
    kvw_receiver_destroy(r);
}

/* Wait until decode engine m sent its HELLO to prefill rank `rank`. */
static void wait_hello_sent(const mem_t *m, uint32_t rank)
{
    uint64_t end = pair_now_ms() + WAIT_MS;
    for (;;) {
        for (uint32_t i = 0; i < m->engine->peer_slots; i++) {
            kvw_peer_t *p = kvw__peer_at(m->engine, i);
            if (p && p->rank == rank && atomic_load(&p->state) == PEER_HELLO)
                return;
        }
        assert_true(pair_now_ms() < end);
        pair_sleep_ms(1);
    }
}

/* What learning refuses: bad parameters at creation; at the handshake an
 * item length that is no whole number of prefill's heads, or whole heads
 * that are not the model's over decode's TP (nothing learned, nothing
 * written); a second prefill rank whose heads give decode other heads
 * than the first taught (refused by decode, the heads learned kept, the
 * first rank still serving); a prefill rank describing none (nothing
 * learned: whole pages, and no receiver over ranks). */
static void test_learn_refusals(void **state)
{
    (void)state;
    order = KVW_PAGE_NHD;
    page_tokens = 4;
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES); /* its memory, for the params */
    kvw_group_heads_t learning[2] = {{0, 0, 0, 0, 4, KVW_PAGE_NHD}, {0}};
    kvw_group_heads_t aux_learns[2] = {{0}, {0, 0, 0, 0, 4, KVW_PAGE_NHD}};
    assert_int_equal(create_learning(KVW_ROLE_DECODE, learning, 2, 2), KVW_ERR_INVALID);
    assert_int_equal(create_learning(KVW_ROLE_DECODE, NULL, 0, 1), KVW_ERR_INVALID);
    assert_int_equal(create_learning(KVW_ROLE_DECODE, aux_learns, 0, 1), KVW_ERR_INVALID);
    assert_int_equal(create_learning(KVW_ROLE_PREFILL, learning, 0, 1), KVW_ERR_INVALID);
    mem_close(&decode[0]);

    learn_tp = 1;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    /* 3 heads of 24 B: 288 B a page, no whole number of 32-byte heads. */
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, 3, 24);
    assert_int_equal(engine_heads(&decode[0]).total, 0); /* nothing known before */
    expect_refused(0, 700, "decode's item length 288 is no multiple of 4 tokens x 32 bytes a head");
    assert_int_equal(engine_heads(&decode[0]).total, 0);
    mem_close(&decode[0]);
    /* 4 whole heads, but decode says TP 1 of a model of 8. */
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, 4, HEAD_BYTES);
    expect_refused(0, 701, "4 heads (of 32 B x 4 tokens) x 1 ranks is not the model's 8");
    assert_int_equal(engine_heads(&decode[0]).total, 0);
    uint64_t pl = page_len(&decode[0].heads[0]);
    for (uint64_t b = 0; b < pl * POOL; b++)
        assert_int_equal(decode[0].buf[0][b], CANARY);
    mem_close(&decode[0]);
    mem_close(&prefill);

    /* Rank 0 holds the model's 8 heads of 32 B; rank 1 claims a model of
     * 16 heads of 16 B (the same page length). */
    engine_rank = 0;
    mem_open(&prefills[0], KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    engine_rank = 1;
    total_heads = 16;
    mem_open(&prefills[1], KVW_ROLE_PREFILL, 0, 16, HEAD_BYTES / 2);
    total_heads = HEADS;
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    /* Rank 1 gets decode's HELLO (heads still to learn) but answers only
     * once rank 0 taught decode (its engine lock held meanwhile, which its
     * control thread waits for): decode refuses rank 1's answer. */
    pthread_mutex_lock(&prefills[1].engine->lock);
    kvw_receiver_t *r;
    const char *why = NULL;
    assert_int_equal(kvw_receiver_create(decode[0].engine, kvw_bootstrap_addr(bs), 1, 711, &r),
                     KVW_OK);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    wait_hello_sent(&decode[0], 1);
    xfer_one(&prefills[0], 0, 710);
    assert_learned(&decode[0]);
    pthread_mutex_unlock(&prefills[1].engine->lock);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "prefill rank 1 gives decode heads [0, 16) of 16 x 16 B, not [0, "
                                "8) of 8 x 32 B as learned before"));
    kvw_receiver_destroy(r);
    assert_learned(&decode[0]);
    /* Sent after learning, decode's HELLO names its heads: rank 1 refuses. */
    expect_refused(1, 711, "kv group 0: model KV heads: peer 8, ours 16");
    assert_learned(&decode[0]);
    memset(decode[0].buf[2 * LAYERS], CANARY, AUX_ITEM * 4);
    for (uint32_t g = 0; g < 2 * LAYERS; g++)
        memset(decode[0].buf[g], CANARY, decode[0].regions[g].len);
    xfer_one(&prefills[0], 0, 712);
    mem_close(&decode[0]);
    mem_close(&prefills[0]);
    mem_close(&prefills[1]);

    /* A prefill rank describing no heads teaches nothing: a plain receiver
     * pairs as undescribed (whole pages of equal length), and a receiver
     * over ranks cannot assign heads decode does not know. */
    total_heads = 0;
    engine_rank = 0;
    mem_open(&prefill, KVW_ROLE_PREFILL, 0, HEADS, HEAD_BYTES);
    mem_open(&decode[0], KVW_ROLE_DECODE, 0, HEADS, HEAD_BYTES);
    xfer_one(&prefill, 0, 720);
    assert_int_equal(engine_heads(&decode[0]).total, 0);
    r = create_set(&decode[0], 1, 721);
    assert_int_equal(kvw_receiver_init(r, contiguous, 4, KVW_NO_AUX), KVW_OK);
    assert_int_equal(wait_receiver(r), KVW_POLL_FAILED);
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_MISMATCH);
    assert_non_null(strstr(why, "decode's KV heads are not known"));
    kvw_receiver_destroy(r);
}

int main(int argc, char **argv)
{
    /* An argument runs only the tests whose name contains it. */
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_decode_fewer_heads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gather_write_count, setup, teardown),
        cmocka_unit_test_setup_teardown(test_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_more_heads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_more_heads_rows, setup, teardown),
        cmocka_unit_test_setup_teardown(test_landing_full, setup, teardown),
        cmocka_unit_test_setup_teardown(test_landing_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_landing_gpu, setup, teardown),
        cmocka_unit_test_setup_teardown(test_landing_copy_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gqa_replicas, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rank_dies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_set_endpoints_abort, setup, teardown),
        cmocka_unit_test_setup_teardown(test_set_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_heads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_mla_replicated, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_receiver_killed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_receiver_aborts, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_refusals, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_learned, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_learn_unsaid, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_counts_disagree, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fanout_count_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_learn_heads, setup, teardown),
        cmocka_unit_test_setup_teardown(test_learn_gqa_replicated, setup, teardown),
        cmocka_unit_test_setup_teardown(test_learn_refusals, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
