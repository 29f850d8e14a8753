/* SPDX-License-Identifier: Apache-2.0 */
#include "mem/staging.h"

#include "common/log.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static kvw_status_t create_streams(kvw_staging_t *s, char *why, size_t size)
{
    const kvw_cuda_ops_t *cu = kvw__cuda_ops();
    for (int c = 0; c < s->nctx; c++)
        for (int l = 0; l < s->lanes; l++)
            if (cu->stream_create(s->ctx[c], &s->stream[c][l], why, size))
                return KVW_ERR_UNSUPPORTED;
    return KVW_OK;
}

kvw_status_t kvw__staging_create(kvw_dev_t *dev, size_t len, bool remote_write, void *const *ctxs,
                                 int nctx, int lanes, kvw_staging_t **s_p)
{
    const kvw_cuda_ops_t *cu = kvw__cuda_ops();
    char why[160] = "";
    if (!len || lanes < 1 || lanes > KVW_STAGING_MAX_LANES)
        return KVW_ERR_INVALID;
    if (cu->init(why, sizeof(why))) {
        KVW_ERROR("staging needs the CUDA driver: %s", why);
        return KVW_ERR_UNSUPPORTED;
    }
    kvw_staging_t *s = calloc(1, sizeof(*s));
    if (!s)
        return KVW_ERR_NO_MEMORY;
    s->lanes = lanes;
    s->dev = dev;
    for (int i = 0; i < nctx && s->nctx < KVW_MEM_MAX_FLUSH; i++) {
        bool seen = !ctxs[i];
        for (int j = 0; j < s->nctx && !seen; j++)
            seen = s->ctx[j] == ctxs[i];
        if (!seen)
            s->ctx[s->nctx++] = ctxs[i];
    }
    if (!s->nctx)
        s->nctx = 1; /* ctx[0] NULL: the seam's current context */
    kvw_status_t st = create_streams(s, why, sizeof(why));
    if (st) {
        KVW_ERROR("staging: cannot create a CUDA stream: %s", why);
        goto fail;
    }
    s->base = cu->host_alloc(len, why, sizeof(why));
    if (!s->base) {
        KVW_ERROR("staging: cannot allocate %zu MiB of pinned host memory: %s (lower "
                  "KVW_STAGING_MIB)",
                  len >> 20, why);
        st = KVW_ERR_NO_MEMORY;
        goto fail;
    }
    s->len = len;
    if (!dev) {
        *s_p = s; /* copies only (measuring): nothing registered */
        return KVW_OK;
    }
    int access = IBV_ACCESS_LOCAL_WRITE | (remote_write ? IBV_ACCESS_REMOTE_WRITE : 0);
    s->mr = dev->ops->reg_mr(dev->pd, s->base, len, access);
    if (!s->mr) {
        KVW_ERROR("%s: staging: ibv_reg_mr of %zu MiB of pinned host memory failed: %s (check "
                  "'ulimit -l')",
                  dev->name, len >> 20, strerror(errno));
        st = KVW_ERR_REGISTER;
        goto fail;
    }
    s->lkey = s->mr->lkey;
    s->rkey = s->mr->rkey;
    *s_p = s;
    return KVW_OK;
fail:
    kvw__staging_destroy(s);
    return st;
}

void kvw__staging_destroy(kvw_staging_t *s)
{
    if (!s)
        return;
    const kvw_cuda_ops_t *cu = kvw__cuda_ops();
    if (s->mr)
        s->dev->ops->dereg_mr(s->mr);
    if (s->base)
        cu->host_free(s->base);
    for (int c = 0; c < s->nctx; c++)
        for (int l = 0; l < s->lanes; l++)
            if (s->stream[c][l])
                cu->stream_destroy(s->stream[c][l]);
    free(s);
}

static int ctx_index(const kvw_staging_t *s, void *ctx)
{
    for (int c = 0; c < s->nctx; c++)
        if (s->ctx[c] == ctx)
            return c;
    return 0;
}

kvw_status_t kvw__staging_copy(kvw_staging_t *s, int lane, void *ctx, void *dst, const void *src,
                               size_t len, char *why, size_t size)
{
    void *stream = s->stream[ctx_index(s, ctx)][lane];
    if (kvw__cuda_ops()->copy_async(stream, dst, src, len, why, size))
        return KVW_ERR_TRANSFER;
    return KVW_OK;
}

kvw_status_t kvw__staging_wait(kvw_staging_t *s, int lane, char *why, size_t size)
{
    kvw_status_t st = KVW_OK;
    for (int c = 0; c < s->nctx; c++)
        if (kvw__cuda_ops()->stream_sync(s->stream[c][lane], why, size))
            st = KVW_ERR_TRANSFER; /* still wait for the other contexts' copies */
    return st;
}
