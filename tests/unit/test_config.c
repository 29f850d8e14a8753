/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for src/common/config.c, src/common/status.c and src/common/version.c. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/config.h"
#include "common/sized.h"
#include "kvwire.h"
#include "support/fake_nic.h"

/* ------------------------------------------------------------ helpers */

static const char *const env_names[] = {
    "KVW_SQ_DEPTH",
    "KVW_RQ_DEPTH",
    "KVW_CHAIN_MAX",
    "KVW_SIGNAL_EVERY",
    "KVW_POLL_SPIN_US",
    "KVW_BOOTSTRAP_TIMEOUT_MS",
    "KVW_TRANSFER_TIMEOUT_MS",
    "KVW_HEARTBEAT_MS",
    "KVW_PEER_TIMEOUT_MS",
    "KVW_GID_INDEX",
    "KVW_IB_PORT",
    "KVW_QP_TIMEOUT",
    "KVW_QP_RETRY_CNT",
    "KVW_QP_RNR_RETRY",
    "KVW_MAX_PEERS",
    "KVW_IDLE_HEARTBEAT_MS",
    "KVW_BOOTSTRAP_REFRESH_MS",
    "KVW_ORPHAN_TTL_MS",
    "KVW_MAX_ORPHANS_PER_PEER",
    "KVW_MAX_ORPHAN_MIB_PER_PEER",
    "KVW_TRAFFIC_CLASS",
    "KVW_SERVICE_LEVEL",
    "KVW_HOP_LIMIT",
    "KVW_FLOW_LABEL",
    "KVW_IB_USE_GRH",
    "KVW_GPU_FLUSH",
    "KVW_GPU_RELAXED_ORDERING",
    "KVW_STAGING_MIB",
    "KVW_STAGING_CHUNK_KIB",
    "KVW_STAGING_LANES",
    "KVW_QPS_PER_PEER",
    "KVW_POLL_BUSY_US",
    "KVW_MAX_HANDSHAKES",
    "KVW_LANDING_MIB",
    "KVW_VERIFY",
};
#define NUM_ENV (sizeof(env_names) / sizeof(env_names[0]))

static char log_buf[4096];
static int log_count;

static void capture_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    log_count++;
    size_t used = strlen(log_buf);
    snprintf(log_buf + used, sizeof(log_buf) - used, "%s\n", msg);
}

static void clear_env(void)
{
    for (size_t i = 0; i < NUM_ENV; i++)
        unsetenv(env_names[i]);
}

static int setup(void **state)
{
    (void)state;
    clear_env();
    log_buf[0] = '\0';
    log_count = 0;
    kvw_set_log_handler(capture_log, NULL, KVW_LOG_DEBUG);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    clear_env();
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    return 0;
}

static void assert_defaults(const kvw_config_t *c)
{
    assert_int_equal(c->sq_depth, 512);
    assert_int_equal(c->rq_depth, 256);
    assert_int_equal(c->chain_max, 64);
    assert_int_equal(c->signal_every, 32);
    assert_int_equal(c->poll_spin_us, 50);
    assert_int_equal(c->bootstrap_timeout_ms, 30000);
    assert_int_equal(c->transfer_timeout_ms, 60000);
    assert_int_equal(c->heartbeat_ms, 500);
    assert_int_equal(c->peer_timeout_ms, 2000);
    assert_int_equal(c->gid_index, -1);
    assert_int_equal(c->ib_port, 1);
    assert_int_equal(c->qp_timeout, 14);
    assert_int_equal(c->qp_retry_cnt, 7);
    assert_int_equal(c->qp_rnr_retry, 7);
    assert_int_equal(c->traffic_class, 0);
    assert_int_equal(c->service_level, 0);
    assert_int_equal(c->hop_limit, 255);
    assert_int_equal(c->flow_label, -1);
    assert_int_equal(c->ib_use_grh, -1);
    assert_string_equal(c->gpu_path, "");
    assert_string_equal(c->devices, "");
    assert_int_equal(c->gpu_flush, -1);
    assert_int_equal(c->gpu_relaxed_ordering, -1);
    assert_int_equal(c->verify, 0); /* off: the data path unchanged */
}

/* ------------------------------------------------------------ config */

static void test_defaults(void **state)
{
    (void)state;
    kvw_config_t c;
    memset(&c, 0x5a, sizeof(c));
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_defaults(&c);
    assert_int_equal(kvw__config_validate(&c), KVW_OK);
    assert_int_equal(log_count, 0);
    assert_int_equal(kvw_config_init(NULL), KVW_ERR_INVALID);
}

