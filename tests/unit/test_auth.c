/* SPDX-License-Identifier: Apache-2.0 */
/* Opt-in control-plane security (ZeroMQ CURVE with one cluster key,
 * src/ctrl/zsock.c): key files and config, the bootstrap service with and
 * without the key, the ZAP handler refusing strangers, and a prefill/decode
 * pair on the fake NIC with the key on both sides or on prefill only. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/config.h"
#include "ctrl/bootstrap.h"
#include "ctrl/zsock.h"
#include "engine/core.h"
#include "support/engine_pair.h"

enum { ANSWER_MS = 300 };

static char log_buf[16384];
static char key[KVW_ZKEY_Z85_LEN + 1], other_key[KVW_ZKEY_Z85_LEN + 1];
static char dir[64];

static void capture_log(void *arg, kvw_log_level_t level, const char *msg)
{
    (void)arg;
    (void)level;
    size_t used = strlen(log_buf);
    snprintf(log_buf + used, sizeof(log_buf) - used, "%s\n", msg);
}

static void new_key(char *out)
{
    char pub[KVW_ZKEY_Z85_LEN + 1];
    assert_int_equal(zmq_curve_keypair(pub, out), 0);
}

static int setup(void **state)
{
    (void)state;
    log_buf[0] = '\0';
    kvw_set_log_handler(capture_log, NULL, KVW_LOG_INFO);
    unsetenv("KVW_CLUSTER_KEY");
    unsetenv("KVW_CLUSTER_KEY_FILE");
    new_key(key);
    new_key(other_key);
    snprintf(dir, sizeof(dir), "/tmp/kvw-auth-test-XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    if (system(cmd) != 0)
        return -1;
    kvw_set_log_handler(NULL, NULL, KVW_LOG_WARN);
    /* No line may ever show a key. */
    return strstr(log_buf, key) || strstr(log_buf, other_key) ? -1 : 0;
}

static void path_in_dir(char *buf, size_t size, const char *name)
{
    snprintf(buf, size, "%s/%s", dir, name);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    chmod(path, 0600);
}

/* ------------------------------------------------------ keys and config */

static void test_key_file_roundtrip(void **state)
{
    (void)state;
    char path[128], got[KVW_ZKEY_Z85_LEN + 1], written[KVW_ZKEY_Z85_LEN + 1];
    path_in_dir(path, sizeof(path), "cluster.key");
    assert_int_equal(kvw__zkey_write_file(path, false, written), 0);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(kvw__zkey_read_file(path, got), KVW_OK);
    assert_string_equal(got, written);
    assert_int_equal(kvw__zkey_write_file(path, false, NULL), EEXIST); /* kept */
    assert_int_equal(kvw__zkey_read_file(path, got), KVW_OK);
    assert_string_equal(got, written);
    chmod(path, 0644);
    assert_int_equal(kvw__zkey_write_file(path, true, NULL), 0); /* --force */
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(kvw__zkey_read_file(path, got), KVW_OK);
    assert_string_not_equal(got, written);
}

static void test_bad_key_files(void **state)
{
    (void)state;
    char path[128], got[KVW_ZKEY_Z85_LEN + 1], text[256];
    path_in_dir(path, sizeof(path), "missing.key");
    assert_int_equal(kvw__zkey_read_file(path, got), KVW_ERR_INVALID);
    path_in_dir(path, sizeof(path), "bad.key");
    const char *bad[] = {"", "# only a comment\n", "tooshort\n", "%s\n%s\n", "%s0\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        snprintf(text, sizeof(text), bad[i], key, key);
        write_text(path, text);
        assert_int_equal(kvw__zkey_read_file(path, got), KVW_ERR_INVALID);
    }
    snprintf(text, sizeof(text), "# comment\n\n%s  \r\n", key); /* blanks are fine */
    write_text(path, text);
    assert_int_equal(kvw__zkey_read_file(path, got), KVW_OK);
    assert_string_equal(got, key);
    assert_non_null(strstr(log_buf, "need exactly one key line"));
}

