/* SPDX-License-Identifier: Apache-2.0 */
/* The engine's ground floor: the types and declarations every engine
 * file shares (the engine, a connection and its lanes, a request with its
 * role's part, a sender's parts) and the lowest files' functions: wake.c
 * (waking the threads), request.c (a request's life, either role),
 * reqtab.c (the request table: room hash, deadline heap, work list,
 * tokens), peer.c (connections), landing.c, metrics.c. The files above
 * (the rails in rails/, the poller, the stager, each role's owner
 * sender.c / receiver.c, the sets, the control thread and the public API
 * in api_sender.c / api_receiver.c / engine.c) build on it and reach
 * down only; what lower files need from upper ones goes through hooks
 * registered downward (kvw_role_ops_t). docs/architecture.md maps them;
 * scripts/engine-calls.sh checks the order. (It was engine.h.)
 *
 * Threads and ownership
 *   engine->lock guards the request list and table, the ready queue, the
 *   token table, request and peer fields marked (lock), and peer
 *   attachment. No verbs call is made under it. engine->pass_lock is held
 *   by whoever runs a poller pass: the poller thread, or a caller's thread
 *   doing the pass itself while the poller sleeps (kvw__poller_help). Only
 *   its holder touches a peer's txq, active and in-flight queues (fields
 *   marked "poller"), and the poller frees reclaimed peers under it; the
 *   control thread alone touches ZeroMQ sockets and fills or clears peer
 *   slots. A request's state is atomic so poll() never waits for a lock:
 *   it at most tries the pass lock. */
#ifndef KVW_ENGINE_CORE_H
#define KVW_ENGINE_CORE_H

#include "common/clock.h"
#include "ctrl/wire.h"
#include "engine/rails/state.h"
#include "engine/txq.h"
#include "mem/mem.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "verbs/qp.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

enum {
    KVW_TOKEN_BITS = 16, /* receivers in flight per decode engine: 65536 */
    KVW_TOKEN_GEN_MASK = KVW_WIRE_TOKEN_MASK >> 16, /* the rest of the token: a generation */
    KVW_IDENTITY_LEN = 12, /* decode DEALER routing id: engine id + connection serial */
    /* A part waiting on its producer's CUDA event (kvw_sender_send_part_after)
     * is looked at again this often by the thread that holds it (the
     * poller sleeps no longer than this meanwhile, the stager waits no
     * longer): a few thousand cheap queries a second, not a spinning core. */
    KVW_EVENT_RECHECK_US = 100,
};

typedef enum { PEER_LOOKUP, PEER_HELLO, PEER_CONNECTED, PEER_DEAD } kvw_peer_state_t;

typedef struct kvw_req kvw_req_t;
typedef struct kvw_peer kvw_peer_t;

/* One QP of a connection; a connection has cfg.qps_per_peer of them (the
 * smaller count of the two sides is connected) and prefill stripes its
 * chains over them. Its health (failover, rejoin) is the rails' own
 * (rails/state.h). */
typedef struct kvw_lane {
    kvw_qp_t *qp;
    uint8_t rail;        /* the engine's rail (device) the QP lives on */
    uint8_t remote_rail; /* the peer's rail of the QP it is connected to (HELLO) */
    /* Prefill: the regions with this lane's keys (its rail's lkeys, the
     * peer rail's rkeys): one of p->regions' tables, fixed by the handshake. */
    const kvw_plan_region_t *regions;
    /* Immediate credits. Every WRITE_WITH_IMM consumes one receive decode
     * posted on that QP; prefill never has more immediates in flight on a
     * QP than decode has posted receives there (cumulative counts, so a
     * lost CREDIT heals). */
    _Atomic uint64_t imm_limit;    /* prefill: receives decode has posted in all */
    _Atomic uint64_t recvs_posted; /* decode: receives posted in all */
    _Atomic uint64_t credits_sent; /* decode: recvs_posted as last told to prefill */
    /* poller thread only */
    kvw_txq_t txq;
    bool txq_ready;
    uint64_t imm_posted;                 /* prefill: immediates posted */
    uint64_t wrs_counted, bytes_counted; /* prefill: txq totals already in the rail counters */
    struct ibv_recv_wr *rwrs;            /* decode: zero-SGE receives, set before publish */
    kvw_qp_info_t remote;                /* the peer's QP, from HELLO; a reset renews its PSN */
    kvw_lane_health_t health;            /* failover and rejoin (rails/) */
} kvw_lane_t;

/* One part of a sender's request (kvw_sender_send / send_part /
 * send_state), planned once decode's pages are known. The owner thread
 * appends under the lock; the poller follows `next` without it. */
typedef struct kvw_seg {
    struct kvw_seg *_Atomic next;
    size_t first, n;            /* request page positions [first, first + n) */
    uint32_t lb, le;            /* KV layers [lb, le) */
    bool final;                 /* also aux and state; its last write carries the immediate */
    uint64_t *src;              /* n source pages */
    kvw_run_t *runs;            /* planned: n entries */
    kvw_run_t *state_runs;      /* final part: one per state index */
    kvw_plan_set_t *state_sets; /* final part: one per state group */
    kvw_plan_t plan;
    kvw_plan_cursor_t cursor; /* poller */
    /* Landing (decode's path (b)): KV slot i's writes go to land_addr + i *
     * land_area (land_rkey), page position k at k * the slice per page;
     * the runs' destinations are positions. Set when planned. */
    bool landing;
    uint64_t land_addr, land_area;
    uint32_t land_rkey;
    /* Head slicing (the peer is sliced): the KV writes are gather writes
     * of kvw__heads_next, slot by slot over layers [lb, le), before the
     * plan's state and aux writes (its KV part is left empty). Poller. */
    bool sliced, slices_done;
    const kvw_heads_geom_t *kv_geom; /* the request's (tx.kv_geom) or the peer's */
    uint32_t hslot;
    kvw_heads_cursor_t hcursor;
    uint64_t writes_total, writes_built; /* poller (total: set when planned) */
    /* A staged slice (engine/stager.h): its source is a staging chunk. */
    uint32_t chunk;                   /* chunk + 1; 0: none, or the poller took it */
    kvw_plan_region_t *stage_regions; /* planned: the regions, staged ones in the chunk */
    uint64_t *state_src;              /* final slice with staged state: 0..n-1 */
    /* The producer's CUevent (kvw_sender_send_part_after): nothing of the
     * part is read (posted, or copied by the stager) before it completed.
     * Cleared once it did, by the one thread that holds the part then (the
     * poller, or the stager for staged engines, whose slices carry none);
     * queried only through kvw__seg_event_ready. */
    void *event;
    /* Verified transfers (engine/verify.h): its source items still to be
     * added to the request's digest, by the one thread that first posts
     * it (set when planned; false with the check off). */
    bool digest_due;
} kvw_seg_t;

