/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/plan/plan.c: run grouping and write planning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/plan.h"

/* ------------------------------------------------------------ helpers */

#define MAX_WRITES 4096

/* Drain a plan into out[] (at most cap writes); returns how many. Fails the
 * test if the plan produces more than cap writes. */
static size_t drain(const kvw_plan_t *p, kvw_write_t *out, size_t cap)
{
    kvw_plan_cursor_t cur;
    memset(&cur, 0, sizeof(cur));
    size_t n = 0;
    kvw_write_t w;
    while (kvw__plan_next(p, &cur, &w)) {
        assert_true(n < cap);
        out[n++] = w;
    }
    /* Once done it stays done. */
    assert_int_equal(kvw__plan_next(p, &cur, &w), 0);
    return n;
}

static void assert_write(const kvw_write_t *w, uint64_t local, uint64_t remote, uint32_t len,
                         uint32_t lkey, uint32_t rkey)
{
    assert_int_equal(w->local_addr, local);
    assert_int_equal(w->remote_addr, remote);
    assert_int_equal(w->len, len);
    assert_int_equal(w->lkey, lkey);
    assert_int_equal(w->rkey, rkey);
}

static void assert_run(const kvw_run_t *r, uint64_t src, uint64_t dst, uint64_t count)
{
    assert_int_equal(r->src, src);
    assert_int_equal(r->dst, dst);
    assert_int_equal(r->count, count);
}

/* ------------------------------------------------------------ runs */

static void test_runs_empty(void **state)
{
    (void)state;
    kvw_run_t runs[1] = {{99, 99, 99}};
    assert_int_equal(kvw__plan_runs(NULL, NULL, 0, runs), 0);
    /* Nothing written. */
    assert_run(&runs[0], 99, 99, 99);
}

static void test_runs_one_page(void **state)
{
    (void)state;
    uint64_t src[] = {7}, dst[] = {42};
    kvw_run_t runs[1];
    assert_int_equal(kvw__plan_runs(src, dst, 1, runs), 1);
    assert_run(&runs[0], 7, 42, 1);
}

static void test_runs_all_contiguous(void **state)
{
    (void)state;
    uint64_t src[16], dst[16];
    for (int i = 0; i < 16; i++) {
        src[i] = 100 + (uint64_t)i;
        dst[i] = 5 + (uint64_t)i;
    }
    kvw_run_t runs[16];
    assert_int_equal(kvw__plan_runs(src, dst, 16, runs), 1);
    assert_run(&runs[0], 100, 5, 16);
}

static void test_runs_none_contiguous(void **state)
{
    (void)state;
    uint64_t src[] = {0, 2, 4, 6, 8}, dst[] = {1, 3, 5, 7, 9};
    kvw_run_t runs[5];
    assert_int_equal(kvw__plan_runs(src, dst, 5, runs), 5);
    for (int i = 0; i < 5; i++)
        assert_run(&runs[i], src[i], dst[i], 1);
}

static void test_runs_broken_on_source_only(void **state)
{
    (void)state;
    /* Destination fully contiguous, source jumps after the 3rd page. */
    uint64_t src[] = {10, 11, 12, 20, 21}, dst[] = {0, 1, 2, 3, 4};
    kvw_run_t runs[5];
    assert_int_equal(kvw__plan_runs(src, dst, 5, runs), 2);
    assert_run(&runs[0], 10, 0, 3);
    assert_run(&runs[1], 20, 3, 2);
}

static void test_runs_broken_on_destination_only(void **state)
{
    (void)state;
    /* Source fully contiguous, destination jumps after the 2nd page. */
    uint64_t src[] = {0, 1, 2, 3, 4}, dst[] = {50, 51, 70, 71, 72};
    kvw_run_t runs[5];
    assert_int_equal(kvw__plan_runs(src, dst, 5, runs), 2);
    assert_run(&runs[0], 0, 50, 2);
    assert_run(&runs[1], 2, 70, 3);
}

static void test_runs_descending_not_contiguous(void **state)
{
    (void)state;
    uint64_t src[] = {9, 8, 7, 6}, dst[] = {3, 2, 1, 0};
    kvw_run_t runs[4];
    assert_int_equal(kvw__plan_runs(src, dst, 4, runs), 4);
    for (int i = 0; i < 4; i++)
        assert_run(&runs[i], src[i], dst[i], 1);
}