static void test_env_overrides(void **state)
{
    (void)state;
    setenv("KVW_SQ_DEPTH", "1024", 1);
    setenv("KVW_RQ_DEPTH", "16", 1);
    setenv("KVW_CHAIN_MAX", "128", 1);
    setenv("KVW_SIGNAL_EVERY", "1", 1);
    setenv("KVW_POLL_SPIN_US", "0", 1);
    setenv("KVW_BOOTSTRAP_TIMEOUT_MS", "3600000", 1);
    setenv("KVW_TRANSFER_TIMEOUT_MS", "10", 1);
    setenv("KVW_HEARTBEAT_MS", "250", 1);
    setenv("KVW_PEER_TIMEOUT_MS", "300", 1);
    setenv("KVW_GID_INDEX", "3", 1);
    setenv("KVW_IB_PORT", "255", 1);
    setenv("KVW_QP_TIMEOUT", "31", 1);
    setenv("KVW_QP_RETRY_CNT", "0", 1);
    setenv("KVW_QP_RNR_RETRY", "6", 1);
    setenv("KVW_TRAFFIC_CLASS", "106", 1);
    setenv("KVW_SERVICE_LEVEL", "15", 1);
    setenv("KVW_HOP_LIMIT", "64", 1);
    setenv("KVW_FLOW_LABEL", "1048575", 1);
    setenv("KVW_IB_USE_GRH", "1", 1);
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.sq_depth, 1024);
    assert_int_equal(c.rq_depth, 16);
    assert_int_equal(c.chain_max, 128);
    assert_int_equal(c.signal_every, 1);
    assert_int_equal(c.poll_spin_us, 0);
    assert_int_equal(c.bootstrap_timeout_ms, 3600000);
    assert_int_equal(c.transfer_timeout_ms, 10);
    assert_int_equal(c.heartbeat_ms, 250);
    assert_int_equal(c.peer_timeout_ms, 300);
    assert_int_equal(c.gid_index, 3);
    assert_int_equal(c.ib_port, 255);
    assert_int_equal(c.qp_timeout, 31);
    assert_int_equal(c.qp_retry_cnt, 0);
    assert_int_equal(c.qp_rnr_retry, 6);
    assert_int_equal(c.traffic_class, 106);
    assert_int_equal(c.service_level, 15);
    assert_int_equal(c.hop_limit, 64);
    assert_int_equal(c.flow_label, 0xfffff);
    assert_int_equal(c.ib_use_grh, 1);
    assert_int_equal(kvw__config_validate(&c), KVW_OK);
    assert_int_equal(log_count, 0);

    /* gid_index accepts its -1 sentinel explicitly. */
    setenv("KVW_GID_INDEX", "-1", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.gid_index, -1);

    /* So do flow_label and ib_use_grh; their other end values too. */
    setenv("KVW_FLOW_LABEL", "-1", 1);
    setenv("KVW_IB_USE_GRH", "-1", 1);
    setenv("KVW_TRAFFIC_CLASS", "255", 1);
    setenv("KVW_HOP_LIMIT", "1", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.flow_label, -1);
    assert_int_equal(c.ib_use_grh, -1);
    assert_int_equal(c.traffic_class, 255);
    assert_int_equal(c.hop_limit, 1);
    setenv("KVW_FLOW_LABEL", "0", 1);
    setenv("KVW_IB_USE_GRH", "0", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.flow_label, 0);
    assert_int_equal(c.ib_use_grh, 0);

    /* An empty variable is ignored. */
    clear_env();
    setenv("KVW_SQ_DEPTH", "", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_defaults(&c);
}

typedef struct bad_case {
    const char *env, *value;
} bad_case_t;