struct kvw_peer {
    kvw_engine_t *engine;
    uint32_t index;             /* slot in engine->peers, reused once the peer is reclaimed */
    uint32_t serial;            /* unique over the engine's life: decode's routing identity */
    _Atomic int state;          /* kvw_peer_state_t; changes only by compare-and-swap */
    atomic_bool killing;        /* the first killer wins; state turns DEAD once the QP is in ERR */
    atomic_bool closing;        /* the other side left: post nothing new, kill once drained */
    uint64_t close_deadline_ns; /* (lock) kill by then even if not drained */
    kvw_status_t close_status;  /* (lock) */
    char close_reason[KVW_WIRE_REASON_MAX]; /* (lock) */
    bool kill_due;           /* (lock) killed under the lock: the control thread finishes it */
    atomic_bool poller_done; /* dead, and the poller has let go of its queues */
    bool live;               /* (lock) published and not dead: counts against max_peers */
    uint32_t nreqs;          /* (lock) listed requests whose r->peer is this peer */
    uint32_t orphans;        /* (lock) prefill: requests of this peer no sender claimed yet */
    uint64_t orphan_bytes;   /* (lock) their page lists */
    kvw_peer_t *grave_next;  /* (lock) unpublished, for the poller to free */
    kvw_lane_t lanes[KVW_MAX_LANES];
    uint32_t nlanes; /* created, fixed before the peer is published */
    /* Every region, local paired with remote: one table of
     * layout.num_regions entries per route (a pair of local and remote
     * rails the lanes use, nroutes of them), route 0 first; a lane's
     * `regions` points at its route's. One rail on each side: one table. */
    kvw_plan_region_t *regions;
    uint32_t nroutes;
    /* The lanes' turn and what failed lanes need (rails/state.h). */
    kvw_rails_t rails;
    uint64_t remote_max[3]; /* items every remote region of each kind holds */
    /* items every remote region of each state group holds */
    uint64_t remote_state_max[KVW_LAYOUT_MAX_GROUPS];
    uint32_t max_msg_sz; /* the smaller of the two ports' limits */
    /* Head slicing, fixed by the handshake (kvw__peer_accept_layout): the
     * two sides' head ranges differ. Prefill: KV slot j's writes follow
     * kv_geom[j] (kv_per_layer entries) with up to max_sge entries each;
     * slice_bad when decode wants heads this rank lacks (slice_why says
     * which): its requests fail. */
    bool sliced, slice_bad;
    kvw_heads_geom_t *kv_geom;
    /* The peer's heads for each KV slot j (kv_per_layer entries; total 0:
     * not described), kept by the handshake: prefill plans a request's head
     * range against them, decode assigns its heads over several ranks. */
    kvw_heads_t *kv_theirs;
    uint32_t max_sge;
    char slice_why[KVW_WIRE_REASON_MAX];
    /* Prefill: decode's landing buffer from its HELLO (len 0: none). */
    uint64_t landing_addr, landing_len;
    uint32_t landing_rkey;
    char dead_reason[KVW_WIRE_REASON_MAX]; /* (lock) */
    kvw_status_t dead_status;              /* (lock) */
    atomic_bool bye_due;                   /* dead: the control thread tells the other side */
    atomic_bool ctl_gone; /* the other side's control connection closed: no BYE can reach it */
    /* CLOSING was said on this connection (decode: its engine is going;
     * prefill: decode's is). Prefill's BYE, once it has its completions,
     * ends it: news rather than trouble. */
    atomic_bool closing_said;
    /* Wire 12: what the connection speaks, agreed in its handshake (the
     * version, and the capabilities both ends have: KVW_WIRE_CAP_*), and
     * whether the decode side offered (prefill: a HELLO without an offer
     * is a 1.4.x engine's, answered in 1.4.0's own bytes). Set before the
     * peer is published; read-only then. */
    uint16_t wire_version;
    uint32_t wire_caps;
    bool wire_offered;

    /* control thread only */
    void *sock, *bs_sock; /* decode: DEALER to prefill, DEALER to bootstrap */
    void *monitor;        /* decode: PAIR receiving sock's disconnect events */
    char bootstrap_addr[KVW_WIRE_ENDPOINT_MAX];
    uint32_t rank;
    uint8_t id[KVW_IDENTITY_LEN]; /* ROUTER identity of the decode side */
    uint64_t last_seen_ns, next_ping_ns, deadline_ns;
    bool busy;                 /* decode: a request depended on it at the last tick */
    uint64_t busy_since_ns;    /* decode: when it last turned busy (pinged at once then) */
    uint64_t hello_retry_ns;   /* decode: no HELLO_ACK by then, look the rank up again */
    uint32_t hello_qpn;        /* prefill: decode's first QPN in its HELLO (a resend names it) */
    uint64_t missing_since_ns; /* decode: the bootstrap first said "not registered" */

    /* Liveness seen on the data path: the last pass that reaped a
     * successful completion of this connection (decode: an immediate from
     * prefill; prefill: writes decode's NIC acknowledged). The poller (or a
     * caller's pass) stores it, the control thread reads it beside
     * last_seen_ns, so a connection whose data flows is never judged
     * silent because its control messages are late. */
    _Atomic uint64_t data_seen_ns;

    /* poller thread only */
    bool credit_blocked;                      /* the next immediate waits for a CREDIT */
    kvw_req_t *active_head, *active_tail;     /* writes left to post */
    uint32_t chunk_head, chunk_tail;          /* staging chunks + 1 posted, oldest first */
    kvw_req_t *inflight_head, *inflight_tail; /* all posted, awaiting completion */
    /* Requests whose next part waits on its producer's CUDA event: off the
     * active queue so that they hold up no other request of the
     * connection; a pass looks at their events again once
     * KVW_EVENT_RECHECK_US went by since the last look. */
    kvw_req_t *evwait_head, *evwait_tail;
    uint64_t evwait_due_ns; /* their next look: passes in between leave them be */
};

/* A sender's side of a request (prefill; kvw_sender_*, sender.c and
 * ctl_prefill.c). Fields are (lock) unless marked: "poller" ones belong to
 * whoever runs the poller's pass (engine->pass_lock), atomics are written
 * by the poller and read by anyone. */
typedef struct kvw_req_tx {
    /* (lock): the caller's thread and the control thread */
    bool inited, have_dst;
    bool drained;                   /* no write of this request can still be in flight */
    bool notify_failure;            /* tell decode it failed, once drained */
    bool abort_heard;               /* (lock) decode aborted it: the notice confirms that */
    _Atomic uint64_t first_post_ns; /* transfer clock: starts at the first post */
    _Atomic uint64_t done_ns;       /* its last write completed */
    size_t num_pages;               /* declared by init */
    uint32_t aux_index;
    uint64_t *covered; /* per KV layer: page positions handed over */
    /* given by kvw_sender_send_state(_lists): every state group's list in
     * group order, num_src_state in all, src_state_n[s] of state group s */
    uint64_t *src_state;
    size_t num_src_state;
    uint32_t *src_state_n;
    bool have_state, final_given;    /* the part that completes the request exists */
    uint64_t *dst_pages, *dst_state; /* decode's request: pages, then state indices */
    size_t num_dst_state;
    uint32_t *dst_state_n; /* decode's count per state group */
    uint32_t dst_aux;
    kvw_seg_t *segs_head, *segs_tail; /* parts in the order handed over */
    kvw_seg_t *to_plan;               /* first part not planned yet (decode's request unknown) */
    bool in_poller;                   /* the poller holds a reference (queued or starved) */
    bool starved;                     /* the poller posted every part it has; waits for more */
    /* poller */
    bool ev_blocked; /* its next part waits on its CUDA event */
    kvw_seg_t *seg;  /* the part being posted */
    uint64_t writes_built;
    uint64_t last_seq[KVW_MAX_LANES];  /* its last write on each lane */
    uint32_t lane_life[KVW_MAX_LANES]; /* the lane's life (kvw_lane_t.life) last_seq is of */
    uint32_t lane_mask;                /* lanes that carried writes of it */
    uint32_t imm_lanes;                /* lanes its final immediates go on, fixed at the finish */
    uint32_t imms_posted;              /* lanes whose zero-length immediate is posted */
    uint32_t final_lane;               /* the lane of its last write */
    uint32_t epoch;                    /* attempts replayed after a lane failed (rails) */
    /* (lock) Asking decode whether it completed the attempt (a lane failed
     * while its final immediate was on it): KVW_ASK_*; ask_deadline_ns
     * bounds the wait. */
    int ask;
    uint64_t ask_deadline_ns;
    _Atomic uint64_t writes_posted; /* poller writes, anyone reads */
    /* (lock, fixed once have_dst) Decode over several prefill ranks: the
     * REQUEST named a head range. KV slot j's writes follow kv_geom[j]
     * (kv_per_layer entries) instead of the peer's; owes_none: the range is
     * empty, no KV write at all. NULL and false for all of decode's heads. */
    kvw_heads_geom_t *kv_geom;
    bool owes_none;
    bool no_rest; /* another rank sends decode the aux item and the state */
    /* (lock, fixed once have_dst) Decode asked for its heads in its landing
     * buffer (KVW_WIRE_HEADS_LANDING): kv_geom is the landing geometry,
     * KV slot i's writes start at land_addr + i * land_area. */
    bool landing;
    uint64_t land_addr, land_area;
    /* One sender serving several decode receivers of the room (txset.c):
     * the set this request is a member of, fixed by create and cleared
     * (lock) by the set's destroy; NULL for a plain sender. */
    struct kvw_txset *set;
    uint32_t set_index;
    /* (lock, fixed once have_dst) The decode receivers decode's REQUEST
     * says ask for the room (wire 12); 0: it did not say. */
    uint32_t room_receivers;
    /* (lock) The set's hook, set and cleared with `set`: r failed, the
     * set fails its other members (kvw__txset_member_failed_locked). */
    void (*member_failed_locked)(kvw_req_t *r);
    /* Verified transfers (engine/verify.h). (lock, fixed once have_dst)
     * decode asked for the check; the caller gives the digest (GPU memory
     * kvwire does not read). (lock) digest_due: the DIGEST is still to be
     * sent once the request succeeded; given: the caller's digest arrived
     * (in `given`). `digest`: kvwire's sum, added to by whichever thread
     * first posts each part (poller). */
    bool verify, caller_digest, digest_due, digest_given;
    uint64_t given;
    _Atomic uint64_t digest;
} kvw_req_tx_t;

