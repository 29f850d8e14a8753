/* SPDX-License-Identifier: Apache-2.0 */
/* Control-plane wire format: versioned, little-endian, length-checked binary
 * messages. Every field from the network is validated here, before any other
 * layer sees it. Pure: no I/O. */
#ifndef KVW_CTRL_WIRE_H
#define KVW_CTRL_WIRE_H

#include "kvwire.h"
#include "verbs/qp.h"

#define KVW_WIRE_MAGIC 0x3157564bu /* "KVW1" read little-endian */
/* 5: HELLO's groups carry their heads (head slicing); 6: REQUEST carries
 * an index list per state group; 7: REQUEST carries the head range decode
 * asks this prefill rank for (decode over several ranks); 8: decode's
 * HELLO advertises its landing buffer, and REQUEST may ask for the heads
 * in a slice of it (an offset); 9: HELLO carries the sender's rails
 * (devices): each QP's rail, each rail's link speed, and every region's
 * rkey on each rail; 10: LANE_RESET / LANE_READY bring a lane that failed
 * back into its connection, REPLAY_ASK / REPLAY_ANSWER, LANE_DOWN, LANE_UP;
 * 11: LANE_DOWN and LANE_UP name the lane's life (prefill's PSN), REPLAY_ASK
 * never asks about the last epoch; DIGEST, and REQUEST's flag
 * KVW_WIRE_REQ_VERIFY (config verify);
 * CLOSING, the orderly end of a connection; 12: HELLO and HELLO_ACK carry
 * an offer (the lowest and highest version the sender speaks, its
 * capabilities), and a connection speaks the highest version both ends
 * speak with the capabilities both have (docs/control-plane.md,
 * "Versions and capabilities"); a version-12 REQUEST may say how many
 * decode receivers ask for the room (KVW_WIRE_REQ_RECEIVERS, capability
 * KVW_WIRE_CAP_FANOUT). */
#define KVW_WIRE_VERSION 12     /* the newest version this build speaks */
#define KVW_WIRE_VERSION_MIN 11 /* the oldest: 1.4.0's, which demands its own exactly */
/* A message's header names the version of its own format: every message
 * whose layout is unchanged since 11 is written as 11 (what a 1.4.0 peer
 * reads), HELLO and HELLO_ACK in the version their sender chose. */
#define KVW_WIRE_VERSION_BASE 11
/* Capabilities: features a peer may lack. A connection uses one only when
 * both ends offer it; a wire-11 peer (1.4.x, no offer) has every one of
 * these. Bits this build does not know are ignored. */
enum {
    KVW_WIRE_CAP_VERIFY = 1u,  /* REQUEST's KVW_WIRE_REQ_VERIFY and DIGEST (config verify) */
    KVW_WIRE_CAP_CLOSING = 2u, /* CLOSING, the orderly end of a connection */
    KVW_WIRE_CAP_LANDING = 4u, /* decode's landing buffer (KVW_WIRE_HEADS_LANDING) */
    KVW_WIRE_CAP_HEADS = 8u,   /* head slicing: REQUEST's head range (KVW_WIRE_HEADS_RANGE) */
    /* Wire 12: REQUEST's decode receiver count (KVW_WIRE_REQ_RECEIVERS) */
    KVW_WIRE_CAP_FANOUT = 16u,
    /* Since 1.5: decode's HELLO may carry a learning group (below,
     * kvw_wire_group_t), whose heads prefill derives as decode will. */
    KVW_WIRE_CAP_LEARN_HEADS = 32u,
    KVW_WIRE_CAPS_V11 = 15u, /* what every wire-11 peer has */
    KVW_WIRE_CAPS_ALL = 63u, /* every capability this build has */
};
/* The versions one side speaks and its capabilities (max 0: no offer). */
typedef struct kvw_wire_offer {
    uint16_t min, max;
    uint32_t caps;
} kvw_wire_offer_t;
/* How a wire-11 HELLO carries an offer: as its reason string, which 1.4.0
 * reads and ignores in a HELLO that is not a refusal ("kvwire-offer 11..12
 * caps 0x0000003f"). */