static void test_runs_repeated_page_not_contiguous(void **state)
{
    (void)state;
    uint64_t src[] = {4, 4, 5}, dst[] = {8, 8, 9};
    kvw_run_t runs[3];
    assert_int_equal(kvw__plan_runs(src, dst, 3, runs), 2);
    assert_run(&runs[0], 4, 8, 1);
    assert_run(&runs[1], 4, 8, 2);
}

/* ------------------------------------------------------------ plans */

/* The classic layout's slots: K and V regions of each layer (K layers
 * first in regions[], then V layers), then the aux regions. */
static uint32_t kv_tab[8][16], aux_tab[8][8];

static const uint32_t *classic_kv(uint32_t layers)
{
    for (uint32_t l = 0; l < layers; l++) {
        kv_tab[layers][2 * l] = l;
        kv_tab[layers][2 * l + 1] = layers + l;
    }
    return kv_tab[layers];
}

static const uint32_t *classic_aux(uint32_t layers)
{
    for (uint32_t a = 0; a < 8; a++)
        aux_tab[layers][a] = 2 * layers + a;
    return aux_tab[layers];
}

#define CLASSIC(layers)                                                                            \
    .kv_slots = classic_kv(layers), .kv_per_layer = 2, .layer_end = (layers),                      \
    .aux_slots = classic_aux(layers)

static void test_plan_empty_no_writes(void **state)
{
    (void)state;
    kvw_plan_region_t regions[4] = {
        {0x1000, 0x9000, 64, 1, 2}, {0x2000, 0xa000, 64, 3, 4},
        {0x3000, 0xb000, 64, 5, 6}, {0x4000, 0xc000, 64, 7, 8},
    };
    kvw_plan_t p = {.runs = NULL, .num_runs = 0, .regions = regions, CLASSIC(2),
                    .num_aux = 0, .has_aux = 0, .max_msg = 1 << 20};
    kvw_write_t out[4];
    assert_int_equal(kvw__plan_count(&p), 0);
    assert_int_equal(drain(&p, out, 4), 0);

    /* Aux regions exist but the request carries no aux item: still nothing. */
    kvw_plan_region_t with_aux[5] = {
        {0x1000, 0x9000, 64, 1, 2}, {0x2000, 0xa000, 64, 3, 4}, {0x3000, 0xb000, 64, 5, 6},
        {0x4000, 0xc000, 64, 7, 8}, {0x5000, 0xd000, 16, 9, 10},
    };
    p.regions = with_aux;
    p.num_aux = 1;
    assert_int_equal(kvw__plan_count(&p), 0);
    assert_int_equal(drain(&p, out, 4), 0);

    /* No layers at all. */
    p.layer_end = 0;
    p.num_aux = 0;
    assert_int_equal(kvw__plan_count(&p), 0);
    assert_int_equal(drain(&p, out, 4), 0);
}

static void test_plan_only_aux(void **state)
{
    (void)state;
    /* 0 runs with an aux item: only the aux writes. */
    kvw_plan_region_t regions[3] = {
        {0x1000, 0x9000, 64, 1, 2}, {0x2000, 0xa000, 64, 3, 4}, {0x5000, 0xd000, 16, 9, 10}};
    kvw_plan_t p = {.num_runs = 0, .regions = regions, CLASSIC(1), .num_aux = 1,
                    .has_aux = 1, .aux_src = 3, .aux_dst = 5, .max_msg = 1 << 20};
    kvw_write_t out[4];
    assert_int_equal(kvw__plan_count(&p), 1);
    assert_int_equal(drain(&p, out, 4), 1);
    assert_write(&out[0], 0x5000 + 3 * 16, 0xd000 + 5 * 16, 16, 9, 10);
}

static void test_plan_one_page(void **state)
{
    (void)state;
    uint64_t src[] = {3}, dst[] = {8};
    kvw_run_t runs[1];
    size_t nr = kvw__plan_runs(src, dst, 1, runs);
    kvw_plan_region_t regions[2] = {{0x10000, 0x80000, 256, 11, 21},
                                    {0x20000, 0x90000, 256, 12, 22}};
    kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(1),
                    .max_msg = 1 << 20};
    kvw_write_t out[4];
    assert_int_equal(kvw__plan_count(&p), 2);
    assert_int_equal(drain(&p, out, 4), 2);
    assert_write(&out[0], 0x10000 + 3 * 256, 0x80000 + 8 * 256, 256, 11, 21);
    assert_write(&out[1], 0x20000 + 3 * 256, 0x90000 + 8 * 256, 256, 12, 22);
}

