/* The completion-queue poller: one thread per engine. It moves ready
 * requests onto their peer's send queue in doorbell-batched chains, retires
 * completions, and drives request states. When idle it spins briefly, then
 * sleeps on the completion channel so an idle engine burns no core. */
#include "engine/poller.h"
#include "engine/stager.h"

#include "common/log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <unistd.h>

enum { WC_BATCH = 32, IDLE_SLEEP_MS = 1000 };

static void queue_push(kvw_req_t **head, kvw_req_t **tail, kvw_req_t *r)
{
    r->qnext = NULL;
    if (*tail)
        (*tail)->qnext = r;
    else
        *head = r;
    *tail = r;
}

static kvw_req_t *queue_pop(kvw_req_t **head, kvw_req_t **tail)
{
    kvw_req_t *r = *head;
    if (r) {
        *head = r->qnext;
        if (!*head)
            *tail = NULL;
        r->qnext = NULL;
    }
    return r;
}

static void release(kvw_req_t *r);

/* Requests whose both page lists are known, handed over by other threads.
 * Under the lock: a kill detaches requests from their peer, and a dead
 * peer's queues must not grow once the poller has let go of them. */
static int drain_ready(kvw_engine_t *e)
{
    if (!atomic_exchange(&e->ready_pending, false))
        return 0;
    kvw_req_t *orphaned = NULL;
    int n = 0;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = e->ready_head;
    e->ready_head = e->ready_tail = NULL;
    while (r) {
        kvw_req_t *next = r->qnext;
        kvw_peer_t *p = r->peer;
        if (p && atomic_load(&p->state) != PEER_DEAD) {
            queue_push(&p->active_head, &p->active_tail, r);
        } else { /* its connection died before it was posted */
            r->qnext = orphaned;
            orphaned = r;
        }
        r = next;
        n++;
    }
    pthread_mutex_unlock(&e->lock);
    while ((r = orphaned)) {
        orphaned = r->qnext;
        release(r);
    }
    return n;
}

/* r leaves the poller with no write in flight: it was never posted, or all
 * its posted writes completed, or its connection died (QP in ERR). Once
 * per request, not per write: a failed (or aborted after it succeeded)
 * sender may now tell decode. */
static void release(kvw_req_t *r)
{
    kvw__req_drained(r);
    kvw__req_unref(r);
}

/* Completion accounting: WRs known landed or known lost since the last call. */
static void publish_outcomes(kvw_engine_t *e, kvw_txq_t *q)
{
    atomic_fetch_add_explicit(&e->counters.wrs_completed, q->wrs_ok, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.wrs_flushed, q->wrs_flushed, memory_order_relaxed);
    q->wrs_ok = q->wrs_flushed = 0;
}

/* A dead peer's requests were already failed by kvw__peer_kill(); the
 * poller only lets go of them. WRs not known to have completed never will
 * land: their QP is in ERR. */
static void drop_queues(kvw_engine_t *e, kvw_peer_t *p)
{
    kvw_req_t *r;
    while ((r = queue_pop(&p->active_head, &p->active_tail)))
        release(r);
    while ((r = queue_pop(&p->inflight_head, &p->inflight_tail)))
        release(r);
    if (p->txq_ready) {
        kvw__txq_fail_at(&p->txq, p->txq.completed); /* no-op once broken */
        publish_outcomes(e, &p->txq);
    }
    if (p->chunk_head) /* the QP is in ERR: the NIC reads no chunk any more */
        kvw__stager_chunks_completed(p, true);
}

static void publish_counters(kvw_engine_t *e, kvw_txq_t *q, const kvw_txq_t *before)
{
    atomic_fetch_add_explicit(&e->counters.chains, q->chains - before->chains,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.wrs, q->wrs_posted - before->wrs_posted,
                              memory_order_relaxed);
    atomic_fetch_add_explicit(&e->counters.bytes, q->bytes_posted - before->bytes_posted,
                              memory_order_relaxed);
}

