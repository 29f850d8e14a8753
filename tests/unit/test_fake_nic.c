/* SPDX-License-Identifier: Apache-2.0 */
/* Unit tests for the fake NIC (tests/support/fake_nic.c), driven only
 * through fake_nic_ops, the way src/verbs/ drives a device. No engine.
 *
 * Each test gets a fresh NIC and two RC QPs connected by hand as
 * src/verbs/qp.c does: `a` on fake0 writes into `b` on fake1. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>

#include "support/fake_nic.h"

#define OPS (&fake_nic_ops)

enum {
    BUF_LEN = 1 << 16,
    SQ_DEPTH = 64,
    RQ_DEPTH = 16,
    WAIT_MS = 3000,
    CHUNK = 1024, /* tests write chunk i at offset i * CHUNK */
};

typedef struct side {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_mr *mr;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    uint8_t *buf;
    uint32_t psn;
} side_t;

typedef struct pair {
    side_t a, b;
} pair_t;

static pair_t pair;
static int cq_entries = SQ_DEPTH + RQ_DEPTH; /* per CQ; the overrun test shrinks it */
static uint32_t send_sge = 1;   /* max_send_sge of the QPs; the gather test raises it */
static uint64_t expected_fatal; /* fatal errors a test provokes on purpose */

/* ---- helpers --------------------------------------------------------- */

static uint64_t ms_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static struct ibv_context *open_by_name(const char *name)
{
    int n = 0;
    struct ibv_device **list = OPS->get_device_list(&n);
    assert_non_null(list);
    struct ibv_context *ctx = NULL;
    for (int i = 0; i < n && !ctx; i++)
        if (strcmp(OPS->get_device_name(list[i]), name) == 0)
            ctx = OPS->open_device(list[i]);
    OPS->free_device_list(list);
    assert_non_null(ctx);
    return ctx;
}

/* Device, PD, registered buffer, channel, CQ and a QP in INIT. */
static void open_side(side_t *s, const char *dev, uint32_t psn)
{
    s->ctx = open_by_name(dev);
    s->pd = OPS->alloc_pd(s->ctx);
    assert_non_null(s->pd);
    s->buf = calloc(1, BUF_LEN);
    assert_non_null(s->buf);
    s->mr = OPS->reg_mr(s->pd, s->buf, BUF_LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    assert_non_null(s->mr);
    s->ch = OPS->create_comp_channel(s->ctx);
    assert_non_null(s->ch);
    s->cq = OPS->create_cq(s->ctx, cq_entries, s, s->ch, 0);
    assert_non_null(s->cq);
    struct ibv_qp_init_attr init = {
        .send_cq = s->cq,
        .recv_cq = s->cq,
        .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = SQ_DEPTH,
                .max_recv_wr = RQ_DEPTH,
                .max_send_sge = send_sge,
                .max_recv_sge = 1},
    };
    s->qp = OPS->create_qp(s->pd, &init);
    assert_non_null(s->qp);
    assert_int_equal(s->qp->state, IBV_QPS_RESET);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                            .port_num = 1,
                            .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE};
    assert_int_equal(
        OPS->modify_qp(s->qp, &a,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
        0);
    s->psn = psn;
}

static int to_rtr(side_t *s, const side_t *remote)
{
    struct ibv_gid_entry g;
    assert_int_equal(OPS->query_gid_ex(remote->ctx, 1, 1, &g), 0);
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = IBV_MTU_4096,
        .dest_qp_num = remote->qp->qp_num,
        .rq_psn = remote->psn,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 12,
        .ah_attr = {.port_num = 1, .is_global = 1, .grh = {.sgid_index = 1, .hop_limit = 255}},
    };
    a.ah_attr.grh.dgid = g.gid;
    return OPS->modify_qp(s->qp, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static int to_rts(side_t *s, uint8_t rnr_retry)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS,
                            .sq_psn = s->psn,
                            .max_rd_atomic = 1,
                            .timeout = 14,
                            .retry_cnt = 7,
                            .rnr_retry = rnr_retry};
    return OPS->modify_qp(s->qp, &a,
                          IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_TIMEOUT |
                              IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY);
}

static void connect_pair(pair_t *p, uint8_t rnr_retry)
{
    assert_int_equal(to_rtr(&p->a, &p->b), 0);
    assert_int_equal(to_rtr(&p->b, &p->a), 0);
    assert_int_equal(to_rts(&p->a, rnr_retry), 0);
    assert_int_equal(to_rts(&p->b, rnr_retry), 0);
}

static void close_side(side_t *s)
{
    if (s->qp)
        assert_int_equal(OPS->destroy_qp(s->qp), 0);
    assert_int_equal(OPS->destroy_cq(s->cq), 0);
    assert_int_equal(OPS->destroy_comp_channel(s->ch), 0);
    assert_int_equal(OPS->dereg_mr(s->mr), 0);
    assert_int_equal(OPS->dealloc_pd(s->pd), 0);
    assert_int_equal(OPS->close_device(s->ctx), 0);
    free(s->buf);
    memset(s, 0, sizeof(*s));
}

static int setup(void **state)
{
    memset(&pair, 0, sizeof(pair));
    expected_fatal = 0;
    fake_nic_fini(); /* in case a failed test left it up: no cascade */
    assert_int_equal(fake_nic_init(NULL), 0);
    open_side(&pair.a, "fake0", 0x123456);
    open_side(&pair.b, "fake1", 0xfffff0); /* wraps past 2^24 during the tests */
    for (int i = 0; i < BUF_LEN; i++)
        pair.a.buf[i] = (uint8_t)(i * 7 + 1);
    *state = &pair;
    return 0;
}

static int setup_small_cq(void **state)
{
    cq_entries = 2;
    int rc = setup(state);
    cq_entries = SQ_DEPTH + RQ_DEPTH;
    return rc;
}

static int setup_gather(void **state)
{
    send_sge = 4;
    int rc = setup(state);
    send_sge = 1;
    return rc;
}

/* Every test ends balanced: nothing outstanding, nothing leaked, no
 * misuse it did not provoke on purpose. */
