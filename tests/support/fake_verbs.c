/* SPDX-License-Identifier: Apache-2.0 */
#include "support/fake_verbs.h"

#include <errno.h>
#include <string.h>

fake_verbs_t fake_verbs;
static size_t fail_at; /* absolute post number to fail, 0 none */
static char fake_qp_storage[sizeof(struct ibv_qp)];

void fake_verbs_reset(void)
{
    memset(&fake_verbs, 0, sizeof(fake_verbs));
    fail_at = 0;
}

void fake_verbs_fail_post_at(size_t nth, int rc, size_t wr)
{
    fail_at = nth ? fake_verbs.num_posts + nth : 0;
    fake_verbs.fail_post = fail_at;
    fake_verbs.fail_rc = rc;
    fake_verbs.fail_wr = wr;
}

void fake_verbs_fail_post(size_t nth, int rc)
{
    fake_verbs_fail_post_at(nth, rc, 0);
}

struct ibv_qp *fake_verbs_qp(void)
{
    return (struct ibv_qp *)(void *)fake_qp_storage;
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    (void)qp;
    size_t call = ++fake_verbs.num_posts;
    fake_post_t *p = call <= FAKE_MAX_POSTS ? &fake_verbs.posts[call - 1] : NULL;
    if (p) {
        p->first = fake_verbs.num_wrs;
        p->count = 0;
        p->failed = 0;
    }
    for (struct ibv_send_wr *w = wr; w; w = w->next) {
        if (p)
            p->count++;
        if (fake_verbs.num_wrs >= FAKE_MAX_WRS)
            continue;
        fake_wr_t *f = &fake_verbs.wrs[fake_verbs.num_wrs++];
        f->wr_id = w->wr_id;
        f->opcode = (int)w->opcode;
        f->send_flags = w->send_flags;
        f->num_sge = w->num_sge;
        if (w->num_sge > 0 && w->sg_list) {
            f->sge_addr = w->sg_list[0].addr;
            f->sge_len = w->sg_list[0].length;
            f->sge_lkey = w->sg_list[0].lkey;
        }
        f->remote_addr = w->wr.rdma.remote_addr;
        f->rkey = w->wr.rdma.rkey;
        f->imm_data = w->imm_data;
    }
    if (fail_at && call == fail_at) {
        if (p)
            p->failed = 1;
        struct ibv_send_wr *bad = wr;
        for (size_t i = 0; i < fake_verbs.fail_wr && bad->next; i++)
            bad = bad->next;
        if (bad_wr)
            *bad_wr = bad;
        return fake_verbs.fail_rc ? fake_verbs.fail_rc : EIO;
    }
    return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    (void)qp;
    (void)wr;
    (void)bad_wr;
    fake_verbs.post_recv_calls++;
    return 0;
}

static int fake_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    (void)cq;
    (void)n;
    (void)wc;
    fake_verbs.poll_cq_calls++;
    return 0;
}