static uint64_t seg_total(const kvw_seg_t *s)
{
    /* A final part with nothing to copy: one zero-length write carries the
     * immediate. */
    return s->final && !s->writes_total ? 1 : s->writes_total;
}

static int next_write(kvw_seg_t *s, kvw_write_t *w)
{
    if (s->writes_total)
        return kvw__plan_next(&s->plan, &s->cursor, w);
    *w = (kvw_write_t){.remote_addr = s->plan.regions[0].remote_addr,
                       .rkey = s->plan.regions[0].rkey};
    return 1;
}

/* The part to post from: the current one, or the next planned one once the
 * current is done (the owner appends with a release store). */
static kvw_seg_t *current_seg(kvw_req_t *r)
{
    kvw_seg_t *s = r->seg;
    while (s->writes_built == seg_total(s) && !s->final) {
        kvw_seg_t *next = atomic_load_explicit(&s->next, memory_order_acquire);
        if (!next)
            break;
        s = r->seg = next;
    }
    return s;
}

static bool fully_built(const kvw_req_t *r)
{
    return r->seg->final && r->seg->writes_built == seg_total(r->seg);
}

/* The request's last write carries the immediate and consumes one receive
 * decode posted; without a credit it waits (the connection, not a request,
 * is out of receives). */
static bool imm_credit(kvw_peer_t *p)
{
    if (p->imm_posted < atomic_load_explicit(&p->imm_limit, memory_order_acquire))
        return true;
    p->credit_blocked = true;
    return false;
}

/* Plain writes of s that can go in as a span of whole runs (at most room,
 * never the part's last write when it carries the immediate): appended
 * straight from the precomputed byte runs. Returns how many (0: none, take
 * the next write one at a time). */
static uint32_t build_span(kvw_txq_t *q, kvw_seg_t *s, uint32_t room, uint64_t *bytes)
{
    uint64_t plain = seg_total(s) - s->writes_built - (s->final ? 1 : 0);
    const kvw_plan_region_t *g;
    const kvw_wrun_t *runs;
    uint32_t n =
        kvw__plan_span(&s->plan, &s->cursor, plain < room ? (uint32_t)plain : room, &g, &runs);
    if (!n)
        return 0;
    *bytes += kvw__txq_add_runs(q, g, runs, n);
    kvw__plan_skip(&s->plan, &s->cursor, n);
    s->writes_built += n;
    return n;
}

/* A staged slice whose writes are all built: its chunk is free again once
 * they completed. */
static void seg_posted(kvw_peer_t *p, kvw_req_t *r, kvw_seg_t *s)
{
    if (s->chunk && s->writes_built == seg_total(s))
        kvw__stager_chunk_posted(p, s, r->last_seq);
}