#define KVW_WIRE_OFFER_TEXT "kvwire-offer "
#define KVW_WIRE_HEADER_LEN 12
#define KVW_WIRE_ENDPOINT_MAX 128 /* including the NUL */
#define KVW_WIRE_REASON_MAX 160
#define KVW_WIRE_MAX_REGIONS 16384 /* every buffer group's regions together */
#define KVW_WIRE_MAX_GROUPS 64
#define KVW_WIRE_MAX_QPS 16  /* QPs per connection (KVW_QPS_PER_PEER) */
#define KVW_WIRE_MAX_RAILS 4 /* devices per engine (KVW_DEVICES) */
/* The immediate of a request's last writes: its token in the low 26 bits,
 * the attempt (epoch) in the next 2, and how many QPs carry one (each that
 * carried part of it), less one, in the top 4. Decode reports the request
 * landed once all of them of its latest epoch arrived. Wire 9: prefill
 * replays a request's writes on other lanes when a rail fails (epoch + 1);
 * decode then forgets the immediates of earlier epochs. */
#define KVW_WIRE_TOKEN_MASK 0x03ffffffu
#define KVW_WIRE_IMM_EPOCH_SHIFT 26
#define KVW_WIRE_IMM_EPOCH_MASK 3u
#define KVW_WIRE_IMM_COUNT_SHIFT 28
#define KVW_WIRE_MAX_PAGES (1u << 22) /* 4 Mi page and state indices per request */
/* REQUEST's head range (wire 7): flags, first head, head count; then
 * (wire 8) the landing offset. */
#define KVW_WIRE_HEADS_LEN 20u
enum {
    /* The request names a head range: prefill sends decode's heads [first,
     * first + count) of every described KV group (count 0: none, it owes
     * nothing); without it, all of decode's heads. */
    KVW_WIRE_HEADS_RANGE = 1u,
    /* Another prefill rank sends the aux item and the state: this rank's
     * aux_index and state list are empty whatever its sender declares. */
    KVW_WIRE_HEADS_NO_REST = 2u,
    /* Wire 8: write the heads contiguously into decode's landing buffer
     * (its HELLO's), from landing_off on, instead of into decode's rows:
     * KV slot i (layer-major, kv_per_layer a layer) of the request at
     * landing_off + i * pages * slice per page, page position k of it at
     * k * slice per page. Needs RANGE with a count above 0. */
    KVW_WIRE_HEADS_LANDING = 4u,
    /* Wire 11, not about heads (the REQUEST's one flags word): decode
     * checks the request's bytes (config verify) and waits for prefill's
     * DIGEST; prefill must verify too, or the request fails. */
    KVW_WIRE_REQ_VERIFY = 8u,
    /* Wire 12 (capability KVW_WIRE_CAP_FANOUT), a version-12 REQUEST only:
     * room_receivers follows the state lists, how many decode receivers
     * ask this prefill rank for the room (1..KVW_MAX_DECODE_RECEIVERS). */
    KVW_WIRE_REQ_RECEIVERS = 16u,
    KVW_WIRE_HEADS_FLAGS = 31u, /* every known flag */
};
/* REPLAY_ANSWER's answers. */
enum {
    KVW_WIRE_REPLAY_AGAIN = 1, /* not completed: replay it under the next epoch */
    KVW_WIRE_REPLAY_DONE = 2,  /* completed: every write of the attempt landed */
    KVW_WIRE_REPLAY_GONE = 3,  /* decode no longer has it (failed, destroyed) */
};
/* The largest valid message (a REQUEST of KVW_WIRE_MAX_PAGES pages): ZeroMQ
 * drops anything longer before we buffer it. */
#define KVW_WIRE_MAX_MSG                                                                           \
    (KVW_WIRE_HEADER_LEN + 24u + KVW_WIRE_HEADS_LEN + 8u * KVW_WIRE_MAX_PAGES +                    \
     KVW_WIRE_STATE_LISTS_MAX_LEN + 4u)
/* REQUEST's state lists (after its indices): a count, then one count of
 * indices per state group. */
#define KVW_WIRE_STATE_LISTS_MAX_LEN (4u + 4u * KVW_WIRE_MAX_GROUPS)

