/* SPDX-License-Identifier: Apache-2.0 */
/* The etcd registry (KVW_REGISTRY) against a real three-member etcd
 * cluster on loopback that tests/etcd/run.sh starts from Debian's
 * etcd-server. Engines run on the fake NIC (not RDMA): this is the
 * registry's test, the transfers only prove that ranks found through etcd
 * are the right ones.
 *
 * Usage (run.sh sets the environment): test_etcd cluster | auth
 *   KVW_TEST_ETCD_ENDPOINTS  "127.0.0.1:p0,127.0.0.1:p1,127.0.0.1:p2"
 *   KVW_TEST_ETCD_DIR        the cluster's directory (etcd-cluster.sh)
 *   KVW_TEST_ETCD_CTL        tests/etcd/etcd-cluster.sh
 *   auth: KVW_TEST_ETCD_USER, KVW_TEST_ETCD_PASSWORD, KVW_TEST_ETCD_PREFIX
 *
 * Every receiver here names a bootstrap address nothing listens on, so a
 * connection can only have come from etcd. */
#include "ctrl/registry.h"
#include "engine/core.h"
#include "support/engine_pair.h"
#include "support/fake_nic.h"

#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

enum {
    WAIT_MS = 10000,
    REFRESH_MS = 2000, /* the lease: three of these (6 s), kept alive every 2 s */
    LEASE_MS = 3 * REFRESH_MS,
    ROOMS = 24, /* per run of rooms; a member dies a third of the way in */
};

#define NOWHERE "127.0.0.1:9" /* no bootstrap service: lookups must go to etcd */

static char endpoints[512];
static atomic_int errors_logged, relogins;
static char last_error[512];

static void log_handler(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    if (level <= KVW_LOG_ERROR) {
        atomic_fetch_add(&errors_logged, 1);
        snprintf(last_error, sizeof(last_error), "%s", msg);
    }
    if (strstr(msg, "logging in again"))
        atomic_fetch_add(&relogins, 1);
    if (level <= KVW_LOG_WARN)
        fprintf(stderr, "  [log] %s\n", msg);
}

static void set_registry(const char *prefix, const char *credentials)
{
    char url[1024];
    snprintf(url, sizeof(url), "etcd://%s%s%s/%s", credentials ? credentials : "",
             credentials ? "@" : "", endpoints, prefix);
    setenv(KVW_REGISTRY_ENV, url, 1);
}

static void etcd_config(kvw_config_t *c)
{
    pair_config(c);
    c->bootstrap_refresh_ms = REFRESH_MS;
    c->bootstrap_timeout_ms = WAIT_MS;
    c->transfer_timeout_ms = WAIT_MS;
}

static void cluster(const char *what)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s %s %s", getenv("KVW_TEST_ETCD_CTL"), what,
             getenv("KVW_TEST_ETCD_DIR"));
    fprintf(stderr, "  [etcd] %s\n", what);
    assert_int_equal(system(cmd), 0);
}

/* One room through decode engine d: Success both sides, every byte right. */
static void land_room(engine_pair_t *p, kvw_engine_t *d, uint64_t room, uint32_t slot)
{
    pair_room_t a;
    pair_pick(&a, room, 4, room * 11, slot);
    assert_int_equal(kvw_sender_create(p->prefill, a.room, &a.s), KVW_OK);
    assert_int_equal(kvw_receiver_create(d, NOWHERE, 0, a.room, &a.r), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_send(a.s, a.src, a.n), KVW_OK);
    kvw_poll_t rs = pair_wait_receiver(&a, WAIT_MS);
    if (rs != KVW_POLL_SUCCESS) {
        const char *why = "";
        kvw_receiver_failure(a.r, &why);
        fprintf(stderr, "  room %llu: receiver ended %d: %s\n", (unsigned long long)room, rs, why);
    }
    assert_int_equal(rs, KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(&a, WAIT_MS), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(p, &a), 0);
    pair_destroy_room(&a);
}

/* What decode's registry says rank 0 is: the prefill engine's endpoint. */
static void assert_rank0_is(kvw_engine_t *decode, kvw_engine_t *prefill)
{
    char ep[KVW_WIRE_ENDPOINT_MAX], why[256] = "";
    assert_non_null(decode->registry);
    assert_int_equal(kvw__registry_lookup(decode->registry, 0, ep, sizeof(ep), why, sizeof(why)),
                     KVW_OK);
    assert_string_equal(ep, kvw_engine_endpoint(prefill));
}

