/* SPDX-License-Identifier: Apache-2.0 */
/* The one place memory is registered. Each region takes one path, decided
 * at run time (kvw__mem_decide) apart from the registration that carries it
 * out (kvw__mem_register_in):
 *   HOST     plain ibv_reg_mr (host memory, pinned or not);
 *   DMABUF   GPU memory exported by the CUDA driver as a dma-buf and
 *            registered with ibv_reg_dmabuf_mr;
 *   PEERMEM  GPU memory given to plain ibv_reg_mr, which the nvidia_peermem
 *            kernel module resolves;
 *   STAGING  GPU memory the NIC cannot reach: nothing is registered for
 *            it; the engine copies its pages through a registered pool of
 *            pinned host memory (mem/staging.h, engine/stager.c).
 * GPU regions try them in that order unless config gpu_path forces one.
 * CUDA is reached through a table of driver calls (kvw_cuda_ops_t), loaded
 * with dlopen at run time; tests swap in a fake. */
#ifndef KVW_MEM_MEM_H
#define KVW_MEM_MEM_H

#include "verbs/device.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { KVW_MEM_HOST = 0, KVW_MEM_CUDA = 1 } kvw_mem_kind_t;

typedef enum {
    KVW_MEM_PATH_HOST = 0,
    KVW_MEM_PATH_DMABUF = 1,
    KVW_MEM_PATH_PEERMEM = 2,
    KVW_MEM_PATH_STAGING = 3,
} kvw_mem_path_t;
#define KVW_MEM_NUM_PATHS 4

/* "host", "dmabuf", "peermem", "staging" (the KVW_GPU_PATH spellings). */
const char *kvw__mem_path_name(kvw_mem_path_t path);

/* ---- the CUDA seam (mem/cuda.c) ------------------------------------------ */

typedef enum {
    KVW_CUDA_PTR_HOST = 0, /* unknown to CUDA: ordinary host memory */
    KVW_CUDA_PTR_PINNED,   /* cudaHostAlloc / cudaHostRegister: host memory */
    KVW_CUDA_PTR_DEVICE,   /* cudaMalloc / cuMemAlloc / cuMemCreate + cuMemMap */
    KVW_CUDA_PTR_MANAGED,  /* cudaMallocManaged */
} kvw_cuda_ptr_type_t;

typedef struct kvw_cuda_ptr {
    kvw_cuda_ptr_type_t type;
    int device;       /* ordinal, for DEVICE and MANAGED */
    void *ctx;        /* CUcontext to use for it: the owner's, else the
                       * device's primary context (retained for the process) */
    uint64_t base;    /* the CUDA allocation holding the pointer */
    uint64_t size;    /* (RANGE_START_ADDR / RANGE_SIZE); 0: unknown */
    bool vmm;         /* mapped with cuMemCreate + cuMemMap */
    int rdma_capable; /* -1 unknown, else whether GPUDirect RDMA may use it
                       * (VMM: allocFlags.gpuDirectRDMACapable) */
} kvw_cuda_ptr_t;

typedef struct kvw_cuda_dev {
    char name[96];
    char pci[32]; /* bus id, e.g. "0000:17:00.0" */
    int cc_major, cc_minor;
    /* -1 where the driver is too old to say, else the attribute. */
    int dmabuf;          /* CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (and the
                          * driver exports cuMemGetHandleForAddressRange) */
    int gdr;             /* CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED */
    int vmm_gdr;         /* ..._GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED */
    int writes_ordering; /* ..._GPU_DIRECT_RDMA_WRITES_ORDERING: 0 none,
                          * 100 owner, 200 all devices */
} kvw_cuda_dev_t;