/* Build r's next writes into the open chain; returns how many. */
static uint32_t build_writes(kvw_peer_t *p, kvw_req_t *r, uint32_t room)
{
    kvw_txq_t *q = &p->txq;
    uint32_t built = 0;
    uint64_t bytes = 0;
    kvw_write_t w;
    if (!r->writes_built && room)
        atomic_store_explicit(&r->first_post_ns, kvw__now_ns(), memory_order_relaxed);
    kvw_seg_t *s = current_seg(r);
    while (built < room) {
        uint64_t total = seg_total(s);
        if (s->writes_built == total) {
            kvw_seg_t *next = current_seg(r);
            if (s->final || next == s)
                break; /* done, or the next part is not here yet */
            s = next;
            continue;
        }
        uint32_t n = build_span(q, s, room - built, &bytes);
        if (n) {
            built += n;
            r->last_seq = q->posted + q->pending - 1;
            seg_posted(p, r, s);
            continue;
        }
        int last = s->final && s->writes_built + 1 == total;
        if (last && !imm_credit(p))
            break;
        if (!next_write(s, &w))
            break;
        r->last_seq = kvw__txq_add(q, &w, last, r->token);
        p->imm_posted += (uint64_t)last;
        s->writes_built++;
        bytes += w.len;
        built++;
        seg_posted(p, r, s);
    }
    r->writes_built += built;
    atomic_fetch_add_explicit(&r->bytes_posted, bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(&r->writes_posted, built, memory_order_relaxed);
    return built;
}

/* Every part r (the head of p's active queue) has was posted and more will
 * come: park it (it keeps the poller's reference; the next part, a failure
 * or a dead connection hands it back). It stays if a part arrived meanwhile. */
static void starve(kvw_engine_t *e, kvw_peer_t *p, kvw_req_t *r)
{
    pthread_mutex_lock(&e->lock);
    /* Off the active queue before the lock is released: once it is marked
     * starved, another thread may hand it back (through qnext) at once. */
    if (kvw__sender_starve_locked(r))
        queue_pop(&p->active_head, &p->active_tail);
    pthread_mutex_unlock(&e->lock);
}

/* Stop feeding a request that failed meanwhile (aborted, destroyed): what
 * it already posted stays in flight and is retired in order. */
static void drop_failed_active(kvw_peer_t *p, kvw_req_t *r)
{
    queue_pop(&p->active_head, &p->active_tail);
    if (r->writes_built)
        queue_push(&p->inflight_head, &p->inflight_tail, r);
    else
        release(r);
}

static int post_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    if (!p->active_head)
        return 0;
    if (!p->txq_ready) {
        if (kvw__txq_init(&p->txq, e->dev->ops, p->qp->qp, e->cfg.sq_depth, e->cfg.chain_max,
                          e->cfg.signal_every)) {
            kvw__peer_kill(p, KVW_ERR_NO_MEMORY, "no memory for the send queue");
            return 0;
        }
        p->txq_ready = true;
    }
    kvw_txq_t *q = &p->txq, before = *q;
    kvw_status_t st = KVW_OK;
    int work = 0;
    kvw_req_t *r;
    p->credit_blocked = false;
    while (!st && !p->credit_blocked && (r = p->active_head)) {
        uint32_t room = kvw__txq_room(q);
        if (!room) {
            if (!q->pending)
                break; /* out of send-queue credits: wait for completions */
            st = kvw__txq_flush(q);
            continue;
        }
        if (atomic_load(&r->state) != KVW_POLL_TRANSFERRING) {
            drop_failed_active(p, r);
            continue;
        }
        if (!r->seg)
            r->seg = r->segs_head; /* set before it was handed over */
        uint32_t n = build_writes(p, r, room);
        work += (int)n;
        if (fully_built(r)) {
            queue_pop(&p->active_head, &p->active_tail);
            queue_push(&p->inflight_head, &p->inflight_tail, r);
        } else if (n < room && !p->credit_blocked &&
                   current_seg(r)->writes_built == seg_total(current_seg(r))) {
            starve(e, p, r); /* waits for its next part */
        }
    }
    if (!st)
        st = kvw__txq_flush(q);
    publish_counters(e, q, &before);
    if (st) {
        /* Nothing more may be posted on this QP: a later chain would put an
         * immediate on the wire after a hole in the request's writes. */
        atomic_fetch_add(&e->counters.errors, 1);
        kvw__peer_kill(p, KVW_ERR_VERBS, "posting to the send queue failed");
    }
    return work;
}

