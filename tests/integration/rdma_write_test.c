/* SPDX-License-Identifier: Apache-2.0 */
/* First real-RDMA test of the verbs layer: two processes open an rxe device,
 * register buffers, connect RC QPs by exchanging QP info over ZeroMQ, RDMA
 * WRITE a pattern as one linked chain (the last write carries an
 * immediate), and the target verifies every byte. Runs rxe0 -> rxe0 and
 * rxe0 -> rxe1 (test bed devices 0 and 1). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "ctrl/wire.h"
#include "mem/mem.h"
#include "support/testbed_env.h"
#include "verbs/qp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

enum { BUF_LEN = 4 << 20, WRITE_LEN = 64 << 10, NUM_WRITES = BUF_LEN / WRITE_LEN };
static const uint32_t IMM = 0xC0FFEE;

static uint8_t pattern_byte(size_t i)
{
    return (uint8_t)((i * 131u + (i >> 12) * 7u + 1u) & 0xff);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Wait for one completion; returns its status or -1 after timeout_s. */
static int wait_completion(kvw_qp_t *qp, struct ibv_wc *wc, double timeout_s)
{
    double deadline = now_s() + timeout_s;
    while (now_s() < deadline) {
        int n = qp->dev->ops->poll_cq(qp->cq, 1, wc);
        if (n < 0)
            return -1;
        if (n == 1)
            return (int)wc->status;
        usleep(100);
    }
    fprintf(stderr, "timed out after %.0f s waiting for a completion\n", timeout_s);
    return -1;
}

typedef struct side {
    kvw_dev_t *dev;
    kvw_qp_t *qp;
    kvw_mr_t mr;
    uint8_t *buf;
    kvw_config_t cfg;
} side_t;

static int side_open(side_t *s, const tb_device_t *d)
{
    memset(s, 0, sizeof(*s));
    kvw_config_init(&s->cfg);
    s->buf = aligned_alloc(4096, BUF_LEN);
    if (!s->buf || kvw__dev_open(d->name, d->ip, 1, -1, &s->dev) ||
        kvw__mem_register(s->dev, s->buf, BUF_LEN, true, &s->mr) ||
        kvw__qp_create(s->dev, NULL, NULL, 256, 16, true, &s->qp))
        return -1;
    return 0;
}

static void side_close(side_t *s)
{
    kvw__qp_destroy(s->qp);
    kvw__mem_deregister(s->dev, &s->mr);
    kvw__dev_close(s->dev);
    free(s->buf);
}

static void hello_of(const side_t *s, uint16_t type, kvw_wire_region_t *region, kvw_msg_t *m)
{
    memset(m, 0, sizeof(*m));
    m->type = type;
    m->u.hello.num_qps = 1;
    kvw__qp_local_info(s->qp, &m->u.hello.qps[0]);
    *region = (kvw_wire_region_t){s->mr.addr, BUF_LEN, BUF_LEN, s->mr.rkey};
    m->u.hello.num_groups = 1; /* one aux-like group holding the buffer */
    m->u.hello.groups[0] = (kvw_wire_group_t){1, 1, 1};
    m->u.hello.max_msg_sz = s->dev->max_msg_sz;
    m->u.hello.regions = region;
}

static int send_msg(void *sock, const kvw_msg_t *m)
{
    uint8_t buf[512];
    size_t len;
    if (kvw__wire_encode(m, buf, sizeof(buf), &len))
        return -1;
    return zmq_send(sock, buf, len, 0) == (int)len ? 0 : -1;
}

static int recv_msg(void *sock, kvw_msg_t *m)
{
    uint8_t buf[512];
    int n = zmq_recv(sock, buf, sizeof(buf), 0);
    char why[128] = "";
    if (n < 0 || n > (int)sizeof(buf) || kvw__wire_decode(buf, (size_t)n, m, why, sizeof(why))) {
        fprintf(stderr, "bad control message: %s\n", n < 0 ? zmq_strerror(errno) : why);
        return -1;
    }
    return 0;
}

