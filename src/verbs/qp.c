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

kvw_status_t kvw__qp_create(kvw_dev_t *dev, struct ibv_comp_channel *channel, void *cq_ctx,
                            uint32_t sq_depth, uint32_t rq_depth, bool remote_write,
                            kvw_qp_t **qp_p)
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
    struct ibv_qp_init_attr init = {
        .send_cq = q->cq,
        .recv_cq = q->cq,
        .qp_type = IBV_QPT_RC,
        .sq_sig_all = 0,
        .cap = {.max_send_wr = sq_depth,
                .max_recv_wr = rq_depth,
                .max_send_sge = 1,
                .max_recv_sge = 1},
    };
    q->qp = ops->create_qp(dev->pd, &init);
    if (!q->qp) {
        KVW_ERROR("%s: ibv_create_qp(sq %u, rq %u) failed: %s", dev->name, sq_depth, rq_depth,
                  strerror(errno));
        goto fail;
    }
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT,
        .pkey_index = 0,
        .port_num = dev->port,
        .qp_access_flags = remote_write ? IBV_ACCESS_REMOTE_WRITE : 0,
    };
    if (ops->modify_qp(q->qp, &a,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        KVW_ERROR("%s: QP %u to INIT failed: %s", dev->name, q->qp->qp_num, strerror(errno));
        goto fail;
    }
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

static kvw_status_t to_rtr(kvw_qp_t *q, const kvw_qp_info_t *r)
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
        .ah_attr = {.port_num = q->dev->port, .dlid = r->lid, .sl = 0},
    };
    /* RoCE needs a GRH (there are no LIDs); plain IB within a subnet does not. */
    if (q->dev->link_layer == IBV_LINK_LAYER_ETHERNET) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, r->gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)q->dev->gid_index;
        a.ah_attr.grh.hop_limit = 255;
    }
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (q->dev->ops->modify_qp(q->qp, &a, mask)) {
        KVW_ERROR("%s: QP %u to RTR (peer QPN %u) failed: %s", q->dev->name, q->qp->qp_num, r->qpn,
                  strerror(errno));
        return KVW_ERR_VERBS;
    }
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

kvw_status_t kvw__qp_connect(kvw_qp_t *qp, const kvw_qp_info_t *remote, const kvw_config_t *cfg)
{
    if (remote->link_layer != qp->dev->link_layer) {
        KVW_ERROR("%s: peer link layer %u differs from ours (%u)", qp->dev->name,
                  remote->link_layer, qp->dev->link_layer);
        return KVW_ERR_MISMATCH;
    }
    kvw_status_t st = to_rtr(qp, remote);
    return st ? st : to_rts(qp, cfg);
}

void kvw__qp_set_error(kvw_qp_t *qp)
{
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
    if (qp && qp->qp && qp->dev->ops->modify_qp(qp->qp, &a, IBV_QP_STATE))
        KVW_WARN("%s: QP %u to ERR failed: %s", qp->dev->name, qp->qp->qp_num, strerror(errno));
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
