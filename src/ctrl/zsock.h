/* SPDX-License-Identifier: Apache-2.0 */
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
/* Receive one whole message (non-blocking with ZMQ_DONTWAIT), which must
 * be exactly one frame, and decode it. A message of more frames is
 * consumed whole and refused (KVW_ERR_PROTOCOL). The error text lands in
 * reason. KVW_ERR_NOT_FOUND when nothing was waiting under ZMQ_DONTWAIT.
 * After a ROUTER's identity frame, this receives the body that follows. */
kvw_status_t kvw__zrecv(void *sock, kvw_msg_t *m_p, int flags, char *reason, size_t reason_size);
/* Whether the frame just received has more frames after it. */
bool kvw__zmore(void *sock);
/* Receive and drop what is left of the current message; how many frames. */
int kvw__zskip_rest(void *sock);
enum {
    KVW_ZSOCK_HWM = 256,           /* messages received and queued per connection */
    KVW_ZSOCK_SEND_HWM = 1u << 17, /* messages of ours queued per connection */
};

/* Create a socket with the options every kvwire socket wants: no linger on
 * close, messages no larger than the largest valid one, bounded queues,
 * unroutable ROUTER replies reported (ZMQ_ROUTER_MANDATORY), and no ZMTP
 * heartbeats (heartbeat_ms is unused; liveness is the engines' own). */
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

/* ------------------------------------------------------------ security
 *
 * Opt-in ZeroMQ CURVE with one cluster key: a CURVE secret key shared by
 * every party of a deployment. Each derives the public key from it. Server
 * sockets (ROUTER: an engine's control socket, the bootstrap service) use
 * the secret as their own; clients (DEALER) use the cluster pair as their
 * own and the cluster public key as the server's. A ZAP handler on the
 * server's context admits only clients that prove they hold the cluster
 * secret, so knowing a server's public key is not enough. Everything on a
 * secured connection is encrypted and authenticated. */

#define KVW_ZKEY_Z85_LEN 40 /* a 32-byte key in Z85 */

typedef struct kvw_zsecurity kvw_zsecurity_t;

/* Read a cluster key file (kvw-keygen's format: '#' comment lines and blank
 * lines, then exactly one line holding the 40-character Z85 key) into
 * key_z85 (41 bytes). KVW_ERR_INVALID, logged with the path and what is
 * wrong, when it cannot be read or holds no valid key; a file others may
 * read is accepted with a warning. */
kvw_status_t kvw__zkey_read_file(const char *path, char key_z85[KVW_ZKEY_Z85_LEN + 1]);
/* Write a fresh random cluster key to path (mode 0600, created: EEXIST
 * unless overwrite). 0 or an errno value. key_z85_p (41 bytes) receives
 * the key when not NULL. */
int kvw__zkey_write_file(const char *path, bool overwrite, char *key_z85_p);

/* Security for the sockets of one ZeroMQ context, from cfg's cluster_key /
 * cluster_key_file. *sec_p = NULL when neither is set: plain sockets, as
 * before. serve: the context will hold server (ROUTER) sockets, so start
 * its ZAP handler (a small thread, bound before this returns; at most one
 * per context). KVW_ERR_INVALID for a bad key or file, KVW_ERR_UNSUPPORTED
 * when libzmq lacks CURVE; both logged. Call before creating any socket
 * that should be secured; destroy before zmq_ctx_term(zctx), which would
 * otherwise wait for the handler's socket forever. */
kvw_status_t kvw__zsecurity_create(void *zctx, const kvw_config_t *cfg, bool serve,
                                   kvw_zsecurity_t **sec_p);
/* The same from a Z85 key (NULL or "": *sec_p = NULL, security off). */
kvw_status_t kvw__zsecurity_create_key(void *zctx, const char *key_z85, bool serve,
                                       kvw_zsecurity_t **sec_p);
/* Stop the ZAP handler and free. Accepts NULL. */
void kvw__zsecurity_destroy(kvw_zsecurity_t *sec);
/* Connections the ZAP handler refused since creation (wrong key). */
uint64_t kvw__zsecurity_refused(const kvw_zsecurity_t *sec);

/* kvw__zsocket, secured by sec when it is not NULL: ZMQ_ROUTER becomes a
 * CURVE server, any other type a CURVE client. Set before bind/connect, as
 * here, or the options do not apply. NULL on failure (logged). The socket
 * belongs to the caller's thread like any other; sec may be shared by
 * every thread of the context (it is read only). */
void *kvw__zsocket_secure(void *zctx, int type, uint32_t heartbeat_ms, const kvw_zsecurity_t *sec);

#endif