static void test_config_key_fields(void **state)
{
    (void)state;
    setenv("KVW_CLUSTER_KEY_FILE", "/etc/kvwire/cluster.key", 1);
    kvw_config_t c;
    assert_int_equal(kvw_config_init(&c), KVW_OK);
    assert_string_equal(c.cluster_key_file, "/etc/kvwire/cluster.key");
    assert_int_equal(kvw__config_validate(&c), KVW_OK);
    setenv("KVW_CLUSTER_KEY", key, 1);
    /* Both in the environment: refused where it is read, not at create. */
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID);
    assert_string_equal(c.cluster_key, key);
    assert_int_equal(kvw__config_validate(&c), KVW_ERR_INVALID); /* both */
    char *text = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    kvw_config_print(&c, f);
    fclose(f);
    assert_null(strstr(text, key)); /* the secret is never printed */
    assert_non_null(strstr(text, "(set, not shown)"));
    assert_non_null(strstr(text, "/etc/kvwire/cluster.key"));
    free(text);
    char longer[300];
    memset(longer, 'a', sizeof(longer) - 1);
    longer[sizeof(longer) - 1] = '\0';
    setenv("KVW_CLUSTER_KEY_FILE", longer, 1);
    assert_int_equal(kvw_config_init(&c), KVW_ERR_INVALID);
    assert_string_equal(c.cluster_key_file, "");
    unsetenv("KVW_CLUSTER_KEY_FILE");
    unsetenv("KVW_CLUSTER_KEY");
}

/* A bad key refuses to create the service or an engine's security. */
static void test_bad_key_refused_at_create(void **state)
{
    (void)state;
    kvw_config_t c;
    kvw_config_init(&c);
    snprintf(c.cluster_key, sizeof(c.cluster_key), "not-a-key");
    kvw_bootstrap_params_t p = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = "127.0.0.1:0", .config = &c};
    kvw_bootstrap_t *b = NULL;
    assert_int_equal(kvw_bootstrap_create(&p, &b), KVW_ERR_INVALID);
    assert_null(b);
    c.cluster_key[0] = '\0';
    path_in_dir(c.cluster_key_file, sizeof(c.cluster_key_file), "absent.key");
    assert_int_equal(kvw_bootstrap_create(&p, &b), KVW_ERR_INVALID);
    assert_non_null(strstr(log_buf, "absent.key"));
}

/* ------------------------------------------------- service with the key */

typedef struct svc {
    kvw_bootstrap_t *bs;
    void *zctx;
} svc_t;

static void svc_open(svc_t *s, const char *cluster_key)
{
    kvw_config_t c;
    kvw_config_init(&c);
    snprintf(c.cluster_key, sizeof(c.cluster_key), "%s", cluster_key);
    kvw_bootstrap_params_t p = {
        .struct_size = sizeof(kvw_bootstrap_params_t), .bind_addr = "127.0.0.1:0", .config = &c};
    assert_int_equal(kvw_bootstrap_create(&p, &s->bs), KVW_OK);
    s->zctx = zmq_ctx_new();
    assert_non_null(s->zctx);
}

static void svc_close(svc_t *s)
{
    kvw_bootstrap_destroy(s->bs);
    zmq_ctx_term(s->zctx);
}

/* LOOKUP of rank 0 from a DEALER secured with client_key (NULL: plain).
 * KVW_ERR_TIMEOUT when nothing answers within ANSWER_MS. */
static kvw_status_t lookup_with(svc_t *s, const char *client_key, char *ep, size_t ep_size)
{
    kvw_zsecurity_t *sec = NULL;
    assert_int_equal(kvw__zsecurity_create_key(s->zctx, client_key, false, &sec), KVW_OK);
    char addr[KVW_WIRE_ENDPOINT_MAX];
    kvw__zendpoint(kvw_bootstrap_addr(s->bs), addr, sizeof(addr));
    void *d = kvw__zsocket_secure(s->zctx, ZMQ_DEALER, 1000, sec);
    assert_non_null(d);
    assert_int_equal(zmq_connect(d, addr), 0);
    kvw_msg_t m = {.type = KVW_MSG_BS_LOOKUP};
    assert_int_equal(kvw__zsend(d, &m, 0), KVW_OK);
    zmq_pollitem_t item = {d, 0, ZMQ_POLLIN, 0};
    kvw_status_t st = KVW_ERR_TIMEOUT;
    if (zmq_poll(&item, 1, ANSWER_MS) > 0) {
        kvw_msg_t reply;
        char why[KVW_WIRE_REASON_MAX];
        assert_int_equal(kvw__zrecv(d, &reply, ZMQ_DONTWAIT, why, sizeof(why)), KVW_OK);
        st = (kvw_status_t)reply.status;
        if (st == KVW_OK)
            snprintf(ep, ep_size, "%s", reply.u.bs.endpoint);
    }
    zmq_close(d);
    kvw__zsecurity_destroy(sec);
    return st;
}

