/* SPDX-License-Identifier: Apache-2.0 */
/* The rails' own state (src/engine/rails/): a lane's health (failed over,
 * its life, its way back), a connection's turn of lanes and the requests
 * held for decode's answer, and an engine rail's devices and counters.
 * Only types: the core header (engine/core.h) embeds them in the lane, the
 * peer and the engine; the rails' files (rails.h) own what is in them. */
#ifndef KVW_ENGINE_RAILS_STATE_H
#define KVW_ENGINE_RAILS_STATE_H

#include "ctrl/wire.h"
#include "verbs/device.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

enum {
    KVW_MAX_LANES = KVW_WIRE_MAX_QPS,
    KVW_MAX_RAILS = KVW_WIRE_MAX_RAILS, /* devices per engine (KVW_DEVICES) */
    /* Prefill's weighted turn over a connection's lanes (kvw_rails_t.sched):
     * a lane appears in it in proportion to its rail's link speed. */
    KVW_MAX_SCHED = 64,
};

struct kvw_req;

/* A lane's way back into its connection after it failed (rails, docs/
 * rails.md "A rail that comes back"). The state is handed between the
 * poller and the control thread through `rejoin`; the fields each state
 * lists belong to the thread that holds it. */
typedef enum {
    LANE_LIVE = 0, /* carries writes */
    /* Prefill. */
    LANE_DRAINING,   /* failed; the poller waits for its last completions */
    LANE_PAUSED,     /* drained; the control thread probes its port at probe_at_ns */
    LANE_RESETTING,  /* control: QP reset, LANE_RESET sent, LANE_READY awaited */
    LANE_PROBING,    /* connected again: the poller sends a zero-length write */
    LANE_PROBE_SENT, /* poller: that write landing brings the lane back */
    /* Decode. Verbs calls that may block (RTR resolves the peer's address)
     * are the control thread's, never the poller's. */
    LANE_RESET_DUE, /* prefill asked for a reset: the poller fails the QP and drains it */
    LANE_READY_DUE, /* drained: the control thread resets, connects, posts, says LANE_READY */
    LANE_BACK_DUE,  /* done: the poller takes the lane back */
} kvw_lane_rejoin_t;

/* A request's REPLAY_ASK (kvw_req_t.tx.ask, under the engine lock). */
enum {
    KVW_ASK_NONE = 0,
    KVW_ASK_DUE,  /* the poller holds it: the control thread sends the question */
    KVW_ASK_SENT, /* asked: the answer comes as one of KVW_WIRE_REPLAY_* + KVW_ASK_SENT */
};

/* Why a lane's down_due was set (prefill; the poller's failover says it). */
enum {
    KVW_DOWN_PORT = 0, /* our rail's port went down (async event) */
    KVW_DOWN_HELLO,    /* the handshake could not connect it */
    KVW_DOWN_PEER,     /* decode said its end is down (LANE_DOWN) */
};

/* One lane's health. The fields each kvw_lane_rejoin_t state lists belong
 * to the thread that holds it; the others as marked. */
typedef struct kvw_lane_health {
    bool dead; /* its QP failed and its rail has others: no more writes, nor turns, on it */
    /* Which life of the lane this is: 0 from the handshake, one more each
     * time it comes back after a failure (lane_in). Sequence numbers go on
     * across lives, and a rejoin makes the old life's flushed ones read as
     * completed, so a request's bookkeeping on the lane (last_seq, its bit
     * in lane_mask) means something only for the life it was made in. */
    uint32_t life;
    /* Its rail's port went down (control thread): the poller fails it over
     * before it posts again. */
    atomic_bool down_due;
    _Atomic uint8_t down_why; /* prefill: KVW_DOWN_*, set before down_due */
    /* Rejoining (kvw_lane_rejoin_t). */
    _Atomic int rejoin;
    uint32_t cooldown_ms; /* prefill: the wait before the next probe, growing */
    bool probe_early;     /* prefill: the current try was brought forward by a port event */
    uint64_t failed_ns;   /* prefill poller: when it failed (time to recover) */
    uint64_t rejoined_ns; /* prefill poller: when it last came back (flapping) */
    uint64_t reaped_upto; /* prefill poller: completions reaped after the failure, up to */
    uint64_t probe_seq;   /* prefill poller: the zero-length write's sequence number */
    uint64_t probe_at_ns, reset_deadline_ns; /* prefill control */
    _Atomic uint64_t imm_base;               /* prefill: imm_posted once drained, for LANE_RESET */
    /* decode: receives flushed since they were posted (poller counts,
     * the control thread restarts it when it reconnects the lane) */
    _Atomic uint32_t rq_flushed;
    bool err_set;      /* decode poller: the QP's current life was moved to ERR */
    uint32_t peer_psn; /* decode (lock): prefill's PSN of the lane's life (HELLO_ACK, LANE_RESET) */
    uint64_t peer_base; /* decode (lock): and its count of immediates */
} kvw_lane_health_t;

/* A connection's rails: the turn its lanes take chains in and what its
 * failed lanes need from the two threads. */
typedef struct kvw_rails {
    /* Prefill: the order lanes take chains in (lane indices, nsched of
     * them, each lane in proportion to its route's link speed), fixed by
     * the handshake less the dead lanes; next_lane is sched[sched_pos]
     * (poller). */
    uint8_t sched[KVW_MAX_SCHED];
    uint32_t nsched;
    uint32_t next_lane, sched_pos;
    /* The turn with every lane, as the handshake built it: a lane that
     * rejoins takes its turns back (sched is this less the dead lanes). */
    uint8_t sched_all[KVW_MAX_SCHED];
    uint32_t nsched_all;
    /* Lanes that need the control thread for their rejoin (prefill:
     * PAUSED, RESETTING; decode: READY_DUE), a bit each, and decode lanes
     * whose reset the poller owes (RESET_DUE). */
    _Atomic uint32_t rejoin_ctl, rejoin_poll;
    uint32_t dead_lanes;    /* poller: lanes failed over (kvw_lane_health_t.dead), a bit each */
    atomic_bool lanes_down; /* some lane's down_due is set */
    atomic_bool asks_due;   /* some request's ask is KVW_ASK_DUE */
    struct kvw_req *asking_head, *asking_tail; /* poller: waiting for decode's REPLAY_ANSWER */
} kvw_rails_t;

/* One of the engine's rails (KVW_DEVICES): its device with its PD, its
 * completion channel and link speed, fixed before the threads run, and
 * its counters. */
typedef struct kvw_engine_rail {
    kvw_dev_t *dev;
    struct ibv_comp_channel *channel;
    uint32_t mbps; /* link speed (0: unknown) */
    /* Work requests and bytes posted on it (prefill; the poller adds once
     * per pass and connection). */
    _Atomic uint64_t wrs, bytes;
    /* Lanes that failed, lanes that rejoined, lanes out of their
     * connection now, port probes, and the time from a lane's failure to
     * its rejoin (the last, the longest), in microseconds. */
    _Atomic uint64_t failed, rejoined, out, probes;
    _Atomic uint64_t recovery_us, recovery_max_us;
} kvw_engine_rail_t;

#endif
