/* SPDX-License-Identifier: Apache-2.0 */
/* Bootstrap directory: prefill engines publish their control endpoint under
 * their rank; decode engines look it up. No fixed ports anywhere.
 *
 * A registration has an owner (the registering engine's id) and a lease:
 * the owner refreshes it every refresh interval; another engine may take
 * the rank only once the lease ran out (its owner died without saying
 * UNREGISTER) or after the owner unregistered. A restarted service is
 * repopulated by the refreshes within about one interval. */
#ifndef KVW_CTRL_BOOTSTRAP_H
#define KVW_CTRL_BOOTSTRAP_H

#include "ctrl/zsock.h"

/* ------------------------------------------------------------ registrar
 *
 * Prefill's side: keeps rank -> endpoint registered at one bootstrap
 * service, without blocking. Owned by one thread (the engine's control
 * thread once it runs); nothing here is thread-safe. */
typedef struct kvw_registrar kvw_registrar_t;

/* A DEALER to bootstrap_addr ("host:port"), secured by sec (NULL: plain).
 * Sends nothing yet. KVW_ERR_CONTROL (logged) if the socket cannot be
 * made. */
kvw_status_t kvw__registrar_create(void *zctx, const kvw_zsecurity_t *sec,
                                   const char *bootstrap_addr, uint32_t rank, const char *endpoint,
                                   uint64_t engine_id, uint32_t refresh_ms,
                                   kvw_registrar_t **registrar_p);
/* Register now and wait for the answer, at most timeout_ms: for engine
 * creation, which should fail when the service cannot be reached. A rank
 * held by another engine is retried until that engine's lease could have
 * run out (a restarted prefill taking over from its dead predecessor),
 * then refused with KVW_ERR_EXISTS. KVW_ERR_TIMEOUT without an answer.
 * Failures are logged with the rank and address. */
kvw_status_t kvw__registrar_register(kvw_registrar_t *r, uint32_t timeout_ms);
/* The socket to zmq_poll for ZMQ_POLLIN; then call on_readable. */
void *kvw__registrar_socket(const kvw_registrar_t *r);
/* Consume the service's answers without blocking; a refusal is logged
 * once (and its end, when the rank is ours again). */
void kvw__registrar_on_readable(kvw_registrar_t *r);
/* Send REGISTER when it is due (every refresh_ms; a send that cannot go
 * out now is retried at the next interval). Returns the monotonic time
 * (ns, CLOCK_MONOTONIC) of the next due send, so the caller can sleep
 * until then. */
uint64_t kvw__registrar_tick(kvw_registrar_t *r, uint64_t now_ns);
/* The service's last answer: KVW_OK, KVW_ERR_EXISTS while another engine
 * holds the rank, KVW_ERR_NOT_FOUND before any answer. */
kvw_status_t kvw__registrar_status(const kvw_registrar_t *r);
/* Close; with unregister, first send UNREGISTER (best effort: it waits at
 * most a short linger in zmq_ctx_term). Accepts NULL. */
void kvw__registrar_destroy(kvw_registrar_t *r, bool unregister);

/* One blocking registration as engine_id (kvw__registrar_register on a
 * temporary registrar). */
kvw_status_t kvw__bootstrap_register_as(void *zctx, const kvw_zsecurity_t *sec,
                                        const char *bootstrap_addr, uint32_t rank,
                                        const char *endpoint, uint64_t engine_id,
                                        uint32_t timeout_ms);

#endif
