/* SPDX-License-Identifier: Apache-2.0 */
/* The control thread's pieces: control.c runs the loop (sockets, timers),
 * ctl_frame.c the framing; ctl_prefill.c and ctl_decode.c hold each role's
 * handlers.
 * Everything here runs on the control thread only, the engine's one user
 * of ZeroMQ; functions marked (lock) need engine->lock held. */
#ifndef KVW_ENGINE_CONTROL_H
#define KVW_ENGINE_CONTROL_H

#include "engine/core.h"

enum {
    KVW_CTL_MAX_ID = 255, /* ZeroMQ routing ids are at most 255 bytes */
};

/* The control thread's state: only the control thread reads or writes it
 * while the engine runs (engine.c creates it before the thread starts and
 * frees it after the thread ended). */
typedef struct kvw_ctl {
    struct kvw_registrar *registrar; /* prefill with a bootstrap address; NULL: none */
    uint64_t probe_until_ns;         /* probe peers' connections until then */
    /* Router connections that failed their ZMTP (CURVE) handshake and
     * whose DISCONNECTED has not come yet: those closings concern no peer
     * and start no probe (kvw__prefill_on_monitor). */
    uint64_t unhandshaken_closes;
    /* Prefill: connections whose decode engine said CLOSING and got our
     * BYE, which it closes next: those closings start no probe either
     * (each DISCONNECTED takes one), until closes_expected_until_ns (a
     * count never matched must not hide a crashed peer for long). */
    uint64_t closes_expected, closes_expected_until_ns;
    /* Prefill: HELLOs received and not yet served, in arrival order from
     * hellos[hello_head] (ctl_prefill.c, max_handshakes). */
    struct kvw_pending_hello *hellos;
    uint32_t hello_head, hello_count, hello_cap;
    uint32_t next_serial;   /* the next peer's serial (never reused) */
    kvw_ratelog_t drop_log; /* the log lines of dropped messages (e->drops) */
} kvw_ctl_t;

/* The earlier of two due times, 0 meaning none. */
static inline uint64_t kvw__earliest(uint64_t a, uint64_t b)
{
    return !a ? b : !b ? a : a < b ? a : b;
}

/* ctl_frame.c */
/* REQUEST_FAILED, ABORT or BYE carrying an error status and a reason. */
kvw_msg_t kvw__failure_msg(uint16_t type, uint64_t room, uint32_t token, kvw_status_t st,
                           const char *why);

/* Receive one whole ROUTER message: the identity frame and exactly one
 * body frame (kvw__zrecv). Anything else (extra or missing frames, an
 * undecodable body) is dropped whole and counted, with at most one log
 * line per second. KVW_OK with *m_p to free, KVW_ERR_PROTOCOL for one
 * message dropped (the caller counts it against its batch, so that a flood
 * of garbage cannot hold the control loop here), or KVW_ERR_NOT_FOUND when
 * nothing is waiting. A DEALER's messages come through kvw__zrecv. */
kvw_status_t kvw__ctl_recv_routed(kvw_engine_t *e, void *sock, uint8_t *id, size_t *id_len,
                                  kvw_msg_t *m_p);
/* Send m to a ROUTER peer; an unroutable identity (its connection is gone)
 * is counted and logged at most once per second. */
kvw_status_t kvw__ctl_route(kvw_engine_t *e, const uint8_t *id, size_t id_len, const kvw_msg_t *m);
/* Count one dropped message and log (rate-limited) why. */
void kvw__ctl_dropped(kvw_engine_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ctl_prefill.c */
void kvw__prefill_serve_router(kvw_engine_t *e);
void kvw__prefill_on_monitor(kvw_engine_t *e);
/* Queued handshakes (max_handshakes per call), heartbeat limits and
 * connection probes; returns when it next needs to run. */
uint64_t kvw__prefill_peers_tick(kvw_engine_t *e, uint64_t now);
/* (lock) Serve a touched or expired request; true when it leaves the table. */
bool kvw__prefill_service_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now);
/* Free the HELLOs still queued (the control thread is gone). */
void kvw__prefill_fini_handshakes(kvw_engine_t *e);
void kvw__prefill_say_bye(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *bye);

/* ctl_decode.c */
void kvw__decode_on_bootstrap(kvw_engine_t *e, kvw_peer_t *p);
void kvw__decode_on_message(kvw_engine_t *e, kvw_peer_t *p);
void kvw__decode_on_monitor(kvw_engine_t *e, kvw_peer_t *p);
uint64_t kvw__decode_peers_tick(kvw_engine_t *e, uint64_t now);
bool kvw__decode_service_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t now);
/* Create the connections that receivers served under the lock asked for
 * (verbs calls: without the lock). */
void kvw__decode_connect_pending(kvw_engine_t *e);
void kvw__decode_say_bye(kvw_engine_t *e, kvw_peer_t *p, const kvw_msg_t *bye);
/* The engine is going (the control loop ended): say CLOSING on every
 * connected peer and serve their sockets until each answered with BYE
 * (prefill has the completions of every write it posted to us), closed,
 * or peer_timeout_ms and a heartbeat passed. The QPs stay up meanwhile. */
void kvw__decode_close_all(kvw_engine_t *e);
void kvw__decode_fini(kvw_engine_t *e);

#endif