/* A receiver's side of a request (decode; kvw_receiver_*, receiver.c and
 * ctl_decode.c). Set by init on the caller's thread before the request is
 * listed, then (lock) where marked; the poller writes landed_ns. */
typedef struct kvw_req_rx {
    uint32_t prefill_rank;
    char bootstrap_addr[KVW_WIRE_ENDPOINT_MAX];
    bool request_due;  /* (lock) init done, REQUEST not yet sent */
    bool request_sent; /* (lock) prefill may be writing into our pages */
    bool abort_due;    /* (lock) ABORT to send to prefill */
    bool aborting;     /* (lock) ABORT sent; Failed once prefill confirms its writes drained */
    kvw_status_t abort_status;              /* (lock) */
    char abort_reason[KVW_WIRE_REASON_MAX]; /* (lock) */
    /* npages destination pages, then nstate state indices: every state
     * group's list in group order, state_n[s] of state group s */
    uint64_t *pages;
    size_t npages, nstate;
    uint32_t *state_n;
    uint32_t aux;
    _Atomic uint64_t sent_ns;   /* (lock) REQUEST sent: decode's transfer clock */
    _Atomic uint64_t landed_ns; /* the immediate arrived */
    uint32_t imms_landed;       /* (lock) final immediates arrived (one per lane used) */
    uint32_t imm_epoch;         /* (lock) the latest attempt whose immediates are counted */
    /* Decode over several prefill ranks (rxset.c): the set this request is
     * one rank's member of, fixed by create and cleared (lock) by the set's
     * destroy; NULL for a plain receiver. Once the set assigned the heads
     * (lock): the REQUEST asks for heads only, and no_rest members leave
     * the aux item and the state to another rank. */
    struct kvw_rxset *set;
    /* (lock) The set's hook, set and cleared with `set`: r failed, the
     * set aborts its other members (kvw__rxset_member_failed_locked). */
    void (*member_failed_locked)(kvw_req_t *r);
    bool heads_set, no_rest;
    kvw_head_range_t heads;
    /* (lock, fixed once the REQUEST left) How many decode receivers ask
     * this prefill rank for the room (kvw_receiver_set_room_receivers);
     * 0: not said. Sent on connections with KVW_WIRE_CAP_FANOUT. */
    uint32_t room_receivers;
    /* (lock) Landing (path (b), landing.c): land_len bytes of the engine's
     * landing buffer from land_off hold this member's heads until the
     * scatter into the rows; 0: none (its writes land in the rows). Freed
     * when it ends (Failed comes only once nothing more can land). */
    uint64_t land_off, land_len;
    /* Verified transfers (engine/verify.h), (lock) unless marked: the
     * check's mode (KVW_VERIFY_*, fixed by init); every write landed
     * (v_landed, the immediates all counted); decode's own digest
     * (v_local: computed, or the caller's) and prefill's (v_remote), each
     * with its flag. Success only once all three are in and agree. */
    uint8_t verify;
    bool v_landed, v_have_local, v_have_remote;
    uint64_t v_local, v_remote;
} kvw_req_rx_t;

/* A request's staging through host memory (engine/stager.h), on engines
 * with GPU regions the NIC cannot reach; unused elsewhere. */
typedef struct kvw_req_stage {
    kvw_req_t *snext; /* on a stager queue */
    bool queued;      /* (stager lock) on its job queue */
    union {
        struct {                                      /* prefill */
            kvw_seg_t *unstaged_head, *unstaged_tail; /* (lock) parts not staged yet */
            /* stager thread: the part being cut into slices, where in it
             * the next slice starts (stage_send.c), and the connection
             * whose share of the chunks it takes (peer slot and serial) */
            kvw_seg_t *staging;
            int step;
            uint32_t layer;
            size_t page;
            uint32_t slot, serial;
            bool parked; /* (stager lock) waits for a chunk its connection may take */
            bool evwait; /* (stager lock) its part waits on the producer's CUDA event */
        };
        struct {             /* decode */
            uint64_t *slots; /* a slot per page, per state index, then aux */
            bool slots_held; /* (stager lock) */
            bool waiting;    /* (lock) in the stager's queue for slots */
            /* Every write landed in the slots and the stager copies them
             * to the GPU (queued or running), or (landing.c) the landing
             * buffer's copy into the rows runs; the request ends only
             * when that copy is over. Written under both the lock and the
             * stager lock, so either lock reads it. */
            bool staging_in;
        };
    };
} kvw_req_stage_t;

/* One request, either role: the head every file shares (the table, the
 * queues, the state and its failure), then the role's own part. One
 * allocation (kvw__req_new_locked, inside the user's handle). */
struct kvw_req {
    kvw_engine_t *engine;
    kvw_role_t role;
    uint64_t room;
    _Atomic int state;                     /* kvw_poll_t */
    _Atomic int refs;                      /* user handle + engine list + poller queues */
    kvw_status_t fail_status;              /* (lock) valid once Failed */
    char fail_reason[KVW_WIRE_REASON_MAX]; /* (lock) valid once Failed */
    kvw_req_t *prev, *next;                /* engine->reqs (lock) */
    kvw_req_t *qnext;                      /* ready queue (lock) or a poller queue */
    kvw_req_t *hnext;                      /* room hash chain (lock) */
    kvw_req_t *wnext;                      /* control work list (lock) */
    bool listed;                           /* (lock) in engine->reqs and the room table */
    bool in_work;                          /* (lock) on the work list (which holds a ref) */
    size_t heap_pos;                       /* (lock) 1-based place in the deadline heap, 0 = none */
    kvw_peer_t *peer;                      /* (lock) set through kvw__req_attach_locked */
    uint64_t deadline_ns; /* (lock) limit of the current state, 0 = none; set through
                             kvw__req_set_deadline_locked */
    bool orphan;          /* (lock) prefill: decode asked, no sender claimed it yet */
    bool has_user;        /* (lock) a sender/receiver handle refers to it */
    bool user_gone;       /* (lock) handle destroyed; kept only as a tombstone */
    /* Decode: its slot in the token table (receiver.c), which its last
     * writes' immediate names; prefill: decode's token, from the REQUEST. */
    uint32_t token;
    /* Prefill: bytes posted (the poller writes, anyone reads); decode: the
     * bytes its indices ask for, set by init. */
    _Atomic uint64_t bytes_posted;
    uint64_t created_ns; /* fixed at creation: the request latency's start */