static void test_env_bad_values(void **state)
{
    (void)state;
    static const bad_case_t bad[] = {
        {"KVW_SQ_DEPTH", "abc"},
        {"KVW_SQ_DEPTH", "1024abc"},
        {"KVW_SQ_DEPTH", "1024 "},
        {"KVW_SQ_DEPTH", "15"},
        {"KVW_SQ_DEPTH", "16385"},
        {"KVW_SQ_DEPTH", "-1"},
        {"KVW_SQ_DEPTH", "99999999999999999999999"},
        {"KVW_SQ_DEPTH", "4294967808"}, /* 2^32 + 512: must not wrap to 512 */
        {"KVW_RQ_DEPTH", "0"},
        {"KVW_CHAIN_MAX", "0"},
        {"KVW_CHAIN_MAX", "4097"},
        {"KVW_SIGNAL_EVERY", "0"},
        {"KVW_POLL_SPIN_US", "1000001"},
        {"KVW_BOOTSTRAP_TIMEOUT_MS", "9"},
        {"KVW_TRANSFER_TIMEOUT_MS", "3600001"},
        {"KVW_HEARTBEAT_MS", "1.5"},
        {"KVW_PEER_TIMEOUT_MS", "49"},
        {"KVW_GID_INDEX", "-2"},
        {"KVW_GID_INDEX", "256"},
        {"KVW_IB_PORT", "0"},
        {"KVW_IB_PORT", "256"}, /* must not wrap to 0 in a uint8_t */
        {"KVW_QP_TIMEOUT", "0"},
        {"KVW_QP_TIMEOUT", "32"},
        {"KVW_QP_RETRY_CNT", "8"},
        {"KVW_QP_RNR_RETRY", "x7"},
        {"KVW_QP_RNR_RETRY", "-"},
        {"KVW_TRAFFIC_CLASS", "256"}, /* must not wrap to 0 in a uint8_t */
        {"KVW_TRAFFIC_CLASS", "-1"},
        {"KVW_SERVICE_LEVEL", "16"},
        {"KVW_HOP_LIMIT", "0"},
        {"KVW_HOP_LIMIT", "256"},
        {"KVW_FLOW_LABEL", "1048576"}, /* 2^20: more than the GRH's 20 bits */
        {"KVW_FLOW_LABEL", "-2"},
        {"KVW_FLOW_LABEL", "0x100000"}, /* hex, as the docs write it, still checked */
        {"KVW_FLOW_LABEL", "0x"},
        {"KVW_FLOW_LABEL", "0x-1"},
        {"KVW_FLOW_LABEL", "1e3"},
        {"KVW_SQ_DEPTH", "+1024"},
        {"KVW_SQ_DEPTH", " 1024"},
        {"KVW_SQ_DEPTH", "-0x10"}, /* no sign where the range has no negatives */
        {"KVW_SQ_DEPTH", "0b100"},
        {"KVW_IB_USE_GRH", "2"},
        {"KVW_IB_USE_GRH", "-2"},
        {"KVW_IB_USE_GRH", "yes"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        clear_env();
        log_buf[0] = '\0';
        log_count = 0;
        setenv(bad[i].env, bad[i].value, 1);
        /* A good override elsewhere still applies. */
        int other_is_hb = strcmp(bad[i].env, "KVW_HEARTBEAT_MS") == 0;
        setenv(other_is_hb ? "KVW_PEER_TIMEOUT_MS" : "KVW_HEARTBEAT_MS", "777", 1);
        kvw_config_t c;
        kvw_status_t st = kvw_config_init(&c);
        if (st != KVW_ERR_INVALID)
            fail_msg("%s='%s' returned %s", bad[i].env, bad[i].value, kvw_status_name(st));
        if (other_is_hb)
            assert_int_equal(c.peer_timeout_ms, 777);
        else
            assert_int_equal(c.heartbeat_ms, 777);
        /* The bad field holds its default. */
        if (other_is_hb)
            c.peer_timeout_ms = 2000;
        else
            c.heartbeat_ms = 500;
        assert_defaults(&c);
        /* One message, naming the variable, refusing it (no "keeping"). */
        if (log_count != 1 || !strstr(log_buf, bad[i].env) || !strstr(log_buf, "refused") ||
            strstr(log_buf, "keeping"))
            fail_msg("log for %s='%s' is not one refusal naming it: %s", bad[i].env, bad[i].value,
                     log_buf);
    }
}

static void test_validate(void **state)
{
    (void)state;
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);

    c.chain_max = c.sq_depth / 2;
    assert_int_equal(kvw__config_validate(&c), KVW_OK);
    c.chain_max = c.sq_depth / 2 + 1;
    assert_int_equal(kvw__config_validate(&c), KVW_ERR_INVALID);

    assert_int_equal(kvw_config_init(&c), KVW_OK);
    c.sq_depth = 16;
    c.chain_max = 9;
    c.signal_every = 8;
    assert_int_equal(kvw__config_validate(&c), KVW_ERR_INVALID);
    c.chain_max = 8;
    assert_int_equal(kvw__config_validate(&c), KVW_OK);
    c.signal_every = 9;
    assert_int_equal(kvw__config_validate(&c), KVW_ERR_INVALID);

    /* Per-field ranges, for a config edited by the caller. */
    static const struct {
        size_t off;
        int size;
        int64_t v;
    } out_of_range[] = {
        {offsetof(kvw_config_t, sq_depth), 4, 15},
        {offsetof(kvw_config_t, sq_depth), 4, 16385},
        {offsetof(kvw_config_t, chain_max), 4, 0},
        {offsetof(kvw_config_t, signal_every), 4, 0},
        {offsetof(kvw_config_t, heartbeat_ms), 4, 9},
        {offsetof(kvw_config_t, gid_index), 4, -2},
        {offsetof(kvw_config_t, ib_port), 1, 0},
        {offsetof(kvw_config_t, qp_timeout), 1, 32},
        {offsetof(kvw_config_t, qp_retry_cnt), 1, 8},
        {offsetof(kvw_config_t, qp_rnr_retry), 1, 255},
        {offsetof(kvw_config_t, service_level), 1, 16},
        {offsetof(kvw_config_t, hop_limit), 1, 0},
        {offsetof(kvw_config_t, flow_label), 4, 0x100000},
        {offsetof(kvw_config_t, flow_label), 4, -2},
        {offsetof(kvw_config_t, ib_use_grh), 4, 2},
        {offsetof(kvw_config_t, ib_use_grh), 4, -2},
    };
    for (size_t i = 0; i < sizeof(out_of_range) / sizeof(out_of_range[0]); i++) {
        assert_int_equal(kvw_config_init(&c), KVW_OK);
        char *p = (char *)&c + out_of_range[i].off;
        if (out_of_range[i].size == 4) {
            int32_t v = (int32_t)out_of_range[i].v;
            memcpy(p, &v, 4);
        } else {
            *(uint8_t *)p = (uint8_t)out_of_range[i].v;
        }
        if (kvw__config_validate(&c) != KVW_ERR_INVALID)
            fail_msg("field at offset %zu = %lld accepted", out_of_range[i].off,
                     (long long)out_of_range[i].v);
    }
}

