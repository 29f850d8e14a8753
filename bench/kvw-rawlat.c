/* SPDX-License-Identifier: Apache-2.0 */
/* kvw-rawlat: the raw-verbs floor for a request's critical path, the
 * yardstick kvwire-bench's critical path is compared with. No kvwire code:
 * two RC QPs on one device, connected to each other through its GID, and
 * one chain of --writes small RDMA WRITEs whose last carries an immediate
 * (the shape of a kvwire request: one write per K/V run, the immediate on
 * the last), posted with one ibv_post_send. Timed from the post to the
 * receive completion of the immediate, busy-polled on the same thread: no
 * thread hand-off, no wake-up, nothing but the device.
 *
 *   kvw-rawlat [--dev NAME] [--gid-index N] [--writes N] [--idle-us US]
 *              [--iters N] [--size BYTES]
 *
 * --idle-us sleeps before each post, as a request arrives after the forward
 * pass, not back to back: on rxe, which does the transfer in software inside
 * ibv_post_send, a post after an idle gap costs about twice a post in a hot
 * loop. Prints the median and the 10th and 90th percentiles, and, since rxe
 * runs the whole transfer inside the call, the median time spent in
 * ibv_post_send itself. Exit status 0 on success, 1 on any verbs failure. */
#include "kvw-tools.h"

#include <arpa/inet.h>
#include <getopt.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { MAX_WRITES = 64, PORT = 1 };

typedef struct opts {
    const char *dev;
    int gid_index, writes, idle_us, iters;
    uint32_t size;
} opts_t;

typedef struct rig {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_mr *mr;
    struct ibv_cq *send_cq, *recv_cq;
    struct ibv_qp *sender, *receiver;
    char *buf;
    size_t len;
} rig_t;

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int fail(const char *what)
{
    perror(what);
    return 1;
}

static struct ibv_context *open_device(const char *name)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    struct ibv_context *ctx = NULL;
    for (int i = 0; list && i < n && !ctx; i++)
        if (!name || !strcmp(ibv_get_device_name(list[i]), name))
            ctx = ibv_open_device(list[i]);
    if (list)
        ibv_free_device_list(list);
    return ctx;
}