    /* The role's own part: an engine has one role, and so have all its
     * requests (r->role == engine->role); only the role's files, and code
     * that checked r->role, touch it. */
    union {
        kvw_req_tx_t tx; /* prefill */
        kvw_req_rx_t rx; /* decode */
    };
    kvw_req_stage_t stage; /* staged engines (and decode's landing copy), by role inside */
};

/* What the generic request code (request.c) asks of a request's role,
 * so that it calls no role's file: the engine's table, set at creation
 * for its role (engine.c). */
typedef struct kvw_role_ops {
    /* (lock) r just moved to Failed, or failed again: prefill hands a
     * sender the poller parked between parts back to it, for it to retire
     * (kvw__sender_unstarve_locked). NULL: nothing to do. */
    void (*failed_locked)(kvw_req_t *r);
    /* r's last reference went: free what its role holds (not r itself). */
    void (*free)(kvw_req_t *r);
    /* (lock) r's handle is gone: does the other side still need an answer
     * about it (prefill: its failure, or its digest; decode: its ABORT)? */
    bool (*answer_owed_locked)(kvw_req_t *r);
    /* Prefill's sender (sender.c), for the files below it that drive its
     * requests (the poller, rails, staging), so that none calls up into
     * it; NULL on decode. (lock) fail r and tell decode once drained
     * (kvw__sender_fail_locked); park r between parts, or hand it back
     * (kvw__sender_starve_locked, _unstarve_locked); append a staged
     * slice (kvw__sender_append_locked). */
    kvw_status_t (*fail_locked)(kvw_req_t *r, kvw_status_t st, const char *why);
    bool (*starve_locked)(kvw_req_t *r);
    void (*unstarve_locked)(kvw_req_t *r);
    kvw_status_t (*append_locked)(kvw_req_t *r, kvw_seg_t *s);
} kvw_role_ops_t;

extern const kvw_role_ops_t kvw__prefill_ops; /* sender.c */
extern const kvw_role_ops_t kvw__decode_ops;  /* receiver.c */

/* Fixed log-scale latency buckets: bucket i counts values up to 2^(i+3)
 * microseconds (8 us .. 2^24 us, about 16.8 s), the last one the rest.
 * Atomics only: the poller adds without a lock or an allocation. */
#define KVW_HIST_BUCKETS 22
typedef struct kvw_hist {
    _Atomic uint64_t bucket[KVW_HIST_BUCKETS + 1];
    _Atomic uint64_t sum_ns;
} kvw_hist_t;
/* Failure causes counted: every kvw_status_t, by -status. */
#define KVW_METRIC_CAUSES 32

typedef struct kvw_engine_counters {
    _Atomic uint64_t bytes, wrs, chains, completions, wrs_completed, wrs_flushed, errors, ok,
        failed, sleeps, caller_passes;
    _Atomic uint64_t created; /* requests made: those not ok nor failed are under way */
    /* Producer events: queries made, and times a part was set aside
     * because its event had not completed (tests: a wait is counted, not
     * spun). */
    _Atomic uint64_t event_queries, event_waits;
    /* Rails: lanes failed over, requests whose writes started over on the
     * live lanes, requests failed instead (their final immediate on the
     * failed lane may have landed). */
    _Atomic uint64_t lanes_failed, replays, replay_refused;
    /* Rejoins: lanes back in their connection; probes of a paused lane's
     * port, those that found it still down or the lane not working, and
     * cooldowns cut short because a port came up (ours or decode's). */
    _Atomic uint64_t lanes_rejoined, lane_probes, lane_probes_failed, lane_probes_early;
    /* Requests asked about (REPLAY_ASK), and those decode had completed. */
    _Atomic uint64_t replay_asks, replay_done;
    /* Metrics (metrics.c, kvw_engine_metrics_text): requests failed by
     * cause (index -status), the bytes of requests by outcome, and the two
     * latency histograms, all updated as a request ends. */
    _Atomic uint64_t failed_by[KVW_METRIC_CAUSES];
    _Atomic uint64_t bytes_ok, bytes_failed;
    kvw_hist_t transfer_hist, request_hist;
    /* Control plane: handshakes completed and refused (prefill: by us;
     * decode: by prefill), requests refused (prefill: REQUEST_FAILED for a
     * request it would not take; decode: prefill failed or refused one),
     * reconnects, orphans held and expired, aborts (prefill: heard;
     * decode: sent) and their confirmations (prefill: sent; decode:
     * heard). */
    _Atomic uint64_t handshakes, handshakes_refused, requests_refused, reconnects;
    _Atomic uint64_t orphans, orphans_expired, aborts, abort_confirms;
} kvw_engine_counters_t;

/* The engine's request table (reqtab.c owns it; all under the engine
 * lock): the room hash, the deadline heap, the control thread's work list
 * and decode's token table. */
typedef struct kvw_reqtab {
    kvw_req_t **rooms; /* hash of the engine's requests by room */
    size_t room_mask, num_reqs;
    kvw_req_t **heap; /* requests with a deadline, earliest first */
    size_t heap_len, heap_cap;
    kvw_req_t *work_head, *work_tail; /* requests the control thread must look at */
    kvw_req_t **tokens;               /* decode: slot -> receiver */
    uint16_t *token_gen;
    uint32_t token_hint;
} kvw_reqtab_t;

struct kvw_engine {
    kvw_role_t role;
    const kvw_role_ops_t *ops; /* the role's: kvw__prefill_ops or kvw__decode_ops */
    uint32_t rank;
    uint64_t id;
    char log_tag[48]; /* "prefill r0 <id>": its threads' log lines name it */
    kvw_config_t cfg;
    char local_ip[64];
    char bootstrap_addr[KVW_WIRE_ENDPOINT_MAX];
    kvw_dev_t *dev; /* rail[0].dev */
    /* Rails (KVW_DEVICES): every device the engine opened, each with its
     * PD, completion channel and a registration of every region, and its
     * counters (rails/state.h); nrails is 1 unless several devices were
     * named. Fixed before the threads run. */
    kvw_engine_rail_t rail[KVW_MAX_RAILS];
    uint32_t nrails;
    kvw_layout_t layout;
    bool layout_heads; /* some KV group describes its heads (head slicing) */
    /* Decode's KV groups that learn their heads from prefill's handshake
     * (kvw_group_heads_t's learning entry): bit g of learn_groups, learn[g]
     * the group's page (page_tokens, order), and this engine's attention TP
     * rank of tp_size; fixed at creation. The heads learned are written
     * once into layout.groups[g].heads, by the control thread under lock
     * (kvw__peer_accept_layout); until then the group reads undescribed. */
    uint64_t learn_groups;
    kvw_heads_t learn[KVW_LAYOUT_MAX_GROUPS];
    uint32_t tp_rank, tp_size;
    kvw_region_t *regions; /* layout.num_regions, group by group */
    /* layout.num_regions registrations per rail: rail r's at mrs + r *
     * num_regions (kvw__rail_mrs), so mrs itself is rail 0's. */
    kvw_mr_t *mrs;
    kvw_mem_ctx_t mem;           /* how each region was registered; read-only once threads run */
    struct kvw_stager *stager;   /* GPU regions copied through host memory; NULL: none */
    struct kvw_landing *landing; /* decode's landing buffer (landing.c); NULL: none */
    struct kvw_copier *copier;   /* its copies' thread (copier.c); NULL: none */
    uint8_t verify_mode;         /* KVW_VERIFY_*: cfg.verify and who reads the memory */
    /* The wire versions and capabilities this engine offers (all this
     * build speaks; a test narrows them before connecting to play an
     * older or a different build). */
    kvw_wire_offer_t wire;
    uint64_t local_max[3]; /* items every local region of each kind holds (KVW_LAYOUT_*) */
    uint64_t state_max[KVW_LAYOUT_MAX_GROUPS]; /* the same per state group */
    struct ibv_comp_channel *channel;          /* rail[0].channel */
    int poller_wake_fd, control_wake_fd;       /* eventfds */
    void *zctx, *router;
    /* CURVE for every socket of zctx (NULL: no cluster key, plain); set
     * before the threads start, read only after. */
    struct kvw_zsecurity *zsec;
    struct kvw_registry *registry; /* KVW_REGISTRY's store, NULL: none; its own thread */
    void *router_monitor;          /* PAIR receiving the router's disconnect events */
    /* The control thread's own state (engine/control.h): only its files
     * (control.c, ctl_*.c) touch it; engine.c creates and frees it. */
    struct kvw_ctl *ctl;
    char endpoint[KVW_WIRE_ENDPOINT_MAX];
    pthread_t control_thread, poller_thread;
    bool control_started, poller_started;
    atomic_bool stop;
    /* The poller stops only after the control thread: decode's QPs must
     * live while it ends its connections in order (kvw__decode_close_all). */
    atomic_bool poller_stop;