/* Wait until decode's registry has rank 0 as want (NULL: not registered). */
static bool wait_rank0(kvw_engine_t *decode, const char *want, int ms)
{
    uint64_t end = pair_now_ms() + (uint64_t)ms;
    do {
        char ep[KVW_WIRE_ENDPOINT_MAX], why[256];
        kvw_status_t st =
            kvw__registry_lookup(decode->registry, 0, ep, sizeof(ep), why, sizeof(why));
        if (want ? st == KVW_OK && strcmp(ep, want) == 0 : st == KVW_ERR_NOT_FOUND)
            return true;
        pair_sleep_ms(20);
    } while (pair_now_ms() < end);
    return false;
}

/* ----------------------------------------------------------- scenarios */

/* Ranks found through etcd: transfers land, and the endpoint decode read is
 * prefill's. */
static void test_transfer_through_etcd(void **state)
{
    (void)state;
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("transfer", NULL);
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    assert_rank0_is(p.decode, p.prefill);
    for (uint64_t room = 1; room <= 8; room++)
        land_room(&p, p.decode, room, 0);
    pair_close(&p);
}

/* Rooms go on while a member dies (kill follower|leader); afterwards a
 * second lease interval passes (the lease was kept alive through the
 * loss), and a new decode engine reads the ranks from the members left. */
static void rooms_while_member_dies(const char *prefix, const char *which)
{
    engine_pair_t p;
    kvw_config_t c;
    char kill_cmd[32];
    etcd_config(&c);
    set_registry(prefix, NULL);
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    int failed_before = atomic_load(&errors_logged);
    for (uint64_t room = 1; room <= ROOMS; room++) {
        if (room == ROOMS / 3) {
            snprintf(kill_cmd, sizeof(kill_cmd), "kill %s", which);
            cluster(kill_cmd);
        }
        land_room(&p, p.decode, room, 0);
    }
    pair_sleep_ms(2 * LEASE_MS); /* a lease that was not kept alive would be gone */
    kvw_engine_t *late = NULL;
    assert_int_equal(pair_add_decode(&p, &late), KVW_OK);
    assert_rank0_is(late, p.prefill);
    assert_rank0_is(p.decode, p.prefill);
    land_room(&p, late, ROOMS + 1, 1);
    land_room(&p, p.decode, ROOMS + 2, 0);
    kvw_engine_destroy(late);
    assert_int_equal(atomic_load(&errors_logged), failed_before); /* 0 failed, nothing refused */
    pair_close(&p);
    cluster("revive");
}

static void test_follower_killed_mid_run(void **state)
{
    (void)state;
    rooms_while_member_dies("follower", "follower");
}

static void test_leader_killed_mid_run(void **state)
{
    (void)state;
    rooms_while_member_dies("leader", "leader");
}

/* A child process holding rank 0 under prefix until it is killed. Returns
 * its pid once it registered. */
static pid_t prefill_child(const char *prefix, char *endpoint, size_t size)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        engine_pair_t p;
        kvw_config_t c;
        etcd_config(&c);
        set_registry(prefix, NULL);
        char ep[KVW_WIRE_ENDPOINT_MAX] = "";
        if (pair_open(&p, &c) == KVW_OK)
            snprintf(ep, sizeof(ep), "%s", kvw_engine_endpoint(p.prefill));
        if (write(fds[1], ep, sizeof(ep)) != (ssize_t)sizeof(ep) || !ep[0])
            _exit(1);
        for (;;)
            pause(); /* until SIGKILL: no revoke, the lease must run out */
    }
    close(fds[1]);
    assert_int_equal(read(fds[0], endpoint, size), (ssize_t)size);
    close(fds[0]);
    assert_true(endpoint[0] != '\0');
    return pid;
}

/* A prefill killed: its key goes when its lease runs out (no revoke: the
 * process got SIGKILL); decode's new request for the rank then fails with
 * a reason, well before its bootstrap timeout. */