static void test_print(void **state)
{
    (void)state;
    setenv("KVW_SQ_DEPTH", "2048", 1);
    setenv("KVW_GID_INDEX", "2", 1);
    setenv("KVW_TRAFFIC_CLASS", "106", 1);
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    char *text = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    assert_non_null(f);
    kvw_config_print(&c, f);
    fclose(f);
    assert_non_null(text);

    static const struct {
        const char *name, *env;
        long long value;
    } want[] = {
        {"sq_depth", "KVW_SQ_DEPTH", 2048},
        {"rq_depth", "KVW_RQ_DEPTH", 256},
        {"chain_max", "KVW_CHAIN_MAX", 64},
        {"signal_every", "KVW_SIGNAL_EVERY", 32},
        {"poll_spin_us", "KVW_POLL_SPIN_US", 50},
        {"bootstrap_timeout_ms", "KVW_BOOTSTRAP_TIMEOUT_MS", 30000},
        {"transfer_timeout_ms", "KVW_TRANSFER_TIMEOUT_MS", 60000},
        {"heartbeat_ms", "KVW_HEARTBEAT_MS", 500},
        {"peer_timeout_ms", "KVW_PEER_TIMEOUT_MS", 2000},
        {"idle_heartbeat_ms", "KVW_IDLE_HEARTBEAT_MS", 5000},
        {"bootstrap_refresh_ms", "KVW_BOOTSTRAP_REFRESH_MS", 5000},
        {"max_peers", "KVW_MAX_PEERS", 256},
        {"orphan_ttl_ms", "KVW_ORPHAN_TTL_MS", 30000},
        {"max_orphans_per_peer", "KVW_MAX_ORPHANS_PER_PEER", 1024},
        {"max_orphan_mib_per_peer", "KVW_MAX_ORPHAN_MIB_PER_PEER", 64},
        {"gid_index", "KVW_GID_INDEX", 2},
        {"ib_port", "KVW_IB_PORT", 1},
        {"qp_timeout", "KVW_QP_TIMEOUT", 14},
        {"qp_retry_cnt", "KVW_QP_RETRY_CNT", 7},
        {"qp_rnr_retry", "KVW_QP_RNR_RETRY", 7},
        {"traffic_class", "KVW_TRAFFIC_CLASS", 106},
        {"service_level", "KVW_SERVICE_LEVEL", 0},
        {"hop_limit", "KVW_HOP_LIMIT", 255},
        {"flow_label", "KVW_FLOW_LABEL", -1},
        {"ib_use_grh", "KVW_IB_USE_GRH", -1},
        {"gpu_flush", "KVW_GPU_FLUSH", -1},
        {"gpu_relaxed_ordering", "KVW_GPU_RELAXED_ORDERING", -1},
        {"staging_mib", "KVW_STAGING_MIB", 256},
        {"staging_chunk_kib", "KVW_STAGING_CHUNK_KIB", 4096},
        {"staging_lanes", "KVW_STAGING_LANES", 2},
        {"qps_per_peer", "KVW_QPS_PER_PEER", 1},
        {"poll_busy_us", "KVW_POLL_BUSY_US", 0},
        {"max_handshakes", "KVW_MAX_HANDSHAKES", 16},
        {"landing_mib", "KVW_LANDING_MIB", 64},
        {"verify", "KVW_VERIFY", 0},
    };
    const size_t n = sizeof(want) / sizeof(want[0]);
    assert_int_equal(n, NUM_ENV);
    int seen[sizeof(want) / sizeof(want[0])] = {0};
    size_t lines = 0;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char name[64], env[64];
        long long value;
        if (strncmp(line, "cluster_key", 11) == 0 || strncmp(line, "gpu_path", 8) == 0 ||
            strncmp(line, "devices", 7) == 0) {
            /* text, and not set here */
            assert_non_null(strstr(line, "= -"));
            continue;
        }
        if (sscanf(line, " %63s = %lld (%63[^)])", name, &value, env) != 3)
            fail_msg("unparsable config line: '%s'", line);
        lines++;
        size_t k;
        for (k = 0; k < n; k++)
            if (strcmp(name, want[k].name) == 0)
                break;
        if (k == n)
            fail_msg("unexpected field '%s'", name);
        assert_int_equal(seen[k], 0);
        seen[k] = 1;
        assert_string_equal(env, want[k].env);
        assert_int_equal(value, want[k].value);
    }
    assert_int_equal(lines, n);
    free(text);

    /* Negative values print as such. */
    c.gid_index = -1;
    f = open_memstream(&text, &size);
    assert_non_null(f);
    kvw_config_print(&c, f);
    fclose(f);
    assert_non_null(strstr(text, "= -1"));
    free(text);

    /* flow_label's -1 sentinel prints signed, and so does its 20-bit top. */
    c.flow_label = -1;
    f = open_memstream(&text, &size);
    assert_non_null(f);
    kvw_config_print(&c, f);
    fclose(f);
    assert_non_null(strstr(text, "flow_label             = -1       (KVW_FLOW_LABEL)"));
    free(text);
    c.flow_label = 0xfffff;
    f = open_memstream(&text, &size);
    assert_non_null(f);
    kvw_config_print(&c, f);
    fclose(f);
    assert_non_null(strstr(text, "flow_label             = 1048575  (KVW_FLOW_LABEL)"));
    free(text);
}