static void retire_inflight(kvw_peer_t *p)
{
    kvw_req_t *r;
    while ((r = p->inflight_head) && r->last_seq < p->txq.completed) {
        queue_pop(&p->inflight_head, &p->inflight_tail);
        atomic_store_explicit(&r->done_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_succeed(r); /* unless it failed meanwhile */
        release(r);
    }
}

static uint64_t room_of_seq(const kvw_peer_t *p, uint64_t seq)
{
    for (const kvw_req_t *r = p->inflight_head; r; r = r->qnext)
        if (r->last_seq >= seq)
            return r->room;
    return p->active_head ? p->active_head->room : UINT64_MAX;
}

/* RC completes in order: everything posted before the failing WR landed.
 * Retire those requests as Success first, then fail the connection. */
static void on_send_error(kvw_engine_t *e, kvw_peer_t *p, const struct ibv_wc *wc)
{
    bool first = !p->txq.broken;
    kvw__txq_fail_at(&p->txq, wc->wr_id);
    retire_inflight(p);
    if (first && atomic_load(&p->state) != PEER_DEAD)
        kvw__peer_kill(p, KVW_ERR_TRANSFER,
                       "RDMA write (room %llu) completed with %s (vendor error 0x%x)",
                       (unsigned long long)room_of_seq(p, wc->wr_id), ibv_wc_status_str(wc->status),
                       wc->vendor_err);
    (void)e;
}

static void on_error_completion(kvw_engine_t *e, kvw_peer_t *p, const struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_WR_FLUSH_ERR || atomic_load(&p->state) != PEER_DEAD)
        atomic_fetch_add(&e->counters.errors, 1); /* flushes after a kill are expected */
    if (e->role == KVW_ROLE_PREFILL)
        on_send_error(e, p, wc);
    else if (atomic_load(&p->state) != PEER_DEAD)
        kvw__peer_kill(p, KVW_ERR_TRANSFER, "receive completed with %s (vendor error 0x%x)",
                       ibv_wc_status_str(wc->status), wc->vendor_err);
}

static void repost_receive(kvw_engine_t *e, kvw_peer_t *p, uint64_t index)
{
    struct ibv_recv_wr *bad, *wr = &p->rwrs[index];
    wr->next = NULL;
    if (e->dev->ops->post_recv(p->qp->qp, wr, &bad)) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "re-posting a receive failed: %s", strerror(errno));
        return;
    }
    /* Credits go back to prefill in batches (CREDIT, sent by the control
     * thread), so a busy connection costs one message per quarter queue. */
    uint64_t posted = atomic_fetch_add(&p->recvs_posted, 1) + 1;
    if (posted - atomic_load(&p->credits_sent) >= (e->cfg.rq_depth + 3) / 4)
        kvw__wake(e->control_wake_fd);
}

static void on_immediate(kvw_engine_t *e, kvw_peer_t *p, const struct ibv_wc *wc)
{
    uint32_t token = ntohl(wc->imm_data);
    /* GPU regions on GPUs that do not order the NIC's writes for their own
     * kernels: make every landed byte visible before saying Success (a CUDA
     * call, so before the lock). */
    kvw_status_t flushed =
        kvw__mem_needs_flush(&e->mem) ? kvw__mem_flush_gpu_writes(&e->mem) : KVW_OK;
    pthread_mutex_lock(&e->lock);
    kvw_req_t *r = kvw__token_lookup_locked(e, token);
    bool staged = r && r->slots && kvw__stager_on(e);
    if (r && r->peer == p && flushed)
        kvw__req_fail(r, KVW_ERR_TRANSFER, "the data landed but flushing GPU writes failed");
    else if (r && r->peer == p && r->aborting)
        /* The last write landed, so nothing more can: the abort is done. */
        kvw__req_fail(r, r->abort_status, "%s", r->abort_reason);
    else if (r && r->peer == p && staged) {
        /* In the staging pool: Success once copied to the GPU. */
        atomic_store_explicit(&r->landed_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__stager_landed_locked(r);
    } else if (r && r->peer == p && kvw__req_succeed(r)) {
        atomic_store_explicit(&r->landed_ns, kvw__now_ns(), memory_order_relaxed);
        kvw__req_set_deadline_locked(r, 0); /* its transfer limit no longer applies */
    } else
        KVW_INFO("immediate for unknown request token 0x%x (destroyed receiver?)", token);
    pthread_mutex_unlock(&e->lock);
    /* Give the receive back at once so the peer never meets an empty queue. */
    if (wc->wr_id < e->cfg.rq_depth)
        repost_receive(e, p, wc->wr_id);
}

static int poll_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    struct ibv_wc wc[WC_BATCH];
    int n = e->dev->ops->poll_cq(p->qp->cq, WC_BATCH, wc);
    if (n < 0) {
        kvw__peer_kill(p, KVW_ERR_VERBS, "ibv_poll_cq failed");
        return 0;
    }
    for (int i = 0; i < n; i++) {
        if (wc[i].status != IBV_WC_SUCCESS)
            on_error_completion(e, p, &wc[i]);
        else if (e->role == KVW_ROLE_PREFILL)
            kvw__txq_retire(&p->txq, wc[i].wr_id);
        else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM)
            on_immediate(e, p, &wc[i]);
    }
    if (n > 0) {
        atomic_fetch_add_explicit(&e->counters.completions, (uint64_t)n, memory_order_relaxed);
        if (e->role == KVW_ROLE_PREFILL)
            retire_inflight(p);
        if (p->chunk_head)
            kvw__stager_chunks_completed(p, false);
    }
    if (atomic_load(&p->state) == PEER_DEAD && !atomic_load(&p->poller_done)) {
        drop_queues(e, p);
        atomic_store(&p->poller_done, true); /* the control thread may reclaim it */
    }
    if (p->txq_ready)
        publish_outcomes(e, &p->txq);
    return n;
}

