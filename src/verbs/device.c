/* SPDX-License-Identifier: Apache-2.0 */
#include "verbs/device.h"

#include "common/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>

int kvw__gid_is_ipv4_mapped(const union ibv_gid *gid)
{
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return memcmp(gid->raw, prefix, sizeof(prefix)) == 0;
}

static int gid_matches_ip(const union ibv_gid *gid, const char *ip)
{
    struct in_addr a;
    if (!ip || inet_pton(AF_INET, ip, &a) != 1)
        return 1; /* nothing to match against */
    return memcmp(gid->raw + 12, &a, 4) == 0;
}

static void gid_to_text(const union ibv_gid *gid, char *buf, size_t size)
{
    if (!inet_ntop(AF_INET6, gid->raw, buf, (socklen_t)size))
        snprintf(buf, size, "?");
}

int kvw__gid_usable(const struct ibv_gid_entry *e, const char *local_ip)
{
    return e->gid_type == IBV_GID_TYPE_ROCE_V2 && kvw__gid_is_ipv4_mapped(&e->gid) &&
           gid_matches_ip(&e->gid, local_ip);
}

/* RoCE: prefer a RoCEv2 GID that is IPv4-mapped (routable, and GID 0, the
 * link-local one, hangs on rxe) and carries our IP. InfiniBand: GID 0. */
static kvw_status_t choose_gid(kvw_dev_t *dev, const struct ibv_port_attr *pa, const char *local_ip,
                               int requested)
{
    if (requested >= 0) {
        if (requested >= pa->gid_tbl_len) {
            KVW_ERROR("%s: GID index %d outside the table (%d entries)", dev->name, requested,
                      pa->gid_tbl_len);
            return KVW_ERR_INVALID;
        }
        dev->gid_index = requested;
    } else if (pa->link_layer == IBV_LINK_LAYER_INFINIBAND) {
        dev->gid_index = 0;
    } else {
        dev->gid_index = -1;
        for (int i = 0; i < pa->gid_tbl_len && dev->gid_index < 0; i++) {
            struct ibv_gid_entry e;
            if (dev->ops->query_gid_ex(dev->ctx, dev->port, (uint32_t)i, &e))
                continue; /* empty slots return an error */
            if (kvw__gid_usable(&e, local_ip))
                dev->gid_index = i;
        }
        if (dev->gid_index < 0) {
            KVW_ERROR("%s port %u: no RoCEv2 IPv4-mapped GID%s%s; is an IPv4 address assigned "
                      "to its netdev? (set KVW_GID_INDEX to force one)",
                      dev->name, dev->port, local_ip ? " for " : "", local_ip ? local_ip : "");
            return KVW_ERR_NO_DEVICE;
        }
    }
    struct ibv_gid_entry e;
    if (dev->ops->query_gid_ex(dev->ctx, dev->port, (uint32_t)dev->gid_index, &e)) {
        KVW_ERROR("%s: cannot read GID %d: %s", dev->name, dev->gid_index, strerror(errno));
        return KVW_ERR_VERBS;
    }
    dev->gid = e.gid;
    char text[INET6_ADDRSTRLEN];
    gid_to_text(&dev->gid, text, sizeof(text));
    KVW_INFO("%s port %u: using GID index %d (%s)", dev->name, dev->port, dev->gid_index, text);
    return KVW_OK;
}

static struct ibv_context *open_by_name(const kvw_verbs_ops_t *ops, const char *name)
{
    int n = 0;
    struct ibv_device **list = ops->get_device_list(&n);
    if (!list) {
        KVW_ERROR("cannot list RDMA devices: %s", strerror(errno));
        return NULL;
    }
    struct ibv_context *ctx = NULL;
    for (int i = 0; i < n && !ctx; i++)
        if (strcmp(ops->get_device_name(list[i]), name) == 0)
            ctx = ops->open_device(list[i]);
    if (!ctx)
        KVW_ERROR("RDMA device '%s' not found among %d device(s)", name, n);
    ops->free_device_list(list);
    return ctx;
}

