/* A narrow seam into the poller (poller.c) for tools and tests that drive
 * its real steps synchronously, on one thread, without starting the poller
 * thread: tools/kvw-wrcost.c measures the per-WR cost and the posting rate
 * of exactly the code the poller runs. Production code calls none of these:
 * the poller thread (kvw__poller_main) is their only caller there. Same
 * thread rules as the poller: one caller at a time per engine. */
#ifndef KVW_ENGINE_POLLER_H
#define KVW_ENGINE_POLLER_H

#include "engine/engine.h"

/* One pass of the poller's loop: take handed-over requests, post and poll
 * every peer. Returns the work done (WRs built, completions, requests). */
int kvw__poller_run_once(kvw_engine_t *e);
/* The two halves of a pass for one connected prefill peer: build, link and
 * post its requests' writes (returns WRs built), and poll its CQ, retiring
 * what completed (returns completions polled). */
int kvw__poller_post_peer(kvw_engine_t *e, kvw_peer_t *p);
int kvw__poller_poll_peer(kvw_engine_t *e, kvw_peer_t *p);

#endif
