/* SPDX-License-Identifier: Apache-2.0 */
/* The fleet registry: where prefill ranks are found when KVW_REGISTRY
 * names an external store instead of kvwire's own bootstrap service
 * (bootstrap.h, the default). One backend today: etcd v3, spoken through
 * its gRPC JSON gateway (registry_etcd.c; docs/control-plane.md, "A
 * registry on etcd"). Built only with libcurl and json-c (make ETCD=1, or
 * found by pkg-config); without them KVW_REGISTRY is refused at engine
 * creation and nothing else changes.
 *
 * Prefill: kvw__registry_register puts rank -> endpoint under a lease and
 * a thread of the registry's own keeps the lease alive (and puts the key
 * again if the lease was lost). Decode: kvw__registry_watch reads every
 * rank once and a thread of its own follows changes, so kvw__registry_lookup
 * answers from memory at once and never blocks the control thread. */
#ifndef KVW_CTRL_REGISTRY_H
#define KVW_CTRL_REGISTRY_H

#include "kvwire.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct kvw_registry kvw_registry_t;

/* The environment variable naming the registry ("" or unset: none). */
#define KVW_REGISTRY_ENV "KVW_REGISTRY"

/* The registry named by KVW_REGISTRY: *reg_p NULL (and KVW_OK) when it is
 * unset or empty. "etcd://[user:password@]host:port[,host:port...][/prefix]".
 * KVW_ERR_INVALID for a malformed value, KVW_ERR_UNSUPPORTED on a build
 * without the etcd backend; both logged. Contacts nobody yet. */
kvw_status_t kvw__registry_open_env(kvw_registry_t **reg_p);
kvw_status_t kvw__registry_open(const char *url, kvw_registry_t **reg_p);

/* The registry as logs and reasons name it: the URL without credentials. */
const char *kvw__registry_name(const kvw_registry_t *reg);

/* Prefill: put rank -> endpoint under a lease of about lease_ms and keep
 * it alive from the registry's thread. Blocks at most timeout_ms: no
 * member answering is KVW_ERR_TIMEOUT; a rank another live engine on
 * another host holds is retried until its lease could have run out, then
 * KVW_ERR_EXISTS. Logged. */
kvw_status_t kvw__registry_register(kvw_registry_t *reg, uint32_t rank, const char *endpoint,
                                    uint64_t engine_id, uint32_t lease_ms, uint32_t timeout_ms);

/* Decode: read every registered rank (at most timeout_ms, as above), then
 * follow changes from the registry's thread. */
kvw_status_t kvw__registry_watch(kvw_registry_t *reg, uint32_t timeout_ms);

/* Decode, any thread, never blocks: rank's endpoint as the registry last
 * said it. KVW_OK with the endpoint (a tcp:// endpoint that fits);
 * KVW_ERR_NOT_FOUND when the rank is not registered; KVW_ERR_PROTOCOL when
 * what is registered is not an endpoint we would dial (why says what). */
kvw_status_t kvw__registry_lookup(kvw_registry_t *reg, uint32_t rank, char *endpoint,
                                  size_t endpoint_size, char *why, size_t why_size);

/* Decode: watch events applied so far (tests: a change came by the watch). */
uint64_t kvw__registry_events(kvw_registry_t *reg);

/* Stop the thread; with unregister, a prefill's key is removed at once
 * (its lease revoked, best effort) rather than when the lease runs out.
 * Accepts NULL. */
void kvw__registry_close(kvw_registry_t *reg, bool unregister);

/* The checks a bootstrap answer's endpoint gets (ctl_decode.c), shared:
 * NUL-terminated within KVW_WIRE_ENDPOINT_MAX, printable, tcp://. False
 * with why filled otherwise. */
bool kvw__registry_endpoint_ok(const char *value, size_t len, char *why, size_t why_size);

#endif
