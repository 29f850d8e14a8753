/* SPDX-License-Identifier: Apache-2.0 */
/* A fake CUDA driver behind kvwire's CUDA seam (kvw__cuda_set_ops), for
 * the staging tests on the fake NIC and on real rxe: "device memory" is
 * host memory that pointer_info reports as a cudaMalloc allocation on a
 * GPU without GPUDirect RDMA (so kvwire must stage it), pinned memory is
 * aligned_alloc, and every stream is a worker thread copying with memcpy,
 * in order, so copies really run asynchronously to the caller. Faults: a
 * copy that fails, copies that take time, copies into the GPU held at a
 * gate for as long as a test likes. Events stand for the application's
 * CUDA events (kvw_sender_send_part_after): each completes when the test
 * says, or at a time it set, or fails with the CUDA error it chose. With
 * gdr set the GPU has GPUDirect RDMA and exports dma-bufs (an eventfd,
 * which the fake NIC takes as the memory at its iova), so its memory is
 * registered directly instead of staged. Never reported as a GPU.
 * For the memory-path tests (test_mem), what the GPU and its allocations
 * report can be changed piece by piece (fake_cuda_facts), and the exports
 * and flushes kvwire asked for are counted (fake_cuda_stats). */
#ifndef KVW_TEST_FAKE_CUDA_H
#define KVW_TEST_FAKE_CUDA_H

#include "mem/mem.h"

#include <stddef.h>
#include <stdint.h>

extern const kvw_cuda_ops_t fake_cuda_ops;

typedef struct fake_cuda_config {
    int gdr;                /* what the GPU reports for GPUDirect RDMA (0: staging) */
    unsigned copy_delay_us; /* each copy takes at least this long */
    long fail_host_alloc;   /* nonzero: pinned allocations fail */
} fake_cuda_config_t;

/* Reset state and counters; install with kvw__cuda_set_ops(&fake_cuda_ops). */
void fake_cuda_init(const fake_cuda_config_t *cfg);
/* The next copy out of (to_gpu false) or into (true) fake GPU memory
 * fails: its stream's sync reports an error. */
void fake_cuda_fail_next(bool to_gpu);
/* Closed: a copy into fake GPU memory waits, at the head of its stream,
 * until the gate opens (a GPU busy for as long as the test wants), so a
 * test can act while decode's copy from the staging pool is under way.
 * fake_cuda_stats().gated counts the copies waiting now. fake_cuda_init
 * opens it; open it before destroying an engine that copies. */
void fake_cuda_gate_to_gpu(bool closed);
/* len bytes of "GPU memory" (zeroed); freed by fake_cuda_free. */
void *fake_cuda_alloc(size_t len);
void fake_cuda_free(void *p);
/* pointer_info reports size as p's allocation size (RANGE_SIZE) from now
 * on, instead of its length; addresses up to its length still belong to
 * it. For a region that runs past the end of its CUDA allocation. */
void fake_cuda_set_alloc_size(void *p, uint64_t size);
/* The one fake CUDA context: pointer_info's ctx for fake GPU memory. */
void *fake_cuda_ctx(void);

/* What the fake GPU and its memory report. fake_cuda_init sets the
 * defaults below from its config; a test may change any field between
 * calls into kvwire, while no other thread of the test is using the fake
 * (it writes them without the lock the fake reads them under). */
typedef struct fake_cuda_facts {
    kvw_cuda_dev_t dev;       /* device_info of GPU 0; dmabuf, gdr and vmm_gdr are
                               * config.gdr, cc_major 9, writes_ordering 100 (owner) */
    kvw_cuda_ptr_type_t type; /* what fake GPU memory is: KVW_CUDA_PTR_DEVICE */
    bool vmm;                 /* it is a VMM mapping: false */
    int rdma_capable;         /* its gpuDirectRDMACapable flag: -1 (unknown) */
    bool query_fails;         /* pointer_info fails (CUDA could not classify): false */
    bool peermem;             /* nvidia_peermem is loaded: false */
} fake_cuda_facts_t;
fake_cuda_facts_t *fake_cuda_facts(void);

typedef struct fake_cuda_stats {
    long copies, failed_copies;
    uint64_t bytes_copied;
    long max_pending; /* most copies queued on all streams at once */
    long live_streams, live_host_allocs;
    uint64_t host_bytes; /* pinned bytes allocated in all */
    long copies_from_gpu, copies_to_gpu;
    long gated;                       /* copies into the GPU waiting at the closed gate now */
    long pending;                     /* copies queued or running on all streams now */
    long event_queries, event_misuse; /* all events; queries of destroyed ones */
    long exports;                     /* dma-buf exports asked for (granted or not) */
    uint64_t export_start;            /* the last one's range */
    size_t export_len;
    long flushes;         /* flush_writes calls */
    long copies_2d;       /* copy_2d_async calls (also counted in copies) */
    uint64_t rows_2d;     /* their rows */
    long live_dev_allocs; /* dev_alloc not yet freed */
    void *flushed_ctx;    /* the last one's context */
} fake_cuda_stats_t;
void fake_cuda_stats(fake_cuda_stats_t *st);

/* ---- events: a CUevent as kvwire sees it (pass the pointer as the event) */

/* A recorded event whose work has not completed: its queries say
 * CUDA_ERROR_NOT_READY until one of the calls below. Freed by the next
 * fake_cuda_init. */
void *fake_cuda_event_create(void);
/* It completes now. */
void fake_cuda_event_complete(void *ev);
/* It completes ms milliseconds from now (CLOCK_MONOTONIC). */
void fake_cuda_event_complete_in(void *ev, unsigned ms);
/* Its queries fail with this CUDA error from now on (e.g. 719,
 * CUDA_ERROR_LAUNCH_FAILED: the producing kernel faulted). */
void fake_cuda_event_fail(void *ev, int cuda_error);
/* The application destroyed it: a query from now on is counted as misuse
 * (fake_cuda_stats().event_misuse) and fails with
 * CUDA_ERROR_INVALID_HANDLE. */
void fake_cuda_event_destroy(void *ev);
/* Whether a query now would say it completed, and when it did (or will:
 * CLOCK_MONOTONIC ns; 0 while no completion is set). Not counted as
 * queries. */
bool fake_cuda_event_done(void *ev);
uint64_t fake_cuda_event_done_ns(void *ev);
/* Queries kvwire made of it. */
long fake_cuda_event_queries(void *ev);

#endif