typedef enum {
    KVW_MSG_BS_REGISTER = 1,     /* prefill -> bootstrap: rank, endpoint, engine id */
    KVW_MSG_BS_REGISTER_ACK = 2, /* bootstrap -> prefill: status */
    KVW_MSG_BS_LOOKUP = 3,       /* decode -> bootstrap: rank */
    KVW_MSG_BS_LOOKUP_REPLY = 4, /* bootstrap -> decode: status, endpoint */
    KVW_MSG_BS_UNREGISTER = 5,   /* prefill -> bootstrap: rank, engine id; no reply */
    KVW_MSG_HELLO = 10,          /* decode -> prefill: QP info + memory table */
    KVW_MSG_HELLO_ACK = 11,      /* prefill -> decode: status, QP info + memory table */
    KVW_MSG_REQUEST = 20,        /* decode -> prefill: room, token, aux, dst pages */
    /* prefill -> decode: room, token, status, reason. Sent only once every
     * write prefill posted for the room has completed (or none was posted),
     * so decode may report Failed and reuse the pages at once. */
    KVW_MSG_REQUEST_FAILED = 21,
    /* decode -> prefill: room, token, status, reason. Decode gives the room
     * up; prefill stops and answers REQUEST_FAILED once its writes drained. */
    KVW_MSG_ABORT = 22,
    KVW_MSG_PING = 30, /* decode -> prefill: liveness */
    KVW_MSG_PONG = 31,
    KVW_MSG_CREDIT = 32, /* decode -> prefill: receives posted so far per QP (cumulative) */
    KVW_MSG_BYE = 33,    /* either way: status, reason; the connection is dead */
    /* Wire 10, a lane (QP) that failed rejoins its connection: prefill,
     * its QP reset, asks decode to reset its end (LANE_RESET: the lane,
     * prefill's new PSN, the immediates it posted there in all); decode
     * answers once its QP is connected again and its receives posted
     * (LANE_READY: its new PSN, prefill's echoed, receives posted in all). */
    KVW_MSG_LANE_RESET = 34,
    KVW_MSG_LANE_READY = 35,
    /* Wire 10, a replay after a lane failed while a request's final
     * immediate was on it: prefill asks whether decode completed the
     * attempt (REPLAY_ASK: room, token, epoch); decode answers
     * (REPLAY_ANSWER: KVW_WIRE_REPLAY_*) and, before it answers "replay",
     * stops counting that attempt's immediates. */
    KVW_MSG_REPLAY_ASK = 36,
    KVW_MSG_REPLAY_ANSWER = 37,
    /* Wire 10, decode -> prefill: its end of a lane is down (its port went
     * down, the handshake or a reset prefill asked for could not connect
     * it): prefill fails the lane over now instead of learning it from its
     * writes running out of retries, or pauses a rejoin at once (the lane
     * in `lane.qp`; wire 11: `lane.peer_psn`, prefill's PSN on the lane
     * decode last heard, names the lane's life or reset try, and prefill
     * drops one of another; the other fields 0). */
    KVW_MSG_LANE_DOWN = 38,
    /* Wire 10, decode -> prefill: its port on the lane's rail came up
     * again (IBV_EVENT_PORT_ACTIVE): a paused lane there is probed now
     * rather than after its cooldown (the lane in `lane.qp`, `lane.peer_psn`
     * as LANE_DOWN's; the other fields 0). */
    KVW_MSG_LANE_UP = 39,
    /* Wire 11, prefill -> decode: the digest of what prefill wrote for a
     * request decode asked to verify (KVW_WIRE_REQ_VERIFY), sent once every
     * write of it completed (room, token, the attempt that completed it,
     * the digest). The same for every attempt: a replay writes the same
     * bytes. */
    KVW_MSG_DIGEST = 40,
    /* Wire 11, decode -> prefill: status, reason (the body of BYE).
     * Decode's engine is going: prefill posts nothing more on the
     * connection, lets what it posted complete (its QPs stay up at decode
     * meanwhile, so every ACK can still come), then ends the connection
     * with BYE, which is decode's cue to tear its QPs down. */
    KVW_MSG_CLOSING = 41,
} kvw_msg_type_t;

