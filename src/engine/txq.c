/* SPDX-License-Identifier: Apache-2.0 */
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
    q->special = calloc(chain_max, sizeof(*q->special));
    if (!q->wrs || !q->sges || !q->special) {
        kvw__txq_fini(q);
        return KVW_ERR_NO_MEMORY;
    }
    /* Links, SGE pointers and the shared form never change (a slot that
     * leaves the form is put back after its post): set once, not per WR. */
    for (uint32_t i = 0; i < chain_max; i++) {
        q->wrs[i].next = i + 1 < chain_max ? &q->wrs[i + 1] : NULL;
        q->wrs[i].sg_list = &q->sges[i];
        q->wrs[i].num_sge = 1;
        q->wrs[i].opcode = IBV_WR_RDMA_WRITE;
    }
    return KVW_OK;
}

void kvw__txq_fini(kvw_txq_t *q)
{
    free(q->wrs);
    free(q->sges);
    free(q->special);
    q->wrs = NULL;
    q->sges = NULL;
    q->special = NULL;
}

kvw_status_t kvw__txq_enable_gather(kvw_txq_t *q, uint32_t max_sge)
{
    if (!max_sge || max_sge > KVW_HEADS_MAX_SGE)
        return KVW_ERR_INVALID;
    if (q->max_sge)
        return max_sge <= q->max_sge ? KVW_OK : KVW_ERR_INVALID;
    if (q->pending)
        return KVW_ERR_STATE; /* the chain's slots point into sges */
    struct ibv_sge *sges = calloc((size_t)q->chain_max * (1 + max_sge), sizeof(*sges));
    if (!sges)
        return KVW_ERR_NO_MEMORY;
    free(q->sges);
    q->sges = sges;
    for (uint32_t i = 0; i < q->chain_max; i++)
        q->wrs[i].sg_list = &q->sges[i];
    q->max_sge = max_sge;
    return KVW_OK;
}

uint64_t kvw__txq_add_gather(kvw_txq_t *q, const kvw_gwrite_t *w, uint32_t lkey, uint32_t rkey,
                             int with_imm, uint32_t imm)
{
    uint32_t i = q->pending++;
    uint64_t seq = q->posted + i;
    struct ibv_sge *sge = q->sges + q->chain_max + (size_t)i * q->max_sge;
    struct ibv_send_wr *wr = &q->wrs[i];
    for (uint32_t k = 0; k < w->num_sge; k++)
        sge[k] = (struct ibv_sge){.addr = w->sge[k].addr, .length = w->sge[k].len, .lkey = lkey};
    wr->sg_list = sge;
    wr->num_sge = (int)w->num_sge;
    wr->wr_id = seq;
    wr->wr.rdma.remote_addr = w->remote_addr;
    wr->wr.rdma.rkey = rkey;
    if (with_imm) {
        wr->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr->imm_data = htonl(imm);
    }
    q->pending_bytes += w->len;
    q->special[q->nspecial++] = i;
    return seq;
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
    wr->wr.rdma.remote_addr = w->remote_addr;
    wr->wr.rdma.rkey = w->rkey;
    q->pending_bytes += w->len;
    if (with_imm || !w->len) {
        wr->num_sge = w->len != 0; /* a zero-length write carries only the immediate */
        if (with_imm) {
            wr->opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
            wr->imm_data = htonl(imm);
        }
        q->special[q->nspecial++] = i;
    }
    return seq;
}

/* Every Nth WR of the chain and its last one get `flags`: set before the
 * post, cleared after it (slots are unsignaled between posts). */
static void set_signaled(kvw_txq_t *q, uint32_t n, unsigned flags)
{
    uint32_t every = q->signal_every ? q->signal_every : 1;
    for (uint32_t i = every - 1; i < n - 1; i += every)
        q->wrs[i].send_flags = flags;
    q->wrs[n - 1].send_flags = flags;
}

/* Put the slots kvw__txq_add changed back into the shared form. */
static void restore_special(kvw_txq_t *q)
{
    for (uint32_t k = 0; k < q->nspecial; k++) {
        q->wrs[q->special[k]].num_sge = 1;
        q->wrs[q->special[k]].sg_list = &q->sges[q->special[k]];
        q->wrs[q->special[k]].opcode = IBV_WR_RDMA_WRITE;
    }
    q->nspecial = 0;
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
    uint64_t bytes = q->pending_bytes;
    /* The chain's end is always signaled so nothing stays unretired. */
    set_signaled(q, n, IBV_SEND_SIGNALED);
    q->pending = 0;
    q->pending_bytes = 0;
    struct ibv_send_wr *bad = NULL, *after = q->wrs[n - 1].next;
    q->wrs[n - 1].next = NULL; /* end the chain here for this post */
    int rc = q->ops->post_send(q->qp, q->wrs, &bad);
    q->wrs[n - 1].next = after;
    set_signaled(q, n, 0);
    uint32_t taken = n;
    if (rc) {
        taken = accepted_before(q, bad, n);
        q->post_failed = true;
        KVW_ERROR("ibv_post_send of a %u-WR chain failed at WR %u: %s", n, taken,
                  strerror(rc > 0 ? rc : errno));
        bytes = 0; /* only what was taken counts as posted (every entry of a gather) */
        for (uint32_t i = 0; i < taken; i++)
            for (int k = 0; k < q->wrs[i].num_sge; k++)
                bytes += q->wrs[i].sg_list[k].length;
    }
    restore_special(q);
    q->posted += taken;
    q->chains += taken > 0;
    q->wrs_posted += taken;
    q->bytes_posted += bytes;
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

void kvw__txq_rearm(kvw_txq_t *q)
{
    restore_special(q); /* a chain built when the QP failed is never posted */
    q->pending = 0;
    q->pending_bytes = 0;
    q->completed = q->posted;
    q->broken = false;
    q->post_failed = false;
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