static int run_once(kvw_engine_t *e)
{
    int work = drain_ready(e);
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (!p || atomic_load(&p->poller_done))
            continue;
        bool closing = atomic_load(&p->closing);
        if (e->role == KVW_ROLE_PREFILL && atomic_load(&p->state) == PEER_CONNECTED && !closing)
            work += post_peer(e, p);
        work += poll_peer(e, p);
        if (closing) /* every posted write completed: what landed was retired */
            kvw__peer_close_if_drained(p, !p->inflight_head &&
                                              (!p->txq_ready || p->txq.completed >= p->txq.posted));
    }
    return work;
}

/* Arm every CQ, look once more (a completion may have slipped in before the
 * arm), then block until a completion event or a wake-up. */
static void sleep_on_channel(kvw_engine_t *e)
{
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++) {
        kvw_peer_t *p = kvw__peer_at(e, i);
        if (p && !atomic_load(&p->poller_done))
            e->dev->ops->req_notify_cq(p->qp->cq, 0);
    }
    if (run_once(e) > 0)
        return;
    struct pollfd fds[2] = {{e->channel->fd, POLLIN, 0}, {e->poller_wake_fd, POLLIN, 0}};
    atomic_fetch_add_explicit(&e->counters.sleeps, 1, memory_order_relaxed);
    if (poll(fds, 2, IDLE_SLEEP_MS) <= 0)
        return;
    struct ibv_cq *cq;
    void *ctx;
    while (fds[0].revents && e->dev->ops->get_cq_event(e->channel, &cq, &ctx) == 0)
        e->dev->ops->ack_cq_events(cq, 1);
    uint64_t v;
    if (fds[1].revents && read(e->poller_wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        KVW_WARN("poller wake read failed: %s", strerror(errno));
}

void *kvw__poller_main(void *arg)
{
    kvw_engine_t *e = arg;
    uint64_t spin_ns = (uint64_t)e->cfg.poll_spin_us * 1000ull;
    uint64_t last_work = kvw__now_ns();
    while (!atomic_load(&e->stop)) {
        kvw__peers_reap(e); /* no peer pointer is held between passes */
        if (run_once(e) > 0) {
            last_work = kvw__now_ns();
            continue;
        }
        if (kvw__now_ns() - last_work < spin_ns)
            continue;
        sleep_on_channel(e);
        last_work = kvw__now_ns();
    }
    uint32_t np = atomic_load(&e->num_peers);
    for (uint32_t i = 0; i < np; i++)
        if (kvw__peer_at(e, i))
            drop_queues(e, kvw__peer_at(e, i));
    return NULL;
}

/* The seam (poller.h): the same functions the thread runs, nothing added. */
int kvw__poller_run_once(kvw_engine_t *e)
{
    return run_once(e);
}

int kvw__poller_post_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    return post_peer(e, p);
}

int kvw__poller_poll_peer(kvw_engine_t *e, kvw_peer_t *p)
{
    return poll_peer(e, p);
}