/* Every CUDA driver call kvwire makes. All thread-safe. */
typedef struct kvw_cuda_ops {
    /* Load the driver and cuInit once. 0, or -1 with why ("libcuda.so.1
     * not found", "cuInit: CUDA_ERROR_NO_DEVICE", ...). */
    int (*init)(char *why, size_t size);
    int (*device_count)(void);
    /* 0, or -1 with why. */
    int (*device_info)(int ordinal, kvw_cuda_dev_t *info_p, char *why, size_t size);
    /* Classify addr: 0 (*info_p written; HOST for memory CUDA does not
     * know), -1 when the driver could not say (why). */
    int (*pointer_info)(const void *addr, kvw_cuda_ptr_t *info_p, char *why, size_t size);
    /* dma-buf fd for [start, start + len) (host-page aligned, inside one
     * allocation), exported in ctx. 0, or -1 with why. */
    int (*dmabuf_export)(void *ctx, uint64_t start, size_t len, int *fd_p, char *why, size_t size);
    /* cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER) in ctx: the
     * NIC's writes so far become visible to ctx's kernels. 0 or -1. */
    int (*flush_writes)(void *ctx, char *why, size_t size);
    /* Whether the nvidia_peermem module is loaded (plain ibv_reg_mr on GPU
     * memory works). */
    bool (*peermem_loaded)(void);

    /* Staging (mem/staging.c). Page-locked host memory usable by every
     * context (cuMemHostAlloc, PORTABLE); NULL with why. */
    void *(*host_alloc)(size_t len, char *why, size_t size);
    void (*host_free)(void *p);
    /* A non-blocking stream of kvwire's own in ctx. 0, or -1 with why. */
    int (*stream_create)(void *ctx, void **stream_p, char *why, size_t size);
    void (*stream_destroy)(void *stream);
    /* Queue a copy of len bytes on stream (cuMemcpyAsync: unified
     * addressing tells device from host on either side). 0, or -1 with why. */
    int (*copy_async)(void *stream, void *dst, const void *src, size_t len, char *why, size_t size);
    /* Block until every copy queued on stream so far completed. 0, or -1
     * when one failed (why). */
    int (*stream_sync)(void *stream, char *why, size_t size);

    /* Producer events (kvw_sender_send_part_after): the state of a CUevent
     * the application recorded, without waiting (cuEventQuery). 0: every
     * piece of work it captured completed (or it was never recorded); 1:
     * not yet (CUDA_ERROR_NOT_READY); -1: the query failed, with why
     * naming the CUDA error (an error of the work it waits for, a sticky
     * error of the context, an invalid handle). ctx: a context to make
     * current should the driver want one (NULL: none). Optional: NULL in a
     * table without events. */
    int (*event_query)(void *ctx, void *event, char *why, size_t size);

    /* Head slicing's landing buffer on decode (docs/head-slicing.md).
     * Optional: NULL in a table without them (landing then stays off for
     * GPU regions). Device memory of len bytes in ctx (cuMemAlloc); NULL
     * with why. */
    void *(*dev_alloc)(void *ctx, size_t len, char *why, size_t size);
    void (*dev_free)(void *ctx, void *p);
    /* Queue a 2D copy on stream (cuMemcpy2DAsync): height rows of width
     * bytes, from src at pitch spitch to dst at pitch dpitch. 0, or -1
     * with why. */
    int (*copy_2d_async)(void *stream, void *dst, size_t dpitch, const void *src, size_t spitch,
                         size_t width, size_t height, char *why, size_t size);
} kvw_cuda_ops_t;

/* The table used from now on; NULL restores the real one. Not thread-safe:
 * call before creating engines (like kvw__verbs_set_ops). */
const kvw_cuda_ops_t *kvw__cuda_ops(void);
void kvw__cuda_set_ops(const kvw_cuda_ops_t *ops);
extern const kvw_cuda_ops_t kvw__cuda_real_ops;

/* ---- deciding the path ---------------------------------------------------- */

#define KVW_MEM_REASON_MAX 512

/* What the decision looks at, gathered by kvw__mem_decide (or by a tool
 * describing a hypothetical region, as kvwire-info does). */
typedef struct kvw_mem_facts {
    int force;                  /* -1 auto, else the kvw_mem_path_t forced */
    kvw_cuda_ptr_t ptr;         /* the region's start */
    const kvw_cuda_dev_t *gpu;  /* its GPU; NULL for host memory */
    bool past_allocation;       /* the region runs past its CUDA allocation */
    int nic_dmabuf;             /* -1 unknown, else whether the NIC takes dma-bufs */
    const char *nic_dmabuf_why; /* when 0: the probe's answer */
    bool peermem;               /* nvidia_peermem loaded */
} kvw_mem_facts_t;

/* Pure: the path for these facts, and in reason why it and not a better
 * one, with the fix for each 'no'. */
kvw_mem_path_t kvw__mem_choose(const kvw_mem_facts_t *facts, char *reason, size_t size);

/* One engine's registration state. Filled by kvw__mem_ctx_init and by
 * registrations on the creating thread; read-only once the poller runs. */
#define KVW_MEM_MAX_FLUSH 16
typedef struct kvw_mem_ctx {
    int force;      /* config gpu_path: -1 auto, else kvw_mem_path_t */
    int flush;      /* config gpu_flush */
    int relaxed;    /* config gpu_relaxed_ordering */
    int nic_dmabuf; /* -1 not probed yet, else the probe's verdict */
    char nic_dmabuf_why[96];
    unsigned logged;                    /* bit per path: its choice was logged */
    void *flush_ctx[KVW_MEM_MAX_FLUSH]; /* CUDA contexts decode must flush */
    int nflush;
} kvw_mem_ctx_t;

