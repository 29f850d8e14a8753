/* SPDX-License-Identifier: Apache-2.0 */
/* The counts of kvw_engine_params_t (since 1.4): num_kv_regions,
 * num_group_heads and group_num_regions tell the library how long the
 * arrays whose length the layout implies really are. A count that
 * disagrees with the layout is refused (KVW_ERR_INVALID, logged naming the
 * field) before any array is read; 0 / NULL keeps the old reading, and a
 * caller built against an older header (smaller struct_size) is unchanged.
 * The arrays are heap-allocated to their exact length, so ASan would see
 * a read past one. Decode engines on the fake NIC (no bootstrap needed). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvwire.h"
#include "support/fake_nic.h"

enum { ITEM = 256, ITEMS = 8, REGION = ITEM * ITEMS };

/* The last ERROR the library logged. */
static char last_error[512];

static void capture(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (level == KVW_LOG_ERROR)
        snprintf(last_error, sizeof(last_error), "%s", msg);
}

static kvw_config_t cfg;
static uint8_t *mem; /* backs every region: 16 of REGION bytes */

static int setup(void **state)
{
    (void)state;
    kvw_set_log_handler(capture, NULL, KVW_LOG_ERROR);
    if (fake_nic_init(NULL) != 0)
        return -1;
    kvw__verbs_set_ops(&fake_nic_ops);
    if (kvw_config_init(&cfg) != KVW_OK)
        return -1;
    cfg.landing_mib = 0; /* nothing to land: the engines here never transfer */
    mem = calloc(16, REGION);
    return mem ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    free(mem);
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

/* n regions of REGION bytes, in a heap array of exactly n entries. */
static kvw_region_t *regions(uint32_t n, uint32_t first)
{
    kvw_region_t *r = malloc(n * sizeof(*r));
    assert_non_null(r);
    for (uint32_t i = 0; i < n; i++)
        r[i] = (kvw_region_t){mem + (size_t)(first + i) * REGION, REGION, ITEM};
    return r;
}

static void params(kvw_engine_params_t *p)
{
    kvw_engine_params_init(p);
    p->role = KVW_ROLE_DECODE;
    p->device = "fake0";
    p->local_ip = "127.0.0.1";
    p->config = &cfg;
}

/* Created and destroyed: the params were accepted. */
static void accepted(const kvw_engine_params_t *p)
{
    kvw_engine_t *e = NULL;
    last_error[0] = 0;
    assert_int_equal(kvw_engine_create(p, &e), KVW_OK);
    assert_non_null(e);
    kvw_engine_destroy(e);
}

/* Refused with KVW_ERR_INVALID, the log naming each of the words. */
static void refused(const kvw_engine_params_t *p, const char *field, const char *detail)
{
    kvw_engine_t *e = NULL;
    last_error[0] = 0;
    assert_int_equal(kvw_engine_create(p, &e), KVW_ERR_INVALID);
    assert_null(e);
    print_message("refused: %s\n", last_error);
    assert_non_null(strstr(last_error, field));
    assert_non_null(strstr(last_error, detail));
}

/* The cases: 2 regions for 4 layers (the library read past the
 * array) and 3 for 1 layer (the third dropped silently). With the count
 * both are refused; 0 keeps the implied length; the right count works. */
static void test_kv_region_count(void **state)
{
    (void)state;
    kvw_engine_params_t p;
    params(&p);
    kvw_region_t *two = regions(2, 0), *three = regions(3, 0);
    p.num_layers = 4;
    p.kv_regions = two;
    p.num_kv_regions = 2;
    refused(&p, "num_kv_regions is 2", "2 x num_layers needs 8 entries");
    p.num_layers = 1;
    p.kv_regions = three;
    p.num_kv_regions = 3;
    refused(&p, "num_kv_regions is 3", "needs 2 entries");
    p.kv_regions = two;
    p.num_kv_regions = 2;
    accepted(&p);
    p.num_kv_regions = 0; /* an older caller: implied, 2 x num_layers */
    accepted(&p);
    free(two);
    free(three);
}

/* num_kv_regions and group_num_regions each belong to one layout only. */
static void test_counts_of_the_other_layout(void **state)
{
    (void)state;
    kvw_region_t *kv = regions(2, 0);
    kvw_group_t g = {KVW_GROUP_KV, 1, 2, kv};
    size_t n = 2;
    kvw_engine_params_t p;
    params(&p);
    p.num_groups = 1;
    p.groups = &g;
    p.num_kv_regions = 2;
    refused(&p, "num_kv_regions is 2", "a layout of groups");
    p.num_kv_regions = 0;
    accepted(&p);
    params(&p);
    p.num_layers = 1;
    p.kv_regions = kv;
    p.group_num_regions = &n;
    refused(&p, "group_num_regions is set", "classic layout");
    free(kv);
}

/* group_num_regions: each group's array against num_layers x
 * regions_per_layer, naming the group that differs. */
static void test_group_region_counts(void **state)
{
    (void)state;
    kvw_region_t *kv = regions(4, 0), *st = regions(1, 4);
    kvw_group_t g[2] = {{KVW_GROUP_KV, 2, 2, kv}, {KVW_GROUP_STATE, 1, 1, st}};
    size_t *n = malloc(2 * sizeof(*n));
    assert_non_null(n);
    kvw_engine_params_t p;
    params(&p);
    p.num_groups = 2;
    p.groups = g;
    p.group_num_regions = n;
    n[0] = 4;
    n[1] = 1;
    accepted(&p);
    n[1] = 2; /* the state group's one region said to be two */
    refused(&p, "group_num_regions[1] is 2", "group 1's num_layers 1 x regions_per_layer 1");
    n[1] = 1;
    n[0] = 3; /* four regions read from an array of three */
    g[0].regions = regions(3, 0);
    refused(&p, "group_num_regions[0] is 3", "needs 4 regions");
    free((void *)g[0].regions);
    free(n);
    free(kv);
    free(st);
}

/* num_group_heads: one entry per group, one for the classic layout, and
 * nothing without group_heads. */
static void test_group_heads_count(void **state)
{
    (void)state;
    kvw_region_t *kv = regions(2, 0);
    /* 2 tokens x 2 heads x 64 bytes: the regions' item length */
    kvw_group_heads_t *h = malloc(sizeof(*h));
    assert_non_null(h);
    *h = (kvw_group_heads_t){2, 0, 2, 64, 2, KVW_PAGE_NHD};
    kvw_engine_params_t p;
    params(&p);
    p.num_layers = 1;
    p.kv_regions = kv;
    p.num_kv_regions = 2;
    p.group_heads = h;
    p.num_group_heads = 2;
    refused(&p, "num_group_heads is 2", "the classic layout (its K/V group) needs 1");
    p.num_group_heads = 1;
    accepted(&p);
    p.group_heads = NULL;
    refused(&p, "num_group_heads is 1", "group_heads NULL needs 0");
    kvw_group_t g = {KVW_GROUP_KV, 1, 2, kv};
    params(&p);
    p.num_groups = 1;
    p.groups = &g;
    p.group_heads = h;
    p.num_group_heads = 3;
    refused(&p, "num_group_heads is 3", "one entry per group (num_groups) needs 1");
    free(h);
    free(kv);
}

/* A caller built against the 1.3 header: its struct ends before the
 * counts, and whatever lies past its struct_size is never read. */
static void test_older_caller_unchanged(void **state)
{
    (void)state;
    kvw_region_t *kv = regions(2, 0);
    kvw_engine_params_t p;
    memset(&p, 0xa5, sizeof(p)); /* what follows an older caller's struct */
    params(&p);
    memset(&p.num_kv_regions, 0xa5, sizeof(p) - offsetof(kvw_engine_params_t, num_kv_regions));
    p.struct_size = offsetof(kvw_engine_params_t, num_kv_regions);
    p.num_layers = 1;
    p.kv_regions = kv;
    accepted(&p);
    free(kv);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kv_region_count),
        cmocka_unit_test(test_counts_of_the_other_layout),
        cmocka_unit_test(test_group_region_counts),
        cmocka_unit_test(test_group_heads_count),
        cmocka_unit_test(test_older_caller_unchanged),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