static void test_service_with_key(void **state)
{
    (void)state;
    svc_t s;
    svc_open(&s, key);
    kvw_zsecurity_t *sec;
    assert_int_equal(kvw__zsecurity_create_key(s.zctx, key, false, &sec), KVW_OK);
    assert_int_equal(kvw__bootstrap_register_as(s.zctx, sec, kvw_bootstrap_addr(s.bs), 0,
                                                "tcp://10.0.0.1:5000", 42, ANSWER_MS),
                     KVW_OK);
    char ep[KVW_WIRE_ENDPOINT_MAX] = "";
    assert_int_equal(lookup_with(&s, key, ep, sizeof(ep)), KVW_OK);
    assert_string_equal(ep, "tcp://10.0.0.1:5000");

    /* Without the key, or with another one: no answer at all, to lookups
     * or registrations (the rank stays where it was). */
    assert_int_equal(lookup_with(&s, NULL, ep, sizeof(ep)), KVW_ERR_TIMEOUT);
    assert_int_equal(lookup_with(&s, other_key, ep, sizeof(ep)), KVW_ERR_TIMEOUT);
    assert_int_equal(kvw__bootstrap_register_as(s.zctx, NULL, kvw_bootstrap_addr(s.bs), 0,
                                                "tcp://6.6.6.6:1", 43, ANSWER_MS),
                     KVW_ERR_TIMEOUT);
    assert_int_equal(lookup_with(&s, key, ep, sizeof(ep)), KVW_OK);
    assert_string_equal(ep, "tcp://10.0.0.1:5000");
    kvw__zsecurity_destroy(sec);
    svc_close(&s);
    /* The service itself logged no drop: strangers never got a message in. */
    assert_null(strstr(log_buf, "bootstrap: dropped"));
}

/* A plain service and a keyed client do not talk either: a cluster key
 * set on one side only fails closed. */
static void test_key_on_client_only(void **state)
{
    (void)state;
    svc_t s;
    svc_open(&s, "");
    char ep[KVW_WIRE_ENDPOINT_MAX];
    assert_int_equal(lookup_with(&s, key, ep, sizeof(ep)), KVW_ERR_TIMEOUT);
    assert_int_equal(lookup_with(&s, NULL, ep, sizeof(ep)), KVW_ERR_NOT_FOUND);
    svc_close(&s);
}

/* Knowing a server's public key is not enough: a client with its own key
 * pair is refused by the ZAP handler (and counted, and logged without
 * flooding). */
static void test_zap_refuses_other_client_keys(void **state)
{
    (void)state;
    void *zctx = zmq_ctx_new();
    kvw_zsecurity_t *server_sec;
    assert_int_equal(kvw__zsecurity_create_key(zctx, key, true, &server_sec), KVW_OK);
    void *router = kvw__zsocket_secure(zctx, ZMQ_ROUTER, 1000, server_sec);
    assert_int_equal(zmq_bind(router, "tcp://127.0.0.1:*"), 0);
    char ep[KVW_WIRE_ENDPOINT_MAX];
    size_t ep_len = sizeof(ep);
    assert_int_equal(zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, ep, &ep_len), 0);

    char cluster_pub[KVW_ZKEY_Z85_LEN + 1], pub[KVW_ZKEY_Z85_LEN + 1], sec[KVW_ZKEY_Z85_LEN + 1];
    assert_int_equal(zmq_curve_public(cluster_pub, key), 0);
    void *strangers[3];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(zmq_curve_keypair(pub, sec), 0);
        strangers[i] = kvw__zsocket(zctx, ZMQ_DEALER, 1000);
        zmq_setsockopt(strangers[i], ZMQ_CURVE_SERVERKEY, cluster_pub, KVW_ZKEY_Z85_LEN + 1);
        zmq_setsockopt(strangers[i], ZMQ_CURVE_PUBLICKEY, pub, KVW_ZKEY_Z85_LEN + 1);
        zmq_setsockopt(strangers[i], ZMQ_CURVE_SECRETKEY, sec, KVW_ZKEY_Z85_LEN + 1);
        assert_int_equal(zmq_connect(strangers[i], ep), 0);
        assert_true(zmq_send(strangers[i], "hi", 2, 0) == 2);
    }
    kvw_zsecurity_t *client_sec;
    assert_int_equal(kvw__zsecurity_create_key(zctx, key, false, &client_sec), KVW_OK);
    void *member = kvw__zsocket_secure(zctx, ZMQ_DEALER, 1000, client_sec);
    assert_int_equal(zmq_connect(member, ep), 0);
    assert_true(zmq_send(member, "member", 6, 0) == 6);

    /* Only the member's message arrives. */
    zmq_pollitem_t item = {router, 0, ZMQ_POLLIN, 0};
    char buf[64];
    assert_int_equal(zmq_poll(&item, 1, 2000), 1);
    assert_true(zmq_recv(router, buf, sizeof(buf), 0) >= 0); /* identity */
    assert_int_equal(zmq_recv(router, buf, sizeof(buf), 0), 6);
    assert_memory_equal(buf, "member", 6);
    assert_int_equal(zmq_poll(&item, 1, 300), 0);
    uint64_t t0 = pair_now_ms();
    while (kvw__zsecurity_refused(server_sec) < 3 && pair_now_ms() - t0 < 2000)
        pair_sleep_ms(10);
    assert_true(kvw__zsecurity_refused(server_sec) >= 3);
    const char *line = strstr(log_buf, "without the cluster key");
    assert_non_null(line);
    assert_null(strstr(line + 1, "without the cluster key")); /* one line, not three */

    for (int i = 0; i < 3; i++)
        zmq_close(strangers[i]);
    zmq_close(member);
    zmq_close(router);
    kvw__zsecurity_destroy(client_sec);
    kvw__zsecurity_destroy(server_sec);
    zmq_ctx_term(zctx);
}