static int teardown(void **state)
{
    pair_t *p = *state;
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    close_side(&p->a);
    close_side(&p->b);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.wrs_accepted, st.wrs_succeeded + st.wrs_errored + st.wrs_flushed);
    assert_int_equal(st.wrs_outstanding, 0);
    assert_int_equal(st.recvs_posted, st.recvs_consumed + st.recvs_flushed);
    assert_int_equal(st.live_qps + st.live_cqs + st.live_mrs + st.live_pds + st.live_channels +
                         st.live_contexts,
                     0);
    assert_int_equal(st.fatal_errors, expected_fatal);
    if (!expected_fatal)
        assert_int_equal(st.cq_overruns, 0);
    fake_nic_fini();
    return 0;
}

/* A one-SGE RDMA WRITE of chunk `i` from a.buf to the same offset of b.buf. */
static void make_write(pair_t *p, struct ibv_send_wr *wr, struct ibv_sge *sge, uint64_t i,
                       uint32_t len, unsigned int flags)
{
    *sge = (struct ibv_sge){
        .addr = (uintptr_t)p->a.buf + i * CHUNK, .length = len, .lkey = p->a.mr->lkey};
    *wr = (struct ibv_send_wr){.wr_id = 100 + i,
                               .sg_list = sge,
                               .num_sge = 1,
                               .opcode = IBV_WR_RDMA_WRITE,
                               .send_flags = flags};
    wr->wr.rdma.remote_addr = (uintptr_t)p->b.buf + i * CHUNK;
    wr->wr.rdma.rkey = p->b.mr->rkey;
}

/* n writes of chunks 0..n-1 linked into one list. */
static void make_chain(pair_t *p, struct ibv_send_wr *wrs, struct ibv_sge *sges, int n,
                       unsigned int flags)
{
    for (int i = 0; i < n; i++) {
        make_write(p, &wrs[i], &sges[i], (uint64_t)i, CHUNK, flags);
        wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
}

static int post(side_t *s, struct ibv_send_wr *wr)
{
    struct ibv_send_wr *bad = NULL;
    return OPS->post_send(s->qp, wr, &bad);
}

static void post_recvs(side_t *s, uint64_t first_id, int n)
{
    for (int i = 0; i < n; i++) {
        struct ibv_recv_wr r = {.wr_id = first_id + (uint64_t)i}, *bad = NULL;
        assert_int_equal(OPS->post_recv(s->qp, &r, &bad), 0);
    }
}

/* Poll until n CQEs arrived (or WAIT_MS passed); returns how many. */
static int wait_cqes(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    int got = 0;
    uint64_t deadline = ms_now() + WAIT_MS;
    while (got < n && ms_now() < deadline) {
        int k = OPS->poll_cq(cq, n - got, wc + got);
        assert_true(k >= 0);
        got += k;
        if (got < n)
            usleep(100);
    }
    return got;
}

static void expect_no_cqe(struct ibv_cq *cq)
{
    struct ibv_wc wc;
    assert_int_equal(OPS->poll_cq(cq, 1, &wc), 0);
}

static int chunk_landed(const pair_t *p, int i)
{
    return memcmp(p->a.buf + i * CHUNK, p->b.buf + i * CHUNK, CHUNK) == 0;
}

static int chunk_untouched(const pair_t *p, int i)
{
    for (int k = 0; k < CHUNK; k++)
        if (p->b.buf[i * CHUNK + k])
            return 0;
    return 1;
}

static void expect_send_cqe(const struct ibv_wc *wc, uint64_t wr_id, enum ibv_wc_status st,
                            const side_t *s)
{
    assert_int_equal(wc->wr_id, wr_id);
    assert_int_equal(wc->status, st);
    assert_int_equal(wc->qp_num, s->qp->qp_num);
    if (st == IBV_WC_SUCCESS)
        assert_int_equal(wc->opcode, IBV_WC_RDMA_WRITE);
}

/* ---- devices and object rules ----------------------------------------- */

static void test_devices_and_attributes(void **state)
{
    pair_t *p = *state;
    int n = 0;
    struct ibv_device **list = OPS->get_device_list(&n);
    assert_int_equal(n, 2);
    assert_string_equal(OPS->get_device_name(list[0]), "fake0");
    assert_string_equal(OPS->get_device_name(list[1]), "fake1");
    assert_null(list[2]);
    OPS->free_device_list(list);

    char name[64];
    uint8_t port = 0;
    assert_int_equal(OPS->device_for_ip("127.0.0.1", name, sizeof(name), &port), 0);
    assert_string_equal(name, "fake0");
    assert_int_equal(port, 1);
    assert_int_equal(OPS->device_for_ip("10.9.9.9", name, sizeof(name), &port), ENODEV);

    struct ibv_device_attr da;
    assert_int_equal(OPS->query_device(p->a.ctx, &da), 0);
    assert_int_equal(da.max_qp_wr, 16384);
    assert_int_equal(da.max_cqe, 65536);
    assert_int_equal(da.max_sge, 32);
    assert_int_equal(da.max_qp, 1024);

    struct ibv_port_attr pa;
    assert_int_equal(OPS->query_port(p->a.ctx, 1, &pa), 0);
    assert_int_equal(pa.state, IBV_PORT_ACTIVE);
    assert_int_equal(pa.link_layer, IBV_LINK_LAYER_ETHERNET);
    assert_int_equal(pa.active_mtu, IBV_MTU_4096);
    assert_int_equal(pa.max_msg_sz, 8u << 20);
    assert_int_equal(pa.gid_tbl_len, 2);
    assert_int_equal(pa.lid, 0);
    assert_int_not_equal(OPS->query_port(p->a.ctx, 2, &pa), 0);

    struct ibv_gid_entry g;
    assert_int_equal(OPS->query_gid_ex(p->b.ctx, 1, 0, &g), 0);
    assert_int_equal(g.gid_type, IBV_GID_TYPE_ROCE_V1);
    assert_int_equal(g.gid.raw[0], 0xfe);
    assert_int_equal(g.gid.raw[1], 0x80);
    assert_int_equal(OPS->query_gid_ex(p->b.ctx, 1, 1, &g), 0);
    assert_int_equal(g.gid_type, IBV_GID_TYPE_ROCE_V2);
    static const uint8_t mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1};
    assert_memory_equal(g.gid.raw, mapped, 16);
    assert_int_not_equal(OPS->query_gid_ex(p->b.ctx, 1, 2, &g), 0);

    errno = 0;
    assert_null(OPS->reg_dmabuf_mr(p->a.pd, 0, 4096, 0, -1, IBV_ACCESS_LOCAL_WRITE));
    assert_int_equal(errno, EBADF); /* dma-buf supported, but no such fd */
    assert_int_not_equal(p->a.mr->lkey, p->a.mr->rkey);
    assert_int_not_equal(p->a.mr->rkey, p->b.mr->rkey);
    assert_int_not_equal(p->a.qp->qp_num, p->b.qp->qp_num);
    assert_ptr_equal(p->a.cq->cq_context, &p->a);
    assert_ptr_equal(p->a.cq->channel, p->a.ch);
    /* Objects in use cannot go away, as on real verbs. */
    assert_int_equal(OPS->destroy_cq(p->a.cq), EBUSY);
    assert_int_equal(OPS->dealloc_pd(p->a.pd), EBUSY);
}