/* Everything else fails. */
static struct ibv_device **f_get_device_list(int *num)
{
    fake_verbs.other_calls++;
    if (num)
        *num = 0;
    errno = ENODEV;
    return NULL;
}
static void f_free_device_list(struct ibv_device **list)
{
    (void)list;
    fake_verbs.other_calls++;
}
static const char *f_get_device_name(struct ibv_device *dev)
{
    (void)dev;
    fake_verbs.other_calls++;
    return NULL;
}
static struct ibv_context *f_open_device(struct ibv_device *dev)
{
    (void)dev;
    fake_verbs.other_calls++;
    errno = ENODEV;
    return NULL;
}
static int f_close_device(struct ibv_context *ctx)
{
    (void)ctx;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_device_for_ip(const char *ip, char *name, size_t name_size, uint8_t *port)
{
    (void)ip;
    (void)name;
    (void)name_size;
    (void)port;
    fake_verbs.other_calls++;
    return -1;
}
static int f_query_device(struct ibv_context *ctx, struct ibv_device_attr *attr)
{
    (void)ctx;
    (void)attr;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr)
{
    (void)ctx;
    (void)port;
    (void)attr;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_query_gid_ex(struct ibv_context *ctx, uint32_t port, uint32_t index,
                          struct ibv_gid_entry *entry)
{
    (void)ctx;
    (void)port;
    (void)index;
    (void)entry;
    fake_verbs.other_calls++;
    return EINVAL;
}
static struct ibv_pd *f_alloc_pd(struct ibv_context *ctx)
{
    (void)ctx;
    fake_verbs.other_calls++;
    errno = ENOMEM;
    return NULL;
}
static int f_dealloc_pd(struct ibv_pd *pd)
{
    (void)pd;
    fake_verbs.other_calls++;
    return EINVAL;
}
static struct ibv_mr *f_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access)
{
    (void)pd;
    (void)addr;
    (void)len;
    (void)access;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return NULL;
}
static struct ibv_mr *f_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                      int fd, int access)
{
    (void)pd;
    (void)offset;
    (void)len;
    (void)iova;
    (void)fd;
    (void)access;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return NULL;
}
static int f_dereg_mr(struct ibv_mr *mr)
{
    (void)mr;
    fake_verbs.other_calls++;
    return EINVAL;
}
static struct ibv_comp_channel *f_create_comp_channel(struct ibv_context *ctx)
{
    (void)ctx;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return NULL;
}
static int f_destroy_comp_channel(struct ibv_comp_channel *ch)
{
    (void)ch;
    fake_verbs.other_calls++;
    return EINVAL;
}
static struct ibv_cq *f_create_cq(struct ibv_context *ctx, int cqe, void *cq_ctx,
                                  struct ibv_comp_channel *ch, int vector)
{
    (void)ctx;
    (void)cqe;
    (void)cq_ctx;
    (void)ch;
    (void)vector;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return NULL;
}
static int f_destroy_cq(struct ibv_cq *cq)
{
    (void)cq;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    (void)cq;
    (void)solicited_only;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_get_cq_event(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_ctx)
{
    (void)ch;
    (void)cq;
    (void)cq_ctx;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return -1;
}
static void f_ack_cq_events(struct ibv_cq *cq, unsigned int n)
{
    (void)cq;
    (void)n;
    fake_verbs.other_calls++;
}
static struct ibv_qp *f_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    (void)pd;
    (void)attr;
    fake_verbs.other_calls++;
    errno = EINVAL;
    return NULL;
}
static int f_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    (void)qp;
    (void)attr;
    (void)mask;
    fake_verbs.other_calls++;
    return EINVAL;
}
static int f_destroy_qp(struct ibv_qp *qp)
{
    (void)qp;
    fake_verbs.other_calls++;
    return EINVAL;
}

static int f_get_async_event(struct ibv_context *ctx, struct ibv_async_event *ev)
{
    (void)ctx;
    (void)ev;
    errno = EAGAIN;
    return -1;
}
static void f_ack_async_event(struct ibv_async_event *ev)
{
    (void)ev;
}
static int f_fork_init(void)
{
    return 0;
}
static enum ibv_fork_status f_is_fork_initialized(void)
{
    return IBV_FORK_UNNEEDED;
}

const kvw_verbs_ops_t fake_verbs_ops = {
    .get_device_list = f_get_device_list,
    .free_device_list = f_free_device_list,
    .get_device_name = f_get_device_name,
    .open_device = f_open_device,
    .close_device = f_close_device,
    .device_for_ip = f_device_for_ip,
    .query_device = f_query_device,
    .query_port = f_query_port,
    .query_gid_ex = f_query_gid_ex,
    .alloc_pd = f_alloc_pd,
    .dealloc_pd = f_dealloc_pd,
    .reg_mr = f_reg_mr,
    .reg_dmabuf_mr = f_reg_dmabuf_mr,
    .dereg_mr = f_dereg_mr,
    .create_comp_channel = f_create_comp_channel,
    .destroy_comp_channel = f_destroy_comp_channel,
    .create_cq = f_create_cq,
    .destroy_cq = f_destroy_cq,
    .req_notify_cq = f_req_notify_cq,
    .get_cq_event = f_get_cq_event,
    .ack_cq_events = f_ack_cq_events,
    .create_qp = f_create_qp,
    .modify_qp = f_modify_qp,
    .destroy_qp = f_destroy_qp,
    .post_send = fake_post_send,
    .post_recv = fake_post_recv,
    .poll_cq = fake_poll_cq,
    .fork_init = f_fork_init,
    .is_fork_initialized = f_is_fork_initialized,
    .get_async_event = f_get_async_event,
    .ack_async_event = f_ack_async_event,
};