uint32_t kvw__link_mbps(uint8_t active_speed, uint8_t active_width)
{
    static const struct {
        uint8_t code;
        uint32_t mbps;
    } speeds[] = {{1, 2500},   {2, 5000},   {4, 10000},  {8, 10000},
                  {16, 14000}, {32, 25000}, {64, 50000}, {128, 100000}};
    static const struct {
        uint8_t code, lanes;
    } widths[] = {{1, 1}, {2, 4}, {4, 8}, {8, 12}, {16, 2}};
    uint32_t lane = 0, lanes = 0;
    for (size_t i = 0; i < sizeof(speeds) / sizeof(speeds[0]); i++)
        if (speeds[i].code == active_speed)
            lane = speeds[i].mbps;
    for (size_t i = 0; i < sizeof(widths) / sizeof(widths[0]); i++)
        if (widths[i].code == active_width)
            lanes = widths[i].lanes;
    return lane * lanes;
}

static kvw_status_t query_port(kvw_dev_t *dev, const char *local_ip, int gid_index,
                               bool may_be_down)
{
    struct ibv_port_attr pa;
    struct ibv_device_attr da;
    if (dev->ops->query_port(dev->ctx, dev->port, &pa) || dev->ops->query_device(dev->ctx, &da)) {
        KVW_ERROR("%s: query port %u failed: %s", dev->name, dev->port, strerror(errno));
        return KVW_ERR_VERBS;
    }
    if (pa.state != IBV_PORT_ACTIVE) {
        if (!may_be_down) {
            KVW_ERROR("%s port %u is not active (state %d)", dev->name, dev->port, pa.state);
            return KVW_ERR_NO_DEVICE;
        }
        KVW_WARN("%s port %u is not active (state %d): opened as a rail whose lanes join once it "
                 "is up",
                 dev->name, dev->port, pa.state);
        dev->down_at_open = true;
    }
    dev->lid = pa.lid;
    dev->link_layer = pa.link_layer;
    /* A port that is down may not report its active MTU: its largest
     * then (the connection takes the smaller of both ends'). */
    dev->active_mtu =
        pa.active_mtu >= IBV_MTU_256 && pa.active_mtu <= IBV_MTU_4096 ? pa.active_mtu : pa.max_mtu;
    dev->max_msg_sz = pa.max_msg_sz ? pa.max_msg_sz : (1u << 30);
    dev->max_qp_wr = da.max_qp_wr;
    dev->max_cqe = da.max_cqe;
    dev->max_sge = da.max_sge;
    dev->link_mbps = kvw__link_mbps(pa.active_speed, pa.active_width);
    return choose_gid(dev, &pa, local_ip, gid_index);
}

bool kvw__dev_port_active(const kvw_dev_t *dev)
{
    struct ibv_port_attr pa;
    return dev->ops->query_port(dev->ctx, dev->port, &pa) == 0 && pa.state == IBV_PORT_ACTIVE;
}

kvw_status_t kvw__dev_check_limits(const kvw_dev_t *dev, uint32_t sq_depth, uint32_t rq_depth)
{
    /* One CQ per QP takes both queues' completions (see qp.c). */
    uint64_t cqe = (uint64_t)sq_depth + rq_depth;
    if (sq_depth > (uint32_t)dev->max_qp_wr || rq_depth > (uint32_t)dev->max_qp_wr) {
        KVW_ERROR("%s: sq_depth %u / rq_depth %u exceed the device's max_qp_wr %d", dev->name,
                  sq_depth, rq_depth, dev->max_qp_wr);
        return KVW_ERR_INVALID;
    }
    if (cqe > (uint64_t)dev->max_cqe) {
        KVW_ERROR("%s: sq_depth + rq_depth = %llu exceeds the device's max_cqe %d", dev->name,
                  (unsigned long long)cqe, dev->max_cqe);
        return KVW_ERR_INVALID;
    }
    if (dev->max_sge < 1) {
        KVW_ERROR("%s: the device takes no scatter/gather entry per WR (max_sge %d)", dev->name,
                  dev->max_sge);
        return KVW_ERR_INVALID;
    }
    return KVW_OK;
}