/* Two layers, every K/V layer and aux region with its own item length and
 * keys; two runs. Every write checked against a hand computation. */
static void test_plan_unequal_item_lengths_order(void **state)
{
    (void)state;
    uint64_t src[] = {1, 2, 5}, dst[] = {10, 11, 3};
    kvw_run_t runs[3];
    size_t nr = kvw__plan_runs(src, dst, 3, runs);
    assert_int_equal(nr, 2); /* (1,10,2) and (5,3,1) */

    /* regions[]: K0, K1, V0, V1, aux0, aux1 */
    kvw_plan_region_t regions[6] = {
        {0x100000, 0x900000, 100, 0xa0, 0xb0}, /* K layer 0 */
        {0x200000, 0xa00000, 200, 0xa1, 0xb1}, /* K layer 1 */
        {0x300000, 0xb00000, 300, 0xa2, 0xb2}, /* V layer 0 */
        {0x400000, 0xc00000, 400, 0xa3, 0xb3}, /* V layer 1 */
        {0x500000, 0xd00000, 50, 0xa4, 0xb4},  /* aux 0 */
        {0x600000, 0xe00000, 70, 0xa5, 0xb5},  /* aux 1 */
    };
    kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(2),
                    .num_aux = 2, .has_aux = 1, .aux_src = 4, .aux_dst = 9,
                    .max_msg = 1 << 20};
    kvw_write_t out[16];
    assert_int_equal(kvw__plan_count(&p), 10);
    assert_int_equal(drain(&p, out, 16), 10);
    /* layer 0 K */
    assert_write(&out[0], 0x100000 + 100, 0x900000 + 1000, 200, 0xa0, 0xb0);
    assert_write(&out[1], 0x100000 + 500, 0x900000 + 300, 100, 0xa0, 0xb0);
    /* layer 0 V */
    assert_write(&out[2], 0x300000 + 300, 0xb00000 + 3000, 600, 0xa2, 0xb2);
    assert_write(&out[3], 0x300000 + 1500, 0xb00000 + 900, 300, 0xa2, 0xb2);
    /* layer 1 K */
    assert_write(&out[4], 0x200000 + 200, 0xa00000 + 2000, 400, 0xa1, 0xb1);
    assert_write(&out[5], 0x200000 + 1000, 0xa00000 + 600, 200, 0xa1, 0xb1);
    /* layer 1 V */
    assert_write(&out[6], 0x400000 + 400, 0xc00000 + 4000, 800, 0xa3, 0xb3);
    assert_write(&out[7], 0x400000 + 2000, 0xc00000 + 1200, 400, 0xa3, 0xb3);
    /* aux regions: item 4 -> item 9 */
    assert_write(&out[8], 0x500000 + 200, 0xd00000 + 450, 50, 0xa4, 0xb4);
    assert_write(&out[9], 0x600000 + 280, 0xe00000 + 630, 70, 0xa5, 0xb5);
}

static void test_plan_split_long_run(void **state)
{
    (void)state;
    uint64_t src[] = {0, 1, 2, 3, 4}, dst[] = {10, 11, 12, 13, 14};
    kvw_run_t runs[5];
    size_t nr = kvw__plan_runs(src, dst, 5, runs);
    assert_int_equal(nr, 1);
    kvw_plan_region_t regions[2] = {{0x10000, 0x80000, 2048, 1, 2},
                                    {0x40000, 0xc0000, 2048, 3, 4}};
    kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(1),
                    .max_msg = 5000};
    kvw_write_t out[8];
    assert_int_equal(kvw__plan_count(&p), 6);
    assert_int_equal(drain(&p, out, 8), 6);
    /* 5 * 2048 = 10240 = 5000 + 5000 + 240, for K then V. */
    assert_write(&out[0], 0x10000, 0x80000 + 10 * 2048, 5000, 1, 2);
    assert_write(&out[1], 0x10000 + 5000, 0x80000 + 10 * 2048 + 5000, 5000, 1, 2);
    assert_write(&out[2], 0x10000 + 10000, 0x80000 + 10 * 2048 + 10000, 240, 1, 2);
    assert_write(&out[3], 0x40000, 0xc0000 + 10 * 2048, 5000, 3, 4);
    assert_write(&out[4], 0x40000 + 5000, 0xc0000 + 10 * 2048 + 5000, 5000, 3, 4);
    assert_write(&out[5], 0x40000 + 10000, 0xc0000 + 10 * 2048 + 10000, 240, 3, 4);
}

