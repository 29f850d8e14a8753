/* SPDX-License-Identifier: Apache-2.0 */
/* RC queue pairs connected by hand from exchanged QP info (no rdma_cm on the
 * data path: the peers already talk over the control plane). */
#ifndef KVW_VERBS_QP_H
#define KVW_VERBS_QP_H

#include "verbs/device.h"

#include <stdbool.h>

/* What a peer needs to connect to one of our QPs; sent over the wire. */
typedef struct kvw_qp_info {
    uint32_t qpn;
    uint32_t psn;
    uint16_t lid;
    uint8_t mtu;        /* enum ibv_mtu of the sender's port */
    uint8_t link_layer; /* IBV_LINK_LAYER_* */
    uint8_t gid[16];
} kvw_qp_info_t;

typedef struct kvw_qp {
    kvw_dev_t *dev;
    struct ibv_cq *cq; /* one CQ per QP for sends and receives: sized so it cannot overrun */
    struct ibv_qp *qp;
    uint32_t psn;
    uint32_t sq_depth, rq_depth;
    uint32_t max_send_sge; /* scatter/gather entries a send WR may carry */
    bool remote_write;     /* the peer may write our memory through it (decode) */
    /* The path as set at RTR, for the bring-up log. */
    enum ibv_mtu path_mtu;
    struct ibv_ah_attr ah;
} kvw_qp_t;

#define KVW_QPN_MASK 0xffffffu
#define KVW_FLOW_LABEL_MASK 0xfffffu

/* Create an RC QP and its CQ (bound to channel if not NULL, with cq_ctx).
 * The QP is left in INIT, accepting remote writes only when remote_write
 * (decode); a prefill QP grants the peer no remote access at all. */
kvw_status_t kvw__qp_create(kvw_dev_t *dev, struct ibv_comp_channel *channel, void *cq_ctx,
                            uint32_t sq_depth, uint32_t rq_depth, bool remote_write,
                            kvw_qp_t **qp_p);
/* kvw__qp_create with send WRs of up to max_send_sge entries (head
 * slicing's gather writes), capped at the device's max_sge; qp->max_send_sge
 * says what the QP took. kvw__qp_create asks for 1. */
kvw_status_t kvw__qp_create_sge(kvw_dev_t *dev, struct ibv_comp_channel *channel, void *cq_ctx,
                                uint32_t sq_depth, uint32_t rq_depth, uint32_t max_send_sge,
                                bool remote_write, kvw_qp_t **qp_p);
void kvw__qp_local_info(const kvw_qp_t *qp, kvw_qp_info_t *info_p);
/* INIT -> RTR -> RTS towards remote, with cfg's fabric settings; logs the
 * path at info level once connected. */
kvw_status_t kvw__qp_connect(kvw_qp_t *qp, const kvw_qp_info_t *remote, const kvw_config_t *cfg);
/* Pure helpers, exposed for tests. The flow label a QP derives when
 * cfg->flow_label is -1: a hash of both QPNs, the same on both ends. */
uint32_t kvw__flow_label(uint32_t local_qpn, uint32_t remote_qpn);
/* Does the address vector towards remote carry a GRH (see ib_use_grh)? */
bool kvw__qp_wants_grh(const kvw_dev_t *dev, const kvw_qp_info_t *remote, const kvw_config_t *cfg);
/* The address vector towards remote, with cfg's fabric settings. */
void kvw__qp_fill_ah(const kvw_dev_t *dev, uint32_t local_qpn, const kvw_qp_info_t *remote,
                     const kvw_config_t *cfg, struct ibv_ah_attr *ah_p);
/* Move to ERR: every outstanding WR completes with a flush error and the
 * peer can no longer write into our memory through this QP. */
void kvw__qp_set_error(kvw_qp_t *qp);
/* Back to INIT from any state, under a new PSN (qp->psn), for
 * kvw__qp_connect to connect it again: what a lane that failed does to
 * rejoin its connection. Every WR still on the QP is dropped without a
 * completion, so the caller must have reaped all of them first (a CQE
 * left over would describe a WR of the QP's previous life). */
kvw_status_t kvw__qp_reset(kvw_qp_t *qp);
/* Accepts NULL and half-built QPs. */
void kvw__qp_destroy(kvw_qp_t *qp);

#endif