static void test_prefill_killed(void **state)
{
    (void)state;
    char child_ep[KVW_WIRE_ENDPOINT_MAX];
    pid_t child = prefill_child("killed", child_ep, sizeof(child_ep));
    /* Our own pair lives under another prefix; the extra decode engine
     * reads the child's. */
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("killed-pair", NULL);
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    set_registry("killed", NULL);
    kvw_engine_t *d = NULL;
    assert_int_equal(pair_add_decode(&p, &d), KVW_OK);
    assert_true(wait_rank0(d, child_ep, WAIT_MS));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    uint64_t t0 = pair_now_ms();
    assert_true(wait_rank0(d, NULL, 3 * LEASE_MS));
    uint64_t gone_ms = pair_now_ms() - t0;
    fprintf(stderr, "  rank 0's key went %llu ms after the kill (lease %d ms)\n",
            (unsigned long long)gone_ms, LEASE_MS);
    /* A new request for the dead rank. */
    kvw_receiver_t *r;
    uint64_t dst[1] = {0};
    uint64_t t1 = pair_now_ms();
    assert_int_equal(kvw_receiver_create(d, NOWHERE, 0, 77, &r), KVW_OK);
    assert_int_equal(kvw_receiver_init(r, dst, 1, KVW_NO_AUX), KVW_OK);
    while (kvw_receiver_poll(r) != KVW_POLL_FAILED && pair_now_ms() - t1 < 2 * WAIT_MS)
        pair_sleep_ms(5);
    const char *why = "";
    assert_int_equal(kvw_receiver_failure(r, &why), KVW_ERR_NOT_FOUND); /* not a timeout */
    fprintf(stderr, "  the request failed after %llu ms: %s\n",
            (unsigned long long)(pair_now_ms() - t1), why);
    assert_non_null(strstr(why, "is not registered at etcd://"));
    kvw_receiver_destroy(r);
    kvw_engine_destroy(d);
    pair_close(&p);
}

/* Prefill restarted on a new port (the engine destroyed and made again):
 * decode's watch brings the new endpoint, and new rooms reach it. */
static void test_prefill_restarted_on_new_port(void **state)
{
    (void)state;
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("restart", NULL);
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    land_room(&p, p.decode, 1, 0);
    char old_ep[KVW_WIRE_ENDPOINT_MAX];
    snprintf(old_ep, sizeof(old_ep), "%s", kvw_engine_endpoint(p.prefill));
    uint64_t events = kvw__registry_events(p.decode->registry);
    assert_int_equal(pair_restart_prefill(&p), KVW_OK);
    assert_string_not_equal(kvw_engine_endpoint(p.prefill), old_ep);
    assert_true(wait_rank0(p.decode, kvw_engine_endpoint(p.prefill), WAIT_MS));
    assert_true(kvw__registry_events(p.decode->registry) > events); /* by the watch */
    land_room(&p, p.decode, 2, 0);
    land_room(&p, p.decode, 3, 0);
    pair_close(&p);
}

/* A prefill that crashed and restarted at once on the same host, another
 * port: it takes its rank over without waiting out the dead one's lease,
 * and decode follows. */
static void test_crashed_prefill_replaced_at_once(void **state)
{
    (void)state;
    char child_ep[KVW_WIRE_ENDPOINT_MAX];
    pid_t child = prefill_child("takeover", child_ep, sizeof(child_ep));
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("takeover", NULL);
    uint64_t t0 = pair_now_ms();
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    fprintf(stderr, "  the new prefill registered %llu ms after the kill\n",
            (unsigned long long)(pair_now_ms() - t0));
    assert_string_not_equal(kvw_engine_endpoint(p.prefill), child_ep);
    assert_rank0_is(p.decode, p.prefill);
    land_room(&p, p.decode, 1, 0);
    pair_close(&p);
}

/* etcdctl put KEY VALUE; value is shell text (it may use printf). */
static void etcd_put(const char *key, const char *value)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "ETCDCTL_API=3 etcdctl --endpoints %s put -- '%s' \"%s\" >/dev/null",
             endpoints, key, value);
    assert_int_equal(system(cmd), 0);
}