/* ------------------------------------------------- engines on the fake NIC */

static void keyed_config(kvw_config_t *c, const char *cluster_key)
{
    pair_config(c);
    snprintf(c->cluster_key, sizeof(c->cluster_key), "%s", cluster_key);
}

/* One room, prefill to decode: Success on both sides, every byte right. */
static void land_one_room(engine_pair_t *pair)
{
    pair_room_t a;
    pair_pick(&a, 1, 8, 7, 0);
    assert_int_equal(pair_create(pair, &a), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    assert_int_equal(kvw_sender_send(a.s, a.src, a.n), KVW_OK);
    assert_int_equal(pair_wait_receiver(&a, 5000), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wait_sender(&a, 5000), KVW_POLL_SUCCESS);
    assert_int_equal(pair_wrong_bytes(pair, &a), 0);
    pair_destroy_room(&a);
}

static void test_engine_pair_with_key(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_config_t c;
    keyed_config(&c, key);
    assert_int_equal(pair_open(&pair, &c), KVW_OK);
    land_one_room(&pair);
    pair_close(&pair);
}

/* Decode outside the cluster: it never gets an answer from the bootstrap
 * service, so its request fails at its bootstrap timeout, with a reason,
 * and prefill never sees a request. */
static void test_engine_pair_decode_without_key(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_config_t c, d;
    keyed_config(&c, key);
    pair_config(&d);
    d.bootstrap_timeout_ms = 800;
    assert_int_equal(pair_open2(&pair, &c, &d), KVW_OK);
    pair_room_t a;
    pair_pick(&a, 1, 8, 7, 0);
    assert_int_equal(pair_create(&pair, &a), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    uint64_t t0 = pair_now_ms();
    assert_int_equal(pair_wait_receiver(&a, 5000), KVW_POLL_FAILED);
    uint64_t took = pair_now_ms() - t0;
    const char *why = NULL;
    kvw_status_t st = kvw_receiver_failure(a.r, &why);
    print_message("decode without the key: %s after %llu ms: %s\n", kvw_status_name(st),
                  (unsigned long long)took, why ? why : "?");
    assert_int_equal(st, KVW_ERR_TIMEOUT);
    assert_true(took < 3000);
    assert_int_equal(kvw_sender_poll(a.s), KVW_POLL_BOOTSTRAPPING);
    assert_true(pair_wrong_bytes(&pair, &a) > 0); /* nothing landed */
    pair_destroy_room(&a);
    pair_close(&pair);
}

/* Clients without the cluster key that connect to prefill's control socket
 * and fail the CURVE handshake, one every 50 ms, while a keyed decode is
 * connected: their closing does not make prefill probe its live
 * connections (before the fix, each started 500 ms of probes every 10 ms:
 * 99 wake-ups for the 10 here, against 12 after). Counted wake-ups, with
 * headroom. */
static void test_failed_handshakes_not_amplified(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_config_t c;
    keyed_config(&c, key);
    c.idle_heartbeat_ms = 10000; /* no heartbeats in the window */
    c.peer_timeout_ms = 20000;
    assert_int_equal(pair_open(&pair, &c), KVW_OK);
    land_one_room(&pair);
    pair_sleep_ms(100);

    enum { STRANGERS = 10 };
    char cluster_pub[KVW_ZKEY_Z85_LEN + 1], pub[KVW_ZKEY_Z85_LEN + 1], sec[KVW_ZKEY_Z85_LEN + 1];
    assert_int_equal(zmq_curve_public(cluster_pub, key), 0);
    void *zctx = zmq_ctx_new();
    uint64_t wakes0 = atomic_load(&pair.prefill->control_wakes);
    for (int i = 0; i < STRANGERS; i++) {
        assert_int_equal(zmq_curve_keypair(pub, sec), 0);
        void *s = kvw__zsocket(zctx, ZMQ_DEALER, 0);
        zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, cluster_pub, KVW_ZKEY_Z85_LEN + 1);
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, pub, KVW_ZKEY_Z85_LEN + 1);
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, sec, KVW_ZKEY_Z85_LEN + 1);
        assert_int_equal(zmq_connect(s, kvw_engine_endpoint(pair.prefill)), 0);
        pair_sleep_ms(50);
        zmq_close(s);
    }
    pair_sleep_ms(600);
    uint64_t wakes = atomic_load(&pair.prefill->control_wakes) - wakes0;
    print_message("%d failed handshakes: %llu prefill control wake-ups\n", STRANGERS,
                  (unsigned long long)wakes);
    assert_true(wakes <= 4 * STRANGERS);
    zmq_ctx_term(zctx);
    pair_close(&pair);
}