    pthread_mutex_t lock;
    /* Held for one poller pass (run_once), by the poller thread or by a
     * caller's thread helping while the poller sleeps; taken before lock,
     * never while holding it. */
    pthread_mutex_t pass_lock;
    /* Held around each query of a producer's CUDA event, with the check
     * that its request has not ended, and around a prefill request's move
     * to Failed (kvw__req_fail): once the caller sees a request ended, no
     * query of its events is under way or will start, so the caller may
     * destroy them. A leaf: nothing is taken while it is held. */
    pthread_mutex_t event_lock;
    void *event_ctx;             /* a CUDA context of a GPU region (NULL: none); read-only */
    _Atomic uint32_t ev_waiting; /* requests on the peers' evwait lists */
    /* Peer slots, read by the poller and control threads without the lock.
     * Only the control thread fills or clears a slot (under the lock), and
     * only the poller frees a cleared one's peer, at the start of a pass. */
    kvw_peer_t *_Atomic *peers;
    uint32_t peer_slots;        /* capacity: live ones are capped at cfg.max_peers */
    _Atomic uint32_t num_peers; /* slots in use so far (high-water mark) */
    uint32_t live_peers;        /* (lock) published and not dead */
    kvw_peer_t *graveyard;      /* (lock) unpublished peers for the poller to free */
    atomic_bool graves_pending;
    kvw_req_t *reqs, *reqs_tail;    /* oldest first */
    kvw_reqtab_t tab;               /* (lock) the room hash, deadline heap, work list, tokens */
    kvw_req_t **pending;            /* (lock) decode: receivers waiting for a new connection */
    size_t npending, pending_cap;   /* (lock) */
    _Atomic uint64_t drops;         /* control writes: messages dropped; anyone reads */
    uint64_t control_due_ns;        /* (lock) when the control thread wakes at the latest */
    _Atomic uint64_t control_wakes; /* control loop iterations (tests: an idle loop sleeps) */
    kvw_req_t *ready_head, *ready_tail;
    atomic_bool ready_pending;   /* lets the spinning poller skip the lock */
    atomic_bool poller_sleeping; /* set before its last look and its sleep */
    kvw_engine_counters_t counters;
};

/* Rail r's registration of every region. */
static inline const kvw_mr_t *kvw__rail_mrs(const kvw_engine_t *e, uint32_t r)
{
    return e->mrs + (size_t)r * e->layout.num_regions;
}

/* metrics.c: count a request that just reached Success (ok) or Failed:
 * its bytes, its cause, its latencies. Atomics only (any thread). */
void kvw__metrics_request_ended(const kvw_req_t *r, bool ok);

/* wake.c */
void kvw__wake(int fd);
/* After publishing work the poller finds on its own (ready_pending): wake
 * it only if it sleeps. A spinning poller sees the work on its next pass,
 * and the eventfd write is a system call on the request's critical path.
 * Safe because both sides store, then load (sequentially consistent): the
 * poller sets poller_sleeping before its last look for work. */
void kvw__wake_poller(kvw_engine_t *e);
/* The calling thread is about to hand work over and will run the poller's
 * pass itself if the poller sleeps: kvw__wake_poller() only notes the wake
 * until kvw__poller_help() (poller.h) decides. Pair every call with one. */
void kvw__wake_defer(void);
/* Ends kvw__wake_defer(); true if a wake was asked for meanwhile. */
bool kvw__wake_deferred_end(void);

/* request.c */
void kvw__req_unref(kvw_req_t *r);
bool kvw__req_ended(const kvw_req_t *r);
/* KVW_OK, or the failure status with its reason (valid while r lives). */
kvw_status_t kvw__req_failure(const kvw_req_t *r, const char **reason_p);
/* (lock) The user's handle is gone: keep r only while the other side may
 * still need an answer about it, else drop it. */
void kvw__req_release_handle_locked(kvw_req_t *r);
/* Index of the first value >= limit, or n when all fit. */
size_t kvw__first_out_of_range(const uint64_t *v, size_t n, uint64_t limit);
/* Checks against this engine's own regions of one kind (KVW_LAYOUT_*):
 * KVW_ERR_OUT_OF_RANGE with the reason in why, or KVW_OK. side: "source"
 * (prefill) or "destination" (decode). */
kvw_status_t kvw__check_count(const kvw_engine_t *e, int kind, size_t n, char *why, size_t size);
kvw_status_t kvw__check_aux(const kvw_engine_t *e, uint32_t aux_index, char *why, size_t size);
kvw_status_t kvw__check_indices(const kvw_engine_t *e, int kind, const char *side,
                                const uint64_t *idx, size_t n, char *why, size_t size);
/* A request's state lists (hybrid models: each state group its own index
 * space, kvw_state_list_t): listed groups take their own list, the others
 * the shared one. Each index is checked against its own group's local
 * regions (side as above). *out_p gets prefix free entries (the caller's
 * pages), then every state group's indices in group order (*total_p of
 * them); *counts_p one count per state group (NULL when the layout has
 * none). KVW_ERR_INVALID (a list naming no state group, or one twice;
 * shared indices without a state group) or KVW_ERR_OUT_OF_RANGE, with why;
 * nothing allocated then. */
kvw_status_t kvw__state_lists(const kvw_engine_t *e, const char *side, const uint64_t *shared,
                              size_t num_shared, const kvw_state_list_t *lists, size_t num_lists,
                              size_t prefix, uint64_t **out_p, uint32_t **counts_p, size_t *total_p,
                              char *why, size_t size);
/* Where state group s's indices start in a concatenated list (counts as
 * above). */
size_t kvw__state_off(const uint32_t *counts, uint32_t s);
/* part.c: a sender's parts. Whether the producer's event of part s of r
 * completed
 * (kvw_sender_send_part_after): 1 when it did, or s has none (s->event is
 * then cleared and never touched again); 0 while it runs, and also once r
 * ended (the caller may have destroyed the event: it is not touched);
 * -1 when it failed, with why naming the part and the CUDA error. Never
 * blocks. Called by the one thread that holds the part. */