static void test_custom_config(void **state)
{
    (void)state;
    fake_nic_config_t cfg = {.num_devices = 3, .ip = {"10.0.0.1", "10.0.0.2"}, .max_msg_sz = 4096};
    assert_int_equal(fake_nic_init(&cfg), 0);
    assert_int_equal(fake_nic_init(&cfg), -1); /* already up */
    int n = 0;
    struct ibv_device **list = OPS->get_device_list(&n);
    assert_int_equal(n, 3);
    assert_string_equal(OPS->get_device_name(list[2]), "fake2");
    struct ibv_context *ctx = OPS->open_device(list[1]);
    OPS->free_device_list(list);
    char name[64];
    uint8_t port = 0;
    assert_int_equal(OPS->device_for_ip("10.0.0.2", name, sizeof(name), &port), 0);
    assert_string_equal(name, "fake1");
    assert_int_equal(OPS->device_for_ip("127.0.0.1", name, sizeof(name), &port), 0);
    assert_string_equal(name, "fake2"); /* the default IP */
    struct ibv_gid_entry g;
    assert_int_equal(OPS->query_gid_ex(ctx, 1, 1, &g), 0);
    assert_int_equal(g.gid.raw[12], 10);
    assert_int_equal(g.gid.raw[15], 2);
    struct ibv_port_attr pa;
    assert_int_equal(OPS->query_port(ctx, 1, &pa), 0);
    assert_int_equal(pa.max_msg_sz, 4096);
    assert_int_equal(OPS->close_device(ctx), 0);
    fake_nic_fini();
    fake_nic_fini(); /* harmless twice */
}

static void test_qp_state_rules(void **state)
{
    pair_t *p = *state;
    struct ibv_send_wr wrs[SQ_DEPTH + 2], *bad = NULL;
    struct ibv_sge sges[SQ_DEPTH + 2];
    make_chain(p, wrs, sges, 1, IBV_SEND_SIGNALED);
    /* Posting before RTS is refused. */
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), EINVAL);
    assert_ptr_equal(bad, &wrs[0]);
    /* INIT -> RTS skips RTR. */
    assert_int_equal(to_rts(&p->a, 7), EINVAL);
    /* RoCE needs a GRH. */
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024};
    assert_int_equal(OPS->modify_qp(p->a.qp, &a,
                                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                        IBV_QP_MIN_RNR_TIMER),
                     EINVAL);
    assert_int_equal(p->a.qp->state, IBV_QPS_INIT);
    connect_pair(p, 7);
    assert_int_equal(p->a.qp->state, IBV_QPS_RTS);
    assert_int_equal(to_rtr(&p->a, &p->b), EINVAL); /* RTS -> RTR */

    /* Unsupported opcode, too many SGEs. */
    wrs[0].opcode = IBV_WR_SEND;
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), EINVAL);
    wrs[0].opcode = IBV_WR_RDMA_WRITE;
    wrs[0].num_sge = 2;
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), EINVAL);

    /* A full send queue: the WR past capacity is refused with ENOMEM. The
     * WRs are unsignaled, so no polled CQE ever frees their slots. */
    make_chain(p, wrs, sges, SQ_DEPTH + 2, 0);
    for (int i = 0; i < SQ_DEPTH + 2; i++)
        sges[i].length = 16;
    bad = NULL;
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), ENOMEM);
    assert_ptr_equal(bad, &wrs[SQ_DEPTH]);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    wrs[0].next = NULL;
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), ENOMEM);
    expect_no_cqe(p->a.cq);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.wrs_accepted, SQ_DEPTH);
    assert_int_equal(st.wrs_succeeded, SQ_DEPTH);
    assert_int_equal(st.cqes, 0);
}

/* ---- data path -------------------------------------------------------- */

static void test_write_lands(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 3, CHUNK, IBV_SEND_SIGNALED);
    wr.wr_id = 42;
    assert_int_equal(post(&p->a, &wr), 0);
    /* The caller may reuse its WR at once: the NIC copied it. */
    memset(&wr, 0xff, sizeof(wr));
    memset(&sge, 0xff, sizeof(sge));
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 42, IBV_WC_SUCCESS, &p->a);
    assert_true(chunk_landed(p, 3));
    assert_true(chunk_untouched(p, 2));
    assert_true(chunk_untouched(p, 4));
    expect_no_cqe(p->b.cq); /* a plain write is invisible to the receiver */
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.bytes_written, CHUNK);
    assert_int_equal(st.post_send_calls, 1);
    assert_int_equal(st.wrs_succeeded, 1);
}