static void test_plan_split_exact_multiple(void **state)
{
    (void)state;
    /* 4 pages x 1000 = 4000 with max_msg 2000: exactly two writes, no empty tail. */
    uint64_t src[] = {0, 1, 2, 3}, dst[] = {0, 1, 2, 3};
    kvw_run_t runs[4];
    size_t nr = kvw__plan_runs(src, dst, 4, runs);
    kvw_plan_region_t regions[2] = {{0, 0x100000, 1000, 1, 2}, {0x8000, 0x200000, 1000, 3, 4}};
    kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(1),
                    .max_msg = 2000};
    kvw_write_t out[8];
    assert_int_equal(kvw__plan_count(&p), 4);
    assert_int_equal(drain(&p, out, 8), 4);
    assert_write(&out[0], 0, 0x100000, 2000, 1, 2);
    assert_write(&out[1], 2000, 0x100000 + 2000, 2000, 1, 2);
    assert_write(&out[2], 0x8000, 0x200000, 2000, 3, 4);
    assert_write(&out[3], 0x8000 + 2000, 0x200000 + 2000, 2000, 3, 4);
}

static void test_plan_split_aux_item(void **state)
{
    (void)state;
    uint64_t src[] = {0}, dst[] = {0};
    kvw_run_t runs[1];
    size_t nr = kvw__plan_runs(src, dst, 1, runs);
    kvw_plan_region_t regions[4] = {
        {0x1000, 0x2000, 100, 1, 2},
        {0x3000, 0x4000, 100, 3, 4},
        {0x100000, 0x200000, 2500, 5, 6}, /* aux 0: 2500 > 1000 */
        {0x300000, 0x400000, 1000, 7, 8}, /* aux 1: exactly max_msg */
    };
    kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(1),
                    .num_aux = 2, .has_aux = 1, .aux_src = 2, .aux_dst = 1, .max_msg = 1000};
    kvw_write_t out[8];
    assert_int_equal(kvw__plan_count(&p), 6);
    assert_int_equal(drain(&p, out, 8), 6);
    assert_write(&out[0], 0x1000, 0x2000, 100, 1, 2);
    assert_write(&out[1], 0x3000, 0x4000, 100, 3, 4);
    assert_write(&out[2], 0x100000 + 5000, 0x200000 + 2500, 1000, 5, 6);
    assert_write(&out[3], 0x100000 + 6000, 0x200000 + 3500, 1000, 5, 6);
    assert_write(&out[4], 0x100000 + 7000, 0x200000 + 4500, 500, 5, 6);
    assert_write(&out[5], 0x300000 + 2000, 0x400000 + 1000, 1000, 7, 8);
}

/* ------------------------------------------------------------ randomized */

static uint64_t rng_state;

static uint32_t rnd(uint32_t bound)
{
    /* xorshift64*: deterministic across platforms. */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)(((rng_state * 2685821657736338717ull) >> 32) % bound);
}

/* Independent model of the posting order: fills exp[] and returns the count. */
static size_t model_writes(const uint64_t *src, const uint64_t *dst, size_t n,
                           const kvw_plan_t *p, kvw_write_t *exp, size_t cap)
{
    size_t k = 0;
    for (uint32_t layer = 0; layer < p->layer_end; layer++) {
        for (int v = 0; v < 2; v++) {
            const kvw_plan_region_t *g = &p->regions[v ? p->layer_end + layer : layer];
            /* Per page, merging with the previous page when both sides continue. */
            size_t i = 0;
            while (i < n) {
                size_t j = i + 1;
                while (j < n && src[j] == src[j - 1] + 1 && dst[j] == dst[j - 1] + 1)
                    j++;
                uint64_t bytes = (j - i) * g->item_len;
                for (uint64_t off = 0; off < bytes; off += p->max_msg) {
                    uint64_t len = bytes - off < p->max_msg ? bytes - off : p->max_msg;
                    assert_true(k < cap);
                    exp[k++] = (kvw_write_t){g->local_addr + src[i] * g->item_len + off,
                                             g->remote_addr + dst[i] * g->item_len + off, g->lkey,
                                             g->rkey, (uint32_t)len};
                }
                i = j;
            }
        }
    }
    if (p->has_aux) {
        for (uint32_t a = 0; a < p->num_aux; a++) {
            const kvw_plan_region_t *g = &p->regions[2 * p->layer_end + a];
            for (uint64_t off = 0; off < g->item_len; off += p->max_msg) {
                uint64_t len = g->item_len - off < p->max_msg ? g->item_len - off : p->max_msg;
                assert_true(k < cap);
                exp[k++] = (kvw_write_t){g->local_addr + p->aux_src * g->item_len + off,
                                         g->remote_addr + p->aux_dst * g->item_len + off,
                                         g->lkey, g->rkey, (uint32_t)len};
            }
        }
    }
    return k;
}