/* A bootstrap service that answers a lookup with an endpoint that is not
 * tcp:// (here ipc://): decode refuses to dial it and fails the request
 * with the reason, instead of connecting to a local socket file on the
 * service's word. The rogue service is a plain ROUTER in this thread. */
static void test_decode_refuses_non_tcp_endpoint(void **state)
{
    (void)state;
    engine_pair_t pair;
    assert_int_equal(pair_open(&pair, NULL), KVW_OK);
    void *zctx = zmq_ctx_new();
    void *rogue = zmq_socket(zctx, ZMQ_ROUTER);
    int linger = 0;
    zmq_setsockopt(rogue, ZMQ_LINGER, &linger, sizeof(linger));
    assert_int_equal(zmq_bind(rogue, "tcp://127.0.0.1:*"), 0);
    char ep[KVW_WIRE_ENDPOINT_MAX];
    size_t ep_len = sizeof(ep);
    assert_int_equal(zmq_getsockopt(rogue, ZMQ_LAST_ENDPOINT, ep, &ep_len), 0);

    kvw_receiver_t *r;
    assert_int_equal(kvw_receiver_create(pair.decode, ep, 0, 1, &r), KVW_OK);
    uint64_t dst[2] = {0, 1};
    assert_int_equal(kvw_receiver_init(r, dst, 2, KVW_NO_AUX), KVW_OK);
    zmq_pollitem_t item = {rogue, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&item, 1, 3000), 1);
    uint8_t id[256];
    int id_len = zmq_recv(rogue, id, sizeof(id), 0);
    assert_true(id_len > 0);
    kvw_msg_t in;
    char why[KVW_WIRE_REASON_MAX];
    assert_int_equal(kvw__zrecv(rogue, &in, 0, why, sizeof(why)), KVW_OK);
    assert_int_equal(in.type, KVW_MSG_BS_LOOKUP);
    kvw_msg_t out = {.type = KVW_MSG_BS_LOOKUP_REPLY, .status = KVW_OK};
    out.u.bs.rank = in.u.bs.rank;
    snprintf(out.u.bs.endpoint, sizeof(out.u.bs.endpoint), "ipc:///tmp/kvwire-rogue");
    kvw__wire_free(&in);
    assert_int_equal(kvw__zsend_to(rogue, id, (size_t)id_len, &out), KVW_OK);

    uint64_t end = pair_now_ms() + 3000;
    while (kvw_receiver_poll(r) != KVW_POLL_FAILED && pair_now_ms() < end)
        pair_sleep_ms(5);
    const char *reason = NULL;
    assert_int_equal(kvw_receiver_failure(r, &reason), KVW_ERR_PROTOCOL);
    assert_non_null(strstr(reason, "not tcp://"));
    kvw_receiver_destroy(r);
    zmq_close(rogue);
    zmq_ctx_term(zctx);
    pair_close(&pair);
}

