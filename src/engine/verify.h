/* SPDX-License-Identifier: Apache-2.0 */
/* Verified transfers (config verify; docs/failure-semantics.md, "Verified
 * transfers"): an end-to-end check of a request's bytes.
 *
 * The digest. Every item a request writes (one page of one KV region, one
 * state item of a state region, the aux item of an aux region) is keyed by
 * its region's index in the layout and its index in decode's index space
 * (the index decode's REQUEST named: a page, a state index, the aux index,
 * or the staging slot standing in for one). Its share is the CRC32C of the
 * 12-byte key (region as 4 bytes, index as 8, little-endian) followed by
 * the item's bytes; the digest is the sum of the shares modulo 2^64. Both
 * sides compute it from what each knows, in any order: prefill per part as
 * it posts it (from its source items, or the staging chunk that holds
 * them), decode over the items of its REQUEST once every write landed. It
 * is the same for every attempt (a replay writes the same bytes).
 *
 * Threads: prefill's parts are summed by the thread that first posts them
 * (the poller); the DIGEST goes out from the control thread once the
 * request succeeded (ctl_prefill.c). Decode's digest is computed by the
 * poller (host memory) or the stager (staged), outside the lock; the
 * comparison is made under the lock by whichever of them, the control
 * thread (prefill's DIGEST) or the caller (kvw_receiver_verify) brings the
 * last of the three pieces. */
#ifndef KVW_ENGINE_VERIFY_H
#define KVW_ENGINE_VERIFY_H

#include "engine/core.h"

enum {
    KVW_VERIFY_OFF = 0,
    KVW_VERIFY_KVWIRE = 1, /* host memory or staged: kvwire reads the items */
    KVW_VERIFY_CALLER = 2, /* GPU memory the NIC reaches directly: the caller's digests */
};

/* The engine's mode, once its regions are registered. */
uint8_t kvw__verify_mode(const kvw_engine_t *e);
/* One item's share of a digest (see above). */
uint64_t kvw__verify_item(uint32_t region, uint64_t index, const void *addr, uint64_t len);

/* Prefill. (lock) Decode's REQUEST m for r on p: whether it asks for the
 * check, which both sides must agree on; KVW_ERR_MISMATCH or
 * KVW_ERR_UNSUPPORTED (head slicing) with why, else KVW_OK and r's verify
 * fields set. */
kvw_status_t kvw__verify_accept_locked(kvw_req_t *r, const kvw_peer_t *p, const kvw_msg_t *m,
                                       char *why, size_t size);
/* The thread posting s first (its producer's event completed, its chunk
 * filled): add its source items to r's digest. */
void kvw__verify_seg(kvw_req_t *r, kvw_seg_t *s);
/* (lock) r succeeded and its DIGEST can go now: the caller's digest, when
 * it is the caller's, was given. */
bool kvw__verify_sendable_locked(const kvw_req_t *r);

/* (lock) r succeeded and its DIGEST is still to go (now, or once the
 * caller's digest is given): a destroyed sender is kept until it went. */
bool kvw__verify_owed_locked(const kvw_req_t *r);

/* Decode. The digest of the items r's REQUEST named, as they are now in
 * its pages (or staging slots). Runs the test hook first. No lock. */
uint64_t kvw__verify_landed(kvw_engine_t *e, const kvw_req_t *r);
/* (lock) Every write of r landed; with decode's digest of them when
 * have_local (kvwire's, or the caller's). Ends r if the other pieces are
 * in. */
void kvw__verify_landed_locked(kvw_req_t *r, bool have_local, uint64_t local);
/* (lock) Prefill's DIGEST for r (first one counts). Ends r if the other
 * pieces are in. */
void kvw__verify_remote_locked(kvw_req_t *r, uint64_t remote);
/* Poller, no lock: compute r's digest (kvwire's mode), then settle it;
 * drops the reference the caller took. */
void kvw__verify_check_landed(kvw_engine_t *e, kvw_req_t *r);

/* Tests: called with the room just before decode computes the digest of
 * what landed (to change a byte of it). NULL: none. */
extern void (*_Atomic kvw__verify_hook)(uint64_t room);

#endif