/* ------------------------------------------------------------ status */

/* KVW_DEVICES: names split in order; "near" alone names none (the engine
 * picks them by affinity), and inside a list it is refused. */
static void test_device_lists(void **state)
{
    (void)state;
    char names[KVW_CONFIG_MAX_DEVICES][KVW_CONFIG_DEVICE_NAME];
    assert_int_equal(kvw__config_devices("", names), 0);
    assert_int_equal(kvw__config_devices("mlx5_0, mlx5_1", names), 2);
    assert_string_equal(names[0], "mlx5_0");
    assert_string_equal(names[1], "mlx5_1");
    assert_true(kvw__config_devices_near("near"));
    assert_int_equal(kvw__config_devices("near", names), 0);
    assert_false(kvw__config_devices_near("mlx5_0"));
    assert_false(kvw__config_devices_near(""));
    assert_int_equal(kvw__config_devices("near,mlx5_0", names), -1);
    assert_int_equal(kvw__config_devices("mlx5_0,near", names), -1);
    assert_int_equal(kvw__config_devices("mlx5_0,mlx5_0", names), -1);
}

static void test_status_strings(void **state)
{
    (void)state;
    static const struct {
        kvw_status_t st;
        const char *name, *msg;
    } all[] = {
#define KVW_TEST_STATUS(name, value, msg) {KVW_##name, "KVW_" #name, msg},
        KVW_STATUS_MAP(KVW_TEST_STATUS)
#undef KVW_TEST_STATUS
    };
    const size_t n = sizeof(all) / sizeof(all[0]);
    assert_int_equal(n, 20);
    for (size_t i = 0; i < n; i++) {
        assert_string_equal(kvw_status_name(all[i].st), all[i].name);
        assert_string_equal(kvw_strerror(all[i].st), all[i].msg);
        assert_string_not_equal(kvw_strerror(all[i].st), "unknown status");
        for (size_t j = 0; j < i; j++) {
            assert_int_not_equal(all[i].st, all[j].st);
            assert_string_not_equal(kvw_status_name(all[i].st), kvw_status_name(all[j].st));
        }
    }
    assert_string_equal(kvw_status_name(KVW_OK), "KVW_OK");
    assert_string_equal(kvw_status_name(KVW_ERR_TIMEOUT), "KVW_ERR_TIMEOUT");
    assert_string_equal(kvw_strerror(KVW_OK), "success");
    assert_int_equal(KVW_ERR_UNSUPPORTED, -16);
    assert_int_equal(KVW_ERR_ABORTED, -17);
    assert_int_equal(KVW_ERR_LIMIT, -18);
    assert_int_equal(KVW_ERR_CORRUPT, -19);

    static const int unknown[] = {1, 2, -20, -100, 12345, INT32_MIN, INT32_MAX};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        assert_string_equal(kvw_strerror((kvw_status_t)unknown[i]), "unknown status");
        assert_string_equal(kvw_status_name((kvw_status_t)unknown[i]), "KVW_UNKNOWN");
    }
}

static void test_poll_names(void **state)
{
    (void)state;
    assert_string_equal(kvw_poll_name(KVW_POLL_FAILED), "Failed");
    assert_string_equal(kvw_poll_name(KVW_POLL_BOOTSTRAPPING), "Bootstrapping");
    assert_string_equal(kvw_poll_name(KVW_POLL_WAITING_FOR_INPUT), "WaitingForInput");
    assert_string_equal(kvw_poll_name(KVW_POLL_TRANSFERRING), "Transferring");
    assert_string_equal(kvw_poll_name(KVW_POLL_SUCCESS), "Success");
    assert_string_equal(kvw_poll_name((kvw_poll_t)5), "Unknown");
    assert_string_equal(kvw_poll_name((kvw_poll_t)1000), "Unknown");
}

