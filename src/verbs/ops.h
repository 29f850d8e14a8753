/* SPDX-License-Identifier: Apache-2.0 */
/* Every verbs (and librdmacm) call kvwire makes goes through this table.
 * verbs.h makes ibv_post_send and ibv_poll_cq static inline, so ld --wrap
 * cannot mock them; an ops table lets unit tests substitute a fake device
 * and inject faults. The real table is the default. */
#ifndef KVW_VERBS_OPS_H
#define KVW_VERBS_OPS_H

#include <infiniband/verbs.h>

typedef struct kvw_verbs_ops {
    struct ibv_device **(*get_device_list)(int *num);
    void (*free_device_list)(struct ibv_device **list);
    const char *(*get_device_name)(struct ibv_device *dev);
    struct ibv_context *(*open_device)(struct ibv_device *dev);
    int (*close_device)(struct ibv_context *ctx);
    /* librdmacm: name of the device that owns ip, and its port. */
    int (*device_for_ip)(const char *ip, char *name, size_t name_size, uint8_t *port);
    int (*query_device)(struct ibv_context *ctx, struct ibv_device_attr *attr);
    int (*query_port)(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
    int (*query_gid_ex)(struct ibv_context *ctx, uint32_t port, uint32_t index,
                        struct ibv_gid_entry *entry);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
    int (*dealloc_pd)(struct ibv_pd *pd);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
    struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova,
                                    int fd, int access);
    int (*dereg_mr)(struct ibv_mr *mr);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *ctx);
    int (*destroy_comp_channel)(struct ibv_comp_channel *ch);
    struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_ctx,
                                struct ibv_comp_channel *ch, int vector);
    int (*destroy_cq)(struct ibv_cq *cq);
    int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
    int (*get_cq_event)(struct ibv_comp_channel *ch, struct ibv_cq **cq, void **cq_ctx);
    void (*ack_cq_events)(struct ibv_cq *cq, unsigned int n);
    struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
    int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
    int (*destroy_qp)(struct ibv_qp *qp);
    int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
    int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
    int (*poll_cq)(struct ibv_cq *cq, int n, struct ibv_wc *wc);
    /* The device's asynchronous events (port up/down, QP or device fatal):
     * read from ctx->async_fd, which kvw__dev_open makes non-blocking. */
    int (*get_async_event)(struct ibv_context *ctx, struct ibv_async_event *event);
    void (*ack_async_event)(struct ibv_async_event *event);
    /* fork() protection for registered pages (ibv_fork_init(3)). */
    int (*fork_init)(void);
    enum ibv_fork_status (*is_fork_initialized)(void);
} kvw_verbs_ops_t;

/* The ops used by devices opened from now on. Unit tests install a fake
 * with kvw__verbs_set_ops(); NULL restores the real table. Not thread-safe:
 * call before creating engines. */
const kvw_verbs_ops_t *kvw__verbs_ops(void);
void kvw__verbs_set_ops(const kvw_verbs_ops_t *ops);
extern const kvw_verbs_ops_t kvw__verbs_real_ops;

#endif