static void test_write_with_imm_consumes_receive(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 7, 2);
    struct ibv_send_wr wrs[2];
    struct ibv_sge sges[2];
    make_write(p, &wrs[0], &sges[0], 1, 300, IBV_SEND_SIGNALED);
    wrs[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[0].imm_data = htonl(0xabcdef01);
    wrs[0].next = &wrs[1];
    /* A zero-length write carries only its immediate (num_sge 0). */
    wrs[1] = (struct ibv_send_wr){.wr_id = 2,
                                  .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                                  .imm_data = htonl(5),
                                  .send_flags = IBV_SEND_SIGNALED};
    wrs[1].wr.rdma.remote_addr = (uintptr_t)p->b.buf;
    wrs[1].wr.rdma.rkey = p->b.mr->rkey;
    assert_int_equal(post(&p->a, wrs), 0);

    struct ibv_wc wc[2];
    assert_int_equal(wait_cqes(p->b.cq, 2, wc), 2);
    assert_int_equal(wc[0].status, IBV_WC_SUCCESS);
    assert_int_equal(wc[0].opcode, IBV_WC_RECV_RDMA_WITH_IMM);
    assert_true(wc[0].wc_flags & IBV_WC_WITH_IMM);
    assert_int_equal(wc[0].imm_data, htonl(0xabcdef01)); /* network order, untouched */
    assert_int_equal(wc[0].byte_len, 300);
    assert_int_equal(wc[0].qp_num, p->b.qp->qp_num);
    assert_int_equal(wc[0].src_qp, p->a.qp->qp_num);
    assert_int_equal(wc[0].wr_id, 7); /* the receive's wr_id */
    assert_int_equal(wc[1].wr_id, 8);
    assert_int_equal(wc[1].imm_data, htonl(5));
    assert_int_equal(wc[1].byte_len, 0);
    assert_memory_equal(p->b.buf + CHUNK, p->a.buf + CHUNK, 300);
    assert_int_equal(p->b.buf[CHUNK + 300], 0);
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 101, IBV_WC_SUCCESS, &p->a);
    expect_send_cqe(&wc[1], 2, IBV_WC_SUCCESS, &p->a);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.recvs_consumed, 2);
    assert_int_equal(st.recvs_posted, 2);
}

static void test_unsignaled_then_signaled(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wrs[4];
    struct ibv_sge sges[4];
    make_chain(p, wrs, sges, 4, 0);
    wrs[3].send_flags = IBV_SEND_SIGNALED;
    assert_int_equal(post(&p->a, wrs), 0);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    struct ibv_wc wc[4];
    assert_int_equal(OPS->poll_cq(p->a.cq, 4, wc), 1);
    expect_send_cqe(&wc[0], 103, IBV_WC_SUCCESS, &p->a);
    for (int i = 0; i < 4; i++)
        assert_true(chunk_landed(p, i));
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.wrs_succeeded, 4);
    assert_int_equal(st.cqes, 1);
}

/* Like mlx5, send-queue slots come back only when a completion covering
 * them is polled: executing a WR is not enough. */
static void test_send_slots_freed_by_polled_cqe(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wrs[SQ_DEPTH], *bad = NULL;
    struct ibv_sge sges[SQ_DEPTH];
    make_chain(p, wrs, sges, SQ_DEPTH, 0);
    wrs[SQ_DEPTH / 2 - 1].send_flags = IBV_SEND_SIGNALED;
    wrs[SQ_DEPTH - 1].send_flags = IBV_SEND_SIGNALED;
    assert_int_equal(post(&p->a, wrs), 0);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    make_chain(p, wrs, sges, 1, IBV_SEND_SIGNALED);
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), ENOMEM); /* all done, none polled */
    struct ibv_wc wc;
    assert_int_equal(OPS->poll_cq(p->a.cq, 1, &wc), 1); /* frees the first half */
    expect_send_cqe(&wc, 100 + SQ_DEPTH / 2 - 1, IBV_WC_SUCCESS, &p->a);
    make_chain(p, wrs, sges, SQ_DEPTH / 2 + 1, 0);
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), ENOMEM);
    assert_ptr_equal(bad, &wrs[SQ_DEPTH / 2]);
    assert_int_equal(OPS->poll_cq(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100 + SQ_DEPTH - 1, IBV_WC_SUCCESS, &p->a);
}

/* A post_send call fails at WR 2 of its 5: WRs 0 and 1 run, the rest
 * never do. A fault scoped to another QP never fires here. */
static void test_failed_post_executes_prefix(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    fake_nic_faults_t f = {.fail_post_call = 1, .fault_qp_num = p->b.qp->qp_num};
    fake_nic_set_faults(&f);
    struct ibv_send_wr wrs[5], *bad = NULL;
    struct ibv_sge sges[5];
    make_chain(p, wrs, sges, 1, IBV_SEND_SIGNALED);
    assert_int_equal(post(&p->a, wrs), 0); /* other QP's fault: no effect */
    struct ibv_wc wc[5];
    assert_int_equal(wait_cqes(p->a.cq, 1, wc), 1);
    memset(p->b.buf, 0, BUF_LEN);

    f = (fake_nic_faults_t){.fail_post_call = 2, .fail_post_wr = 2};
    fake_nic_set_faults(&f);
    make_chain(p, wrs, sges, 1, IBV_SEND_SIGNALED);
    assert_int_equal(post(&p->a, wrs), 0); /* call 1 of the new count */
    assert_int_equal(wait_cqes(p->a.cq, 1, wc), 1);
    memset(p->b.buf, 0, BUF_LEN);
    make_chain(p, wrs, sges, 5, IBV_SEND_SIGNALED);
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), EIO);
    assert_ptr_equal(bad, &wrs[2]);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 100, IBV_WC_SUCCESS, &p->a);
    expect_send_cqe(&wc[1], 101, IBV_WC_SUCCESS, &p->a);
    expect_no_cqe(p->a.cq);
    assert_true(chunk_landed(p, 0));
    assert_true(chunk_landed(p, 1));
    for (int i = 2; i < 5; i++)
        assert_true(chunk_untouched(p, i));

    /* A list shorter than fail_post_wr fails at its last WR. */
    f = (fake_nic_faults_t){.fail_post_call = 1, .fail_post_wr = 9, .fail_post_rc = ENOSPC};
    fake_nic_set_faults(&f);
    make_chain(p, wrs, sges, 3, IBV_SEND_SIGNALED);
    assert_int_equal(OPS->post_send(p->a.qp, wrs, &bad), ENOSPC);
    assert_ptr_equal(bad, &wrs[2]);
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[1], 101, IBV_WC_SUCCESS, &p->a);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.post_send_calls, 4);
    assert_int_equal(st.wrs_accepted, 6);
}

