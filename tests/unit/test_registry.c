/* SPDX-License-Identifier: Apache-2.0 */
/* KVW_REGISTRY without an etcd cluster (the cluster's tests are
 * tests/etcd, make etcd-check): what is refused at engine creation, and
 * how, in a build with the etcd backend and in one without (make ETCD=0).
 * Engines on the fake NIC (not RDMA). */
#include "ctrl/registry.h"
#include "support/engine_pair.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

static char last_error[512];

static void log_handler(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (level <= KVW_LOG_ERROR)
        snprintf(last_error, sizeof(last_error), "%s", msg);
}

static kvw_status_t open_pair_with(const char *registry, uint32_t timeout_ms)
{
    engine_pair_t p;
    kvw_config_t c;
    pair_config(&c);
    c.bootstrap_timeout_ms = timeout_ms;
    setenv(KVW_REGISTRY_ENV, registry, 1);
    last_error[0] = '\0';
    kvw_status_t st = pair_open(&p, &c);
    pair_close(&p);
    unsetenv(KVW_REGISTRY_ENV);
    return st;
}

#ifdef KVW_HAVE_ETCD

static void test_malformed_registry_refused(void **state)
{
    (void)state;
    static const char *const bad[] = {"etcd://",      "etcd:///p",         "etcd://host",
                                      "etcd://h:p",   "etcd://h:1,",       "zk://h:1",
                                      "etcd://u@h:1", "etcd://h:1/pre fix"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvw_registry_t *r = (kvw_registry_t *)1;
        assert_int_equal(kvw__registry_open(bad[i], &r), KVW_ERR_INVALID);
        assert_null(r);
        assert_int_equal(open_pair_with(bad[i], 1000), KVW_ERR_INVALID);
    }
    kvw_registry_t *r;
    assert_int_equal(kvw__registry_open("etcd://u:pw@h1:1,[::1]:2/a/b/", &r), KVW_OK);
    assert_string_equal(kvw__registry_name(r), "etcd://(user)@h1:1,[::1]:2/a/b");
    kvw__registry_close(r, false);
    /* The password is never logged, even in the refusal of a bad URL. */
    assert_int_equal(open_pair_with("etcd://u:secret@h:x/p", 1000), KVW_ERR_INVALID);
    assert_null(strstr(last_error, "secret"));
}

/* No member answers: creation fails at its bootstrap timeout, saying so. */
static void test_unreachable_members(void **state)
{
    (void)state;
    assert_int_equal(open_pair_with("etcd://127.0.0.1:1,127.0.0.1:2/x", 400), KVW_ERR_TIMEOUT);
    assert_non_null(strstr(last_error, "no member answered within 400 ms"));
}

#else

/* Built without the backend: any KVW_REGISTRY is refused, saying why. */
static void test_registry_refused_without_etcd(void **state)
{
    (void)state;
    assert_int_equal(open_pair_with("etcd://127.0.0.1:2379/x", 400), KVW_ERR_UNSUPPORTED);
    assert_non_null(strstr(last_error, "built without the etcd registry"));
}

#endif

/* Empty is unset: the bootstrap service, as before. */
static void test_empty_registry_is_none(void **state)
{
    (void)state;
    assert_int_equal(open_pair_with("", 1000), KVW_OK);
}

int main(void)
{
    kvw_set_log_handler(log_handler, NULL, KVW_LOG_ERROR);
    const struct CMUnitTest tests[] = {
#ifdef KVW_HAVE_ETCD
        cmocka_unit_test(test_malformed_registry_refused),
        cmocka_unit_test(test_unreachable_members),
#else
        cmocka_unit_test(test_registry_refused_without_etcd),
#endif
        cmocka_unit_test(test_empty_registry_is_none),
    };
    return cmocka_run_group_tests_name("registry (no cluster)", tests, NULL, NULL);
}
