/* SPDX-License-Identifier: Apache-2.0 */
/* Decode's landing buffer: head slicing's path (b) (docs/head-slicing.md).
 * When decode holds more heads than a prefill rank sends it (decode TP <
 * prefill TP), that rank's slice of each token row (NHD) or page (HND) is
 * strided in decode's region, and RDMA writes land on contiguous bytes
 * only: written into the rows directly, it costs a write per row (path
 * (a)). Instead the rank writes its heads contiguously into a slice of
 * this buffer, as many writes as equal TP, and once its immediates all
 * arrived decode copies them into the rows: a 2D copy (width the slice,
 * pitch the slice on one side and the row on the other) per KV slot and
 * run of contiguous pages, by host rows or cuMemcpy2DAsync for GPU
 * regions. The buffer is registered once, through the memory seam, in the
 * memory the KV regions live in. Reservations are first fit over chunks,
 * one per member at REQUEST time (never per block), released when the
 * member ends: Success after the copy, Failed only once nothing more can
 * land (the abort barrier). */
#include "engine/core.h"

#include "common/log.h"
#include "plan/heads.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LANDING_CHUNK = 4096 }; /* reservation granularity */

typedef struct kvw_landing {
    uint8_t *base; /* host memory, or GPU memory (gpu) */
    size_t len;
    kvw_mr_t mr;
    bool gpu;
    void *cuda_ctx, *stream; /* gpu: the KV regions' context, a stream of ours */
    uint8_t *used;           /* (lock) chunk map: 1 reserved */
    size_t nchunks;
    uint64_t reserved; /* (lock) bytes */
    bool full_logged;  /* (lock) */
    _Atomic uint64_t scatters, copies;
} kvw_landing_t;

/* The KV regions' memory: the first KV region's (an engine's KV regions
 * live on one GPU, or in host memory). */
static const kvw_mr_t *kv_mr(const kvw_engine_t *e)
{
    return &e->mrs[e->layout.kv_slots[0]];
}

static void landing_free(kvw_engine_t *e, kvw_landing_t *b)
{
    kvw__mem_deregister(e->dev, &b->mr);
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    if (b->stream)
        cuda->stream_destroy(b->stream);
    if (b->gpu && b->base)
        cuda->dev_free(b->cuda_ctx, b->base);
    else
        free(b->base);
    free(b->used);
    free(b);
}

/* GPU memory in the KV regions' context, with a stream for the copies;
 * false (logged) when the CUDA seam lacks what it takes. */
static bool gpu_alloc(kvw_landing_t *b)
{
    const kvw_cuda_ops_t *cuda = kvw__cuda_ops();
    char why[200] = "the CUDA seam has no device allocation or 2D copy";
    if (cuda->dev_alloc && cuda->dev_free && cuda->copy_2d_async &&
        !cuda->stream_create(b->cuda_ctx, &b->stream, why, sizeof(why)) &&
        (b->base = cuda->dev_alloc(b->cuda_ctx, b->len, why, sizeof(why))))
        return true;
    KVW_WARN("landing buffer: %s; decode over several prefill ranks writes a row at a time", why);
    return false;
}

kvw_status_t kvw__landing_create(kvw_engine_t *e)
{
    if (e->role != KVW_ROLE_DECODE || !e->layout_heads || !e->cfg.landing_mib)
        return KVW_OK;
    const kvw_mr_t *kv = kv_mr(e);
    if (kv->path == KVW_MEM_PATH_STAGING)
        return KVW_OK; /* a receiver over several ranks refuses staged engines anyway */
    if (e->nrails > 1) {
        /* Prefill writes into it with the rkey of the rail each lane is
         * on, and the buffer advertises one: on several rails, path (a). */
        KVW_INFO("landing buffer: none on an engine of %u rails; decode over several prefill "
                 "ranks writes a row at a time",
                 e->nrails);
        return KVW_OK;
    }
    kvw_landing_t *b = calloc(1, sizeof(*b));
    if (!b)
        return KVW_ERR_NO_MEMORY;
    b->len = (size_t)e->cfg.landing_mib << 20;
    b->nchunks = b->len / LANDING_CHUNK;
    b->used = calloc(b->nchunks, 1);
    b->gpu = kv->kind == KVW_MEM_CUDA;
    b->cuda_ctx = kv->cuda_ctx;
    bool ok = b->used && (b->gpu ? gpu_alloc(b) : (b->base = aligned_alloc(4096, b->len)) != NULL);
    /* Registered like the KV regions, through the same seam (a GPU buffer
     * takes the path they took, the decision logged). */
    if (ok && (kvw__mem_register_in(&e->mem, e->dev, b->base, b->len, true, &b->mr) || !b->mr.mr)) {
        KVW_WARN("landing buffer: %zu MiB could not be registered; decode over several prefill "
                 "ranks writes a row at a time",
                 b->len >> 20);
        ok = false;
    }
    if (!ok) {
        landing_free(e, b);
        return KVW_OK; /* path (a) for every request: slower, not wrong */
    }
    KVW_INFO("landing buffer: %zu MiB of %s memory for head slicing over several prefill ranks",
             b->len >> 20, b->gpu ? "GPU" : "host");
    e->landing = b;
    return KVW_OK;
}

void kvw__landing_destroy(kvw_engine_t *e)
{
    if (e->landing)
        landing_free(e, e->landing);
    e->landing = NULL;
}

void kvw__landing_advertise(const kvw_engine_t *e, kvw_msg_t *m)
{
    const kvw_landing_t *b = e->landing;
    if (!b)
        return;
    m->u.hello.landing_addr = b->mr.addr;
    m->u.hello.landing_len = b->mr.len;
    m->u.hello.landing_rkey = b->mr.rkey;
}