/* The third WR executed fails: 0 and 1 land, 2 errors, 3 and 4 flush. */
static void test_error_wr_flushes_the_rest(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->a, 50, 2); /* a's own receives are flushed too */
    fake_nic_faults_t f = {.error_wr = 3};
    fake_nic_set_faults(&f);
    struct ibv_send_wr wrs[5];
    struct ibv_sge sges[5];
    make_chain(p, wrs, sges, 5, 0); /* unsignaled: errors complete anyway */
    assert_int_equal(post(&p->a, wrs), 0);
    struct ibv_wc wc[5];
    assert_int_equal(wait_cqes(p->a.cq, 5, wc), 5);
    expect_send_cqe(&wc[0], 102, IBV_WC_REM_ACCESS_ERR, &p->a);
    expect_send_cqe(&wc[1], 103, IBV_WC_WR_FLUSH_ERR, &p->a);
    expect_send_cqe(&wc[2], 104, IBV_WC_WR_FLUSH_ERR, &p->a);
    assert_int_equal(wc[3].wr_id, 50);
    assert_int_equal(wc[3].status, IBV_WC_WR_FLUSH_ERR);
    assert_int_equal(wc[4].wr_id, 51);
    assert_int_equal(wc[4].status, IBV_WC_WR_FLUSH_ERR);
    assert_true(chunk_landed(p, 0));
    assert_true(chunk_landed(p, 1));
    for (int i = 2; i < 5; i++)
        assert_true(chunk_untouched(p, i));
    assert_int_equal(p->a.qp->state, IBV_QPS_ERR);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.wrs_succeeded, 2);
    assert_int_equal(st.wrs_errored, 1);
    assert_int_equal(st.wrs_flushed, 2);
    assert_int_equal(st.recvs_flushed, 2);
}

/* A custom status, scoped to the QP. */
static void test_error_status_is_configurable(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    fake_nic_faults_t f = {
        .error_wr = 1, .error_status = IBV_WC_RETRY_EXC_ERR, .fault_qp_num = p->a.qp->qp_num};
    fake_nic_set_faults(&f);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_RETRY_EXC_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
}

static void test_modify_to_err_flushes_receives(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 10, 3);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    assert_int_equal(OPS->modify_qp(p->b.qp, &a, IBV_QP_STATE), 0);
    assert_int_equal(p->b.qp->state, IBV_QPS_ERR);
    struct ibv_wc wc[4];
    assert_int_equal(OPS->poll_cq(p->b.cq, 4, wc), 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(wc[i].wr_id, 10 + i);
        assert_int_equal(wc[i].status, IBV_WC_WR_FLUSH_ERR);
        assert_int_equal(wc[i].qp_num, p->b.qp->qp_num);
    }
    /* A receive posted in ERR is flushed at once. */
    post_recvs(&p->b, 20, 1);
    assert_int_equal(OPS->poll_cq(p->b.cq, 4, wc), 1);
    assert_int_equal(wc[0].wr_id, 20);
    assert_int_equal(wc[0].status, IBV_WC_WR_FLUSH_ERR);
    /* ERR -> RTS is not a transition. */
    assert_int_equal(to_rts(&p->b, 7), EINVAL);
}

static void test_post_in_err_is_flushed(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    assert_int_equal(OPS->modify_qp(p->a.qp, &a, IBV_QP_STATE), 0);
    struct ibv_send_wr wrs[2];
    struct ibv_sge sges[2];
    make_chain(p, wrs, sges, 2, 0);
    assert_int_equal(post(&p->a, wrs), 0);
    struct ibv_wc wc[2];
    assert_int_equal(OPS->poll_cq(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 100, IBV_WC_WR_FLUSH_ERR, &p->a);
    expect_send_cqe(&wc[1], 101, IBV_WC_WR_FLUSH_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
}

/* rnr_retry 7: the immediate waits for a receive, and the write posted
 * after it waits behind it (RC order). */
static void test_rnr_forever_stalls_until_receive(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wrs[2];
    struct ibv_sge sges[2];
    make_chain(p, wrs, sges, 2, IBV_SEND_SIGNALED);
    wrs[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[0].imm_data = htonl(99);
    assert_int_equal(post(&p->a, wrs), 0);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0); /* stalled counts as idle */
    usleep(20 * 1000);                              /* many RNR retry periods */
    expect_no_cqe(p->a.cq);
    expect_no_cqe(p->b.cq);
    assert_true(chunk_untouched(p, 0));
    assert_true(chunk_untouched(p, 1));
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.wrs_outstanding, 2);

    post_recvs(&p->b, 1, 1);
    struct ibv_wc wc[2];
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 100, IBV_WC_SUCCESS, &p->a);
    expect_send_cqe(&wc[1], 101, IBV_WC_SUCCESS, &p->a);
    assert_int_equal(wait_cqes(p->b.cq, 1, wc), 1);
    assert_int_equal(wc[0].imm_data, htonl(99));
    assert_true(chunk_landed(p, 0));
    assert_true(chunk_landed(p, 1));
}

static void test_rnr_zero_fails(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 0);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_RNR_RETRY_EXC_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
    expect_no_cqe(p->b.cq);
    assert_int_equal(p->a.qp->state, IBV_QPS_ERR);
}

/* ---- faults on the wire ----------------------------------------------- */