/* Sized structs: an older caller's config (a shorter struct_size) is read as
 * far as it goes and defaulted past it; a newer caller's (a longer one) is
 * accepted while its unknown tail is zero; 0 and a set tail are refused. */
static void test_sized_config(void **state)
{
    (void)state;
    kvw_config_t cfg, got;
    assert_int_equal(kvw_config_init(&cfg), KVW_OK);
    assert_int_equal(cfg.struct_size, sizeof(kvw_config_t));

    /* Older: covers sq_depth .. peer_timeout_ms only. */
    cfg.sq_depth = 1024;
    cfg.heartbeat_ms = 111;
    cfg.max_peers = 7;
    cfg.struct_size = offsetof(kvw_config_t, heartbeat_ms);
    assert_int_equal(kvw__config_read(&cfg, &got), KVW_OK);
    assert_int_equal(got.struct_size, sizeof(kvw_config_t));
    assert_int_equal(got.sq_depth, 1024);
    assert_int_equal(got.heartbeat_ms, 500); /* past its size: the default */
    assert_int_equal(got.max_peers, 256);
    assert_int_equal(kvw__config_validate(&got), KVW_OK);

    /* Too small, and never set. */
    log_count = 0;
    cfg.struct_size = 0;
    assert_int_equal(kvw__config_read(&cfg, &got), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "struct_size 0"));
    assert_int_equal(kvw_config_init_size(&cfg, 4), KVW_ERR_INVALID);
    assert_int_equal(kvw_config_init_size(NULL, sizeof(cfg)), KVW_ERR_INVALID);

    /* Newer: a longer struct with a zero tail is fine, a set tail is not. */
    struct {
        kvw_config_t cfg;
        uint32_t future[4];
    } newer;
    memset(&newer, 0xab, sizeof(newer));
    assert_int_equal(kvw_config_init_size(&newer.cfg, sizeof(newer)), KVW_OK);
    assert_int_equal(newer.cfg.struct_size, sizeof(newer));
    assert_int_equal(newer.cfg.sq_depth, 512);
    for (int i = 0; i < 4; i++)
        assert_int_equal(newer.future[i], 0); /* zeroed, not left as 0xab */
    assert_int_equal(kvw__config_read(&newer.cfg, &got), KVW_OK);
    assert_int_equal(got.struct_size, sizeof(kvw_config_t));
    newer.future[2] = 1;
    log_count = 0;
    assert_int_equal(kvw__config_read(&newer.cfg, &got), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "newer kvwire.h"));

    /* An older caller's init writes no byte past its size. */
    unsigned char buf[sizeof(kvw_config_t)];
    memset(buf, 0xcd, sizeof(buf));
    size_t old = offsetof(kvw_config_t, cluster_key_file);
    assert_int_equal(kvw_config_init_size((kvw_config_t *)(void *)buf, old), KVW_OK);
    for (size_t i = old; i < sizeof(buf); i++)
        assert_int_equal(buf[i], 0xcd);

    /* print reads through the size too: a bad one prints nothing. */
    cfg.struct_size = 0;
    char out[64] = "";
    FILE *f = fmemopen(out, sizeof(out), "w");
    kvw_config_print(&cfg, f);
    fclose(f);
    assert_string_equal(out, "");
}

/* Numbers as the docs write them: hex after 0x (KVW_FLOW_LABEL's range is
 * -1..0xfffff), decimal with leading zeros still decimal. */
static void test_env_hex(void **state)
{
    (void)state;
    kvw_config_t c;
    setenv("KVW_FLOW_LABEL", "0x10", 1);
    setenv("KVW_SQ_DEPTH", "0X400", 1);
    setenv("KVW_TRAFFIC_CLASS", "0x6a", 1);
    setenv("KVW_RQ_DEPTH", "0100", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.flow_label, 0x10);
    assert_int_equal(c.sq_depth, 1024);
    assert_int_equal(c.traffic_class, 106);
    assert_int_equal(c.rq_depth, 100); /* not octal */
    setenv("KVW_FLOW_LABEL", "0xfffff", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.flow_label, 0xfffff);
    setenv("KVW_FLOW_LABEL", "-0x1", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(c.flow_label, -1);
    assert_int_equal(log_count, 0);
}

/* Variables that are each in range but disagree are refused by
 * kvw_config_init, once, not later by the engine create. */
static void test_env_relations(void **state)
{
    (void)state;
    kvw_config_t c;
    setenv("KVW_SQ_DEPTH", "16", 1); /* chain_max's default 64 is over 16 / 2 */
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "chain_max"));
    assert_non_null(strstr(log_buf, "sq_depth"));
    log_buf[0] = '\0';
    log_count = 0;
    setenv("KVW_CHAIN_MAX", "8", 1);
    setenv("KVW_SIGNAL_EVERY", "8", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(log_count, 0);
    setenv("KVW_HEARTBEAT_MS", "2000", 1); /* not below peer_timeout_ms */
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "heartbeat_ms"));

    /* An older caller's struct takes the fields it lacks from the
     * environment: a bad one there is refused, not replaced by a default. */
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID); /* the variables above */
    unsetenv("KVW_HEARTBEAT_MS");
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    c.struct_size = offsetof(kvw_config_t, heartbeat_ms);
    setenv("KVW_PEER_TIMEOUT_MS", "soon", 1);
    kvw_config_t got;
    log_count = 0;
    assert_int_equal(kvw__config_read(&c, &got), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "KVW_PEER_TIMEOUT_MS='soon' refused"));
}