/* A receiver for rank on d: Failed with want, its reason holding text. */
static void assert_rank_refused(kvw_engine_t *d, uint32_t rank, kvw_status_t want, const char *text)
{
    kvw_receiver_t *r;
    uint64_t dst[1] = {0};
    assert_int_equal(kvw_receiver_create(d, NOWHERE, rank, 100 + rank, &r), KVW_OK);
    /* The watch brought the value already: the lookup may fail the
     * receiver before init, which then says it ended. */
    kvw_status_t st = kvw_receiver_init(r, dst, 1, KVW_NO_AUX);
    assert_true(st == KVW_OK || st == KVW_ERR_STATE);
    uint64_t t0 = pair_now_ms();
    while (kvw_receiver_poll(r) != KVW_POLL_FAILED && pair_now_ms() - t0 < 2 * WAIT_MS)
        pair_sleep_ms(5);
    const char *why = "";
    assert_int_equal(kvw_receiver_failure(r, &why), want);
    fprintf(stderr, "  rank %u: %s\n", rank, why);
    assert_non_null(strstr(why, text));
    kvw_receiver_destroy(r);
}

/* Whoever can write the prefix can put anything there: what decode reads
 * is checked as a bootstrap answer is (tcp:// only, printable, fits), and
 * keys that are not PREFIX/rank/N are ignored. The good rank still works. */
static void test_bad_values_refused(void **state)
{
    (void)state;
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("bad", NULL);
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    etcd_put("/bad/rank/1", "ipc:///tmp/kvw.sock");
    etcd_put("/bad/rank/2", "tcp://$(printf '%0200d' 1):5");
    etcd_put("/bad/rank/3", "$(printf 'tcp://127.0.0.1:5\\001')");
    etcd_put("/bad/rank/01", "tcp://127.0.0.1:1");
    etcd_put("/bad/rank/x", "tcp://127.0.0.1:1");
    etcd_put("/bad/rank/99999", "tcp://127.0.0.1:1");
    etcd_put("/bad/other", "tcp://127.0.0.1:1");
    uint64_t t0 = pair_now_ms();
    char ep[KVW_WIRE_ENDPOINT_MAX], why[256];
    while (kvw__registry_lookup(p.decode->registry, 3, ep, sizeof(ep), why, sizeof(why)) ==
               KVW_ERR_NOT_FOUND &&
           pair_now_ms() - t0 < WAIT_MS)
        pair_sleep_ms(10); /* the watch brings them */
    assert_rank_refused(p.decode, 1, KVW_ERR_PROTOCOL, "not tcp://");
    assert_rank_refused(p.decode, 2, KVW_ERR_PROTOCOL, "an endpoint of 208 bytes");
    assert_rank_refused(p.decode, 3, KVW_ERR_PROTOCOL, "a byte 0x01");
    for (uint32_t rank = 4; rank < 6; rank++) /* the ignored keys registered nothing */
        assert_int_equal(
            kvw__registry_lookup(p.decode->registry, rank, ep, sizeof(ep), why, sizeof(why)),
            KVW_ERR_NOT_FOUND);
    land_room(&p, p.decode, 1, 0);
    pair_close(&p);
}

/* No member answers: creation fails with a clear error within about its
 * bootstrap timeout. */
static void test_unreachable_at_start(void **state)
{
    (void)state;
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    c.bootstrap_timeout_ms = 1500;
    setenv(KVW_REGISTRY_ENV, "etcd://127.0.0.1:1,127.0.0.1:2/unreachable", 1);
    int before = atomic_load(&errors_logged);
    assert_int_equal(pair_open(&p, &c), KVW_ERR_TIMEOUT);
    assert_true(atomic_load(&errors_logged) > before);
    assert_non_null(strstr(last_error, "no member answered within 1500 ms"));
    pair_close(&p);
}

/* ---------------------------------------------------------------- auth */