int kvw__seg_event_ready(kvw_req_t *r, kvw_seg_t *s, char *why, size_t size);
/* Free one part (and give back its staging chunk); a list of them,
 * linked through next. */
void kvw__seg_free(kvw_engine_t *e, kvw_seg_t *s);
/* Head slicing: the plan of s's KV slot `slot` (an index into the layout's
 * kv_slots) towards peer p: its region pair, p's geometry for the slot's
 * place in a layer, s's runs, p's entries and message limits. */
void kvw__seg_slice_plan(const kvw_peer_t *p, const kvw_layout_t *l, const kvw_seg_t *s,
                         size_t slot, kvw_heads_plan_t *hp);
void kvw__seg_free_list(kvw_engine_t *e, kvw_seg_t *s);
/* (lock) Append a part to r, planning it if decode's pages are known (the
 * stager's way in: its parts were checked when they were handed over).
 * Frees s and fails r when it cannot be planned. */
kvw_status_t kvw__sender_append_locked(kvw_req_t *r, kvw_seg_t *s);
/* (lock) Move r to Failed (once; later calls and ended requests are
 * ignored) with a reason. Also ignored for a staged receiver whose copy to
 * the GPU runs (staging_in): every byte of it landed, so what the network
 * says now changes nothing, and a Failed before the copy is over would let
 * the copy write its pages after it. The copy's end decides (stage_recv.c).
 * Every failure goes through here, so a sender the poller parked between
 * parts (starved, on none of its queues) is handed back here too: else
 * nothing would ever retire it, its drain would never be noticed and
 * decode would never hear of the failure. */
void kvw__req_fail(kvw_req_t *r, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Transferring -> Success; false if r was no longer Transferring. */
bool kvw__req_succeed(kvw_req_t *r);
/* (lock) Prefill: fail r and tell decode once its posted writes drained. */
kvw_status_t kvw__sender_fail_locked(kvw_req_t *r, kvw_status_t st, const char *why);
/* (lock) Decode: give a sent request up: ABORT to prefill, Failed when it
 * confirms, the connection killed if it does not within peer_timeout_ms. */
void kvw__receiver_start_abort_locked(kvw_req_t *r, kvw_status_t st, const char *why);
/* (lock) Decode: give up a receiver whose request prefill does not have:
 * nothing can land, so it fails now, and prefill is told (ABORT) so that
 * its sender fails too instead of waiting for a request that never comes.
 * One waiting for staging slots leaves its place to the next. */
void kvw__receiver_fail_unsent_locked(kvw_req_t *r, kvw_status_t st, const char *why);
/* receiver.c, for rxset.c: one member's creation (member: rooms may repeat
 * over ranks), init, abort under the lock, and destroy. */
kvw_status_t kvw__receiver_create(kvw_engine_t *e, const char *addr, uint32_t prefill_rank,
                                  uint64_t room, bool member, kvw_req_t **r_p);
kvw_status_t kvw__receiver_init_one(kvw_req_t *r, const kvw_indices_t *x,
                                    const kvw_state_list_t *lists, size_t num_lists);
void kvw__receiver_abort_locked(kvw_req_t *r, const char *why);
void kvw__receiver_end(kvw_req_t *r);
void kvw__receiver_destroy_one(kvw_req_t *r);
/* kvw_receiver_landed and kvw_receiver_verify of a plain receiver. */
int kvw__receiver_landed_one(kvw_req_t *r);
kvw_status_t kvw__receiver_verify_one(kvw_req_t *r, uint64_t digest);
/* rxset.c: a receiver over several prefill ranks (kvw_receiver_create_ranks).
 * The public receiver calls on a set's handle (its member 0) land here. */
typedef struct kvw_rxset kvw_rxset_t;
/* A set over params' ranks (kvw_receiver_create_ranks, checked here):
 * *first_p is member 0, whose handle is the caller's. */
kvw_status_t kvw__rxset_create(kvw_engine_t *e, const kvw_receiver_params_t *params,
                               kvw_req_t **first_p);
kvw_status_t kvw__rxset_init(kvw_rxset_t *set, const kvw_indices_t *x,
                             const kvw_state_list_t *lists, size_t num_lists);
kvw_poll_t kvw__rxset_poll(kvw_rxset_t *set);
kvw_status_t kvw__rxset_failure(kvw_rxset_t *set, const char **reason_p);
kvw_status_t kvw__rxset_abort(kvw_rxset_t *set);
kvw_status_t kvw__rxset_metrics(kvw_rxset_t *set, kvw_req_metrics_t *m);
void kvw__rxset_destroy(kvw_rxset_t *set);
/* (lock) kvw_receiver_set_room_receivers on a set: every member. */
kvw_status_t kvw__rxset_set_room_receivers_locked(kvw_rxset_t *set, uint32_t n);
/* (lock) receiver.c: r's REQUEST will say n decode receivers ask for the
 * room; KVW_ERR_STATE once it is due (init) or r ended. */
kvw_status_t kvw__receiver_set_room_receivers_locked(kvw_req_t *r, uint32_t n);
/* (lock) A member failed: abort the others, keep the first reason. */
void kvw__rxset_member_failed_locked(kvw_req_t *r);
/* (lock) May r's REQUEST go? Always for a plain receiver; for a member,
 * once every member's rank is connected and the heads are assigned (the
 * first call that finds them connected assigns them and touches every
 * member). */
bool kvw__rxset_ready_locked(kvw_req_t *r);
/* landing.c: decode's landing buffer (head slicing's path (b)). Create:
 * registered once when the config asks for one and the engine describes
 * heads (no buffer is no error: requests take path (a)); destroy once no
 * QP can write any more. */
kvw_status_t kvw__landing_create(kvw_engine_t *e);
void kvw__landing_destroy(kvw_engine_t *e);
/* Put the buffer (address, length, rkey) in a HELLO of ours (none: 0). */
void kvw__landing_advertise(const kvw_engine_t *e, kvw_msg_t *m);
/* (lock) Reserve bytes of it for member r (r->rx.land_off/len); false
 * when there is no buffer or no room (logged once per engine). */
bool kvw__landing_reserve_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t bytes);
/* (lock) Give r's reservation back (none: nothing). */
void kvw__landing_release_locked(kvw_engine_t *e, kvw_req_t *r);
/* Copy r's landed heads into its rows: every KV slot, a 2D copy per run of
 * contiguous pages (host rows, or cuMemcpy2DAsync then a wait for GPU
 * regions). No lock held; r's immediates all arrived. KVW_OK, or
 * KVW_ERR_TRANSFER with why. */
kvw_status_t kvw__landing_scatter(kvw_engine_t *e, const kvw_req_t *r, char *why, size_t size);
/* Every write of r landed in its slice of the buffer: copy it into the
 * rows (kvw__landing_scatter), then end r (and only then: its pages hold
 * the heads once Success is seen), giving the slice back and dropping
 * the reference its hand-off took. No lock held; the copier's thread. */
void kvw__landing_finish(kvw_engine_t *e, kvw_req_t *r);
/* copier.c: the copy executor, one thread per engine off the poller, for
 * the engine's staging jobs (the stager's loop) or its landing buffer's
 * scatter (kvw__landing_finish per landed member, in landing order).
 * Start: when the engine has a stager or a landing buffer (neither:
 * nothing); stop: staging's from kvw__stager_stop, the landing buffer's
 * once nothing pushes any more (the poller stopped), after finishing what
 * is queued. Push (landing): r with a reference of the caller's, handed
 * over. */