/* Options from cfg (gpu_path, gpu_flush, gpu_relaxed_ordering; cfg NULL:
 * defaults). KVW_ERR_INVALID for an unknown gpu_path. */
kvw_status_t kvw__mem_ctx_init(kvw_mem_ctx_t *m, const kvw_config_t *cfg);

typedef struct kvw_mem_plan {
    kvw_mem_path_t path;
    kvw_cuda_ptr_t ptr;
    /* DMABUF: the range exported: addr's host page to the page after its
     * end, clamped to the allocation (the rounding must not run past it). */
    uint64_t start;
    size_t len;
    bool flush; /* a decode region: flush before Success */
    char reason[KVW_MEM_REASON_MAX];
} kvw_mem_plan_t;

/* Decide how [addr, addr + len) would be registered on dev (probing the
 * NIC's dma-buf support once per ctx). KVW_OK with *plan_p, or
 * KVW_ERR_INVALID for an empty region. */
kvw_status_t kvw__mem_decide(kvw_mem_ctx_t *m, kvw_dev_t *dev, const void *addr, size_t len,
                             bool remote_write, kvw_mem_plan_t *plan_p);

/* Pure, exposed for tests: the page-aligned range covering [addr, addr +
 * len), clamped to the allocation [base, base + size) when size != 0. */
void kvw__mem_export_range(uint64_t addr, size_t len, uint64_t base, uint64_t size, uint64_t page,
                           uint64_t *start_p, size_t *len_p);

/* ---- registering ---------------------------------------------------------- */

typedef struct kvw_mr {
    struct ibv_mr *mr; /* NULL for STAGING: the engine's staging pool stands in */
    kvw_mem_kind_t kind;
    kvw_mem_path_t path;
    void *cuda_ctx; /* GPU regions: the CUDA context copies and flushes use */
    uint64_t addr;
    size_t len;
    uint32_t lkey, rkey;
} kvw_mr_t;

/* Register [addr, addr+len) for local access, and for remote writes by
 * the peer when remote_write (decode's memory only: prefill's memory is a
 * write source and grants the network nothing). Logs each path's choice
 * once per ctx, with its reason. KVW_ERR_REGISTER when the verbs refuse
 * (the log says why and how to fix it). A STAGING region succeeds with no
 * ibv_mr (mr NULL, keys 0): the engine copies it through its staging pool.
 * Not thread-safe with other calls on the same ctx. */
kvw_status_t kvw__mem_register_in(kvw_mem_ctx_t *m, kvw_dev_t *dev, void *addr, size_t len,
                                  bool remote_write, kvw_mr_t *mr_p);
/* Register the region on each of n devices (an engine's rails: every
 * device has its own PD, so its own keys): mrs_p[k] for devs[k]. A region
 * that takes the staging path is refused on several rails
 * (KVW_ERR_UNSUPPORTED: the staging pool lives on one device). On failure
 * nothing stays registered. */
kvw_status_t kvw__mem_register_rails(kvw_mem_ctx_t *m, kvw_dev_t *const *devs, uint32_t n,
                                     void *addr, size_t len, bool remote_write, kvw_mr_t *mrs_p);
/* The same with default options (gpu_path auto) and a ctx of its own. */
kvw_status_t kvw__mem_register(kvw_dev_t *dev, void *addr, size_t len, bool remote_write,
                               kvw_mr_t *mr_p);
/* Accepts a zeroed (never registered) mr. */
void kvw__mem_deregister(kvw_dev_t *dev, kvw_mr_t *mr);

/* Whether decode must call kvw__mem_flush_gpu_writes before Success. */
static inline bool kvw__mem_needs_flush(const kvw_mem_ctx_t *m)
{
    return m->nflush > 0;
}

/* Make every NIC write that completed so far visible to the GPUs holding
 * ctx's decode regions (cuFlushGPUDirectRDMAWrites on each, in its
 * context). Call after the completion that ends a transfer and before
 * reporting Success. No-op (KVW_OK) when nothing needs it. KVW_ERR_TRANSFER
 * (logged) when the driver refuses. Callable from any one thread at a
 * time once registration is over; it switches that thread's current CUDA
 * context and restores it. */
kvw_status_t kvw__mem_flush_gpu_writes(const kvw_mem_ctx_t *m);

#endif