static void test_delay_honoured(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    fake_nic_faults_t f = {.delay_us = 100 * 1000};
    fake_nic_set_faults(&f);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, CHUNK, IBV_SEND_SIGNALED);
    uint64_t t0 = ms_now();
    assert_int_equal(post(&p->a, &wr), 0);
    usleep(40 * 1000);
    expect_no_cqe(p->a.cq);
    assert_true(chunk_untouched(p, 0));
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    assert_true(ms_now() - t0 >= 100);
    expect_send_cqe(&wc, 100, IBV_WC_SUCCESS, &p->a);
    assert_true(chunk_landed(p, 0));
}

/* Jitter reorders due times, never the QP's completions. */
static void test_jitter_keeps_rc_order(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    fake_nic_faults_t f = {.delay_us = 100, .delay_jitter_us = 5000, .seed = 42};
    fake_nic_set_faults(&f);
    enum { N = 16 };
    struct ibv_send_wr wrs[N];
    struct ibv_sge sges[N];
    for (int i = 0; i < N; i++) {
        make_write(p, &wrs[i], &sges[i], (uint64_t)i, CHUNK, IBV_SEND_SIGNALED);
        assert_int_equal(post(&p->a, &wrs[i]), 0); /* one post per WR: own due times */
    }
    struct ibv_wc wc[N];
    assert_int_equal(wait_cqes(p->a.cq, N, wc), N);
    for (int i = 0; i < N; i++) {
        expect_send_cqe(&wc[i], 100 + (uint64_t)i, IBV_WC_SUCCESS, &p->a);
        assert_true(chunk_landed(p, i));
    }
}

static void test_protection_errors(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    struct ibv_wc wc;
    /* Bad rkey. */
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    wr.wr.rdma.rkey = p->b.mr->lkey;
    assert_int_equal(post(&p->a, &wr), 0);
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_REM_ACCESS_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
}

static void test_remote_range_error(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    struct ibv_wc wc;
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    wr.wr.rdma.remote_addr = (uintptr_t)p->b.buf + BUF_LEN - CHUNK / 2; /* runs past the MR */
    assert_int_equal(post(&p->a, &wr), 0);
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_REM_ACCESS_ERR, &p->a);
    assert_int_equal(p->b.buf[BUF_LEN - 1], 0);
}

static void test_local_protection_error(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wrs[2];
    struct ibv_sge sges[2];
    struct ibv_wc wc[2];
    make_chain(p, wrs, sges, 2, IBV_SEND_SIGNALED);
    sges[0].lkey = p->a.mr->rkey;
    assert_int_equal(post(&p->a, wrs), 0);
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 100, IBV_WC_LOC_PROT_ERR, &p->a);
    expect_send_cqe(&wc[1], 101, IBV_WC_WR_FLUSH_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
    assert_true(chunk_untouched(p, 1));
}

static void test_destroyed_peer_is_unreachable(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    assert_int_equal(OPS->destroy_qp(p->b.qp), 0);
    p->b.qp = NULL;
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_RETRY_EXC_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
}

/* A killed device answers nothing, sends nothing, yet tears down cleanly
 * (teardown destroys b as usual). */
static void test_killed_device(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 1, 1);
    assert_int_equal(fake_nic_kill_device("fake1"), 0);
    assert_int_equal(fake_nic_kill_device("nope"), -1);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, CHUNK, 0);
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 100, IBV_WC_RETRY_EXC_ERR, &p->a);
    assert_true(chunk_untouched(p, 0));
    /* b's own writes go nowhere. */
    struct ibv_sge bs = {.addr = (uintptr_t)p->b.buf, .length = 8, .lkey = p->b.mr->lkey};
    struct ibv_send_wr bw = {.wr_id = 5,
                             .sg_list = &bs,
                             .num_sge = 1,
                             .opcode = IBV_WR_RDMA_WRITE,
                             .send_flags = IBV_SEND_SIGNALED};
    bw.wr.rdma.remote_addr = (uintptr_t)p->a.buf;
    bw.wr.rdma.rkey = p->a.mr->rkey;
    assert_int_equal(post(&p->b, &bw), 0);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    expect_no_cqe(p->b.cq);
    assert_int_equal(p->a.buf[0], 1);
}

/* Replace the fixture's NIC by one made with cfg (fini frees the old
 * objects) and rebuild the pair on it. */
static void reinit(pair_t *p, const fake_nic_config_t *cfg)
{
    fake_nic_fini();
    assert_int_equal(fake_nic_init(cfg), 0);
    free(p->a.buf);
    free(p->b.buf);
    open_side(&p->a, "fake0", 1);
    open_side(&p->b, "fake1", 2);
}

static void test_unreachable_retry_time(void **state)
{
    pair_t *p = *state;
    fake_nic_config_t cfg = {.retry_us = 50 * 1000};
    reinit(p, &cfg);
    connect_pair(p, 7);
    assert_int_equal(fake_nic_kill_device("fake1"), 0);
    struct ibv_send_wr wr;
    struct ibv_sge sge;
    make_write(p, &wr, &sge, 0, 8, 0);
    uint64_t t0 = ms_now();
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    assert_true(ms_now() - t0 >= 50);
    expect_send_cqe(&wc, 100, IBV_WC_RETRY_EXC_ERR, &p->a);
}

/* A write longer than the port's max_msg_sz fails locally. */
static void test_message_too_long(void **state)
{
    pair_t *p = *state;
    fake_nic_config_t cfg = {.max_msg_sz = CHUNK};
    reinit(p, &cfg);
    connect_pair(p, 7);
    struct ibv_send_wr wrs[2];
    struct ibv_sge sges[2];
    make_chain(p, wrs, sges, 2, IBV_SEND_SIGNALED);
    sges[1].length = CHUNK + 1;
    assert_int_equal(post(&p->a, wrs), 0);
    struct ibv_wc wc[2];
    assert_int_equal(wait_cqes(p->a.cq, 2, wc), 2);
    expect_send_cqe(&wc[0], 100, IBV_WC_SUCCESS, &p->a);
    expect_send_cqe(&wc[1], 101, IBV_WC_LOC_LEN_ERR, &p->a);
    assert_true(chunk_untouched(p, 1));
}

/* ---- completion channel, CQ overrun, stats ------------------------------ */