kvw_status_t kvw__copier_start(kvw_engine_t *e);
void kvw__copier_stop(kvw_engine_t *e);
void kvw__copier_push(kvw_engine_t *e, kvw_req_t *r);
/* Landing copies the executor took on (tests: every scatter is one). */
uint64_t kvw__copier_jobs(kvw_engine_t *e);
/* What the buffer holds (tests): its bytes (0: none), those reserved
 * now, the scatters done (one per member landed), and 2D copies queued
 * (one per KV slot and run of contiguous pages). */
typedef struct kvw_landing_stats {
    uint64_t len, reserved, scatters, copies;
    bool gpu;
} kvw_landing_stats_t;
void kvw__landing_stats(kvw_engine_t *e, kvw_landing_stats_t *out);

/* sender.c, for txset.c: one member's calls (the public ones dispatch a
 * set's handle to txset.c, which calls these for each member). */
/* A plain sender's request for room (a request decode sent ahead, or a
 * new one): the caller's. */
kvw_status_t kvw__sender_create_one(kvw_engine_t *e, uint64_t room, kvw_req_t **r_p);
kvw_status_t kvw__sender_init_one(kvw_req_t *r, size_t num_pages, uint32_t aux_index);
kvw_status_t kvw__sender_send_part_one(kvw_req_t *r, const kvw_part_t *part, void *event);
kvw_status_t kvw__sender_send_one(kvw_req_t *r, const uint64_t *pages, size_t n, void *event);
kvw_status_t kvw__sender_send_state_one(kvw_req_t *r, const uint64_t *state, size_t n,
                                        const kvw_state_list_t *lists, size_t num_lists);
kvw_status_t kvw__sender_abort_one(kvw_req_t *r, const char *why);
kvw_status_t kvw__sender_requested_one(const kvw_req_t *r, size_t *num_pages_p, uint32_t *aux_p);
void kvw__sender_destroy_one(kvw_req_t *r);
/* (lock) The caller's digest of r's bytes (kvw_sender_set_digest, verify
 * with GPU memory kvwire cannot read): KVW_ERR_STATE when the engine does
 * not take the caller's digests, it was given, or r failed. */
kvw_status_t kvw__sender_set_digest_locked(kvw_req_t *r, uint64_t digest);
/* (lock) Make r the caller's sender (it may be a request decode sent ahead). */
void kvw__sender_adopt_locked(kvw_req_t *r);
/* txset.c: one sender serving a room to several decode receivers
 * (kvw_sender_create_fanout). The public sender calls on a set's handle
 * (its member 0) land here. */
typedef struct kvw_txset kvw_txset_t;
/* A set of n >= 2 members for room (kvw_sender_create_fanout): *first_p
 * is member 0, whose handle is the caller's. n 0 (kvw_sender_create_learn):
 * the first decode REQUEST for the room says how many members it has. */
kvw_status_t kvw__txset_create(kvw_engine_t *e, uint64_t room, uint32_t n, kvw_req_t **first_p);
kvw_status_t kvw__txset_init(kvw_txset_t *set, size_t num_pages, uint32_t aux_index);
kvw_status_t kvw__txset_send_part(kvw_txset_t *set, const kvw_part_t *part, void *event);
kvw_status_t kvw__txset_send(kvw_txset_t *set, const uint64_t *pages, size_t n, void *event);
kvw_status_t kvw__txset_send_state(kvw_txset_t *set, const uint64_t *state, size_t n,
                                   const kvw_state_list_t *lists, size_t num_lists);
kvw_poll_t kvw__txset_poll(kvw_txset_t *set);
kvw_status_t kvw__txset_failure(kvw_txset_t *set, const char **reason_p);
kvw_status_t kvw__txset_requested(kvw_txset_t *set, size_t *num_pages_p, uint32_t *aux_p);
kvw_status_t kvw__txset_metrics(kvw_txset_t *set, kvw_req_metrics_t *m);
kvw_status_t kvw__txset_abort(kvw_txset_t *set);
/* kvw_sender_set_digest on a set: the same digest for every member. */
kvw_status_t kvw__txset_set_digest(kvw_txset_t *set, uint64_t digest);
void kvw__txset_destroy(kvw_txset_t *set);
/* (lock) A member failed: fail the others (each tells its decode receiver
 * once its writes drained), keep the first reason. */
void kvw__txset_member_failed_locked(kvw_req_t *r);
/* (lock) The member of r's set that decode engine p's REQUEST m is for:
 * *r_p the member p claimed already (*resend: the same token), or one
 * nobody claimed; NULL and why when p claimed one with another token, or
 * every member is claimed, or m's decode receiver count disagrees with
 * the set's (which fails the room). A set still learning its count
 * learns it from m (members added: the one allocation per room). */
kvw_status_t kvw__txset_claim_locked(kvw_txset_t *set, const kvw_peer_t *p, const kvw_msg_t *m,
                                     kvw_req_t **r_p, bool *resend, char *why, size_t size);
/* (lock) The member of r's set that p claimed, else one nobody claimed,
 * else NULL (an ABORT from decode engine p). */
kvw_req_t *kvw__txset_member_of_locked(kvw_txset_t *set, const kvw_peer_t *p);
/* Poller: r left the poller's queues and none of its writes is in flight. */
void kvw__req_drained(kvw_req_t *r);
/* (lock) Plan the parts handed over so far (once decode's request is
 * known) and give the poller what it does not have. */
kvw_status_t kvw__sender_feed_locked(kvw_req_t *r);
/* (lock) The poller posted every part it has of a request that is not
 * complete: true if it should park it (starved) until the next part, false
 * if a part arrived meanwhile (poller-side s->next is then set) or it
 * failed meanwhile (the poller then drops it). */
bool kvw__sender_starve_locked(kvw_req_t *r);
/* (lock) Give a starved request back to the poller (it failed, or its
 * connection died): the poller retires it once its writes drained. */
void kvw__sender_unstarve_locked(kvw_req_t *r);
/* (lock) Check decode's request against local layout and the sender; r
 * must not have a request yet (the caller refuses a second claim). */
kvw_status_t kvw__sender_accept_request_locked(kvw_req_t *r, kvw_peer_t *peer, const kvw_msg_t *m,
                                               char *why, size_t why_size);
kvw_req_t *kvw__req_new_locked(kvw_engine_t *e, kvw_role_t role, uint64_t room);
/* (lock) Point r at p (or at no peer), keeping p->nreqs and the orphan
 * counts right. */
void kvw__req_attach_locked(kvw_req_t *r, kvw_peer_t *p);
/* (lock) r is no longer an orphan (a sender claimed it, or it ended). */
void kvw__req_unorphan_locked(kvw_req_t *r);
/* Take r off the engine's request list and drop the list's reference. */
void kvw__req_drop_locked(kvw_req_t *r);

/* reqtab.c (all under the lock) */
kvw_status_t kvw__reqtab_reserve_locked(kvw_engine_t *e);
void kvw__room_insert_locked(kvw_engine_t *e, kvw_req_t *r);
void kvw__room_remove_locked(kvw_engine_t *e, kvw_req_t *r);
kvw_req_t *kvw__req_find_locked(kvw_engine_t *e, kvw_role_t role, uint64_t room);
/* (lock) The next request of the same room and role after r in the room
 * table (several: a fan-out sender's members, or requests decode engines
 * sent ahead of it), NULL after the last. */
kvw_req_t *kvw__req_find_next_locked(kvw_req_t *r);
/* 0 removes r's deadline. Wakes the control thread if it is the earliest. */
void kvw__req_set_deadline_locked(kvw_req_t *r, uint64_t ns);
uint64_t kvw__next_deadline_locked(const kvw_engine_t *e);
kvw_req_t *kvw__pop_expired_locked(kvw_engine_t *e, uint64_t now);
/* Queue r for the control thread (once) and wake it. */
void kvw__req_touch_locked(kvw_req_t *r);
/* The caller owns a reference to what it pops. */
kvw_req_t *kvw__pop_work_locked(kvw_engine_t *e);
void kvw__reqtab_fini(kvw_engine_t *e);
/* Decode's token table: a receiver's slot, named by its last writes'
 * immediate. Alloc gives r a free slot with a new generation (so a late
 * immediate for a reused slot misses); lookup finds the receiver a token
 * names (NULL: none, or an older generation); release frees r's slot. */
