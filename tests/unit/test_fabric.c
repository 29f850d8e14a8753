/* SPDX-License-Identifier: Apache-2.0 */
/* Fabric settings (traffic class, service level, flow label, hop limit,
 * GRH or LID routing): the pure address-vector builder of src/verbs/qp.c,
 * and, through an engine pair on the fake NIC, that the configured values
 * reach ibv_modify_qp on both sides and the bring-up log shows them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <pthread.h>

#include "support/engine_pair.h"
#include "support/fake_nic.h"
#include "verbs/qp.h"

enum { WAIT_MS = 5000 };

/* ------------------------------------------------------------ log capture */

/* Engines log from their own threads: guard the buffer. */
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[16384];

static void capture_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    pthread_mutex_lock(&log_lock);
    size_t used = strlen(log_buf);
    snprintf(log_buf + used, sizeof(log_buf) - used, "%s\n", msg);
    pthread_mutex_unlock(&log_lock);
}

static int setup(void **state)
{
    (void)state;
    log_buf[0] = '\0';
    kvw_set_log_handler(capture_log, NULL, KVW_LOG_INFO);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

/* The bring-up line of device dev: "dev: QP a -> peer QP b up: ...". Copies
 * it to line and returns 0, or -1 if there is none. */
static int find_bring_up(const char *dev, uint32_t *qpn, uint32_t *peer, char *line, size_t size)
{
    char head[80];
    snprintf(head, sizeof(head), "%s: QP ", dev);
    int rc = -1;
    pthread_mutex_lock(&log_lock);
    for (const char *p = strstr(log_buf, head); p && rc; p = strstr(p + 1, head)) {
        if ((p != log_buf && p[-1] != '\n') || !strstr(p, " up: "))
            continue;
        if (sscanf(p + strlen(head), "%u -> peer QP %u up:", qpn, peer) != 2)
            continue;
        size_t n = strcspn(p, "\n");
        snprintf(line, size, "%.*s", (int)n, p);
        rc = 0;
    }
    pthread_mutex_unlock(&log_lock);
    return rc;
}

/* ------------------------------------------------------------ pure helpers */

static void test_flow_label_hash(void **state)
{
    (void)state;
    /* rdma_calc_flow_label: v = l * r; v ^= v >> 20; v ^= v >> 40; 20 bits. */
    assert_int_equal(kvw__flow_label(1, 1), 1);
    assert_int_equal(kvw__flow_label(0x123456, 0x654321), 0xa77ae);
    assert_int_equal(kvw__flow_label(0xffffff, 0xffffff), 0xfff1e);
    /* Symmetric, so both ends agree; masked to the QPN's and label's bits. */
    for (uint32_t a = 1; a < 5000; a += 97)
        for (uint32_t b = 1; b < 5000; b += 89) {
            assert_int_equal(kvw__flow_label(a, b), kvw__flow_label(b, a));
            assert_true(kvw__flow_label(a, b) <= KVW_FLOW_LABEL_MASK);
        }
    assert_int_equal(kvw__flow_label(0x1000005, 7), kvw__flow_label(5, 7));
    /* Different connections spread: not one label for many QPN pairs. */
    assert_int_not_equal(kvw__flow_label(100, 200), kvw__flow_label(101, 200));
}

static kvw_config_t fabric_config(void)
{
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    c.traffic_class = 106; /* DSCP 26 << 2 */
    c.service_level = 3;
    c.hop_limit = 64;
    c.flow_label = 0x12345;
    return c;
}

static kvw_dev_t fake_dev(uint8_t link_layer)
{
    kvw_dev_t d;
    memset(&d, 0, sizeof(d));
    d.port = 1;
    d.gid_index = 3;
    d.lid = 7;
    d.link_layer = link_layer;
    d.gid.raw[0] = 0xfe;
    d.gid.raw[1] = 0x80;
    d.gid.raw[15] = 1;
    return d;
}

static kvw_qp_info_t peer_info(const kvw_dev_t *d, int other_subnet)
{
    kvw_qp_info_t r = {.qpn = 0x654321, .psn = 1, .lid = 9, .mtu = 5, .link_layer = d->link_layer};
    memcpy(r.gid, d->gid.raw, 16);
    r.gid[15] = 2;
    if (other_subnet)
        r.gid[7] = 0x42; /* the upper 64 bits are the subnet prefix */
    return r;
}

static void test_fill_ah_roce(void **state)
{
    (void)state;
    kvw_dev_t d = fake_dev(IBV_LINK_LAYER_ETHERNET);
    kvw_qp_info_t r = peer_info(&d, 0);
    kvw_config_t c = fabric_config();
    c.ib_use_grh = 0; /* ignored: RoCE has no LIDs */
    struct ibv_ah_attr ah;
    kvw__qp_fill_ah(&d, 0x123456, &r, &c, &ah);
    assert_int_equal(ah.is_global, 1);
    assert_int_equal(ah.port_num, 1);
    assert_int_equal(ah.sl, 3);
    assert_int_equal(ah.grh.traffic_class, 106);
    assert_int_equal(ah.grh.hop_limit, 64);
    assert_int_equal(ah.grh.flow_label, 0x12345);
    assert_int_equal(ah.grh.sgid_index, 3);
    assert_memory_equal(ah.grh.dgid.raw, r.gid, 16);

    c.flow_label = -1;
    kvw__qp_fill_ah(&d, 0x123456, &r, &c, &ah);
    assert_int_equal(ah.grh.flow_label, kvw__flow_label(0x123456, 0x654321));
    c.flow_label = 0;
    kvw__qp_fill_ah(&d, 0x123456, &r, &c, &ah);
    assert_int_equal(ah.grh.flow_label, 0);

    /* Defaults: what kvwire did before these settings existed, plus a
     * derived flow label. */
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    kvw__qp_fill_ah(&d, 0x123456, &r, &c, &ah);
    assert_int_equal(ah.is_global, 1);
    assert_int_equal(ah.sl, 0);
    assert_int_equal(ah.grh.traffic_class, 0);
    assert_int_equal(ah.grh.hop_limit, 255);
    assert_int_equal(ah.grh.flow_label, kvw__flow_label(0x123456, 0x654321));
}

static void test_fill_ah_infiniband(void **state)
{
    (void)state;
    kvw_dev_t d = fake_dev(IBV_LINK_LAYER_INFINIBAND);
    kvw_qp_info_t same = peer_info(&d, 0), other = peer_info(&d, 1);
    kvw_config_t c = fabric_config();
    struct ibv_ah_attr ah;

    /* Auto, same subnet, no GID index asked for: LID routing. */
    assert_int_equal(c.ib_use_grh, -1);
    c.gid_index = -1;
    kvw__qp_fill_ah(&d, 5, &same, &c, &ah);
    assert_int_equal(ah.is_global, 0);
    assert_int_equal(ah.dlid, 9);
    assert_int_equal(ah.sl, 3);
    assert_int_equal(ah.grh.traffic_class, 0); /* no GRH, nothing in it */

    /* Auto: another subnet, or an explicit GID index, takes a GRH. */
    kvw__qp_fill_ah(&d, 5, &other, &c, &ah);
    assert_int_equal(ah.is_global, 1);
    assert_int_equal(ah.dlid, 9);
    assert_int_equal(ah.grh.traffic_class, 106);
    assert_int_equal(ah.grh.hop_limit, 64);
    c.gid_index = 0;
    kvw__qp_fill_ah(&d, 5, &same, &c, &ah);
    assert_int_equal(ah.is_global, 1);

    /* Forced either way. */
    c.ib_use_grh = 0;
    kvw__qp_fill_ah(&d, 5, &other, &c, &ah);
    assert_int_equal(ah.is_global, 0);
    assert_int_equal(ah.sl, 3);
    c.ib_use_grh = 1;
    c.gid_index = -1;
    kvw__qp_fill_ah(&d, 5, &same, &c, &ah);
    assert_int_equal(ah.is_global, 1);
    assert_int_equal(ah.grh.flow_label, 0x12345);
}

/* ------------------------------------------------------------ engine pair */

/* One transfer, so both sides brought their QP up. */
static void one_transfer(engine_pair_t *p)
{
    pair_room_t pr;
    pair_pick(&pr, 1, 4, 7, 0);
    assert_int_equal(pair_create(p, &pr), KVW_OK);
    assert_int_equal(kvw_receiver_init(pr.r, pr.dst, pr.n, pr.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_init(pr.s, pr.n, pr.aux_src), KVW_OK);
    assert_int_equal(kvw_sender_send(pr.s, pr.src, pr.n), KVW_OK);
    assert_int_equal(pair_wait_receiver(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(&pr, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(p, &pr), 0);
    pair_destroy_room(&pr);
}

typedef struct side {
    uint32_t qpn, peer;
    struct ibv_ah_attr ah;
    char line[512];
} side_t;

static void read_side(const char *dev, side_t *s)
{
    if (find_bring_up(dev, &s->qpn, &s->peer, s->line, sizeof(s->line)))
        fail_msg("no bring-up log line for %s in:\n%s", dev, log_buf);
    assert_int_equal(fake_nic_qp_ah(s->qpn, &s->ah), 0);
}

static void assert_applied(const side_t *s, const kvw_config_t *c, uint32_t flow_label)
{
    assert_int_equal(s->ah.is_global, 1);
    assert_int_equal(s->ah.sl, c->service_level);
    assert_int_equal(s->ah.grh.traffic_class, c->traffic_class);
    assert_int_equal(s->ah.grh.hop_limit, c->hop_limit);
    assert_int_equal(s->ah.grh.flow_label, flow_label);
    char want[160];
    snprintf(want, sizeof(want), "sl %u, tclass %u, flow_label 0x%05x%s, hop_limit %u, grh on",
             c->service_level, c->traffic_class, flow_label, c->flow_label < 0 ? " (derived)" : "",
             c->hop_limit);
    if (!strstr(s->line, want) || !strstr(s->line, "mtu 4096, gid_index "))
        fail_msg("bring-up line '%s' lacks '%s'", s->line, want);
}

static void run_pair(const kvw_config_t *cfg, side_t *pre, side_t *dec)
{
    engine_pair_t p;
    assert_int_equal(pair_open(&p, cfg), KVW_OK);
    one_transfer(&p);
    read_side("fake0", pre);
    read_side("fake1", dec);
    pair_close(&p);
    if (getenv("KVW_TEST_LOG")) /* the lines an operator would see */
        printf("%s\n%s\n", pre->line, dec->line);
    /* Each side names the other's QP. */
    assert_int_equal(pre->peer, dec->qpn);
    assert_int_equal(dec->peer, pre->qpn);
}

static void test_pair_derived_flow_label(void **state)
{
    (void)state;
    kvw_config_t c;
    pair_config(&c);
    c.traffic_class = 106;
    c.service_level = 5;
    c.hop_limit = 64;
    assert_int_equal(c.flow_label, -1);
    side_t pre, dec;
    run_pair(&c, &pre, &dec);
    /* Derived from both QPNs: the same label on both sides. */
    uint32_t fl = kvw__flow_label(pre.qpn, dec.qpn);
    assert_applied(&pre, &c, fl);
    assert_applied(&dec, &c, fl);
    /* Once per QP. */
    assert_non_null(strstr(log_buf, pre.line));
    assert_null(strstr(strstr(log_buf, pre.line) + 1, pre.line));
}

static void test_pair_fixed_flow_label(void **state)
{
    (void)state;
    kvw_config_t c;
    pair_config(&c);
    c.flow_label = 0xabcde;
    c.traffic_class = 184; /* DSCP 46 */
    side_t pre, dec;
    run_pair(&c, &pre, &dec);
    assert_applied(&pre, &c, 0xabcde);
    assert_applied(&dec, &c, 0xabcde);
    assert_int_equal(pre.ah.sl, 0);
    assert_int_equal(pre.ah.grh.hop_limit, 255);
}

/* Out-of-range values are refused when the engine is created. */
static void test_pair_refuses_bad_values(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        size_t off;
        int size;
        int64_t v;
    } bad[] = {
        {"service_level", offsetof(kvw_config_t, service_level), 1, 16},
        {"hop_limit", offsetof(kvw_config_t, hop_limit), 1, 0},
        {"flow_label", offsetof(kvw_config_t, flow_label), 4, 0x100000},
        {"flow_label", offsetof(kvw_config_t, flow_label), 4, -2},
        {"ib_use_grh", offsetof(kvw_config_t, ib_use_grh), 4, 2},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvw_config_t c;
        pair_config(&c);
        char *p = (char *)&c + bad[i].off;
        if (bad[i].size == 4) {
            int32_t v = (int32_t)bad[i].v;
            memcpy(p, &v, 4);
        } else {
            *(uint8_t *)p = (uint8_t)bad[i].v;
        }
        log_buf[0] = '\0';
        engine_pair_t pair;
        kvw_status_t st = pair_open(&pair, &c);
        pair_close(&pair);
        if (st != KVW_ERR_INVALID)
            fail_msg("%s=%lld: %s", bad[i].name, (long long)bad[i].v, kvw_status_name(st));
        if (!strstr(log_buf, bad[i].name))
            fail_msg("log for %s does not name it: %s", bad[i].name, log_buf);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_flow_label_hash, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fill_ah_roce, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fill_ah_infiniband, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pair_derived_flow_label, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pair_fixed_flow_label, setup, teardown),
        cmocka_unit_test_setup_teardown(test_pair_refuses_bad_values, setup, teardown),
    };
    return cmocka_run_group_tests_name("fabric", tests, NULL, NULL);
}