static int fd_readable(int fd, int timeout_ms)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    return poll(&pfd, 1, timeout_ms);
}

static void send_imm(pair_t *p, uint32_t imm)
{
    struct ibv_send_wr wr = {
        .wr_id = imm, .opcode = IBV_WR_RDMA_WRITE_WITH_IMM, .imm_data = htonl(imm)};
    wr.wr.rdma.remote_addr = (uintptr_t)p->b.buf;
    wr.wr.rdma.rkey = p->b.mr->rkey;
    assert_int_equal(post(&p->a, &wr), 0);
}

static void test_comp_channel_event(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 1, 3);
    int fd = p->b.ch->fd;
    assert_int_equal(fd_readable(fd, 0), 0);
    struct ibv_cq *cq = NULL;
    void *ctx = NULL;
    assert_int_equal(OPS->get_cq_event(p->b.ch, &cq, &ctx), -1);
    assert_int_equal(errno, EAGAIN);

    assert_int_equal(OPS->req_notify_cq(p->b.cq, 0), 0);
    send_imm(p, 1);
    assert_int_equal(fd_readable(fd, WAIT_MS), 1);
    assert_int_equal(OPS->get_cq_event(p->b.ch, &cq, &ctx), 0);
    assert_ptr_equal(cq, p->b.cq);
    assert_ptr_equal(ctx, &p->b);
    errno = 0;
    assert_int_equal(OPS->get_cq_event(p->b.ch, &cq, &ctx), -1); /* one event per arm */
    assert_int_equal(errno, EAGAIN);
    OPS->ack_cq_events(cq, 1);
    assert_int_equal(fd_readable(fd, 0), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->b.cq, 1, &wc), 1);
    assert_int_equal(wc.imm_data, htonl(1));

    /* Not re-armed: the next CQE raises no event. */
    send_imm(p, 2);
    assert_int_equal(wait_cqes(p->b.cq, 1, &wc), 1);
    assert_int_equal(fd_readable(fd, 20), 0);

    /* Solicited-only arming ignores an unsolicited immediate... */
    assert_int_equal(OPS->req_notify_cq(p->b.cq, 1), 0);
    send_imm(p, 3);
    assert_int_equal(wait_cqes(p->b.cq, 1, &wc), 1);
    assert_int_equal(fd_readable(fd, 20), 0);
    /* ...but not an error. */
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    post_recvs(&p->b, 9, 1);
    assert_int_equal(OPS->modify_qp(p->b.qp, &a, IBV_QP_STATE), 0);
    assert_int_equal(fd_readable(fd, WAIT_MS), 1);
    assert_int_equal(OPS->get_cq_event(p->b.ch, &cq, &ctx), 0);
    OPS->ack_cq_events(cq, 1);
    assert_int_equal(wait_cqes(p->b.cq, 1, &wc), 1);
    assert_int_equal(wc.status, IBV_WC_WR_FLUSH_ERR);
}

/* A CQ smaller than the signaled WRs outstanding overruns: recorded, never
 * silent. (The fixture's CQs hold 2 entries here.) */
static void test_cq_overrun_is_recorded(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    struct ibv_send_wr wrs[3];
    struct ibv_sge sges[3];
    make_chain(p, wrs, sges, 3, IBV_SEND_SIGNALED);
    assert_int_equal(post(&p->a, wrs), 0);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.cq_overruns, 1);
    assert_int_equal(st.fatal_errors, 1);
    assert_non_null(strstr(st.fatal, "cq overrun"));
    assert_int_equal(st.cqes, 2);
    expected_fatal = 1;
}

/* Mixed traffic and faults; once every QP is gone the books balance. */
static void test_stats_balance(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 0, 4);
    struct ibv_send_wr wrs[8];
    struct ibv_sge sges[8];
    make_chain(p, wrs, sges, 8, 0);
    wrs[3].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[3].send_flags = IBV_SEND_SIGNALED;
    assert_int_equal(post(&p->a, wrs), 0); /* 8 accepted, 4 unsignaled, all succeed */
    struct ibv_wc wc[8];
    assert_int_equal(wait_cqes(p->a.cq, 1, wc), 1);
    assert_int_equal(fake_nic_quiesce(WAIT_MS), 0);

    fake_nic_faults_t f = {.error_wr = 2, .delay_us = 2000};
    fake_nic_set_faults(&f);
    make_chain(p, wrs, sges, 6, 0);
    assert_int_equal(post(&p->a, wrs), 0); /* 1 ok, 1 error, 4 flushed */
    /* b: 3 receives left, one more posted, then b dies with 2 WRs queued. */
    post_recvs(&p->b, 10, 1);
    assert_int_equal(wait_cqes(p->a.cq, 5, wc), 5);
    assert_int_equal(OPS->destroy_qp(p->a.qp), 0);
    p->a.qp = NULL;
    struct ibv_sge bs = {.addr = (uintptr_t)p->b.buf, .length = 8, .lkey = p->b.mr->lkey};
    struct ibv_send_wr bw[2] = {
        {.wr_id = 1, .sg_list = &bs, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE, .next = &bw[1]},
        {.wr_id = 2, .sg_list = &bs, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE}};
    bw[0].wr.rdma.rkey = bw[1].wr.rdma.rkey = p->a.mr->rkey;
    bw[0].wr.rdma.remote_addr = bw[1].wr.rdma.remote_addr = (uintptr_t)p->a.buf;
    assert_int_equal(fake_nic_kill_device("fake1"), 0); /* so they stay queued */
    assert_int_equal(post(&p->b, bw), 0);
    assert_int_equal(OPS->destroy_qp(p->b.qp), 0);
    p->b.qp = NULL;

    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.post_send_calls, 3);
    assert_int_equal(st.wrs_accepted, 8 + 6 + 2);
    assert_int_equal(st.wrs_succeeded, 8 + 1);
    assert_int_equal(st.wrs_errored, 1);
    assert_int_equal(st.wrs_flushed, 4 + 2);
    assert_int_equal(st.wrs_accepted, st.wrs_succeeded + st.wrs_errored + st.wrs_flushed);
    assert_int_equal(st.wrs_outstanding, 0);
    assert_int_equal(st.recvs_posted, 5);
    assert_int_equal(st.recvs_consumed, 1);
    assert_int_equal(st.recvs_flushed, 4);
    assert_int_equal(st.bytes_written, 9 * CHUNK);
    assert_int_equal(st.cqes, 1 + 1 + 1 + 4); /* signaled, recv, error, flushes */
    assert_int_equal(st.cq_overruns, 0);
    assert_int_equal(st.live_qps, 0);
}

