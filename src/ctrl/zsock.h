/* Thin helpers to move kvwire messages over ZeroMQ sockets. */
#ifndef KVW_CTRL_ZSOCK_H
#define KVW_CTRL_ZSOCK_H

#include "ctrl/wire.h"

#include <stdbool.h>
#include <zmq.h>

/* Encode m straight into a zmq message and send it (flags: ZMQ_SNDMORE,
 * ZMQ_DONTWAIT). */
kvw_status_t kvw__zsend(void *sock, const kvw_msg_t *m, int flags);
/* Send a ROUTER identity frame followed by m. */
kvw_status_t kvw__zsend_to(void *sock, const void *id, size_t id_len, const kvw_msg_t *m);
/* Receive one frame (non-blocking with ZMQ_DONTWAIT) and decode it. The
 * decode error text lands in reason. KVW_ERR_NOT_FOUND when nothing was
 * waiting under ZMQ_DONTWAIT. */
kvw_status_t kvw__zrecv(void *sock, kvw_msg_t *m_p, int flags, char *reason, size_t reason_size);
/* Create a socket with the options every kvwire socket wants: no linger on
 * close, a bounded message size, and ZMTP heartbeats (a connection silent
 * for 4 heartbeats is closed, which its monitor reports). */
void *kvw__zsocket(void *zctx, int type, uint32_t heartbeat_ms);
/* A PAIR socket that receives sock's events in `events` (ZMQ_EVENT_*
 * bits), e.g. ZMQ_EVENT_DISCONNECTED: a peer process that exits closes its
 * TCP connection, and this sees it at once. name must be unique in the
 * context. NULL on failure. */
void *kvw__zmonitor(void *zctx, void *sock, const char *name, int events);
/* Stop sock's events, then close their reader. In that order: libzmq sends
 * events blocking, so a monitored socket that outlives its reader (linger,
 * reconnect attempts) would freeze the context's I/O thread. Accepts a
 * NULL monitor. */
void kvw__zmonitor_close(void *sock, void *monitor);
/* Read one pending monitor event without blocking: its ZMQ_EVENT_* id, or
 * 0 when none is waiting. */
int kvw__zmonitor_event(void *monitor);

/* Fault-injection seam for tests: when set, every message kvw__zsend is
 * about to send is offered to it first, and a true return drops it as if
 * the network lost it. Never set in production. */
typedef bool (*kvw_zdrop_fn)(void *sock, const kvw_msg_t *m);
extern _Atomic(kvw_zdrop_fn) kvw__zdrop_hook;
/* Ask the hook once; for senders that frame a message themselves. */
bool kvw__zdropped(void *sock, const kvw_msg_t *m);
/* kvw__zsend without asking the hook. */
kvw_status_t kvw__zsend_raw(void *sock, const kvw_msg_t *m, int flags);
/* "tcp://host:port" from "host:port" (or copy if it already has tcp://). */
void kvw__zendpoint(const char *addr, char *buf, size_t size);

#endif
