/* SPDX-License-Identifier: Apache-2.0 */
#include "verbs/qp.h"

#include "common/log.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

static uint32_t random_psn(void)
{
    uint32_t v = 0;
    if (getrandom(&v, sizeof(v), 0) != sizeof(v))
        v = (uint32_t)rand();
    return v & 0xffffff;
}

static kvw_status_t to_init(kvw_qp_t *q)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT,
        .pkey_index = 0,
        .port_num = q->dev->port,
        .qp_access_flags = q->remote_write ? IBV_ACCESS_REMOTE_WRITE : 0,
    };
    if (q->dev->ops->modify_qp(
            q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        KVW_ERROR("%s: QP %u to INIT failed: %s", q->dev->name, q->qp->qp_num, strerror(errno));
        return KVW_ERR_VERBS;
    }
    return KVW_OK;
}

kvw_status_t kvw__qp_create(kvw_dev_t *dev, struct ibv_comp_channel *channel, void *cq_ctx,
                            uint32_t sq_depth, uint32_t rq_depth, bool remote_write,
                            kvw_qp_t **qp_p)
{
    return kvw__qp_create_sge(dev, channel, cq_ctx, sq_depth, rq_depth, 1, remote_write, qp_p);
}

kvw_status_t kvw__qp_create_sge(kvw_dev_t *dev, struct ibv_comp_channel *channel, void *cq_ctx,
                                uint32_t sq_depth, uint32_t rq_depth, uint32_t max_send_sge,
                                bool remote_write, kvw_qp_t **qp_p)
{
    const kvw_verbs_ops_t *ops = dev->ops;
    kvw_qp_t *q = calloc(1, sizeof(*q));
    if (!q)
        return KVW_ERR_NO_MEMORY;
    q->dev = dev;
    q->sq_depth = sq_depth;
    q->rq_depth = rq_depth;
    q->psn = random_psn();
    /* Every WR can produce a CQE when the QP flushes, signaled or not. */
    q->cq = ops->create_cq(dev->ctx, (int)(sq_depth + rq_depth), cq_ctx, channel, 0);
    if (!q->cq) {
        KVW_ERROR("%s: ibv_create_cq(%u) failed: %s", dev->name, sq_depth + rq_depth,
                  strerror(errno));
        goto fail;
    }
    if (max_send_sge > (uint32_t)dev->max_sge)
        max_send_sge = (uint32_t)dev->max_sge;
    struct ibv_qp_init_attr init = {
        .send_cq = q->cq,
        .recv_cq = q->cq,
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
        .cap = {.max_send_wr = sq_depth,
                .max_recv_wr = rq_depth,
                .max_send_sge = max_send_sge ? max_send_sge : 1,
                .max_recv_sge = 1},
    };
    q->max_send_sge = init.cap.max_send_sge;
    q->qp = ops->create_qp(dev->pd, &init);
    if (!q->qp) {
        KVW_ERROR("%s: ibv_create_qp(sq %u, rq %u, %u entries a WR) failed: %s", dev->name,
                  sq_depth, rq_depth, q->max_send_sge, strerror(errno));
        goto fail;
    }
    /* The provider may round the entries up: it says so in init.cap. */
    if (init.cap.max_send_sge > q->max_send_sge)
        q->max_send_sge = init.cap.max_send_sge;
    q->remote_write = remote_write;
    if (to_init(q))
        goto fail;
    *qp_p = q;
    return KVW_OK;
fail:
    kvw__qp_destroy(q);
    return KVW_ERR_VERBS;
}

void kvw__qp_local_info(const kvw_qp_t *qp, kvw_qp_info_t *info_p)
{
    memset(info_p, 0, sizeof(*info_p));
    info_p->qpn = qp->qp->qp_num;
    info_p->psn = qp->psn;
    info_p->lid = qp->dev->lid;
    info_p->mtu = (uint8_t)qp->dev->active_mtu;
    info_p->link_layer = qp->dev->link_layer;
    memcpy(info_p->gid, qp->dev->gid.raw, 16);
}

uint32_t kvw__flow_label(uint32_t local_qpn, uint32_t remote_qpn)
{
    /* Linux's rdma_calc_flow_label(): a product is symmetric, so both ends
     * of a connection derive the same label, and folding spreads the high
     * bits of the product over the 20 the GRH carries. */
    uint64_t v = (uint64_t)(local_qpn & KVW_QPN_MASK) * (remote_qpn & KVW_QPN_MASK);
    v ^= v >> 20;
    v ^= v >> 40;
    return (uint32_t)(v & KVW_FLOW_LABEL_MASK);
}

/* RoCE has no LIDs: always a GRH. InfiniBand routes by LID inside a subnet;
 * a GRH is needed to cross subnets (the GID's upper 64 bits are the subnet
 * prefix), and an explicit gid_index says the operator wants that GID used. */
bool kvw__qp_wants_grh(const kvw_dev_t *dev, const kvw_qp_info_t *remote, const kvw_config_t *cfg)
{
    if (dev->link_layer == IBV_LINK_LAYER_ETHERNET)
        return true;
    if (cfg->ib_use_grh >= 0)
        return cfg->ib_use_grh == 1;
    return cfg->gid_index >= 0 || memcmp(dev->gid.raw, remote->gid, 8) != 0;
}