/* INIT -> RTR -> RTS towards `peer_qpn` at `gid` (the same device). */
static int connect_qp(struct ibv_qp *qp, uint32_t peer_qpn, const union ibv_gid *gid, int gid_index)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT, .port_num = PORT, .qp_access_flags = IBV_ACCESS_REMOTE_WRITE};
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
        return fail("ibv_modify_qp(INIT)");
    struct ibv_port_attr port;
    if (ibv_query_port(qp->context, PORT, &port))
        return fail("ibv_query_port");
    a = (struct ibv_qp_attr){
        .qp_state = IBV_QPS_RTR,
        .path_mtu = port.active_mtu,
        .dest_qp_num = peer_qpn,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 12,
        .ah_attr = {.is_global = 1,
                    .dlid = port.lid,
                    .port_num = PORT,
                    .grh = {.dgid = *gid, .sgid_index = (uint8_t)gid_index, .hop_limit = 64}}};
    if (ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        return fail("ibv_modify_qp(RTR)");
    a = (struct ibv_qp_attr){
        .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7, .max_rd_atomic = 1};
    if (ibv_modify_qp(qp, &a,
                      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                          IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
        return fail("ibv_modify_qp(RTS)");
    return 0;
}

static int setup(const opts_t *o, rig_t *g)
{
    if (!(g->ctx = open_device(o->dev))) {
        fprintf(stderr, "kvw-rawlat: no RDMA device%s%s\n", o->dev ? " named " : "",
                o->dev ? o->dev : "");
        return 1;
    }
    g->len = 2 * (size_t)MAX_WRITES * 4096;
    g->buf = aligned_alloc(4096, g->len);
    if (!g->buf || !(g->pd = ibv_alloc_pd(g->ctx)))
        return fail("ibv_alloc_pd");
    memset(g->buf, 0, g->len);
    g->mr = ibv_reg_mr(g->pd, g->buf, g->len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    g->send_cq = ibv_create_cq(g->ctx, 256, NULL, NULL, 0);
    g->recv_cq = ibv_create_cq(g->ctx, 256, NULL, NULL, 0);
    if (!g->mr || !g->send_cq || !g->recv_cq)
        return fail("ibv_reg_mr / ibv_create_cq");
    struct ibv_qp_init_attr ia = {
        .send_cq = g->send_cq,
        .recv_cq = g->send_cq,
        .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 256, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1}};
    g->sender = ibv_create_qp(g->pd, &ia);
    ia.send_cq = ia.recv_cq = g->recv_cq;
    g->receiver = ibv_create_qp(g->pd, &ia);
    if (!g->sender || !g->receiver)
        return fail("ibv_create_qp");
    union ibv_gid gid;
    if (ibv_query_gid(g->ctx, PORT, o->gid_index, &gid))
        return fail("ibv_query_gid");
    return connect_qp(g->sender, g->receiver->qp_num, &gid, o->gid_index) ||
           connect_qp(g->receiver, g->sender->qp_num, &gid, o->gid_index);
}

/* Busy-poll cq for one completion; 0 if it succeeded, else says which
 * (`what`) failed and returns 1. */
static int await_completion(struct ibv_cq *cq, const char *what)
{
    struct ibv_wc wc;
    int n;
    while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
        ;
    if (n > 0 && wc.status == IBV_WC_SUCCESS)
        return 0;
    fprintf(stderr, "kvw-rawlat: %s completion: %s\n", what,
            n < 0 ? "ibv_poll_cq failed" : ibv_wc_status_str(wc.status));
    return 1;
}

/* One request: the chain, then its immediate at the receiver. Returns the
 * microseconds post -> receive completion (and in *post_us the post). */
static int one_request(const opts_t *o, rig_t *g, uint32_t seq, double *total_us, double *post_us)
{
    struct ibv_sge sge[MAX_WRITES];
    struct ibv_send_wr wr[MAX_WRITES], *bad;
    struct ibv_recv_wr rwr = {.wr_id = seq}, *rbad;
    if (ibv_post_recv(g->receiver, &rwr, &rbad))
        return fail("ibv_post_recv");
    for (int i = 0; i < o->writes; i++) {
        sge[i] = (struct ibv_sge){(uintptr_t)g->buf + (size_t)i * 4096, o->size, g->mr->lkey};
        wr[i] = (struct ibv_send_wr){.wr_id = (uint64_t)i,
                                     .next = i + 1 < o->writes ? &wr[i + 1] : NULL,
                                     .sg_list = &sge[i],
                                     .num_sge = 1,
                                     .opcode = IBV_WR_RDMA_WRITE};
        wr[i].wr.rdma.remote_addr = (uintptr_t)g->buf + g->len / 2 + (size_t)i * 4096;
        wr[i].wr.rdma.rkey = g->mr->rkey;
    }
    struct ibv_send_wr *last = &wr[o->writes - 1];
    last->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    last->imm_data = htonl(seq);
    last->send_flags = IBV_SEND_SIGNALED; /* selective signaling: the chain's end */
    double t0 = now_us();
    if (ibv_post_send(g->sender, wr, &bad))
        return fail("ibv_post_send");
    *post_us = now_us() - t0;
    int failed = await_completion(g->recv_cq, "receive");
    *total_us = now_us() - t0;
    return failed || await_completion(g->send_cq, "send");
}

static __attribute__((noreturn)) void usage(void)
{
    printf("Usage: kvw-rawlat [--dev NAME] [--gid-index N] [--writes N] [--idle-us US]\n"
           "                  [--iters N] [--size BYTES]\n"
           "Raw verbs latency on one device, without kvwire: a burst of RDMA writes with\n"
           "immediate between two QPs after an idle gap, the yardstick for kvwire's own\n"
           "latency. Numbers are decimal, or hex after 0x.\n"
           "  --dev NAME       the device (the first one)\n"
           "  --gid-index N    the GID (1)\n"
           "  --writes N       writes a burst, 1 to %d (2)\n"
           "  --idle-us US     the gap before each burst (1000)\n"
           "  --iters N        bursts (201)\n"
           "  --size BYTES     bytes a write, 1 to 4096 (8)\n"
           "  -h, --help       this help\n"
           "  -V, --version    the kvwire version\n"
           "Exit status: 0 measured; 1 a verbs step failed, or a bad command line.\n",
           MAX_WRITES);
    exit(0);
}

static void parse(int argc, char **argv, opts_t *o)
{
    *o = (opts_t){.gid_index = 1, .writes = 2, .idle_us = 1000, .iters = 201, .size = 8};
    static const struct option lo[] = {
        {"dev", 1, 0, 'd'},     {"gid-index", 1, 0, 'g'}, {"writes", 1, 0, 'w'},
        {"idle-us", 1, 0, 'i'}, {"iters", 1, 0, 'n'},     {"size", 1, 0, 's'},
        {"help", 0, 0, 'h'},    {"version", 0, 0, 'V'},   {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "hV", lo, NULL)) != -1) {
        if (c == 'd')
            o->dev = optarg;
        else if (c == 'g')
            o->gid_index = (int)kvw_tool_u32("--gid-index", optarg, 0, 255);
        else if (c == 'w')
            o->writes = (int)kvw_tool_u32("--writes", optarg, 1, MAX_WRITES);
        else if (c == 'i')
            o->idle_us = (int)kvw_tool_u32("--idle-us", optarg, 0, 10000000);
        else if (c == 'n')
            o->iters = (int)kvw_tool_u32("--iters", optarg, 1, 10000000);
        else if (c == 's')
            o->size = kvw_tool_u32("--size", optarg, 1, 4096);
        else if (c == 'h')
            usage();
        else if (c == 'V')
            kvw_tool_version();
        else
            kvw_tool_bad_option();
    }
    if (optind != argc)
        kvw_tool_usage_error("unexpected argument '%s'", argv[optind]);
}

int main(int argc, char **argv)
{
    kvw_tool_name = "kvw-rawlat";
    opts_t o;
    parse(argc, argv, &o);
    rig_t g = {0};
    if (setup(&o, &g))
        return 1;
    double *total = calloc((size_t)o.iters, sizeof(double));
    double *post = calloc((size_t)o.iters, sizeof(double));
    if (!total || !post)
        return fail("calloc");
    for (int i = 0; i < o.iters; i++) {
        if (o.idle_us)
            usleep((useconds_t)o.idle_us);
        if (one_request(&o, &g, (uint32_t)i, &total[i], &post[i]))
            return 1;
    }
    qsort(total, (size_t)o.iters, sizeof(double), cmp_double);
    qsort(post, (size_t)o.iters, sizeof(double), cmp_double);
    printf("raw verbs on %s: chain of %d x %u B writes, the last with an immediate, %d us idle "
           "before each, %d reps: post -> receive completion median %.1f us (p10 %.1f, p90 "
           "%.1f); inside ibv_post_send %.1f us\n",
           ibv_get_device_name(g.ctx->device), o.writes, o.size, o.idle_us, o.iters,
           total[o.iters / 2], total[o.iters / 10], total[o.iters * 9 / 10], post[o.iters / 2]);
    free(total);
    free(post);
    ibv_destroy_qp(g.sender);
    ibv_destroy_qp(g.receiver);
    ibv_destroy_cq(g.send_cq);
    ibv_destroy_cq(g.recv_cq);
    ibv_dereg_mr(g.mr);
    ibv_dealloc_pd(g.pd);
    ibv_close_device(g.ctx);
    free(g.buf);
    return 0;
}