static void test_auth_user_and_password(void **state)
{
    (void)state;
    char cred[512];
    snprintf(cred, sizeof(cred), "%s:%s", getenv("KVW_TEST_ETCD_USER"),
             getenv("KVW_TEST_ETCD_PASSWORD"));
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry(getenv("KVW_TEST_ETCD_PREFIX") + 1, cred); /* prefix: "/name" */
    assert_int_equal(pair_open(&p, &c), KVW_OK);
    assert_rank0_is(p.decode, p.prefill);
    land_room(&p, p.decode, 1, 0);
    /* The cluster's tokens last 1 s (etcd-cluster.sh), so they have
     * expired when decode's watch ends (each member killed in turn, so one
     * of them held it) and decode reads the ranks again: it is refused
     * (HTTP 401), logs in again and goes on. */
    int before = atomic_load(&relogins);
    for (int m = 0; m < 3; m++) {
        char cmd[32];
        pair_sleep_ms(1500);
        snprintf(cmd, sizeof(cmd), "kill-member %d", m);
        cluster(cmd);
        pair_sleep_ms(1000);
        cluster("revive");
    }
    pair_sleep_ms(1500);
    fprintf(stderr, "  logged in again %d times\n", atomic_load(&relogins) - before);
    assert_true(atomic_load(&relogins) > before);
    int errors = atomic_load(&errors_logged);
    assert_rank0_is(p.decode, p.prefill);
    kvw_engine_t *late = NULL;
    assert_int_equal(pair_add_decode(&p, &late), KVW_OK);
    assert_rank0_is(late, p.prefill);
    land_room(&p, late, 2, 1);
    land_room(&p, p.decode, 3, 0);
    kvw_engine_destroy(late);
    assert_int_equal(atomic_load(&errors_logged), errors);
    pair_close(&p);
}

static void test_auth_wrong_password_refused(void **state)
{
    (void)state;
    char cred[512];
    snprintf(cred, sizeof(cred), "%s:not-the-password", getenv("KVW_TEST_ETCD_USER"));
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry(getenv("KVW_TEST_ETCD_PREFIX") + 1, cred);
    assert_int_equal(pair_open(&p, &c), KVW_ERR_CONTROL); /* refused, not retried */
    assert_non_null(strstr(last_error, "authentication failed"));
    pair_close(&p);
}

static void test_auth_without_credentials_refused(void **state)
{
    (void)state;
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry(getenv("KVW_TEST_ETCD_PREFIX") + 1, NULL);
    assert_int_equal(pair_open(&p, &c), KVW_ERR_CONTROL);
    fprintf(stderr, "  without credentials: %s\n", last_error);
    pair_close(&p);
}

/* The user may write its prefix only. */
static void test_auth_outside_prefix_refused(void **state)
{
    (void)state;
    char cred[512];
    snprintf(cred, sizeof(cred), "%s:%s", getenv("KVW_TEST_ETCD_USER"),
             getenv("KVW_TEST_ETCD_PASSWORD"));
    engine_pair_t p;
    kvw_config_t c;
    etcd_config(&c);
    set_registry("another-prefix", cred);
    assert_int_equal(pair_open(&p, &c), KVW_ERR_CONTROL);
    assert_non_null(strstr(last_error, "permission denied"));
    pair_close(&p);
}

int main(int argc, char **argv)
{
    const char *eps = getenv("KVW_TEST_ETCD_ENDPOINTS");
    if (argc != 2 || !eps || !getenv("KVW_TEST_ETCD_CTL") || !getenv("KVW_TEST_ETCD_DIR")) {
        fprintf(stderr, "usage: test_etcd cluster|auth (run by tests/etcd/run.sh, which starts "
                        "the etcd cluster)\n");
        return 2;
    }
    snprintf(endpoints, sizeof(endpoints), "%s", eps);
    kvw_set_log_handler(log_handler, NULL, KVW_LOG_DEBUG); /* counts re-logins */
    const struct CMUnitTest cluster_tests[] = {
        cmocka_unit_test(test_transfer_through_etcd),
        cmocka_unit_test(test_follower_killed_mid_run),
        cmocka_unit_test(test_leader_killed_mid_run),
        cmocka_unit_test(test_prefill_killed),
        cmocka_unit_test(test_prefill_restarted_on_new_port),
        cmocka_unit_test(test_crashed_prefill_replaced_at_once),
        cmocka_unit_test(test_bad_values_refused),
        cmocka_unit_test(test_unreachable_at_start),
    };
    const struct CMUnitTest auth_tests[] = {
        cmocka_unit_test(test_auth_user_and_password),
        cmocka_unit_test(test_auth_wrong_password_refused),
        cmocka_unit_test(test_auth_without_credentials_refused),
        cmocka_unit_test(test_auth_outside_prefix_refused),
    };
    if (strcmp(argv[1], "auth") == 0)
        return cmocka_run_group_tests_name("etcd registry, authenticated", auth_tests, NULL, NULL);
    return cmocka_run_group_tests_name("etcd registry", cluster_tests, NULL, NULL);
}