kvw_status_t kvw__token_alloc_locked(kvw_engine_t *e, kvw_req_t *r);
kvw_req_t *kvw__token_lookup_locked(kvw_engine_t *e, uint32_t token);
void kvw__token_release_locked(kvw_engine_t *e, const kvw_req_t *r);

/* peer.c */
/* Verbs calls: never under the engine lock. */
/* nlanes lanes, lane i on rail rails[i] (NULL: decode's way, i modulo the
 * engine's rails, so each rail gets every nrails-th lane). */
kvw_status_t kvw__peer_create(kvw_engine_t *e, uint32_t nlanes, const uint8_t *rails,
                              kvw_peer_t **peer_p);
/* Decode: the lanes it offers, qps_per_peer on each rail (at most
 * KVW_MAX_LANES). */
uint32_t kvw__decode_lanes(const kvw_engine_t *e);
/* Every lane's QP to ERR: nothing more lands. Verbs: not under the lock. */
void kvw__peer_set_error(kvw_peer_t *p);
/* (lock) Give p a slot; KVW_ERR_LIMIT with the reason in why when
 * cfg.max_peers connections are live or every slot is still draining. */
kvw_status_t kvw__peer_publish_locked(kvw_engine_t *e, kvw_peer_t *p, char *why, size_t why_size);
/* Control thread: take dead peers nothing refers to any more out of their
 * slots, for the poller to free. */
void kvw__peers_unpublish_dead(kvw_engine_t *e);
/* Poller, at the start of a pass (it holds no peer pointer then): free the
 * unpublished peers. Verbs calls, outside the lock. */
void kvw__peers_reap(kvw_engine_t *e);
/* Teardown, threads stopped. */
void kvw__peers_destroy_all(kvw_engine_t *e);
void kvw__peer_destroy(kvw_peer_t *p);
kvw_status_t kvw__peer_accept_layout(kvw_peer_t *p, const kvw_msg_t *hello, char *why,
                                     size_t why_size);
void kvw__peer_hello(const kvw_peer_t *p, uint16_t type, kvw_msg_t *m_p);
kvw_status_t kvw__peer_post_recvs(kvw_peer_t *p, uint32_t n);
/* Handshake, control thread: connect p's lanes 0..n-1 to the peer's QPs
 * (remote[i]), remembered in each lane for a rejoin. A lane whose rail's
 * port is not up, or whose connect fails (RoCE cannot resolve the peer's
 * address while the link is down), is left out (*out, a lane bit mask)
 * when the connection can do without it: several rails, no staging, and
 * another rail's lane connected. Otherwise the first error, the lane and
 * rail in why. Verbs: not under the lock. */
kvw_status_t kvw__peer_connect_lanes(kvw_peer_t *p, const kvw_qp_info_t *remote, uint32_t n,
                                     uint32_t *out, char *why, size_t why_size);
/* Can p go on without `lane`: several rails, no stager (a staged slice's
 * chunk is reused once posted), and a lane on another rail that is not in
 * `down` (a lane bit mask). The failover's rule and the handshake's. */
bool kvw__peer_other_rail_up(const kvw_peer_t *p, uint32_t lane, uint32_t down);
/* Have the poller fail `lane` over before it posts again (take_down_lanes),
 * saying why (KVW_DOWN_*). Any thread; the caller wakes the poller. */
void kvw__lane_mark_down(kvw_peer_t *p, uint32_t lane, uint8_t why);
/* Decode: n receives on one lane (its rwrs), counted in recvs_posted;
 * *accepted_p: how many were posted (all, or those before a failing one). */
kvw_status_t kvw__lane_post_recvs(kvw_lane_t *l, uint32_t n, uint32_t *accepted_p);
/* Declare p dead (once): QP to ERR first, so nothing more lands, then fail
 * every request attached to it and have the control thread say BYE. Any
 * thread; kvw__peer_kill takes the lock. The _locked form, for callers
 * that hold it, leaves the QP and the rest to the control thread
 * (kvw__peer_finish_kills), so that no verbs call runs under the lock. */
void kvw__peer_kill(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void kvw__peer_kill_locked(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The other side went away (its process exited, or it said BYE): post
 * nothing new on p, let the writes already posted complete (one that
 * landed is a Success: decode may have read it and left), then kill p with
 * this reason; at the latest after one ACK timeout (qp_timeout), so that
 * no retransmission outlives the peer. Any thread. */
void kvw__peer_close(kvw_peer_t *p, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same when decode says CLOSING: its QPs stay up until our BYE, so the
 * posted writes get grace_ns to complete rather than one ACK timeout. */
void kvw__peer_close_within(kvw_peer_t *p, uint64_t grace_ns, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Poller: a closing peer with nothing in flight any more is killed. */
void kvw__peer_close_if_drained(kvw_peer_t *p, bool drained);
/* Move p from state `from` to `to`; false (and nothing changed) if p was
 * no longer in `from`, e.g. killed meanwhile. */
bool kvw__peer_transition(kvw_peer_t *p, kvw_peer_state_t from, kvw_peer_state_t to);
/* Control thread, without the lock: complete kills begun under it. */
void kvw__peer_finish_kills(kvw_engine_t *e);
/* The peer in slot i, or NULL (free slot). Any thread. */
static inline kvw_peer_t *kvw__peer_at(kvw_engine_t *e, uint32_t i)
{
    return atomic_load_explicit(&e->peers[i], memory_order_acquire);
}

/* control.c / poller.c */
/* poller.c: poll() of either side: r's state, after a pass on the caller's thread
 * when r is Transferring and the poller sleeps (kvw__poller_help). */
kvw_poll_t kvw__req_poll(const kvw_req_t *r);
/* poll() of a set of requests (rxset.c, txset.c): Success once every
 * member is; Failed once every member ended and one failed; until then
 * the least advanced live member's state (Transferring while a failed
 * member's siblings are still being failed). */
kvw_poll_t kvw__members_poll(kvw_req_t *const *m, uint32_t n);
/* request.c: what a set of requests (rxset.c, txset.c) ended with: the
 * first failure's status and reason, kept under the engine lock. */
typedef struct kvw_set_fate {
    bool failed; /* a member failed, or the caller aborted */
    kvw_status_t status;
    char reason[KVW_WIRE_REASON_MAX];
} kvw_set_fate_t;
/* (lock) Record the first failure; later ones keep it. */
void kvw__set_fail_locked(kvw_set_fate_t *f, kvw_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* failure() of a set in state `state` (kvw__members_poll): KVW_OK unless
 * Failed; then the first failure's status (KVW_ERR_ABORTED when no member
 * said why) and reason. Takes the engine lock. */
kvw_status_t kvw__set_failure(kvw_engine_t *e, kvw_poll_t state, const kvw_set_fate_t *f,
                              const char **reason_p);
/* (lock) Has any of the n members not ended yet? */
bool kvw__members_live(kvw_req_t *const *m, uint32_t n);
void *kvw__control_main(void *arg);
/* control.c: the control thread's state (e->ctl), before the control
 * socket opens; destroy also ends the registrar (safe on a NULL ctl). */
kvw_status_t kvw__ctl_create(kvw_engine_t *e);
void kvw__ctl_destroy(kvw_engine_t *e);
void *kvw__poller_main(void *arg);

#endif