#define RAND_CAP 20000

static void test_plan_count_matches_randomized(void **state)
{
    (void)state;
    rng_state = 0x9e3779b97f4a7c15ull;
    kvw_write_t *got = calloc(RAND_CAP, sizeof(*got));
    kvw_write_t *exp = calloc(RAND_CAP, sizeof(*exp));
    assert_non_null(got);
    assert_non_null(exp);
    uint64_t total_writes = 0;
    for (int c = 0; c < 200; c++) {
        size_t n = rnd(40);
        uint64_t src[40], dst[40];
        uint64_t s = rnd(100), d = rnd(100);
        for (size_t i = 0; i < n; i++) {
            /* Mostly contiguous, sometimes a jump on one side or both. */
            uint32_t k = rnd(6);
            if (i > 0) {
                s = (k == 1 || k == 3) ? s + 2 + rnd(5) : s + 1;
                d = (k == 2 || k == 3) ? d + 2 + rnd(5) : (k == 4 ? d - (d > 0) : d + 1);
            }
            src[i] = s;
            dst[i] = d;
        }
        kvw_run_t runs[40];
        size_t nr = kvw__plan_runs(src, dst, n, runs);
        assert_true(nr <= n);
        assert_true((n == 0) == (nr == 0));
        uint64_t pages = 0;
        for (size_t r = 0; r < nr; r++)
            pages += runs[r].count;
        assert_int_equal(pages, n);

        uint32_t L = rnd(4), A = rnd(4);
        kvw_plan_region_t regions[2 * 3 + 3];
        for (uint32_t g = 0; g < 2 * L + A; g++) {
            regions[g] = (kvw_plan_region_t){(uint64_t)(g + 1) << 32, (uint64_t)(g + 17) << 32,
                                             1 + rnd(3000), 100 + g, 200 + g};
        }
        kvw_plan_t p = {.runs = runs, .num_runs = nr, .regions = regions, CLASSIC(L),
                        .num_aux = A, .has_aux = (int)rnd(2), .aux_src = rnd(50),
                        .aux_dst = rnd(50), .max_msg = 64 + rnd(8000)};
        size_t ne = model_writes(src, dst, n, &p, exp, RAND_CAP);
        size_t ng = drain(&p, got, RAND_CAP);
        assert_int_equal(kvw__plan_count(&p), ng);
        assert_int_equal(ng, ne);
        for (size_t i = 0; i < ng; i++) {
            assert_true(got[i].len > 0 && got[i].len <= p.max_msg);
            assert_write(&got[i], exp[i].local_addr, exp[i].remote_addr, exp[i].len, exp[i].lkey,
                         exp[i].rkey);
        }
        total_writes += ng;
    }
    assert_true(total_writes > 1000); /* the generator actually exercised something */
    free(got);
    free(exp);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_runs_empty),
        cmocka_unit_test(test_runs_one_page),
        cmocka_unit_test(test_runs_all_contiguous),
        cmocka_unit_test(test_runs_none_contiguous),
        cmocka_unit_test(test_runs_broken_on_source_only),
        cmocka_unit_test(test_runs_broken_on_destination_only),
        cmocka_unit_test(test_runs_descending_not_contiguous),
        cmocka_unit_test(test_runs_repeated_page_not_contiguous),
        cmocka_unit_test(test_plan_empty_no_writes),
        cmocka_unit_test(test_plan_only_aux),
        cmocka_unit_test(test_plan_one_page),
        cmocka_unit_test(test_plan_unequal_item_lengths_order),
        cmocka_unit_test(test_plan_split_long_run),
        cmocka_unit_test(test_plan_split_exact_multiple),
        cmocka_unit_test(test_plan_split_aux_item),
        cmocka_unit_test(test_plan_count_matches_randomized),
    };
    return cmocka_run_group_tests_name("plan", tests, NULL, NULL);
}
