/* SPDX-License-Identifier: Apache-2.0 */
/* A narrow seam into the poller (poller.c). The first three are for tools
 * and tests that drive its real steps synchronously, on one thread,
 * without starting the poller thread: bench/kvw-wrcost.c measures the
 * per-WR cost and the posting rate of exactly the code the poller runs.
 * Production code calls none of them; same thread rules as the poller:
 * one caller at a time per engine. kvw__poller_help is the production way
 * for a caller's thread to run a pass (under the pass lock). */
#ifndef KVW_ENGINE_POLLER_H
#define KVW_ENGINE_POLLER_H

#include "engine/core.h"

/* One pass of the poller's loop: take handed-over requests, post and poll
 * every peer. Returns the work done (WRs built, completions, requests). */
int kvw__poller_run_once(kvw_engine_t *e);
/* The two halves of a pass for one connected prefill peer: build, link and
 * post its requests' writes (returns WRs built), and poll its CQ, retiring
 * what completed (returns completions polled). */
int kvw__poller_post_peer(kvw_engine_t *e, kvw_peer_t *p);
int kvw__poller_poll_peer(kvw_engine_t *e, kvw_peer_t *p);

/* Production: a caller's thread after handing work over (between
 * kvw__wake_defer() and here, without the engine lock) or while polling a
 * request under way: runs one pass itself if the poller sleeps and the
 * pass is free, else wakes the poller if work was handed over. */
void kvw__poller_help(kvw_engine_t *e);

#endif
