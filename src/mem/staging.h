/* SPDX-License-Identifier: Apache-2.0 */
/* Host staging for GPU memory the NIC cannot reach: one pool of pinned
 * host memory, registered once, and copy lanes (a stream of kvwire's own
 * per lane in every CUDA context involved). Copies queued on one lane
 * complete in order; different lanes overlap, which is what lets the
 * engine copy one slice while the NIC writes the previous one. The pool's
 * layout (chunks on prefill, page slots on decode) is the engine's
 * (engine/stager.c); this file only owns memory, registration and copies.
 * Not thread-safe: one thread (the engine's stager) issues copies. */
#ifndef KVW_MEM_STAGING_H
#define KVW_MEM_STAGING_H

#include "mem/mem.h"

enum { KVW_STAGING_MAX_LANES = 4 };

typedef struct kvw_staging {
    kvw_dev_t *dev;
    uint8_t *base; /* pinned, len bytes */
    size_t len;
    struct ibv_mr *mr;
    uint32_t lkey, rkey;
    int lanes, nctx;
    void *ctx[KVW_MEM_MAX_FLUSH];
    void *stream[KVW_MEM_MAX_FLUSH][KVW_STAGING_MAX_LANES];
} kvw_staging_t;

/* Allocate len bytes of pinned host memory through the CUDA seam, register
 * them on dev (for remote writes too when remote_write: decode), and
 * create `lanes` streams in each of the nctx contexts (NULL entries are
 * skipped; with none, one NULL context: the seam's default). dev NULL
 * registers nothing (a copy engine only, for measuring). KVW_OK,
 * KVW_ERR_NO_MEMORY / KVW_ERR_REGISTER / KVW_ERR_UNSUPPORTED (no CUDA),
 * logged with the reason. */
kvw_status_t kvw__staging_create(kvw_dev_t *dev, size_t len, bool remote_write, void *const *ctxs,
                                 int nctx, int lanes, kvw_staging_t **s_p);
/* Waits for nothing: the caller synced its lanes. Accepts NULL. */
void kvw__staging_destroy(kvw_staging_t *s);

/* Queue a copy of len bytes on lane, in ctx's streams (NULL ctx: the
 * first). KVW_OK, or KVW_ERR_TRANSFER with why. */
kvw_status_t kvw__staging_copy(kvw_staging_t *s, int lane, void *ctx, void *dst, const void *src,
                               size_t len, char *why, size_t size);
/* Wait for every copy queued on lane (in all contexts). KVW_OK, or
 * KVW_ERR_TRANSFER with why when one failed. */
kvw_status_t kvw__staging_wait(kvw_staging_t *s, int lane, char *why, size_t size);

#endif