/* ---- lifecycle ---------------------------------------------------------- */

/* fini frees what the user leaked (ASan checks), and init works again. */
static void test_fini_frees_leftovers(void **state)
{
    (void)state;
    for (int round = 0; round < 3; round++) {
        assert_int_equal(fake_nic_init(NULL), 0);
        side_t a, b;
        open_side(&a, "fake0", 7);
        open_side(&b, "fake1", 8);
        pair_t p = {a, b};
        connect_pair(&p, 7);
        assert_int_equal(OPS->req_notify_cq(b.cq, 0), 0);
        post_recvs(&b, 0, 2);
        fake_nic_faults_t f = {.delay_us = 1000 * 1000}; /* still queued at fini */
        fake_nic_set_faults(&f);
        struct ibv_send_wr wr = {.opcode = IBV_WR_RDMA_WRITE_WITH_IMM};
        wr.wr.rdma.rkey = b.mr->rkey;
        assert_int_equal(post(&a, &wr), 0);
        fake_nic_set_faults(NULL);
        send_imm(&p, 4); /* behind the delayed one */
        assert_int_equal(OPS->close_device(a.ctx), EBUSY);
        fake_nic_stats_t st;
        fake_nic_stats(&st);
        assert_int_equal(st.live_qps, 2);
        fake_nic_fini();
        free(a.buf);
        free(b.buf);
    }
}

/* A write with several entries gathers them, in order, into contiguous
 * remote bytes (head slicing's gather writes); more entries than the QP's
 * max_send_sge are refused, and an entry outside its MR fails the write
 * without landing any of it. */
static void test_gather_write(void **state)
{
    pair_t *p = *state;
    connect_pair(p, 7);
    post_recvs(&p->b, 1, 1);
    struct ibv_sge sges[5];
    for (int i = 0; i < 5; i++) /* 100 bytes from every other chunk, last first */
        sges[i] = (struct ibv_sge){.addr = (uintptr_t)p->a.buf + (uint64_t)(8 - 2 * i) * CHUNK,
                                   .length = 100,
                                   .lkey = p->a.mr->lkey};
    struct ibv_send_wr wr = {.wr_id = 9,
                             .sg_list = sges,
                             .num_sge = 5,
                             .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                             .imm_data = htonl(3),
                             .send_flags = IBV_SEND_SIGNALED};
    wr.wr.rdma.remote_addr = (uintptr_t)p->b.buf + 20 * CHUNK;
    wr.wr.rdma.rkey = p->b.mr->rkey;
    assert_int_equal(post(&p->a, &wr), EINVAL); /* 5 entries, max_send_sge 4 */
    wr.num_sge = 4;
    assert_int_equal(post(&p->a, &wr), 0);
    struct ibv_wc wc;
    assert_int_equal(wait_cqes(p->b.cq, 1, &wc), 1);
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_int_equal(wc.byte_len, 400);
    for (int i = 0; i < 4; i++)
        assert_memory_equal(p->b.buf + 20 * CHUNK + i * 100, p->a.buf + (8 - 2 * i) * CHUNK, 100);
    assert_int_equal(p->b.buf[20 * CHUNK + 400], 0);
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    expect_send_cqe(&wc, 9, IBV_WC_SUCCESS, &p->a);
    assert_int_equal(wc.byte_len, 400);
    fake_nic_stats_t st;
    fake_nic_stats(&st);
    assert_int_equal(st.bytes_written, 400);

    /* The second entry outside the MR: a local protection error, nothing
     * of the first entry lands. */
    sges[1].lkey = p->a.mr->lkey + 1000;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.num_sge = 2;
    wr.wr.rdma.remote_addr = (uintptr_t)p->b.buf + 30 * CHUNK;
    assert_int_equal(post(&p->a, &wr), 0);
    assert_int_equal(wait_cqes(p->a.cq, 1, &wc), 1);
    assert_int_equal(wc.status, IBV_WC_LOC_PROT_ERR);
    assert_true(chunk_untouched(p, 30));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_devices_and_attributes, setup, teardown),
        cmocka_unit_test(test_custom_config),
        cmocka_unit_test_setup_teardown(test_qp_state_rules, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_lands, setup, teardown),
        cmocka_unit_test_setup_teardown(test_gather_write, setup_gather, teardown),
        cmocka_unit_test_setup_teardown(test_write_with_imm_consumes_receive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unsignaled_then_signaled, setup, teardown),
        cmocka_unit_test_setup_teardown(test_send_slots_freed_by_polled_cqe, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_post_executes_prefix, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_wr_flushes_the_rest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_status_is_configurable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_modify_to_err_flushes_receives, setup, teardown),
        cmocka_unit_test_setup_teardown(test_post_in_err_is_flushed, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rnr_forever_stalls_until_receive, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rnr_zero_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_delay_honoured, setup, teardown),
        cmocka_unit_test_setup_teardown(test_jitter_keeps_rc_order, setup, teardown),
        cmocka_unit_test_setup_teardown(test_protection_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_remote_range_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_local_protection_error, setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroyed_peer_is_unreachable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_killed_device, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unreachable_retry_time, setup, teardown),
        cmocka_unit_test_setup_teardown(test_message_too_long, setup, teardown),
        cmocka_unit_test_setup_teardown(test_comp_channel_event, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cq_overrun_is_recorded, setup_small_cq, teardown),
        cmocka_unit_test_setup_teardown(test_stats_balance, setup, teardown),
        cmocka_unit_test(test_fini_frees_leftovers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