/* Child process: fills its buffer and writes it into the target's. */
static int run_initiator(const tb_device_t *d, const char *endpoint)
{
    side_t s;
    if (side_open(&s, d))
        return 10;
    for (size_t i = 0; i < BUF_LEN; i++)
        s.buf[i] = pattern_byte(i);
    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_REQ);
    int timeout_ms = 30000, rc = 0;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    kvw_wire_region_t mine;
    kvw_msg_t hello, ack;
    hello_of(&s, KVW_MSG_HELLO, &mine, &hello);
    if (zmq_connect(sock, endpoint) || send_msg(sock, &hello) || recv_msg(sock, &ack)) {
        rc = 11;
        goto out;
    }
    kvw_wire_region_t remote = ack.u.hello.regions[0];
    if (kvw__qp_connect(s.qp, &ack.u.hello.qps[0], &s.cfg)) {
        rc = 12;
        goto out_msg;
    }
    /* One chain, one doorbell: NUM_WRITES writes, only the last signaled. */
    struct ibv_sge sge[NUM_WRITES];
    struct ibv_send_wr wr[NUM_WRITES], *bad = NULL;
    for (int i = 0; i < NUM_WRITES; i++) {
        sge[i] = (struct ibv_sge){s.mr.addr + (uint64_t)i * WRITE_LEN, WRITE_LEN, s.mr.lkey};
        int last = i == NUM_WRITES - 1;
        wr[i] = (struct ibv_send_wr){
            .wr_id = (uint64_t)i,
            .next = last ? NULL : &wr[i + 1],
            .sg_list = &sge[i],
            .num_sge = 1,
            .opcode = last ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
            .send_flags = last ? IBV_SEND_SIGNALED : 0,
            .imm_data = htonl(IMM),
            .wr.rdma = {remote.addr + (uint64_t)i * WRITE_LEN, remote.rkey},
        };
    }
    double t0 = now_s();
    struct ibv_wc wc;
    if (s.dev->ops->post_send(s.qp->qp, wr, &bad)) {
        fprintf(stderr, "ibv_post_send failed at WR %ld: %s\n", bad ? (long)(bad - wr) : -1L,
                strerror(errno));
        rc = 13;
    } else if (wait_completion(s.qp, &wc, 60) != IBV_WC_SUCCESS) {
        fprintf(stderr, "write completion failed: %s\n", ibv_wc_status_str(wc.status));
        rc = 14;
    } else {
        double dt = now_s() - t0;
        printf("  initiator %s: %d writes x %d KiB in one chain, %.1f MB/s\n", d->name, NUM_WRITES,
               WRITE_LEN >> 10, BUF_LEN / dt / 1e6);
    }
out_msg:
    kvw__wire_free(&ack);
out:
    zmq_close(sock);
    zmq_ctx_term(zctx);
    side_close(&s);
    return rc;
}

/* Parent process: accepts the initiator's hello, waits for the immediate,
 * verifies every byte. */
static void run_pair(const tb_device_t *from, const tb_device_t *to)
{
    printf("  RDMA WRITE %s (%s) -> %s (%s), test bed mode %s\n", from->name, from->ip, to->name,
           to->ip, tb_mode());
    side_t s;
    assert_int_equal(side_open(&s, to), 0);
    memset(s.buf, 0, BUF_LEN);
    struct ibv_sge none = {0};
    struct ibv_recv_wr rwr = {.wr_id = 1, .sg_list = &none, .num_sge = 0}, *rbad;
    assert_int_equal(s.dev->ops->post_recv(s.qp->qp, &rwr, &rbad), 0);

    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_REP);
    int timeout_ms = 30000;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    char bind[64], endpoint[128];
    size_t elen = sizeof(endpoint);
    snprintf(bind, sizeof(bind), "tcp://%s:*", to->ip);
    assert_int_equal(zmq_bind(sock, bind), 0);
    assert_int_equal(zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, endpoint, &elen), 0);

    fflush(stdout);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        int rc = run_initiator(from, endpoint);
        fflush(stdout);
        _exit(rc);
    }

    kvw_msg_t hello, ack;
    kvw_wire_region_t mine;
    assert_int_equal(recv_msg(sock, &hello), 0);
    assert_int_equal(hello.type, KVW_MSG_HELLO);
    assert_int_equal(kvw__qp_connect(s.qp, &hello.u.hello.qps[0], &s.cfg), 0);
    hello_of(&s, KVW_MSG_HELLO_ACK, &mine, &ack);
    assert_int_equal(send_msg(sock, &ack), 0);
    kvw__wire_free(&hello);

    struct ibv_wc wc;
    int wst = wait_completion(s.qp, &wc, 120);
    int status;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_int_equal(wst, IBV_WC_SUCCESS);
    assert_int_equal(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
    assert_int_equal(ntohl(wc.imm_data), IMM);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    size_t bad = 0;
    for (size_t i = 0; i < BUF_LEN; i++)
        bad += s.buf[i] != pattern_byte(i);
    printf("  target %s: verified %d bytes, %zu wrong\n", to->name, BUF_LEN, bad);
    assert_int_equal(bad, 0);
    zmq_close(sock);
    zmq_ctx_term(zctx);
    side_close(&s);
}

static void test_write_same_device(void **state)
{
    (void)state;
    tb_device_t d0;
    assert_true(tb_device(0, &d0));
    run_pair(&d0, &d0);
}

static void test_write_across_devices(void **state)
{
    (void)state;
    tb_device_t d0, d1;
    assert_true(tb_device(0, &d0));
    assert_true(tb_device(1, &d1));
    run_pair(&d0, &d1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_same_device),
        cmocka_unit_test(test_write_across_devices),
    };
    return cmocka_run_group_tests_name("rdma_write (real RDMA)", tests, NULL, NULL);
}