/* First fit: the first run of n free chunks, or nchunks. */
static size_t first_fit(const kvw_landing_t *b, size_t n)
{
    for (size_t i = 0, run = 0; i < b->nchunks; i++) {
        run = b->used[i] ? 0 : run + 1;
        if (run == n)
            return i + 1 - n;
    }
    return b->nchunks;
}

bool kvw__landing_reserve_locked(kvw_engine_t *e, kvw_req_t *r, uint64_t bytes)
{
    kvw_landing_t *b = e->landing;
    if (!b || !bytes)
        return false;
    uint64_t n = (bytes + LANDING_CHUNK - 1) / LANDING_CHUNK;
    size_t at = n <= b->nchunks ? first_fit(b, (size_t)n) : b->nchunks;
    if (at == b->nchunks) {
        if (!b->full_logged)
            KVW_INFO("room %llu: the landing buffer (KVW_LANDING_MIB=%u) has no room for %llu "
                     "bytes; such requests write a row at a time (logged once)",
                     (unsigned long long)r->room, e->cfg.landing_mib, (unsigned long long)bytes);
        b->full_logged = true;
        return false;
    }
    memset(b->used + at, 1, (size_t)n);
    b->reserved += n * LANDING_CHUNK;
    r->rx.land_off = (uint64_t)at * LANDING_CHUNK;
    r->rx.land_len = bytes;
    return true;
}

void kvw__landing_release_locked(kvw_engine_t *e, kvw_req_t *r)
{
    kvw_landing_t *b = e->landing;
    if (!b || !r->rx.land_len)
        return;
    uint64_t n = (r->rx.land_len + LANDING_CHUNK - 1) / LANDING_CHUNK;
    memset(b->used + r->rx.land_off / LANDING_CHUNK, 0, (size_t)n);
    b->reserved -= n * LANDING_CHUNK;
    r->rx.land_len = 0;
}

/* Our KV slot j's heads (every KV group describes the same, rxset.c). */
static const kvw_heads_t *slot_heads(const kvw_layout_t *l, uint32_t j)
{
    uint32_t r = l->kv_slots[j], g = 0;
    while (g + 1 < l->num_groups && r >= l->groups[g + 1].first)
        g++;
    return &l->groups[g].heads;
}

/* One 2D copy: rows of g->slice bytes from src (pitch slice) to dst (pitch
 * the row). */
static int copy_2d(kvw_landing_t *b, uint8_t *dst, const uint8_t *src, const kvw_heads_geom_t *g,
                   uint64_t rows, char *why, size_t size)
{
    atomic_fetch_add(&b->copies, 1);
    if (b->gpu)
        return kvw__cuda_ops()->copy_2d_async(b->stream, dst, g->dst_stride, src, g->slice,
                                              g->slice, rows, why, size);
    for (uint64_t y = 0; y < rows; y++)
        memcpy(dst + y * g->dst_stride, src + y * g->slice, g->slice);
    return 0;
}

kvw_status_t kvw__landing_scatter(kvw_engine_t *e, const kvw_req_t *r, char *why, size_t size)
{
    kvw_landing_t *b = e->landing;
    const kvw_layout_t *l = &e->layout;
    const uint64_t *pages = r->rx.pages;
    const uint8_t *src = b->base + r->rx.land_off;
    int rc = 0;
    for (uint32_t i = 0; !rc && i < l->kv_layers * l->kv_per_layer; i++) {
        const kvw_heads_t *h = slot_heads(l, i % l->kv_per_layer);
        kvw_heads_geom_t g;
        if (kvw__heads_geom(h, h, r->rx.heads, &g, why, size))
            return KVW_ERR_TRANSFER;
        uint8_t *region = (uint8_t *)e->regions[l->kv_slots[i]].addr;
        /* Runs of contiguous pages: their rows are one pitch apart. */
        for (size_t k = 0; !rc && k < r->rx.npages;) {
            size_t run = 1;
            while (k + run < r->rx.npages && pages[k + run] == pages[k] + run)
                run++;
            uint8_t *dst = region + pages[k] * g.units_per_page * g.dst_stride + g.dst_off;
            rc = copy_2d(b, dst, src + k * g.units_per_page * g.slice, &g, run * g.units_per_page,
                         why, size);
            k += run;
        }
        src += r->rx.npages * g.units_per_page * g.slice;
    }
    if (!rc && b->gpu)
        rc = kvw__cuda_ops()->stream_sync(b->stream, why, size);
    if (!rc)
        atomic_fetch_add(&b->scatters, 1);
    return rc ? KVW_ERR_TRANSFER : KVW_OK;
}

void kvw__landing_stats(kvw_engine_t *e, kvw_landing_stats_t *out)
{
    kvw_landing_t *b = e->landing;
    memset(out, 0, sizeof(*out));
    if (!b)
        return;
    pthread_mutex_lock(&e->lock);
    *out = (kvw_landing_stats_t){b->len, b->reserved, atomic_load(&b->scatters),
                                 atomic_load(&b->copies), b->gpu};
    pthread_mutex_unlock(&e->lock);
}

void kvw__landing_finish(kvw_engine_t *e, kvw_req_t *r)
{
    char why[200] = "";
    kvw_status_t st = kvw__landing_scatter(e, r, why, sizeof(why));
    pthread_mutex_lock(&e->lock);
    r->stage.staging_in = false;
    if (st)
        kvw__req_fail(r, KVW_ERR_TRANSFER,
                      "the data landed but copying it from the landing buffer failed: %s", why);
    else if (r->rx.aborting)
        kvw__req_fail(r, r->rx.abort_status, "%s", r->rx.abort_reason);
    else
        kvw__req_succeed(r);
    kvw__landing_release_locked(e, r);
    pthread_mutex_unlock(&e->lock);
    kvw__req_unref(r);
}