void kvw__qp_fill_ah(const kvw_dev_t *dev, uint32_t local_qpn, const kvw_qp_info_t *remote,
                     const kvw_config_t *cfg, struct ibv_ah_attr *ah_p)
{
    memset(ah_p, 0, sizeof(*ah_p));
    ah_p->port_num = dev->port;
    ah_p->dlid = remote->lid;
    ah_p->sl = cfg->service_level & 0xf; /* 4 bits on the wire */
    if (!kvw__qp_wants_grh(dev, remote, cfg))
        return;
    ah_p->is_global = 1;
    memcpy(ah_p->grh.dgid.raw, remote->gid, 16);
    ah_p->grh.sgid_index = (uint8_t)dev->gid_index;
    ah_p->grh.hop_limit = cfg->hop_limit;
    ah_p->grh.traffic_class = cfg->traffic_class;
    ah_p->grh.flow_label = cfg->flow_label < 0 ? kvw__flow_label(local_qpn, remote->qpn)
                                               : (uint32_t)cfg->flow_label & KVW_FLOW_LABEL_MASK;
}

static kvw_status_t to_rtr(kvw_qp_t *q, const kvw_qp_info_t *r, const kvw_config_t *cfg)
{
    enum ibv_mtu mtu =
        q->dev->active_mtu < (enum ibv_mtu)r->mtu ? q->dev->active_mtu : (enum ibv_mtu)r->mtu;
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTR,
        .path_mtu = mtu,
        .dest_qp_num = r->qpn,
        .rq_psn = r->psn,
        .max_dest_rd_atomic = 1,
        .min_rnr_timer = 12,
    };
    kvw__qp_fill_ah(q->dev, q->qp->qp_num, r, cfg, &a.ah_attr);
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (q->dev->ops->modify_qp(q->qp, &a, mask)) {
        KVW_ERROR("%s: QP %u to RTR (peer QPN %u) failed: %s", q->dev->name, q->qp->qp_num, r->qpn,
                  strerror(errno));
        return KVW_ERR_VERBS;
    }
    q->path_mtu = mtu;
    q->ah = a.ah_attr;
    return KVW_OK;
}

static kvw_status_t to_rts(kvw_qp_t *q, const kvw_config_t *cfg)
{
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_RTS,
        .sq_psn = q->psn,
        .max_rd_atomic = 1,
        .timeout = cfg->qp_timeout,
        .retry_cnt = cfg->qp_retry_cnt,
        .rnr_retry = cfg->qp_rnr_retry,
    };
    int mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_TIMEOUT |
               IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY;
    if (q->dev->ops->modify_qp(q->qp, &a, mask)) {
        KVW_ERROR("%s: QP %u to RTS failed: %s", q->dev->name, q->qp->qp_num, strerror(errno));
        return KVW_ERR_VERBS;
    }
    return KVW_OK;
}

/* Once per QP, so an operator can check what the fabric was asked for. */
static void log_bring_up(const kvw_qp_t *q, const kvw_qp_info_t *r, const kvw_config_t *cfg)
{
    const struct ibv_ah_attr *ah = &q->ah;
    char grh[128] = "grh off";
    char lid[40] = "";
    if (ah->is_global)
        snprintf(grh, sizeof(grh), "tclass %u, flow_label 0x%05x%s, hop_limit %u, grh on",
                 ah->grh.traffic_class, ah->grh.flow_label, cfg->flow_label < 0 ? " (derived)" : "",
                 ah->grh.hop_limit);
    if (q->dev->link_layer == IBV_LINK_LAYER_INFINIBAND)
        snprintf(lid, sizeof(lid), ", lid %u -> %u", q->dev->lid, ah->dlid);
    KVW_INFO("%s: QP %u -> peer QP %u up: mtu %d, gid_index %d, sl %u, %s%s", q->dev->name,
             q->qp->qp_num, r->qpn, 128 << q->path_mtu, q->dev->gid_index, ah->sl, grh, lid);
}

kvw_status_t kvw__qp_connect(kvw_qp_t *qp, const kvw_qp_info_t *remote, const kvw_config_t *cfg)
{
    if (remote->link_layer != qp->dev->link_layer) {
        KVW_ERROR("%s: peer link layer %u differs from ours (%u)", qp->dev->name,
                  remote->link_layer, qp->dev->link_layer);
        return KVW_ERR_MISMATCH;
    }
    if (qp->dev->link_layer == IBV_LINK_LAYER_INFINIBAND &&
        !kvw__qp_wants_grh(qp->dev, remote, cfg) && memcmp(qp->dev->gid.raw, remote->gid, 8) != 0)
        KVW_WARN("%s: QP %u: peer GID is in another subnet but ib_use_grh=0 (KVW_IB_USE_GRH): "
                 "LID routing will not reach it",
                 qp->dev->name, qp->qp->qp_num);
    kvw_status_t st = to_rtr(qp, remote, cfg);
    if (!st)
        st = to_rts(qp, cfg);
    if (!st)
        log_bring_up(qp, remote, cfg);
    return st;
}

void kvw__qp_set_error(kvw_qp_t *qp)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    if (qp && qp->qp && qp->dev->ops->modify_qp(qp->qp, &a, IBV_QP_STATE))
        KVW_WARN("%s: QP %u to ERR failed: %s", qp->dev->name, qp->qp->qp_num, strerror(errno));
}

kvw_status_t kvw__qp_reset(kvw_qp_t *qp)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RESET};
    if (qp->dev->ops->modify_qp(qp->qp, &a, IBV_QP_STATE)) {
        KVW_ERROR("%s: QP %u to RESET failed: %s", qp->dev->name, qp->qp->qp_num, strerror(errno));
        return KVW_ERR_VERBS;
    }
    /* A new PSN: a packet of the QP's previous life still in the fabric
     * is then out of sequence for the new one. */
    qp->psn = random_psn();
    return to_init(qp);
}

void kvw__qp_destroy(kvw_qp_t *qp)
{
    if (!qp)
        return;
    if (qp->qp)
        qp->dev->ops->destroy_qp(qp->qp);
    if (qp->cq)
        qp->dev->ops->destroy_cq(qp->cq);
    free(qp);
}