/* One buffer group (kvw_group_t) as a peer sees it, with its heads
 * (kvw_group_heads_t; total_heads 0: not described). A decode HELLO's
 * learning group (KVW_WIRE_CAP_LEARN_HEADS offered; its heads come from
 * prefill's: include/kvwire.h) is total_heads 0 and head_bytes 0 with
 * page_tokens above 0 and its page_order; first_head then carries
 * decode's attention TP rank and num_heads its TP size, from which prefill
 * derives decode's heads (kvw__heads_learn) exactly as decode does from
 * the HELLO_ACK. The layout of the message is wire 11's: a 1.4.x prefill
 * reads the group as undescribed. */
typedef struct kvw_wire_group {
    uint8_t kind;
    uint32_t num_layers, per_layer;
    uint32_t total_heads, first_head, num_heads, head_bytes, page_tokens, page_order;
} kvw_wire_group_t;

/* One registered region as a peer sees it: one rkey per rail (the
 * region is registered on every device of the engine, each with its own
 * PD); rkey is rail 0's, rail_rkeys[r - 1] rail r's. */
typedef struct kvw_wire_region {
    uint64_t addr, len, item_len;
    uint32_t rkey;
    uint32_t rail_rkeys[KVW_WIRE_MAX_RAILS - 1];
} kvw_wire_region_t;

/* The rkey of region g on rail `rail` (< the HELLO's num_rails). */
static inline uint32_t kvw__wire_region_rkey(const kvw_wire_region_t *g, uint32_t rail)
{
    return rail ? g->rail_rkeys[rail - 1] : g->rkey;
}

typedef struct kvw_msg {
    uint16_t type;
    /* The header's version: decode sets it; encode writes it, or
     * KVW_WIRE_VERSION_BASE when 0. */
    uint16_t version;
    int32_t status; /* BS_REGISTER_ACK, BS_LOOKUP_REPLY, HELLO_ACK, REQUEST_FAILED, ABORT, BYE,
                     * CLOSING */
    union {
        struct {
            uint32_t rank;
            uint64_t engine_id;                   /* REGISTER, UNREGISTER: the rank's owner */
            char endpoint[KVW_WIRE_ENDPOINT_MAX]; /* REGISTER, LOOKUP_REPLY */
        } bs;
        struct {
            uint64_t engine_id;
            uint32_t num_qps; /* 1..KVW_WIRE_MAX_QPS (0 in a refusal) */
            kvw_qp_info_t qps[KVW_WIRE_MAX_QPS];
            uint32_t num_groups;
            kvw_wire_group_t groups[KVW_WIRE_MAX_GROUPS];
            uint32_t recv_credits; /* decode: receives posted per QP for immediates */
            uint32_t max_msg_sz;   /* largest RDMA message the sender's port takes */
            /* Wire 8, decode: its landing buffer (len 0: none; prefill
             * sends none) */
            uint64_t landing_addr, landing_len;
            uint32_t landing_rkey;
            /* Wire 9, rails: the sender's devices (0 is encoded as 1), the
             * rail of each QP (< num_rails), and each rail's link speed in
             * Mb/s (ibv_query_port's active_speed x active_width; 0:
             * unknown), which weighs the striping. */
            uint32_t num_rails;
            uint8_t qp_rail[KVW_WIRE_MAX_QPS];
            uint32_t rail_mbps[KVW_WIRE_MAX_RAILS];
            char reason[KVW_WIRE_REASON_MAX]; /* HELLO_ACK refusal: why */
            /* Wire 12: the sender's versions and capabilities (in a
             * version-11 message, carried as the reason; max 0: none, 1.4.0's
             * bytes, see kvw__wire_hello_offer()). A refusal's is not read. */
            kvw_wire_offer_t offer;
            kvw_wire_region_t *regions; /* every group's, in order; owned by the msg */
        } hello;
        struct {
            uint64_t room;
            uint32_t
                token; /* decode's id for the request (KVW_WIRE_TOKEN_MASK), in the immediate */
            uint32_t aux_index;
            uint32_t num_pages;
            uint32_t num_state;
            /* Head slicing over several prefill ranks (wire 7): KVW_WIRE_HEADS_*
             * flags and the range; all 0 for a request of all decode's heads. */
            uint32_t heads_flags, head_first, head_count;
            uint64_t landing_off; /* wire 8: with KVW_WIRE_HEADS_LANDING, else 0 */
            uint64_t *pages;      /* num_pages, then num_state state indices; owned by the msg */
            /* Wire 6, state lists: the num_state indices are state group
             * 0's state_counts[0], then group 1's, ... (num_state_lists
             * groups, their counts summing to num_state). */
            uint32_t num_state_lists;
            uint32_t state_counts[KVW_WIRE_MAX_GROUPS];
            /* Wire 12, with KVW_WIRE_REQ_RECEIVERS: the decode receivers
             * that ask this prefill rank for the room (this one
             * included); 0 without the flag (not said). */
            uint32_t room_receivers;
        } request;
        struct {
            uint64_t room;
            uint32_t token;
            char reason[KVW_WIRE_REASON_MAX];
        } failed; /* REQUEST_FAILED, ABORT, BYE, CLOSING (room and token unused in the last two) */
        struct {
            uint64_t engine_id;
        } ping;
        struct {
            uint32_t num_qps;
            uint64_t recvs_posted[KVW_WIRE_MAX_QPS];
        } credit;
        struct {
            uint32_t qp;       /* the lane: its index in HELLO's QPs (< KVW_WIRE_MAX_QPS) */
            uint32_t psn;      /* the sender's new PSN on it */
            uint32_t peer_psn; /* LANE_READY: the PSN of the LANE_RESET it answers */
            uint64_t count;    /* RESET: immediates posted in all; READY: receives posted */
        } lane;
        struct {
            uint64_t room;
            uint32_t token;  /* <= KVW_WIRE_TOKEN_MASK */
            uint32_t epoch;  /* the attempt asked about, < KVW_WIRE_IMM_EPOCH_MASK */
            uint32_t answer; /* ANSWER: KVW_WIRE_REPLAY_*; ASK: 0 */
        } replay;
        struct {
            uint64_t room;
            uint32_t token; /* <= KVW_WIRE_TOKEN_MASK */
            uint32_t epoch; /* <= KVW_WIRE_IMM_EPOCH_MASK */
            uint64_t value;
        } digest;
    } u;
} kvw_msg_t;