/* Prefill's engine id owns its bootstrap registration (only the owner
 * renews or unregisters a rank): no message prefill sends a decode peer
 * (HELLO_ACK, PONG, probes) carries it. The send hook sees every message
 * prefill's router sends and drops none. */
static _Atomic int ids_seen, hello_acks_seen, pongs_seen;
static void *_Atomic watched_router;
static bool watch_prefill_sends(void *sock, const kvw_msg_t *m)
{
    if (sock != atomic_load(&watched_router))
        return false;
    if (m->type == KVW_MSG_HELLO_ACK) {
        atomic_fetch_add(&hello_acks_seen, 1);
        atomic_fetch_add(&ids_seen, m->u.hello.engine_id != 0);
    } else if (m->type == KVW_MSG_PONG) {
        atomic_fetch_add(&pongs_seen, 1);
        atomic_fetch_add(&ids_seen, m->u.ping.engine_id != 0);
    }
    return false;
}

static void test_prefill_engine_id_not_given_to_decode(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_config_t c;
    pair_config(&c);
    assert_int_equal(pair_open(&pair, &c), KVW_OK);
    atomic_store(&watched_router, pair.prefill->router);
    atomic_store(&kvw__zdrop_hook, watch_prefill_sends);
    pair_room_t a;
    pair_pick(&a, 1, 8, 7, 0);
    assert_int_equal(pair_create(&pair, &a), KVW_OK);
    assert_int_equal(kvw_sender_init(a.s, a.n, a.aux_src), KVW_OK);
    assert_int_equal(kvw_receiver_init(a.r, a.dst, a.n, a.aux_dst), KVW_OK);
    assert_int_equal(pair_wait_sender_ready(&a, 5000), KVW_POLL_WAITING_FOR_INPUT);
    pair_sleep_ms(3 * (int)c.heartbeat_ms); /* a few PINGs answered */
    assert_int_equal(kvw_sender_send(a.s, a.src, a.n), KVW_OK);
    assert_int_equal(pair_wait_receiver(&a, 5000), KVW_POLL_SUCCESS);
    atomic_store(&kvw__zdrop_hook, NULL);
    print_message("%d HELLO_ACK, %d PONG from prefill; %d carried its engine id\n",
                  atomic_load(&hello_acks_seen), atomic_load(&pongs_seen), atomic_load(&ids_seen));
    assert_true(atomic_load(&hello_acks_seen) >= 1);
    assert_true(atomic_load(&pongs_seen) >= 1);
    assert_int_equal(atomic_load(&ids_seen), 0);
    pair_destroy_room(&a);
    pair_close(&pair);
}

/* An engine with a bad key file is not created. */
static void test_engine_bad_key_file(void **state)
{
    (void)state;
    engine_pair_t pair;
    kvw_config_t c;
    pair_config(&c);
    path_in_dir(c.cluster_key_file, sizeof(c.cluster_key_file), "absent.key");
    assert_int_equal(pair_open(&pair, &c), KVW_ERR_INVALID); /* the bootstrap refuses first */
    pair_close(&pair);
    kvw_config_t ok;
    pair_config(&ok);
    kvw_config_t bad = ok;
    snprintf(bad.cluster_key, sizeof(bad.cluster_key), "%s", "0123456789");
    assert_int_equal(pair_open2(&pair, &ok, &bad), KVW_ERR_INVALID); /* decode's own check */
    pair_close(&pair);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_key_file_roundtrip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_key_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_config_key_fields, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_key_refused_at_create, setup, teardown),
        cmocka_unit_test_setup_teardown(test_service_with_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_key_on_client_only, setup, teardown),
        cmocka_unit_test_setup_teardown(test_zap_refuses_other_client_keys, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_pair_with_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_pair_decode_without_key, setup, teardown),
        cmocka_unit_test_setup_teardown(test_engine_bad_key_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_handshakes_not_amplified, setup, teardown),
        cmocka_unit_test_setup_teardown(test_decode_refuses_non_tcp_endpoint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_prefill_engine_id_not_given_to_decode, setup,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