/* KVW_LOG_LEVEL: the names people use are levels; any other is refused. */
static void test_log_level_names(void **state)
{
    (void)state;
    static const struct {
        const char *name;
        int level;
    } names[] = {
        {"error", KVW_LOG_ERROR},
        {"warn", KVW_LOG_WARN},
        {"WARNING", KVW_LOG_WARN},
        {"info", KVW_LOG_INFO},
        {"Debug", KVW_LOG_DEBUG},
        {"trace", KVW_LOG_DEBUG},
        {"verbose", KVW_LOG_DEBUG},
        {"loud", -1},
        {"", -1},
        {"3", -1},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        assert_int_equal(kvw__config_log_level(names[i].name), names[i].level);
    kvw_config_t c;
    setenv("KVW_LOG_LEVEL", "verbose", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(log_count, 0);
    setenv("KVW_LOG_LEVEL", "loud", 1);
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "KVW_LOG_LEVEL='loud' refused"));
    unsetenv("KVW_LOG_LEVEL");
}

/* Unknown KVW_* names: one warning each, naming the nearest variable; the
 * test bed's and tests' own prefixes and other programs' variables are
 * left alone. */
static void test_unknown_env_names(void **state)
{
    (void)state;
    char *env[] = {
        "KVW_SQ_DEPHT=1024",
        "KVW_LOG_LEVL=info",
        "KVW_BANANA=1",
        "KVW_SQ_DEPTH=1024",
        "KVW_LOG_LEVEL=warn",
        "KVW_SYSFS_ROOT=/x",
        "KVW_TB_IP0=10.0.0.1",
        "KVW_TESTBED_MODE=vm",
        "KVW_CHAOS_SCHEDULES=5",
        "KVW_SOAK_CYCLES=1",
        "PATH=/bin",
        "KVWIRE_LIB=/x.so",
        "KVW_FLOWLABEL=0x10",
        NULL,
    };
    assert_int_equal(kvw__config_warn_unknown_env(env), 4);
    assert_int_equal(log_count, 4);
    assert_non_null(strstr(log_buf, "unknown variable KVW_SQ_DEPHT ignored (did you mean "
                                    "KVW_SQ_DEPTH?)"));
    assert_non_null(strstr(log_buf, "KVW_LOG_LEVL ignored (did you mean KVW_LOG_LEVEL?)"));
    assert_non_null(strstr(log_buf, "KVW_FLOWLABEL ignored (did you mean KVW_FLOW_LABEL?)"));
    assert_non_null(strstr(log_buf, "KVW_BANANA ignored (not a kvwire variable"));
    assert_null(strstr(log_buf, "KVW_TB_"));
    assert_null(strstr(log_buf, "KVWIRE_LIB"));
}

/* Once per process: the first kvw_config_init warns, later ones (and
 * engine creation's config read) do not. Runs first (main's list). */
static void test_unknown_env_once(void **state)
{
    (void)state;
    kvw_config_t c, got;
    setenv("KVW_SQ_DEPHT", "1024", 1);
    assert_int_equal(kvw_config_init(&c), KVW_OK); /* a warning, not a refusal */
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(kvw__config_read(NULL, &got), KVW_OK);
    assert_int_equal(log_count, 1);
    assert_non_null(strstr(log_buf, "did you mean KVW_SQ_DEPTH?"));
    unsetenv("KVW_SQ_DEPHT");
}

/* The engine's info line: the library's variables that are set. */
static void test_env_summary(void **state)
{
    (void)state;
    char buf[256];
    kvw__config_env_summary(buf, sizeof(buf));
    assert_string_equal(buf, "none");
    setenv("KVW_SQ_DEPTH", "1024", 1);
    setenv("KVW_CLUSTER_KEY", "secret-secret", 1);
    setenv("KVW_LOG_LEVEL", "info", 1);
    kvw__config_env_summary(buf, sizeof(buf));
    assert_non_null(strstr(buf, "KVW_SQ_DEPTH=1024"));
    assert_non_null(strstr(buf, "KVW_CLUSTER_KEY=(set, not shown)"));
    assert_non_null(strstr(buf, "KVW_LOG_LEVEL=info"));
    assert_null(strstr(buf, "secret-secret"));
    /* Cut, not overrun, when the buffer is short. */
    char small[24];
    kvw__config_env_summary(small, sizeof(small));
    assert_true(strlen(small) < sizeof(small));
    unsetenv("KVW_CLUSTER_KEY");
    unsetenv("KVW_LOG_LEVEL");
}

