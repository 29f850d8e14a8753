/* SPDX-License-Identifier: Apache-2.0 */
/* Fork protection: the first engine of a process calls ibv_fork_init()
 * before it registers any memory (a fork() after registration, e.g. by
 * Python multiprocessing, could otherwise corrupt registered pages on
 * kernels without copy-on-fork for DMA pages); nothing is called where the
 * kernel makes it unneeded; too late (memory registered already), engine
 * creation still succeeds and the log says what to do. On the fake NIC,
 * which answers as libibverbs does (not RDMA; see tests/support). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "support/engine_pair.h"
#include "support/fake_nic.h"

static engine_pair_t pair;
static char last_warning[512];

static void keep_warning(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (level <= KVW_LOG_WARN)
        snprintf(last_warning, sizeof(last_warning), "%s", msg);
}

static uint64_t fork_init_calls(void)
{
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    return st.fork_init_calls;
}

static void test_fork_init_before_registration(void **state)
{
    (void)state;
    fake_nic_set_fork_status(IBV_FORK_DISABLED);
    assert_int_equal(pair_open(&pair, NULL), KVW_OK);
    /* The fake refuses (EINVAL) once memory is registered: success means
     * the call came first. Later engines find it enabled and skip it. */
    assert_int_equal(fork_init_calls(), 1);
    assert_string_equal(last_warning, "");
    pair_close(&pair);
}

static void test_fork_init_unneeded(void **state)
{
    (void)state;
    fake_nic_set_fork_status(IBV_FORK_UNNEEDED);
    assert_int_equal(pair_open(&pair, NULL), KVW_OK);
    assert_int_equal(fork_init_calls(), 0);
    pair_close(&pair);
}

static void test_fork_init_too_late_warns(void **state)
{
    (void)state;
    fake_nic_set_fork_status(IBV_FORK_UNNEEDED);
    assert_int_equal(pair_open(&pair, NULL), KVW_OK);
    /* Memory is registered now; a process whose kernel needs protection
     * and which never had it: */
    fake_nic_set_fork_status(IBV_FORK_DISABLED);
    kvw_engine_t *third = NULL;
    last_warning[0] = 0;
    assert_int_equal(pair_add_decode(&pair, &third), KVW_OK);
    assert_int_equal(fork_init_calls(), 1);
    assert_non_null(strstr(last_warning, "ibv_fork_init failed"));
    assert_non_null(strstr(last_warning, "RDMAV_FORK_SAFE"));
    kvw_engine_destroy(third);
    pair_close(&pair);
}

int main(void)
{
    kvw_set_log_handler(keep_warning, NULL, KVW_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fork_init_before_registration),
        cmocka_unit_test(test_fork_init_unneeded),
        cmocka_unit_test(test_fork_init_too_late_warns),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
