/* SPDX-License-Identifier: Apache-2.0 */
/* Send-queue discipline for one RC QP: WRs are appended to a preallocated
 * chain and posted with one ibv_post_send (one doorbell); every Nth WR and
 * the last of each chain are signaled, wr_id carries the WR's sequence
 * number so one completion retires every earlier WR, and a credit count
 * keeps the send queue (and so the CQ) from overflowing. No allocation and
 * no lock after init: only the poller thread touches a txq.
 *
 * Per-WR cost is what this file is shaped by. The chain slots keep the
 * fields most writes share (RDMA WRITE, one SGE, unsignaled, linked) from
 * init on, so appending a write sets only what differs; a write that needs
 * more (an immediate, zero length) is noted and its slot put back after the
 * post. Signaled flags are set when the chain is posted, and the chain's
 * bytes come from the plan (kvw__txq_add_runs), not from a sum per WR. */
#ifndef KVW_ENGINE_TXQ_H
#define KVW_ENGINE_TXQ_H

#include "kvwire.h"
#include "plan/heads.h"
#include "plan/plan.h"
#include "verbs/ops.h"

#include <stdbool.h>

typedef struct kvw_txq {
    const kvw_verbs_ops_t *ops;
    struct ibv_qp *qp;
    uint32_t depth, chain_max, signal_every;
    /* Gather writes (head slicing), 0 until kvw__txq_enable_gather: then
     * sges holds chain_max more slots of max_sge entries each after the
     * chain's own, used by kvw__txq_add_gather only. (Here, in padding: a
     * larger txq costs the posting loop instructions.) */
    uint32_t max_sge;
    uint64_t posted;        /* sequence number of the next WR to post */
    uint64_t completed;     /* every WR with a smaller sequence number has landed */
    bool post_failed;       /* a post failed: the QP is being failed, post nothing more */
    bool broken;            /* an error completion: WRs from `completed` on were flushed */
    uint32_t pending;       /* WRs built into the current chain, not yet posted */
    uint64_t pending_bytes; /* their bytes */
    struct ibv_send_wr *wrs;
    struct ibv_sge *sges;
    uint32_t *special, nspecial; /* chain slots kvw__txq_add changed from the shared form */
    uint64_t chains, wrs_posted, bytes_posted;
    uint64_t wrs_ok, wrs_flushed; /* posted WRs known landed / known not landed */
} kvw_txq_t;

kvw_status_t kvw__txq_init(kvw_txq_t *q, const kvw_verbs_ops_t *ops, struct ibv_qp *qp,
                           uint32_t depth, uint32_t chain_max, uint32_t signal_every);
void kvw__txq_fini(kvw_txq_t *q);

/* How many more WRs may be added before a flush (credits and chain room);
 * 0 for good once a post failed or an error completion arrived. */
static inline uint32_t kvw__txq_room(const kvw_txq_t *q)
{
    if (q->post_failed || q->broken)
        return 0;
    uint64_t credits = q->depth - (q->posted + q->pending - q->completed);
    uint32_t chain_room = q->chain_max - q->pending;
    return credits < chain_room ? (uint32_t)credits : chain_room;
}
/* Append one write (room must be > 0); with_imm makes it an RDMA WRITE with
 * immediate (imm in host order). Returns the WR's sequence number. */
uint64_t kvw__txq_add(kvw_txq_t *q, const kvw_write_t *w, int with_imm, uint32_t imm);
/* Let this txq post writes of up to max_sge entries (at most
 * KVW_HEADS_MAX_SGE, and what the QP was created with). */
kvw_status_t kvw__txq_enable_gather(kvw_txq_t *q, uint32_t max_sge);
/* Append one gather write (room must be > 0, w->num_sge <= q->max_sge, and
 * kvw__txq_enable_gather called): w's entries with lkey, gathered into
 * w->remote_addr with rkey; with_imm as kvw__txq_add. Returns the WR's
 * sequence number. */
uint64_t kvw__txq_add_gather(kvw_txq_t *q, const kvw_gwrite_t *w, uint32_t lkey, uint32_t rkey,
                             int with_imm, uint32_t imm);
/* Append n plain writes (room must be >= n, n > 0): runs r[0, n) of region
 * g, each one write (kvw__plan_span). Only the fields that differ between
 * writes are set. Returns their bytes; the last one's sequence number is
 * q->posted + q->pending - 1. Inline: this loop is the posting hot path. */
static inline uint64_t kvw__txq_add_runs(kvw_txq_t *q, const kvw_plan_region_t *g,
                                         const kvw_wrun_t *r, uint32_t n)
{
    uint32_t first = q->pending;
    struct ibv_send_wr *wr = q->wrs + first;
    struct ibv_sge *sge = q->sges + first;
    uint64_t seq = q->posted + first, laddr = g->local_addr, raddr = g->remote_addr;
    uint32_t lkey = g->lkey, rkey = g->rkey;
    for (uint32_t i = 0; i < n; i++) {
        sge[i].addr = laddr + r[i].src_off;
        sge[i].length = (uint32_t)r[i].len;
        sge[i].lkey = lkey;
        wr[i].wr_id = seq + i;
        wr[i].wr.rdma.remote_addr = raddr + r[i].dst_off;
        wr[i].wr.rdma.rkey = rkey;
    }
    uint64_t bytes = r[n - 1].before + r[n - 1].len - r[0].before;
    q->pending = first + n;
    q->pending_bytes += bytes;
    return bytes;
}
/* Post the pending chain, its last WR signaled. KVW_ERR_VERBS if the post
 * failed: the WRs before ibv_post_send's bad_wr were posted and count as
 * outstanding (they will complete); the rest are dropped, their sequence
 * numbers are never used, and the txq posts nothing more: the caller must
 * fail the QP. */
kvw_status_t kvw__txq_flush(kvw_txq_t *q);
/* A signaled WR with sequence number seq completed successfully: it and
 * every earlier WR landed (RC completes in order). */
void kvw__txq_retire(kvw_txq_t *q, uint64_t seq);
/* WR seq completed with an error (or was flushed). The first such report
 * fixes the outcome of every WR: those before seq landed, seq and all later
 * ones did not. Later reports change nothing. */
void kvw__txq_fail_at(kvw_txq_t *q, uint64_t seq);
/* The QP, failed, was reset and connected again (a lane rejoining): the
 * txq takes writes again. Every WR of its old life must have completed;
 * a chain built but not posted is dropped. Sequence numbers and totals go
 * on from where they were. */
void kvw__txq_rearm(kvw_txq_t *q);
/* WRs posted and not yet known complete. */
static inline uint64_t kvw__txq_outstanding(const kvw_txq_t *q)
{
    return q->broken ? 0 : q->posted - q->completed;
}

#endif
