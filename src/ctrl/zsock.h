/* Thin helpers to move kvwire messages over ZeroMQ sockets. */
#ifndef KVW_CTRL_ZSOCK_H
#define KVW_CTRL_ZSOCK_H

#include "ctrl/wire.h"

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
 * close, a bounded message size, and ZMTP heartbeats. */
void *kvw__zsocket(void *zctx, int type, uint32_t heartbeat_ms);
/* "tcp://host:port" from "host:port" (or copy if it already has tcp://). */
void kvw__zendpoint(const char *addr, char *buf, size_t size);

#endif