/* The offer of a HELLO or HELLO_ACK that is no refusal: a message without
 * one is a 1.4.x peer's, which speaks 11 alone and has every wire-11
 * capability. */
static inline kvw_wire_offer_t kvw__wire_hello_offer(const kvw_msg_t *m)
{
    return m->u.hello.offer.max ? m->u.hello.offer : (kvw_wire_offer_t){11, 11, KVW_WIRE_CAPS_V11};
}

/* Regions a HELLO's groups describe (UINT64_MAX if a group's count
 * overflows). */
uint64_t kvw__wire_hello_regions(const kvw_msg_t *m);
/* Bytes kvw__wire_encode() will write for m. */
size_t kvw__wire_size(const kvw_msg_t *m);
/* Encode m into buf (cap bytes). KVW_ERR_INVALID if it does not fit or m
 * breaks a limit. */
kvw_status_t kvw__wire_encode(const kvw_msg_t *m, uint8_t *buf, size_t cap, size_t *len_p);
/* Decode and validate. On success *m_p may own arrays: free with
 * kvw__wire_free(). On failure nothing is allocated and, if reason is not
 * NULL, it says what was wrong. */
kvw_status_t kvw__wire_decode(const uint8_t *buf, size_t len, kvw_msg_t *m_p, char *reason,
                              size_t reason_size);
void kvw__wire_free(kvw_msg_t *m);
/* The capability a REQUEST uses that caps (a connection's) lacks, by its
 * name ("verify", "landing buffer", "head slicing", "the decode receiver
 * count"), or NULL. */
const char *kvw__wire_request_lacks(const kvw_msg_t *m, uint32_t caps);
/* Agree on a connection: the highest version both offers speak and the
 * capabilities both have (agreed->min == agreed->max == that version). No
 * common version: KVW_ERR_MISMATCH, and why names both ranges (ours as
 * our_role's, theirs as their_role's). */
kvw_status_t kvw__wire_agree(const kvw_wire_offer_t *ours, const kvw_wire_offer_t *theirs,
                             const char *our_role, const char *their_role, kvw_wire_offer_t *agreed,
                             char *why, size_t why_size);
const char *kvw__wire_type_name(uint16_t type);

#endif
