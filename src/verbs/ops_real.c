/* SPDX-License-Identifier: Apache-2.0 */
/* The real verbs table: thin adapters over libibverbs and librdmacm. */
#include "verbs/ops.h"

#include <arpa/inet.h>
#include <errno.h>
#include <rdma/rdma_cma.h>
#include <stdio.h>
#include <string.h>

static int real_close_device(struct ibv_context *ctx)
{
    return ibv_close_device(ctx);
}

static int real_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr)
{
    return ibv_query_port(ctx, port, attr);
}

static int real_query_gid_ex(struct ibv_context *ctx, uint32_t port, uint32_t index,
                             struct ibv_gid_entry *entry)
{
    return ibv_query_gid_ex(ctx, port, index, entry, 0);
}

static struct ibv_mr *real_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    return ibv_reg_mr(pd, addr, len, access);
}

static int real_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    return ibv_req_notify_cq(cq, solicited_only);
}

static int real_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    return ibv_modify_qp(qp, attr, mask);
}

static int real_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    return ibv_post_send(qp, wr, bad);
}

static int real_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    return ibv_post_recv(qp, wr, bad);
}

static int real_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    return ibv_poll_cq(cq, n, wc);
}

/* Binding an rdma_cm id to the address makes the kernel resolve which
 * device and port own it, which is exactly "the device for this IP". */
static int real_device_for_ip(const char *ip, char *name, size_t name_size, uint8_t *port)
{
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    struct sockaddr_in *sin = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, ip, &sin->sin_addr) == 1) {
        sin->sin_family = AF_INET;
    } else if (inet_pton(AF_INET6, ip, &sin6->sin6_addr) == 1) {
        sin6->sin6_family = AF_INET6;
    } else {
        return EINVAL;
    }
    struct rdma_event_channel *ch = rdma_create_event_channel();
    if (!ch)
        return errno ? errno : ENODEV;
    struct rdma_cm_id *id = NULL;
    int rc = 0;
    if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP)) {
        rc = errno;
    } else if (rdma_bind_addr(id, (struct sockaddr *)&ss)) {
        rc = errno;
    } else if (!id->verbs) {
        rc = ENODEV;
    } else {
        snprintf(name, name_size, "%s", ibv_get_device_name(id->verbs->device));
        *port = id->port_num;
    }
    if (id)
        rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
    return rc;
}

const kvw_verbs_ops_t kvw__verbs_real_ops = {
    .get_device_list = ibv_get_device_list,
    .free_device_list = ibv_free_device_list,
    .get_device_name = ibv_get_device_name,
    .open_device = ibv_open_device,
    .close_device = real_close_device,
    .device_for_ip = real_device_for_ip,
    .query_device = ibv_query_device,
    .query_port = real_query_port,
    .query_gid_ex = real_query_gid_ex,
    .alloc_pd = ibv_alloc_pd,
    .dealloc_pd = ibv_dealloc_pd,
    .reg_mr = real_reg_mr,
    .reg_dmabuf_mr = ibv_reg_dmabuf_mr,
    .dereg_mr = ibv_dereg_mr,
    .create_comp_channel = ibv_create_comp_channel,
    .destroy_comp_channel = ibv_destroy_comp_channel,
    .create_cq = ibv_create_cq,
    .destroy_cq = ibv_destroy_cq,
    .req_notify_cq = real_req_notify_cq,
    .get_cq_event = ibv_get_cq_event,
    .ack_cq_events = ibv_ack_cq_events,
    .create_qp = ibv_create_qp,
    .modify_qp = real_modify_qp,
    .destroy_qp = ibv_destroy_qp,
    .post_send = real_post_send,
    .post_recv = real_post_recv,
    .poll_cq = real_poll_cq,
    .fork_init = ibv_fork_init,
    .is_fork_initialized = ibv_is_fork_initialized,
    .get_async_event = ibv_get_async_event,
    .ack_async_event = ibv_ack_async_event,
};

static const kvw_verbs_ops_t *current_ops = &kvw__verbs_real_ops;

const kvw_verbs_ops_t *kvw__verbs_ops(void)
{
    return current_ops;
}

void kvw__verbs_set_ops(const kvw_verbs_ops_t *ops)
{
    current_ops = ops ? ops : &kvw__verbs_real_ops;
}