/* The public check is the engine's: ranges and relations. */
static void test_public_validate(void **state)
{
    (void)state;
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_int_equal(kvw_config_validate(&c), KVW_OK);
    c.sq_depth = 16;
    assert_int_equal(kvw_config_validate(&c), KVW_ERR_INVALID);
    assert_non_null(strstr(log_buf, "chain_max"));
    c.chain_max = 8;
    c.signal_every = 8;
    assert_int_equal(kvw_config_validate(&c), KVW_OK);
    c.flow_label = 0x100000;
    assert_int_equal(kvw_config_validate(&c), KVW_ERR_INVALID);
    assert_int_equal(kvw_config_validate(NULL), KVW_ERR_INVALID);
}

/* An engine from the environment (config NULL) on the fake NIC: one info
 * line with the version and the overrides it applied; a bad variable is
 * one error, from kvw_config_init, and the create fails with its status. */
static kvw_status_t create_decode(kvw_engine_t **e)
{
    static uint8_t mem[2][4096];
    kvw_region_t kv[2] = {{mem[0], sizeof(mem[0]), 256}, {mem[1], sizeof(mem[1]), 256}};
    kvw_engine_params_t p;
    kvw_engine_params_init(&p);
    p.role = KVW_ROLE_DECODE;
    p.device = "fake0";
    p.local_ip = "127.0.0.1";
    p.num_layers = 1;
    p.kv_regions = kv;
    return kvw_engine_create(&p, e);
}

static void test_engine_says_version_and_overrides(void **state)
{
    (void)state;
    assert_int_equal(fake_nic_init(NULL), 0);
    kvw__verbs_set_ops(&fake_nic_ops);
    setenv("KVW_SQ_DEPTH", "0x400", 1);
    setenv("KVW_LANDING_MIB", "0", 1);
    kvw_engine_t *e = NULL;
    assert_int_equal(create_decode(&e), KVW_OK);
    kvw_engine_destroy(e);
    char want[160];
    snprintf(want, sizeof(want),
             "kvwire %s, decode engine rank 0: KVW_* overrides applied: KVW_SQ_DEPTH=0x400 "
             "KVW_LANDING_MIB=0\n",
             kvw_version_string());
    if (!strstr(log_buf, want))
        fail_msg("no line \"%s\" in:\n%s", want, log_buf);

    log_buf[0] = '\0';
    log_count = 0;
    kvw_set_log_handler(capture_log, NULL, KVW_LOG_ERROR);
    setenv("KVW_SQ_DEPTH", "lots", 1);
    e = NULL;
    assert_int_equal(create_decode(&e), KVW_ERR_INVALID);
    assert_null(e);
    if (log_count != 1 || !strstr(log_buf, "KVW_SQ_DEPTH='lots' refused"))
        fail_msg("not one refusal: %s", log_buf);
    kvw__verbs_set_ops(NULL);
    fake_nic_fini();
}

/* The runtime version is the header's, as a number and as text. */
static void test_version(void **state)
{
    (void)state;
    assert_int_equal(kvw_version(), KVW_VERSION);
    assert_int_equal(KVW_VERSION,
                     KVW_VERSION_MAJOR * 10000 + KVW_VERSION_MINOR * 100 + KVW_VERSION_PATCH);
    char want[32];
    snprintf(want, sizeof(want), "%d.%d.%d", KVW_VERSION_MAJOR, KVW_VERSION_MINOR,
             KVW_VERSION_PATCH);
    assert_string_equal(kvw_version_string(), want);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_unknown_env_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_defaults, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_overrides, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_bad_values, setup, teardown),
        cmocka_unit_test_setup_teardown(test_validate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_print, setup, teardown),
        cmocka_unit_test_setup_teardown(test_device_lists, setup, teardown),
        cmocka_unit_test_setup_teardown(test_status_strings, setup, teardown),
        cmocka_unit_test_setup_teardown(test_poll_names, setup, teardown),
        cmocka_unit_test_setup_teardown(test_version, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sized_config, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_hex, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_relations, setup, teardown),
        cmocka_unit_test_setup_teardown(test_log_level_names, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_env_names, setup, teardown),
        cmocka_unit_test_setup_teardown(test_env_summary, setup, teardown),
        cmocka_unit_test_setup_teardown(test_public_validate, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_says_version_and_overrides, setup, teardown),
    };
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
