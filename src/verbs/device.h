/* SPDX-License-Identifier: Apache-2.0 */
/* One opened RDMA device: context, port, chosen GID and the single PD that
 * every region and QP of an engine uses. */
#ifndef KVW_VERBS_DEVICE_H
#define KVW_VERBS_DEVICE_H

#include "kvwire.h"
#include "verbs/ops.h"

#include <stdbool.h>

typedef struct kvw_dev {
    const kvw_verbs_ops_t *ops;
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    char name[64];
    uint8_t port;
    int gid_index;
    union ibv_gid gid;
    uint16_t lid;
    uint8_t link_layer; /* IBV_LINK_LAYER_* */
    enum ibv_mtu active_mtu;
    uint32_t max_msg_sz; /* largest single RDMA write the port accepts */
    int max_qp_wr, max_cqe, max_sge;
    uint32_t link_mbps; /* the port's active speed x width in Mb/s; 0: unknown */
    bool down_at_open;  /* opened as a rail while its port was not ACTIVE */
} kvw_dev_t;

/* Open device `name`, or the device that owns local_ip when name is NULL.
 * gid_index < 0 picks a RoCEv2 IPv4-mapped GID (matching local_ip if given). */
kvw_status_t kvw__dev_open(const char *name, const char *local_ip, uint8_t port, int gid_index,
                           kvw_dev_t **dev_p);
/* As kvw__dev_open, for one rail of several: a port that is not ACTIVE is
 * opened all the same (down_at_open; its GID must be readable), since its
 * lanes can join their connections once it comes up. */
kvw_status_t kvw__dev_open_rail(const char *name, const char *local_ip, uint8_t port, int gid_index,
                                kvw_dev_t **dev_p);
void kvw__dev_close(kvw_dev_t *dev);
/* Can this device hold QPs of these depths (and their CQ, one SGE per WR)?
 * KVW_ERR_INVALID with the limit named in the log if not. */
kvw_status_t kvw__dev_check_limits(const kvw_dev_t *dev, uint32_t sq_depth, uint32_t rq_depth);
/* Is the device's port ACTIVE now (ibv_query_port; false if that fails)? */
bool kvw__dev_port_active(const kvw_dev_t *dev);

/* Pure: a port's link speed in Mb/s from ibv_port_attr's active_speed
 * (per lane: 1 SDR 2.5G, 2 DDR 5G, 4 QDR 10G, 8 FDR10 10G, 16 FDR 14G,
 * 32 EDR 25G, 64 HDR 50G, 128 NDR 100G) and active_width
 * (1 1x, 2 4x, 4 8x, 8 12x, 16 2x); 0 when either is unknown. */
uint32_t kvw__link_mbps(uint8_t active_speed, uint8_t active_width);

/* Pure helper, exposed for tests: is this GID an IPv4-mapped address
 * (::ffff:a.b.c.d)? */
int kvw__gid_is_ipv4_mapped(const union ibv_gid *gid);
/* Pure: would kvwire pick this RoCE GID (RoCEv2, IPv4-mapped, carrying
 * local_ip when given)? The first usable index is the one picked; on
 * InfiniBand it is GID 0. */
int kvw__gid_usable(const struct ibv_gid_entry *e, const char *local_ip);

#endif
