#include "engine/txq.h"

#include "common/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

kvw_status_t kvw__txq_init(kvw_txq_t *q, const kvw_verbs_ops_t *ops, struct ibv_qp *qp,
                           uint32_t depth, uint32_t chain_max, uint32_t signal_every)
{
    memset(q, 0, sizeof(*q));
    q->ops = ops;
    q->qp = qp;
    q->depth = depth;
    q->chain_max = chain_max;
    q->signal_every = signal_every;
    q->wrs = calloc(chain_max, sizeof(*q->wrs));
    q->sges = calloc(chain_max, sizeof(*q->sges));
    if (!q->wrs || !q->sges) {
        kvw__txq_fini(q);
        return KVW_ERR_NO_MEMORY;
    }
    /* Links and SGE pointers never change: set them once, not per WR. */
    for (uint32_t i = 0; i < chain_max; i++) {
        q->wrs[i].next = i + 1 < chain_max ? &q->wrs[i + 1] : NULL;
        q->wrs[i].sg_list = &q->sges[i];
    }
    return KVW_OK;
}

void kvw__txq_fini(kvw_txq_t *q)
{
    free(q->wrs);
    free(q->sges);
    q->wrs = NULL;
    q->sges = NULL;
}

uint32_t kvw__txq_room(const kvw_txq_t *q)
{
    if (q->post_failed || q->broken)
        return 0;
    uint64_t credits = q->depth - (q->posted + q->pending - q->completed);
    uint32_t chain_room = q->chain_max - q->pending;
    return credits < chain_room ? (uint32_t)credits : chain_room;
}

uint64_t kvw__txq_add(kvw_txq_t *q, const kvw_write_t *w, int with_imm, uint32_t imm)
{
    uint32_t i = q->pending++;
    uint64_t seq = q->posted + i;
    struct ibv_sge *sge = &q->sges[i];
    struct ibv_send_wr *wr = &q->wrs[i];
    sge->addr = w->local_addr;
    sge->length = w->len;
    sge->lkey = w->lkey;
    wr->wr_id = seq;
    wr->num_sge = w->len != 0; /* a zero-length write carries only the immediate */
    wr->opcode = IBV_WR_RDMA_WRITE;
    if (with_imm) {
        wr->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr->imm_data = htonl(imm);
    }
    wr->wr.rdma.remote_addr = w->remote_addr;
    wr->wr.rdma.rkey = w->rkey;
    wr->send_flags = 0;
    if (++q->since_signal >= q->signal_every) {
        wr->send_flags = IBV_SEND_SIGNALED;
        q->since_signal = 0;
    }
    return seq;
}

/* How many WRs of an n-WR chain ibv_post_send took before failing at bad. */
static uint32_t accepted_before(const kvw_txq_t *q, const struct ibv_send_wr *bad, uint32_t n)
{
    if (!bad || bad < q->wrs || bad >= q->wrs + n)
        return 0; /* no usable bad_wr: assume none was taken */
    return (uint32_t)(bad - q->wrs);
}

kvw_status_t kvw__txq_flush(kvw_txq_t *q)
{
    if (!q->pending)
        return KVW_OK;
    uint32_t n = q->pending;
    /* The chain's end is always signaled so nothing stays unretired. */
    q->wrs[n - 1].send_flags = IBV_SEND_SIGNALED;
    q->since_signal = 0;
    q->pending = 0;
    struct ibv_send_wr *bad = NULL, *after = q->wrs[n - 1].next;
    q->wrs[n - 1].next = NULL; /* end the chain here for this post */
    int rc = q->ops->post_send(q->qp, q->wrs, &bad);
    q->wrs[n - 1].next = after;
    uint32_t taken = n;
    if (rc) {
        taken = accepted_before(q, bad, n);
        q->post_failed = true;
        KVW_ERROR("ibv_post_send of a %u-WR chain failed at WR %u: %s", n, taken,
                  strerror(rc > 0 ? rc : errno));
    }
    q->posted += taken;
    q->chains += taken > 0;
    q->wrs_posted += taken;
    for (uint32_t i = 0; i < taken; i++)
        q->bytes_posted += q->sges[i].length;
    return rc ? KVW_ERR_VERBS : KVW_OK;
}

void kvw__txq_retire(kvw_txq_t *q, uint64_t seq)
{
    uint64_t done = seq + 1 < q->posted ? seq + 1 : q->posted; /* never past what was posted */
    if (q->broken || done <= q->completed)
        return;
    q->wrs_ok += done - q->completed;
    q->completed = done;
}

void kvw__txq_fail_at(kvw_txq_t *q, uint64_t seq)
{
    if (q->broken)
        return;
    uint64_t boundary = seq < q->completed ? q->completed : seq;
    if (boundary > q->posted)
        boundary = q->posted;
    q->wrs_ok += boundary - q->completed;
    q->wrs_flushed += q->posted - boundary;
    q->completed = boundary;
    q->broken = true;
}