/* A fork() (Python multiprocessing's default start method, system(),
 * popen()) after memory was registered lets the child share the pinned
 * pages copy-on-write; on kernels without copy-on-fork for DMA pages the
 * parent's next write then moves to a new page while the NIC keeps the
 * old one, and transfers silently read or land in the wrong memory.
 * ibv_fork_init() marks registered ranges MADV_DONTFORK; it works only
 * before the process's first registration, so the first engine does it
 * before its own. Kernels that copy DMA pages on fork need nothing. */
static void fork_protect(const kvw_verbs_ops_t *ops)
{
    enum ibv_fork_status s = ops->is_fork_initialized();
    if (s == IBV_FORK_UNNEEDED || s == IBV_FORK_ENABLED)
        return;
    int rc = ops->fork_init();
    if (rc)
        KVW_WARN("ibv_fork_init failed (%s): this process registered RDMA memory before "
                 "kvwire; a fork() in it may corrupt registered pages on this kernel. Set "
                 "RDMAV_FORK_SAFE=1 in the environment, or create the engine before other RDMA "
                 "users register memory",
                 strerror(rc));
}

static kvw_status_t dev_open(const char *name, const char *local_ip, uint8_t port, int gid_index,
                             bool may_be_down, kvw_dev_t **dev_p)
{
    kvw_dev_t *dev = calloc(1, sizeof(*dev));
    if (!dev)
        return KVW_ERR_NO_MEMORY;
    dev->ops = kvw__verbs_ops();
    dev->port = port;
    fork_protect(dev->ops);
    kvw_status_t st = KVW_ERR_NO_DEVICE;
    if (name) {
        snprintf(dev->name, sizeof(dev->name), "%s", name);
    } else if (!local_ip) {
        KVW_ERROR("neither a device name nor a local IP to find one from");
        goto fail;
    } else {
        int rc = dev->ops->device_for_ip(local_ip, dev->name, sizeof(dev->name), &dev->port);
        if (rc) {
            KVW_ERROR("no RDMA device owns %s: %s", local_ip, strerror(rc));
            goto fail;
        }
    }
    dev->ctx = open_by_name(dev->ops, dev->name);
    if (!dev->ctx)
        goto fail;
    /* The control thread polls it with its sockets and must never block. */
    int fl = dev->ctx->async_fd >= 0 ? fcntl(dev->ctx->async_fd, F_GETFL) : -1;
    if (fl >= 0 && fcntl(dev->ctx->async_fd, F_SETFL, fl | O_NONBLOCK) < 0)
        KVW_WARN("%s: cannot make the async event fd non-blocking: %s", dev->name, strerror(errno));
    st = query_port(dev, local_ip, gid_index, may_be_down);
    if (st)
        goto fail;
    dev->pd = dev->ops->alloc_pd(dev->ctx);
    if (!dev->pd) {
        KVW_ERROR("%s: ibv_alloc_pd failed: %s", dev->name, strerror(errno));
        st = KVW_ERR_VERBS;
        goto fail;
    }
    *dev_p = dev;
    return KVW_OK;
fail:
    kvw__dev_close(dev);
    return st;
}

kvw_status_t kvw__dev_open(const char *name, const char *local_ip, uint8_t port, int gid_index,
                           kvw_dev_t **dev_p)
{
    return dev_open(name, local_ip, port, gid_index, false, dev_p);
}

kvw_status_t kvw__dev_open_rail(const char *name, const char *local_ip, uint8_t port, int gid_index,
                                kvw_dev_t **dev_p)
{
    return dev_open(name, local_ip, port, gid_index, true, dev_p);
}

void kvw__dev_close(kvw_dev_t *dev)
{
    if (!dev)
        return;
    if (dev->pd)
        dev->ops->dealloc_pd(dev->pd);
    if (dev->ctx)
        dev->ops->close_device(dev->ctx);
    free(dev);
}
